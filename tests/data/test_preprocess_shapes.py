"""The synthetic visual task (``rlfoundry preprocess shapes``): images whose squares match the answer."""

from __future__ import annotations

import io
import random

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rlfoundry.data.preprocess.__main__ import main
from rlfoundry.data.preprocess.shapes import DATA_SOURCE, draw_problem
from rlfoundry.rewards.default import default_compute_score


def _count_squares(png: bytes) -> tuple[int, int]:
    """(squares, circles) read back from the pixels: per grid cell, a filled bounding box is a square."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    half = pixels.shape[0] // 2
    squares = circles = 0
    for cy in range(2):
        for cx in range(2):
            ink = (pixels[cy * half:(cy + 1) * half, cx * half:(cx + 1) * half] != 255).any(-1)
            if not ink.any():
                continue
            ys, xs = np.nonzero(ink)
            box = ink[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
            squares, circles = (squares + 1, circles) if box.all() else (squares, circles + 1)
    return squares, circles


def test_the_answer_is_the_number_of_squares_drawn():
    rng = random.Random(0)
    answers, circles = [], 0
    for _ in range(200):
        png, answer = draw_problem(rng)
        got, c = _count_squares(png)
        assert got == answer
        answers.append(answer)
        circles += c
    assert set(answers) == {1, 2, 3, 4} and circles > 0


def test_preprocess_writes_verl_image_rows(tmp_path):
    assert main(["shapes", "--output", str(tmp_path), "--train-size", "6", "--test-size", "3", "--seed", "1"]) == 0
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(train) == 6 and len(test) == 3
    row = train[0]
    assert row["data_source"] == DATA_SOURCE and row["prompt"][0]["content"].startswith("<image>")
    assert _count_squares(row["images"][0]["bytes"])[0] == int(row["reward_model"]["ground_truth"])
    truth = row["reward_model"]["ground_truth"]
    assert default_compute_score(DATA_SOURCE, f" {truth}\n", truth) == 1.0
    assert default_compute_score(DATA_SOURCE, str(int(truth) % 4 + 1), truth) == 0.0
    # the same seed gives the same files
    again = tmp_path / "again"
    main(["shapes", "--output", str(again), "--train-size", "6", "--test-size", "3", "--seed", "1"])
    assert pq.read_table(again / "train.parquet").equals(pq.read_table(tmp_path / "train.parquet"))


def test_the_colour_answer_is_the_colour_drawn(tmp_path):
    """``--question colour`` (the vision demo's task): every non-white pixel is the named colour, all
    four colours and both shapes occur; the rows are scored as the exact word."""
    from rlfoundry.data.preprocess.shapes import COLOUR_DATA_SOURCE, COLOUR_NAMES, draw_colour_problem

    rng, names, shapes = random.Random(0), set(), set()
    for _ in range(200):
        png, name = draw_colour_problem(rng)
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
        ink = pixels[(pixels != 255).any(-1)]
        assert len(ink) and (ink == COLOUR_NAMES[name]).all(), name
        names.add(name)
        shapes.add(len(ink) == int(np.sqrt(len(ink))) ** 2)  # a square's ink count is a perfect square
    assert names == set(COLOUR_NAMES) and shapes == {True, False}

    assert main(["shapes", "--question", "colour", "--output", str(tmp_path), "--train-size", "4",
                 "--test-size", "2"]) == 0
    row = pq.read_table(tmp_path / "train.parquet").to_pylist()[0]
    truth = row["reward_model"]["ground_truth"]
    assert row["data_source"] == COLOUR_DATA_SOURCE and truth in COLOUR_NAMES
    assert row["prompt"][0]["content"] == "<image>What colour is the shape?"
    assert default_compute_score(COLOUR_DATA_SOURCE, f" {truth.upper()}\n", truth) == 1.0
    assert default_compute_score(COLOUR_DATA_SOURCE, f"{truth} {truth}", truth) == 0.0
    assert default_compute_score(COLOUR_DATA_SOURCE, "red" if truth != "red" else "blue", truth) == 0.0


def test_synthetic_shape_colour_task_writes_image_rows_into_the_run_dir(tmp_path):
    """``data.synthetic.task=shape_colour`` (vision_grpo's data): the rows are generated at start-up,
    seeded, and equal to the preprocess command's; an unknown task is refused by the schema."""
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import prepare_synthetic_data

    cfg = load_config(["data.synthetic.task=shape_colour", "data.synthetic.train_size=6",
                       "data.synthetic.val_size=3", "data.synthetic.seed=2"])
    train, val = prepare_synthetic_data(cfg, tmp_path)
    main(["shapes", "--question", "colour", "--output", str(tmp_path / "cli"), "--train-size", "6",
          "--test-size", "3", "--seed", "2"])
    assert pq.read_table(train).equals(pq.read_table(tmp_path / "cli" / "train.parquet"))
    assert pq.read_table(val).equals(pq.read_table(tmp_path / "cli" / "test.parquet"))
    with pytest.raises(Exception, match="shape_colour"):
        load_config(["data.synthetic.task=nope"])
