"""verl's utility entry points beside training: ``model_merger``, ``main_generation``,
``main_generation_server`` and ``main_eval`` (docs/verl_keys.md, "verl's utility entry points")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from rlfoundry.model_merger.merge import build_parser
from rlfoundry.model_merger.merge import main as merger
from rlfoundry.trainer import main_eval, main_generation, main_generation_server
from tests.trainer import _e2e as E


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


# ───────────────────────────────────── model_merger ─────────────────────────────────────


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tiny_critic_dir, tmp_path_factory) -> Path:
    """One PPO step (GAE, a critic) at a large lr, checkpointed: a real trainer's global_step_1/{actor,critic}."""
    run_dir = tmp_path_factory.mktemp("merger_run")
    reward = E.write_reward_file(tmp_path_factory.mktemp("reward"))
    E.train(E.tiny_overrides(tiny_model_dir, run_dir, "trainer.save_freq=1", "trainer.total_training_steps=1",
                             f"custom_reward_function.path={reward}", "actor_rollout_ref.actor.optim.lr=1e-2",
                             f"critic.model.path={tiny_critic_dir}", "critic.ppo_mini_batch_size=2"))
    return run_dir


def test_merge_equals_rlfoundry_export_and_test_names_a_changed_tensor(trained, tiny_model_dir, tmp_path, capsys):
    from rlfoundry.cli import export

    actor = trained / "global_step_1" / "actor"
    assert merger(["merge", "--backend", "fsdp", "--local_dir", str(actor), "--target_dir", str(tmp_path / "m")]) == 0
    export(trained, tmp_path / "e")  # the run directory: its newest step, through the run's own worker
    merged, exported = _weights(tmp_path / "m"), _weights(tmp_path / "e")
    assert merged.keys() == exported.keys() and len(merged) > 10
    assert all(torch.equal(merged[k], exported[k]) for k in merged)
    # the trained weights, not the starting ones
    base = _weights(tiny_model_dir)
    assert any(not torch.equal(merged[k], base[k]) for k in merged)
    assert (tmp_path / "m" / "tokenizer_config.json").is_file()

    test = ["test", "--backend", "fsdp", "--local_dir", str(actor), "--test_hf_dir"]
    assert merger([*test, str(tmp_path / "m")]) == 0
    assert "test passed" in capsys.readouterr().out
    # one element of one tensor moved by 1e-3: the test fails and names that tensor only
    shutil.copytree(tmp_path / "m", tmp_path / "bad")
    (file,) = (tmp_path / "bad").glob("*.safetensors")
    weights = load_file(file)
    weights["model.norm.weight"][0] += 1e-3
    save_file(weights, file, metadata={"format": "pt"})
    assert merger([*test, str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert "model.norm.weight: values differ" in err and err.count("values differ") == 1


def test_a_critic_merges_as_a_value_model(trained, tiny_critic_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    critic = str(trained / "global_step_1" / "critic")
    assert merger(["merge", "--backend", "fsdp", "--is-value-model", "--local_dir", critic,
                   "--target_dir", str(tmp_path / "v")]) == 0
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "v")
    assert model.config.num_labels == 1 and model.score.weight.shape[0] == 1
    # the trained value head, not the starting one
    assert not torch.equal(_weights(tmp_path / "v")["score.weight"], _weights(tiny_critic_dir)["score.weight"])
    assert merger(["test", "--backend", "fsdp", "--is-value-model", "--local_dir", critic,
                   "--test_hf_dir", str(tmp_path / "v")]) == 0


def test_a_lora_actor_merges_with_its_adapter_where_verl_puts_it(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    reward = E.write_reward_file(tmp_path)
    E.train(E.tiny_overrides(tiny_model_dir, run_dir, "trainer.save_freq=1", "trainer.total_training_steps=1",
                             f"custom_reward_function.path={reward}", "actor_rollout_ref.actor.optim.lr=1e-2",
                             "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                             "actor_rollout_ref.model.target_modules=all-linear"))
    actor = str(run_dir / "global_step_1" / "actor")
    out = tmp_path / "hf"  # verl's run_grpo_lora_with_merge.sh line: the adapter in <target_dir>/lora_adapter
    assert merger(["merge", "--backend", "fsdp", "--local_dir", actor, "--target_dir", str(out)]) == 0
    adapter = load_file(out / "lora_adapter" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    merged, base = _weights(out), _weights(tiny_model_dir)
    assert merged.keys() == base.keys()  # a plain model: the adapter folded in, no lora tensors
    assert any(not torch.equal(merged[k], base[k]) for k in merged if "proj" in k)
    assert merger(["test", "--backend", "fsdp", "--local_dir", actor, "--test_hf_dir", str(out)]) == 0


def test_a_megatron_checkpoint_merges_with_backend_megatron_only(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("megatron.core")
    from rlfoundry.cli import export

    run_dir = tmp_path / "run"
    reward = E.write_reward_file(tmp_path)
    E.train(E.tiny_overrides(tiny_model_dir, run_dir, "trainer.save_freq=1", "trainer.total_training_steps=1",
                             f"custom_reward_function.path={reward}"), config_name="ppo_megatron_trainer")
    actor = str(run_dir / "global_step_1" / "actor")
    assert merger(["merge", "--backend", "fsdp", "--local_dir", actor, "--target_dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--backend fsdp" in err and "saved by the megatron engine" in err and "give --backend megatron" in err
    # verl's Megatron line (its module docstring): --tie-word-embedding with a tied model
    tied = json.loads((tmp_path / "run" / "global_step_1" / "actor" / "huggingface" / "config.json").read_text())
    flags = ["--tie-word-embedding"] if tied.get("tie_word_embeddings") else []
    assert merger(["merge", "--backend", "megatron", *flags, "--local_dir", actor,
                   "--target_dir", str(tmp_path / "m")]) == 0
    export(run_dir, tmp_path / "e")
    merged, exported = _weights(tmp_path / "m"), _weights(tmp_path / "e")
    assert merged.keys() == exported.keys() and all(torch.equal(merged[k], exported[k]) for k in merged)


def test_merger_flags_that_do_not_fit_the_checkpoint_are_errors_naming_them(trained, tmp_path, capsys):
    actor = str(trained / "global_step_1" / "actor")
    cases = [
        (["--backend", "megatron"], ["--backend megatron", "saved by the fsdp engine", "--backend fsdp"]),
        (["--backend", "fsdp", "--is-value-model"], ["--is-value-model", "Qwen2ForCausalLM"]),
        (["--backend", "fsdp", "--hf_upload_path", "me/model"], ["--hf_upload_path", "no Hugging Face Hub"]),
    ]
    for flags, words in cases:
        assert merger(["merge", "--local_dir", actor, "--target_dir", str(tmp_path / "x"), *flags]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), (flags, err)
        assert "Traceback" not in err
    assert not (tmp_path / "x").exists()
    assert merger(["merge", "--backend", "fsdp", "--local_dir", str(tmp_path / "none")]) == 2
    assert "--local_dir" in capsys.readouterr().err


# verl's model_merger lines (its module docstring, tests/special_e2e/run_grpo_lora_with_merge.sh)
VERL_MERGER_LINES = [
    "merge --backend fsdp --local_dir {ckpt}/global_step_1/actor --target_dir {out}",
    "merge --backend megatron --tie-word-embedding --local_dir {ckpt}/global_step_1/actor --target_dir {out}",
    "merge --backend fsdp --local_dir {ckpt}/global_step_1/actor/ --target_dir {ckpt}/global_step_1/actor/hf",
]


@pytest.mark.parametrize("line", VERL_MERGER_LINES)
def test_verls_merger_command_lines_parse(line):
    args = build_parser().parse_args(line.format(ckpt="/c", out="/o").split())
    assert args.operation == "merge" and args.backend in ("fsdp", "megatron")
    assert args.local_dir.startswith("/c/global_step_1/actor")


# ───────────────────────────────────── generation ─────────────────────────────────────


@pytest.fixture(scope="module")
def gsm8k4(shared_data, tmp_path_factory) -> Path:
    """The first 4 GSM8K test prompts in verl's format (data/preprocess)."""
    from rlfoundry.data.preprocess.__main__ import main as preprocess_main

    out = tmp_path_factory.mktemp("gsm8k")
    assert preprocess_main(["gsm8k", "--input", str(shared_data / "gsm8k"), "--output", str(out)]) == 0
    path = out / "four.parquet"
    pq.write_table(pq.read_table(out / "test.parquet").slice(0, 4), path)
    return path


def _generate(tiny_model_dir: Path, data: Path, out: Path, *extra: str) -> pa.Table:
    assert main_generation.main([f"data.path={data}", f"data.output_path={out}", f"model.path={tiny_model_dir}",
                                 "data.n_samples=2", "data.batch_size=3", "rollout.response_length=8",
                                 "rollout.prompt_length=1024", *extra]) == 0
    return pq.read_table(out)


def test_main_generation_keeps_the_rows_and_adds_n_responses_greedy_twice_the_same(tiny_model_dir, gsm8k4, tmp_path):
    first = _generate(tiny_model_dir, gsm8k4, tmp_path / "a.parquet", "rollout.do_sample=false")
    inputs = pq.read_table(gsm8k4)
    assert first.column_names == [*inputs.column_names, "responses"]
    assert first.drop_columns(["responses"]).equals(inputs)  # the input columns, row for row
    responses = first.column("responses").to_pylist()
    assert len(responses) == 4 and all(len(r) == 2 and r[0] == r[1] for r in responses)  # greedy: both the same
    again = _generate(tiny_model_dir, gsm8k4, tmp_path / "b.parquet", "rollout.do_sample=false")
    assert again.column("responses").to_pylist() == responses
    # two ranks: batches of 3 padded to 4 and 1 to 2, the padding dropped again; the same responses, same rows
    ranks = _generate(tiny_model_dir, gsm8k4, tmp_path / "r.parquet", "rollout.do_sample=false",
                      "trainer.n_gpus_per_node=2")
    assert ranks.column("responses").to_pylist() == responses
    # August's server entry point: the same prompts through the trainer's keys give the same greedy responses
    assert main_generation_server.main([
        f"data.train_files={gsm8k4}", f"+data.output_path={tmp_path / 'c.parquet'}", "data.max_prompt_length=1024",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_batch_size=3",
        "actor_rollout_ref.rollout.response_length=8", "actor_rollout_ref.rollout.temperature=0",
        "actor_rollout_ref.rollout.n=1"]) == 0
    assert [r[0] for r in pq.read_table(tmp_path / "c.parquet").column("responses").to_pylist()] == \
        [r[0] for r in responses]


def test_generation_mistakes_are_messages_naming_the_key(tiny_model_dir, gsm8k4, tmp_path, capsys):
    base = [f"data.path={gsm8k4}", f"data.output_path={tmp_path / 'o.parquet'}", f"model.path={tiny_model_dir}"]
    cases = [
        (["rollout.temperature=0", "data.n_samples=2"], "data.n_samples=1"),
        (["rollout.temprature=0.5"], "Did you mean 'rollout.temperature'"),
        (["data.prompt_key=question"], "data.prompt_key"),
        (["rollout.prompt_length=8", "data.n_samples=1"], "rollout.prompt_length=8"),
        (["data.path=/nonexistent.parquet"], "data.path=/nonexistent.parquet"),
    ]
    for extra, words in cases:
        assert main_generation.main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (extra, err)
    assert not (tmp_path / "o.parquet").exists()


# ───────────────────────────────────── main_eval ─────────────────────────────────────


def _eval_parquet(path: Path) -> Path:
    rows = [  # GSM8K's strict scorer reads the number after "####"; MATH the last \boxed{}
        ("openai/gsm8k", "18", ["so #### 18", "#### 17"]),  # 1, 0: mean 0.5, passed
        ("openai/gsm8k", "3", ["#### 4", "no answer"]),  # 0, 0: mean 0, not passed
        ("openai/gsm8k", "70000", ["#### 70000", "#### 70,000"]),  # 1, 1: mean 1, passed
        ("lighteval/MATH", "\\frac{1}{2}", ["\\boxed{\\frac{1}{2}}", "\\boxed{3}"]),  # 1, 0
    ]
    pq.write_table(pa.table({
        "data_source": [r[0] for r in rows], "prompt": [[{"role": "user", "content": "q"}]] * len(rows),
        "reward_model": [{"style": "rule", "ground_truth": r[1]} for r in rows],
        "responses": [r[2] for r in rows]}), path)
    return path


def test_main_eval_prints_verls_test_score_and_pass_at_n_per_data_source(tmp_path, capsys):
    data = _eval_parquet(tmp_path / "gen.parquet")
    assert main_eval.main([f"data.path={data}", f"data.output_path={tmp_path / 'm.json'}"]) == 0
    # gsm8k: mean of row means (0.5 + 0 + 1) / 3 = 0.5; rows passed 2 of 3. MATH: one row, 0.5 and passed
    expected = {"test_score/lighteval/MATH": 0.5, "pass@2/lighteval/MATH": 1.0,
                "test_score/openai/gsm8k": 0.5, "pass@2/openai/gsm8k": 2 / 3}
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(expected)
    assert json.loads((tmp_path / "m.json").read_text()) == expected


def test_main_eval_calls_a_custom_function_as_verl_does(tmp_path, capsys):
    data = _eval_parquet(tmp_path / "gen.parquet")
    fn = tmp_path / "score.py"  # verl calls fn(data_source, response, ground_truth), positionally
    fn.write_text("def length(source, response, truth):\n    return {'score': len(response) / 10}\n")
    assert main_eval.main([f"data.path={data}", f"custom_reward_function.path={fn}",
                           "custom_reward_function.name=length"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    # gsm8k rows: (1.0+0.7)/2, (0.6+0.9)/2, (1.0+1.1)/2 -> 0.85, 0.75, 1.05: mean 0.8833; passed: rows 1 and 3
    metrics = eval(out)  # noqa: S307 - our own printed dict
    assert metrics["test_score/openai/gsm8k"] == pytest.approx((0.85 + 0.75 + 1.05) / 3)
    assert metrics["pass@2/openai/gsm8k"] == pytest.approx(2 / 3)
    assert main_eval.main([f"data.path={data}", "data.response_key=answers"]) == 2
    assert "data.response_key" in capsys.readouterr().err
    # a data source without a built-in scorer and no custom function: named, with the fix
    pq.write_table(pq.read_table(data).set_column(0, "data_source", pa.array(["my/set"] * 4)), tmp_path / "mine.parquet")
    assert main_eval.main([f"data.path={tmp_path / 'mine.parquet'}"]) == 2
    err = capsys.readouterr().err
    assert "my/set" in err and "custom_reward_function.path" in err and "Traceback" not in err


def test_main_eval_a_scorer_that_hangs_or_raises_costs_its_response_only(tmp_path, capsys):
    """A response whose scorer hangs past scoring.timeout_s or raises scores scoring.failure_score, is counted
    and named on stderr; every other response keeps its score and the evaluation ends normally."""
    data = _eval_parquet(tmp_path / "gen.parquet")
    fn = tmp_path / "score.py"
    fn.write_text("import time\n"
                  "def flaky(source, response, truth):\n"
                  "    if response == '#### 17':\n        time.sleep(600)\n"
                  "    if response == 'no answer':\n        raise ValueError('cannot parse')\n"
                  "    return 1.0\n")
    assert main_eval.main([f"data.path={data}", f"custom_reward_function.path={fn}", "custom_reward_function.name=flaky",
                           "scoring.timeout_s=3", "scoring.num_workers=2"]) == 0
    captured = capsys.readouterr()
    metrics = eval(captured.out.strip().splitlines()[-1])  # noqa: S307 - our own printed dict
    # gsm8k rows: (1, timeout 0), (1, raised 0), (1, 1) -> 0.5, 0.5, 1: mean 2/3; MATH: both 1
    assert metrics["test_score/openai/gsm8k"] == pytest.approx(2 / 3)
    assert metrics["test_score/lighteval/MATH"] == 1.0
    assert "2 of 8 responses could not be scored" in captured.err
    assert "'timeout': 1" in captured.err and "'exception': 1" in captured.err and "row 0, response 1" in captured.err


def test_the_r1_recipes_eval_entry_runs_its_script_line_with_its_task_dispatching_scorer(tmp_path, monkeypatch, capsys):
    """recipe/r1/run_r1_distill_qwen.sh's main_eval line: the recipe's reward_score.py dispatches by data
    source to ``recipe.r1.tasks.*``, a package of the checkout the script runs in (here a stand-in
    written for the test, with GPQA's "Answer: X" rule), imported from the working directory."""
    from rlfoundry.recipe.r1 import main_eval as r1_eval

    tasks = tmp_path / "recipe" / "r1" / "tasks"
    tasks.mkdir(parents=True)
    for pkg in (tmp_path / "recipe", tmp_path / "recipe" / "r1", tasks):
        (pkg / "__init__.py").write_text("")
    (tasks / "gpqa.py").write_text(
        "import re\n\ndef compute_score(solution_str, ground_truth):\n"
        "    m = re.search(r'(?i)Answer[ \\t]*:[ \\t]*\\$?([A-D])\\$?', solution_str)\n"
        "    return 1.0 if m and m.group(1) == ground_truth else 0.0\n")
    (tmp_path / "recipe" / "r1" / "reward_score.py").write_text(
        "def reward_func(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if data_source == 'Idavidrein/gpqa':\n"
        "        from recipe.r1.tasks import gpqa\n"
        "        return gpqa.compute_score(solution_str, ground_truth)\n"
        "    raise NotImplementedError(data_source)\n")
    pq.write_table(pa.table({
        "data_source": ["Idavidrein/gpqa"] * 3, "prompt": [[{"role": "user", "content": "q"}]] * 3,
        "reward_model": [{"style": "rule", "ground_truth": t} for t in ("A", "C", "B")],
        "responses": [["Answer: A", "Answer: B"], ["answer: C", "Answer: C"], ["no idea", "Answer: D"]]}),
        tmp_path / "test-output-8.parquet")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # python -m puts the working directory first, as here
    line = ("data.path=test-output-8.parquet data.prompt_key=prompt data.response_key=responses "
            "custom_reward_function.path=recipe/r1/reward_score.py custom_reward_function.name=reward_func")
    assert r1_eval.main(line.split()) == 0
    metrics = eval(capsys.readouterr().out.strip().splitlines()[-1])  # noqa: S307 - our own printed dict
    # rows: (1 + 0) / 2, (1 + 1) / 2, (0 + 0) / 2 -> 0.5, 1, 0: mean 0.5; two rows of three have a full mark
    assert metrics == {"test_score/Idavidrein/gpqa": 0.5, "pass@2/Idavidrein/gpqa": pytest.approx(2 / 3)}


# ───────────────────────────────── verl's command lines, --cfg job ─────────────────────────────────

# examples/generation/run_deepseek7b_mutli_node.sh, run_deepseek_v2_lite_math.sh and
# tests/special_e2e/generation/run_gen_qwen05.sh (January, b178a3cd5); model/data paths substituted
VERL_GENERATION_LINES = [
    "trainer.nnodes=2 trainer.n_gpus_per_node=8 data.path={data} data.prompt_key=prompt data.n_samples=1 "
    "data.output_path={out} model.path={model} +model.trust_remote_code=True rollout.temperature=1.0 "
    "rollout.top_k=50 rollout.top_p=0.7 rollout.prompt_length=2048 rollout.response_length=1024 "
    "rollout.tensor_model_parallel_size=16 rollout.gpu_memory_utilization=0.8",
    "trainer.nnodes=1 trainer.n_gpus_per_node=8 data.path={data} data.prompt_key=prompt data.n_samples=1 "
    "data.output_path={out} model.path={model} +model.trust_remote_code=True rollout.temperature=1.0 "
    "rollout.top_k=50 rollout.top_p=0.7 rollout.prompt_length=2048 rollout.response_length=1024 "
    "rollout.tensor_model_parallel_size=2 rollout.gpu_memory_utilization=0.8",
    "trainer.nnodes=1 trainer.n_gpus_per_node=4 data.path={data} data.prompt_key=prompt data.n_samples=1 "
    "data.output_path={out} model.path={model} +model.trust_remote_code=True rollout.temperature=1.0 "
    "rollout.top_k=50 rollout.top_p=0.7 rollout.prompt_length=2048 rollout.response_length=1024 "
    "rollout.tensor_model_parallel_size=2 rollout.gpu_memory_utilization=0.8",
]
# tests/special_e2e/generation/run_gen_qwen05_server.sh (January) and examples/generation/run_deepseek_llm_7b.sh
# (August, 1dda039b9)
VERL_SERVER_LINES = [
    "trainer.nnodes=1 trainer.n_gpus_per_node=8 actor_rollout_ref.model.path={model} "
    "actor_rollout_ref.model.trust_remote_code=True actor_rollout_ref.rollout.temperature=1.0 "
    "actor_rollout_ref.rollout.top_k=50 actor_rollout_ref.rollout.top_p=0.7 "
    "actor_rollout_ref.rollout.prompt_length=2048 actor_rollout_ref.rollout.response_length=1024 "
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.gpu_memory_utilization=0.9 "
    "actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4 data.train_files={data} "
    "data.prompt_key=prompt +data.output_path={out}",
    "trainer.nnodes=1 trainer.n_gpus_per_node=8 data.train_files={data} data.prompt_key=prompt "
    "+data.output_path={out} actor_rollout_ref.model.path={model} actor_rollout_ref.model.trust_remote_code=True "
    "actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.load_format=auto "
    "actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_k=50 actor_rollout_ref.rollout.top_p=0.7 "
    "actor_rollout_ref.rollout.prompt_length=2048 actor_rollout_ref.rollout.response_length=1024 "
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.gpu_memory_utilization=0.8 "
    "actor_rollout_ref.rollout.n=1",
]


def _dry_run(module, line: str, capsys) -> dict:
    args = line.format(data="/d/gsm8k/test.parquet", out="/d/gen.parquet", model="/m/Qwen2.5-0.5B-Instruct").split()
    assert module.main([*args, "--cfg", "job"]) == 0, capsys.readouterr().err
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(capsys.readouterr().out))


@pytest.mark.parametrize("line", VERL_GENERATION_LINES)
def test_verls_main_generation_lines_validate(line, capsys):
    cfg = _dry_run(main_generation, line, capsys)
    assert cfg["model"]["trust_remote_code"] is True and cfg["data"]["output_path"] == "/d/gen.parquet"
    assert (cfg["rollout"]["top_k"], cfg["rollout"]["prompt_length"], cfg["rollout"]["response_length"]) == (50, 2048, 1024)


@pytest.mark.parametrize("line", VERL_SERVER_LINES)
def test_verls_main_generation_server_lines_validate(line, capsys):
    cfg = _dry_run(main_generation_server, line, capsys)
    rollout = cfg["actor_rollout_ref"]["rollout"]
    assert cfg["data"]["output_path"] == "/d/gen.parquet" and cfg["data"]["train_files"] == "/d/gsm8k/test.parquet"
    assert (rollout["name"], rollout["top_p"], rollout["response_length"]) == ("vllm", 0.7, 1024)
