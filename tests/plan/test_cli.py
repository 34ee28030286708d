"""``rlfoundry plan`` on packaged configs and on a model that does not fit; the trainer's start-up check."""

from __future__ import annotations

import json

import pytest

from pathlib import Path

from rlfoundry.cli import main as cli
from rlfoundry.plan.model import load_shape, param_counts
from rlfoundry.trainer.plan_check import has_model_config
from rlfoundry.trainer.config import CONFIG_DIR, resolve_asset_path
from tests.config.test_verl_command_lines import LINES as VERL_LINES
from tests.config.test_verl_command_lines import TREE_FILES
from tests.plan.configs import QWEN3_30B_A3B, QWEN25_7B, QWEN25_32B, QWEN25_72B, write_config


def _plan_json(capsys, *args: str) -> tuple[int, dict]:
    code = cli(["plan", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_packaged_config_fits_on_one_h100(capsys):
    code, out = _plan_json(capsys, "--config-name", "ppo_trainer", "--gpu", "h100-80g")
    assert code == 0 and out["fits"] is True
    # the model figures are the packaged policy's config.json, counted by the same formula
    shape = load_shape(resolve_asset_path("rlfoundry://arithmetic-policy"))
    assert out["model"]["params_total"] == param_counts(shape)[0]
    pool = out["pools"][0]
    peak = max(pool["phases"], key=lambda p: p["bytes"])
    assert out["worst"]["bytes"] == peak["bytes"] == sum(peak["device"].values())
    assert out["headroom_bytes"] == out["capacity_bytes"] - peak["bytes"]


def test_ppo_with_critic_plans_the_critic_phases(capsys):
    code, out = _plan_json(capsys, "--config-name", "arithmetic_ppo", "--gpu", "a100-80g")
    names = [p["name"] for p in out["pools"][0]["phases"]]
    assert code == 0 and {"critic values", "critic update", "actor update"} <= set(names)
    assert out["times_s"]["update_critic"] > 0


def test_a_7b_that_does_not_fit_gets_fixes_that_fit(tmp_path, capsys):
    model = write_config(tmp_path / "qwen7b", QWEN25_7B)
    args = ["--gpu", "h100-80g", f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=8",
            "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "data.max_prompt_length=1024",
            "data.max_response_length=4096", "actor_rollout_ref.rollout.name=vllm"]
    code, out = _plan_json(capsys, *args)
    # 8 × 5120 tokens × 28 layers × 196,608 bytes of activations alone = 210 GiB > 79.6 GiB
    assert code == 1 and out["fits"] is False and out["worst"]["phase"] == "actor update"
    fixes = {tuple(f["overrides"]): f for f in out["fixes"]}
    assert fixes and all(f["fits"] and f["peak_bytes"] <= out["capacity_bytes"] for f in fixes.values())
    # each fix re-plans to the same answer as the command line with its overrides
    first = next(iter(fixes))
    code2, again = _plan_json(capsys, *args, *first)
    assert code2 == 0 and again["worst"]["bytes"] == fixes[first]["peak_bytes"]


def test_vllm_rollout_is_planned_at_tensor_parallel_size_1(tmp_path, capsys):
    """The hybrid vLLM engine runs one TP-1 engine per rank whatever rollout.tensor_model_parallel_size says
    (workers/rollout/vllm_rollout.py): a 32B's bf16 weights (65.5 GB) exceed 0.6 × 79.6 GiB on every GPU, at
    TP 4 as at TP 1, and the fix offered is the HF engine on the actor's own sharded weights."""
    model = write_config(tmp_path / "qwen32b", QWEN25_32B)
    args = ["--gpu", "h100-80g", f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=8",
            "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.actor.fsdp_config.param_offload=true", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]
    code1, tp1 = _plan_json(capsys, *args, "actor_rollout_ref.rollout.tensor_model_parallel_size=1")
    code4, tp4 = _plan_json(capsys, *args, "actor_rollout_ref.rollout.tensor_model_parallel_size=4")
    assert code1 == code4 == 1 and tp1["worst"] == tp4["worst"]
    assert any("tensor_parallel_size=1 here" in p for p in tp4["problems"]), tp4["problems"]
    assert [f["overrides"] for f in tp4["fixes"]] == [["actor_rollout_ref.rollout.name=hf"]] and tp4["fixes"][0]["fits"]


def test_unknown_gpu_is_a_message(capsys):
    assert cli(["plan", "--gpu", "h1000"]) == 2
    err = capsys.readouterr().err
    assert "--gpu h1000" in err and "h100-80g" in err and "Traceback" not in err


def test_startup_refuses_a_72b_config_only_directory_by_the_plan(tmp_path, capsys):
    model = write_config(tmp_path / "qwen72b", QWEN25_72B)
    args = ["train", f"actor_rollout_ref.model.path={model}", "trainer.device=cpu", f"trainer.run_dir={tmp_path}/run"]
    assert cli(args) == 2
    err = capsys.readouterr().err
    # 72.7e9 parameters × 16 bytes of fp32 weights, gradients and moments = 1083 GiB: no host holds it
    assert "does not fit" in err and "rank 0" in err and "trainer.plan_check=false" in err
    assert "enable_gradient_checkpointing=true" in err and "actor optimizer" in err
    assert "safetensors" not in err and "Traceback" not in err
    # switched off, the run goes on to the weights check, which refuses for the missing weights
    assert cli([*args, "trainer.plan_check=false"]) == 2
    assert "safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["trainer.plan_check"])
def test_plan_check_key_is_documented(key):
    from pathlib import Path

    assert key in (Path(__file__).parents[2] / "docs" / "plan.md").read_text()


def _assert_answered(code: int, out: dict) -> None:
    """A verdict with per-rank figures: exit 0 exactly when it fits, every phase's total its items' sum,
    the worst the largest phase of any pool, named by pool, rank and phase."""
    assert code == (0 if out["fits"] else 1)
    for pool in out["pools"]:
        assert pool["ranks"] >= 1 and pool["rank"].startswith(("rank 0", "rollout rank 0"))
        assert all(p["bytes"] == sum(p["device"].values()) > 0 for p in pool["phases"])
    assert out["worst"]["bytes"] == max(p["bytes"] for pool in out["pools"] for p in pool["phases"])
    assert out["headroom_bytes"] == out["capacity_bytes"] - out["worst"]["bytes"]


def _model_of(name: str) -> str | None:
    """The packaged config's policy path, when that directory holds a config.json here (a GPU config
    names a model under /root/models that a CPU machine does not have)."""
    from omegaconf import OmegaConf

    return OmegaConf.load(CONFIG_DIR / f"{name}.yaml").get("actor_rollout_ref", {}).get("model", {}).get("path")


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("plan") / "qwen7b", QWEN25_7B)


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_every_packaged_config_is_planned(capsys, qwen7b, name):
    """``rlfoundry plan --config-name NAME`` answers for every packaged config (SFT's names included: as
    for ``rlfoundry train``, their overlays compose onto the PPO defaults). A config whose model
    directory is not on this machine is planned with Qwen2.5-7B's config.json in its place."""
    path = _model_of(name)
    usable = path is None or has_model_config(path)
    code, out = _plan_json(capsys, "--config-name", name, "--no-fixes",
                           *([] if usable else [f"actor_rollout_ref.model.path={qwen7b}"]))
    _assert_answered(code, out)


def _verl_plan_args(line: dict, model: str, tree: Path, home: Path) -> list[str]:
    """A verl command line's arguments, the model paths pointed at a config-only directory (its module is
    given to the plan as ``--entry``: its default config, pipeline and spellings)."""
    args = [a.replace("{home}", str(home)).replace("{tree}", str(tree)) for a in line["args"]]
    return [a.split("=", 1)[0] + "=" + model if a.startswith(MODEL_KEYS) else a for a in args]


MODEL_KEYS = ("actor_rollout_ref.model.path=", "critic.model.path=")
# main_ppo's lines (and its one-step-off and fully-async entries); SFT's are not RL runs to plan
PPO_LINES = [line for line in VERL_LINES if ".sft_trainer" not in line["module"] and "fsdp_sft" not in line["module"]]


@pytest.mark.parametrize("line", PPO_LINES, ids=[line["source"].split(":", 1)[1] for line in PPO_LINES])
def test_verls_example_command_lines_are_planned(capsys, qwen7b, tmp_path, monkeypatch, line):
    """Each of verl's command lines (tests/config/verl_command_lines.json), module name changed: a verdict
    with per-rank figures, or, where the trainer refuses the line, exit 2 with the trainer's message."""
    tree = tmp_path / "verl"
    for name, text in TREE_FILES.items():  # the files the lines name inside verl's tree
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    monkeypatch.chdir(tree / line["cwd"])
    args = _verl_plan_args(line, qwen7b, tree, tmp_path / "home")
    code = cli(["plan", "--json", "--no-fixes", "--entry", line["module"], *args])
    captured = capsys.readouterr()
    if code == 2:  # refused: the same message as the module's own check of these arguments
        from rlfoundry.plan_cli import entry_of
        from rlfoundry.trainer import main_ppo

        assert main_ppo.main([*args, "--cfg", "job"], entry=entry_of(line["module"])) == 2
        assert captured.err.split(": ", 1)[1].strip() in capsys.readouterr().err
        return
    _assert_answered(code, json.loads(captured.out))


def _step_items(capsys, model: str, ep: int) -> dict:
    code, out = _plan_json(capsys, "--config-name", "ppo_megatron_trainer", "--gpu", "h100-80g", "--no-fixes",
                           f"actor_rollout_ref.model.path={model}", "trainer.n_gpus_per_node=8",
                           "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                           f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}")
    assert code in (0, 1) and out["layout"]["actor"]["ep"] == ep
    return next(p for p in out["pools"][0]["phases"] if p["name"] == "actor step")["device"]


def test_megatron_expert_parallel_plans_a_share_of_the_experts_per_rank(tmp_path, capsys):
    """EP=2 against EP=1 on 8 ranks (tp = pp = 1, bf16 weights): each rank holds half the routed experts,
    E = 48 layers × 128 experts × 3 · 2048 · 768 = 28,991,029,248 parameters, so E/2 fewer bf16 weights
    (2 bytes) and fp32 gradients (4 bytes). The distributed optimizer shards each expert over its
    replicas, ranks / EP = 4 at EP=2, 8 at EP=1: E/2/4 = E/8 per rank either way, the same moments and
    master copies."""
    model = write_config(tmp_path / "qwen3-30b-a3b", QWEN3_30B_A3B)
    one, two = _step_items(capsys, model, 1), _step_items(capsys, model, 2)
    experts = 48 * 128 * 3 * 2048 * 768
    assert experts == 28_991_029_248
    assert one["actor weights"] - two["actor weights"] == pytest.approx(2 * experts / 2, abs=2)
    assert one["actor gradients"] - two["actor gradients"] == pytest.approx(4 * experts / 2, abs=2)
    assert one["actor optimizer"] == pytest.approx(two["actor optimizer"], abs=2)
    assert one["actor master weights"] == pytest.approx(two["actor master weights"], abs=2)
    # at EP=1 the moments are the whole model's fp32 pair over the 8 data-parallel ranks
    total = param_counts(load_shape(model))[0]
    assert one["actor optimizer"] == pytest.approx(8 * total / 8, abs=2)


def test_vllm_weights_are_on_the_device_for_the_weight_sync_only(tmp_path, capsys):
    """Sleep mode releases vLLM's share outside generation; the sync wakes its weights (bf16, 2 bytes per
    parameter) beside the actor's export of its largest tensor (the embedding, 152064 × 3584, once for
    FSDP's full_tensor, in the bf16 compute dtype)."""
    model = write_config(tmp_path / "qwen7b", QWEN25_7B)
    code, out = _plan_json(capsys, "--gpu", "h100-80g", "--no-fixes", f"actor_rollout_ref.model.path={model}",
                           "trainer.n_gpus_per_node=8", "data.train_batch_size=64",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.rollout.name=vllm")
    assert code in (0, 1)
    phases = {p["name"]: p["device"] for p in out["pools"][0]["phases"]}
    n = param_counts(load_shape(model))[0]
    assert phases["weight sync"]["rollout rollout weights"] == 2 * n
    assert phases["weight sync"]["actor weight export"] == 152064 * 3584 * 2
    assert "rollout rollout weights" not in phases["actor update"]


FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"


def test_entry_reads_a_command_line_as_its_module_does(capsys, qwen7b):
    """verl's fully-async main counts ``trainer.test_freq`` in weight syncs, as January's ``rollout.test_freq``
    (``fully_async_main.verl_spellings``): verl's dapo_30b_a3b_base_math_fsdp.sh gives both, 25 syncs of 16
    steps. The module accepts the line; ``--entry`` plans it as the module reads it, where main_ppo's reading
    (trainer.test_freq=25 steps against 25 × 16 = 400) is a refusal."""
    from rlfoundry.plan_cli import entry_of
    from rlfoundry.trainer import main_ppo

    args = [f"actor_rollout_ref.model.path={qwen7b}", "trainer.n_gpus_per_node=4", "rollout.nnodes=1",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "rollout.n_gpus_per_node=4", "async_training.trigger_parameter_sync_step=16", "trainer.test_freq=25",
            "rollout.test_freq=25"]
    assert main_ppo.main([*args, "--cfg", "job"], entry=entry_of(FULLY_ASYNC)) == 0
    assert "test_freq: 400" in capsys.readouterr().out  # 25 syncs × 16 steps
    code, out = _plan_json(capsys, "--no-fixes", "--entry", FULLY_ASYNC, *args)
    _assert_answered(code, out)
    assert out["layout"]["separate_rollout_pool"] is True  # the entry's pipeline: the rollout on its own pool
    assert cli(["plan", "--no-fixes", "--config-name", "fully_async_ppo_trainer", "async_training.mode=fully_async",
                *args]) == 2
    assert "disagree" in capsys.readouterr().err


def test_unknown_entry_is_a_message(capsys):
    assert cli(["plan", "--entry", "verl.trainer.no_such_main"]) == 2
    err = capsys.readouterr().err
    assert "--entry verl.trainer.no_such_main" in err and FULLY_ASYNC in err and "Traceback" not in err
