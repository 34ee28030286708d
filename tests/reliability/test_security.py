"""Loading never executes code from a file, and nothing runs remote code unless the user says so.

A static scan of the package (AST, not grep, so comments and strings do not count): every
``torch.load`` passes ``weights_only=True``; nothing calls ``pickle``/``dill``/``cloudpickle``/
``joblib`` loaders, ``numpy.load(..., allow_pickle=True)``, ``eval`` or ``exec``; and no call sets
``trust_remote_code=True``. The one allow-listed unpickler (DCP metadata, with a restricted
``find_class``) is a class, not a call to ``pickle.load``, so it passes by construction.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rlfoundry"
_UNSAFE_LOADERS = {("pickle", "load"), ("pickle", "loads"), ("dill", "load"), ("dill", "loads"),
                   ("cloudpickle", "load"), ("cloudpickle", "loads"), ("joblib", "load"), ("marshal", "loads")}


def _dotted(node: ast.AST) -> tuple[str, ...]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "?")  # "?": called on an expression, e.g. x().eval()
    return tuple(reversed(parts))


def _kw_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def unsafe_calls(source: str, filename: str = "<src>") -> list[str]:
    """``file:line: what`` for every unsafe load / code execution in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        where = f"{filename}:{node.lineno}"
        if name[-2:] == ("torch", "load") and not _kw_is_true(node, "weights_only"):
            found.append(f"{where}: torch.load without weights_only=True")
        elif name[-2:] in _UNSAFE_LOADERS:
            found.append(f"{where}: {'.'.join(name)} unpickles arbitrary objects")
        elif name[-1:] == ("load",) and name[-2:-1] in (("np",), ("numpy",)) and _kw_is_true(node, "allow_pickle"):
            found.append(f"{where}: numpy.load(allow_pickle=True)")
        elif name in (("eval",), ("exec",)):
            found.append(f"{where}: {name[0]}()")
        elif _kw_is_true(node, "trust_remote_code"):
            found.append(f"{where}: trust_remote_code=True hard-coded")
    return found


def test_the_scanner_catches_each_unsafe_pattern():
    assert unsafe_calls("model.to(d).eval()\nself.model.eval()\n") == []  # nn.Module.eval is fine
    bad = ("torch.load(p)\ntorch.load(p, weights_only=False)\npickle.loads(b)\nnp.load(p, allow_pickle=True)\n"
           "eval(s)\nAutoModel.from_pretrained(p, trust_remote_code=True)\n")
    assert len(unsafe_calls(bad)) == 6
    assert unsafe_calls("torch.load(p, map_location='cpu', weights_only=True)\nnp.load(p)\n") == []


def test_package_never_loads_with_pickle_or_without_weights_only():
    problems = [p for f in sorted(PACKAGE.rglob("*.py"))
                for p in unsafe_calls(f.read_text(encoding="utf-8"), str(f.relative_to(PACKAGE.parent)))]
    assert problems == []


@pytest.mark.parametrize("config_name", [None, "arithmetic_ppo", "gsm8k_grpo_gpu"])
def test_trust_remote_code_is_off_by_default(config_name):
    from rlfoundry.config.schema import PPOConfig
    from rlfoundry.trainer.config import load_config, schema_keys

    keys = [k for k in schema_keys(PPOConfig) if k.endswith("trust_remote_code")]
    assert len(keys) >= 4  # data, actor model, critic model, reward model
    cfg = load_config([], config_name=config_name)
    from omegaconf import OmegaConf

    assert {k: OmegaConf.select(cfg, k) for k in keys} == {k: False for k in keys}
