"""``rlfoundry preprocess geo3k`` on rows in the hub's Geometry3K layout that the test writes."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from rlfoundry.data.preprocess.__main__ import main
from rlfoundry.data.preprocess.geo3k import DATA_SOURCE, INSTRUCTION
from rlfoundry.data.rl_dataset import RLHFDataset
from rlfoundry.models.vision import load_processor
from rlfoundry.rewards.default import default_compute_score


def _png(colour: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buf, format="PNG")
    return buf.getvalue()


def _write_hub_layout(root, rows_per_split):
    """``data/{split}-00000-of-00001.parquet`` with the hub's columns: images (list of {bytes, path}), problem, answer."""
    (root / "data").mkdir(parents=True)
    for split, rows in rows_per_split.items():
        pq.write_table(pa.Table.from_pylist(rows), root / "data" / f"{split}-00000-of-00001.parquet")


def test_geo3k_rows_are_verls_layout_and_load_with_the_processor(tmp_path, tiny_vlm_dir):
    train = [{"images": [{"bytes": _png("red"), "path": None}], "problem": "<image>Find x. Angle A is 2x.", "answer": "12"},
             {"images": [{"bytes": _png("blue"), "path": None}], "problem": "<image>Find the area.", "answer": "8\\sqrt{3}"}]
    test = [{"images": [{"bytes": _png("green"), "path": None}], "problem": "<image>Find y.", "answer": "5"}]
    _write_hub_layout(tmp_path / "raw", {"train": train, "test": test})
    out = tmp_path / "out"
    assert main(["geo3k", "--input", str(tmp_path / "raw"), "--output", str(out)]) == 0

    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert len(rows) == 2 and len(pq.read_table(out / "test.parquet").to_pylist()) == 1
    row = rows[1]
    assert row["data_source"] == DATA_SOURCE and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": f"<image>Find the area. {INSTRUCTION}"}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "8\\sqrt{3}"}
    assert row["extra_info"] == {"split": "train", "index": 1, "answer": "8\\sqrt{3}", "question": "<image>Find the area."}
    assert row["images"][0]["bytes"] == _png("blue")

    processor = load_processor(tiny_vlm_dir)
    ds = RLHFDataset(str(out / "train.parquet"), processor.tokenizer, {"max_prompt_length": 512}, processor=processor)
    assert len(ds) == 2
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for item in (ds[0], ds[1]):
        assert int((item["input_ids"] == image_token).sum()) == 4  # one 32x32 image = 4 tokens on the tiny VLM
        assert item["multi_modal_inputs"]["pixel_values"].shape[0] > 0 and item["position_ids"].shape[0] == 3
    # the two rows' different images reach the pixels
    assert not torch.equal(ds[0]["multi_modal_inputs"]["pixel_values"], ds[1]["multi_modal_inputs"]["pixel_values"])


@pytest.mark.parametrize("response, score", [
    ("<think>2x = 24</think> so \\boxed{12}", 1.0),
    ("\\boxed{12}", 0.9),
    ("<think>hm</think> \\boxed{13}", 0.1),
    ("x is 12", 0.0),
])
def test_geo3k_score_is_verls_rule(response, score):
    assert default_compute_score(DATA_SOURCE, response, "12") == pytest.approx(score)


def test_geo3k_row_without_images_is_an_error(tmp_path, capsys):
    _write_hub_layout(tmp_path / "raw", {"train": [{"images": [], "problem": "<image>Find x.", "answer": "1"}]})
    assert main(["geo3k", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "out")]) == 2
    assert "geo3k train row 0" in capsys.readouterr().err
