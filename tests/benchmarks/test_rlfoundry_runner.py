"""The benchmark's rlfoundry runner still runs the trainer it times (it wraps ``train_step``, so a
change of that method's signature once broke every benchmark without any test noticing)."""

from __future__ import annotations

import pytest

from benchmarks.common import Workload, prepare, run_framework

pytestmark = pytest.mark.slow


def test_the_runner_times_every_step_of_a_tiny_workload(tmp_path):
    w = Workload(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, prompts_per_step=2, n=2,
                 max_response_length=4, steps=3, rlfoundry_workers=1, rlfoundry_backend="local", threads=1)
    row = run_framework("rlfoundry", w, prepare(w, tmp_path / "work"), tmp_path / "run", timeout_s=600)
    assert "error" not in row, row.get("error")
    assert row["returncode"] == 0 and row["samples_per_s"] > 0


def test_the_workload_device_reaches_the_trainer_and_old_result_files_read_as_cpu(tmp_path):
    from types import SimpleNamespace

    from benchmarks.rlfoundry_grpo import verl_keys

    prepared = SimpleNamespace(train_file=tmp_path / "t.parquet", model_dir=tmp_path / "m")
    assert "trainer.device=cuda" in verl_keys(Workload(device="cuda"), prepared, tmp_path, rows=4)
    assert "trainer.device=cpu" in verl_keys(Workload(), prepared, tmp_path, rows=4)
    assert Workload.from_json({"steps": 3}).device == "cpu"  # written before the field existed
    with pytest.raises(ValueError, match="device must be one of"):
        Workload(device="tpu")
