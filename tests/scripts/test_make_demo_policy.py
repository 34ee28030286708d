"""scripts/make_demo_policy.py: the SFT pairs it writes for the demo policy (two answer styles)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rlfoundry.data.sft_dataset import load_pairs
from rlfoundry.trainer.sft_trainer import load_sft_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_demo_policy.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("make_demo_policy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_answer_styles_mix_in_training_only(demo):
    train, val = demo.demo_pairs(400, 50, seed=0, sentence_ratio_by_op={"-": 1.0})
    assert (len(train), len(val)) == (400, 50)
    for row in train:  # every subtraction in a sentence, every addition bare
        subtraction = "-" in row["prompt"][1:]
        assert row["response"].startswith("The answer is ") == subtraction, row
    assert all(r["response"].lstrip("-").isdigit() for r in val), "validation answers stay bare (what the verifier checks)"
    assert demo.demo_pairs(400, 50, seed=0, sentence_ratio_by_op={"-": 1.0}) == (train, val), "seeded"
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}


def test_written_files_are_what_rlfoundry_sft_reads(demo, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DATA", {"train_size": 20, "val_size": 5, "seed": 0})
    train_file, val_file = demo.write_demo_data(tmp_path)
    cfg = load_sft_config(["model.partial_pretrain=x"])
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    assert load_pairs(str(train_file), cfg.data) == [([{"role": "user", "content": r["prompt"]}], r["response"])
                                                     for r in rows]
    assert len(load_pairs(str(val_file), cfg.data)) == 5
    # the shipped recipe: a quarter of the additions and three quarters of the subtractions in a sentence
    assert demo.SENTENCE_RATIO_BY_OP == {"+": 0.25, "-": 0.75}


def test_the_packaged_moe_policy_is_the_moe_recipe(demo):
    """``--moe``'s recipe (MOE_MODEL, the shared SFT keys) is what rlfoundry://moe-policy was made with: its
    config has that shape and its card lists the recipe."""
    from transformers import AutoConfig

    m, cfg = demo.MOE_MODEL, AutoConfig.from_pretrained(demo.MOE_ASSET_DIR)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == \
        (m["arch"], m["hidden_size"], m["num_layers"], m["num_heads"])
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == \
        (m["num_experts"], m["num_experts_per_tok"], m["intermediate_size"])
    card = (demo.MOE_ASSET_DIR / "README.md").read_text()
    assert json.dumps(m) in card and all(key in card for key in demo.SFT_OVERRIDES + demo.MOE_SFT_OVERRIDES)
