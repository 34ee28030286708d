"""verl's reward loop with a generative reward model: ``reward_model.model.path`` served at SGLang's
``/generate`` to an ``async`` custom reward function (FAPO's shape, written here), which gets
``reward_router_address`` and ``reward_model_tokenizer``. The server's tokens are the model's greedy
tokens, its score reaches ``token_level_scores``, one GRPO step runs through ``main_ppo``, and a
request that fails (bad request, server down) costs that sample's score, never the run."""

from __future__ import annotations

import concurrent.futures
import json
import time
import textwrap
import urllib.error
import urllib.request

import pytest
import torch

from tests.trainer import _e2e as E

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

MAX_NEW = 6
# A critic in FAPO's shape: the solution goes to the reward model, whose greedy output decides the score.
# Rows whose index is a multiple of 3 send a sampling parameter the server refuses (a failed request).
REWARD_FILE = textwrap.dedent(f'''
    import asyncio, json, urllib.request

    def _post(address, payload):
        request = urllib.request.Request(f"http://{{address}}/generate", data=json.dumps(payload).encode(),
                                         headers={{"Content-Type": "application/json"}})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())

    def critic_prompt(solution_str):
        return "Check: " + solution_str[:20]

    async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                            reward_model_tokenizer):
        ids = reward_model_tokenizer(critic_prompt(solution_str))["input_ids"]
        params = {{"max_new_tokens": {MAX_NEW}, "temperature": 0}}
        if extra_info.get("index", 1) % 3 == 0:
            params["frequency_penalty"] = 0.5  # not served: HTTP 400, this sample fails
        out = await asyncio.to_thread(_post, reward_router_address, {{"input_ids": ids, "sampling_params": params}})
        return {{"score": sum(out["output_ids"]) % 7 / 6.0, "critic_tokens": len(out["output_ids"])}}
''')


def greedy_tokens(model, tok, text: str) -> list[int]:
    """The model's own greedy continuation (transformers' generate), up to and including EOS."""
    ids = torch.tensor([tok(text)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    return out[: out.index(tok.eos_token_id) + 1] if tok.eos_token_id in out else out


def expected_score(model, tok, solution: str) -> float:
    return sum(greedy_tokens(model, tok, "Check: " + solution[:20])) % 7 / 6.0


def overrides(model_dir, tmp_path, *extra: str) -> list[str]:
    fn = tmp_path / "critic_reward.py"
    fn.write_text(REWARD_FILE)
    return E.tiny_overrides(model_dir, tmp_path / "run", "reward_model.enable=true", f"reward_model.model.path={model_dir}",
                            f"custom_reward_function.path={fn}", "reward_model.reward_kwargs.failure_score=-1",
                            "reward_model.rollout.prompt_length=64", "reward_model.rollout.response_length=16",
                            "algorithm.adv_estimator=grpo", "trainer.total_training_steps=1", *extra)


def post(address: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{address}/generate", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """One GRPO step through main_ppo; fit() shut its server down at the end, so the tests below talk to
    a new one over the same engine (the trainer's genrm workers, kept)."""
    from rlfoundry.trainer.ppo.ray_trainer import _reward_model_server

    done = E.train(overrides(tiny_model_dir, tmp_path_factory.mktemp("reward-loop")), keep_trainer=True)
    done.closed_address = done.trainer.reward_server.address
    done.trainer.reward_server = _reward_model_server(done.trainer.config, done.trainer.genrm_wg)
    yield done
    done.trainer.reward_server.shutdown()


def test_fit_shuts_its_server_down(run):
    with pytest.raises(urllib.error.URLError):  # connection refused: no thread or socket left behind
        post(run.closed_address, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})


def test_a_request_the_engine_has_not_started_when_its_caller_gives_up_is_skipped(run):
    """settle() after a reward phase: a queued request whose caller timed out is cancelled, not generated
    later while the trainer uses the workers (a colocated reward model shares them)."""
    from rlfoundry.rewards.reward_loop import RewardModelServer

    calls = []
    server = run.trainer.reward_server
    slow = RewardModelServer(lambda data: calls.append(len(data)) or server.generate(data), server.tokenizer,
                             server.model_path, 64, 16, request_timeout_s=0.0)
    try:
        with slow._engine_busy:  # the engine is busy with an earlier call: this request waits in the queue
            status, out = post(slow.address, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
            assert status == 500 and "did not answer within 0s" in out["error"]["message"]
            slow.request_timeout_s = 60.0
            # a later request, queued behind the abandoned one (FIFO): once it is answered, the engine has
            # dealt with both
            pool = concurrent.futures.ThreadPoolExecutor(1)
            later = pool.submit(post, slow.address, {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 1}})
            time.sleep(0.2)
        assert later.result(timeout=60)[0] == 200
        pool.shutdown()
        assert slow.settle(timeout_s=60)
        assert calls == [1]  # the later request's row alone: the abandoned one never reached the engine
    finally:
        slow.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_generate_gives_the_models_greedy_tokens_in_sglangs_response(run, hf):
    model, tok = hf
    server = run.trainer.reward_server
    texts = ["Check: 12+7=19", "Check: a much longer solution text here", "x"]
    rows = [tok(t)["input_ids"] for t in texts]
    status, out = post(server.address, {"input_ids": rows, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
    assert status == 200 and len(out) == 3  # a list of prompts, one response each (batched in one engine call)
    for text, row, item in zip(texts, rows, out):
        assert item["output_ids"] == greedy_tokens(model, tok, text)
        assert item["text"] == tok.decode(item["output_ids"], skip_special_tokens=True)
        assert item["meta_info"]["prompt_tokens"] == len(row)
        assert item["meta_info"]["completion_tokens"] == len(item["output_ids"])
        stopped = item["output_ids"][-1] == tok.eos_token_id
        assert item["meta_info"]["finish_reason"]["type"] == ("stop" if stopped else "length")
        assert stopped or len(item["output_ids"]) == MAX_NEW
    status, one = post(server.address, {"input_ids": rows[0], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}})
    assert status == 200 and one["output_ids"] == out[0]["output_ids"]  # a single prompt: a single response


def test_bad_requests_are_400s_naming_the_field(run):
    address = run.trainer.reward_server.address
    status, body = post(address, {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 1}})
    assert status == 400 and "frequency_penalty" in body["error"]["message"]
    status, body = post(address, {"input_ids": list(range(3, 80))})
    assert status == 400 and "prompt_length=64" in body["error"]["message"]
    status, body = post(address, {"sampling_params": {}})
    assert status == 400 and "input_ids" in body["error"]["message"]


def test_grpo_step_scores_with_the_served_model_and_failed_requests_cost_their_sample(run, hf):
    model, tok = hf
    assert run.summary["global_step"] == 1 and run.trainer.rm_wg is None  # no classifier pass
    (batch,) = run.batches
    lengths = batch["response_mask"].sum(-1)
    solutions = [tok.decode(r[:n].tolist(), skip_special_tokens=True) for r, n in zip(batch["responses"], lengths)]
    failed = [info["index"] % 3 == 0 for info in batch["extra_info"]]
    assert 0 < sum(failed) < len(failed)  # both kinds of sample in the step
    expected = [-1.0 if bad else expected_score(model, tok, s) for s, bad in zip(solutions, failed)]
    assert E.sequence_scores(batch).tolist() == pytest.approx(expected, abs=1e-6)
    # the score sits on the last valid response token, as token_level_scores hold it
    nonzero = batch["token_level_scores"] != 0
    assert all(int(row.nonzero().max()) == int(n) - 1 for row, n in zip(nonzero, lengths) if row.any())
    assert run.step(1)["reward/errors"] == sum(failed) and run.step(1)["reward/errors/exception"] == sum(failed)
    assert run.step(1)["actor/pg_loss"] == run.step(1)["actor/pg_loss"]  # finite: the step trained


def test_a_server_that_is_down_costs_each_sample_its_score_not_the_call(run):
    from rlfoundry.protocol import DataProto
    from rlfoundry.rewards import load_reward_manager
    from rlfoundry.rewards.reward_loop import RewardModelServer

    trainer, (snapshot,) = run.trainer, run.batches
    batch = DataProto.from_dict(tensors={k: v for k, v in snapshot.items() if isinstance(v, torch.Tensor)},
                                non_tensors={k: v for k, v in snapshot.items() if not isinstance(v, torch.Tensor)})
    server = trainer.reward_server
    down = RewardModelServer(server.generate, server.tokenizer, server.model_path, 64, 16)
    down.shutdown()  # its port now refuses connections
    manager = load_reward_manager(trainer.config, trainer.tokenizer)
    manager.serve_reward_model(down)
    result = manager(batch, return_dict=True)
    assert result["reward_tensor"].sum(-1).tolist() == [-1.0] * len(batch)
    assert result["reward_metrics"]["reward/errors/exception"] == len(batch)  # connection refused, each sample


def _batch(snapshot):
    from rlfoundry.protocol import DataProto

    return DataProto.from_dict(tensors={k: v for k, v in snapshot.items() if isinstance(v, torch.Tensor)},
                               non_tensors={k: v for k, v in snapshot.items() if not isinstance(v, torch.Tensor)})


def test_scorer_processes_call_the_server_too(run):
    """With reward processes the function (and the tokenizer, loaded there from the model's path)
    travels to them and scores as in the driver."""
    from rlfoundry.rewards import load_reward_manager

    (snapshot,) = run.batches
    with load_reward_manager(run.trainer.config, run.trainer.tokenizer, num_workers=2) as manager:
        manager.serve_reward_model(run.trainer.reward_server)
        result = manager(_batch(snapshot), return_dict=True)
        assert manager._pool is not None  # scored in the processes, not the driver
    assert torch.equal(result["reward_tensor"], snapshot["token_level_scores"])


def test_a_timeout_says_whether_the_server_or_the_function_hung(run, tmp_path, caplog):
    from rlfoundry.rewards.custom import FileRewardFunction
    from rlfoundry.rewards.reward_manager import NaiveRewardManager

    slow = tmp_path / "slow.py"
    slow.write_text("import asyncio\n\nasync def compute_score(reward_router_address, **kw):\n"
                    "    await asyncio.sleep(30)\n")
    (snapshot,) = run.batches
    manager = NaiveRewardManager(run.trainer.tokenizer, 0, FileRewardFunction(slow), num_workers=0, timeout_s=0.5,
                                 failure_score=-1)
    manager.serve_reward_model(run.trainer.reward_server)
    with caplog.at_level("WARNING"):
        result = manager(_batch(snapshot), return_dict=True)
    assert result["reward_metrics"]["reward/errors/timeout"] == len(snapshot["responses"])
    assert result["reward_tensor"].sum(-1).tolist() == [-1.0] * len(snapshot["responses"])
    assert "had no request pending: the reward function itself did not finish" in caplog.text
    assert run.trainer.reward_server.address in caplog.text


def test_a_classifier_served_to_the_function_is_a_start_up_error_naming_the_fix(tmp_path, tiny_model_dir):
    from rlfoundry.models.tiny import save_tiny_model
    from rlfoundry.trainer.config import ConfigError, check_startup_paths, load_config

    classifier = save_tiny_model(tmp_path / "rm", head="sequence_classification", seed=3)
    keys = [arg.replace(str(tiny_model_dir), str(classifier)) if arg.startswith("reward_model.model.path") else arg
            for arg in overrides(tiny_model_dir, tmp_path)]
    with pytest.raises(ConfigError, match=r"is a classifier .*/classify.* not built here.*use_reward_loop=false"):
        check_startup_paths(load_config(keys))
    check_startup_paths(load_config(keys + ["reward_model.use_reward_loop=false"]))  # the legacy classifier path
    check_startup_paths(load_config(overrides(tiny_model_dir, tmp_path)))  # a causal LM is served


def test_the_served_model_in_a_pool_of_its_own_scores_the_same(tiny_model_dir, tmp_path, hf):
    """verl's reward_model.enable_resource_pool: the served model's engine in its own process (process
    back end), the actor's in this one; the function's scores are the model's greedy ones as colocated."""
    model, tok = hf
    run = E.train(overrides(tiny_model_dir, tmp_path, "trainer.worker_backend=process",
                            "reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=1",
                            "reward_model.nnodes=1"), keep_trainer=True)
    try:
        assert run.trainer.genrm_wg is not run.trainer.actor_rollout_wg and run.trainer.genrm_wg.world_size == 1
    finally:  # the kept trainer's worker processes: not left running into later tests
        for group in (run.trainer.genrm_wg, run.trainer.actor_rollout_wg):
            if hasattr(group, "shutdown"):
                group.shutdown()
    (batch,) = run.batches
    lengths = batch["response_mask"].sum(-1)
    solutions = [tok.decode(r[:n].tolist(), skip_special_tokens=True) for r, n in zip(batch["responses"], lengths)]
    expected = [-1.0 if info["index"] % 3 == 0 else expected_score(model, tok, s)
                for s, info in zip(solutions, batch["extra_info"])]
    assert E.sequence_scores(batch).tolist() == pytest.approx(expected, abs=1e-6)
