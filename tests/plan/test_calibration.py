"""The plan against a real run's measured peak on the CPU (tests/plan/calibrate.py says what is measured
and why against a 64-wide baseline). docs/plan.md, "Calibration on the CPU", has the full table, with
what is not calibrated yet."""

from __future__ import annotations

import pytest

from tests.plan.calibrate import CASES, baseline, calibrate

pytestmark = pytest.mark.slow  # two real training runs in fresh processes (about a minute on 2 shared cores)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    work = tmp_path_factory.mktemp("calibrate")
    return work, baseline(work)


# CI time: LoRA's case is heavy (its plan is 12.8 % over the measured peak: docs/plan.md); dense and MoE run
@pytest.mark.parametrize("name", ["dense", pytest.param("lora", marks=pytest.mark.heavy), "moe"])
def test_planned_peak_within_15_percent_of_measured(base, name):
    work, figures = base
    row = calibrate(CASES[name], figures, work)
    # the state above the baseline run's own peak: full fine-tuning 16 bytes/param at fp32 (1.6 GB at
    # 100M parameters), LoRA the frozen fp32 base (0.4 GB) and the adapters' states, MoE its experts'
    assert row["measured"] > 2**28, row  # the state dominates the measurement (over 256 MiB)
    assert abs(row["error"]) <= 0.15, row
