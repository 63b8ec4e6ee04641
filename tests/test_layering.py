"""The layers import only downwards, checked on the source with ``ast`` (nothing is imported).

    protocol/      pure: data in, data or bytes out; no sockets, no processes
    swarm/         the DHT node, the DHT records, the console: shared by peers and the coordinator
    peer/          a peer (``python -m peer``)            coordinator/   a coordinator (``python -m coordinator``)
    voloco/        the layer that knows both: the ``voloco`` command and the demo

Every import counts, also one inside a function (the lazy imports of the command lines).

One exception, by design: the coordinator trains a run's BPE tokenizer on the corpus exactly as
peers read it, so it may use the peer's data modules (``ALLOWED``), and nothing else of the peer.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN: Dict[str, Set[str]] = {
    "protocol": {"peer", "coordinator", "swarm", "voloco", "hivemind", "socket", "asyncio", "subprocess", "multiprocessing"},
    "swarm": {"peer", "coordinator", "voloco"},
    "peer": {"coordinator", "voloco"},
    "coordinator": {"peer", "voloco"},
}


ALLOWED: Dict[str, Set[str]] = {
    "coordinator": {"peer.data", "peer.data_formats", "peer.tokenizer"},
}


def imported_modules(path: Path, root: Path) -> Set[str]:
    """Every module ``path`` imports, as absolute names; relative imports are resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(root).parent.parts)  # the package this module (or __init__) is in
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)  # `from peer import chain`
    return out


def violations(package: str, root: Path = ROOT) -> List[str]:
    forbidden = FORBIDDEN[package]
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for module in sorted(imported_modules(path, root)):
            allowed = ALLOWED.get(package, set())
            if module.split(".")[0] in forbidden and not any(module == a or module.startswith(a + ".") for a in allowed):
                found.append(f"{path.relative_to(root).as_posix()} imports {module}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports_only_downwards(package):
    assert (ROOT / package / "__init__.py").is_file(), package
    assert violations(package) == []


def test_the_check_sees_every_kind_of_import(tmp_path):
    """The checker itself: plain, from-, relative and function-local imports are all seen."""
    (tmp_path / "peer" / "sub").mkdir(parents=True)
    (tmp_path / "peer" / "__init__.py").write_text("from . import sub\n")
    (tmp_path / "peer" / "sub" / "__init__.py").write_text("")
    (tmp_path / "peer" / "sub" / "a.py").write_text(
        "import os, coordinator.server\n"
        "from voloco import demo\n"
        "from .. import chain\n"
        "def f():\n"
        "    from coordinator.cli import main\n"
    )
    assert violations("peer", tmp_path) == [
        "peer/sub/a.py imports coordinator.cli",
        "peer/sub/a.py imports coordinator.cli.main",
        "peer/sub/a.py imports coordinator.server",
        "peer/sub/a.py imports voloco",
        "peer/sub/a.py imports voloco.demo",
    ]
    assert "peer.chain" in imported_modules(tmp_path / "peer" / "sub" / "a.py", tmp_path)
    assert "peer.sub" in imported_modules(tmp_path / "peer" / "__init__.py", tmp_path)
