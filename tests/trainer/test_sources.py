"""Sample sources on a stand-in trainer: what each step takes from the loader, and the loader
position a checkpoint records after the step (so a resumed run neither repeats nor skips a batch)."""

from __future__ import annotations

from types import SimpleNamespace

from rlfoundry.trainer.ppo.one_step_off import OneStepOffSource
from rlfoundry.trainer.ppo.sources import SyncSource, loader_batches


class _Loader:
    """Batches 0, 1, 2, ... of an epoch of ``n``; ``state_dict`` is the next batch's index."""

    def __init__(self, n: int):
        self.n, self.next = n, 0

    def __iter__(self):
        while self.next < self.n:
            self.next += 1
            yield {"batch": self.next - 1}
        self.next = 0

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"next": self.next}


class _Batch(SimpleNamespace):
    def __len__(self):
        return 1


class _Future:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


def _trainer(loader: _Loader, total: int) -> SimpleNamespace:
    t = SimpleNamespace(train_dataloader=loader, total_training_steps=total, state=SimpleNamespace(global_steps=0),
                        trained=[])
    t.prompts = lambda batch_dict: batch_dict
    t.generate = lambda batch_dict, timing, balance=True: _Batch(meta_info={}, batch_dict=batch_dict)
    t.generated = lambda out: _Batch(meta_info={}, batch_dict=out)
    t.reward = lambda batch, timing: (batch, {})
    t.reward_in_background = t.reward  # the synchronous source's way in (launch_reward_fn_async)
    t.sync_weights = lambda timing: {}
    calls = []  # the stand-in pool's generation calls (an engine seeds each call's draws by their count)

    def future(p):
        calls.append(p)
        return _Future(p)

    t.rollout_wg = SimpleNamespace(generate_sequences=SimpleNamespace(future=future),
                                   rollout_sampling_state=lambda: {"seed": 7, "calls": len(calls)})
    return t


def _run(source, trainer, steps: int) -> list[int]:
    taken = []
    for _ in range(steps):
        trainer.state.global_steps += 1
        batch, _ = source.next_batch({})
        taken.append(batch.batch_dict["batch"])
    return taken


def test_loader_batches_roll_over_epochs_and_report_the_state_before_each():
    loader = _Loader(2)
    got = [next(it) for it in [loader_batches(loader, with_state=True)] for _ in range(3)]
    assert [(s["next"], b["batch"]) for s, b in got] == [(0, 0), (1, 1), (0, 0)]


def test_the_sync_source_takes_one_batch_per_step():
    trainer = _trainer(_Loader(5), total=3)
    assert _run(SyncSource(trainer), trainer, 3) == [0, 1, 2]


def test_one_step_off_checkpoints_the_loader_before_the_batch_in_flight_and_after_the_last_one():
    trainer = _trainer(_Loader(10), total=3)
    source = OneStepOffSource(trainer)
    assert _run(source, trainer, 2) == [0, 1]
    # step 2 started batch 2's generation: a resume must generate batch 2 again, with the pool's sampling
    # counter where it was before that generation (2 calls), so the batch gets the same draws
    assert source.checkpoint_state() == {"dataloader": {"next": 2}, "rollout_sampling": {"seed": 7, "calls": 2}}
    assert _run(source, trainer, 1) == [2]
    # the last step starts nothing: a resume with a larger budget continues at batch 3, not 2
    assert source.checkpoint_state() == {"dataloader": {"next": 3}, "rollout_sampling": {"seed": 7, "calls": 3}}
