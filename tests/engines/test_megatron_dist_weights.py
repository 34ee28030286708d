"""verl's ``megatron.use_dist_checkpointing`` / ``dist_checkpointing_path`` / ``dist_checkpointing_prefix``
and ``python -m rlfoundry.scripts.converter_hf_to_mcore``, on CPU processes over gloo.

A tiny model (``other``, seed 7) is converted on one process; the engines then start from
``model.path`` = the project's tiny model (seed 0, same shape, other weights) with the dist checkpoint
as their weights, so weights equal to ``other``'s can only have come from the checkpoint. At TP=2
(a trainable actor) and PP=2 (a frozen reference) the log-probs equal those of an engine of the same
layout loaded from ``other``'s HF directory bit for bit (the same weights in the same layout run the
same arithmetic); a critic at PP=2 takes the backbone and leaves its value head at zero; a bf16
checkpoint gives the HF weights rounded to bf16. Errors: an unset, missing or non-checkpoint path, a
checkpoint of another shape or depth, a wrong prefix; the converter refuses a non-empty output.

Start-up (spawning ranks, importing megatron-core, building process groups) costs more than the
checks, so one job per parallel layout computes everything the tests of that layout compare, once per
module: PP=2 (the layout, tied and critic cases), TP=2, and one rank (the bf16 weights and every
refused checkpoint); each checkpoint is converted once per module."""

from __future__ import annotations

import re
import subprocess
import sys
import traceback

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


def _convert(hf_dir, out, *extra: str) -> subprocess.CompletedProcess:
    from tests.trainer._e2e import subprocess_env

    return subprocess.run([sys.executable, "-m", "rlfoundry.scripts.converter_hf_to_mcore", "--hf_model_path",
                           str(hf_dir), "--output_path", str(out), *extra],
                          capture_output=True, text=True, env=subprocess_env(), timeout=600)


def convert_other(root, *extra: str):
    """``other`` (the tiny model's shape, seed 7) saved under ``root``, its float32 dist checkpoint made by
    the CLI, and the CLI's run."""
    from rlfoundry.models.tiny import save_tiny_model

    other = save_tiny_model(root / "other", seed=7)
    run = _convert(other, root / "mcore", "--dtype", "float32", *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    return other, root / "mcore", run


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(``other``'s HF directory, its float32 dist checkpoint made by the CLI with --test)."""
    other, ckpt, run = convert_other(tmp_path_factory.mktemp("dist-weights"), "--test")
    assert "every tensor of" in run.stdout  # --test reloaded it and compared
    return other, ckpt


def _engine(model_dir: str, tp: int, pp: int, kind: str = "causal_lm", trainable: bool = False, **dist_keys):
    from rlfoundry.config.schema import MegatronConfig, OptimConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig

    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, dtype="float32",
                              use_distributed_optimizer=False, **dist_keys)
    optim = OptimConfig(lr=1e-3) if trainable else None
    role = {"causal_lm": "actor" if trainable else "ref", "token_classification": "critic"}[kind]
    return MegatronEngine(MegatronEngineConfig(model_dir, megatron, optim, model_kind=kind), "cpu", role=role)


def _random(name: str) -> bool:
    """A weight the tiny models initialise at random (norms start at 1, biases at 0)."""
    return "norm" not in name and not name.endswith(".bias")


def _log_probs(engine, batch) -> torch.Tensor:
    from rlfoundry.engines.base import LogProbs, MicroBatching
    from rlfoundry.protocol import DataProto

    return engine.infer_batch(DataProto.from_dict(tensors=batch), LogProbs(), MicroBatching(size=2))["log_probs"]


def _from_checkpoint_and_from_hf(rank: int, model_dir: str, other: str, ckpt: str, tp: int, pp: int, trainable: bool):
    from tests.engines.test_megatron_model import _batch

    batch = _batch()
    loaded = _engine(model_dir, tp, pp, trainable=trainable, use_dist_checkpointing=True, dist_checkpointing_path=ckpt)
    hf = _engine(other, tp, pp, trainable=trainable)
    return {"dist": _log_probs(loaded, batch), "hf": _log_probs(hf, batch), "weights": dict(loaded.iter_hf_weights())}


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A head tied to the embedding (Qwen2.5-0.5B) and its float32 dist checkpoint: one tensor in the
    checkpoint, which both the first stage (embedding) and the last (head) read at PP=2."""
    from rlfoundry.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tied")
    model = save_tiny_model(root / "tied", seed=7, tie_word_embeddings=True)
    run = _convert(model, root / "mcore", "--dtype", "float32")
    assert run.returncode == 0, run.stderr[-3000:]
    return model, root / "mcore"


def _pp2_cases(rank: int, model_dir: str, other: str, ckpt: str, tied_dir: str, tied_ckpt: str):
    """Everything the PP=2 tests compare, in one job: the frozen reference from the checkpoint and from
    ``other``, the tied model likewise, and the critic from the checkpoint."""
    return {"layout": _from_checkpoint_and_from_hf(rank, model_dir, other, ckpt, 1, 2, False),
            "tied": _from_checkpoint_and_from_hf(rank, tied_dir, tied_dir, tied_ckpt, 1, 2, False),
            "critic": _critic(rank, model_dir, ckpt)}


@pytest.fixture(scope="module")
def pp2(tiny_model_dir, converted, tied, tmp_path_factory):
    (other, ckpt), (tied_dir, tied_ckpt) = converted, tied
    return run_ranks(_pp2_cases, 2, tmp_path_factory.mktemp("pp2"), pp=2,
                     args=(str(tiny_model_dir), str(other), str(ckpt), str(tied_dir), str(tied_ckpt)))


@pytest.mark.parametrize("tp, pp, trainable", [(2, 1, True), (1, 2, False)])
def test_engine_starts_from_the_converted_checkpoint_at_another_layout(request, tiny_model_dir, converted, tmp_path,
                                                                       tp, pp, trainable):
    from safetensors.torch import load_file

    other, ckpt = converted
    if pp == 2:  # the module's PP=2 job computed it
        results = [r["layout"] for r in request.getfixturevalue("pp2")]
    else:
        results = run_ranks(_from_checkpoint_and_from_hf, 2, tmp_path, tp=tp, pp=pp,
                            args=(str(tiny_model_dir), str(other), str(ckpt), tp, pp, trainable))
    theirs, mine = load_file(other / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    # every randomly initialised weight differs between the two models: model.path's would show
    differing = {n for n, t in theirs.items() if not torch.equal(mine[n], t)}
    assert differing == {n for n in theirs if _random(n)}
    for r in results:
        assert torch.equal(r["dist"], r["hf"])  # same weights, same layout: the same arithmetic
        assert set(r["weights"]) == set(theirs)
        for name, tensor in theirs.items():
            assert torch.equal(r["weights"][name], tensor), name
    assert r["dist"].abs().sum() > 0  # real log-probs (rows beyond the response padding are not all masked)


def test_a_tied_model_converted_on_one_stage_loads_at_pp2(pp2):
    """The tied head read by both stages from the checkpoint's one tensor (fixture ``tied``)."""
    for r in pp2:
        assert torch.equal(r["tied"]["dist"], r["tied"]["hf"])


def _critic(rank: int, model_dir: str, ckpt: str):
    from rlfoundry.engines.base import MicroBatching, Values
    from rlfoundry.protocol import DataProto
    from tests.engines.test_megatron_model import _batch

    engine = _engine(model_dir, 1, 2, kind="token_classification", use_dist_checkpointing=True,
                     dist_checkpointing_path=ckpt)
    values = engine.infer_batch(DataProto.from_dict(tensors=_batch()), Values(), MicroBatching(size=2))["values"]
    return {"weights": dict(engine.iter_hf_weights()), "values": values}


def test_critic_takes_the_backbone_and_a_zero_value_head(converted, pp2):
    from safetensors.torch import load_file

    other, _ = converted
    theirs = load_file(other / "model.safetensors")
    for r in (r["critic"] for r in pp2):
        backbone = {n: t for n, t in r["weights"].items() if not n.startswith("score.")}
        assert set(backbone) == set(theirs) - {"lm_head.weight"}  # the checkpoint's LM head is not read
        for name, tensor in backbone.items():
            assert torch.equal(tensor, theirs[name]), name
        assert not r["weights"]["score.weight"].any() and not r["weights"]["score.bias"].any()
        assert r["values"].shape == (4, 5) and not r["values"].any()  # a zero head: V = 0 everywhere


def _bf16_weights(rank: int, model_dir: str, ckpt: str):
    return dict(_engine(model_dir, 1, 1, use_dist_checkpointing=True, dist_checkpointing_path=ckpt).iter_hf_weights())


def _start(model_dir: str, ckpt: str, prefix: str, kind: str) -> str | None:
    """The traceback of building the engine (None if it started)."""
    try:
        _engine(model_dir, 1, 1, kind=kind, use_dist_checkpointing=True, dist_checkpointing_path=ckpt,
                dist_checkpointing_prefix=prefix)
    except Exception:
        return traceback.format_exc()
    return None


def _one_rank_cases(rank: int, model_dir: str, bf16_ckpt: str, refused: list[tuple[str, str, str, str]]):
    """Everything the one-rank tests compare, in one job: the weights a float32 engine loads from the
    bf16 checkpoint, then each refused checkpoint's error (each engine built afresh, as a worker would)."""
    return {"bf16": _bf16_weights(rank, model_dir, bf16_ckpt), "refused": [_start(*case) for case in refused]}


def _refused_cases(root, other, ckpt) -> list[tuple[str, str, str, str, str]]:
    """(checkpoint path, model.path, prefix, model kind, the error's pattern)."""
    from rlfoundry.models.tiny import save_tiny_model

    wider = save_tiny_model(root / "wider", hidden_size=96)
    deeper = save_tiny_model(root / "deeper", num_layers=3)
    (root / "empty").mkdir()
    return [
        (str(root / "nowhere"), str(other), "", "causal_lm", r"actor_rollout_ref\.ref\.megatron\.dist_checkpointing_path="
         r"'.*nowhere' is not a directory; point it at a directory written by `python -m rlfoundry\.scripts\.converter_hf_to_mcore"),
        (str(root / "empty"), str(other), "", "causal_lm", r"has no metadata\.json"),
        (str(ckpt), str(wider), "", "causal_lm", r"holds another model than model\.path's: other shapes: "
         r"decoder\.final_layernorm\.weight \[64\] \(the model's \[96\]\)"),
        (str(ckpt), str(deeper), "", "token_classification", r"critic\.megatron\.dist_checkpointing_path=.*other shapes: "
         r"decoder\.layers\.mlp\.linear_fc1\.layer_norm_weight \[2, 64\] \(the model's \[3, 64\]\)"),
        (str(ckpt), str(other), "module.", "causal_lm", r"dist_checkpointing_prefix='module\.' right\?\): missing: module\.decoder"),
    ]


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, converted, tmp_path_factory):
    """(the bf16 checkpoint's weights, [(error pattern, traceback or None)] per refused checkpoint)."""
    other, ckpt = converted
    root = tmp_path_factory.mktemp("one-rank")
    bf16 = root / "bf16"
    run = _convert(other, bf16)  # verl's converter writes bf16 (the default here too)
    assert run.returncode == 0, run.stderr[-3000:]
    cases = _refused_cases(root, other, ckpt)
    [result] = run_ranks(_one_rank_cases, 1, root, args=(str(tiny_model_dir), str(bf16),
                                                                [(model, path, prefix, kind) for path, model, prefix, kind, _ in cases]))
    return result["bf16"], list(zip((c[4] for c in cases), result["refused"]))


def test_a_bf16_checkpoint_loads_rounded_into_a_float32_engine(converted, one_rank):
    """verl's converter writes bf16 (the default here too); a float32 engine holds those values exactly."""
    from safetensors.torch import load_file

    other, _ = converted
    weights, _ = one_rank
    for name, tensor in load_file(other / "model.safetensors").items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], tensor.to(torch.bfloat16).float()), name
        if _random(name):  # the constant-initialised ones (1, 0) bf16 holds exactly
            assert not torch.equal(weights[name], tensor), name  # it did go through bf16


def test_a_checkpoint_of_another_model_or_place_is_refused_naming_the_key(one_rank):
    _, refused = one_rank
    assert len(refused) == 5
    for message, error in refused:
        assert error is not None and re.search(message, error), (message, error)


def test_the_converter_refuses_a_non_empty_output(converted):
    other, ckpt = converted
    before = sorted(p.name for p in ckpt.iterdir())
    run = _convert(other, ckpt)
    assert run.returncode != 0 and "exists and is not an empty directory; choose a new one" in run.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_verl_command_line_keys_validate_and_reach_each_role(converted):
    from rlfoundry.trainer.config import ConfigError, load_config

    _, ckpt = converted
    keys = [f"{role}.megatron.{k}" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
            for k in ("use_dist_checkpointing=true", f"dist_checkpointing_path={ckpt}")]
    base = ["actor_rollout_ref.actor.strategy=megatron", "trainer.save_freq=-1", "trainer.n_gpus_per_node=2",
            "critic.enable=true", "critic.strategy=megatron", "critic.model.path=x"]
    cfg = load_config([*base, *keys, "critic.megatron.dist_checkpointing_prefix=module."])
    for role in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref, cfg.critic):
        assert role.megatron.use_dist_checkpointing is True and role.megatron.dist_checkpointing_path == str(ckpt)
    assert cfg.critic.megatron.dist_checkpointing_prefix == "module."
    assert cfg.actor_rollout_ref.ref.megatron.dist_checkpointing_prefix == ""
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.ref\.megatron\.use_dist_checkpointing=True loads the "
                       r"initial weights from actor_rollout_ref\.ref\.megatron\.dist_checkpointing_path, which is not set"):
        load_config([*base, "actor_rollout_ref.ref.megatron.use_dist_checkpointing=true"])


def test_start_up_check_names_the_key_and_the_converter(converted, tmp_path):
    """The config check (before any worker starts): no path, or a local path that is no dist checkpoint."""
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.plugin import _check_dist_checkpoint

    unset = MegatronConfig(use_dist_checkpointing=True)
    assert MegatronConfig().use_dist_checkpointing is False and MegatronConfig().dist_checkpointing_path is None
    [error] = _check_dist_checkpoint("critic", unset)
    assert error.startswith("critic.megatron.use_dist_checkpointing=True loads the initial weights from "
                            "critic.megatron.dist_checkpointing_path, which is not set: make one with `python -m "
                            "rlfoundry.scripts.converter_hf_to_mcore --hf_model_path <model.path> --output_path <dir>`")
    other, ckpt = converted
    [error] = _check_dist_checkpoint("actor_rollout_ref.actor",
                                     MegatronConfig(use_dist_checkpointing=True, dist_checkpointing_path=str(other)))
    assert "has no metadata.json" in error
    assert _check_dist_checkpoint("actor_rollout_ref.actor", MegatronConfig(use_dist_checkpointing=True,
                                                                            dist_checkpointing_path=str(ckpt))) == []
    # a path not on this machine is the workers' to check (their nodes may have it)
    assert _check_dist_checkpoint("critic", MegatronConfig(use_dist_checkpointing=True,
                                                           dist_checkpointing_path=str(tmp_path / "elsewhere"))) == []
