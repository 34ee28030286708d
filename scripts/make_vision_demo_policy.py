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

The fine-tuning is a plain loop here, not ``rlfoundry sft``: the SFT trainer does not take image
rows yet (docs/vision.md). Each pair is the RL prompt (the same chat template and image tokens as
``RLHFDataset`` renders) + the answer + EOS, the loss on the answer and EOS only.

    python scripts/make_vision_demo_policy.py                 # the shipped policy (a few minutes, 1 core)
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
STAGES = [  # (share of answers that are the image's colour (the rest say BIAS), steps, learning rate)
    (1.0, 400, 3e-3),
    (0.3, 150, 1e-3),
]
BATCH = 32


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


def sft(model, processor, problems, stages=STAGES, seed: int = SEED, log=print) -> None:
    images = _images(problems)
    rng = random.Random(seed)
    for s, (p_true, steps, lr) in enumerate(stages):
        answers = [name if rng.random() < p_true else BIAS for _, name in problems]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        order: list[int] = []
        model.train()
        for step in range(steps):
            if len(order) < BATCH:
                order += rng.sample(range(len(problems)), len(problems))
            idx, order = order[:BATCH], order[BATCH:]
            inputs = _batch(processor, [images[i] for i in idx], [answers[i] for i in idx])
            loss = model(**inputs).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 50 == 0 or step == steps - 1:
                log(f"stage {s + 1} step {step}: loss {loss.item():.4f}")
        model.eval()


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
    lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    p_right = (lp * (labels != -100)).sum(-1).exp()
    return {"greedy_right": sum(s == t for s, t in zip(said, truth)) / n,
            "greedy_says_red": sum(s == BIAS for s in said) / n,
            "red_images": sum(t == BIAS for t in truth) / n,
            "sampled_right": float(p_right.mean()), "n_images": n}


def _write_card(out_dir: Path, scores: dict[str, float]) -> None:
    pct = {k: f"{v:.1%}" for k, v in scores.items() if k != "n_images"}
    recipe = [f"seed: {SEED}", f"data: {json.dumps(DATA)}", f"batch: {BATCH}, AdamW, constant lr, bias: {BIAS!r}"] + [
        f"stage {i + 1}: p_true={p} steps={n} lr={lr}" for i, (p, n, lr) in enumerate(STAGES)]
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
    torch.manual_seed(SEED)
    sft(model, processor, problems)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        if args.out.exists():
            shutil.rmtree(args.out)
        shutil.copytree(tmp, args.out)
    scores = evaluate_policy(args.out)
    _write_card(args.out, scores)
    print(f"vision demo policy written to {args.out}\n{json.dumps(scores, indent=2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
