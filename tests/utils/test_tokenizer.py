"""The one pad id (``utils/tokenizer.pad_id``): the tokenizer's pad token, else its EOS, never a silent 0."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.utils.tokenizer import pad_id


def test_the_pad_token_wins_even_when_its_id_is_zero():
    # the tiny vocabulary starts with its special tokens: <|endoftext|> (pad) = 0, <|im_start|> = 1,
    # <|im_end|> (EOS) = 2; a truthiness fallback (`pad or eos`) would wrongly answer 2
    assert pad_id(build_tokenizer()) == 0
    assert pad_id(SimpleNamespace(pad_token_id=7, eos_token_id=2)) == 7


def test_without_a_pad_token_eos_pads_as_in_verl_and_hf_generate():
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None  # as a Llama base model ships
    assert tokenizer.pad_token_id is None and pad_id(tokenizer) == 2  # <|im_end|>
    assert pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=0)) == 0


def test_a_tokenizer_with_neither_is_an_error_that_says_what_to_add():
    with pytest.raises(ValueError, match="neither a pad nor an EOS token.*tokenizer_config.json"):
        pad_id(SimpleNamespace(pad_token_id=None, eos_token_id=None, name_or_path="models/rm"))
