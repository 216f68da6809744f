"""Tests of the scripts under ``bench/`` on the CPU (their GPU parts need a GPU machine)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

#: The scripts' folder: they import each other by their file names.
BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as the module ``name`` (once: later calls get the same module)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
