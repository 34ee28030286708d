"""The plan against a real run's measured peak on the CPU (tests/plan/calibrate.py says what is measured
and why against a 64-wide baseline). docs/plan.md, "Calibration on the CPU", has the full table, with
the configurations that are not yet within 15 % and why."""

from __future__ import annotations

import pytest

from tests.plan.calibrate import CASES, baseline, calibrate

pytestmark = pytest.mark.slow  # two real training runs in fresh processes (about a minute on 2 shared cores)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    work = tmp_path_factory.mktemp("calibrate")
    return work, baseline(work)


@pytest.mark.parametrize("name", ["lora"])
def test_planned_peak_within_15_percent_of_measured(base, name):
    work, figures = base
    row = calibrate(CASES[name], figures, work)
    # the adapter run's state: fp32 base weights (400 MB at 100M parameters), the adapters' gradients
    # and moments, one micro-batch's activations; measured above the baseline run's own peak
    assert row["measured"] > 2**28, row  # the state dominates the measurement (over 256 MiB)
    assert abs(row["error"]) <= 0.15, row
