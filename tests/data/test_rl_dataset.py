"""RLHFDataset on real and hand-made parquet files; the resumable loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from rlfoundry.data import DataError, RLHFDataset, build_dataloader, collate_fn
from rlfoundry.models.tiny import build_tokenizer
from tests.data.conftest import write_prompts

# The project's tokenizer spends one token per UTF-8 byte; each special token is one token. The
# ChatML template wraps a single user message as
#   <|im_start|> "user\n" CONTENT <|im_end|> "\n" <|im_start|> "assistant\n"
# = 1 + 5 + len(CONTENT) + 1 + 1 + 1 + 10 tokens.
CHAT_OVERHEAD = 19


def _config(**kw):
    return OmegaConf.create({"max_prompt_length": 64, "truncation": "error", **kw})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()  # the tiny model's tokenizer, without building the model


def _valid_text(tokenizer, item: dict) -> str:
    return tokenizer.decode(item["input_ids"][item["attention_mask"].bool()].tolist())


def test_gsm8k_train_and_test_load_with_row_counts(gsm8k_dir: Path, tokenizer) -> None:
    cfg = _config(max_prompt_length=1100, return_raw_chat=True)  # longest train prompt: 1077
    train = RLHFDataset(str(gsm8k_dir / "train.parquet"), tokenizer, cfg)
    test = RLHFDataset([gsm8k_dir / "test.parquet"], tokenizer, cfg)
    assert (len(train), len(test)) == (7473, 1319)
    item = test[0]
    question = item["extra_info"]["question"]
    assert question.startswith("Janet\u2019s ducks lay 16 eggs per day")
    expected = f"<|im_start|>user\n{item['raw_prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert _valid_text(tokenizer, item) == expected
    n = len(item["raw_prompt"][0]["content"].encode()) + CHAT_OVERHEAD
    assert int(item["attention_mask"].sum()) == n == len(item["raw_prompt_ids"])
    # left padded: zeros then ones; positions count real tokens from 0
    assert item["attention_mask"][: 1100 - n].sum() == 0 and item["attention_mask"][-n:].all()
    assert item["input_ids"][: 1100 - n].eq(tokenizer.pad_token_id).all()
    assert item["position_ids"][-n:].tolist() == list(range(n)) and item["position_ids"][: 1100 - n].eq(0).all()
    assert item["reward_model"]["ground_truth"] == "18" and item["data_source"] == "openai/gsm8k"
    assert item["index"] == 0 and "prompt" not in item


def test_filter_overlong_prompts_keeps_exactly_the_short_ones(gsm8k_dir: Path, tokenizer) -> None:
    rows = pq.read_table(gsm8k_dir / "test.parquet").to_pylist()
    lengths = [len(r["prompt"][0]["content"].encode()) + CHAT_OVERHEAD for r in rows]
    limit = 300
    ds = RLHFDataset(gsm8k_dir / "test.parquet", tokenizer, _config(max_prompt_length=limit, filter_overlong_prompts=True))
    kept = [i for i, n in enumerate(lengths) if n <= limit]
    assert 0 < len(kept) < len(rows)
    assert len(ds) == len(kept)
    assert [ds[j]["index"] for j in (0, -1)] == [kept[0], kept[-1]]
    # without filtering, truncation=error names the first over-long row (file, row, length)
    first_over = next(i for i, n in enumerate(lengths) if n > limit)
    with pytest.raises(DataError, match=rf"test.parquet, row {first_over}: prompt is {lengths[first_over]} tokens"):
        RLHFDataset(gsm8k_dir / "test.parquet", tokenizer, _config(max_prompt_length=limit))


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("left", "ghij"), ("right", "abcd"), ("middle", "abij")],  # middle: first 4//2, last 4-2
)
def test_truncation_modes_by_hand(tmp_path: Path, tokenizer, mode: str, expected: str) -> None:
    path = write_prompts(tmp_path / "p.parquet", ["abcdefghij", "xy"])
    ds = RLHFDataset(path, tokenizer, _config(max_prompt_length=4, truncation=mode, apply_chat_template=False))
    assert _valid_text(tokenizer, ds[0]) == expected
    assert tokenizer.decode(ds[0]["raw_prompt_ids"]) == expected
    # the short prompt is left padded, not truncated
    assert ds[1]["input_ids"].tolist() == [0, 0, *tokenizer.encode("xy")]
    assert ds[1]["attention_mask"].tolist() == [0, 0, 1, 1]


def test_truncation_left_on_real_row_keeps_generation_prompt(gsm8k_dir: Path, tokenizer, tmp_path: Path) -> None:
    head = tmp_path / "head.parquet"  # the first real rows are enough here; tokenising all costs seconds
    pq.write_table(pq.read_table(gsm8k_dir / "test.parquet").slice(0, 20), head)
    ds = RLHFDataset(head, tokenizer, _config(max_prompt_length=64, truncation="left"))
    text = _valid_text(tokenizer, ds[0])
    assert int(ds[0]["attention_mask"].sum()) == 64
    assert text.endswith('after "####".<|im_end|>\n<|im_start|>assistant\n')
    right = RLHFDataset(head, tokenizer, _config(max_prompt_length=64, truncation="right"))
    assert _valid_text(tokenizer, right[0]).startswith("<|im_start|>user\nJanet\u2019s ducks")


def test_no_chat_template_error_and_plain_concatenation(tmp_path: Path) -> None:
    tok = build_tokenizer(chat_template=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    path = write_prompts(tmp_path / "p.parquet", [messages])
    with pytest.raises(DataError, match="data.apply_chat_template=False"):
        RLHFDataset(path, tok, _config())
    ds = RLHFDataset(path, tok, _config(apply_chat_template=False, return_full_prompt=True))
    assert _valid_text(tok, ds[0]) == "Be brief.\n2+2=" == ds[0]["full_prompts"]


def test_bad_data_errors_name_the_problem(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(DataError, match=r"missing\.parquet does not exist"):
        RLHFDataset(tmp_path / "missing.parquet", tokenizer, _config())
    (tmp_path / "rows.parquet").write_text('{"prompt": "hi"}\n')
    with pytest.raises(DataError, match="rows.parquet is not a readable parquet file"):
        RLHFDataset(tmp_path / "rows.parquet", tokenizer, _config())
    path = write_prompts(tmp_path / "p.parquet", ["hello"])
    with pytest.raises(DataError, match=r"no column 'question' \(data.prompt_key\)"):
        RLHFDataset(path, tokenizer, _config(prompt_key="question"))
    bad = write_prompts(tmp_path / "bad.parquet", [[{"role": "user", "content": "ok"}], [{"role": "user", "text": "x"}]])
    with pytest.raises(DataError, match=r"bad.parquet, row 1: column 'prompt' must be a list of chat messages"):
        RLHFDataset(bad, tokenizer, _config())
    with pytest.raises(DataError, match=r"no prompts left .*every prompt is longer than data.max_prompt_length=2"):
        RLHFDataset(path, tokenizer, _config(max_prompt_length=2, filter_overlong_prompts=True))
    with pytest.raises(DataError, match="data.truncation='sideways'"):
        RLHFDataset(path, tokenizer, _config(truncation="sideways"))


def test_many_files_and_passthrough_columns(tmp_path: Path, tokenizer) -> None:
    a = write_prompts(tmp_path / "a.parquet", ["one", "two"])
    b = write_prompts(tmp_path / "b.parquet", ["three"], data_source="openai/gsm8k")
    ds = RLHFDataset([str(a), str(b)], tokenizer, _config(apply_chat_template=False))
    assert len(ds) == 3
    assert [_valid_text(tokenizer, ds[i]) for i in range(3)] == ["one", "two", "three"]
    assert ds[2]["data_source"] == "openai/gsm8k" and ds[2]["ability"] == "test"


def test_collate_fn_stacks_tensors_and_keeps_objects(tmp_path: Path, tokenizer) -> None:
    path = write_prompts(tmp_path / "p.parquet", ["a", "bb", "ccc"])
    ds = RLHFDataset(path, tokenizer, _config(max_prompt_length=32, return_raw_chat=True))
    batch = collate_fn([ds[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 32) and batch["position_ids"].dtype == torch.long
    for key in ("data_source", "reward_model", "extra_info", "raw_prompt", "raw_prompt_ids", "index"):
        assert isinstance(batch[key], np.ndarray) and batch[key].dtype == object and batch[key].shape == (3,)
    assert batch["raw_prompt"][1] == [{"role": "user", "content": "bb"}]  # a list stays one object
    assert batch["reward_model"][2]["ground_truth"] == "2"


def _indices(batch: dict) -> list[int]:
    return [int(i) for i in batch["index"]]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_loader_resume_replays_the_same_prompt_order(tmp_path: Path, tokenizer, num_workers: int) -> None:
    path = write_prompts(tmp_path / "p.parquet", [f"q{i}" for i in range(10)])
    ds = RLHFDataset(path, tokenizer, _config(max_prompt_length=32))

    def loader():
        return build_dataloader(ds, batch_size=3, shuffle=True, seed=7, num_workers=num_workers, drop_last=True)

    # 3 batches per epoch; run 3 epochs uninterrupted
    uninterrupted = loader()
    reference = [_indices(b) for _epoch in range(3) for b in uninterrupted]
    first = loader()
    consumed = [_indices(b) for b in first]  # epoch 1
    it = iter(first)
    consumed.append(_indices(next(it)))  # one batch into epoch 2, then "crash"
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [_indices(b) for b in resumed]  # remainder of epoch 2
    rest += [_indices(b) for b in resumed]  # epoch 3
    assert consumed + rest == reference[: len(consumed) + len(rest)]
    assert sorted(sum(reference[:3], [])) != sum(reference[:3], [])  # actually shuffled
    assert reference[:3] != reference[3:6]  # a new order each epoch



def test_file_written_like_verls_gsm8k_script_loads_unchanged(shared_data: Path, tmp_path: Path, tokenizer) -> None:
    """verl's examples/data_preprocess/gsm8k.py maps rows with HF datasets and calls to_parquet."""
    import json

    import datasets

    lines = (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:4]
    raw = datasets.Dataset.from_list([json.loads(line) for line in lines])
    suffix = 'Let\'s think step by step and output the final answer after "####".'

    def to_verl(example: dict, idx: int) -> dict:
        answer = example["answer"].split("####")[-1].strip().replace(",", "")
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": example["question"] + " " + suffix}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "test", "index": idx, "answer": example["answer"], "question": example["question"]},
        }

    raw.map(to_verl, with_indices=True, remove_columns=raw.column_names).to_parquet(str(tmp_path / "test.parquet"))
    ds = RLHFDataset(tmp_path / "test.parquet", tokenizer, _config(max_prompt_length=512))
    assert len(ds) == 4
    assert ds[0]["reward_model"] == {"style": "rule", "ground_truth": "18"}
    assert _valid_text(tokenizer, ds[0]).endswith(suffix + "<|im_end|>\n<|im_start|>assistant\n")


def test_loading_prompts_does_not_import_pandas(gsm8k_dir: Path) -> None:
    """``pq.read_table`` would pull in pyarrow.dataset and pandas: ~45 MB in the driver, for nothing."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from rlfoundry.data.rl_dataset import _read_parquet; "
            f"t = _read_parquet(Path({str(gsm8k_dir / 'test.parquet')!r})); "
            "print(t.num_rows, 'pandas' in sys.modules, 'pyarrow.dataset' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1319", "False", "False"]


def test_max_samples_draws_verls_rows_before_the_length_filter(tmp_path: Path, tokenizer) -> None:
    texts = [f"p{i}" + "x" * (i % 3) for i in range(10)]
    path = write_prompts(tmp_path / "p.parquet", texts)

    def kept(**kw) -> list[str]:
        ds = RLHFDataset(str(path), tokenizer, _config(apply_chat_template=False, **kw.pop("cfg", {})), **kw)
        return [_valid_text(tokenizer, ds[i]) for i in range(len(ds))]

    # shuffle (the default): numpy's draw without replacement from data.seed, as verl's RLHFDataset
    drawn = np.random.default_rng(7).choice(10, size=4, replace=False)
    assert kept(max_samples=4, cfg={"seed": 7}) == [texts[i] for i in drawn]
    assert kept(max_samples=4, cfg={"seed": 7}) != kept(max_samples=4, cfg={"seed": 8})
    assert kept(max_samples=4, cfg={"shuffle": False}) == texts[:4]
    assert kept(max_samples=-1) == kept(max_samples=10) == texts
    # drawn first, filtered after (verl's order): of the first 6 rows, those of at most 3 bytes
    assert kept(max_samples=6, cfg={"shuffle": False, "max_prompt_length": 3, "filter_overlong_prompts": True}) == \
        [t for t in texts[:6] if len(t) <= 3]
