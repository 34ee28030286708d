"""Tests of the scripts in ``scripts/``; ``load_compat_harness`` is shared with the verl command-line suite
and with ``scripts/verl_plan_check.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
COMPAT_HARNESS = SCRIPTS / "verl_compat_check.py"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as a module (a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def load_compat_harness() -> ModuleType:
    return load_script("verl_compat_check")
