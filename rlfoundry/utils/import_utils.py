"""A user's object by file and name, as verl's ``load_extern_object`` finds it: ``path`` is a Python
file (absolute, or relative to the working directory) or ``pkg://package.module``.

Used for ``data.custom_cls.{path,name}`` and ``data.sampler.{class_path,class_name}``. Errors name
the config key that pointed there, so a start-up failure says what to fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["ExternObjectError", "load_extern_object", "module_from_file"]


class ExternObjectError(ValueError):
    """A configured file, module or name does not exist or does not import."""


def module_from_file(path: Path, key: str, prefix: str = "rlfoundry_extern_") -> Any:
    """The Python file ``path`` as a module, imported once per file (a name from its path, so two
    files never clobber each other and a class keeps its identity); ``key`` names it in errors."""
    name = prefix + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ExternObjectError(f"{key}={path} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ExternObjectError(f"{key}={path}: importing it failed: {type(err).__name__}: {err}") from err
    return module


def load_extern_object(path: str, name: str | None, key: str, name_key: str) -> Any:
    """``name`` from the file or module ``path``; ``key`` / ``name_key`` are the config keys that hold them."""
    if not name:
        raise ExternObjectError(f"{key}={path} is set but {name_key} is not: name the class in that file.")
    if str(path).startswith("pkg://"):
        try:
            module = importlib.import_module(str(path)[len("pkg://"):])
        except ImportError as err:
            raise ExternObjectError(f"{key}={path}: cannot import {str(path)[len('pkg://'):]!r} ({err})") from err
    else:
        file = Path(str(path)).expanduser().resolve()
        if not file.is_file():
            raise ExternObjectError(f"{key}={path} does not exist; point it at the Python file that defines {name}.")
        module = module_from_file(file, key)
    if not hasattr(module, name):
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_"))
        raise ExternObjectError(f"{path} has no {name!r} ({name_key}); its classes are {found}.")
    return getattr(module, name)
