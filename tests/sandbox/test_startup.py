"""A run that executes generated code says at start-up how it will be contained, and without kernel
isolation refuses to start unless the user opted in (never a silent fallback)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pyarrow as pa
import pytest

from rlfoundry.sandbox import ALLOW_UNISOLATED_ENV, ISOLATION_ENV
from rlfoundry.trainer.config import ConfigError, load_config
from rlfoundry.trainer.main_ppo import check_sandbox


def _dataset(*sources: str) -> SimpleNamespace:
    return SimpleNamespace(tables=[("train.parquet", pa.table({"data_source": list(sources)}))])


@pytest.fixture
def no_isolation(monkeypatch):
    monkeypatch.setenv(ISOLATION_ENV, "none")  # as on a machine without bubblewrap or user namespaces
    monkeypatch.delenv(ALLOW_UNISOLATED_ENV, raising=False)


def test_code_rows_without_isolation_stop_the_run_with_the_key_to_set(no_isolation):
    with pytest.raises(ConfigError, match=r"code rewards \(codecontests\).*sandbox.allow_unisolated=true"):
        check_sandbox(load_config([]), [_dataset("openai/gsm8k", "codecontests")])


def test_the_opt_in_lets_it_start_and_says_so(no_isolation, capsys):
    check_sandbox(load_config(["sandbox.allow_unisolated=true"]), [_dataset("apps")])
    assert os.environ[ALLOW_UNISOLATED_ENV] == "1"  # inherited by reward pools and (via runtime_env) Ray workers
    assert "code rewards (apps) run generated code in the unisolated sandbox" in capsys.readouterr().out


def test_runs_that_run_no_code_or_send_it_elsewhere_need_nothing(no_isolation, tmp_path):
    check_sandbox(load_config([]), [_dataset("openai/gsm8k")])
    check_sandbox(load_config(["reward_model.sandbox_fusion.url=http://10.0.0.2:8080"]), [_dataset("codecontests")])
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: rlfoundry.tools.code_interpreter.CodeInterpreterTool\n    config: {}\n")
    with pytest.raises(ConfigError, match="the tool CodeInterpreterTool"):
        check_sandbox(load_config([f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"]),
                      [_dataset("openai/gsm8k")])
