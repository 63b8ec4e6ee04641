"""The layers import only downwards, checked on the source with ``ast`` (nothing is imported), and no
package holds more modules than a newcomer surveys at a glance (``MAX_MODULES``).

    protocol/      pure: data in, data or bytes out; no sockets, no processes
    swarm/         the DHT node, the DHT records, the console: shared by peers and the coordinator
    peer/          a peer (``python -m peer``)            coordinator/   a coordinator (``python -m coordinator``)
    voloco/        the layer that knows both: the ``voloco`` command and the demo

Every import counts, also one inside a function (the lazy imports of the command lines).

One exception, by design: the coordinator trains a run's BPE tokenizer on the corpus exactly as
peers read it, so it may use the peer's data modules (``ALLOWED``), and nothing else of the peer.

Inside peer/, the sub-packages have levels too (``PEER_LEVELS``): the exchange moves bytes and knows
nothing of training; training, the outer step, chain stages and checkpoints use the exchange and one
another; the round uses all of those; the host (the process) uses everything. A sub-package imports
only its own level and the levels below.
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
    "coordinator": {"peer.training.data", "peer.training.data_formats", "peer.training.tokenizer"},
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


PEER_LEVELS: Dict[str, int] = {
    "exchange": 0,
    "training": 1, "outer": 1, "chain": 1, "checkpoints": 1,
    "round": 2,
    "host": 3,
}


def peer_violations(root: Path = ROOT) -> List[str]:
    """Imports of a peer sub-package from one of a higher level (``PEER_LEVELS``)."""
    found = []
    for sub, level in sorted(PEER_LEVELS.items()):
        for path in sorted((root / "peer" / sub).rglob("*.py")):
            for module in sorted(imported_modules(path, root)):
                parts = module.split(".")
                if parts[0] == "peer" and len(parts) > 1 and PEER_LEVELS.get(parts[1], -1) > level:
                    found.append(f"{path.relative_to(root).as_posix()} imports {module}")
    return found


def test_peer_sub_packages_import_only_their_level_and_below():
    assert sorted(p.name for p in (ROOT / "peer").iterdir() if (p / "__init__.py").is_file()) == sorted(PEER_LEVELS)
    assert peer_violations() == []


def test_the_peer_levels_check_sees_an_upward_import(tmp_path):
    for sub in PEER_LEVELS:
        (tmp_path / "peer" / sub).mkdir(parents=True)
        (tmp_path / "peer" / sub / "__init__.py").write_text("")
    (tmp_path / "peer" / "exchange" / "a.py").write_text("from peer.round import loop\n")
    (tmp_path / "peer" / "round" / "b.py").write_text("from ..training import model\n")
    assert peer_violations(tmp_path) == ["peer/exchange/a.py imports peer.round", "peer/exchange/a.py imports peer.round.loop"]


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


MAX_MODULES = 15  # a folder a newcomer surveys at a glance; more, and it wants sub-packages by concern


def crowded_packages(root: Path = ROOT) -> List[str]:
    """Packages of the product (every layer above, and their sub-packages) with more than
    ``MAX_MODULES`` modules besides their ``__init__``, with their count."""
    found = []
    for package in sorted(set(FORBIDDEN) | {"voloco"}):
        for init in sorted((root / package).rglob("__init__.py")):
            modules = [p for p in init.parent.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > MAX_MODULES:
                found.append(f"{init.parent.relative_to(root).as_posix()}: {len(modules)} modules")
    return found


def test_no_package_holds_more_modules_than_a_newcomer_surveys(tmp_path):
    assert crowded_packages() == []
    (tmp_path / "swarm").mkdir()
    (tmp_path / "swarm" / "__init__.py").write_text("")
    for i in range(MAX_MODULES + 1):
        (tmp_path / "swarm" / f"m{i}.py").write_text("")
    assert crowded_packages(tmp_path) == [f"swarm: {MAX_MODULES + 1} modules"]
