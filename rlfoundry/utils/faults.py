"""Fault injection for the reliability tests: ``RLFOUNDRY_FAULT_INJECT="<spec>[,<spec> ...]"``.

A spec is ``point[@N][>M][:action]``:

- ``point``   a name passed to :func:`inject` by the code (the list is below);
- ``@N``      fire only the N-th time this process reaches the point (1-based); default: every time;
- ``>M``      fire only when the pass runs with a (micro-)batch size above M (OOM-retry tests);
- ``action``  ``kill`` (SIGKILL this process, the default), ``oom`` (raise ``torch.OutOfMemoryError``),
              ``enospc`` (raise ``OSError(ENOSPC)``), ``hang`` (sleep for ever), ``nan`` (fill the
              caller's tensor with NaN: ``advantages`` in ``update_actor``, ``returns`` in
              ``update_critic``), ``slow`` (sleep ``SLOW_S`` seconds and go on: a timing test's step
              that is surely still under way when another thread gets there).

Points: the checkpoint save path ``save.staged`` (a role's shards written, not yet published),
``save.published`` (role directory renamed into place), ``save.trainer_state`` (``data.pt``
written), ``save.step_marked`` (step marker written, ``latest`` pointer not yet), ``save.pruning``
(a checkpoint beyond ``max_*_ckpt_to_keep`` renamed for deletion, not yet deleted); the worker passes
``generate_sequences``, ``compute_log_prob``, ``compute_ref_log_prob``, ``compute_values``,
``update_actor``, ``update_critic``; the weight syncs ``checkpoint_engine.connect`` (a bridge member
before it announces itself), ``checkpoint_engine.send_bucket`` / ``checkpoint_engine.receive_bucket``
(the sender before a bucket, a rollout rank after one) and ``sync_weights.tensor`` (a tensor on its way
into the rollout engine, after its digest was taken: ``nan`` corrupts it); the asynchronous pipelines'
driver-side moments ``rollouter.queued`` (a generation of the fully asynchronous rollouter queued,
not yet trained) and ``partial_rollout.between_chunks`` (a chunked generation with some of its tokens
generated, before the boundary where a sync may come).

Unset (production), :func:`inject` is one environment lookup. Examples::

    RLFOUNDRY_FAULT_INJECT=save.published@2          # die after the 2nd role directory is published
    RLFOUNDRY_FAULT_INJECT=update_actor@3            # die in the middle of the 3rd training step
    RLFOUNDRY_FAULT_INJECT="compute_log_prob>1:oom"  # OOM whenever log-probs run > 1 row at a time

``RLFOUNDRY_FAULT_STAMP=<file>`` appends the wall-clock time at which each fault fires, so a test can
bound how long the driver takes to notice it, apart from start-up time on a busy machine.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["ENV_VAR", "STAMP_VAR", "FaultSpec", "inject", "parse_specs", "reset"]

ENV_VAR = "RLFOUNDRY_FAULT_INJECT"
STAMP_VAR = "RLFOUNDRY_FAULT_STAMP"
ACTIONS = ("kill", "oom", "enospc", "hang", "nan", "slow")
SLOW_S = 1.0
_SPEC_RE = re.compile(r"^(?P<point>[A-Za-z_.]+)(?:@(?P<hit>\d+))?(?:>(?P<above>\d+))?(?::(?P<action>\w+))?$")
_hits: dict[str, int] = {}  # per process: how often each point was reached


@dataclass(frozen=True)
class FaultSpec:
    point: str
    hit: int | None = None  # only the N-th time the point is reached
    above: int | None = None  # only when the size passed to inject() exceeds this
    action: str = "kill"

    def fires(self, hit: int, size: int | None) -> bool:
        if self.hit is not None and hit != self.hit:
            return False
        return self.above is None or (size is not None and size > self.above)


@lru_cache(maxsize=8)
def parse_specs(text: str) -> tuple[FaultSpec, ...]:
    """Parse the environment variable's value; a malformed spec is an error, not a silent no-op."""
    specs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _SPEC_RE.match(part)
        action = (m.group("action") or "kill") if m else None
        if m is None or action not in ACTIONS:
            raise ValueError(f"{ENV_VAR}: cannot parse {part!r}; expected point[@N][>M][:{'|'.join(ACTIONS)}]")
        hit, above = m.group("hit"), m.group("above")
        specs.append(FaultSpec(m.group("point"), int(hit) if hit else None, int(above) if above else None, action))
    return tuple(specs)


def inject(point: str, size: int | None = None, tensors: Any = None, nan_key: str | None = None) -> None:
    """Fire the fault configured for ``point``, if any (see the module docstring)."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return
    specs = [s for s in parse_specs(text) if s.point == point]
    if not specs:
        return
    _hits[point] = hit = _hits.get(point, 0) + 1
    for spec in specs:
        if spec.fires(hit, size):
            _fire(spec, hit, size, tensors, nan_key)


def _fire(spec: FaultSpec, hit: int, size: int | None, tensors: Any, nan_key: str | None) -> None:
    where = f"{spec.point} (hit {hit}{'' if size is None else f', size {size}'})"
    print(f"[rlfoundry.faults] injecting {spec.action} at {where}", file=sys.stderr, flush=True)
    if os.environ.get(STAMP_VAR):
        with open(os.environ[STAMP_VAR], "a") as f:
            f.write(f"{time.time()}\n")
    if spec.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec.action == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected out-of-memory at {where}")
    elif spec.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {where})")
    elif spec.action == "hang":
        while True:
            time.sleep(3600)
    elif spec.action == "slow":
        time.sleep(SLOW_S)
    elif spec.action == "nan":
        if tensors is None or nan_key is None:
            raise ValueError(f"{ENV_VAR}: point {spec.point!r} has no tensor to fill with NaN")
        tensors[nan_key] = tensors[nan_key] * float("nan")


def reset() -> None:
    """Forget the hit counts (tests that run several trainers in one process)."""
    _hits.clear()
