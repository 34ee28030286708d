"""Make the packaged tool demo policy ``rlfoundry/assets/calculator-policy`` reproducibly.

The task: 2-digit × 2-digit products (``data.synthetic`` with ``ops='*'``), which the tiny policy
cannot multiply in its head; it is offered a calculator (``rlfoundry/config/tools/calculator.yaml``).

1. start from the default demo policy (``rlfoundry/assets/arithmetic-policy``: it knows the prompt
   format and how to state a number) with the tool-aware chat template;
2. ``rlfoundry sft`` stage 1 (2000 steps): 30% of first turns call the calculator with the problem's
   expression, the rest answer directly (mostly wrong); every problem also gets a read-back pair
   (after the call and the tool's answer, state that answer). This is where the copying is learned;
3. stage 2 (500 steps, lower rate): the same pairs with 10% calls, so that the policy *can* use the
   tool but rarely does: greedy decoding answers directly, and sampling calls the tool about one
   time in ten. GRPO with the exact-answer reward (``rlfoundry train --config-name calculator_grpo``)
   then has something to discover;
4. copy the HF files into the package and write the measurements into the asset's README.md.

    python scripts/make_tool_demo_policy.py                 # the shipped policy (~50 min, 1 CPU core)
    python scripts/make_tool_demo_policy.py --eval-only DIR # the measurements of any policy

Runs single-threaded, as scripts/make_demo_policy.py does (the same weights on any machine).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ASSET_DIR = REPO / "rlfoundry" / "assets" / "calculator-policy"
BASE_ASSET = REPO / "rlfoundry" / "assets" / "arithmetic-policy"

# The recipe. Changing any of these changes the shipped weights: keep them in the asset's README.
DATA = {"train_size": 9000, "val_size": 128, "seed": 0, "digits": 2, "ops": "*"}  # val: the RL demo's split
STAGES = [  # (share of first turns that call the tool, row seed, SFT overrides)
    (0.3, 5, ["optim.lr=2e-3", "optim.warmup_steps_ratio=0.03", "trainer.total_training_steps=2000"]),
    (0.1, 6, ["optim.lr=5e-4", "optim.warmup_steps_ratio=0.0", "trainer.total_training_steps=500"]),
]
SFT_OVERRIDES = ["data.max_length=300", "data.train_batch_size=32", "data.micro_batch_size_per_gpu=32",
                 "optim.lr_scheduler=cosine", "trainer.total_epochs=10", "trainer.test_freq=250",
                 "trainer.save_freq=500", "trainer.seed=1", "trainer.device=cpu", "trainer.logger=[console,file]"]


def _tools_line() -> str:
    """The system line the tiny chat template renders for the calculator (what RL prompts will show)."""
    from rlfoundry.tools.registry import initialize_tools_from_config

    [tool] = initialize_tools_from_config(REPO / "rlfoundry" / "config" / "tools" / "calculator.yaml")
    f = tool.get_openai_tool_schema().function
    return (f"Tools: {f.name}({', '.join(f.parameters.properties)}). "
            'Call: <tool_call>{"name": ..., "arguments": {...}}</tool_call>')


def call_text(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


def sft_rows(problems: list[tuple[str, str]], p_call: float, rng: random.Random) -> list[dict]:
    """Per problem: a first turn (a call with probability ``p_call``, else the direct answer) and a
    read-back pair (the call and the tool's answer in the prompt; the answer as the response)."""
    system = {"role": "system", "content": _tools_line()}
    rows = []
    for prompt, answer in problems:
        user = [system, {"role": "user", "content": prompt}]
        expression = prompt.rstrip("=")
        rows.append({"prompt": user, "response": call_text(expression) if rng.random() < p_call else answer})
        rows.append({"prompt": user + [{"role": "assistant", "content": call_text(expression)},
                                       {"role": "tool", "content": answer}], "response": answer})
    return rows


def problems() -> dict[str, list[tuple[str, str]]]:
    from rlfoundry.data.preprocess.arithmetic import ArithmeticSpec, generate_splits

    spec = ArithmeticSpec(digits=DATA["digits"], ops=DATA["ops"])
    return generate_splits(DATA["train_size"], DATA["val_size"], seed=DATA["seed"], spec=spec)


def write_stage_data(out_dir: Path, p_call: float, seed: int) -> tuple[Path, Path]:
    """``sft.jsonl`` (shuffled) and ``sft_val.jsonl`` (validation problems, every first turn a call)."""
    splits, rng = problems(), random.Random(seed)
    train = sft_rows(splits["train"], p_call, rng)
    rng.shuffle(train)
    val = sft_rows(splits["test"], 1.0, rng)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "sft.jsonl", out_dir / "sft_val.jsonl"
    for rows, path in zip((train, val), paths):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def start_policy(work_dir: Path) -> Path:
    """The default demo policy with the chat template that renders tools."""
    from rlfoundry.models.tiny import CHAT_TEMPLATE

    base = work_dir / "base"
    shutil.copytree(BASE_ASSET, base, dirs_exist_ok=True)
    (base / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return base


def run_stage(index: int, model: Path, work_dir: Path) -> Path:
    from rlfoundry.trainer.sft_trainer import run_sft

    p_call, seed, overrides = STAGES[index]
    train, val = write_stage_data(work_dir / f"stage{index + 1}", p_call, seed)
    summary = run_sft(SFT_OVERRIDES + overrides + [
        f"model.partial_pretrain={model}", f"data.train_files={train}", f"data.val_files={val}",
        f"trainer.default_local_dir={work_dir / f'stage{index + 1}' / 'sft'}"])
    return Path(summary["checkpoint"])


# --------------------------------------------------------------------------- measurements

@torch.no_grad()
def evaluate_policy(model_dir: str | Path, n: int = 128) -> dict[str, float]:
    """On the validation problems, greedy: how often the first turn calls the tool, how often a direct
    first turn is right, how often a call copies the expression exactly (the call's opening forced),
    and how often the answer after the tool's reply states it exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    system = {"role": "system", "content": _tools_line()}
    opening = call_text("\x00").split("\x00")[0]

    def greedy(chat: list[dict], prefix: str = "") -> str:
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + prefix
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        out = model.generate(ids, max_new_tokens=80, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    counts = dict.fromkeys(("calls", "direct_right", "copies_expression", "reads_back"), 0)
    val = problems()["test"][:n]
    for prompt, answer in val:
        chat = [system, {"role": "user", "content": prompt}]
        first = greedy(chat)
        counts["calls"] += first.startswith("<tool_call>")
        counts["direct_right"] += first.strip() == answer
        counts["copies_expression"] += greedy(chat, opening).startswith(prompt.rstrip("=") + '"')
        after = chat + [{"role": "assistant", "content": call_text(prompt.rstrip("="))}, {"role": "tool", "content": answer}]
        counts["reads_back"] += greedy(after).strip() == answer
    return {k: v / len(val) for k, v in counts.items()} | {"n_problems": len(val)}


def _write_card(out_dir: Path, scores: dict[str, float]) -> None:
    pct = {k: f"{v:.1%}" for k, v in scores.items() if k != "n_problems"}
    recipe = [f"data: {json.dumps(DATA)}"] + [f"stage {i + 1}: p_call={p} seed={s} {' '.join(o)}"
                                               for i, (p, s, o) in enumerate(STAGES)] + SFT_OVERRIDES
    (out_dir / "README.md").write_text(
        "# calculator-policy: the tool demo policy (`rlfoundry train --config-name calculator_grpo`)\n\n"
        "The default demo policy (`arithmetic-policy`) fine-tuned by `python scripts/make_tool_demo_policy.py` "
        "on 2-digit ×\n2-digit products with a calculator tool: it learned the hermes call and reading the "
        "answer back, but\ncalls rarely (greedy: never), and cannot multiply in its head.\n\n"
        f"Greedy, on the RL demo's validation split ({scores['n_problems']} problems):\n\n"
        "| first turn calls the tool | direct answer right | call copies the expression | states the tool's answer |\n"
        f"|---|---|---|---|\n| {pct['calls']} | {pct['direct_right']} | {pct['copies_expression']} | "
        f"{pct['reads_back']} |\n\n```\n" + "\n".join(recipe) + "\n```\n")
    (out_dir / "demo_policy_eval.json").write_text(json.dumps(scores, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSET_DIR)
    parser.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--from-stage", type=int, default=1, help="start at this stage (2: --stage1 is given)")
    parser.add_argument("--stage1", type=Path, default=None, help="stage 1's HF directory, with --from-stage 2")
    parser.add_argument("--eval-only", type=Path, default=None, help="only measure this HF directory")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.eval_only is not None:
        print(json.dumps(evaluate_policy(args.eval_only), indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        model = args.stage1 if args.from_stage == 2 else run_stage(0, start_policy(work), work)
        model = run_stage(1, model, work)
        from rlfoundry.trainer.sft_trainer import ROLE
        from rlfoundry.checkpoint import STEP_MARKER

        if args.out.exists():
            shutil.rmtree(args.out)
        # the Hugging Face files only: not the resumable training state (ROLE/) or the step marker
        shutil.copytree(model, args.out, ignore=shutil.ignore_patterns(ROLE, STEP_MARKER))
    scores = evaluate_policy(args.out)
    _write_card(args.out, scores)
    print(f"tool demo policy written to {args.out}\n{json.dumps(scores, indent=2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
