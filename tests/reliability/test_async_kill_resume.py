"""SIGKILL the asynchronous pipelines at 10 chosen moments; resumed with ``resume_mode=auto``, each run
trains every prompt of the epoch exactly once and no step twice, and at staleness 0 equals the
uninterrupted run step for step.

The moments are fault points (``RLFOUNDRY_FAULT_INJECT``, ``rlfoundry/utils/faults.py``) that SIGKILL
the driver (which hosts the trainer's rank 0 and the rollouter thread; the rollout pool's processes
exit with it): during a weight sync, with generated samples queued, between the chunks of a partial
rollout, in an update with the next batch in flight, and at four points of a checkpoint write. Each
lineage is killed several times in a row (every resume is itself killed once more, until the last
run finishes), so resuming a resumed run is covered too.

Evidence comes from the runs' own records: ``metrics.jsonl`` (one line per step, as written) and the
rollout data dump (``trainer.rollout_data_dir``: per step, every trained sample's data-set index and
the policy version that sampled it). After each kill the ``latest`` pointer must name an intact
checkpoint (every file matches its recorded SHA-256).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from rlfoundry.checkpoint import layout as ckpt_dirs
from tests.reliability._harness import SIGKILLED, assert_same_metrics, latest_step, overrides, raw_records, run_trainer

pytestmark = pytest.mark.slow

STEPS, PROMPTS, N = 8, 16, 2  # one epoch of the 16 synthetic prompts, 2 per step, 2 samples each

# (overlay, extra overrides, kills). A kill is a fault spec; the hit counts are per process, i.e. per
# attempt. 10 kills in all.
LINEAGES = {
    "fully_async_staleness0": ("fully_async_ppo_trainer", ["async_training.staleness_threshold=0"], [
        # prompt 7 generated and queued (it needs version 3: step 2's checkpoint is complete), untrained
        "rollouter.queued@7",
        "save.staged@1",  # the save of step 4: actor shards written, not published
        "checkpoint_engine.send_bucket@4",  # resumed at 2: the sync at start, after 3 and 4, then 5's
        "save.step_marked@1",  # step 6 complete, the pointer not yet moved: step 4 resumes
    ]),
    "fully_async_partial": ("fully_async_ppo_trainer", [
        "async_training.staleness_threshold=1", "async_training.partial_rollout=true",
        "async_training.partial_rollout_chunk_tokens=1"], [
        # a generation half done, samples queued ahead of it. Up to 3 hits per prompt (4 one-token
        # chunks); with staleness 1 no more than 24 hits come before step 3's sync, after step 2's save
        "partial_rollout.between_chunks@25",
        "save.trainer_state@2",  # shards published, data.pt written, the step not yet marked complete
        "update_actor@2",  # a step's update, the rollouter generating ahead
    ]),
    "one_step_off": ("one_step_off_ppo_trainer", [], [
        "update_actor@3",  # the next batch in flight on the rollout pool
        "checkpoint_engine.send_bucket@3",  # the sync before the next batch's generation starts
        "save.published@1",  # the actor's directory published, the trainer state not written
    ]),
}


def _argv(model: Path, reward: Path, run: Path, config: str, extra: list[str]) -> list[str]:
    return ["--config-name", config, *overrides(
        model, run / "ckpt", reward, STEPS, "rollout.n_gpus_per_node=1", "data.gen_batch_size=1",
        "async_training.require_batches=1", "trainer.save_freq=2", "trainer.max_actor_ckpt_to_keep=2",
        f"data.synthetic.train_size={PROMPTS}", f"trainer.rollout_data_dir={run / 'gens'}", *extra)]


def _trained(run: Path) -> dict[int, list[dict]]:
    return {int(p.stem): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted((run / "gens").glob("*.jsonl"))}


def _intact_pointer(ckpt: Path) -> None:
    """The ``latest`` pointer (if any) names a complete step whose files match their checksums."""
    step = latest_step(ckpt)
    if step is not None:
        ckpt_dirs.verify_step_dir(ckpt / f"global_step_{step}")
    newest = ckpt_dirs.find_latest_ckpt_path(ckpt, verify=True)
    assert (newest is None) == (step is None), (newest, step)


def _run_lineage(model: Path, reward: Path, run: Path, config: str, extra: list[str], kills: list[str]):
    argv = _argv(model, reward, run, config, extra)
    resumed_from = []
    for n, fault in enumerate(kills):
        result = run_trainer(argv, run / f"log{n}.txt", env={"RLFOUNDRY_FAULT_INJECT": fault})
        point = fault.split("@")[0]
        assert result.exitcode == SIGKILLED, (fault, result.log[-3000:])
        assert f"injecting kill at {point}" in result.log, (fault, result.log[-3000:])
        assert f"finished at step" not in result.log
        _intact_pointer(run / "ckpt")
        resumed_from.append(result.resumed_from_step)
    final = run_trainer(argv, run / "final.txt")
    assert final.exitcode == 0, final.log[-3000:]
    assert final.resumed_from_step is not None
    return resumed_from + [final.resumed_from_step]


def _check_exactly_once(run: Path) -> dict[int, list[dict]]:
    records = raw_records(run / "ckpt")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # no step twice, none missing
    trained = _trained(run)
    assert sorted(trained) == list(range(1, STEPS + 1))
    per_step = {step: Counter(r["index"] for r in rows) for step, rows in trained.items()}
    total = sum(per_step.values(), Counter())
    # every prompt of the epoch trained exactly once: its N samples, all in one step
    assert total == Counter({i: N for i in range(PROMPTS)}), total
    for step, counts in per_step.items():
        assert set(counts.values()) == {N} and len(counts) == PROMPTS // STEPS, (step, counts)
    return trained


@pytest.fixture(scope="module")
def straight_staleness0(tiny_model_dir, reward_file, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight")
    config, extra, _ = LINEAGES["fully_async_staleness0"]
    result = run_trainer(_argv(tiny_model_dir, reward_file, run, config, extra), run / "log.txt")
    assert result.exitcode == 0, result.log[-3000:]
    return run


@pytest.mark.parametrize("lineage", sorted(LINEAGES))
@pytest.mark.numerics
def test_killed_async_runs_resume_without_losing_or_repeating_a_prompt(lineage, tiny_model_dir, reward_file,
                                                                       straight_staleness0, tmp_path):
    config, extra, kills = LINEAGES[lineage]
    resumed = _run_lineage(tiny_model_dir, reward_file, tmp_path, config, extra, kills)
    assert all(step is not None for step in resumed[1:]), resumed  # every later attempt resumed
    trained = _check_exactly_once(tmp_path)
    for step, rows in trained.items():  # the staleness bound, from the samples' own versions
        lag = {step - 1 - r["param_version"] for r in rows}
        assert max(lag) <= (0 if lineage == "fully_async_staleness0" else 1), (step, lag)
    if lineage != "fully_async_staleness0":
        return
    straight = _trained(straight_staleness0)
    straight_records = {r["step"]: r for r in raw_records(straight_staleness0 / "ckpt")}
    for step, record in ((r["step"], r) for r in raw_records(tmp_path / "ckpt")):
        assert [r["index"] for r in trained[step]] == [r["index"] for r in straight[step]], step
        assert [r["output"] for r in trained[step]] == [r["output"] for r in straight[step]], step
        assert_same_metrics(straight_records[step], record, f"step {step}")
