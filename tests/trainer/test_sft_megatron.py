"""SFT on the Megatron engine (verl's ``engine=megatron optim=megatron``): the same steps as the FSDP2 engine's
(1 rank, TP=2, PP=2 on gloo CPU ranks), checkpoint/resume, the HF export, and the config's rules."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlfoundry.trainer.config import ConfigError
from rlfoundry.trainer.sft_trainer import SFTTrainer, load_sft_config
from tests.trainer.test_sft import _overrides

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

# optim.eps=1e-4 (as tests/engines/test_megatron_engine.py): Adam's step of an element whose gradient is ~0
# stays proportional to it, so fp32 re-association across TP/PP moves a weight by ~1e-7, not by ~lr; a loss
# scaled or a row routed wrongly moves thousands of weights by ~lr = 1e-3. Two steps, fp32 on both engines.
STEPS = ("optim.eps=1e-4", "model.cpu_kernels=off", "trainer.total_training_steps=2")
MEGATRON = ("engine=megatron", "optim=megatron")  # engine.dtype: verl's bfloat16, float32 on the CPU (as PPO's)


def _weights(trainer: SFTTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.engine.iter_hf_weights()}  # collective: every rank


def _train(overrides: list[str]) -> dict:
    """Fit (two steps) and return each step's loss, the weights and where the checkpoints went."""
    trainer = SFTTrainer(load_sft_config(overrides))
    losses = []
    log = trainer.train_step
    trainer.train_step = lambda batch: losses.append(log(batch)) or losses[-1]
    try:
        summary = trainer._train_loop()
        return {"losses": [m["train/loss"] for m in losses], "weights": _weights(trainer), "last": summary[0],
                "dp": trainer.engine.dp_size, "resumed": trainer.resumed_from}
    finally:
        trainer._finish(0.0)


def _rank(rank: int, world: int, ports: list[int], runs: list[list[str]], out: str, between=None) -> None:
    """One rank of ``world`` under torchrun's variables: the SFT trainer over each of ``runs`` in turn, each
    its own process group (``between(i)`` after run i, on rank 0), rank 0's results saved to ``out``."""
    torch.set_num_threads(1)
    results = []
    for i, overrides in enumerate(runs):
        if world > 1:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[i]))
        results.append(_train(overrides))
        if between is not None and rank == 0:
            between(i)
    if rank == 0:
        torch.save(results, out)
    sys.stdout.flush()
    for child in mp.active_children():  # dist-checkpointing's manager process
        child.terminate()
    os._exit(0)  # gloo's threads torn down at interpreter exit can abort the process


def _spawn(world: int, runs: list[list[str]], tmp_path: Path, between=None) -> list[dict]:
    from rlfoundry.single_controller.base.worker import find_free_port

    out = tmp_path / f"results-{world}.pt"
    ports: list[int] = []
    while len(ports) < len(runs):  # one rendezvous per run: a port a torn-down group used may still be closing
        ports += [p for p in [find_free_port()] if p not in ports]
    mp.spawn(_rank, args=(world, ports, runs, str(out), between), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def fsdp_run(tiny_model_dir, tmp_path_factory) -> dict:
    return _train(_overrides(tiny_model_dir, tmp_path_factory.mktemp("fsdp"), *STEPS))


def _assert_same_steps(got: dict, want: dict) -> None:
    moved = max((want["weights"][k] - v).abs().max().item() for k, v in _initial(got).items())
    assert moved > 1e-4, "the steps moved the weights: equality is not vacuous"
    # the losses: the same sums in another order (fp32 over ~260 vocabulary entries and ~1000 tokens)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    # the norm before clipping, over every parallel group (~3.6 > optim.clip_grad=1: the clip binds, so the weights'
    # equality below also shows the engine clips as the FSDP one does)
    assert got["last"]["train/grad_norm"] == pytest.approx(want["last"]["train/grad_norm"], rel=1e-4)
    # each row counted once, not once per rank of the model copy
    assert got["last"]["train/response_tokens"] == want["last"]["train/response_tokens"]
    # the validation loss after the steps (the engine's forward-only pass over the held-out pairs)
    assert got["last"]["val/loss"] == pytest.approx(want["last"]["val/loss"], rel=1e-5)
    assert set(got["weights"]) == set(want["weights"])
    for name, tensor in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _initial(run: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(run["model_dir"]) / "model.safetensors"))


@pytest.mark.numerics
@pytest.mark.slow
def test_two_rank_megatron_sft_takes_the_fsdp_steps(tiny_model_dir, tmp_path, fsdp_run):
    """Two ranks, two runs in the same processes: TP=2 (one model copy over both ranks, both reading the same
    rows; PP=2 passes too, ~75 s here), then DP=2 (each rank half of every batch, the distributed optimiser
    sharding Adam's state), then DP=2 under Megatron-FSDP: the two steps' losses, the validation loss and the weights after them equal the
    1-rank FSDP2 engine's."""
    runs = [_overrides(tiny_model_dir, tmp_path / name, *STEPS, *MEGATRON, *layout, "engine.dtype=float32",
                       "trainer.n_gpus_per_node=2")
            for name, layout in (("tp2", ["engine.tensor_model_parallel_size=2"]),
                                 ("dp2", ["data.micro_batch_size_per_gpu=8"]),
                                 # Megatron-FSDP: parameters, gradients and Adam's state sharded over the two
                                 ("dp2fsdp", ["data.micro_batch_size_per_gpu=8", "engine.use_megatron_fsdp=true"]))]
    tp2, dp2, dp2fsdp = _spawn(2, runs, tmp_path)
    assert (tp2["dp"], dp2["dp"], dp2fsdp["dp"]) == (1, 2, 2)
    for run in (tp2, dp2, dp2fsdp):
        _assert_same_steps(run | {"model_dir": tiny_model_dir}, fsdp_run)


def _set_aside(run_dir: Path, i: int) -> None:
    """After the first run: its last step's HF export set aside, the step removed (as if the run had died
    during it), so the second run resumes from step 1."""
    if i == 0:
        shutil.copytree(run_dir / "global_step_2", run_dir.parent / "exported")
        shutil.rmtree(run_dir / "global_step_2")


@pytest.fixture(scope="module")
def one_rank_runs(tiny_model_dir, tmp_path_factory) -> tuple[list[dict], Path]:
    """1 rank: two steps saving each, then the run again, resuming from step 1."""
    tmp = tmp_path_factory.mktemp("megatron1")
    overrides = _overrides(tiny_model_dir, tmp / "run", *STEPS, *MEGATRON, "trainer.save_freq=1",
                           "optim.lr_scheduler=cosine", "optim.warmup_steps_ratio=0.5")
    return _spawn(1, [overrides, overrides], tmp, functools.partial(_set_aside, tmp / "run")), tmp


@pytest.mark.numerics
@pytest.mark.slow
def test_one_rank_megatron_sft_takes_the_fsdp_steps(tiny_model_dir, tmp_path, one_rank_runs):
    (run, _), _ = one_rank_runs
    assert run["resumed"] is None
    schedule = ("optim.lr_scheduler=cosine", "optim.warmup_steps_ratio=0.5")
    fsdp = _train(_overrides(tiny_model_dir, tmp_path, *STEPS, *schedule))
    _assert_same_steps(run | {"model_dir": tiny_model_dir}, fsdp)


@pytest.mark.slow
def test_megatron_sft_resumes_to_the_same_next_step(one_rank_runs):
    """The second run starts from step 1's checkpoint (megatron-core's dist checkpoint with Adam's moments,
    the LR schedule in warm-up) and its step 2 is the uninterrupted run's, bit for bit."""
    (full, resumed), tmp = one_rank_runs
    assert resumed["resumed"] == tmp / "run" / "global_step_1"
    assert resumed["losses"] == full["losses"][1:]
    assert resumed["last"]["train/lr"] == full["last"]["train/lr"]
    for name, tensor in full["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], tensor, rtol=0, atol=0)


@pytest.mark.slow
def test_megatron_sft_export_loads_in_transformers_with_the_engines_weights(one_rank_runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (full, _), tmp = one_rank_runs
    model = AutoModelForCausalLM.from_pretrained(tmp / "exported", dtype=torch.float32)
    state = model.state_dict()
    for name, tensor in full["weights"].items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(tmp / "exported").pad_token is not None


# --------------------------------------------------------------------------- config


def _load(*keys: str, world: int = 1, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))  # torchrun's, which the loader reads
    return load_sft_config(["model.path=/m", *keys])


def test_verls_megatron_keys_reach_the_engine_config():
    cfg = _load(*MEGATRON, "engine.tensor_model_parallel_size=1", "engine.param_offload=true",
                "optim.lr_decay_style=cosine", "optim.lr=2e-5", "optim.min_lr=2e-6", "optim.lr_warmup_steps=10",
                "optim.lr_warmup_init=0", "optim.clip_grad=0.5")
    assert cfg.model.strategy == "megatron" and cfg.engine.param_offload
    assert cfg.optim.lr_scheduler == "cosine" and cfg.optim.min_lr_ratio == pytest.approx(0.1)
    assert cfg.optim.lr_warmup_steps == 10 and cfg.optim.clip_grad == 0.5
    assert load_sft_config(["model.path=/m"]).model.strategy == "fsdp2"  # engine=fsdp, verl's default


@pytest.mark.parametrize(("keys", "named"), [
    (("engine.use_megatron_fsdp=true", "engine.grad_offload=true"), "engine.use_megatron_fsdp=true with engine.grad_offload"),
    (("engine.use_mbridge=false",), "engine.use_mbridge=False"),
    (("engine.context_parallel_size=0",), "engine.context_parallel_size=0"),
    (("engine.router_replay.mode=R3",), "engine.router_replay.mode=R3"),
    (("model.lora_rank=8",), "model.lora_rank=8 with engine=megatron"),
    (("model.fsdp_config.model_dtype=bf16",), "model.fsdp_config.model_dtype=bf16"),
    (("engine.ulysses_sequence_parallel_size=2", "use_remove_padding=true"), "ulysses_sequence_parallel_size > 1"),
    (("+optim.override_optimizer_config.optimizer_cpu_offload=true",), "optim.override_optimizer_config"),
    (("optim.lr_decay_style=linear",), "optim.lr_decay_style='linear'"),
    (("optim.weight_decay_incr_style=linear",), "optim.weight_decay_incr_style='linear'"),
])
def test_what_megatron_sft_does_not_build_is_an_error_naming_the_key(keys, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        _load("engine=megatron", "optim=megatron", *keys)


def test_megatron_layouts_and_batches_are_checked_against_the_ranks(monkeypatch):
    # TP=2 x PP=2 on 8 ranks: 2 data-parallel ranks of 16 / 2 = 8 rows
    _load(*MEGATRON, "engine.tensor_model_parallel_size=2", "engine.pipeline_model_parallel_size=2",
          "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8", world=8, monkeypatch=monkeypatch)
    with pytest.raises(ConfigError, match="16 / 2 = 8 sequences per rank"):
        _load(*MEGATRON, "engine.tensor_model_parallel_size=4", "data.train_batch_size=16",
              "data.micro_batch_size_per_gpu=3", world=8, monkeypatch=monkeypatch)
    with pytest.raises(ConfigError, match=r"engine: tensor × pipeline × context parallel = 3 does not divide the 8"):
        _load(*MEGATRON, "engine.tensor_model_parallel_size=3", world=8, monkeypatch=monkeypatch)


def test_megatron_keys_on_the_fsdp_engine_and_mismatched_groups_are_errors():
    with pytest.raises(ConfigError, match="engine.tensor_model_parallel_size=2: a Megatron engine key"):
        _load("engine.tensor_model_parallel_size=2")
    with pytest.raises(ConfigError, match="optim=megatron with engine=fsdp"):
        _load("optim=megatron")
    with pytest.raises(ConfigError, match="verl's veomni engine is not built"):
        _load("engine=veomni")  # engine=automodel is the FSDP2 engine (tests/config/test_automodel_keys.py)


@pytest.mark.parametrize("engine", [(), ("engine=megatron", "optim=megatron")], ids=["fsdp", "megatron"])
def test_sft_qat_is_an_error_naming_it_on_both_engines(engine):
    """verl's engine.qat (both of its SFT engines have it): off loads on either engine, on is not built."""
    _load(*engine, "engine.qat.enable=false", "engine.qat.group_size=32")
    with pytest.raises(ConfigError, match=r"engine\.qat\.enable=true: quantisation-aware training") as e:
        _load(*engine, "engine.qat.enable=true")
    assert "Megatron engine key" not in str(e.value)
