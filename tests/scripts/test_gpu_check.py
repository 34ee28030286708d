"""scripts/gpu_check.sh's dry run: the GPU check's own commands on the CPU at tiny sizes, so the script
cannot rot between the sessions that have a GPU. Every part must run and pass, and the summary must
carry each part's figures: the tier collected every ``gpu`` test (all skipped here, no CUDA), the
calculator demo logged validation and tool calls, the benchmark measured both frameworks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# alone (scripts/test.sh's serial pass): the dry run holds each part to the time limit gpu_check.sh gives it
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _dry_run(out: Path, work: Path, **env: str) -> subprocess.CompletedProcess:
    rendezvous = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    environ = {k: v for k, v in os.environ.items() if k not in rendezvous}  # left by in-process ranks of other tests
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, cwd=REPO,
                          env={**environ, "PYTHON": sys.executable, "WORK": str(work), "OMP_NUM_THREADS": "1", **env},
                          timeout=600)


def _gpu_tests() -> set[str]:
    names = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        text = path.read_text()
        if re.search(r"^pytestmark = .*pytest\.mark\.gpu", text, re.M):
            names |= set(re.findall(r"^def (test_\w+)", text, re.M))
        names |= set(re.findall(r"^@pytest\.mark\.gpu\n(?:@.*\n)*def (test_\w+)", text, re.M))
    return names


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    return _dry_run(out, work), out


def test_every_part_passes_and_the_summary_says_so(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    lines = (out / "summary.txt").read_text().splitlines()
    verdicts = {line.split()[0]: line for line in lines if re.match(r"^(env|tier|demo|bench)\s+(PASS|FAIL)", line)}
    assert sorted(verdicts) == ["bench", "demo", "env", "tier"]
    assert all(" PASS in " in line for line in verdicts.values()), verdicts
    assert re.search(r"tier\s+PASS .*: 0 passed, 0 failed, \d+ skipped", verdicts["tier"])
    assert re.search(r"demo\s+PASS .*validation [\d.]+ \(step 0\) -> [\d.]+ \(step 1\), tool calls per trajectory "
                     r"[\d.]+ -> [\d.]+", verdicts["demo"])
    assert re.search(r"bench\s+PASS .*1 layers, 4 tokens: samples/s rlfoundry [\d.]+, trl [\d.]+, "
                     r"rlfoundry/TRL [\d.]+x", verdicts["bench"])
    assert any(line.startswith("RESULT PASS: 4/4 parts passed on cpu") for line in lines)


def test_the_tier_collects_every_gpu_test(dry_run):
    _, out = dry_run
    tier = json.loads((out / "summary.json").read_text())["parts"]["tier"]["figures"]
    skipped = {name.split("::")[1].split("[")[0] for name in tier["skipped_tests"]}
    expected = _gpu_tests()
    assert len(expected) >= 14 and expected <= skipped, expected - skipped


def test_what_comes_back_fits_the_device_tool(dry_run):
    """At most 8 files, named in letters, digits, '.', '_' and '-' (/work/.library/device/README.md)."""
    _, out = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert {"summary.txt", "summary.json", "realistic_cpu.json", "extras.tar.gz"} <= set(files)


def test_a_part_over_its_limit_fails_the_check(tmp_path):
    proc = _dry_run(tmp_path / "out", tmp_path / "work", GPU_CHECK_PARTS="tier", T_TIER="1")
    assert proc.returncode == 1
    summary = (tmp_path / "out" / "summary.txt").read_text()
    # no JUnit report from a killed pytest: the verbose log says how far it got
    assert re.search(r"^tier\s+FAIL \(timed out after 1s \(0 passed, 0 failed before\)\)", summary, re.M), summary
    assert "RESULT FAIL: 0/1 parts passed" in summary


def test_the_large_part_reports_each_run_beside_the_plan(tmp_path):
    """Not a default part (a GPU run of its own): named, it runs both tiny runs and the report reads their JSON."""
    proc = _dry_run(tmp_path / "out", tmp_path / "work", GPU_CHECK_PARTS="large")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    run = r"{} [\d.]+ s/step \([\d.]+x plan\), [\d,]+ tok/s, MFU update [\d.]+%, peak [\d.]+ GiB vs plan [\d.]+ \([\d.]+x\)"
    assert re.search(r"^large\s+PASS .*: " + run.format("tiny:lora") + "; " + run.format("tiny:full-offload"),
                     summary, re.M), summary
    figures = json.loads((tmp_path / "out" / "summary.json").read_text())["parts"]["large"]["figures"]
    assert [r["run"] for r in figures["runs"]] == ["tiny:lora", "tiny:full-offload"]
    assert all(r["plan_peak_bytes"] > 0 and "ru_maxrss" in r["memory_source"] for r in figures["runs"])
