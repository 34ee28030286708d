"""Built-in synthetic visual tasks on drawn images: ``rlfoundry/count_shapes`` ("How many squares?",
``--question count``, the default) and ``rlfoundry/shape_colour`` ("What colour is the shape?",
``--question colour``, the vision demo's task).

Count: each image (``--size`` pixels square, white) is cut into a 2x2 grid; 1 to 4 cells hold a filled
square and up to one other cell a circle (a distractor), each in a random colour, drawn with Pillow.
The answer is the number of squares, scored as an exact integer (``rewards/arithmetic.py``'s rule).

Colour: one filled square or circle (4 to 24 pixels a side at 32 pixels, anywhere in the image) in one of
``COLOUR_NAMES``' four colours; the answer is the colour's name, scored as the exact word.

Rows are verl's image rows: ``images`` = ``[{"bytes": PNG, "path": None}]`` and an ``<image>``
marker in the user message, so ``data.image_key=images`` (the default) reads them.

    python -m rlfoundry.data.preprocess shapes --output ~/data/shapes --train-size 2000 --test-size 200
    python -m rlfoundry.data.preprocess shapes --question colour --output ~/data/shape_colour
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
COLOUR_DATA_SOURCE = "rlfoundry/shape_colour"
COLOUR_QUESTION = "<image>What colour is the shape?"
COLOUR_NAMES = {"red": COLOURS[0], "green": COLOURS[1], "blue": COLOURS[2], "yellow": COLOURS[3]}


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


def draw_colour_problem(rng: random.Random, size: int = 32) -> tuple[bytes, str]:
    """One PNG (``size`` x ``size``, white) with one filled square or circle, and its colour's name."""
    from PIL import Image, ImageDraw

    if size < 16:
        raise PreprocessError(f"--size {size}: images need at least 16 pixels a side")
    name = rng.choice(sorted(COLOUR_NAMES))
    side = rng.randint(size // 8, 3 * size // 4)
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
    shape((x0, y0, x0 + side - 1, y0 + side - 1), fill=COLOUR_NAMES[name])
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue(), name


TASKS = {"count": draw_problem, "colour": draw_colour_problem}


def generate_splits(train_size: int, test_size: int, seed: int = 0, size: int = 32,
                    task: str = "count") -> dict[str, list[tuple[bytes, int | str]]]:
    """Train and test problems from separate seeded streams (test with ``seed``, train with ``seed + 1``)."""
    if task not in TASKS:
        raise PreprocessError(f"--question {task!r}: one of {sorted(TASKS)}")
    draw = TASKS[task]
    return {split: [draw(rng, size) for _ in range(n)]
            for split, n, rng in (("train", train_size, random.Random(seed + 1)),
                                  ("test", test_size, random.Random(seed)))}


def make_row(problem: tuple[bytes, int | str], split: str, index: int) -> dict:
    """A count problem (an int answer) or a colour problem (a colour's name) as verl's image row."""
    png, answer = problem
    source, question = (COLOUR_DATA_SOURCE, COLOUR_QUESTION) if isinstance(answer, str) else (DATA_SOURCE, QUESTION)
    row = verl_row(source, question, "vision", str(answer), {"split": split, "index": index, "answer": answer})
    row["images"] = [{"bytes": png, "path": None}]
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--test-size", type=int, default=200)
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (32: 4 image tokens on the tiny VLM)")
    parser.add_argument("--question", choices=sorted(TASKS), default="count",
                        help="count: how many squares (default); colour: what colour is the one shape")


def run(args: argparse.Namespace) -> dict[str, Path]:
    if args.input:
        raise PreprocessError("the shapes task is drawn from --seed; it takes no --input")
    return write_splits(generate_splits(args.train_size, args.test_size, args.seed, args.size, args.question), Path(args.output), make_row)
