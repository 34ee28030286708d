"""Make the packaged demo policy ``rlfoundry/assets/arithmetic-policy`` from scratch, reproducibly.

1. build a tiny Qwen2 from a config (``rlfoundry.models.tiny.save_tiny_model``, seeded);
2. supervised fine-tune it with ``rlfoundry sft`` on pairs of the built-in arithmetic task that this
   script writes (seeded, ``demo_pairs``). The answers mix two styles, the bare number and "The
   answer is N.", so the policy knows the arithmetic but often states it in a form the
   exact-integer verifier rejects: the default ``rlfoundry train`` run starts near 50% and GRPO
   has a real gap to close;
3. copy the final HF directory into the package, measure it on the RL demo's validation split and
   write the numbers and the recipe into the asset's README.md.

    python scripts/make_demo_policy.py                      # the shipped policy (~15 min, 1 CPU core)
    python scripts/make_demo_policy.py --eval-only DIR      # greedy / sampled accuracy of any policy
    python scripts/make_demo_policy.py --moe                # the MoE demo's policy (rlfoundry/assets/moe-policy)

``--moe`` makes the same policy with a tiny Qwen3-MoE body instead of the Qwen2 (``MOE_MODEL``): same
data, answer styles and SFT keys, so ``rlfoundry train --config-name moe_grpo`` starts from the same
kind of gap as the default demo.

Runs single-threaded (see ``main``): a tiny model gains nothing from a second thread.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ASSET_DIR = REPO / "rlfoundry" / "assets" / "arithmetic-policy"

# The recipe. Changing any of these changes the shipped weights: keep them in the asset's README.
MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "seed": 0}
# --moe: a Qwen3-MoE, every layer 8 experts of width 96 with 2 routed per token, so a token's
# active MLP is as wide (192) as a dense Qwen3 of hidden 96 with the default 2x MLP (the cost
# benchmark's dense twin, benchmarks/moe_step_cost.py); narrower than MODEL to keep the asset
# a few MB with 8 experts a layer.
MOE_MODEL = {"arch": "qwen3_moe", "hidden_size": 96, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
             "intermediate_size": 96, "num_experts": 8, "num_experts_per_tok": 2, "seed": 0}
MOE_ASSET_DIR = REPO / "rlfoundry" / "assets" / "moe-policy"
MOE_SFT_OVERRIDES = ["trainer.experiment_name=moe-sft"]  # after SFT_OVERRIDES: the later key wins
# The SFT pairs: the arithmetic task's splits (2-digit +/-); the 128 validation problems, drawn
# first with seed 0, are the RL demo's validation set.
DATA = {"train_size": 16384, "val_size": 128, "seed": 0}
# A second answer style, "The answer is N.", in a quarter of the addition answers and three
# quarters of the subtraction ones: the policy then knows the arithmetic but states subtraction
# results in a form the exact-integer verifier rejects, a format gap GRPO closes in a few steps.
SENTENCE_RATIO_BY_OP = {"+": 0.25, "-": 0.75}
SENTENCE_TEMPLATE = "The answer is {answer}."
SFT_OVERRIDES = [
    "data.train_batch_size=64",
    "data.micro_batch_size_per_gpu=64",
    "data.max_length=64",
    "optim.lr=2e-3",
    "optim.warmup_steps_ratio=0.05",
    "optim.lr_scheduler=cosine",
    "trainer.total_training_steps=2000",
    "trainer.seed=1",
    "trainer.device=cpu",
    "trainer.logger=[console,file]",
    "trainer.project_name=rlfoundry-demo",
    "trainer.experiment_name=arithmetic-sft",
]


# --------------------------------------------------------------------------- the SFT data

def _styled_answer(prompt: str, answer: str, sentence_ratio_by_op: Mapping[str, float], rng: random.Random) -> str:
    """The bare answer, or with probability ``sentence_ratio_by_op[op]`` (``op``: the problem's first
    operator) the same answer in a sentence, which the task's exact-integer verifier rejects."""
    op = next((c for c in prompt[1:] if c in "+-*"), "+")  # prompt[1:]: a leading '-' is a sign
    ratio = float(sentence_ratio_by_op.get(op, 0.0))
    return SENTENCE_TEMPLATE.format(answer=answer) if rng.random() < ratio else answer


def demo_pairs(train_size: int, val_size: int, seed: int,
               sentence_ratio_by_op: Mapping[str, float]) -> tuple[list[dict], list[dict]]:
    """(train, val) rows ``{"prompt", "response"}`` of the arithmetic task (validation drawn first
    and excluded from training). Only training answers get the second style: validation answers
    stay bare, as the verifier wants them."""
    from rlfoundry.data.preprocess.arithmetic import generate_splits

    splits = generate_splits(train_size, val_size, seed=seed)
    rng = random.Random(seed + 2)  # generate_splits uses seed and seed + 1
    train = [{"prompt": p, "response": _styled_answer(p, a, sentence_ratio_by_op, rng)} for p, a in splits["train"]]
    return train, [{"prompt": p, "response": a} for p, a in splits["test"]]


def write_demo_data(out_dir: Path) -> tuple[Path, Path]:
    """``train.jsonl`` / ``val.jsonl`` of ``demo_pairs`` for ``data.train_files`` / ``data.val_files``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = out_dir / "train.jsonl", out_dir / "val.jsonl"
    for rows, path in zip(demo_pairs(**DATA, sentence_ratio_by_op=SENTENCE_RATIO_BY_OP), files):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


# --------------------------------------------------------------------------- evaluation

def _generate(model, tokenizer, prompts: list[str], do_sample: bool, max_new_tokens: int) -> list[str]:
    """Responses to chat-templated ``prompts`` (left-padded batch), decoded up to EOS."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, **sampling)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


@torch.no_grad()
def evaluate_policy(model_dir: str | Path, problems: list[tuple[str, str]], n_samples: int = 8,
                    seed: int = 0, max_new_tokens: int = 24) -> dict[str, float]:
    """Greedy accuracy, sampled accuracy at T=1 (mean over ``n_samples``) and pass@n_samples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfoundry.rewards.arithmetic import compute_score

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts, answers = [p for p, _ in problems], [a for _, a in problems]
    greedy = _generate(model, tokenizer, prompts, False, max_new_tokens)
    torch.manual_seed(seed)
    sampled = [_generate(model, tokenizer, prompts, True, max_new_tokens) for _ in range(n_samples)]
    hits = torch.tensor([[compute_score(s[i], answers[i]) for i in range(len(prompts))] for s in sampled])
    return {"greedy_acc": sum(compute_score(g, a) for g, a in zip(greedy, answers)) / len(answers),
            "sampled_acc": hits.mean().item(), f"pass@{n_samples}": hits.max(0).values.mean().item(),
            "greedy_number_acc": sum(_last_integer(g) == a for g, a in zip(greedy, answers)) / len(answers),
            "n_problems": len(problems)}


def _last_integer(text: str) -> str | None:
    """The number a response states, whatever its form ("85" or "The answer is 85."): separates
    arithmetic errors from format errors, which the task's exact verifier does not."""
    found = re.findall(r"-?\d+", text)
    return str(int(found[-1])) if found else None


def demo_validation_problems() -> list[tuple[str, str]]:
    """The RL demo's validation split (arithmetic task, seed 0, 128 problems, drawn first)."""
    from rlfoundry.data.preprocess.arithmetic import generate_problems

    return generate_problems(128, seed=0)


# --------------------------------------------------------------------------- making the policy

def make_policy(out_dir: Path, work_dir: Path, steps: int | None = None, model: Mapping | None = None,
                extra_overrides: list[str] = ()) -> Path:
    from rlfoundry.models.tiny import save_tiny_model
    from rlfoundry.trainer.sft_trainer import ROLE, run_sft
    from rlfoundry.checkpoint import STEP_MARKER

    base = save_tiny_model(work_dir / "init", **(model or MODEL))
    train, val = write_demo_data(work_dir / "data")
    overrides = SFT_OVERRIDES + [f"model.partial_pretrain={base}", f"trainer.default_local_dir={work_dir / 'sft'}",
                                 f"data.train_files={train}", f"data.val_files={val}", *extra_overrides]
    if steps is not None:
        overrides.append(f"trainer.total_training_steps={steps}")
    summary = run_sft(overrides)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    # the Hugging Face files only: not the resumable training state (ROLE/) or the step marker
    shutil.copytree(summary["checkpoint"], out_dir, ignore=shutil.ignore_patterns(ROLE, STEP_MARKER))
    return out_dir


def _model_line(moe: bool, size_mb: float) -> str:
    """The card's first lines: which model, how big, which command made it."""
    if moe:
        m = MOE_MODEL
        return ("# moe-policy: the policy of the MoE demo (`rlfoundry train --config-name moe_grpo`)\n\n"
                f"A tiny Qwen3-MoE (hidden {m['hidden_size']}, {m['num_layers']} layers, each with "
                f"{m['num_experts']} experts of width {m['intermediate_size']}, top-{m['num_experts_per_tok']} "
                f"routing, byte-level tokenizer, {size_mb:.1f} MB) made by\n"
                "`python scripts/make_demo_policy.py --moe`: built from a config, then ")
    return ("# arithmetic-policy: the demo policy of `rlfoundry train`\n\n"
            f"A tiny Qwen2 (hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers, byte-level tokenizer, "
            f"{size_mb:.1f} MB) made by\n`python scripts/make_demo_policy.py`: built from a config, then ")


def _write_card(out_dir: Path, scores: dict[str, float], steps: int | None, moe: bool = False) -> None:
    """A README next to the weights: what they are, how they were made, how good they are."""
    recipe = [f"data: {json.dumps(DATA)}, sentence_ratio_by_op: {json.dumps(SENTENCE_RATIO_BY_OP)}"]
    recipe += ([f"model: {json.dumps(MOE_MODEL)}"] if moe else []) + SFT_OVERRIDES
    recipe += (MOE_SFT_OVERRIDES if moe else []) + ([f"trainer.total_training_steps={steps}"] if steps else [])
    size_mb = sum(p.stat().st_size for p in out_dir.iterdir()) / 1e6
    pct = {k: f"{v:.1%}" for k, v in scores.items() if k != "n_problems"}
    (out_dir / "README.md").write_text(
        _model_line(moe, size_mb) +
        "`rlfoundry sft` on pairs of the built-in\n`rlfoundry/arithmetic` task (2-digit `+`/`-`) that the "
        "script writes, with the recipe below.\n\nThe SFT answers come in two styles, the bare number (what the task's exact-integer "
        "verifier\naccepts) and the sentence \"The answer is N.\" (a quarter of the additions, three "
        "quarters of\nthe subtractions). So the policy knows the arithmetic but often states a "
        "subtraction result in\nthe rejected form: RL with the verifier's reward has a real gap to "
        "close.\n\n"
        f"Measured on the RL demo's validation split (data.synthetic seed 0, {scores['n_problems']} problems):\n\n"
        f"| greedy accuracy | sampled (T=1) accuracy | pass@8 (T=1) | greedy, number right in any form |\n"
        f"|---|---|---|---|\n| {pct['greedy_acc']} | {pct['sampled_acc']} | {pct['pass@8']} | "
        f"{pct['greedy_number_acc']} |\n\n```\n" + "\n".join(recipe) + "\n```\n"
    )
    (out_dir / "demo_policy_eval.json").write_text(json.dumps(scores, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: the asset directory of the policy made")
    parser.add_argument("--moe", action="store_true", help="the MoE demo's policy (MOE_MODEL) instead of the Qwen2")
    parser.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=None, help="override the SFT step count (experiments)")
    parser.add_argument("--eval-only", type=Path, default=None, help="only evaluate this HF directory")
    args = parser.parse_args(argv)
    # One thread: the same weights on any machine (thread count changes float summation order), and
    # faster for a model this small on a shared CPU.
    torch.set_num_threads(1)
    if args.eval_only is not None:
        print(json.dumps(evaluate_policy(args.eval_only, demo_validation_problems()), indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = make_policy(args.out or (MOE_ASSET_DIR if args.moe else ASSET_DIR), args.work_dir or Path(tmp),
                          args.steps, MOE_MODEL if args.moe else MODEL, MOE_SFT_OVERRIDES if args.moe else [])
    scores = evaluate_policy(out, demo_validation_problems())
    _write_card(out, scores, args.steps, args.moe)
    print(f"demo policy written to {out}\n{json.dumps(scores, indent=2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
