"""Make the packaged vision demo policy ``rlfoundry/assets/vision-policy`` reproducibly.

The task: "What colour is the shape?" on a 32x32 image with one filled square or circle in one of
four colours (``rlfoundry preprocess shapes --question colour``; ``data.synthetic.task=shape_colour``).

1. build the tiny Qwen2-VL (``rlfoundry/models/tiny_vlm.py``, seed ``SEED``);
2. stage 1: supervised fine-tuning on the right colour names (the perception and the answer format);
3. stage 2: the same pairs at a lower rate where only ``P_TRUE`` of the answers are the image's colour
   and the rest say "red", so that the policy *can* name each colour but prefers "red": greedy
   decoding answers "red" to almost every image (right on the red quarter), and sampling names
   the image's colour about ``P_TRUE`` of the time. GRPO with the exact-word reward
   (``rlfoundry train --config-name vision_grpo``) then has something to discover, as the tool demo's
   policy (``scripts/make_tool_demo_policy.py``) calls its calculator rarely;
4. save the Hugging Face files (model + processor) into the package and write the measurements into
   the asset's README.md.

Each stage is one ``rlfoundry sft`` run (``run_sft``, the trainer's entry point) from the last one's
output, on the stage's pairs written as verl's multimodal rows (the RL prompt ``<image>`` + question,
the PNG in ``images``, the answer in ``response``): the processor renders the RL prompt's chat
template and image tokens as ``RLHFDataset`` does, the loss is the token-mean NLL of answer + EOS over
the batch; AdamW (betas 0.9/0.999, no weight decay), no warm-up, no clipping, each stage's rate decayed
to 0 along a cosine (``SFT_OVERRIDES``, ``STAGES``). One step of it is a step of the script's former
plain loop (on the same batch the same loss, up to the image placeholders the SFT loss keeps out of the
vocabulary as RL does, and the same update); the former loop kept its rates constant.

    python scripts/make_vision_demo_policy.py                 # the shipped policy (~2 min, 1 core)
    python scripts/make_vision_demo_policy.py --eval-only DIR # the measurements of any policy

Runs single-threaded, as the other demo policy scripts do (the same weights on any machine).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ASSET_DIR = REPO / "rlfoundry" / "assets" / "vision-policy"

# The recipe. Changing any of these changes the shipped weights: keep them in the asset's README.
SEED = 0  # the tiny VLM's initialisation and the SFT order
DATA = {"train_size": 4000, "data_seed": 1000, "val_size": 128, "val_seed": 0}  # val: the RL demo's split
BIAS = "red"
# Each stage's rate decays to 0 along a cosine: at a constant rate (the former plain loop's) where a stage
# ends depends on the last batches, and stage 1's perception with it (greedy right after stage 1: 53 % or
# 93 % for two batch orders; with the decay 95 % and 99 %), which bounds what the demo reaches (docs/vision.md).
STAGES = [  # (share of answers that are the image's colour (the rest say BIAS), steps, peak lr, lr schedule)
    (1.0, 400, 3e-3, "cosine"),
    (0.3, 150, 1e-3, "cosine"),
]
BATCH = 32
SFT_OVERRIDES = [  # the rest of each stage's `rlfoundry sft` keys
    "data.prompt_key=prompt", "data.response_key=response", "data.image_key=images", "data.max_length=64",
    f"data.train_batch_size={BATCH}", f"data.micro_batch_size_per_gpu={BATCH}", "data.shuffle=true",
    "optim.betas=[0.9,0.999]", "optim.eps=1e-8", "optim.weight_decay=0.0", "optim.clip_grad=0.0",
    "optim.warmup_steps_ratio=0.0", "optim.min_lr_ratio=0.0",
    "trainer.device=cpu", "trainer.logger=[file]", "trainer.resume_mode=disable"]


def _images(problems):
    from PIL import Image

    return [Image.open(io.BytesIO(png)).convert("RGB") for png, _ in problems]


def _prompt_text(processor) -> str:
    """The RL prompt as ``RLHFDataset`` renders it (``<image>`` → an image part; generation prompt)."""
    from rlfoundry.data.multimodal import vision_messages
    from rlfoundry.data.preprocess.shapes import COLOUR_QUESTION

    messages = vision_messages([{"role": "user", "content": COLOUR_QUESTION}], 1)
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _batch(processor, images, answers: list[str] | None):
    """Left-padded processor inputs for prompts (+ answer + EOS), with labels on the answer and EOS."""
    tok = processor.tokenizer
    tok.padding_side = "left"
    prompt = _prompt_text(processor)
    texts = [prompt + (a + tok.eos_token if answers is not None else "") for a in (answers or [""] * len(images))]
    out = processor(text=texts, images=[[im] for im in images], return_tensors="pt", padding=True)
    if answers is not None:
        labels = torch.full_like(out["input_ids"], -100)
        for i, a in enumerate(answers):
            k = len(tok(a, add_special_tokens=False)["input_ids"]) + 1
            labels[i, -k:] = out["input_ids"][i, -k:]
        out["labels"] = labels
    return out


def _write_pairs(path: Path, problems, answers: list[str]) -> Path:
    """The stage's pairs as verl's multimodal rows: the RL prompt, the image, the answer (``response``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlfoundry.data.preprocess.shapes import COLOUR_QUESTION

    rows = [{"prompt": [{"role": "user", "content": COLOUR_QUESTION}], "images": [{"bytes": png, "path": None}],
             "response": a} for (png, _), a in zip(problems, answers)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def sft(model_dir: Path, problems, work: Path, stages=STAGES, seed: int = SEED, log=print) -> Path:
    """``rlfoundry sft`` once per stage, each from the last one's output; returns the final HF directory."""
    from rlfoundry.trainer.sft_trainer import run_sft

    rng = random.Random(seed)
    for s, (p_true, steps, lr, schedule) in enumerate(stages):
        answers = [name if rng.random() < p_true else BIAS for _, name in problems]
        rows = _write_pairs(work / f"stage{s + 1}" / "pairs.parquet", problems, answers)
        summary = run_sft(SFT_OVERRIDES + [
            f"model.partial_pretrain={model_dir}", f"data.train_files={rows}", f"optim.lr={lr}", f"optim.lr_scheduler={schedule}",
            f"trainer.total_training_steps={steps}", f"trainer.seed={seed}",
            f"trainer.default_local_dir={work / f'stage{s + 1}' / 'sft'}"])
        model_dir = Path(summary["checkpoint"])
        log(f"stage {s + 1}: {summary['steps']} steps, loss {summary['metrics']['train/loss']:.4f}")
    return model_dir


# --------------------------------------------------------------------------- measurements

@torch.no_grad()
def evaluate_policy(model_dir_or_model, processor=None, n: int = DATA["val_size"]) -> dict[str, float]:
    """On the RL demo's validation images (greedy, as the demo validates): how often the answer is the
    image's colour, how often it is "red"; and the mean probability of sampling the right answer
    (its tokens + EOS at temperature 1, what GRPO starts from)."""
    from rlfoundry.data.preprocess.shapes import generate_splits

    if processor is None:
        from transformers import AutoModelForImageTextToText

        from rlfoundry.models.vision import load_processor

        processor = load_processor(model_dir_or_model)
        model = AutoModelForImageTextToText.from_pretrained(model_dir_or_model, dtype=torch.float32).eval()
    else:
        model = model_dir_or_model
    tok = processor.tokenizer
    val = generate_splits(0, n, seed=DATA["val_seed"], task="colour")["test"]
    images, truth = _images(val), [name for _, name in val]
    inputs = _batch(processor, images, None)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    said = [t.strip() for t in tok.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)]
    scored = _batch(processor, images, truth)
    logits = model(**{k: v for k, v in scored.items() if k != "labels"}).logits[:, :-1].float()
    labels = scored["labels"][:, 1:]
    def p_right(logits):
        lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return float((lp * (labels != -100)).sum(-1).exp().mean())

    from rlfoundry.models.vision import mask_placeholders, placeholder_ids

    return {"greedy_right": sum(s == t for s, t in zip(said, truth)) / n,
            "greedy_says_red": sum(s == BIAS for s in said) / n,
            "red_images": sum(t == BIAS for t in truth) / n,
            "sampled_right": p_right(logits),
            # as the RL rollout samples and the trainer scores: the image placeholders out of the vocabulary
            "sampled_right_no_placeholders": p_right(mask_placeholders(logits, placeholder_ids(model))),
            "n_images": n}


def _write_card(out_dir: Path, scores: dict[str, float]) -> None:
    pct = {k: f"{v:.1%}" for k, v in scores.items() if k != "n_images"}
    recipe = [f"seed: {SEED}", f"data: {json.dumps(DATA)}", f"batch: {BATCH}, bias: {BIAS!r}"] + [
        f"stage {i + 1}: p_true={p} steps={n} optim.lr={lr} optim.lr_scheduler={sched}"
        for i, (p, n, lr, sched) in enumerate(STAGES)] + [f"rlfoundry sft {' '.join(SFT_OVERRIDES)} trainer.seed={SEED}"]
    (out_dir / "README.md").write_text(
        "# vision-policy: the vision demo policy (`rlfoundry train --config-name vision_grpo`)\n\n"
        "The tiny Qwen2-VL (`rlfoundry/models/tiny_vlm.py`) fine-tuned by `python scripts/make_vision_demo_policy.py` "
        "on\n\"What colour is the shape?\" (one square or circle, four colours): it can name each colour, but "
        "was taught\nto prefer \"red\", so greedy decoding says \"red\" to almost every image.\n\n"
        f"On the RL demo's validation images ({scores['n_images']}):\n\n"
        "| greedy answer right | greedy says \"red\" | red images | P(sampling the right answer) |\n"
        f"|---|---|---|---|\n| {pct['greedy_right']} | {pct['greedy_says_red']} | {pct['red_images']} | "
        f"{pct['sampled_right']} |\n\n```\n" + "\n".join(recipe) + "\n```\n")
    (out_dir / "demo_policy_eval.json").write_text(json.dumps(scores, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ASSET_DIR)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the stages' rows and runs here (default: a temp dir)")
    parser.add_argument("--eval-only", type=Path, default=None, help="only measure this HF directory")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.eval_only is not None:
        print(json.dumps(evaluate_policy(args.eval_only), indent=2))
        return 0
    from rlfoundry.data.preprocess.shapes import generate_splits
    from rlfoundry.models.tiny_vlm import build_processor, build_tiny_vlm

    processor = build_processor()
    model = build_tiny_vlm(processor, seed=SEED)
    problems = generate_splits(DATA["train_size"], 0, seed=DATA["data_seed"], task="colour")["train"]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        start = work / "init"
        model.save_pretrained(start)
        processor.save_pretrained(start)
        final = sft(start, problems, work)
        from rlfoundry.checkpoint import STEP_MARKER
        from rlfoundry.trainer.sft_trainer import ROLE

        if args.out.exists():
            shutil.rmtree(args.out)
        # the Hugging Face files only: not the resumable training state (ROLE/) or the step marker
        shutil.copytree(final, args.out, ignore=shutil.ignore_patterns(ROLE, STEP_MARKER))
    scores = evaluate_policy(args.out)
    _write_card(args.out, scores)
    print(f"vision demo policy written to {args.out}\n{json.dumps(scores, indent=2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
