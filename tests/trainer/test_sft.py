"""rlfoundry sft: the loss (against the formula it replaced), learning, invariance, checkpoints (HF
output, retention, resume), config errors. The data and batch layout: tests/data/test_sft_dataset.py."""

from __future__ import annotations

import json
import math
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfoundry.config.training_engines import TRAINING_ENGINES
from rlfoundry.data.sft_dataset import SFTDataError, collate_sft, encode_pair, load_pairs
from rlfoundry.engines.base import EnginePlugin, GlobalBatchInfo, LogProbs
from rlfoundry.engines.fsdp.forward import CausalLMForward
from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.trainer.config import ConfigError
from rlfoundry.trainer.sft_trainer import SFTTrainer, load_sft_config, main, sft_loss
from tests.workers import assert_same_gradients, first_step_gradients, reassociation_bound


def _full(param):
    """A copy of the whole parameter (FSDP2 shards gathered; a one-rank engine holds plain ones)."""
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def _overrides(model_dir, run_dir, *extra: str) -> list[str]:
    return [f"model.partial_pretrain={model_dir}", f"trainer.default_local_dir={run_dir}",
            "data.synthetic.train_size=64", "data.synthetic.val_size=16", "data.max_length=64",
            "data.train_batch_size=16", "data.micro_batch_size_per_gpu=16", "optim.lr=1e-3",
            "optim.warmup_steps_ratio=0", "optim.lr_scheduler=constant", "trainer.logger=[file]",
            "trainer.device=cpu", *extra]


# --------------------------------------------------------------------------- the loss

class _UniformLM(torch.nn.Module):
    """Zero logits over V tokens: every target costs exactly log V nats."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, logits_to_keep=0, **_):
        return type("Out", (), {"logits": torch.zeros(len(input_ids), logits_to_keep, self.vocab)})()


def _info(batch) -> GlobalBatchInfo:
    mask = batch["response_mask"]
    return GlobalBatchInfo(dp_size=1, batch_num_tokens=float(mask.sum()), global_batch_size=float((mask.sum(-1) > 0).sum()))


def _sft_loss_of(module, batch, info=None):
    forward = CausalLMForward(module, 1, None, use_remove_padding=False, use_shared_prompt=False)
    return sft_loss(forward(batch, LogProbs(), None), batch, info or _info(batch))


def test_loss_counts_response_tokens_only():
    tok = build_tokenizer()
    rows = [encode_pair(tok, [{"role": "user", "content": "1+1="}], "2", 64),
            encode_pair(tok, [{"role": "user", "content": "10+10="}], "20", 64)]
    batch = collate_sft(rows, tok.pad_token_id)
    # row 0: "2"+EOS = 2 targets; row 1: "20"+EOS = 3 targets; row 0's padding counts for nothing.
    assert batch["response_mask"].sum() == 5
    out = _sft_loss_of(_UniformLM(len(tok)), batch)
    assert out.loss.item() == pytest.approx(math.log(len(tok)), rel=1e-6)  # the mean of 5 x log V
    assert out.summed["train/loss"] == pytest.approx(math.log(len(tok)), rel=1e-6)


def _old_masked_nll_sum(model, rows, pad_id):
    """The formula rlfoundry sft used before it ran on the engine, as it was written: rows right-padded,
    logits at t predict token t+1, targets ``input_ids[:, 1:]`` weighted by ``loss_mask[:, 1:]``."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id)
    attention, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], attention[i, :n], loss_mask[i, :n] = r["input_ids"], 1, r["loss_mask"]
    logits = model(input_ids=ids, attention_mask=attention).logits
    weights = loss_mask[:, 1:].float()
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    return (nll * weights.flatten()).sum(), weights.sum()


@pytest.mark.numerics
def test_loss_and_gradient_equal_the_formula_they_replaced(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = [("1+1=", "2"), ("10+10=", "20"), ("37-48=", "-11"), ("5*5=", "The answer is 25.")]
    rows = [encode_pair(tok, [{"role": "user", "content": q}], a, 64) for q, a in pairs]
    old_model, new_model = (AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
                            for _ in range(2))
    nll_sum, count = _old_masked_nll_sum(old_model, rows, tok.pad_token_id)
    (nll_sum / count).backward()
    new = _sft_loss_of(new_model, collate_sft(rows, tok.pad_token_id))
    new.loss.backward()
    # hand-check: 4 responses of 1+1, 2+1, 3+1 and 17+1 tokens (EOS included) = 27 targets, and the
    # loss is their mean NLL; HF's own labels=-100 loss over the same targets says the same
    assert count.item() == 27
    b = collate_sft(rows, tok.pad_token_id)
    targets = torch.cat([torch.zeros_like(b["input_ids"][:, : -b["responses"].shape[1]]), b["response_mask"]], 1)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
        labels=b["input_ids"].masked_fill(targets == 0, -100)).loss
    # the same NLL summed in another order over 27 tokens: fp32 rounding, ~u x 27
    assert new.loss.item() == pytest.approx((nll_sum / count).item(), rel=1e-6)
    assert new.loss.item() == pytest.approx(hf.item(), rel=1e-6)
    # the same model and targets; the two losses sum the 27 tokens' NLL in another order: rounding only
    # (u x (V + tokens) ~ 2e-5 relative at most; atol for elements that cancel to ~0)
    for (name, p_old), p_new in zip(old_model.named_parameters(), new_model.parameters()):
        torch.testing.assert_close(p_new.grad, p_old.grad, rtol=1e-5, atol=1e-7, msg=name)


# --------------------------------------------------------------------------- training

def _fixed_batch(trainer: SFTTrainer) -> dict[str, torch.Tensor]:
    return next(iter(trainer.train_loader))


def test_sft_steps_lower_the_loss_on_a_fixed_batch(tiny_model_dir, tmp_path):
    trainer = SFTTrainer(load_sft_config(_overrides(tiny_model_dir, tmp_path)))
    try:
        batch = _fixed_batch(trainer)
        metrics = [trainer.train_step(batch) for _ in range(6)]
    finally:
        trainer._finish(0.0)
    losses = [m["train/loss"] for m in metrics]
    assert losses[0] > math.log(200), "an untrained model should be near uniform over ~260 tokens"
    assert losses[-1] < losses[0] - 0.5, losses  # 6 steps at lr 1e-3 drop it by ~0.9 nats
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert metrics[0]["train/lr"] == 1e-3 and metrics[0]["train/grad_norm"] > 0
    assert metrics[0]["train/response_tokens"] == batch["response_mask"].sum()


def _one_step_grads(model_dir, run_dir, *extra: str) -> tuple[float, dict[str, torch.Tensor], float]:
    """One step's loss, the gradients the optimiser took (Adam's first moment / (1 - beta1)), and the
    bound on their re-association (float32 over the vocabulary and the batch's tokens)."""
    trainer = SFTTrainer(load_sft_config(_overrides(model_dir, run_dir, *extra)))
    try:
        batch = _fixed_batch(trainer)
        loss = trainer.train_step(batch)["train/loss"]
        grads = first_step_gradients(trainer.engine.optimizer, trainer.engine.module)
        bound = reassociation_bound(trainer.engine.module.config.vocab_size, int(batch["input_ids"].numel()))
    finally:
        trainer._finish(0.0)
    return loss, grads, bound


@pytest.mark.numerics
def test_update_does_not_depend_on_micro_batch_size_or_cpu_kernels(tiny_model_dir, tmp_path):
    # The loss is normalised by the global batch's token count, so 1 x 16 and 4 x 4 give one update;
    # and the CPU speed-ups (model.cpu_kernels=auto on the CPU) compute what the plain path does.
    # Compared: the gradients of the step, not the weights after it (Adam's first step is ~lr * sign(g),
    # so a gradient ~0 whose last bits differ moves its weight anywhere in [-lr, lr]: #51). A micro-batch
    # normalised by its own token count instead of the batch's is off by O(1).
    loss16, g16, bound = _one_step_grads(tiny_model_dir, tmp_path / "a", "data.micro_batch_size_per_gpu=16")
    loss4, g4, _ = _one_step_grads(tiny_model_dir, tmp_path / "b", "data.micro_batch_size_per_gpu=4")
    plain, g_plain, _ = _one_step_grads(tiny_model_dir, tmp_path / "c", "model.cpu_kernels=off")
    # the losses: the same sum in another order (u x tokens ~ 1e-5 at most)
    assert loss16 == pytest.approx(loss4, rel=1e-5) and loss16 == pytest.approx(plain, rel=1e-5)
    assert_same_gradients(g4, g16, bound, "4 x 4")
    assert_same_gradients(g_plain, g16, bound, "cpu_kernels=off")


def test_fit_writes_hf_checkpoint_that_reloads(tiny_model_dir, tmp_path):
    trainer = SFTTrainer(load_sft_config(_overrides(tiny_model_dir, tmp_path, "trainer.total_training_steps=2")))
    try:
        batch = _fixed_batch(trainer)
        trainer.train_step(batch)
        path = trainer.save_checkpoint(1)
        model = trainer.engine.module.eval()
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        with torch.no_grad():
            expected = model(**inputs).logits
    finally:
        trainer._finish(0.0)
    assert path == tmp_path / "global_step_1"
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    with torch.no_grad():
        got = reloaded(**inputs).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    assert reloaded.config.use_cache, "the exported model is for inference"
    # the step protocol PPO uses: training state in a role directory, step marker, then the pointer
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (path / "sft" / "checkpoint_complete.json").is_file() and (path / "step_complete.json").is_file()
    assert "model.safetensors" in json.loads((path / "step_complete.json").read_text())["manifest"]


def test_main_runs_end_to_end_with_jsonl_and_tracking(tiny_model_dir, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+1=", "a": str(i + 1)}) + "\n" for i in range(32)))
    run_dir = tmp_path / "run"
    args = _overrides(tiny_model_dir, run_dir, f"data.train_files={data}", f"data.val_files={data}",
                      "data.prompt_key=q", "data.response_key=a", "trainer.total_epochs=2", "trainer.profile_steps=[2]")
    assert main(args) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # 32 rows / 16 per step x 2 epochs
    assert "val/loss" in records[-1] and {"train/loss", "train/lr", "train/grad_norm"} <= records[0].keys()
    assert AutoModelForCausalLM.from_pretrained(run_dir / "global_step_4") is not None
    assert [p.name for p in (run_dir / "profile").iterdir()] == ["sft_rank0_step2.pt.trace.json"]


def _run(model_dir, run_dir, *extra: str) -> tuple[dict, torch.Tensor]:
    trainer = SFTTrainer(load_sft_config(_overrides(model_dir, run_dir, "data.micro_batch_size_per_gpu=8",
                                                    "trainer.total_training_steps=3", "trainer.save_freq=1", *extra)))
    summary = trainer.fit()
    return summary, _full(trainer.engine.module.lm_head.weight)


@pytest.mark.numerics
def test_retention_and_resume_give_the_same_next_step(tiny_model_dir, tmp_path):
    # 64 pairs / 16 per step: step 3 lies in the first epoch; a cosine schedule with warm-up, so the
    # resumed schedule must also be right.
    extra = ("optim.lr_scheduler=cosine", "optim.warmup_steps_ratio=0.4", "trainer.max_ckpt_to_keep=2")
    full, w_full = _run(tiny_model_dir, tmp_path, *extra)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    shutil.rmtree(tmp_path / "global_step_3")  # as if the run had died during step 3
    resumed, w_resumed = _run(tiny_model_dir, tmp_path, *extra)
    assert resumed["steps"] == 3 and resumed["checkpoint"] == tmp_path / "global_step_3"
    assert resumed["metrics"]["train/loss"] == full["metrics"]["train/loss"]
    assert resumed["metrics"]["train/lr"] == full["metrics"]["train/lr"]
    torch.testing.assert_close(w_resumed, w_full, rtol=0, atol=0)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # the record goes on where the checkpoint was
    again, _ = _run(tiny_model_dir, tmp_path, *extra)  # nothing left to do: the last checkpoint
    assert again["steps"] == 3 and again["checkpoint"] == tmp_path / "global_step_3"


def test_verls_checkpoint_contents_choose_what_a_step_directory_holds(tiny_model_dir, tmp_path):
    """verl's SFT ``checkpoint.save_contents``: without 'hf_model' no Hugging Face model is written (verl's
    default list), the step still resumes to the uninterrupted run's next step; with it, the model reloads."""
    sharded = ("checkpoint.save_contents=[model,optimizer,extra]", "engine.strategy=fsdp2", "engine.fsdp_size=-1")
    full, w_full = _run(tiny_model_dir, tmp_path / "a", *sharded)
    step = tmp_path / "a" / "global_step_3"
    assert (step / "sft" / "checkpoint_complete.json").is_file() and (step / "step_complete.json").is_file()
    assert not (step / "config.json").exists() and not (step / "model.safetensors").exists()
    shutil.rmtree(step)  # as if the run had died during step 3
    resumed, w_resumed = _run(tiny_model_dir, tmp_path / "a", *sharded)
    assert resumed["metrics"]["train/loss"] == full["metrics"]["train/loss"]
    torch.testing.assert_close(w_resumed, w_full, rtol=0, atol=0)
    _run(tiny_model_dir, tmp_path / "b", "checkpoint.save_contents=[model,hf_model]")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "global_step_3") is not None
    with pytest.raises(ConfigError, match=r"checkpoint.save_contents=\['hf_model'\].*'model' is always one"):
        load_sft_config(["model.path=/m", "checkpoint.save_contents=[hf_model]"])
    assert load_sft_config(["model.path=/m", "engine.fsdp_size=2", "engine.strategy=fsdp"]).model.fsdp_config.fsdp_size == 2


def test_lora_sft_trains_the_adapter_resumes_exactly_and_saves_the_merged_model(tiny_model_dir, tmp_path):
    """``rlfoundry sft model.lora_rank=8``: only the adapter trains; the step directory holds the merged
    model (``from_pretrained`` gives the trainer's logits); a resumed run repeats the next step."""
    pytest.importorskip("peft")
    lora = ("model.lora_rank=8", "model.lora_alpha=16", "optim.lr=1e-2")
    full, _ = _run(tiny_model_dir, tmp_path / "a", *lora)
    _run(tiny_model_dir, tmp_path / "b", *lora, "trainer.total_training_steps=2")
    trainer = SFTTrainer(load_sft_config(_overrides(tiny_model_dir, tmp_path / "b", "data.micro_batch_size_per_gpu=8",
                                                    "trainer.total_training_steps=3", "trainer.save_freq=1", *lora)))
    resumed = trainer.fit()
    assert resumed["steps"] == 3 and resumed["metrics"]["train/loss"] == full["metrics"]["train/loss"]
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    trainable = [n for n, p in trainer.engine.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    batch = _fixed_batch(trainer)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        expected = trainer.engine.module.eval()(**inputs).logits
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "global_step_3").eval()(**inputs).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


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
    with pytest.raises(ConfigError, match="Did you mean 'optim.lr'"):
        load_sft_config(["model.partial_pretrain=x", "optim.lrr=1e-4"])
    with pytest.raises(ConfigError, match="Did you mean 'data.micro_batch_size_per_gpu'"):
        load_sft_config(["model.partial_pretrain=x", "data.micro_batch_size_per_gp=4"])
    with pytest.raises(ConfigError, match="'data.train_batch_size'.*'many' is not valid; expected an integer"):
        load_sft_config(["model.partial_pretrain=x", "data.train_batch_size=many"])


def test_batch_sizes_choices_and_required_keys_are_reported_together():
    with pytest.raises(ConfigError, match=r"10 sequences per rank, not divisible by data.micro_batch_size_per_gpu \(4\)"):
        load_sft_config(["model.partial_pretrain=x", "data.train_batch_size=10", "data.micro_batch_size_per_gpu=4"])
    with pytest.raises(ConfigError, match="model.partial_pretrain is required") as e:
        load_sft_config(["model.cpu_kernels=fast", "trainer.logger=[console,swanlab]"])
    assert "model.cpu_kernels='fast' must be one of ['auto', 'off']" in str(e.value)
    assert "trainer.logger entries ['swanlab']" in str(e.value)


def test_command_line_errors_and_help(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["model.partial_pretrain=x", "optim.lrr=1"])
    assert e.value.code == 2 and "rlfoundry sft: Unknown config key 'optim.lrr'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "micro_batch_size_per_gpu: 4" in capsys.readouterr().out  # the schema's defaults


# ───────────────────────────── verl's SFT command lines ─────────────────────────────


def test_verls_other_sft_spellings_reach_the_keys_the_trainer_reads():
    cfg = load_sft_config(["model.path=/m", "data.micro_batch_size_per_gpu=4", "model.use_remove_padding=true",
                           "optim.lr_warmup_steps_ratio=0.2", "optim.lr_scheduler_type=constant", "model.strategy=fsdp",
                           "engine=fsdp", "optim=fsdp", "model=hf_model"])
    assert (cfg.model.partial_pretrain, cfg.data.micro_batch_size_per_gpu, cfg.use_remove_padding) == ("/m", 4, True)
    assert (cfg.optim.warmup_steps_ratio, cfg.optim.lr_scheduler) == (0.2, "constant")
    assert load_sft_config(["model.path=/m", "optim.warmup_style=constant"]).optim.lr_scheduler == "constant"
    assert load_sft_config(["model.path=/m", "data.pad_mode=no_padding"]).use_remove_padding is True
    assert load_sft_config(["model.path=/m", "data.pad_mode=left_right"]).use_remove_padding is False
    with pytest.raises(ConfigError, match="two spellings"):
        load_sft_config(["model.path=/m", "model.partial_pretrain=/other"])
    with pytest.raises(ConfigError, match="two spellings"):
        load_sft_config(["model.path=/m", "data.pad_mode=no_padding", "use_remove_padding=false"])


def test_verls_unread_micro_batch_size_warns_and_changes_nothing():
    from rlfoundry.config.verl_compat import NoEffectKeyWarning

    with pytest.warns(NoEffectKeyWarning, match="data.micro_batch_size=8"):
        cfg = load_sft_config(["model.path=/m", "data.micro_batch_size=8"])
    assert cfg.data.micro_batch_size_per_gpu == load_sft_config(["model.path=/m"]).data.micro_batch_size_per_gpu


@pytest.mark.parametrize(("override", "named"), [
    ("engine=veomni", "veomni engine"), ("optim=veomni", "veomni optim"),  # engine=automodel: test_automodel_keys.py
    ("model.strategy=veomni", "model.strategy"),  # engine=megatron: tests/trainer/test_sft_megatron.py
    ("model.use_liger=true", "- model.use_liger=true"),  # CPU here: Liger's kernels need CUDA
    ("model.mtp.enable_train=true", "model.mtp.enable_train=true: multi-token prediction"),
    ("model.mtp.enable_rollout=true", "model.mtp.enable_rollout=true: SFT samples nothing"),
])
def test_what_sft_does_not_build_is_an_error_naming_it(override, named):
    with pytest.raises(ConfigError, match=named):
        load_sft_config(["model.partial_pretrain=/m", override])


def test_sft_config_names_and_the_dry_run(tmp_path, monkeypatch, capsys):
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)  # verl's scripts pass its own config dir: absent here, the schema's defaults
    assert main(["--config-path=config", "--config-name=sft_trainer", "model.partial_pretrain=/m",
                 "data.micro_batch_size_per_gpu=4", "--cfg", "job"]) == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed.data.micro_batch_size_per_gpu == 4 and printed.model.partial_pretrain == "/m"
    (tmp_path / "mine").mkdir()  # a user's SFT YAML with a defaults list over verl's SFT name
    (tmp_path / "mine" / "sft.yaml").write_text("defaults: [sft_trainer, _self_]\noptim:\n  lr: 0.5\n")
    assert load_sft_config(["model.partial_pretrain=/m"], "sft.yaml", "mine").optim.lr == 0.5


# ───────────────────────────── conversation rows (verl's multi-turn SFT) ─────────────────────────────

_CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
         {"role": "assistant", "content": "6"}]


def test_a_conversation_trains_every_assistant_turn_and_nothing_else():
    from rlfoundry.data.sft_dataset import _conversation, encode_conversation

    tokenizer = build_tokenizer()
    messages, response = _conversation({"messages": _CHAT}, ("messages", "tools", "enable_thinking"), "row 0")
    example = encode_conversation(tokenizer, messages, 512)
    ids, mask = example["input_ids"].tolist(), example["loss_mask"].tolist()
    assert response is None
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(_CHAT, tokenize=False)  # the whole template
    # the trained tokens are the two assistant turns with their end-of-turn markers, in order
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "4<|im_end|>\n6<|im_end|>\n"
    batch = collate_sft([example], tokenizer.pad_token_id)
    assert int(batch["response_mask"].sum()) == sum(mask)  # the RL layout keeps every trained token


def test_conversation_rows_from_either_verl_layout(tmp_path):
    from omegaconf import OmegaConf

    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"conv": _CHAT, "tools": json.dumps([{"type": "function"}]),
                                           "enable_thinking": False}) for _ in range(2)))
    newer = OmegaConf.create({"messages_key": "conv", "tools_key": "tools", "image_key": "images"})
    older = OmegaConf.create({"multiturn": {"enable": True, "messages_key": "conv", "tools_key": "tools",
                                            "enable_thinking_key": "enable_thinking"}, "image_key": "images"})
    for cfg in (newer, older):
        (messages, response), _ = load_pairs(str(path), cfg)
        assert response is None and messages[1:] == _CHAT
        assert messages[0] == {"role": "_template_args", "tools": [{"type": "function"}], "enable_thinking": False}
    with pytest.raises(SFTDataError, match="no column 'messages'"):
        load_pairs(str(path), OmegaConf.create({"multiturn": {"enable": True}, "image_key": "images"}))


def test_sft_trains_on_conversation_rows(tiny_model_dir, tmp_path):
    from rlfoundry.data.sft_dataset import _conversation, encode_conversation

    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": _CHAT}) for _ in range(16)))
    trainer = SFTTrainer(load_sft_config(_overrides(tiny_model_dir, tmp_path / "run", "data.messages_key=messages",
                                                    f"data.train_files={path}", "data.max_length=128")))
    try:
        metrics = trainer.train_step(next(iter(trainer.train_loader)))
    finally:
        trainer._finish(0.0)
    per_row = int(encode_conversation(trainer.tokenizer, _conversation({"messages": _CHAT}, ("messages", "t", "e"),
                                                                       "")[0], 128)["loss_mask"].sum())
    assert metrics["train/response_tokens"] == 16 * per_row  # the assistant turns' tokens, nothing else
    assert math.isfinite(metrics["train/loss"])


@pytest.mark.numerics
def test_token_budget_micro_batches_give_the_same_update(tiny_model_dir, tmp_path):
    # verl's data.use_dynamic_bsz: micro-batches of at most max_token_len_per_gpu tokens (each row here is
    # at most data.max_length=64 tokens, so a 64-token budget cuts the 16 rows into many micro-batches)
    # the gradients of the step, normwise within float32 re-association (not the weights after Adam: #51)
    loss16, g16, bound = _one_step_grads(tiny_model_dir, tmp_path / "a", "data.micro_batch_size_per_gpu=16")
    budget, g_budget, _ = _one_step_grads(tiny_model_dir, tmp_path / "b", "data.use_dynamic_bsz=true",
                                          "data.max_token_len_per_gpu=64")
    assert budget == pytest.approx(loss16, rel=1e-5)
    assert_same_gradients(g_budget, g16, bound, "token budget")
    with pytest.raises(ConfigError, match="max_token_len_per_gpu"):
        load_sft_config(["model.path=/m", "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=32"])


def _ulysses_rank(rank: int, model_dir, run_dir, port: int, out) -> None:
    """One of two ranks of an SP=2 group: the SFT trainer under torchrun's variables, one step."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    trainer = SFTTrainer(load_sft_config(_overrides(model_dir, run_dir, "engine.ulysses_sequence_parallel_size=2",
                                                    "data.pad_mode=no_padding", "trainer.n_gpus_per_node=2")))
    try:
        metrics = trainer.train_step(_fixed_batch(trainer))
        grads = first_step_gradients(trainer.engine.optimizer, trainer.engine.module)  # collective: every rank
        if rank == 0:
            # the group really splits each row (with one whole copy of the rows per rank, plain data
            # parallelism would give the same numbers)
            from rlfoundry.engines.fsdp.ulysses import ATTN_IMPLEMENTATION

            module = trainer.engine.module
            split = (trainer.engine.sp.size, module.config._attn_implementation == ATTN_IMPLEMENTATION)
            torch.save({"metrics": metrics, "grads": grads, "split": split}, out)
    finally:
        trainer._finish(0.0)


@pytest.mark.numerics
@pytest.mark.slow
def test_ulysses_sft_on_two_ranks_takes_the_one_rank_step(tiny_model_dir, tmp_path):
    """verl's SFT ulysses_sequence_parallel_size: an SP=2 group (two gloo ranks, each half of every packed
    row, both reading the same rows) takes the step one rank takes on the whole rows: the loss, the
    token count and the gradients, within float32 re-association."""
    from tests import rank_server

    from rlfoundry.single_controller.base.worker import find_free_port

    out = tmp_path / "sp2.pt"
    rank_server.run(_ulysses_rank, args=(tiny_model_dir, tmp_path / "sp2", find_free_port(), out), nprocs=2)
    two = torch.load(out)
    assert two["split"] == (2, True)
    loss, grads, bound = _one_step_grads(tiny_model_dir, tmp_path / "sp1", "use_remove_padding=true")
    assert two["metrics"]["train/loss"] == pytest.approx(loss, rel=1e-5)
    one_tokens = _one_step_tokens(tiny_model_dir, tmp_path / "tokens")
    assert two["metrics"]["train/response_tokens"] == one_tokens  # each row counted once, not once per SP rank
    assert_same_gradients(two["grads"], grads, bound, "Ulysses SP=2")


def _one_step_tokens(model_dir, run_dir) -> float:
    trainer = SFTTrainer(load_sft_config(_overrides(model_dir, run_dir)))
    try:
        return float(_fixed_batch(trainer)["response_mask"].sum())
    finally:
        trainer._finish(0.0)


def test_ulysses_sft_config_rules(monkeypatch):
    def load(*keys, world=1):
        monkeypatch.setenv("WORLD_SIZE", str(world))  # torchrun's, which the loader reads
        return load_sft_config(["model.path=/m", *keys])

    assert load("engine.ulysses_sequence_parallel_size=1").ulysses_sequence_parallel_size == 1
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2 splits packed rows only"):
        load("engine.ulysses_sequence_parallel_size=2", world=2)
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2 does not divide the 1 ranks"):
        load("ulysses_sequence_parallel_size=2", "use_remove_padding=true")
    # verl's batch arithmetic: 8 ranks in SP groups of 2 are 4 data-parallel ranks of 64 / 4 = 16 rows
    sp = ("ulysses_sequence_parallel_size=2", "use_remove_padding=true")
    load(*sp, "data.train_batch_size=64", "data.micro_batch_size_per_gpu=16", world=8)
    with pytest.raises(ConfigError, match="64 / 8 = 8 sequences per rank"):
        load("data.train_batch_size=64", "data.micro_batch_size_per_gpu=16", world=8)
    # the token budget is a GPU's: an SP group holds sp of them
    load(*sp, "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=32", "data.max_length=64", world=2)
    with pytest.raises(ConfigError, match="max_token_len_per_gpu"):
        load("data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=32", "data.max_length=64")


class _LayoutEngine(EnginePlugin):
    """A third-party engine whose model copies span tensor x pipeline ranks, laid out in its own subtree (the
    engine group's keys, under the Megatron engine's key names), which its check names."""

    name = "layout_engine"
    layout_key = "megatron"

    def build(self, request, device, role):
        raise AssertionError("the start-up checks build nothing")

    def model_copy(self, role):
        return role.megatron.tensor_model_parallel_size * role.megatron.pipeline_model_parallel_size, "megatron.tp x pp"

    def check(self, cfg, roles, world_size):
        copy = self.model_copy(cfg[roles[0]])[0]
        if world_size % copy:
            return [f"{roles[0]}.megatron: tp x pp = {copy} does not divide the {world_size} ranks"]
        return []


LAYOUT_ENGINE = _LayoutEngine()


def test_sft_layout_checks_follow_the_engine_plugin_not_its_name(monkeypatch):
    """The checks ask the registered plug-in what its layout is, as the RL roles' do: the FSDP2 engine's name
    with this plug-in behind it gets model-parallel checks, the Megatron engine's name with the FSDP plug-in
    behind it gets Ulysses groups."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    load = lambda *keys: load_sft_config(["model.path=/m", "data.train_batch_size=16", *keys])  # noqa: E731
    monkeypatch.setitem(TRAINING_ENGINES, "fsdp2", f"{__name__}:LAYOUT_ENGINE")
    # TP=2 x PP=2 of 8 ranks: 2 model copies read 16 / 2 = 8 rows each, micro-batches of 4 (by the name's
    # rules: the engine.* keys an error, and 8 data-parallel ranks of 2 rows)
    cfg = load("model.strategy=fsdp2", "engine.tensor_model_parallel_size=2", "engine.pipeline_model_parallel_size=2",
               "data.micro_batch_size_per_gpu=4")
    assert cfg.engine.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match=r"16 / 2 = 8 sequences per rank, not divisible by data.micro_batch_size"):
        load("engine.tensor_model_parallel_size=4", "data.micro_batch_size_per_gpu=3")
    # a layout that does not divide the ranks: the plug-in's check says so, in the SFT config's keys
    with pytest.raises(ConfigError, match=r"engine: tp x pp = 3 does not divide the 8 ranks") as e:
        load("engine.tensor_model_parallel_size=3", "data.micro_batch_size_per_gpu=2")
    assert "use a divisor" not in str(e.value)  # the Ulysses message is not given beside it
    with pytest.raises(ConfigError, match="model.lora_rank=8 with engine=layout_engine"):  # FSDP keys it does not read
        load("model.lora_rank=8", "data.micro_batch_size_per_gpu=2")
    # the Megatron engine's name, the FSDP engine's plug-in: SP=2 groups make 8 / 2 = 4 data-parallel ranks of 4 rows
    monkeypatch.setitem(TRAINING_ENGINES, "megatron", "rlfoundry.engines.fsdp.plugin:PLUGIN")
    with pytest.raises(ConfigError, match=r"16 / 4 = 4 sequences per rank, not divisible by data.micro_batch_size"):
        load("engine=megatron", "optim=megatron", "ulysses_sequence_parallel_size=2", "use_remove_padding=true",
             "data.micro_batch_size_per_gpu=8")


class _WordTokenizer:
    """Whitespace words as tokens, the template joining the contents: a turn boundary inside a word makes the
    turn-by-turn tokens ("hel" | "lo") differ from the whole text's ("hello")."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False, **_):
        return "".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]}


def test_turn_tokens_that_differ_from_the_whole_texts_are_an_error_unless_ignored():
    from rlfoundry.data.sft_dataset import _conversation, encode_conversation

    chat = [{"role": "user", "content": "hel"}, {"role": "assistant", "content": "lo world"}]
    messages, _ = _conversation({"messages": chat}, ("messages", "tools", "enable_thinking"), "row 3")
    tokenizer = _WordTokenizer()
    with pytest.raises(SFTDataError, match="row 3.*ignore_input_ids_mismatch"):
        encode_conversation(tokenizer, messages, 64, where="row 3")
    kept = encode_conversation(tokenizer, messages, 64, ignore_mismatch=True)
    v = tokenizer.vocab
    assert kept["input_ids"].tolist() == [v["hel"], v["lo"], v["world"]]  # verl's choice: the turn-by-turn tokens
    assert kept["loss_mask"].tolist() == [0, 1, 1]
    assert load_sft_config(["model.path=/m", "data.ignore_input_ids_mismatch=true"]).data.ignore_input_ids_mismatch


# ───────────────────────────── verl's engine=automodel (config/automodel.py) ─────────────────────────────

def _three_steps(model_dir, run_dir, *engine: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Three steps on one fixed batch: their losses, their lrs and the weights after them."""
    base = [o for o in _overrides(model_dir, run_dir) if not o.startswith("optim.")]
    trainer = SFTTrainer(load_sft_config([*base, "trainer.total_training_steps=3", *engine]))
    try:
        batch = _fixed_batch(trainer)
        metrics = [trainer.train_step(batch) for _ in range(3)]
        weights = {n: _full(p) for n, p in trainer.engine.module.named_parameters()}
    finally:
        trainer._finish(0.0)
    return [m["train/loss"] for m in metrics], [m["train/lr"] for m in metrics], weights


def test_automodel_engine_steps_are_the_fsdp_engines(tiny_model_dir, tmp_path):
    """verl's engine=automodel optim=automodel trains the FSDP engine's steps bit for bit: AutoModel's schedule
    (Megatron's: warm-up from lr x init_lr_ratio, then a half cosine to lr x min_lr_ratio at the last step) is the
    SFT schedule with lr_warmup_init = lr x init_lr_ratio; its accepted kernel choices change no number."""
    automodel = _three_steps(tiny_model_dir, tmp_path / "a", "engine=automodel", "engine.distributed_strategy=fsdp2",
                             "engine.tp_size=1", "engine.ep_size=1", "engine.backend_config.linear=te",
                             "engine.attn_implementation=flash_attention_2", "optim=automodel", "optim.lr=1e-3",
                             "optim.lr_warmup_steps=1", "optim.init_lr_ratio=0.5", "optim.min_lr_ratio=0.1",
                             "optim.lr_scheduler_type=cosine", "optim.betas=[0.9,0.95]")
    fsdp = _three_steps(tiny_model_dir, tmp_path / "f", "engine=fsdp", "optim=fsdp", "optim.lr=1e-3",
                        "optim.lr_warmup_steps=1", "optim.warmup_steps_ratio=0", "optim.lr_warmup_init=5e-4",
                        "optim.min_lr_ratio=0.1", "optim.lr_scheduler=cosine", "optim.betas=[0.9,0.95]")
    assert automodel[1] == pytest.approx([5e-4, 1e-3, 1e-4 + 0.5 * (1 + math.cos(math.pi / 2)) * 9e-4], rel=1e-12)
    assert automodel[0] == fsdp[0] and automodel[1] == fsdp[1]
    assert automodel[2].keys() == fsdp[2].keys()
    for name, weight in automodel[2].items():
        assert torch.equal(weight, fsdp[2][name]), name


def _expert_parallel_rank(rank: int, model_dir, run_dir, port: int, out) -> None:
    """One of two ranks of verl's engine=automodel engine.ep_size=2: the SFT trainer under torchrun's variables."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    base = [o for o in _overrides(model_dir, run_dir) if not o.startswith("optim.")]
    trainer = SFTTrainer(load_sft_config([*base, "data.micro_batch_size_per_gpu=8", "engine=automodel",
                                          "engine.ep_size=2", "optim.lr=1e-3", "optim.betas=[0.9,0.95]",
                                          "trainer.n_gpus_per_node=2"]))
    try:
        trainer.train_step(_fixed_batch(trainer))
        grads = first_step_gradients(trainer.engine.optimizer, trainer.engine.module)  # collective: every rank
        if rank == 0:
            from rlfoundry.engines.fsdp.expert_parallel import EP_ATTR

            torch.save({"grads": grads, "ep": getattr(trainer.engine.module, EP_ATTR).size}, out)
    finally:
        trainer._finish(0.0)


@pytest.mark.numerics
@pytest.mark.slow
def test_automodel_ep_size_is_the_fsdp_engines_expert_parallelism(tiny_moe_dir, tmp_path):
    """engine.ep_size=2 on two gloo ranks shards the experts by expert (the FSDP engine's expert_parallel_size)
    and takes the step one rank takes on the whole batch: the gradients within float32 re-association."""
    from tests import rank_server

    from rlfoundry.single_controller.base.worker import find_free_port

    out = tmp_path / "ep2.pt"
    rank_server.run(_expert_parallel_rank, args=(tiny_moe_dir, tmp_path / "ep2", find_free_port(), out), nprocs=2)
    two = torch.load(out)
    assert two["ep"] == 2
    _, grads, bound = _one_step_grads(tiny_moe_dir, tmp_path / "ep1", "optim.betas=[0.9,0.95]")
    assert_same_gradients(two["grads"], grads, bound, "automodel ep_size=2")


def test_max_samples_keep_the_rows_verl_draws(tiny_model_dir, tmp_path):
    """verl's ``data.train_max_samples`` / ``val_max_samples`` (its Qwen3-30B automodel SFT line): with shuffle, the
    rows ``numpy.random.default_rng(seed).choice`` draws without replacement, as verl's SFT dataset draws them
    (data.seed, else trainer.seed here: the same rows after a resume); without shuffle the first ones; -1 all."""
    import numpy as np

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+0=", "a": str(i)}) + "\n" for i in range(20)))

    def responses(*extra):
        trainer = SFTTrainer(load_sft_config(_overrides(tiny_model_dir, tmp_path / "run", f"data.train_files={data}",
                                                        f"data.val_files={data}", "data.prompt_key=q",
                                                        "data.response_key=a", "data.train_batch_size=2",
                                                        "data.micro_batch_size_per_gpu=2", *extra)))
        train, val = trainer._pairs()
        return [int(r) for _, r in train], [int(r) for _, r in val]

    train, val = responses("data.train_max_samples=5", "data.val_max_samples=3", "data.seed=7", "trainer.seed=1")
    assert train == list(np.random.default_rng(7).choice(20, size=5, replace=False))
    assert val == list(np.random.default_rng(7).choice(20, size=3, replace=False))
    train, _ = responses("data.train_max_samples=4", "trainer.seed=3")  # data.seed null: trainer.seed's draw
    assert train == list(np.random.default_rng(3).choice(20, size=4, replace=False)) and len(set(train)) == 4
    train, val = responses("data.train_max_samples=4", "data.shuffle=false")
    assert (train, val) == ([0, 1, 2, 3], list(range(20)))
