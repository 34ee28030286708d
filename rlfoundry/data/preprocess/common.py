"""Input discovery, record reading and parquet writing shared by the preprocessing tasks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

SPLITS = ("train", "test")
_SUFFIXES = (".jsonl", ".json", ".parquet")


class PreprocessError(RuntimeError):
    """Preprocessing cannot go on; ``__main__`` prints the message and exits non-zero."""


def read_records(path: Path, error: type[Exception] = None) -> list[dict]:
    """Rows of a jsonl file, a JSON list, or a parquet file; a bad jsonl line raises ``error``
    (``PreprocessError`` by default) naming the file and line."""
    error = error or PreprocessError
    if path.suffix == ".parquet":
        with pq.ParquetFile(path) as parquet:  # read_table would import pyarrow.dataset and pandas
            return parquet.read().to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise error(f"{path}, line {n}: not valid JSON ({err}); expected one object per line") from err
    return rows


def _split_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in SPLITS if name.startswith(s) or f"_{s}" in name or f"-{s}" in name), None)


def find_split_files(input_path: Path, split: str | None = None) -> dict[str, list[Path]]:
    """``{split: [files]}`` for a single file (split from ``--split`` or its name) or a directory.

    A directory may hold ``train.jsonl``/``test.jsonl`` (the public GSM8K layout) or the HF parquet
    layout (``main/train-00000-of-00001.parquet``); shards of one split are read in name order.
    """
    if not input_path.exists():
        raise PreprocessError(f"--input {input_path} does not exist")
    if input_path.is_file():
        chosen = split or _split_of(input_path)
        if chosen is None:
            raise PreprocessError(f"cannot tell the split of {input_path} from its name; pass --split train|test")
        return {chosen: [input_path]}
    files = sorted(p for p in input_path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES)
    found: dict[str, list[Path]] = {}
    for path in files:
        if (s := _split_of(path)) is not None and (split is None or s == split):
            found.setdefault(s, []).append(path)
    if not found:
        raise PreprocessError(
            f"no train/test files (*.jsonl, *.json, *.parquet named train*/test*) under {input_path}; "
            f"found {[str(p) for p in files[:10]]}"
        )
    return found


def read_split_records(input_path: Path, split: str | None = None) -> dict[str, list[dict]]:
    return {s: [r for p in paths for r in read_records(p)] for s, paths in find_split_files(input_path, split).items()}


def require_keys(record: dict, keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise PreprocessError(f"{where}: missing {missing}; the row has keys {sorted(record)}")


def load_hub_dataset(name: str, config_name: str | None = None) -> dict[str, list[dict]]:
    """``datasets.load_dataset(name)`` as ``{split: rows}``; a clear error when offline."""
    try:
        import datasets

        loaded = datasets.load_dataset(name, config_name)
    except Exception as err:  # no network, no cache, hub errors: all mean "give us the file"
        raise PreprocessError(
            f"could not load {name!r} from the Hugging Face hub ({type(err).__name__}: {str(err)[:300]}). "
            "Download the data set yourself and pass it with --input FILE_OR_DIR"
        ) from err
    return {split: list(ds) for split, ds in loaded.items()}


def input_records(args: Any, hub_name: str, hub_config: str | None = None,
                  hub_splits: tuple[str, ...] | None = None) -> dict[str, list[dict]]:
    """``{split: rows}`` of ``--input`` (a file is the split ``--split`` names), else of the hub data set
    ``hub_name`` (only ``hub_splits`` of it, when given)."""
    if args.input:
        return read_split_records(Path(args.input), args.split)
    loaded = load_hub_dataset(hub_name, hub_config)
    return loaded if hub_splits is None else {s: rows for s, rows in loaded.items() if s in hub_splits}


def write_splits(
    records: dict[str, list[dict]], output: Path, make_row: Callable[[dict, str, int], dict]
) -> dict[str, Path]:
    """Convert each split's records with ``make_row(record, split, index)`` and write ``<split>.parquet``."""
    output.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, rows in records.items():
        table = pa.Table.from_pylist([make_row(r, split, i) for i, r in enumerate(rows)])
        path = output / f"{split}.parquet"
        pq.write_table(table, path)
        written[split] = path
    return written


def verl_row(data_source: str, content: str, ability: str, ground_truth: str, extra_info: dict[str, Any]) -> dict:
    """One row in verl's prompt format."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }
