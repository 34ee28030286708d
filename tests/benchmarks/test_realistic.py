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
