"""Fixtures of the reliability tests: the dense reward file and one uninterrupted reference run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability._harness import overrides, raw_records, run_trainer, write_reward_file

REFERENCE_STEPS = 4


@pytest.fixture(scope="session")
def reward_file(tmp_path_factory) -> Path:
    return write_reward_file(tmp_path_factory.mktemp("reward"))


@pytest.fixture(scope="session")
def reference_run(tiny_model_dir, reward_file, tmp_path_factory) -> dict:
    """4 steps without faults: per-step records and the order in which prompts were scored."""
    root = tmp_path_factory.mktemp("reference")
    order = root / "order.txt"
    result = run_trainer(overrides(tiny_model_dir, root / "run", reward_file, REFERENCE_STEPS,
                                   "trainer.max_actor_ckpt_to_keep=1"),
                         root / "log.txt", env={"ORDER_LOG": str(order)})
    assert result.exitcode == 0, result.log[-3000:]
    records = {r["step"]: r for r in raw_records(root / "run")}
    assert sorted(records) == list(range(1, REFERENCE_STEPS + 1))
    return {"records": records, "order": order.read_text().split()}


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: long crash/resume soak run (select with -m soak)")


def pytest_collection_modifyitems(config, items):
    """The long soak only runs when asked for (``-m soak``); its short version is in the default suite."""
    if "soak" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="long soak run: select with -m soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_leftover_faults(monkeypatch):
    """In-process runs share the fault hit counters and environment: start every test clean."""
    from rlfoundry.utils import faults

    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    faults.reset()
    yield
    faults.reset()


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    """``main_ppo.main`` in this process: (exit code, stderr)."""
    from rlfoundry.trainer.main_ppo import main

    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err
