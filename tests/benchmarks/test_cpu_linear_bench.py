"""The CPU linear-kernel benchmark times both libraries on the model's shapes and checks they agree."""

from __future__ import annotations

import json

import pytest

from benchmarks import cpu_linear as bench
from rlfoundry.cpu.linear import onednn_available


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_reports_every_layer_and_product_and_both_libraries_agree(tmp_path):
    out = bench.main(["--rows", "600", "--repeats", "2", "--results-dir", str(tmp_path)])
    layers = [r["layer"] for r in out["rows"]]
    assert layers == ["q_proj/o_proj", "k_proj/v_proj", "gate_proj/up_proj", "down_proj", "lm_head"]
    assert [(r["in"], r["out"]) for r in out["rows"]] == [(128, 128), (128, 64), (128, 256), (256, 128), (128, 260)]
    for r in out["rows"]:
        for product in ("fwd", "dx", "dW"):
            assert r[f"{product}_max_rel_diff"] < 1e-5  # the same fp32 products, rounded differently at most
            assert r[f"{product}_speedup"] == pytest.approx(r[f"{product}_aten_us"] / r[f"{product}_onednn_us"])
        assert r["layer_speedup"] == pytest.approx(r["layer_aten_us"] / r["layer_rlfoundry_us"])
    saved = json.loads((tmp_path / "cpu_linear.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(out["rows"])) and saved["benchmark"] == "cpu_linear"
