"""Real GSM8K / MATH-500 files preprocessed once per session, and a writer for small parquet files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfoundry.data.preprocess.__main__ import main as preprocess_main


@pytest.fixture(scope="session")
def gsm8k_dir(shared_data: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gsm8k")
    assert preprocess_main(["gsm8k", "--input", str(shared_data / "gsm8k"), "--output", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def math500_dir(shared_data: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("math500")
    assert preprocess_main(["math", "--input", str(shared_data / "math500"), "--output", str(out)]) == 0
    return out


def write_prompts(path: Path, contents: list, data_source: str = "rlfoundry/arithmetic") -> Path:
    """A verl-format parquet file with one user message per row (``contents`` used as given)."""
    rows = [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": c}] if isinstance(c, str) else c,
            "ability": "test",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"split": "test", "index": i},
        }
        for i, c in enumerate(contents)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
