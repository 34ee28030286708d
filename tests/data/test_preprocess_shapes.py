"""The synthetic visual task (``rlfoundry preprocess shapes``): images whose squares match the answer."""

from __future__ import annotations

import io
import random

import numpy as np
import pyarrow.parquet as pq
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
