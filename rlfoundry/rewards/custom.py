"""Load a user's reward function from a Python file (``custom_reward_function.*``, verl's keys).

    custom_reward_function:
      path: /abs/or/relative/my_reward.py   # null: use default_compute_score
      name: compute_score                   # function in that file
      reward_kwargs: {}                     # extra keyword arguments bound to every call

The function is called like ``default_compute_score(data_source=..., solution_str=...,
ground_truth=..., extra_info=...)`` and returns a float or a dict with a ``score`` key.

The loaded function is wrapped in ``FileRewardFunction``, which pickles as (path, name, kwargs)
and re-imports the file in the process that calls it: reward pool workers started with spawn or
forkserver cannot unpickle a function whose module exists only in the driver's memory.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Callable

from rlfoundry.utils.import_utils import ExternObjectError, module_from_file


class RewardFunctionError(ValueError):
    """The custom reward function could not be loaded; the message names the file and function."""


def _load_module(path: Path, key: str = "custom_reward_function.path"):
    try:
        return module_from_file(path, key, prefix="rlfoundry_custom_reward_")
    except ExternObjectError as err:
        raise RewardFunctionError(str(err)) from err.__cause__


class FileRewardFunction:
    """A picklable handle on ``name`` in the Python file ``path``, called with ``kwargs`` bound."""

    def __init__(self, path: str | Path, name: str = "compute_score", kwargs: dict | None = None) -> None:
        self.path = Path(path).expanduser().resolve()
        self.name = name
        self.kwargs = dict(kwargs or {})
        self._fn: Callable | None = None

    def load(self) -> Callable:
        if self._fn is None:
            if not self.path.is_file():
                raise RewardFunctionError(
                    f"custom reward file {self.path} does not exist (custom_reward_function.path)"
                )
            fn = getattr(_load_module(self.path), self.name, None)
            if not callable(fn):
                raise RewardFunctionError(
                    f"custom reward file {self.path} has no function {self.name!r} "
                    "(custom_reward_function.name); define it or set the right name"
                )
            self._fn = fn
        return self._fn

    @property
    def is_async(self) -> bool:
        """An ``async def`` function: the reward manager awaits it (as verl's reward loop does)."""
        return inspect.iscoroutinefunction(self.load())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **{**self.kwargs, **kwargs})

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name, "kwargs": self.kwargs, "_fn": None}

    def __repr__(self) -> str:
        return f"FileRewardFunction({str(self.path)!r}, {self.name!r})"


class ServedRewardFunction:
    """verl's reward loop: ``fn`` called with ``reward_router_address`` (the reward-model server's
    "host:port") and ``reward_model_tokenizer`` where its signature takes them (by name or ``**kwargs``).
    Pickles without the tokenizer: a scorer process loads it from ``tokenizer_path`` once."""

    def __init__(self, fn: Callable, address: str, tokenizer_path: str, tokenizer: Any = None,
                 trust_remote_code: bool = False) -> None:
        self.fn, self.address, self.tokenizer_path, self._tokenizer = fn, address, str(tokenizer_path), tokenizer
        self.trust_remote_code = bool(trust_remote_code)  # as the driver loaded it (reward_model.model.*)
        target = fn.load() if hasattr(fn, "load") else fn
        params = inspect.signature(target).parameters.values()
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        names = {p.name for p in params}
        self.passes = tuple(k for k in ("reward_router_address", "reward_model_tokenizer") if takes_all or k in names)
        self.is_async = inspect.iscoroutinefunction(target)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    def __call__(self, **kwargs: Any) -> Any:
        served = {"reward_router_address": self.address}
        if "reward_model_tokenizer" in self.passes:
            served["reward_model_tokenizer"] = self.tokenizer
        return self.fn(**kwargs, **{k: v for k, v in served.items() if k in self.passes})

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None}


def load_reward_manager_class(path: str, name: str) -> type:
    """The class ``name`` in ``path``: a Python file, or ``pkg://package.module`` (verl's
    ``reward.reward_manager.module.{path,name}`` with ``source=importlib``)."""
    key = "reward.reward_manager.module.path"
    if path.startswith("pkg://"):
        try:
            module = importlib.import_module(path[len("pkg://"):])
        except ImportError as err:
            raise RewardFunctionError(f"{key}={path}: cannot import {path[len('pkg://'):]!r} ({err})") from err
    else:
        file = Path(path).expanduser().resolve()
        if not file.is_file():
            raise RewardFunctionError(f"{key}={path} does not exist")
        module = _load_module(file, key)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise RewardFunctionError(f"{path} has no class {name!r} (reward.reward_manager.module.name)")
    return cls


def load_custom_reward_fn(config: Any) -> FileRewardFunction | None:
    """The function named by ``config.custom_reward_function``, loaded now (errors surface at start-up)."""
    section = _get(config, "custom_reward_function")
    path = _get(section, "path")
    if not path:
        return None
    fn = FileRewardFunction(path, _get(section, "name") or "compute_score", dict(_get(section, "reward_kwargs") or {}))
    fn.load()
    return fn


def _get(config: Any, key: str) -> Any:
    if config is None:
        return None
    return config.get(key) if hasattr(config, "get") else getattr(config, key, None)
