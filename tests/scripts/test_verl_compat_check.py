"""scripts/verl_compat_check.py on a synthetic verl checkout: the command lines its shims capture (the
scripts' own defaults) and how each is classified under rlfoundry's ``--cfg job``."""

from __future__ import annotations

import json
import sys
import subprocess
from pathlib import Path

import pytest

from tests.scripts import load_compat_harness

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "verl_compat_check.py"

SCRIPTS = {
    # ${VAR:-x} defaults, $1 unset, a GPU count from nvidia-smi, an NPU probe (the node is NVIDIA's), a download and rm/mkdir that must stay
    # in the sandbox; hybrid_engine is a verl key accepted with no effect
    "examples/grpo/run_defaults.sh": """#!/usr/bin/env bash
set -xeuo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
BATCH=${1:-32}
NGPUS=$(nvidia-smi -L | wc -l)
DEVICE=${DEVICE:-$(python3 -c 'import torch_npu' 2>/dev/null && echo npu || echo gpu)}
huggingface-cli download "$MODEL"
rm -rf "$HOME/ckpts" && mkdir -p logs
python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo data.train_batch_size=$BATCH \\
    actor_rollout_ref.model.path=$MODEL trainer.experiment_name=grpo_${NGPUS}${DEVICE}s actor_rollout_ref.hybrid_engine=True "$@" \\
    2>&1 | tee logs/run.log
""",
    # backslash continuations through `ray job submit -- ...`, a config path under the script's tree
    "examples/ppo/run_multiline.sh": """set -x
ray job submit --address="http://127.0.0.1:8265" \\
    --runtime-env=verl/trainer/runtime_env.yaml \\
    -- python3 -m verl.trainer.main_ppo \\
    --config-path="$(pwd)/examples/ppo/config" \\
    --config-name=my_ppo \\
    data.train_batch_size=64 \\
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
    trainer.total_epochs=2
""",
    "examples/ppo/config/my_ppo.yaml": "trainer:\n  project_name: synthetic_overlay\n",
    # two keys no verl has: the first is the rejection, --all-causes finds the second
    "recipe/bad/run_unknown.sh": """cd recipe/bad
python -m verl.trainer.main_ppo trainer.no_such_key=3 actor_rollout_ref.actor.not_a_knob=1 trainer.total_epochs=1
""",
    # names verl but starts only a preprocessing script and a module outside the checked families
    "examples/data/prepare.sh": """# prepare the parquet files before running verl.trainer.main_ppo
python3 examples/data/prepare.py --local_dir $HOME/data
python3 -m verl.model_merger merge --backend fsdp --local_dir $HOME/ckpt
""",
    "examples/data/prepare.py": "raise SystemExit('the shim must not run this')\n",
}


@pytest.fixture(scope="module")
def harness():
    return load_compat_harness()


@pytest.fixture(scope="module")
def report(harness, tmp_path_factory):
    repo = tmp_path_factory.mktemp("verl")
    for path, text in SCRIPTS.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "synthetic verl"], check=True)
    out = repo.parent / "report.json"
    assert harness.main(["--repo", str(repo), "--rev", "HEAD", "--all-causes", "--out", str(out)]) == 0
    status = subprocess.run([*git, "status", "--porcelain", "--ignored"], capture_output=True, text=True).stdout
    assert status == ""  # the scripts' rm/mkdir/tee never reached the checkout they were read from
    return json.loads(out.read_text())


def _row(report, path):
    (row,) = [r for r in report["scripts"] if r["path"] == path]
    return row


def test_captured_command_lines_carry_the_scripts_defaults(report):
    rows = {r["path"]: r for r in report["scripts"]}
    assert set(rows) == {"examples/grpo/run_defaults.sh", "examples/ppo/run_multiline.sh",
                         "recipe/bad/run_unknown.sh", "examples/data/prepare.sh"}
    assert rows["examples/grpo/run_defaults.sh"]["argv"] == [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=32",
        "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "trainer.experiment_name=grpo_8gpus",  # 8 GPUs, not NPUs
        "actor_rollout_ref.hybrid_engine=True"]
    multiline = rows["examples/ppo/run_multiline.sh"]
    assert multiline["argv"] == ["--config-path={tree}/examples/ppo/config", "--config-name=my_ppo",
                                 "data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                                 "trainer.total_epochs=2"]
    assert (multiline["launcher"], multiline["cwd"]) == ("python", ".")
    unknown = rows["recipe/bad/run_unknown.sh"]
    assert (unknown["cwd"], unknown["launcher"]) == ("recipe/bad", "python")
    merger = rows["examples/data/prepare.sh"]
    assert (merger["module"], merger["family"], merger["status"]) == ("verl.model_merger", "other", "unchecked")
    assert merger["argv"] == ["merge", "--backend", "fsdp", "--local_dir", f"{_home(report)}/ckpt"]
    assert report["no_command"] == []


def _home(report):
    return "/tmp/vcc/home" if report["sandbox"] == "bwrap" else pytest.skip("HOME is a temporary path without bwrap")


def test_classification(report):
    defaults = _row(report, "examples/grpo/run_defaults.sh")
    assert (defaults["family"], defaults["rlfoundry_module"]) == ("main_ppo", "rlfoundry.trainer.main_ppo")
    assert defaults["status"] == "ignored_keys"
    assert "actor_rollout_ref.hybrid_engine" in " ".join(defaults["warnings"])
    assert _row(report, "examples/ppo/run_multiline.sh")["status"] == "clean"  # the overlay was found
    unknown = _row(report, "recipe/bad/run_unknown.sh")
    assert unknown["status"] == "rejected"
    assert unknown["message"].startswith("Unknown config key 'trainer.no_such_key'")
    assert unknown["causes"] == ["unknown key trainer.no_such_key"]
    assert unknown["blockers"] == ["unknown key trainer.no_such_key",
                                   "unknown key actor_rollout_ref.actor.not_a_knob"]


def test_summary_counts_and_groups(harness, report):
    text = harness.summarise(report)
    assert "== main_ppo: 3 command lines (3 scripts); 2 validate (clean 1, ignored_keys 1, rejected 1)" in text
    assert "      1  unknown key actor_rollout_ref.actor.not_a_knob" in text
    assert "== other: 1 command lines (1 scripts); 0 validate (unchecked 1)" in text


def test_script_without_a_verl_command_is_listed(harness, tmp_path):
    """A script that only names verl in a comment starts no command line: it is reported, not counted."""
    repo = tmp_path / "verl"
    (repo / "examples").mkdir(parents=True)
    (repo / "examples" / "note.sh").write_text("# see verl.trainer.main_ppo\necho done\n")
    caps, problem = harness.capture(repo, "examples/note.sh", tmp_path / "work", _shims(harness, tmp_path),
                                    timeout=20, sandbox=False)
    assert (caps, problem) == ([], None)


def _shims(harness, tmp_path):
    harness.write_shims(tmp_path / "shims")
    return tmp_path / "shims"


def test_torchrun_world_size_and_module(harness, tmp_path, monkeypatch):
    record = tmp_path / "rec.jsonl"
    monkeypatch.setenv("VCC_RECORD", str(record))
    harness.shim_torchrun(["--nnodes=2", "--nproc_per_node", "4", "--standalone", "-m",
                           "verl.trainer.fsdp_sft_trainer", "data.micro_batch_size_per_gpu=2"])
    rec = json.loads(record.read_text())
    assert (rec["module"], rec["args"], rec["world_size"]) == (
        "verl.trainer.fsdp_sft_trainer", ["data.micro_batch_size_per_gpu=2"], 8)
    assert harness.family_of(rec["module"]) == "sft"


def test_placeholders_only_for_paths_and_counts(harness):
    """A launch variable a script insists on gets a value only when its kind is plain."""
    assert harness._placeholder("HDFS_ROOT", True, Path("/w")) == "/tmp/vcc/home/hdfs_root"
    assert harness._placeholder("NUM_GPUS", True, Path("/w")) == "8"
    assert harness._placeholder("NNODES", True, Path("/w")) == "1"
    assert harness._placeholder("INFER_BACKEND", True, Path("/w")) is None  # never a guessed engine name


def test_problem_lists_give_one_cause_each(harness):
    stderr = ("\nrlfoundry: ConfigError: 2 config problem(s):\n"
              "  - actor_rollout_ref.rollout.name='trtllm' is not one of ['hf', 'vllm', 'sglang'] "
              "(did you mean 'vllm'?).\n"
              "  - data.train_batch_size=16 is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=3; "
              "every step.\n(set RLFOUNDRY_DEBUG=1 for a traceback)\n")
    result = harness.classify(2, stderr, [])
    assert result.status == "rejected"
    assert result.message.startswith("actor_rollout_ref.rollout.name='trtllm' is not one of")
    assert result.causes == [
        "actor_rollout_ref.rollout.name='trtllm' is not one of ['hf', 'vllm', 'sglang']",
        "data.train_batch_size=N is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=N"]
    assert harness.cause_of("Unknown config key 'data.x.3.y' (from 'data.x.3.y=1').") == "unknown key data.x.N.y"
    assert harness.classify(1, "Traceback (most recent call last):\nKeyError: 'a'\n", []).status == "error"
    no_effect = "These verl settings are accepted but have no effect in rlfoundry: a."
    assert harness.classify(0, "", [no_effect]).status == "ignored_keys"


# verl's experimental mains find the trainer's config through a package search path; the tree's own
# verl package must answer it, not rlfoundry's answers to verl imports (issue 46: every fully-async line
# read "'OrphanPath' object has no attribute 'exists'" as verl's refusal)
VERL_PKG_TREE = {
    "verl/__init__.py": "",
    "verl/trainer/__init__.py": "",
    "verl/trainer/config/__init__.py": "",
    "verl/trainer/config/base_trainer.yaml": "trainer:\n  total_epochs: 1\n  test_freq: -1\n",
    "verl/experimental/async_main.py": (
        "import hydra\n\n@hydra.main(config_path='config', config_name='async_trainer', version_base=None)\n"
        "def main(config):\n    pass\n"),
    "verl/experimental/config/async_trainer.yaml": (
        "hydra:\n  searchpath:\n    - pkg://verl.trainer.config\ndefaults:\n  - base_trainer\n  - _self_\n"
        "async_training:\n  staleness_threshold: 0.1\n"),
}


def test_verl_composes_through_its_own_package_search_path(harness, tmp_path):
    from rlfoundry.utils import verl_imports

    for path, text in VERL_PKG_TREE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    verl_imports.install()  # as in the harness's in-process checks

    def line(*args):
        return harness.Captured(path="s.sh", index=0, module="verl.experimental.async_main", args=list(args),
                                cwd=".", launcher="python", world_size=None)

    finders, ours = list(sys.meta_path), sys.modules.get("verl")  # rlfoundry's answer, if a test imported it
    assert harness.verl_refuses(line("trainer.total_epochs=3", "async_training.staleness_threshold=0.5"), tmp_path) == ""
    assert "trainer.no_such_key" in harness.verl_refuses(line("trainer.no_such_key=1"), tmp_path)
    assert sys.meta_path == finders and sys.modules.get("verl") is ours  # the finder is back, the tree's verl gone
