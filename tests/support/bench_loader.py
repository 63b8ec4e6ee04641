"""Load a script of bench/ as a module for its tests (bench/ is not a package, and some of its
names, bench/tokenizers.py say, must not shadow installed packages on sys.path)."""

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/NAME.py, imported as ``bench_NAME``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
