"""Tests of the scripts in ``scripts/``; ``load_compat_harness`` is shared with the verl command-line suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

COMPAT_HARNESS = Path(__file__).resolve().parents[2] / "scripts" / "verl_compat_check.py"


def load_compat_harness() -> ModuleType:
    """``scripts/verl_compat_check.py`` as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("verl_compat_check", COMPAT_HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module
