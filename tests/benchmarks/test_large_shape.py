"""benchmarks/large_shape.py: the named shapes are Qwen2.5-7B's and 3B's, and a tiny CPU run through the real
trainer reports FLOPs, tokens and the planner's prediction that can be derived by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.large_shape import SHAPES, model_config, step_flops

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape, params", [
    # the model cards' totals: Qwen2.5-7B 7.61 B (untied head), Qwen2.5-3B 3.09 B (tied); docs/plan.md has the 7B's exactly
    ("qwen2.5-7b", 7_615_616_512),
    # 3B by hand: embedding 151936·2048 = 311,164,928 (the head is tied to it); a layer: q and o 2048², k and v
    # 2048·256, q/k/v biases 2048 + 2·256, MLP 3·2048·11008, two norms 2·2048: 77,076,992; ·36 + final norm 2048
    ("qwen2.5-3b", 3_085_938_688),
])
def test_the_named_shapes_have_the_published_parameter_counts(shape, params):
    from rlfoundry.plan.model import param_counts, shape_from_config

    assert param_counts(shape_from_config({**model_config(shape), "model_type": "qwen2"}))[0] == params


def test_layer_and_hidden_overrides_keep_the_shape_s_proportions():
    keys = model_config("qwen2.5-7b", layers=2, hidden=896)
    assert (keys["num_hidden_layers"], keys["hidden_size"], keys["intermediate_size"]) == (2, 896, 18944 // 4)
    assert keys["vocab_size"] == SHAPES["qwen2.5-7b"]["vocab_size"]


def test_lora_updates_count_four_flops_per_weight_and_full_fine_tuning_six():
    costs = {"flops_per_token": 1000.0, "attention_flops_per_token_per_context": 2.0}
    # 40 tokens over 4 sequences: mean context 40/4/2 = 5, attention 2·5 = 10 FLOPs a token's forward
    lora = step_flops(costs, 40, 4, {"gen": 1.0, "update_actor": 1.0}, "lora")
    full = step_flops(costs, 40, 4, {"gen": 1.0, "old_log_prob": 1.0, "update_actor": 1.0}, "full-offload")
    assert lora == {"gen": 40 * 1010, "update_actor": 40 * (4 * 500 + 3 * 10)}  # no old_log_prob phase: none counted
    assert full == {"gen": 40 * 1010, "old_log_prob": 40 * 1010, "update_actor": 40 * (6 * 500 + 3 * 10)}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("large")
    out = work / "run.json"
    cmd = [sys.executable, "-m", "benchmarks.large_shape", "--shape", "tiny", "--mode", "full-offload", "--device", "cpu",
           "--prompts", "2", "--n", "2", "--response-length", "8", "--micro", "2", "--steps", "2", "--threads", "1",
           "--peak-gflops", "100", "--work-dir", str(work), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_the_tiny_run_reports_hand_derived_flops_per_token(tiny_run):
    r, _ = tiny_run
    # tiny: hidden 64, 4 heads of 16, 2 KV heads (k, v 64·32), MLP 128, vocabulary 260 (the byte tokenizer), 2 layers.
    # A layer's linears: 64·(64 + 32 + 32 + 64) + 3·64·128 = 12,288 + 24,576 = 36,864; two: 73,728; head 64·260 =
    # 16,640 (the embedding is a lookup): 90,368 weights, 2 FLOPs each a token
    assert r["costs"]["flops_per_token"] == 2 * 90_368
    # the planner counts every parameter: + embedding 16,640, q/k/v biases 2·128, norms 2·128 + 64
    assert r["plan"]["params_total"] == 90_368 + 16_640 + 2 * 128 + 2 * 128 + 64


def test_the_tiny_run_counts_the_batch_s_tokens_and_prints_the_plan_beside_them(tiny_run):
    r, stdout = tiny_run
    assert len(r["steps"]) == 2 and r["summary"]["steps"] == 1  # the first step is the warm-up
    for s in r["steps"]:
        assert s["samples"] == 2 * 2
        # the batch's response mask against the trainer's own response_length/mean metric
        assert s["response_tokens"] == round(s["response_length_mean"] * s["samples"]) > 0
        assert s["tokens"] > s["response_tokens"]  # the prompts' tokens too
        assert s["tokens_per_s"] == pytest.approx(s["tokens"] / s["step_s"])
        # full fine-tuning: 6 FLOPs per weight a token in the update, against the peak given (100 GFLOP/s)
        flops = step_flops(r["costs"], s["tokens"], s["samples"], s["phases_s"], "full-offload")
        assert s["mfu_update"] == pytest.approx(flops["update_actor"] / s["phases_s"]["update_actor"] / 100e9)
        assert s["memory_source"].endswith("(ru_maxrss)") and s["peak_rss_bytes"] > 0
        assert s["memory_vs_plan"] == pytest.approx(s["peak_rss_bytes"] / r["plan"]["peak_bytes"])
    plan = r["plan"]
    assert plan["hardware"] == "cpu" and plan["peak_bytes"] > 0 and plan["times_s"]["step"] > 0
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true" in r["overrides"]
    assert "trainer.worker_backend=local" in r["overrides"]
    assert "step 1 (warm-up):" in stdout and "(plan " in stdout


def test_the_gpu_check_fails_the_large_part_when_a_run_failed(tmp_path):
    from scripts.gpu_check_report import judge, large_figures

    ok = {"run": "qwen2.5-3b:full-offload", "plan": {"times_s": {"step": 2.0}, "peak_phase": "actor update",
                                                      "peak_bytes": 40 * 2**30},
          "summary": {"step_s": 3.0, "tokens_per_s": 4000.0, "mfu_update": 0.3, "step_vs_plan": 1.5, "update_vs_plan": 2.0,
                      "peak_memory_bytes": 44 * 2**30, "plan_peak_bytes": 40 * 2**30, "memory_vs_plan": 1.1,
                      "memory_source": "cuda"}}
    failed = {"run": "qwen2.5-7b:lora", "error": "exit timeout after 220 s"}
    path = tmp_path / "large_cuda.json"
    part = {"rc": 0, "seconds": 300, "limit_s": 480}
    path.write_text(json.dumps({"results": [ok]}))
    assert judge("large", part, large_figures(path), "cuda") == (True, "")
    path.write_text(json.dumps({"results": [ok, failed]}))
    assert judge("large", part, large_figures(path), "cuda") == (False, "qwen2.5-7b:lora: exit timeout after 220 s")


def test_the_engine_s_loader_makes_the_weights_on_the_device_asked_and_is_restored(tmp_path):
    """No weight file is read: the model comes from config.json on the device (here ``meta``, where nothing is
    allocated, as nothing is on the host for ``cuda``) in the dtype the engine asks for."""
    from benchmarks.large_shape import weights_made_on_device, write_model_dir
    from rlfoundry.engines.fsdp import engine as fsdp_engine
    from rlfoundry.trainer import config as trainer_config

    real = fsdp_engine.load_hf_model
    model_dir = write_model_dir("tiny", model_config("tiny"), tmp_path)
    assert not list(model_dir.glob("*.safetensors")) and not trainer_config.is_hf_model_dir(model_dir)
    with weights_made_on_device("meta", seed=0):
        module = fsdp_engine.load_hf_model(str(model_dir), torch_dtype="bf16")
        assert trainer_config.is_hf_model_dir(model_dir)  # the start-up check takes a directory without weights
    assert {(p.device.type, str(p.dtype)) for p in module.parameters()} == {("meta", "torch.bfloat16")}
    assert module.config.num_hidden_layers == 2 and module.config.use_cache is False
    assert fsdp_engine.load_hf_model is real and not trainer_config.is_hf_model_dir(model_dir)


def test_a_run_that_fails_is_recorded_as_failed_beside_the_others(tmp_path):
    """A child the trainer refuses (a misspelt key) leaves an error row in the saved JSON, which fails the part."""
    from scripts.gpu_check_report import judge, large_figures

    cmd = [sys.executable, "-m", "benchmarks.large_shape", "--runs", "tiny:lora", "--device", "cpu", "--steps", "2",
           "--peak-gflops", "100", "--override", "actor_rollout_ref.actor.optim.lrr=1", "--work-dir", str(tmp_path),
           "--results-dir", str(tmp_path), "--name", "large_cpu"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "tiny:lora FAILED: exit " in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = large_figures(tmp_path / "large_cpu.json")
    assert figures["runs"][0]["error"].startswith("exit ") and "0 steps done" in figures["runs"][0]["error"]
    assert judge("large", {"rc": 0, "seconds": 9, "limit_s": 240}, figures, "cpu")[0] is False
