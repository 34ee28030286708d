"""Built-in synthetic visual task ``rlfoundry/count_shapes``: "How many squares?" on a drawn image.

Each image (``--size`` pixels square, white) is cut into a 2x2 grid; 1 to 4 cells hold a filled
square and up to one other cell a circle (a distractor), each in a random colour, drawn with Pillow.
The answer is the number of squares, scored as an exact integer (``rewards/arithmetic.py``'s rule).
Rows are verl's image rows: ``images`` = ``[{"bytes": PNG, "path": None}]`` and an ``<image>``
marker in the user message, so ``data.image_key=images`` (the default) reads them.

    python -m rlfoundry.data.preprocess shapes --output ~/data/shapes --train-size 2000 --test-size 200
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

from rlfoundry.data.preprocess.common import PreprocessError, verl_row, write_splits

DATA_SOURCE = "rlfoundry/count_shapes"
QUESTION = "<image>How many squares are in the picture? Answer with a number."
COLOURS = ((220, 40, 40), (40, 160, 40), (40, 70, 220), (230, 160, 20), (150, 50, 180))


def draw_problem(rng: random.Random, size: int = 32) -> tuple[bytes, int]:
    """One PNG (``size`` x ``size``) and its number of squares (1-4)."""
    from PIL import Image, ImageDraw

    if size < 16:
        raise PreprocessError(f"--size {size}: images need at least 16 pixels a side")
    squares = rng.randint(1, 4)
    cells = rng.sample(range(4), 4)
    circle = cells[squares] if squares < 4 and rng.random() < 0.5 else None
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    half = size // 2
    for cell in cells[:squares] + ([circle] if circle is not None else []):
        side = rng.randint(max(3, half // 2), half - 2)
        x0 = (cell % 2) * half + rng.randint(1, half - side - 1)
        y0 = (cell // 2) * half + rng.randint(1, half - side - 1)
        box = (x0, y0, x0 + side - 1, y0 + side - 1)
        colour = rng.choice(COLOURS)
        (draw.ellipse if cell == circle else draw.rectangle)(box, fill=colour)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), squares


def generate_splits(train_size: int, test_size: int, seed: int = 0, size: int = 32) -> dict[str, list[tuple[bytes, int]]]:
    """Train and test problems from separate seeded streams (test with ``seed``, train with ``seed + 1``)."""
    return {split: [draw_problem(rng, size) for _ in range(n)]
            for split, n, rng in (("train", train_size, random.Random(seed + 1)),
                                  ("test", test_size, random.Random(seed)))}


def make_row(problem: tuple[bytes, int], split: str, index: int) -> dict:
    png, squares = problem
    row = verl_row(DATA_SOURCE, QUESTION, "vision", str(squares), {"split": split, "index": index, "answer": squares})
    row["images"] = [{"bytes": png, "path": None}]
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (32: 4 image tokens on the tiny VLM)")


def run(args: argparse.Namespace) -> dict[str, Path]:
    if args.input:
        raise PreprocessError("the shapes task is drawn from --seed; it takes no --input")
    return write_splits(generate_splits(args.train_size, args.test_size, args.seed, args.size), Path(args.output), make_row)
