"""trainer.profile_steps: a trace for the chosen steps only, with the timed phases inside it."""

from __future__ import annotations

import json

import torch

from rlfoundry.trainer.metric_utils import marked_timer
from rlfoundry.utils.profiler import StepProfiler


def test_trace_written_for_the_chosen_step_only(tmp_path, capsys):
    profiler = StepProfiler([2], tmp_path / "profile")
    written = {}
    for step in (1, 2, 3):
        profiler.start(step)
        timing: dict[str, float] = {}
        with marked_timer("update_actor", timing):
            torch.randn(64, 64) @ torch.randn(64, 64)
        written[step] = profiler.stop(step)
    assert written[1] is None and written[3] is None
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["driver_step2.pt.trace.json"]
    trace = json.loads(written[2].read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "update_actor" in names, "marked_timer phases must be labelled in the trace"
    assert "driver_step2.pt.trace.json" in capsys.readouterr().err  # the console says where it went


def test_context_manager_and_no_steps(tmp_path):
    StepProfiler(None, tmp_path / "none").start(1)
    assert not (tmp_path / "none").exists()
    profiler = StepProfiler([5], tmp_path / "p", name="actor_rank0")
    with profiler.step(5):
        torch.ones(4).sum()
    assert (tmp_path / "p" / "actor_rank0_step5.pt.trace.json").is_file()
