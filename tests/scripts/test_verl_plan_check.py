"""scripts/verl_plan_check.py on a small report built from verl's command lines (tests/config/verl_command_lines.json):
it plans the validated lines with the named model's figures or a stated stand-in, records the trainer's own
refusals as such, skips the lines the harness rejected, and reports a planner that raises as a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfoundry.plan.model import param_counts, shape_from_config
from tests.config.test_verl_command_lines import LINES, TREE_FILES
from tests.plan import configs
from tests.scripts import load_script

SOURCES = {line["source"].split(":", 1)[1]: line for line in LINES}


@pytest.fixture(scope="module")
def check():
    return load_script("verl_plan_check")


def _row(source: str, *extra: str, status: str = "ignored_keys") -> dict:
    """A report row as the harness writes it: ``$HOME`` is the sandbox's, the tree ``{tree}``."""
    line = SOURCES[source]
    module = line["module"]
    return {"path": source, "index": 0, "family": "one_step_off" if "one_step_off" in module else "main_ppo",
            "module": module, "rlfoundry_module": "rlfoundry." + module.split(".", 1)[1], "cwd": line["cwd"],
            "world_size": None, "status": status,
            "argv": [a.replace("{home}", "/tmp/vcc/home") for a in line["args"]] + list(extra)}


def _run(check, tmp_path: Path, rows: list[dict]) -> tuple[int, dict]:
    tree = tmp_path / "verl"
    for name, text in TREE_FILES.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"rev": "0" * 40, "scripts": rows}))
    code = check.main([str(report), "--tree", str(tree), "--out", str(tmp_path / "plan.json")])
    return code, json.loads((tmp_path / "plan.json").read_text())


def test_plans_validated_lines_and_records_the_trainers_refusals(check, tmp_path, capsys):
    rows = [_row("examples/grpo_trainer/run_qwen2-7b.sh"),
            _row("verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh"),
            # gemma's figures are not in tests/plan/configs.py: a stand-in; the bad estimator is refused by both
            _row("examples/ppo_trainer/run_gemma.sh", "algorithm.adv_estimator=nonsense"),
            _row("examples/ppo_trainer/run_qwen2-7b_rm.sh", status="rejected")]
    code, out = _run(check, tmp_path, rows)
    by_path = {r["path"]: r for r in out["lines"]}
    assert code == 0 and len(out["lines"]) == 3 and "examples/ppo_trainer/run_qwen2-7b_rm.sh" not in by_path
    qwen2 = by_path["examples/grpo_trainer/run_qwen2-7b.sh"]
    # Qwen2-7B-Instruct is planned with its own figures (Qwen2.5-7B's architecture), not the stand-in
    assert qwen2["models"]["actor_rollout_ref.model.path"] == {"named": "Qwen/Qwen2-7B-Instruct", "planned": "qwen2-7b"}
    assert qwen2["stand_in"] is False and qwen2["params_total"] == param_counts(shape_from_config(configs.QWEN25_7B))[0]
    assert qwen2["outcome"] in ("fits", "does_not_fit") and qwen2["exit"] == (0 if qwen2["outcome"] == "fits" else 1)
    assert qwen2["verdict"].startswith("fits" if qwen2["outcome"] == "fits" else "DOES NOT")
    assert qwen2["worst"]["phase"] in qwen2["verdict"]
    one_step = by_path["verl/experimental/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh"]
    # the module's ENTRY (one_step_off_ppo_trainer) took effect: the rollout has its own pool of 2 ranks
    assert one_step["models"]["actor_rollout_ref.model.path"]["planned"] == "qwen3-0.6b"
    assert one_step["outcome"] in ("fits", "does_not_fit") and one_step["layout"]["separate_rollout_pool"] is True
    gemma = by_path["examples/ppo_trainer/run_gemma.sh"]
    assert gemma["stand_in"] is True and gemma["models"]["critic.model.path"]["planned"] == "stand-in Qwen2.5-7B"
    assert gemma["outcome"] == "refused_by_trainer" and gemma["exit"] == 2 and "nonsense" in gemma["message"]
    summary = capsys.readouterr().out
    assert "== main_ppo: 2 lines; answered 1" in summary and "refused by the trainer 1, crashed 0" in summary


def test_a_planner_that_raises_is_a_crash(check, tmp_path, monkeypatch):
    """A traceback, or a refusal the trainer does not make, is a crash; the pass goes on and exits 1."""
    import rlfoundry.plan_cli as plan_cli
    from rlfoundry.plan.model import PlanInputError

    real = plan_cli.plan_args

    def broken(overrides, *args, **kwargs):
        if "trainer.experiment_name=divide" in overrides:
            raise ZeroDivisionError("division by zero")
        if "trainer.experiment_name=refuse" in overrides:
            raise PlanInputError("the planner alone refuses this")
        return real(overrides, *args, **kwargs)

    monkeypatch.setattr(plan_cli, "plan_args", broken)
    rows = [_row("examples/grpo_trainer/run_qwen2-7b.sh", f"trainer.experiment_name={name}")
            for name in ("divide", "refuse", "fine")]
    code, out = _run(check, tmp_path, rows)
    divide, refuse, fine = out["lines"]
    assert code == 1
    assert divide["outcome"] == "crashed" and divide["exit"] is None and "ZeroDivisionError" in divide["error"]
    assert "(rlfoundry/plan_cli.py:" in divide["error"]  # the innermost rlfoundry frame: where to look
    assert refuse["outcome"] == "crashed" and refuse["exit"] == 2 and "the trainer accepts the line" in refuse["error"]
    assert fine["outcome"] in ("fits", "does_not_fit")


@pytest.mark.parametrize("argv, planned", [
    (["actor_rollout_ref.model.path=/models/Qwen2.5-3B-Instruct"], "qwen2.5-3b"),
    (["actor_rollout_ref.model.path=Qwen/Qwen3-30B-A3B-Instruct-2507"], "qwen3-30b-a3b"),
    (["actor_rollout_ref.model.path=google/gemma-2-2b-it"], "stand-in Qwen2.5-7B"),
    # a layout the 7B's 28 heads or dense MLP would make the trainer refuse gets a stand-in that takes it
    (["actor_rollout_ref.model.path=x/y", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8"],
     "stand-in Qwen3-8B"),
    (["actor_rollout_ref.model.path=x/y", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4"],
     "stand-in Qwen3-30B-A3B"),
    ([], "stand-in Qwen2.5-7B"),  # a line that leaves the model to its config file
])
def test_model_paths_point_at_the_named_model_or_a_stated_stand_in(check, tmp_path, argv, planned):
    dirs = check.write_models(tmp_path)
    out, models = check.with_models(argv, dirs)
    assert models["actor_rollout_ref.model.path"]["planned"] == planned
    path = next(a.split("=", 1)[1] for a in out if a.startswith("actor_rollout_ref.model.path="))
    name = planned.removeprefix("stand-in ")
    assert path == dirs[name] and json.loads((Path(path) / "config.json").read_text())["hidden_size"] == (
        check.KNOWN[name] if name in check.KNOWN else {"Qwen2.5-7B": configs.QWEN25_7B, "Qwen3-8B": configs.QWEN3_8B,
                                                        "Qwen3-30B-A3B": configs.QWEN3_30B_A3B}[name])["hidden_size"]
