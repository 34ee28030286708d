"""User code written against verl's imports runs on rlfoundry (rlfoundry/utils/verl_imports.py).

The user files here are written for these tests in the style of verl's recipes, not copied."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rlfoundry
from rlfoundry.protocol import DataProto
from rlfoundry.rewards import gsm8k as rlfoundry_gsm8k
from rlfoundry.rewards.custom import RewardFunctionError, load_custom_reward_fn
from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.registry import ToolConfigError, initialize_tools_from_config
from rlfoundry.tools.sandbox_fusion import SandboxFusionTool
from rlfoundry.utils import verl_imports

ROOT = Path(rlfoundry.__file__).resolve().parents[1]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _tool_config(tmp_path: Path, class_name: str) -> Path:
    schema = {"type": "function", "function": {"name": "code_interpreter", "description": "runs code", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
    entry = {"class_name": class_name, "config": {"type": "native", "default_timeout": 5}, "tool_schema": schema}
    return _write(tmp_path / "tools.yaml", json.dumps({"tools": [entry]}))


def test_verl_dataproto_is_rlfoundrys_class():
    import verl

    assert verl.DataProto is DataProto
    from verl.protocol import DataProto as from_protocol

    assert from_protocol is DataProto


def test_a_verl_reward_function_file_scores_as_rlfoundrys_gsm8k(tmp_path):
    path = _write(tmp_path / "my_reward.py", """\
        from verl.utils.reward_score import gsm8k


        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            return gsm8k.compute_score(solution_str, ground_truth, format_score=0.1)
        """)
    fn = load_custom_reward_fn({"custom_reward_function": {"path": str(path), "name": "compute_score"}})
    cases = [("48 + 24 = 72 clips.\n#### 72", 1.0),  # the answer, in GSM8K's "#### n" format
             ("48 + 24 = 71 clips.\n#### 71", 0.1),  # formatted but wrong: format_score
             ("the answer is 72", 0.0)]  # strict extraction finds no "#### n": nothing
    for response, expected in cases:
        assert fn("openai/gsm8k", response, "72") == expected
        assert rlfoundry_gsm8k.compute_score(response, "72", format_score=0.1) == expected


def test_verl_tool_classes_load_through_the_tool_config_as_rlfoundry_subclasses(tmp_path, monkeypatch):
    _write(tmp_path / "my_recipe" / "__init__.py", "")
    _write(tmp_path / "my_recipe" / "tools.py", """\
        import re
        from typing import Any

        from verl.tools.base_tool import BaseTool, OpenAIFunctionToolSchema
        from verl.tools.sandbox_fusion_tools import SandboxFusionTool
        from verl.tools.schemas import ToolResponse
        from verl.utils.rollout_trace import rollout_trace_op


        class FencedCodeTool(SandboxFusionTool):
            def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
                super().__init__(config, tool_schema)
                self.fence = re.compile(r"```python(.*?)```", re.DOTALL)


        class ShoutTool(BaseTool):
            @rollout_trace_op
            async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple:
                return ToolResponse(text=parameters["code"].upper()), 0.5, {}
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    [fenced] = initialize_tools_from_config(_tool_config(tmp_path, "my_recipe.tools.FencedCodeTool"))
    assert isinstance(fenced, SandboxFusionTool) and fenced.name == "code_interpreter"
    assert type(fenced).__mro__[1] is SandboxFusionTool  # verl's name is rlfoundry's class, not a copy
    [shout] = initialize_tools_from_config(_tool_config(tmp_path, "my_recipe.tools.ShoutTool"))
    assert isinstance(shout, BaseTool)
    response, reward, _ = asyncio.run(shout.execute("i", {"code": "print(1)"}))
    assert (response.text, reward) == ("PRINT(1)", 0.5)


def test_a_verl_module_with_no_counterpart_is_named_with_the_file_that_imported_it(tmp_path, monkeypatch):
    tool_file = _write(tmp_path / "megatron_tool.py", """\
        from verl.tools.base_tool import BaseTool
        from verl.utils.megatron_utils import offload_megatron_model_to_cpu


        class MegatronTool(BaseTool):
            pass
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ToolConfigError) as caught:
        initialize_tools_from_config(_tool_config(tmp_path, "megatron_tool.MegatronTool"))
    message = str(caught.value)
    assert "verl.utils.megatron_utils" in message and f"{tool_file}:2" in message
    assert "no rlfoundry.utils.megatron_utils" in message and "install verl" in message

    reward_file = _write(tmp_path / "prime_reward.py", "from verl.utils.reward_score import prime_math\n")
    with pytest.raises(RewardFunctionError, match=r"verl\.utils\.reward_score\.prime_math \(imported by "
                                                  rf"{reward_file}:1\).*rlfoundry\.rewards\.math_dapo"):
        load_custom_reward_fn({"custom_reward_function": {"path": str(reward_file)}})


def test_every_renamed_module_and_name_exists_in_rlfoundry():
    for verl_name, ours in verl_imports._RENAMED.items():
        assert importlib.util.find_spec(ours) is not None, (verl_name, ours)
    for (verl_module, name), (ours, attr) in verl_imports._ATTRIBUTES.items():
        assert hasattr(importlib.import_module(ours), attr), (verl_module, name)
        assert getattr(importlib.import_module(verl_module), name) is getattr(importlib.import_module(ours), attr)


def _run(code: str, path: Path, mode: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != verl_imports.ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT)])
    if mode:
        env[verl_imports.ENV] = mode
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def fake_verl(tmp_path) -> Path:
    """A tiny installed ``verl`` (the package and its distribution's metadata): what a user with verl
    installed has."""
    _write(tmp_path / "verl-0.0.1.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: verl\nVersion: 0.0.1\n")
    _write(tmp_path / "verl" / "__init__.py", "WHO = 'the installed verl'\n")
    _write(tmp_path / "verl" / "tools" / "__init__.py", "")
    _write(tmp_path / "verl" / "tools" / "base_tool.py", "class BaseTool:\n    pass\n")
    _write(tmp_path / "user_tool.py", "from verl.tools.base_tool import BaseTool\n\n\nclass UserTool(BaseTool):\n"
                                      "    pass\n")
    return tmp_path


def test_an_installed_verl_is_left_alone(fake_verl):
    done = _run("""\
        import rlfoundry, verl
        from verl.tools.base_tool import BaseTool
        import rlfoundry.tools.base
        print(verl.WHO, BaseTool is rlfoundry.tools.base.BaseTool, hasattr(verl, "DataProto"))
        try:
            import verl.utils.reward_score
        except ModuleNotFoundError as e:
            print(type(e).__name__, e.name)
        """, fake_verl)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["the installed verl False False", "ModuleNotFoundError verl.utils"]


def test_a_verl_checkout_on_the_path_but_not_installed_is_answered_by_rlfoundry(fake_verl):
    """verl's example scripts run from its root: its verl/ is on the path (python -m puts the working
    directory first), yet the user ran rlfoundry; without the distribution rlfoundry answers."""
    import shutil

    shutil.rmtree(fake_verl / "verl-0.0.1.dist-info")
    done = _run("import rlfoundry, verl\nfrom verl import DataProto\nprint(DataProto.__module__)\n", fake_verl)
    assert done.stdout.strip() == "rlfoundry.protocol", done.stderr
    left = _run("import rlfoundry, verl\nprint(verl.WHO)\n", fake_verl, mode="verl")
    assert left.stdout.strip() == "the installed verl", left.stderr


def test_a_tool_on_an_installed_verl_is_told_how_to_run_it_on_rlfoundry(fake_verl):
    code = """\
        from rlfoundry.tools.registry import ToolConfigError, load_tool_class
        try:
            print(load_tool_class("user_tool.UserTool").__mro__[1].__module__)
        except ToolConfigError as e:
            print(e)
        """
    refused = _run(code, fake_verl)
    assert "not a subclass of rlfoundry.tools.base.BaseTool" in refused.stdout, refused.stderr
    assert f"the verl at {fake_verl / 'verl'}" in refused.stdout and "RLFOUNDRY_VERL_IMPORTS=rlfoundry" in refused.stdout
    forced = _run(code, fake_verl, mode="rlfoundry")
    assert forced.stdout.strip() == "rlfoundry.tools.base", forced.stderr


def test_the_mode_variable_is_checked():
    done = _run("import rlfoundry\ntry:\n    import verl\nexcept ImportError as e:\n    print(e)\n", ROOT, mode="yes")
    assert "RLFOUNDRY_VERL_IMPORTS='yes' is not one of ['auto', 'rlfoundry', 'verl']" in done.stdout, done.stderr
