"""rlfoundry sft: the loss mask, the loss itself, learning, invariance, HF output, config errors."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.trainer.sft_trainer import (
    SFTConfigError,
    SFTDataError,
    SFTTrainer,
    collate_sft,
    encode_pair,
    load_pairs,
    load_sft_config,
    main,
    masked_nll_sum,
    synthetic_pairs,
)


def _overrides(model_dir, run_dir, *extra: str) -> list[str]:
    return [f"model.partial_pretrain={model_dir}", f"trainer.default_local_dir={run_dir}",
            "data.synthetic.train_size=64", "data.synthetic.val_size=16", "data.max_length=64",
            "data.train_batch_size=16", "data.micro_batch_size_per_gpu=16", "optim.lr=1e-3",
            "optim.warmup_steps_ratio=0", "optim.lr_scheduler=constant", "trainer.logger=[file]",
            "trainer.device=cpu", *extra]


# --------------------------------------------------------------------------- the loss mask

def test_loss_mask_covers_response_and_eos_only():
    tok = build_tokenizer()
    ex = encode_pair(tok, [{"role": "user", "content": "1+1="}], "2", max_length=64)
    # "<|im_start|>" "user\n"(5) "1+1="(4) "<|im_end|>" "\n" "<|im_start|>" "assistant\n"(10) = 23 prompt tokens,
    # then "2" and EOS: the two tokens the model must learn to produce.
    assert ex["loss_mask"].tolist() == [0] * 23 + [1, 1]
    assert tok.decode(ex["input_ids"][23:24]) == "2" and ex["input_ids"][-1].item() == tok.eos_token_id
    assert tok.decode(ex["input_ids"][:23]) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"


def test_truncation_modes():
    tok = build_tokenizer()
    msgs = [{"role": "user", "content": "1+1="}]
    with pytest.raises(SFTDataError, match="data.max_length=10"):
        encode_pair(tok, msgs, "2", max_length=10)
    left = encode_pair(tok, msgs, "2", max_length=10, truncation="left")
    assert left["loss_mask"].tolist() == [0] * 8 + [1, 1]  # response kept whole
    right = encode_pair(tok, msgs, "2", max_length=10, truncation="right")
    assert right["loss_mask"].sum() == 0  # only prompt left: nothing to learn from this row


class _UniformLM(torch.nn.Module):
    """Zero logits over V tokens: every target costs exactly log V nats."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, attention_mask):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, self.vocab)})()


def test_nll_counts_response_tokens_only():
    tok = build_tokenizer()
    rows = [encode_pair(tok, [{"role": "user", "content": "1+1="}], "2", 64),
            encode_pair(tok, [{"role": "user", "content": "10+10="}], "20", 64)]
    batch = collate_sft(rows, tok.pad_token_id)
    # row 0: "2"+EOS = 2 targets; row 1: "20"+EOS = 3 targets; row 0's 2 pad tokens count for nothing.
    nll, count = masked_nll_sum(_UniformLM(len(tok)), batch)
    assert count.item() == 5
    assert nll.item() == pytest.approx(5 * math.log(len(tok)), rel=1e-5)
    assert batch["attention_mask"][0].tolist()[-2:] == [0, 0] and batch["loss_mask"][0].sum() == 2


# --------------------------------------------------------------------------- training

def _fixed_batch(trainer: SFTTrainer) -> dict[str, torch.Tensor]:
    return next(iter(trainer.train_loader))


def test_sft_steps_lower_the_loss_on_a_fixed_batch(tiny_model_dir, tmp_path):
    trainer = SFTTrainer(load_sft_config(_overrides(tiny_model_dir, tmp_path)))
    try:
        batch = _fixed_batch(trainer)
        losses = [trainer.train_step(batch)["train/loss"] for _ in range(6)]
    finally:
        trainer._finish(0.0)
    assert losses[0] > math.log(200), "an untrained model should be near uniform over ~260 tokens"
    assert losses[-1] < losses[0] - 0.5, losses  # 6 steps at lr 1e-3 drop it by ~0.9 nats
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def _one_step_params(model_dir, run_dir, micro: int) -> tuple[float, torch.Tensor]:
    trainer = SFTTrainer(load_sft_config(_overrides(model_dir, run_dir, f"data.micro_batch_size_per_gpu={micro}")))
    try:
        loss = trainer.train_step(_fixed_batch(trainer))["train/loss"]
        weight = trainer.model.lm_head.weight.full_tensor().detach().clone()
    finally:
        trainer._finish(0.0)
    return loss, weight


def test_update_does_not_depend_on_micro_batch_size(tiny_model_dir, tmp_path):
    # The loss is normalised by the global batch's token count, so 1 x 16 and 4 x 4 give one update.
    loss16, w16 = _one_step_params(tiny_model_dir, tmp_path / "a", 16)
    loss4, w4 = _one_step_params(tiny_model_dir, tmp_path / "b", 4)
    assert loss16 == pytest.approx(loss4, rel=1e-5)
    torch.testing.assert_close(w16, w4, rtol=1e-4, atol=1e-6)


def test_fit_writes_hf_checkpoint_that_reloads(tiny_model_dir, tmp_path):
    trainer = SFTTrainer(load_sft_config(_overrides(tiny_model_dir, tmp_path, "trainer.total_training_steps=2")))
    try:
        batch = _fixed_batch(trainer)
        trainer.train_step(batch)
        path = trainer.save_checkpoint(1)
        trainer.model.eval()
        with torch.no_grad():
            expected = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    finally:
        trainer._finish(0.0)
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    with torch.no_grad():
        got = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_main_runs_end_to_end_with_jsonl_and_tracking(tiny_model_dir, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(32)))
    run_dir = tmp_path / "run"
    args = _overrides(tiny_model_dir, run_dir, f"data.train_files={data}", f"data.val_files={data}",
                      "data.prompt_key=q", "data.response_key=a", "trainer.total_epochs=2", "trainer.profile_steps=[2]")
    assert main(args) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # 32 rows / 16 per step x 2 epochs
    assert "val/loss" in records[-1] and {"train/loss", "train/lr"} <= records[0].keys()
    assert AutoModelForCausalLM.from_pretrained(run_dir / "global_step_4") is not None
    assert [p.name for p in (run_dir / "profile").iterdir()] == ["sft_rank0_step2.pt.trace.json"]


# --------------------------------------------------------------------------- data and config errors

def test_parquet_with_nested_columns(tmp_path):
    # verl's GSM8K SFT recipe: prompt_key=extra_info, prompt_dict_keys=[question]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"extra_info": {"question": "2+2=", "answer": "4"}}]), path)
    cfg = load_sft_config(["model.partial_pretrain=x", "data.prompt_key=extra_info", "data.response_key=extra_info",
                           "+data.prompt_dict_keys=[question]", "+data.response_dict_keys=[answer]"])
    assert load_pairs(str(path), cfg.data) == [([{"role": "user", "content": "2+2="}], "4")]
    bad = load_sft_config(["model.partial_pretrain=x", "data.prompt_key=question"])
    with pytest.raises(SFTDataError, match="no column 'question'.*extra_info"):
        load_pairs(str(path), bad.data)


def test_unknown_key_names_the_closest():
    with pytest.raises(SFTConfigError, match="Did you mean 'optim.lr'"):
        load_sft_config(["model.partial_pretrain=x", "optim.lrr=1e-4"])
    with pytest.raises(SFTConfigError, match="Did you mean 'data.micro_batch_size_per_gpu'"):
        load_sft_config(["model.partial_pretrain=x", "data.micro_batch_size_per_gp=4"])
    with pytest.raises(SFTConfigError, match="expected a int"):
        load_sft_config(["model.partial_pretrain=x", "data.train_batch_size=many"])


def test_batch_sizes_that_do_not_divide_show_the_numbers():
    with pytest.raises(SFTConfigError, match=r"10 sequences per rank, not divisible by data.micro_batch_size_per_gpu \(4\)"):
        load_sft_config(["model.partial_pretrain=x", "data.train_batch_size=10", "data.micro_batch_size_per_gpu=4"])
    with pytest.raises(SFTConfigError, match="model.partial_pretrain is required"):
        load_sft_config([])


def test_synthetic_pairs_mix_answer_styles_in_training_only():
    cfg = load_sft_config(["model.partial_pretrain=x", "data.synthetic.train_size=400", "data.synthetic.val_size=50",
                           'data.synthetic.sentence_ratio_by_op={"-":1.0}'])
    train, val = synthetic_pairs(cfg.data.synthetic)
    assert (len(train), len(val)) == (400, 50)
    for messages, response in train:  # every subtraction in a sentence, every addition bare
        subtraction = "-" in messages[0]["content"][1:]
        assert response.startswith("The answer is ") == subtraction, (messages, response)
    assert all(r.lstrip("-").isdigit() for _, r in val), "validation answers stay bare (what the verifier checks)"
    assert synthetic_pairs(cfg.data.synthetic) == (train, val), "seeded"
