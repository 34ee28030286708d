"""``import verl…`` in a user's code runs on rlfoundry when verl itself is not installed.

verl users bring files that import verl: reward functions (``from verl.utils.reward_score import
gsm8k``), tool classes (``from verl.tools.sandbox_fusion_tools import SandboxFusionTool``), agent
loops, interactions, data sets. A finder on ``sys.meta_path`` answers those imports with rlfoundry's
module of the same role, so such a file loads unchanged and its classes subclass rlfoundry's:

- ``verl.X.Y`` is ``rlfoundry.X.Y`` where rlfoundry kept verl's layout; ``_RENAMED`` lists the
  modules whose rlfoundry name differs (a module below a renamed one follows it:
  ``verl.utils.dataset.rl_dataset`` is ``rlfoundry.data.rl_dataset``); ``_ATTRIBUTES`` the few
  names that live elsewhere here (``verl.DataProto`` is ``rlfoundry.protocol.DataProto``, the same
  class object).
- a verl module with no rlfoundry counterpart is an ``ImportError`` that names it, the file
  that imported it and what to do, never a module that half works.

A ``verl`` module here is a thin module that reads its names from the rlfoundry module on use
(``__getattr__``), so rlfoundry's own modules are never renamed or written to.

When verl is installed (a ``verl`` distribution, e.g. ``pip install verl`` or ``-e`` of a checkout)
and importable, the finder steps aside and the user gets verl (``RLFOUNDRY_VERL_IMPORTS``: ``auto``,
the default). A ``verl/`` directory that is only on the path, as a verl checkout is when a run starts
from inside it (verl's example scripts run from its root), does not count: rlfoundry answers, as the
user running rlfoundry there means it to. ``rlfoundry`` answers ``verl`` always; ``verl`` never. It is installed when rlfoundry is imported, not by each loader of user
code: a class defined in a user's file travels to Ray workers and reward-pool processes by
reference (pickle names its module, e.g. ``recipe.retool.retool``), and the receiving process
imports that module by name before any loader of ours runs there. Installing costs one list entry;
nothing is looked up until something imports ``verl``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

__all__ = ["ENV", "VerlImportFinder", "install", "real_verl_hint", "rlfoundry_name"]

ENV = "RLFOUNDRY_VERL_IMPORTS"
_MODES = ("auto", "rlfoundry", "verl")

# verl module -> rlfoundry module with the same role, where the names differ.
_RENAMED = {
    "verl": "rlfoundry",
    "verl.tools.base_tool": "rlfoundry.tools.base",
    "verl.tools.sandbox_fusion_tools": "rlfoundry.tools.sandbox_fusion",
    "verl.tools.gsm8k_tool": "rlfoundry.tools.gsm8k",
    "verl.tools.geo3k_tool": "rlfoundry.tools.geo3k",
    "verl.tools.search_tool": "rlfoundry.tools.search",
    "verl.tools.utils.tool_registry": "rlfoundry.tools.registry",
    "verl.interactions.gsm8k_interaction": "rlfoundry.interactions.gsm8k",
    "verl.interactions.utils.interaction_registry": "rlfoundry.interactions.registry",
    "verl.utils.reward_score": "rlfoundry.rewards",
    "verl.utils.reward_score.math_reward": "rlfoundry.rewards.math",
    "verl.utils.dataset": "rlfoundry.data",
    "verl.experimental.agent_loop": "rlfoundry.workers.rollout.agent_loop",
    "verl.experimental.agent_loop.agent_loop": "rlfoundry.workers.rollout.agent_loop.base",
    "verl.experimental.agent_loop.tool_agent_loop": "rlfoundry.workers.rollout.agent_loop.tool_agent",
    "verl.experimental.agent_loop.single_turn_agent_loop": "rlfoundry.workers.rollout.agent_loop.single_turn",
    "verl.experimental.agent_loop.tool_parser": "rlfoundry.tools.parser",
    "verl.experimental.dataset.sampler": "rlfoundry.data.sampler",
    "verl.workers.reward_manager": "rlfoundry.rewards.reward_manager",
    "verl.trainer.ppo.metric_utils": "rlfoundry.trainer.metric_utils",
}

# (verl module, name) -> (rlfoundry module, name): a name verl exports from a module whose
# rlfoundry counterpart does not hold it.
_ATTRIBUTES = {
    ("verl", "DataProto"): ("rlfoundry.protocol", "DataProto"),
    ("verl.tools.base_tool", "OpenAIFunctionToolSchema"): ("rlfoundry.tools.schemas", "OpenAIFunctionToolSchema"),
    ("verl.workers.reward_manager", "register"): ("rlfoundry.rewards.reward_manager", "register_reward_manager"),
    ("verl.workers.reward_manager", "get_reward_manager_cls"): ("rlfoundry.rewards.reward_manager",
                                                                "get_reward_manager_cls"),
}

# What to do instead, for verl modules user code often imports that have no counterpart here.
_HINTS = {
    "verl.workers.megatron_workers": "rlfoundry's workers are engine-neutral: rlfoundry.workers.fsdp_workers "
                                     "runs Megatron with actor_rollout_ref.actor.strategy=megatron",
    "verl.utils.hdfs_io": "rlfoundry reads and writes local paths; copy with shutil (or fsspec) instead",
    "verl.utils.reward_score.prime_math": "rlfoundry's MATH scorer is rlfoundry.rewards.math (math-verify), "
                                          "DAPO's is rlfoundry.rewards.math_dapo",
}


def rlfoundry_name(verl_name: str) -> str:
    """The rlfoundry module that plays ``verl_name``'s role (it may not exist: see ``_target``)."""
    if verl_name in _RENAMED:
        return _RENAMED[verl_name]
    parent, _, leaf = verl_name.rpartition(".")
    return f"{rlfoundry_name(parent)}.{leaf}"


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ImportError(f"{ENV}={mode!r} is not one of {list(_MODES)}: auto (rlfoundry stands in for verl when "
                          "verl is not installed), rlfoundry (always), verl (never)")
    return mode


class _VerlModule(ModuleType):
    """``verl.X``: its names are read from the rlfoundry module on use."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        verl_name = self.__name__
        home, attr = _ATTRIBUTES.get((verl_name, name), (self.__rlfoundry__, name))
        try:
            return getattr(importlib.import_module(home), attr)
        except AttributeError:
            raise AttributeError(f"{verl_name} is rlfoundry's {self.__rlfoundry__} here, which has no {name!r}; "
                                 f"import the rlfoundry name with that role (docs/verl_keys.md, 'verl imports')") \
                from None

    def __repr__(self) -> str:
        return f"<module {self.__name__!r} (rlfoundry's {self.__rlfoundry__})>"

    def __dir__(self) -> list[str]:
        own = [n for (m, n) in _ATTRIBUTES if m == self.__name__]
        return sorted({*dir(importlib.import_module(self.__rlfoundry__)), *own})


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = _VerlModule(spec.name)
        module.__rlfoundry__ = self.target
        module.__path__ = []  # a package, so ``verl.X.Y`` is asked of this finder in turn
        return module

    def exec_module(self, module: ModuleType) -> None:
        importlib.import_module(self.target)  # its own import errors surface here, under the verl name


class VerlImportFinder(importlib.abc.MetaPathFinder):
    """Answers ``verl`` and ``verl.*`` with rlfoundry's modules unless a real verl is importable."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "verl" and not fullname.startswith("verl."):
            return None
        if fullname == "verl":
            if not self._answers_verl():
                return None
        elif not isinstance(sys.modules.get("verl"), _VerlModule):
            return None  # a real verl is loaded: its submodules are its own business
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(_target(fullname)), is_package=True)

    def _answers_verl(self) -> bool:
        mode = _mode()
        if mode != "auto":
            return mode == "rlfoundry"
        if not _installed("verl"):  # a bare verl/ on the path: a checkout the run started in
            return True
        others = (f for f in sys.meta_path if f is not self and hasattr(f, "find_spec"))
        return all(f.find_spec("verl", None) is None for f in others)


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _target(verl_name: str) -> str:
    name = rlfoundry_name(verl_name)
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:  # a parent that is a module, not a package
        found = False
    if found:
        return name
    hint = _HINTS.get(verl_name, "import the rlfoundry module with that role instead (docs/verl_keys.md, "
                                 "'verl imports'), or install verl to run verl's own code")
    # ImportError, not ModuleNotFoundError: ``from verl.a import b`` drops a ModuleNotFoundError for
    # ``verl.a.b`` and reports "cannot import name 'b'", losing this message.
    raise ImportError(
        f"{verl_name} (imported by {_importer()}) has no counterpart in rlfoundry (no {name}), which stands "
        f"in for verl here: {hint}.", name=verl_name)


def _importer() -> str:
    """The file whose import statement reached this finder: the first frame outside importlib and us."""
    frame = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if not (file.startswith("<frozen") or file == __file__ or os.sep + "importlib" + os.sep in file):
            return f"{file}:{frame.f_lineno}"
        frame = frame.f_back
    return "an unknown file"


def real_verl_hint() -> str:
    """For an error about a user's class: a sentence saying that a real verl, not rlfoundry, answered
    its verl imports (and how to change that), or "" when rlfoundry did."""
    loaded = sys.modules.get("verl")
    if isinstance(loaded, _VerlModule):
        return ""
    spec = importlib.machinery.PathFinder.find_spec("verl") if loaded is None else loaded.__spec__
    if spec is None or os.environ.get(ENV, "").strip().lower() == "rlfoundry":  # (a bad value: _mode's own error)
        return ""
    where = (spec.submodule_search_locations or [spec.origin])[0]
    return (f" (verl's imports went to the verl at {where}, not to rlfoundry: an installed verl, or a verl "
            f"checkout in the working directory, comes first; set {ENV}=rlfoundry to have rlfoundry answer them)")


_FINDER = VerlImportFinder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent): first, so that ``RLFOUNDRY_VERL_IMPORTS=rlfoundry``
    can win over a verl on the path; in ``auto`` it defers to every other finder for ``verl`` itself."""
    if not any(isinstance(f, VerlImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
