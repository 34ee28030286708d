"""The calculator demo through the OpenAI-compatible endpoint: ``rlfoundry train --config-name
calculator_openai_agent``, whose agent (``scripts/react_calculator_agent.py``) is ~30 lines of the
official ``openai`` client and nothing of rlfoundry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.trainer import _e2e as E

pytest.importorskip("openai")
pytestmark = pytest.mark.slow

AGENT = Path(__file__).resolve().parents[2] / "scripts" / "react_calculator_agent.py"


def test_the_calculator_demo_learns_through_the_openai_endpoint(tmp_path):
    """As ``test_e2e_learning.test_the_calculator_demo_learns_to_call_its_tool`` (20 of the 40 steps),
    the trajectories made by the ReAct agent over HTTP: greedy validation starts near zero and rises by
    more than 0.3 as GRPO teaches the policy to call the calculator; no sample is lost."""
    run = E.train([f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=20",
                   "trainer.test_freq=20", "trainer.save_freq=-1", "trainer.logger=file",
                   "reward_model.reward_kwargs.num_workers=0", f"actor_rollout_ref.rollout.agent.openai.path={AGENT}"],
                  config_name="calculator_openai_agent")
    key = "val-core/rlfoundry/arithmetic/reward/mean@1"
    val = {r["step"]: r[key] for r in run.records if key in r}
    turns = [run.step(s)["num_turns/mean"] for s in range(1, 21)]
    print(f"calculator demo through the endpoint: validation {val}, turns per trajectory {np.round(turns, 2)}")
    assert val[0] < 0.15, f"the packaged policy should start near zero: {val}"
    assert val[20] > val[0] + 0.3, f"validation did not rise: {val}"
    assert np.mean(turns[-5:]) > np.mean(turns[:5]) + 0.1, turns  # more calls: a call, its reply, the answer
    assert not any(k.startswith("multi_turn/stop/agent_") and k != "multi_turn/stop/agent_done" and v > 0
                   for s in range(1, 21) for k, v in run.step(s).items())
