"""Soak: the default job (``rlfoundry train``) for many steps, SIGKILLed every K steps and resumed
with ``trainer.resume_mode=auto``, sampling the run's resources all along (not part of CI).

    python scripts/soak.py --steps 500 --kill-every 50 --out soak.json     # issue 39's soak
    python scripts/soak.py --steps 100 --kill-every 25 --out soak.json     # the short one (docs/async.md)
    python scripts/soak.py ... -- --config-name fully_async_ppo_trainer    # any overlay / overrides after --

Each attempt is ``python -m rlfoundry train`` in a process group of its own. Once ``metrics.jsonl`` has
the kill step's record (the next step is then under way) the whole group gets SIGKILL — a preempted
node, not a polite stop. Every ~0.5 s the script samples the run's process tree: resident memory
(RSS summed over the driver and its descendants), open file descriptors (summed likewise) and the
number of descendant processes. After each kill it checks that no process of the group survived,
that ``latest_checkpointed_iteration.txt`` names a step whose files all match their recorded
SHA-256 (``checkpoint.layout.verify_step_dir``), and at the end that every retained complete step is
intact and ``metrics.jsonl`` has exactly one record for each step 1..N.

Growth is judged per segment (one attempt): the peak RSS / fds / processes of each, and, inside each,
the RSS at its first sample after step 5 against its last. A leak that outlives a kill (files,
shared memory, processes) shows as a rising baseline from segment to segment; one inside a run as a
rising last-vs-first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlfoundry.checkpoint import layout as ckpt  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def sample(pid: int) -> dict[str, float]:
    tree = _tree(pid)
    return {"rss_mb": sum(_rss_bytes(p) for p in tree) / 2**20, "fds": sum(_fds(p) for p in tree),
            "procs": len(tree) - 1}


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields[2]: pgrp; a zombie is already dead
            alive.append(int(stat.parent.name))
    return alive


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass  # a line cut short by the kill
    return max(steps)


def check_pointer(run_dir: Path) -> int | None:
    """The ``latest`` pointer's step, verified file by file (raises on any damage)."""
    pointer = run_dir / "latest_checkpointed_iteration.txt"
    if not pointer.exists():
        return None
    step = int(pointer.read_text())
    ckpt.verify_step_dir(run_dir / f"global_step_{step}")
    return step


def run_segment(cmd: list[str], env: dict, run_dir: Path, kill_at: int | None, log: Path, hang_s: float) -> dict:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    samples, start_step, deadline = [], last_step(run_dir), time.monotonic() + hang_s
    killed = False
    while proc.poll() is None:
        step, now = last_step(run_dir), sample(proc.pid)
        if now["rss_mb"] > 0:  # 0: the process ended between poll() and the sample
            samples.append({"step": step, **now})
        if kill_at is not None and step >= kill_at:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise TimeoutError(f"segment made no end within {hang_s} s (step {step}); see {log}")
        time.sleep(0.5)
    proc.wait()
    time.sleep(1.0)  # the group's other processes see their pipes close
    survivors = _group_alive(proc.pid)
    if survivors:
        raise AssertionError(f"processes {survivors} of the killed run outlived it")
    if not killed and proc.returncode != 0:
        raise RuntimeError(f"run exited {proc.returncode}; see {log}")
    steady = [s for s in samples if s["step"] >= start_step + 5] or samples
    resumed = re.search(r"resumed from \S*global_step_(\d+)", log.read_text())
    return {"resumed_from": int(resumed.group(1)) if resumed else None, "to_step": last_step(run_dir),
            "killed": killed, "returncode": proc.returncode,
            "pointer_step": check_pointer(run_dir), "samples": len(samples),
            "rss_mb_peak": max(s["rss_mb"] for s in samples), "fds_peak": max(s["fds"] for s in samples),
            "procs_peak": max(s["procs"] for s in samples),
            "rss_mb_first_steady": steady[0]["rss_mb"], "rss_mb_last": steady[-1]["rss_mb"],
            "fds_first_steady": steady[0]["fds"], "fds_last": steady[-1]["fds"],
            "rss_mb_by_step": _peak_by_step(samples, "rss_mb")}


def _peak_by_step(samples: list[dict], key: str) -> dict[int, float]:
    """The highest value sampled while each step was the last one recorded (the series to plot)."""
    out: dict[int, float] = {}
    for s in samples:
        out[s["step"]] = round(max(out.get(s["step"], 0.0), s[key]), 1)
    return out


def final_checks(run_dir: Path, steps: int) -> dict:
    records = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    records = records[1:] if records[:1] == [0] else records  # step 0: the validation before training
    assert records == list(range(1, steps + 1)), f"metrics.jsonl steps {records[:5]}... not 1..{steps} once each"
    retained = sorted(run_dir.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    intact = []
    for step_dir in retained:
        if ckpt.is_complete_step_dir(step_dir):  # older steps beyond max_actor_ckpt_to_keep lose their shards
            ckpt.verify_step_dir(step_dir)
            intact.append(step_dir.name)
    assert check_pointer(run_dir) == steps
    debris = [str(p) for p in run_dir.rglob(f"*{ckpt.TMP_SUFFIX}")]
    assert not debris, debris
    return {"steps_recorded": len(records), "complete_checkpoints_verified": intact, "step_dirs": len(retained)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--kill-every", type=int, default=50)
    parser.add_argument("--save-freq", type=int, default=10)
    parser.add_argument("--keep", type=int, default=3, help="trainer.max_actor_ckpt_to_keep")
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/rlfoundry_soak"))
    parser.add_argument("--out", type=Path, default=None, help="JSON of the figures")
    parser.add_argument("--hang-s", type=float, default=1800, help="a segment longer than this is a hang")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    if args.run_dir.exists():
        raise SystemExit(f"{args.run_dir} exists: pass a fresh --run-dir")
    cmd = [sys.executable, "-m", "rlfoundry", "train", *extra, f"trainer.total_training_steps={args.steps}",
           f"trainer.save_freq={args.save_freq}", f"trainer.max_actor_ckpt_to_keep={args.keep}",
           f"trainer.default_local_dir={args.run_dir}", "trainer.resume_mode=auto", "trainer.logger=file"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    segments, start = [], time.time()
    for n, kill_at in enumerate([*range(args.kill_every, args.steps, args.kill_every), None]):
        seg = run_segment(cmd, env, args.run_dir, kill_at, args.run_dir.parent / f"{args.run_dir.name}_log{n}.txt",
                          args.hang_s)
        segments.append(seg)
        print(json.dumps({k: v for k, v in seg.items() if k != "rss_mb_by_step"}), flush=True)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="minutes"), "machine":
              f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
              "command": " ".join(sys.argv), "wall_s": round(time.time() - start, 1), "segments": segments,
              "final": final_checks(args.run_dir, args.steps)}
    print(json.dumps(report["final"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
