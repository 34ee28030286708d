"""``trainer.profile_steps=[...]``: a ``torch.profiler`` trace of the chosen training steps.

The trainer calls ``start(step)`` at the top of each step and ``stop(step)`` at the bottom; only the
steps listed are recorded, so profiling a long run costs nothing on the others. Each trace goes to
``<out_dir>/<name>_step<N>.pt.trace.json`` (Chrome trace format: open it in https://ui.perfetto.dev,
or point ``tensorboard --logdir`` at the folder with the ``torch-tb-profiler`` plugin, which looks for
the ``.pt.trace.json`` suffix). On a GPU the trace also has CUDA kernels and memory events, and a
CUDA memory snapshot is saved beside it for https://pytorch.org/memory_viz.

Phases timed with ``metric_utils.marked_timer`` appear in the trace under their names (gen, ref,
update_actor, ...), because the timer also opens a ``record_function`` range.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rlfoundry.utils.profile_tools import TORCH_PROFILER_TOOLS

__all__ = ["StepProfiler", "profile_dir"]


def profile_dir(config) -> Path:
    """Where a PPO run's traces go: verl's ``global_profiler.save_path`` when ``global_profiler.tool`` is a
    torch one (its ``steps`` are then ``trainer.profile_steps``: config/verl_compat.py), else
    ``<run_dir>/profile``."""
    gp = config.global_profiler
    if gp.tool in TORCH_PROFILER_TOOLS:
        return Path(gp.save_path).expanduser()
    return Path(config.trainer.run_dir) / "profile"


class StepProfiler:
    """Record a trace for each step in ``profile_steps`` (empty/None: never) into ``out_dir``.

    ``name`` tells traces of different processes apart (``driver``, ``actor_rank0``...): a worker
    that profiles its own side of a step uses the same class with its own name.
    """

    def __init__(self, profile_steps: Iterable[int] | None, out_dir: str | Path, name: str = "driver") -> None:
        self.steps = {int(s) for s in (profile_steps or [])}
        self.out_dir = Path(out_dir)
        self.name = name
        self.cuda = torch.cuda.is_available()
        self._prof: profile | None = None
        self._step: int | None = None

    def enabled_for(self, step: int) -> bool:
        return step in self.steps

    def start(self, step: int) -> None:
        """Begin recording if ``step`` is one of the profiled steps."""
        if not self.enabled_for(step) or self._prof is not None:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # Shapes and memory make the trace answer "which op, how big, how much memory"; stacks are
        # left off because they multiply the trace size for little gain at step granularity.
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof.__enter__()
        self._step = step

    def stop(self, step: int) -> Path | None:
        """Finish the trace started for ``step``; returns the trace path (None if none was recording)."""
        if self._prof is None or step != self._step:
            return None
        if self.cuda:
            torch.cuda.synchronize()  # kernels still queued would be missing from the trace
        self._prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.name}_step{step}.pt.trace.json"
        self._prof.export_chrome_trace(str(path))
        if self.cuda:
            self._save_memory_snapshot(step)
        self._prof, self._step = None, None
        print(f"[profiler] step {step}: trace written to {path} (open in ui.perfetto.dev or TensorBoard)",
              file=sys.stderr)
        return path

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """``with profiler.step(n):`` around a training step: ``start`` + ``stop``, also on error."""
        self.start(step)
        try:
            yield
        finally:
            self.stop(step)

    def _save_memory_snapshot(self, step: int) -> None:
        snapshot = self.out_dir / f"{self.name}_step{step}.memory.pickle"
        torch.cuda.memory._dump_snapshot(str(snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)  # stop recording; it costs per allocation
