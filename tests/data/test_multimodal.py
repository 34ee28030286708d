"""Image prompts in verl's multimodal layout: the processor's own tokens, the model's own 3-D
positions, image tokens counted in max_prompt_length, corrupt images skipped with a message."""

from __future__ import annotations

import io
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from rlfoundry.data.rl_dataset import DataError, RLHFDataset, collate_fn
from rlfoundry.models.vision import load_processor


def png(width: int, height: int, colour: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def write_rows(path, rows):
    full = [{"data_source": "toy", "reward_model": {"style": "rule", "ground_truth": "1"}, **r} for r in rows]
    pq.write_table(pa.Table.from_pylist(full), path)
    return path


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(tiny_vlm_dir)


def test_ids_and_positions_are_the_processors_and_models_own(tmp_path, processor, tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText

    (tmp_path / "pics").mkdir()
    Image.new("RGB", (16, 16), "blue").save(tmp_path / "pics" / "b.png")
    path = write_rows(tmp_path / "d.parquet", [
        {"prompt": [{"role": "user", "content": "<image>How many squares?"}],
         "images": [{"bytes": png(32, 32, "red"), "path": None}]},
        # two images, one given as a path relative to the parquet file's directory
        {"prompt": [{"role": "user", "content": "A <image> then <image>."}],
         "images": [{"bytes": png(48, 32, "green"), "path": None}, {"bytes": None, "path": "pics/b.png"}]},
    ])
    ds = RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 64}, processor=processor)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    batch = collate_fn([ds[0], ds[1]])
    for i, (text, images) in enumerate([
        ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many squares?<|im_end|>\n"
         "<|im_start|>assistant\n", [Image.new("RGB", (32, 32), "red")]),
        ("<|im_start|>user\nA <|vision_start|><|image_pad|><|vision_end|> then <|vision_start|><|image_pad|>"
         "<|vision_end|>.<|im_end|>\n<|im_start|>assistant\n",
         [Image.new("RGB", (48, 32), "green"), Image.new("RGB", (16, 16), "blue")]),
    ]):
        ref = processor(text=[text], images=images, return_tensors="pt")
        n = ref["input_ids"].shape[1]
        mask = batch["attention_mask"][i]
        assert int(mask.sum()) == n and bool(mask[-n:].all())
        assert torch.equal(batch["input_ids"][i, -n:], ref["input_ids"][0])
        # image tokens: grid_t * grid_h * grid_w / merge^2 per image (32x32 -> 4x4 patches -> 4 tokens)
        n_img = int((ref["input_ids"] == processor.image_token_id).sum())
        assert n_img == int((ref["image_grid_thw"].prod(-1) // 4).sum())
        inputs = batch["multi_modal_inputs"][i]
        assert torch.equal(inputs["image_grid_thw"], ref["image_grid_thw"])
        assert torch.allclose(inputs["pixel_values"], ref["pixel_values"])
        # positions: the model's own get_rope_index on the unpadded prompt (padding shifts nothing)
        pos, _ = model.model.get_rope_index(ref["input_ids"], mm_token_type_ids=ref["mm_token_type_ids"],
                                            image_grid_thw=ref["image_grid_thw"])
        assert torch.equal(batch["position_ids"][i][:, -n:], pos[:, 0])
        assert len(batch["multi_modal_data"][i]["image"]) == len(images)
    assert ds[0]["position_ids"].shape == (3, 64)
    assert int((batch["multi_modal_inputs"][0]["image_grid_thw"]).prod()) == 16  # 4x4 patches


def test_max_prompt_length_counts_image_tokens(tmp_path, processor):
    prompt = [{"role": "user", "content": "<image>Hi"}]
    path = write_rows(tmp_path / "d.parquet", [{"prompt": prompt, "images": [{"bytes": png(32, 32, "red")}]}])
    text = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    n = len(processor.tokenizer(processor.apply_chat_template(text, add_generation_prompt=True, tokenize=False))["input_ids"])
    frame = n + 3  # + vision_start, one image_pad, vision_end: the rendered text before image expansion
    # the 32x32 image is 4 tokens (3 more than its placeholder): frame + 2 is refused, frame + 3 fits exactly
    with pytest.raises(DataError, match="longer than data.max_prompt_length"):
        RLHFDataset(path, processor.tokenizer, {"max_prompt_length": frame + 2}, processor=processor)
    ds = RLHFDataset(path, processor.tokenizer, {"max_prompt_length": frame + 3}, processor=processor)
    assert int(ds[0]["attention_mask"].sum()) == frame + 3


def test_corrupt_image_costs_its_row_with_a_message(tmp_path, processor, caplog):
    path = write_rows(tmp_path / "d.parquet", [
        {"prompt": [{"role": "user", "content": "<image>ok"}], "images": [{"bytes": png(32, 32, "red")}]},
        {"prompt": [{"role": "user", "content": "<image>bad"}], "images": [{"bytes": png(32, 32, "red")[:60]}]},
        {"prompt": [{"role": "user", "content": "<image>ok too"}], "images": [{"bytes": png(16, 16, "blue")}]},
    ])
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 64}, processor=processor)
    assert len(ds) == 2
    assert [ds[i]["index"] for i in range(2)] == [0, 0] and ds[1]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert f"{path}, row 1: skipped" in caplog.text and "image 0" in caplog.text


def test_video_rows_and_images_without_processor_are_start_up_errors(tmp_path, processor):
    path = write_rows(tmp_path / "v.parquet", [{"prompt": [{"role": "user", "content": "<video>?"}], "videos": ["a.mp4"]}])
    with pytest.raises(DataError, match="data.video_key"):
        RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 64}, processor=processor)
    path = write_rows(tmp_path / "i.parquet", [{"prompt": [{"role": "user", "content": "<image>?"}],
                                                "images": [{"bytes": png(16, 16, "red")}]}])
    with pytest.raises(DataError, match="no processor"):
        RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 64})


def test_image_key_names_the_column(tmp_path, processor):
    path = write_rows(tmp_path / "d.parquet", [{"prompt": [{"role": "user", "content": "<image>?"}],
                                                "pics": [{"bytes": png(16, 16, "red")}]}])
    ds = RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 64, "image_key": "pics"}, processor=processor)
    assert ds[0]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 2, 2]] and "pics" not in ds[0]
    assert np.array_equal(ds[0]["multi_modal_data"]["image"][0], Image.new("RGB", (16, 16), "red"))


def test_image_patch_size_must_be_the_processors(tmp_path, processor):
    """verl's data.image_patch_size resizes images to that grid before the processor; here only the
    processor's own grid is built, so the processor's size loads and another is refused."""
    path = write_rows(tmp_path / "d.parquet", [{"prompt": [{"role": "user", "content": "<image>?"}],
                                                "images": [{"bytes": png(16, 16, "red")}]}])
    own = processor.image_processor.patch_size
    ds = RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 64, "image_patch_size": own}, processor=processor)
    assert ds[0]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 2, 2]]
    with pytest.raises(DataError, match=f"data.image_patch_size={own + 2}: the model's processor works on patches of {own}"):
        RLHFDataset(path, processor.tokenizer, {"max_prompt_length": 64, "image_patch_size": own + 2}, processor=processor)
