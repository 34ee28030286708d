"""benchmarks/realistic.py's cost model: the prompt length it feeds into the update's FLOPs."""

from __future__ import annotations

import pytest

from benchmarks.common import Workload, prepare_in_process


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    w = Workload(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, prompts_per_step=3, n=2, steps=2)
    return w, prepare_in_process(w, tmp_path_factory.mktemp("work"))


def test_prompt_tokens_is_the_mean_templated_prompt_length_in_tokens(prepared):
    from transformers import AutoTokenizer

    from benchmarks.common import load_prompts
    from benchmarks.realistic import _prompt_tokens

    w, files = prepared
    tok = AutoTokenizer.from_pretrained(files.model_dir)
    # by hand: render each chat-templated prompt as text and count the tokens of that text
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
             for m, _ in load_prompts(files.train_file)[: w.prompts_per_step]]
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert min(lengths) > 10  # arithmetic prompts in a chat template: tens of tokens, never the 2 keys of a dict
    assert _prompt_tokens(files.train_file, files.model_dir, w.prompts_per_step) == pytest.approx(
        sum(lengths) / len(lengths))


def test_the_real_vocabulary_shape_is_qwen25_05b_whole():
    import argparse

    from benchmarks.common import add_workload_args, workload_from_args

    p = argparse.ArgumentParser()
    add_workload_args(p)
    w = workload_from_args(p.parse_args(["--shape", "qwen2.5-0.5b-vocab", "--num-layers", "24"]))
    assert (w.hidden_size, w.num_heads, w.num_kv_heads, w.intermediate_size, w.num_layers) == (896, 14, 2, 4864, 24)
    assert w.vocab_size == 151936 and w.tie_word_embeddings
    assert workload_from_args(p.parse_args(["--vocab-size", "1000"])).vocab_size == 1000


def test_a_padded_vocabulary_reaches_the_model_and_keeps_the_prompt_ids(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.realistic import model_costs
    from rlfoundry.models.tiny import build_tokenizer

    small = Workload(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, prompts_per_step=2, n=2, steps=2)
    big = small.replace(vocab_size=3000, tie_word_embeddings=True)
    files = prepare_in_process(big, tmp_path)
    config, tok = AutoConfig.from_pretrained(files.model_dir), AutoTokenizer.from_pretrained(files.model_dir)
    assert config.vocab_size == len(tok) == 3000 and config.tie_word_embeddings
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert tok(text)["input_ids"] == build_tokenizer()(text)["input_ids"]  # fillers are never produced by encoding
    assert tok.decode(tok(text)["input_ids"]) == text
    # the head's cost grows by hidden × (3000 − the byte vocabulary): 2 FLOPs per weight and token
    base = model_costs(prepare_in_process(small, tmp_path).model_dir)
    assert model_costs(files.model_dir)["flops_per_token"] - base["flops_per_token"] == 2 * 32 * (3000 - len(build_tokenizer()))


def test_transformers_static_cache_generate_samples_the_steps_rows(prepared):
    """The reference decode of issue 34: transformers' generate with its static cache on the step's rows
    (prompts_per_step × n), timed after a first call, per call and per token step."""
    from benchmarks.realistic import hf_static_generate

    w, files = prepared
    w = w.replace(max_response_length=5, threads=1)
    hf = hf_static_generate(w, files, threads=1, repeats=2)
    assert "error" not in hf, hf
    assert hf["rows"] == w.prompts_per_step * w.n == 6
    assert 1 <= hf["steps"] <= 5 and len(hf["calls_s"]) == 2 and hf["first_call_s"] > 0
    assert hf["ms_per_step"] == pytest.approx(1e3 * hf["gen_s"] / hf["steps"])


def test_rlfoundrys_generation_is_set_beside_it_by_hand(tmp_path):
    import json

    from benchmarks.realistic import versus_hf_generate
    from scripts.gpu_check_report import bench_figures, describe

    w = Workload(max_response_length=100)
    hf = {"rows": 64, "gen_s": 4.0, "ms_per_step": 40.0, "steps": 100, "first_call_s": 40.0}
    mine = versus_hf_generate([{"framework": "rlfoundry", "gen_s": 2.0}], hf, w)
    assert mine == {"rlfoundry_gen_s": 2.0, "hf_static_gen_s": 4.0, "rlfoundry/hf_static gen time": 0.5,
                    "rlfoundry_ms_per_step": 20.0, "hf_static_ms_per_step": 40.0}
    assert versus_hf_generate([{"framework": "rlfoundry", "gen_s": 2.0}], {"error": "exit 1"}, w) == {}
    # the GPU check's summary line for the part
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"peaks": {"device": "cuda"}, "results": [{
        "workload": {"num_layers": 24, "max_response_length": 100}, "ratios": {},
        "rows": [{"framework": "rlfoundry", "samples_per_s": 30.0}], "hf_static_generate": {**hf, **mine}}]}))
    line = describe("hfgen", bench_figures(path))
    assert line == ("24 layers, 100 tokens: samples/s rlfoundry 30.00, decode 20.00 ms/step vs transformers' "
                    "static-cache generate 40.00 (0.50x its time)")
