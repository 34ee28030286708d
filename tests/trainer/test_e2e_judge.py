"""A generative reward model (LLM judge) end to end: a tiny judge fine-tuned with ``rlfoundry sft`` to
write verdicts scores a fixed set of responses as it was taught, its malformed judgements cost a
score and never the step, it trains a policy through ``main_ppo`` (colocated, and in a pool of its
own) without its weights ever changing, and the judge's settings that cannot work stop the run
before any model loads."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.protocol import DataProto
from rlfoundry.rewards.judge import parse_verdict
from tests.trainer import _e2e as E

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

TEMPLATE = "Q:{question}\nRef:{ground_truth}\nA:{response}\n"
# (question, ground truth, response, what the judge is taught to write, the score that gives)
FIXED = [
    ("12+7=", "19", "19", "[[YES]]", 1.0),
    ("12+7=", "19", "18", "[[NO]]", 0.0),
    ("40-15=", "25", "25", "[[YES]]", 1.0),
    ("40-15=", "25", "52", "[[NO]]", 0.0),
    ("3+3=", "6", "6", "[[YES]]", 1.0),
    ("3+3=", "6", "9", "[[NO]]", 0.0),
    ("88-8=", "80", "??", "maybe later", -1.0),  # no verdict: failure_score
    ("5+9=", "14", "14!", "[[PERHAPS]]", -1.0),  # a verdict not in the table: failure_score
]
ERRORS = [None] * 6 + ["no_verdict", "unknown_verdict"]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A tiny Qwen2 (head_dim 32, which vLLM's CPU kernels need) fine-tuned by ``rlfoundry sft`` on the
    fixed judgements, prompted with the template as the judge will be."""
    from rlfoundry.models.tiny import save_tiny_model
    from rlfoundry.rewards.judge import JudgeTemplate
    from rlfoundry.trainer.sft_trainer import main

    root = tmp_path_factory.mktemp("judge")
    base = save_tiny_model(root / "base", num_heads=2, num_kv_heads=1, seed=3)
    (root / "template.txt").write_text(TEMPLATE)
    template = JudgeTemplate.load(str(root / "template.txt"), "verdict")
    rows = [{"prompt": template.render(question=q, ground_truth=g, response=r), "response": verdict}
            for q, g, r, verdict, _ in FIXED]
    (root / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows * 8))
    args = [f"model.partial_pretrain={base}", f"trainer.default_local_dir={root / 'run'}",
            f"data.train_files={root / 'pairs.jsonl'}", f"data.val_files={root / 'pairs.jsonl'}",
            "data.max_length=64", "data.train_batch_size=16", "data.micro_batch_size_per_gpu=16",
            "optim.lr=5e-3", "optim.warmup_steps_ratio=0", "trainer.total_epochs=40", "trainer.save_freq=-1",
            "trainer.test_freq=-1", "trainer.logger=[file]", "trainer.device=cpu"]
    assert main(args) == 0
    return root / "run" / "global_step_160"


def judge_overrides(judge_dir, *extra: str) -> list[str]:
    return ["reward.reward_model.enable=true", f"reward.reward_model.model_path={judge_dir}",
            f"reward.reward_model.prompt_template={judge_dir.parent.parent / 'template.txt'}",
            "reward.reward_model.failure_score=-1", "reward.reward_model.rollout.prompt_length=96",
            "reward.reward_model.rollout.response_length=16", *extra]


def fixed_batch(extra_rows: int = 0) -> DataProto:
    """The fixed responses as a rollout batch of the arithmetic policy (byte tokenizer), plus
    ``extra_rows`` whose response is too long for the judge's prompt_length."""
    tok = build_tokenizer()
    rows = [(q, g, r) for q, g, r, *_ in FIXED] + [("1+1=", "2", "2" * 80)] * extra_rows
    prompts = [tok.encode(q) for q, _, _ in rows]
    responses = [tok.encode(r) + [tok.eos_token_id] for _, _, r in rows]
    tp, tr = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.full((len(rows), tp), tok.pad_token_id)
    response_ids = torch.full((len(rows), tr), tok.pad_token_id)
    response_mask = torch.zeros(len(rows), tr, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[i, tp - len(p):], response_ids[i, : len(r)] = torch.tensor(p), torch.tensor(r)
        response_mask[i, : len(r)] = 1
    attention = torch.cat([(prompt_ids != tok.pad_token_id).long(), response_mask], 1)
    return DataProto.from_dict(
        tensors={"prompts": prompt_ids, "responses": response_ids, "response_mask": response_mask,
                 "attention_mask": attention, "input_ids": torch.cat([prompt_ids, response_ids], 1)},
        non_tensors={"data_source": np.array(["rlfoundry/arithmetic"] * len(rows), dtype=object),
                     "raw_prompt": np.array([[{"role": "user", "content": q}] for q, _, _ in rows], dtype=object),
                     "reward_model": np.array([{"ground_truth": g, "style": "model"} for _, g, _ in rows], dtype=object)})


# The judge on another engine (tests/workers/test_rollout_contract.py runs it for vLLM and SGLang in
# their environments): the fixed set, then one GRPO step. A file, as SGLang's processes re-import it.
ENGINE_SCRIPT = r"""
import json, sys
from pathlib import Path
from rlfoundry.trainer.config import load_config
from rlfoundry.trainer.main_ppo import build_trainer
from tests.trainer import _e2e as E
from tests.trainer.test_e2e_judge import fixed_batch, judge_overrides

if __name__ == "__main__":
    judge, run_dir, engine = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    overrides = judge_overrides(judge, f"reward.reward_model.rollout.name={engine}", "trainer.total_training_steps=1",
                                "reward.reward_model.rollout.dtype=float32", "reward.reward_model.rollout.max_num_seqs=16")
    trainer = build_trainer(load_config(E.tiny_overrides("rlfoundry://arithmetic-policy", run_dir, *overrides)))
    out = trainer.judge.compute_rm_score(fixed_batch(extra_rows=1))
    summary = trainer.fit()
    rollout = trainer.judge_wg.worker.workers["judge"].rollout
    print("RESULT " + json.dumps({"engine": type(rollout).__name__, "syncs": rollout.syncs, "step": summary["global_step"],
                                  "texts": list(out.non_tensor_batch["judge_text"]),
                                  "errors": list(out.non_tensor_batch["judge_error"])}))
    rollout.shutdown()
"""


def check_engine_result(stdout: str, engine: str) -> None:
    """The judge on ``engine`` wrote what the HF engine writes, took no weight sync, and trained a step."""
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["engine"] == engine and result["step"] == 1
    assert result["syncs"] == 0  # its weights are the checkpoint's, start to end
    assert result["texts"] == [v for *_, v, _ in FIXED] + [None]
    assert result["errors"] == ERRORS + ["prompt_too_long"]


def judge_module(trainer):
    return trainer.judge_wg.worker.workers["judge"].rollout.module


def test_the_sft_judge_scores_the_fixed_responses_as_taught_and_its_failures_are_contained(judge_dir, tmp_path):
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import build_trainer

    trainer = build_trainer(load_config(E.tiny_overrides("rlfoundry://arithmetic-policy", tmp_path,
                                                         *judge_overrides(judge_dir))))
    batch = fixed_batch(extra_rows=2)
    out = trainer.judge.compute_rm_score(batch)
    texts, errors = list(out.non_tensor_batch["judge_text"]), list(out.non_tensor_batch["judge_error"])
    assert texts[: len(FIXED)] == [verdict for *_, verdict, _ in FIXED]
    assert [float(s) for s in out.batch["judge_scores"].sum(-1)] == [s for *_, s in FIXED] + [-1.0, -1.0]
    assert errors == ERRORS + ["prompt_too_long"] * 2 and texts[-2:] == [None, None]
    # the score sits on each response's last token, as token_level_scores hold it
    last = batch.batch["response_mask"].sum(-1) - 1
    assert torch.equal(out.batch["judge_scores"].nonzero()[:, 1], last[out.batch["judge_scores"].sum(-1) != 0])
    result = trainer.reward_fn(batch.union(out), return_dict=True)
    assert result["reward_metrics"]["reward/errors"] == 4 and result["reward_metrics"]["reward/errors/judge"] == 4
    assert torch.equal(result["reward_tensor"], out.batch["judge_scores"])  # the judge alone (rule weight 0)


def _expected(batch: dict) -> list[float]:
    """Each sample's score from the judgement the batch carries: the verdict, else failure_score."""
    return [(-1.0 if err else parse_verdict(text, {"YES": 1.0, "NO": 0.0})[0])
            for text, err in zip(batch["judge_text"], batch["judge_error"])]


def test_grpo_with_the_judge_trains_the_policy_and_never_changes_the_judge(judge_dir, tmp_path):
    from safetensors.torch import load_file

    run = E.train(E.tiny_overrides("rlfoundry://arithmetic-policy", tmp_path, *judge_overrides(judge_dir)),
                  keep_trainer=True)
    on_disk = load_file(judge_dir / "model.safetensors")
    for name, param in judge_module(run.trainer).named_parameters():
        assert torch.equal(param.detach().cpu(), on_disk[name]), name  # bit-identical after two updates
    assert all(not p.requires_grad for p in judge_module(run.trainer).parameters())
    for n, batch in enumerate(run.batches, start=1):
        assert E.sequence_scores(batch).tolist() == _expected(batch)
        record = run.step(n)
        assert record["reward/errors"] == sum(e is not None for e in batch["judge_error"])
        assert record["reward/errors/judge"] == record["reward/errors"]
    assert run.step(2)["actor/pg_loss"] == run.step(2)["actor/pg_loss"]  # finite, the actor updated
    again = run.trainer.judge.compute_rm_score(fixed_batch())
    assert list(again.non_tensor_batch["judge_text"]) == [v for *_, v, _ in FIXED]


@pytest.fixture
def release_ray():
    """The Ray back end's trainer starts Ray in this process and keeps its pools reserved: end it."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.mark.parametrize("backend", ["process", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_judge_in_its_own_pool_weighed_with_the_rule_score(backend, judge_dir, tmp_path, release_ray):
    from rlfoundry.rewards.default import default_compute_score

    run = E.train(E.tiny_overrides("rlfoundry://arithmetic-policy", tmp_path, f"trainer.worker_backend={backend}",
                                   "trainer.total_training_steps=1", "reward.weights.rule=1", "reward.weights.judge=0.5",
                                   "reward.reward_model.enable_resource_pool=true", *judge_overrides(judge_dir)),
                  keep_trainer=True)
    assert run.trainer.judge_wg.world_size == 1 and run.trainer.judge_wg is not run.trainer.actor_rollout_wg
    tok = build_tokenizer()
    batch = run.batches[0]
    lengths = batch["response_mask"].sum(-1)
    texts = [tok.decode(r[:n].tolist(), skip_special_tokens=True) for r, n in zip(batch["responses"], lengths)]
    rule = [default_compute_score("rlfoundry/arithmetic", t, rm["ground_truth"]) for t, rm in zip(texts, batch["reward_model"])]
    expected = [r + 0.5 * j for r, j in zip(rule, _expected(batch))]
    assert E.sequence_scores(batch).tolist() == pytest.approx(expected)
    again = run.trainer.judge.compute_rm_score(fixed_batch())
    assert list(again.non_tensor_batch["judge_text"]) == [v for *_, v, _ in FIXED]


@pytest.mark.parametrize("extra, message", [
    (["reward.reward_model.enable=true"], "needs reward.reward_model.model_path"),
    (["reward.reward_model.enable=true", "reward.reward_model.model_path=MODEL",
      "reward.reward_model.rollout.n=2"], "one judgement per response"),
    (["reward.reward_model.enable=true", "reward.reward_model.model_path=MODEL",
      "reward.reward_model.prompt_template=BLIND"], "has no {response} placeholder"),
    (["reward.reward_model.enable=true", "reward.reward_model.model_path=MODEL", "reward_model.enable=true",
      "reward_model.model.path=MODEL"], "enable one of them"),
    (["reward.reward_model.enable=true", "reward.reward_model.model_path=CRITIC"],
     "ForTokenClassification, a reward model that scores without writing text"),
])
def test_judge_settings_that_cannot_work_exit_2_with_the_key(extra, message, tiny_model_dir, tiny_critic_dir, tmp_path):
    blind = tmp_path / "blind.txt"
    blind.write_text("{question}")
    subs = {"MODEL": str(tiny_model_dir), "BLIND": str(blind), "CRITIC": str(tiny_critic_dir)}
    extra = [arg.replace(k, v) for arg in extra for k, v in [max(((k, v) for k, v in subs.items() if k in arg),
                                                                 default=("", ""))]]
    proc = subprocess.run([sys.executable, "-m", "rlfoundry", "train", *E.tiny_overrides(tiny_model_dir, tmp_path),
                           *extra], capture_output=True, text=True, env=E.subprocess_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
