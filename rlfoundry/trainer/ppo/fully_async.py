"""Fully asynchronous PPO (verl's ``fully_async_ppo_trainer``): a rollouter streams generated
samples into a bounded queue while the trainer trains on what is there.

    rollouter (a driver thread, the rollout pool):  prompts → generate → queue   (repeat)
    trainer   (the driver's main thread):           take B prompts' samples from the queue → rewards
              → old/ref log-probs, advantages, update; every T steps: pause the rollouter, send the
              weights (checkpoint engine), version + 1, resume

B = ``async_training.require_batches × actor.ppo_mini_batch_size`` prompts per step, T =
``trigger_parameter_sync_step``; the rollouter asks the engine for ``data.gen_batch_size`` prompts
(× ``rollout.n`` samples) at a time. The version is the number of weight syncs so far.

**Staleness bound.** The trainer takes samples in the order they were generated, so the step, and the
version, that will train the j-th prompt is known when it is generated: version ⌊j / (B·T)⌋. The
rollouter generates prompt j under version v only if j < B·T·(v + 1 + s), s =
``staleness_threshold`` — verl's rule that a version generates at most (1 + s) sync periods' worth of
prompts. So every sample's staleness (the trainer's version when it trains the sample minus the
version that sampled it) is at most ⌈s⌉; with s = 0 the pipeline trains on what the synchronous
trainer would, in the same order. Nothing is dropped: the rollouter waits instead (its idle time is
reported). A sync waits for the rollouter's generation in flight (with partial rollout, only for its
current chunk; with multi-turn agent loops, which then run here, until their server's next engine call). The trainer checks the bound again on every sample it takes (``Rollouter.take``):
one older than that stops the run rather than being trained on.

**Checkpoints** store the loader's position before the oldest prompt not yet trained (queued or
in flight) and the rollout pool's sampling position before those prompts' engine calls: a resumed
run generates them again under the restored weights, with the uninterrupted run's draws — none
trained twice, none skipped; the resumed run says how many (``docs/async.md``, the kill test).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlfoundry.models.hf import generation_eos_ids
from rlfoundry.protocol import DataProto
from rlfoundry.trainer.metric_utils import marked_timer
from rlfoundry.trainer.ppo.one_step_off import staleness_metrics
from rlfoundry.trainer.ppo.partial_rollout import ChunkedEngine, ChunkedGeneration
from rlfoundry.trainer.ppo.sources import SampleSource, loader_batches, rewound_sampling_state
from rlfoundry.utils import faults
from rlfoundry.utils.errors import RunAbortedError
from rlfoundry.utils.tokenizer import pad_id

__all__ = ["FullyAsyncSource", "Rollouter"]


class _Stopped(Exception):
    """The trainer stopped the rollouter while a generation waited between chunks."""


@dataclass
class _Item:
    batch: DataProto  # n samples per prompt, response_mask set
    prompts: int
    version: int  # weight syncs reflected in the weights that sampled it
    loader_state: dict  # the loader before these prompts were drawn


class Rollouter:
    """The generating side: a thread that fills a queue under the staleness bound.

    ``generate(batch_dict, boundary) -> DataProto``, where ``boundary()`` is for a generation in chunks
    (partial rollout) to call between them: it lets a requested pause happen there and returns the
    weight version to go on with; ``batches``: (loader state before, batch_dict) pairs;
    ``first_index``: prompts trained before this run started (a resumed run); ``total_prompts``:
    where to stop. ``per_sync`` = B·T prompts. ``clock``: seconds for ``take``'s timeout and the idle /
    generation timings (tests pass one they control). Every method but the thread's own is for the trainer.
    """

    def __init__(self, generate: Callable[[dict, Callable[[], int]], DataProto], batches: Iterator[tuple[dict, dict]], *,
                 per_sync: int, staleness_threshold: float, first_index: int, total_prompts: int, version: int,
                 clock: Callable[[], float] = time.monotonic):
        self._generate, self._batches, self._clock = generate, batches, clock
        self.per_sync, self.staleness, self.total = per_sync, float(staleness_threshold), total_prompts
        self.index, self.version = first_index, version  # next prompt's index; the rollout's weights
        self._cond = threading.Condition()
        self._queue: deque[_Item] = deque()
        self._paused = self._busy = self._stop = self._finished = False
        self._error: BaseException | None = None
        self._idle_s = self._gen_s = 0.0  # since the last stats() call
        self._call_idle = 0.0  # of the generation in flight: time spent paused between its chunks
        self.paused_in_flight = 0  # since the last stats() call: syncs that met a generation mid-way
        self._chunked = False  # the generation in flight has passed its first boundary (its start)
        self._in_flight: tuple[dict, int] | None = None  # (loader state before, prompts) of the generation under way
        self._thread = threading.Thread(target=self._run, name="rollouter", daemon=True)

    # ---- the thread ---------------------------------------------------------------------

    def _allowed(self, prompts: int) -> bool:
        return self.index + prompts <= math.floor(self.per_sync * (self.version + 1 + self.staleness) + 1e-9)

    def _run(self) -> None:
        try:
            while self.index < self.total:
                version = self._wait_turn()
                if version is None:
                    return
                start, self._call_idle, self._chunked = self._clock(), 0.0, False
                loader_state, batch_dict = next(self._batches)
                prompts = len(batch_dict["input_ids"])
                self._in_flight = (loader_state, prompts)
                out = self._generate(batch_dict, self._boundary)
                with self._cond:
                    self._busy, self._in_flight = False, None
                    self._gen_s += self._clock() - start - self._call_idle
                    self._queue.append(_Item(out, prompts, version, loader_state))
                    self.index += prompts
                    self._cond.notify_all()
                faults.inject("rollouter.queued")  # tests: a crash with generated, untrained samples queued
        except _Stopped:
            return
        except BaseException as err:  # noqa: BLE001 - handed to the trainer, which raises it
            with self._cond:
                self._error = err
        finally:
            with self._cond:
                self._busy, self._finished = False, True
                self._cond.notify_all()

    def _wait_turn(self) -> int | None:
        """Wait until not paused and the bound allows the next prompts; the version to sample with."""
        start = self._clock()
        with self._cond:
            while not self._stop and (self._paused or not self._allowed(self._next_size)):
                self._cond.wait()
            self._idle_s += self._clock() - start
            if self._stop:
                return None
            self._busy = True
            return self.version

    def _boundary(self) -> int:
        """Between two chunks of one generation: wait out a pause (a sync) there; the version to go on with.

        The first call comes before any chunk: a sync waited out there is not mid-way (no sample
        spans two versions), so only later ones count in ``paused_in_flight``."""
        start = self._clock()
        with self._cond:
            mid_way, self._chunked = self._chunked, True
            if self._paused:
                self.paused_in_flight += int(mid_way)
                self._busy = False
                self._cond.notify_all()
                while self._paused and not self._stop:
                    self._cond.wait()
                self._busy = True
            waited = self._clock() - start
            self._idle_s += waited
            self._call_idle += waited
            if self._stop:
                raise _Stopped
            return self.version

    # ---- the trainer's side ---------------------------------------------------------------

    def start(self, next_size: int) -> None:
        self._next_size = next_size
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)

    def take(self, prompts: int, timeout_s: float | None, trainer_version: int | None = None) -> list[_Item]:
        """The oldest ``prompts`` prompts' samples; raises the rollouter's error, or after ``timeout_s``.

        With ``trainer_version`` (the version that will train them), a sample more than
        ⌈staleness_threshold⌉ versions older is refused (``RunAbortedError``, the queue left as it was):
        the bound above makes that impossible, and this check keeps it so, rather than train on it."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            while sum(item.prompts for item in self._queue) < prompts:
                if self._error is not None:
                    raise self._error
                if self._finished:
                    raise RunAbortedError(f"the rollouter stopped after prompt {self.index} of {self.total} with "
                                          f"fewer than the {prompts} prompts a step needs queued")
                left = None if deadline is None else deadline - self._clock()
                if left is not None and left <= 0:
                    raise RunAbortedError(
                        f"no samples from the rollout pool for {timeout_s:g} s (trainer.worker_call_timeout_s): "
                        f"{len(self._queue)} queued, rollouter {'generating' if self._busy else 'waiting'} at "
                        f"version {self.version}; a rollout worker may be stuck.")
                self._cond.wait(timeout=left)
            if trainer_version is not None:
                self._refuse_stale(prompts, trainer_version)
            taken, count = [], 0
            while count < prompts:
                taken.append(self._queue.popleft())
                count += taken[-1].prompts
            self._cond.notify_all()
            return taken

    def _refuse_stale(self, prompts: int, trainer_version: int) -> None:
        count, bound = 0, math.ceil(self.staleness - 1e-9)
        for item in self._queue:
            if count >= prompts:
                return
            if trainer_version - item.version > bound:
                raise RunAbortedError(
                    f"fully async: samples generated with weight version {item.version} reached the trainer at "
                    f"version {trainer_version}, more than async_training.staleness_threshold={self.staleness:g} "
                    f"(at most {bound}) versions behind; they are not trained on. This is a bug in the "
                    "rollouter's bound: please report it with the run's log (resume_mode=auto continues from "
                    "the last checkpoint).")
            count += item.prompts

    def pause(self) -> float:
        """Stop after the generation in flight (waited for); returns the seconds waited."""
        start = self._clock()
        with self._cond:
            self._paused = True
            while self._busy:
                if self._error is not None:
                    raise self._error
                self._cond.wait(timeout=1.0)
        return self._clock() - start

    def resume(self, version: int | None = None) -> None:
        with self._cond:
            if version is not None:
                self.version = version
            self._paused = False
            self._cond.notify_all()

    def queued_calls(self) -> int:
        """Generations queued (each was one engine call unless chunked)."""
        with self._cond:
            return len(self._queue)

    def queued_prompts(self) -> int:
        with self._cond:
            return sum(item.prompts for item in self._queue)

    def position(self, current: Callable[[], dict]) -> tuple[dict, int]:
        """(loader state before the oldest untrained prompt, prompts it leaves to regenerate); paused only."""
        with self._cond:
            if self._busy:
                raise RuntimeError("Rollouter.position needs the rollouter paused")
            queued = sum(item.prompts for item in self._queue)
            in_flight = self._in_flight[1] if self._in_flight else 0  # paused between chunks (partial rollout)
            if self._queue:
                return self._queue[0].loader_state, queued + in_flight
            if self._in_flight:
                return self._in_flight[0], in_flight
            return current(), 0

    def stats(self) -> dict[str, float]:
        with self._cond:
            out = {"timing_s/rollouter_idle": self._idle_s, "timing_s/rollouter_gen": self._gen_s,
                   "async/paused_in_flight": float(self.paused_in_flight)}
            self._idle_s = self._gen_s = 0.0
            self.paused_in_flight = 0
        return out


def _refuse_curriculum(loader: Any) -> None:
    """A curriculum sampler learns from each trained batch while the rollouter, a thread of its own,
    draws from it ahead of training: the two would race on the sampler, and the curriculum would lag."""
    from rlfoundry.data.sampler import AbstractCurriculumSampler
    from rlfoundry.trainer.config import ConfigError

    if isinstance(getattr(loader, "sampler", None), AbstractCurriculumSampler):
        raise ConfigError("data.sampler is a curriculum sampler (AbstractCurriculumSampler), which the fully "
                          "asynchronous pipeline cannot feed back; use async_training.mode=one_step_off or sync, "
                          "or a sampler without update()")


class FullyAsyncSource(SampleSource):
    """Samples a ``Rollouter`` streams from a pool of its own; weight syncs every T steps."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        _refuse_curriculum(trainer.train_dataloader)
        self.step_prompts = int(trainer.config.data.train_batch_size)
        self.sync_every = int(trainer.config.async_training.trigger_parameter_sync_step)
        self.rollouter: Rollouter | None = None

    def steps_per_epoch(self) -> int:
        return max(1, len(self.trainer.train_dataloader.dataset) // self.step_prompts)

    def _start_rollouter(self) -> None:
        trainer = self.trainer
        done = trainer.state.global_steps - 1  # steps trained before this run's first (a resumed run: > 0)
        at = trainer.config.async_training
        generate = self._generation(at, trainer.rollout_wg.generate_sequences)
        self.rollouter = Rollouter(generate, loader_batches(trainer.train_dataloader, with_state=True), per_sync=self.step_prompts * self.sync_every,
                                   staleness_threshold=float(at.staleness_threshold),
                                   first_index=done * self.step_prompts,
                                   total_prompts=trainer.total_training_steps * self.step_prompts,
                                   version=done // self.sync_every)
        self.rollouter.start(int(trainer.config.data.gen_batch_size))

    def _generation(self, at: Any, call: Callable[[DataProto], DataProto]) -> Callable[[dict, Callable[[], int]], DataProto]:
        """The rollouter's ``generate(batch_dict, boundary)``: one call to the pool; with partial rollout a
        chunked generation, and with multi-turn too the agent loops here in the driver over a
        ``ChunkedEngine`` (trainer/ppo/partial_rollout.py), the boundary before each of its chunks."""
        trainer = self.trainer
        rollout = trainer.config.actor_rollout_ref.rollout
        chunked = ChunkedGeneration(call, response_length=int(trainer.config.data.max_response_length),
                                    chunk_tokens=int(at.partial_rollout_chunk_tokens), pad_id=pad_id(trainer.tokenizer),
                                    eos_ids=generation_eos_ids(trainer.tokenizer, trainer.config.actor_rollout_ref.model.path),
                                    ) if at.partial_rollout else None
        agents = engine = None
        if chunked is not None and rollout.multi_turn.enable:
            from rlfoundry.workers.rollout.agent_loop import build_agent_loop

            engine = ChunkedEngine(chunked, rollout)
            agents = build_agent_loop(engine, trainer.tokenizer, rollout)

        def generate(batch_dict: dict, boundary: Callable[[], int]) -> DataProto:
            prompts = trainer.prompts(batch_dict)
            if agents is not None:
                engine.boundary = boundary  # the rollouter runs one generation at a time
                out = agents.generate_sequences(prompts)
            elif chunked is not None:
                out = chunked.generate(prompts, int(rollout.n), boundary)
            else:
                out = call(prompts)
            return trainer.generated(out, balance=False)

        return generate

    def next_batch(self, timing: dict) -> tuple[DataProto, dict[str, float]]:
        trainer = self.trainer
        if self.rollouter is None:
            self._start_rollouter()
        with marked_timer("wait_rollout", timing):
            version = (trainer.state.global_steps - 1) // self.sync_every
            items = self.rollouter.take(self.step_prompts, trainer.config.trainer.worker_call_timeout_s,
                                        trainer_version=version)
        metrics = staleness_metrics([version - it.version for it in items for _ in range(len(it.batch))])
        batch = trainer.finish_generation(trainer.concat_generations([it.batch for it in items]))
        if "param_version_end" in batch.non_tensor_batch:  # partial rollout: samples that met a sync
            spans = batch.non_tensor_batch["param_version_end"] != batch.non_tensor_batch["param_version_start"]
            metrics["async/partial_samples_fraction"] = float(np.mean(spans.astype(bool)))
        batch, m = trainer.reward(batch, timing)
        return batch, metrics | m

    def after_update(self, timing: dict) -> dict[str, float]:
        trainer, metrics = self.trainer, {}
        if trainer.state.global_steps % self.sync_every == 0:
            with marked_timer("wait_rollout_pause", timing):
                self.rollouter.pause()
            metrics |= trainer.sync_weights(timing)
            self.rollouter.resume(version=trainer.state.global_steps // self.sync_every)
        return metrics | {"async/queue_prompts": float(self.rollouter.queued_prompts()),
                          "async/param_version": float(self.rollouter.version)} | self.rollouter.stats()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Validation and checkpoints use the rollout pool and the loader: the rollouter pauses for them."""
        if self.rollouter is None:
            yield
            return
        self.rollouter.pause()
        try:
            yield
        finally:
            self.rollouter.resume()

    def on_resume(self, state: dict[str, Any]) -> None:
        if "rollout_sampling" in state:
            self.trainer.rollout_wg.load_rollout_sampling_state(state["rollout_sampling"])
        print(f"[rlfoundry] fully async: {state.get('regenerate_prompts', 0)} prompts that were queued or being "
              "generated at the save are generated again", flush=True)

    def checkpoint_state(self) -> dict[str, Any]:
        if self.rollouter is None:
            return {}
        loader, regenerate = self.rollouter.position(self.trainer.train_dataloader.state_dict)
        # one engine call per queued item (gen_batch_size prompts); a partial rollout's chunks are not
        # counted (its draws depend on when syncs came anyway): its pool just draws afresh
        redo = 0 if self.trainer.config.async_training.partial_rollout else self.rollouter.queued_calls()
        return {"dataloader": loader, "regenerate_prompts": regenerate,
                "rollout_sampling": rewound_sampling_state(self.trainer, redo)}

    def close(self) -> None:
        if self.rollouter is not None:
            self.rollouter.stop()
