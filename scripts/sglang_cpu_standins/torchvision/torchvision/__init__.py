"""Import-only stand-in for ``torchvision``, installed by ``scripts/setup_sglang_cpu.sh``.

Why it exists: SGLang imports torchvision at module level in its vision-model configs and
multimodal processors (first ``sglang/srt/multimodal/internvl_utils.py``), which the text-only
``sglang.Engine`` pulls in at start-up. PyPI's torchvision wheels are built against the CUDA torch of
the same release: against the CPU torch 2.13 wheel their C++ ops fail to register (``operator
torchvision::nms does not exist``), which breaks the import anyway. The text path never calls
torchvision, so this package only has to import: ``torchvision``, any ``torchvision.<sub.module>`` and
any attribute of them resolve to placeholders, and *calling* a placeholder (or instantiating a class
derived from one) raises a ``RuntimeError`` naming this stand-in. Note that ``transformers`` then
reports torchvision as available (it checks ``find_spec``); its text models never touch it.
Distributed as ``rlfoundry-standin-torchvision`` so pip never reports a real torchvision as installed;
``pip uninstall rlfoundry-standin-torchvision`` before installing a real one for vision models.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+rlfoundry.standin"
STANDIN = True

_MESSAGE = (
    "rlfoundry's torchvision stand-in (scripts/sglang_cpu_standins/torchvision, installed by "
    "scripts/setup_sglang_cpu.sh for SGLang on CPU) was called: {name}. It only satisfies imports "
    "on SGLang's text-only path; install a torchvision that matches your torch to use vision models."
)


class _Placeholder:
    """Stands for any torchvision object: attribute access gives more placeholders, calls raise."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(_MESSAGE.format(name=self._name))

    def __mro_entries__(self, bases):
        # `class X(torchvision.Foo): ...` still imports; instantiating X raises.
        return (_placeholder_class(self._name),)

    def __repr__(self) -> str:
        return f"<torchvision stand-in placeholder {self._name}>"


def _placeholder_class(name: str) -> type:
    def __new__(cls, *args, **kwargs):
        raise RuntimeError(_MESSAGE.format(name=name))

    return type(name.rsplit(".", 1)[-1], (), {"__new__": __new__, "__module__": name.rsplit(".", 1)[0]})


def _module_getattr(module_name: str):
    def __getattr__(item: str):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{module_name}.{item}")

    return __getattr__


class _StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``torchvision.<x>[.<y>...]`` submodule importable as a placeholder module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so deeper submodules import too
        module.__getattr__ = _module_getattr(spec.name)
        module.STANDIN = True
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StandinFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StandinFinder())

__getattr__ = _module_getattr(__name__)
