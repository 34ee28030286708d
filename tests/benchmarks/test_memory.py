"""The benchmark's memory figures: tree PSS counts a process tree's pages once, tree RSS does not.

Known cases: a grandchild that holds 200 MB of anonymous memory must show in the tree PSS; two
processes that map the same 100 MB file must each be charged half of it (summed RSS charges it
twice); and the harness parent must map none of the frameworks' libraries, or PSS would charge
part of a framework's pages to the harness.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.common import _TreeMemorySampler, median_row

MB = 2**20

# A launcher that starts ``workers`` copies of itself in worker mode and prints "ready" once every
# worker holds its memory: "anon:<MB>" (touched bytearray), "file:<path>" (mmap, every page read)
# or "none". Everything then sleeps until killed.
TREE = textwrap.dedent('''
    import mmap, subprocess, sys, time

    def hold(what):
        kind, _, arg = what.partition(":")
        if kind == "anon":
            return bytearray(b"\\x01") * (int(arg) << 20)  # repetition writes every byte: resident
        if kind == "file":
            with open(arg, "rb") as fh:
                view = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            sum(view[i] for i in range(0, len(view), mmap.PAGESIZE))  # fault in every page
            return view
        return None

    what, workers = sys.argv[1], int(sys.argv[2])
    if workers == 0:
        held = hold(what)
    else:
        kids = [subprocess.Popen([sys.executable, __file__, what, "0"], stdout=subprocess.PIPE)
                for _ in range(workers)]
        for kid in kids:
            kid.stdout.readline()
    print("ready", flush=True)
    time.sleep(60)
''')


def _sample_tree(tmp_path: Path, what: str, workers: int) -> _TreeMemorySampler:
    """Start a launcher tree, sample it until every worker holds its memory (plus a few samples)."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    root = subprocess.Popen([sys.executable, str(script), what, str(workers)], stdout=subprocess.PIPE)
    try:
        assert root.stdout.readline().strip() == b"ready"
        sampler = _TreeMemorySampler(root.pid, period=0.05)
        sampler.start()
        time.sleep(0.3)
        return sampler.stop()
    finally:
        import psutil

        for proc in psutil.Process(root.pid).children(recursive=True):
            proc.kill()
        root.kill()
        root.wait()


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file(), reason="PSS needs Linux smaps_rollup")
def test_tree_pss_counts_a_grandchilds_anonymous_memory(tmp_path: Path) -> None:
    sampler = _sample_tree(tmp_path, "anon:200", workers=1)
    assert not sampler.pss_fallback and sampler.pss_source == "smaps_rollup"
    assert sampler.peak_pss >= 200 * MB
    assert sampler.peak_rss >= 200 * MB


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file(), reason="PSS needs Linux smaps_rollup")
def test_tree_pss_splits_a_shared_file_mapping(tmp_path: Path) -> None:
    shared = tmp_path / "shared.bin"
    shared.write_bytes(b"\x02" * (100 * MB))
    base = _sample_tree(tmp_path, "none", workers=2)  # the same tree without the mapping
    mapped = _sample_tree(tmp_path, f"file:{shared}", workers=2)
    rss_of_mapping = mapped.peak_rss - base.peak_rss
    pss_of_mapping = mapped.peak_pss - base.peak_pss
    assert rss_of_mapping >= 180 * MB  # summed RSS: each of the two workers is charged the whole file
    assert 80 * MB <= pss_of_mapping < 0.75 * rss_of_mapping  # PSS: the file once, half to each


def test_unreadable_pss_falls_back_to_rss_and_says_so(monkeypatch) -> None:
    monkeypatch.setattr(common, "_pss_bytes", lambda pid: None)  # as on a system without smaps_rollup
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        sampler = _TreeMemorySampler(proc.pid, period=0.05)
        sampler.start()
        time.sleep(0.2)
        sampler.stop()
    finally:
        proc.kill()
        proc.wait()
    assert sampler.pss_fallback and sampler.pss_source.startswith("rss")
    assert sampler.peak_pss == sampler.peak_rss > 0


def test_median_row_carries_tree_pss_and_its_source() -> None:
    def run(pss: float, source: str = "smaps_rollup") -> dict:
        keys = dict.fromkeys(common.MEDIAN_KEYS, 1.0)
        return {**keys, "peak_tree_pss_mb": pss, "tree_pss_source": source}

    row = median_row([run(300.0), run(500.0), run(400.0)])
    assert row["peak_tree_pss_mb"] == 400.0 and row["tree_pss_source"] == "smaps_rollup"
    mixed = median_row([run(1.0), run(2.0, "rss (smaps_rollup unreadable)")])
    assert mixed["tree_pss_source"] == "rss (smaps_rollup unreadable), smaps_rollup"


def test_harness_parent_maps_no_framework_library(tmp_path: Path) -> None:
    """The benchmark scripts and ``prepare`` (which builds a torch model) leave the parent torch-free."""
    check = textwrap.dedent(f'''
        import sys
        import benchmarks.phases, benchmarks.scaling, benchmarks.vs_trl
        from benchmarks.common import Workload, prepare
        w = Workload(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, steps=2)
        prepared = prepare(w, __import__("pathlib").Path({str(tmp_path)!r}))
        assert __import__("pathlib").Path(prepared.model_dir, "config.json").is_file(), prepared
        assert __import__("pathlib").Path(prepared.train_file).is_file(), prepared
        heavy = {{"torch", "transformers", "numpy", "pyarrow", "tensordict"}} & set(sys.modules)
        maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
        mapped = {{lib for lib in ("torch", "transformers", "numpy", "pyarrow") if "/" + lib + "/" in maps}}
        print("HEAVY", sorted(heavy), sorted(mapped))
    ''')
    done = subprocess.run([sys.executable, "-c", check], cwd=common.REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "HEAVY [] []" in done.stdout, done.stdout
