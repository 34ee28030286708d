"""What every benchmark shares: the workload, per-framework subprocess runs, and reporting.

Workload. One tiny Qwen2 built from a config with a fixed seed (``rlfoundry.models.tiny``), the
project's byte-level tokenizer, prompts from the built-in arithmetic task (written once as
verl-format parquet, read in file order by every framework, so step k sees the same prompts
everywhere), and one set of GRPO settings: P prompts per step × n samples, max response length,
learning rate, one PPO epoch over one mini-batch (= one optimiser step per step), token-mean
PPO-clip loss, grad-norm clip, AdamW, constant LR, no KL, fp32 on CPU (``--device cuda``: fp32
master weights computing in bf16 on one GPU, every framework alike).

Measurement. Each framework runs in its own Python process (``python -m benchmarks.<runner>
--spec spec.json --out result.json``), so start-up cost and peak memory belong to it alone. The
runner stamps the wall clock at the start and end of every training step (``StepClock``). The
parent then reports:
  - start-up: from launching the process to the start of step 1 (imports, model load, workers);
  - wall time per step: (end of the last step − end of the warm-up steps) / measured steps. It
    excludes start-up and the first ``warmup_steps`` steps (lazy initialisation, allocator growth,
    first-call costs such as starting a reward pool), and includes everything a steady-state step
    costs, also what a framework does between steps (logging, data loading, callbacks);
  - generated tokens/s and samples/s over the same window (tokens = response tokens up to and
    including EOS, as each framework produced them);
  - peak RSS: ``ru_maxrss`` of the runner process from ``os.wait4`` (the process and any
    descendants it waited for);
  - tree PSS and tree RSS: peaks of the summed PSS (``Pss:`` of ``/proc/<pid>/smaps_rollup``) and of
    the summed RSS over the runner's whole process tree (counts reward-pool and Ray workers, which
    are not waited-for children); RSS every 0.1 s, PSS as often as ``_PSS_DUTY`` allows. PSS
    divides each shared page among the processes that map it, so the tree's PSS counts libtorch's
    pages once where summed RSS counts them once per process; tree PSS is the memory figure to compare. Where smaps_rollup cannot be
    read (not Linux) a process's RSS stands in, and the row's ``tree_pss_source`` says so. The
    parent never imports torch, transformers, numpy or pyarrow (``prepare`` runs in a child), so no
    page of a framework's libraries is shared with, and charged to, the harness (other torch
    processes on the machine would be: measure on a quiet one);
  - reward: mean score over the first and over the last quarter of the steps (at least one step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

_LOAD_AT_START = list(os.getloadavg())  # the machine's load when the benchmark began (shared machines)
REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_WORK_DIR = Path(os.environ.get("RLFOUNDRY_BENCH_DIR", "/tmp/rlfoundry-bench"))

DEVICES = ("cpu", "cuda")

# framework name -> runner module (each has ``main(argv)`` taking --spec / --out)
RUNNERS = {
    "rlfoundry": "benchmarks.rlfoundry_grpo",
    "trl": "benchmarks.trl_grpo",
    "floor": "benchmarks.floor_grpo",
}


# ───────────────────────────────────────── the workload ─────────────────────────────────────────


@dataclass(frozen=True)
class Workload:
    """Everything that defines the work one benchmark step does, identical for every framework."""

    # model: rlfoundry.models.tiny.save_tiny_model(hidden_size, num_layers, ..., seed)
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int | None = None  # None: 2 × hidden_size
    # None: the byte tokenizer's ~260 tokens; else its vocabulary padded with filler tokens to this size
    # (rlfoundry.models.tiny.build_tokenizer), e.g. Qwen2.5's 151,936, with the LM head tied or not
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    model_seed: int = 0
    model_path: str | None = None  # an existing HF directory instead of the model built from the config
    # supervised warm start of the built model on held-apart arithmetic problems (0: random weights).
    # Random weights never score, so the reward says nothing about learning; a warm-started policy
    # answers in a few tokens, so it suits the learning check (short responses), not the speed runs.
    warm_start_steps: int = 0
    # prompts: rlfoundry/arithmetic, generate_splits(seed=data_seed), used in file order
    data_seed: int = 0
    # GRPO
    prompts_per_step: int = 8
    n: int = 8
    max_prompt_length: int = 64
    max_response_length: int = 64
    lr: float = 1e-5
    weight_decay: float = 0.01
    clip_ratio: float = 0.2
    grad_clip: float = 1.0
    temperature: float = 1.0
    # run
    steps: int = 4
    warmup_steps: int = 1
    seed: int = 1
    # torch intra-op threads per framework (OMP_NUM_THREADS): the whole 2-core machine for each;
    # rlfoundry's ranks split them (2 ranks x 1 thread), TRL and the floor run 2 threads in one process
    threads: int = 2
    # rlfoundry only: worker back end and processes (trainer.worker_backend / trainer.n_gpus_per_node),
    # and any extra key=value overrides (to measure a knob, e.g. a rollout option)
    rlfoundry_backend: str = "process"
    rlfoundry_workers: int = 2
    rlfoundry_overrides: tuple[str, ...] = ()
    # "tuned": the runner adds its speed keys (benchmarks/rlfoundry_grpo.py); "verl": only the keys a
    # verl user sets for this workload, so rlfoundry's defaults decide everything else
    rlfoundry_keys: str = "tuned"
    # where every framework computes: "cpu" (fp32) or "cuda" (one GPU: fp32 master weights, bf16
    # compute: rlfoundry's FSDP2 mixed precision, TRL's bf16=True autocast)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.steps <= self.warmup_steps:
            raise ValueError(f"steps ({self.steps}) must exceed warmup_steps ({self.warmup_steps}): "
                             "nothing would be measured")
        if self.n < 2:
            raise ValueError("GRPO needs n >= 2 samples per prompt")

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.n

    @property
    def train_size(self) -> int:
        """Exactly one pass over the prompts: every framework sees the same prompts at step k."""
        return self.prompts_per_step * self.steps

    def replace(self, **changes: Any) -> "Workload":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Workload":
        data = dict(data)
        data["rlfoundry_overrides"] = tuple(data.get("rlfoundry_overrides", ()))
        data.setdefault("device", "cpu")  # result files written before the field existed
        return cls(**data)


@dataclass(frozen=True)
class Prepared:
    """Files a workload needs on disk (shared by all frameworks)."""

    model_dir: str
    train_file: str


def _model_key(w: Workload) -> str:
    key = f"qwen2-h{w.hidden_size}-l{w.num_layers}-a{w.num_heads}-kv{w.num_kv_heads}-seed{w.model_seed}"
    if w.intermediate_size:
        key += f"-i{w.intermediate_size}"
    if w.vocab_size:
        key += f"-v{w.vocab_size}"
    if w.tie_word_embeddings:
        key += "-tied"
    return key + (f"-sft{w.warm_start_steps}" if w.warm_start_steps else "")


def warm_start(model_dir: Path, steps: int, seed: int = 0, batch: int = 64, lr: float = 1e-3) -> None:
    """Teach the model the answer format (and some arithmetic) by next-token SFT, in place.

    Problems come from ``generate_problems(seed=10_000 + seed)``, a stream apart from the RL
    prompts; loss on the answer tokens and EOS only; AdamW, constant LR, seeded: reproducible.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfoundry.data.preprocess.arithmetic import generate_problems

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    problems = generate_problems(min(steps * batch, 16_384), seed=10_000 + seed)  # the task has 20k distinct
    for i in range(steps):
        chunk = [problems[(i * batch + j) % len(problems)] for j in range(batch)]
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q, _ in chunk]
        p_ids = tok(prompts, add_special_tokens=False)["input_ids"]
        a_ids = [ids + [tok.eos_token_id] for ids in tok([a for _, a in chunk], add_special_tokens=False)["input_ids"]]
        width = max(len(p) + len(a) for p, a in zip(p_ids, a_ids))
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for r, (p, a) in enumerate(zip(p_ids, a_ids)):
            ids[r, : len(p) + len(a)] = torch.tensor(p + a)
            labels[r, len(p): len(p) + len(a)] = torch.tensor(a)
            mask[r, : len(p) + len(a)] = 1
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.save_pretrained(model_dir)


def prepare(w: Workload, work_dir: Path = DEFAULT_WORK_DIR) -> Prepared:
    """``prepare_in_process`` in a child process, for the harness parent.

    Building the model imports torch and writing the parquet pyarrow; if the parent mapped them, a
    framework process would share those pages with it and PSS would charge part of them to the
    parent, making every framework's tree PSS look smaller than it is.
    """
    code = ("import dataclasses, json, sys; from pathlib import Path; "
            "from benchmarks.common import Workload, prepare_in_process; "
            "p = prepare_in_process(Workload.from_json(json.loads(sys.argv[1])), Path(sys.argv[2])); "
            "print(json.dumps(dataclasses.asdict(p)))")
    cmd = [sys.executable, "-c", code, json.dumps(w.to_json()), str(work_dir)]
    done = subprocess.run(cmd, env=_with_repo_on_path(dict(os.environ)), stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"preparing the workload failed (exit {done.returncode}; its error is above)")
    return Prepared(**json.loads(done.stdout.strip().splitlines()[-1]))


def prepare_in_process(w: Workload, work_dir: Path = DEFAULT_WORK_DIR) -> Prepared:
    """Build (or reuse) the model directory and the prompt parquet of ``w`` under ``work_dir``."""
    from rlfoundry.data.preprocess.arithmetic import generate_splits, make_row
    from rlfoundry.data.preprocess.common import write_splits

    if w.model_path:
        from rlfoundry.trainer.config import resolve_asset_path

        model_dir = Path(resolve_asset_path(w.model_path))
    else:
        model_dir = work_dir / "models" / _model_key(w)
        if not (model_dir / "config.json").is_file():
            from rlfoundry.models.tiny import save_tiny_model

            tmp = model_dir.with_name(model_dir.name + ".tmp")
            save_tiny_model(tmp, hidden_size=w.hidden_size, num_layers=w.num_layers, num_heads=w.num_heads,
                            num_kv_heads=w.num_kv_heads, intermediate_size=w.intermediate_size, seed=w.model_seed,
                            vocab_size=w.vocab_size, tie_word_embeddings=w.tie_word_embeddings)
            if w.warm_start_steps:
                warm_start(tmp, w.warm_start_steps, seed=w.model_seed)
            tmp.rename(model_dir)  # complete or absent: an interrupted build is never reused
    data_dir = work_dir / "data" / f"arithmetic-seed{w.data_seed}-{w.train_size}"
    train_file = data_dir / "train.parquet"
    if not train_file.is_file():
        splits = generate_splits(w.train_size, 16, seed=w.data_seed)
        write_splits({"train": splits["train"]}, data_dir, make_row)
    return Prepared(model_dir=str(model_dir), train_file=str(train_file))


def load_prompts(train_file: str) -> list[tuple[list[dict], str]]:
    """(chat messages, ground truth) per row of a verl-format parquet, in file order."""
    import pyarrow.parquet as pq

    rows = pq.read_table(train_file, columns=["prompt", "reward_model"]).to_pylist()
    return [(list(r["prompt"]), str(r["reward_model"]["ground_truth"])) for r in rows]


# ───────────────────────────────────── inside a runner process ─────────────────────────────────────


@dataclass
class StepClock:
    """Per-step wall-clock stamps and work counts, written by a runner as its result file."""

    framework: str
    begin: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    gen_tokens: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    reward_mean: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)  # optional per-step phase times
    # optional per-step rollout-vs-trainer mismatch: {"max", "mean"} of |log p_rollout − log p_trainer|
    # over the step's valid response tokens (the sampler's log-prob of each sampled token vs the
    # trainer's forward on the same tokens, before any update)
    logprob_diff: list[dict[str, float]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def step_begin(self) -> None:
        self.begin.append(time.time())

    def step_end(self, gen_tokens: int, samples: int, reward_mean: float, phases: dict | None = None,
                 logprob_diff: dict | None = None) -> None:
        self.end.append(time.time())
        self.gen_tokens.append(int(gen_tokens))
        self.samples.append(int(samples))
        self.reward_mean.append(float(reward_mean))
        if phases is not None:
            self.phases.append({k: float(v) for k, v in phases.items()})
        if logprob_diff is not None:
            self.logprob_diff.append({k: float(v) for k, v in logprob_diff.items()})

    def save(self, path: str | Path | None) -> None:
        """Write the JSON result, or (no path: a standalone run) print one line per step."""
        if path is not None:
            Path(path).write_text(json.dumps(dataclasses.asdict(self)), encoding="utf-8")
            return
        for i, (b, e, tok, rew) in enumerate(zip(self.begin, self.end, self.gen_tokens, self.reward_mean), 1):
            print(f"{self.framework} step {i}: {e - b:.3f} s, {tok} generated tokens, reward {rew:.3f}")


def runner_args(argv: Sequence[str] | None, description: str) -> tuple[Workload, Prepared, Path, argparse.Namespace]:
    """Parse a runner's ``--spec`` / ``--out``; pin torch's thread count to the workload's."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--spec", help="JSON with 'workload' and 'prepared' (written by run_framework); "
                   "default: the default Workload")
    p.add_argument("--out", help="where to write the StepClock JSON; default: print a summary")
    p.add_argument("--work-dir", type=Path, default=None, help="scratch directory for this run")
    args = p.parse_args(argv)
    if args.spec:
        spec = json.loads(Path(args.spec).read_text(encoding="utf-8"))
        workload, prepared = Workload.from_json(spec["workload"]), Prepared(**spec["prepared"])
    else:
        workload = Workload()
        prepared = prepare_in_process(workload)  # a standalone runner is not measured from outside
    if args.work_dir is None:
        args.work_dir = DEFAULT_WORK_DIR / "standalone"
    import torch

    torch.set_num_threads(workload.threads)
    return workload, prepared, Path(args.out) if args.out else None, args


# ───────────────────────────────────── in the parent: one run ─────────────────────────────────────


# a torch.distributed rendezvous left in this process's environment (a launcher, a test that ran ranks
# in-process) would make each framework's run try to join it: TRL's TrainingArguments initialises a
# process group when LOCAL_RANK is set. Each run is a job of its own.
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _child_env(w: Workload, framework: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    # every framework gets the same cores: rlfoundry's ranks split them (one process per rank)
    workers = w.rlfoundry_workers if framework == "rlfoundry" else 1
    threads = str(max(1, w.threads // workers))
    env.update({
        "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore", "WANDB_DISABLED": "true", "DISABLE_MLFLOW_INTEGRATION": "TRUE",
    })
    return _with_repo_on_path(env)


def _with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _pss_bytes(pid: int) -> int | None:
    """``Pss:`` of ``/proc/<pid>/smaps_rollup`` in bytes; None where the kernel does not give it."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as fh:
            for line in fh:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Reading smaps_rollup walks the process's page tables (~15 ms per resident GB here), so PSS is read
# at most this fraction of the time: every sample for small trees, every ~0.7 s for a 2.3 GB one,
# which keeps the sampler from eating into a 2-core machine's second core. RSS (statm) is ~free.
_PSS_DUTY = 0.05


class _TreeMemorySampler(threading.Thread):
    """Peaks of the summed RSS and of the summed PSS of a process and all its descendants.

    RSS is polled every ``period`` s, PSS as often as ``_PSS_DUTY`` allows. A process whose PSS
    cannot be read (not Linux, another user's process) counts its RSS instead and sets
    ``pss_fallback``, so the figure errs high, never low.
    """

    def __init__(self, pid: int, period: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.peak_rss = self.peak_pss = 0
        self.pss_fallback = False
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        next_pss = 0.0
        while not self._halt.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            self.peak_rss = max(self.peak_rss, self._rss_sum(tree))
            if time.monotonic() >= next_pss:
                started = time.monotonic()
                self.peak_pss = max(self.peak_pss, self._pss_sum(tree))
                next_pss = started + (time.monotonic() - started) / _PSS_DUTY
            self._halt.wait(self.period)

    @staticmethod
    def _rss_sum(tree: list) -> int:
        import psutil

        total = 0
        for proc in tree:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def _pss_sum(self, tree: list) -> int:
        import psutil

        total = 0
        for proc in tree:
            pss = _pss_bytes(proc.pid)
            if pss is None:  # unreadable, exited, or a zombie: an exited process counts nothing
                try:
                    rss = proc.memory_info().rss if proc.is_running() else 0
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    rss = 0
                pss, self.pss_fallback = rss, self.pss_fallback or rss > 0
            total += pss
        return total

    def stop(self) -> "_TreeMemorySampler":
        self._halt.set()
        self.join(timeout=2)
        return self

    @property
    def pss_source(self) -> str:
        return "rss (smaps_rollup unreadable)" if self.pss_fallback else "smaps_rollup"


def run_framework(framework: str, w: Workload, prepared: Prepared, run_dir: Path,
                  timeout_s: float = 3600) -> dict[str, Any]:
    """Run one framework on ``w`` in a fresh subprocess; returns the summary row (see ``summarize``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec, out, log = run_dir / "spec.json", run_dir / "result.json", run_dir / "log.txt"
    spec.write_text(json.dumps({"workload": w.to_json(), "prepared": dataclasses.asdict(prepared)}), encoding="utf-8")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", RUNNERS[framework], "--spec", str(spec), "--out", str(out), "--work-dir", str(run_dir)]
    launched = time.time()
    with open(log, "w", encoding="utf-8") as log_fh:
        proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=_child_env(w, framework), stdout=log_fh, stderr=subprocess.STDOUT)
        sampler = _TreeMemorySampler(proc.pid)
        sampler.start()
        status, rusage = _wait_with_timeout(proc, timeout_s)
        sampler.stop()
    finished = time.time()
    returncode = os.waitstatus_to_exitcode(status) if status is not None else -9
    row: dict[str, Any] = {"framework": framework, "returncode": returncode, "total_wall_s": finished - launched,
                           "peak_rss_mb": rusage.ru_maxrss / 1024 if rusage else float("nan"),
                           "peak_tree_rss_mb": sampler.peak_rss / 2**20, "peak_tree_pss_mb": sampler.peak_pss / 2**20,
                           "tree_pss_source": sampler.pss_source, "log": str(log)}
    if returncode != 0 or not out.is_file():
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        row["error"] = f"{framework} exited with {returncode}; log tail:\n{tail}"
        return row
    clock = json.loads(out.read_text(encoding="utf-8"))
    row.update(summarize(clock, w, launched))
    return row


def _wait_with_timeout(proc: subprocess.Popen, timeout_s: float):
    """``os.wait4`` the child (for its own ru_maxrss), killing it after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return status, rusage
        if time.time() > deadline:
            proc.kill()
            _, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = -9
            return None, rusage
        time.sleep(0.05)


def summarize(clock: dict[str, Any], w: Workload, launched: float) -> dict[str, Any]:
    """Steady-state figures from a runner's StepClock (see the module docstring for definitions)."""
    k = w.warmup_steps
    end, begin = clock["end"], clock["begin"]
    if len(end) != w.steps:
        raise RuntimeError(f"{clock['framework']} ran {len(end)} steps, expected {w.steps}")
    window = end[-1] - end[k - 1] if k > 0 else end[-1] - begin[0]
    measured = w.steps - k
    tokens = sum(clock["gen_tokens"][k:])
    samples = sum(clock["samples"][k:])
    q = max(1, w.steps // 4)  # reward: mean over the first / last quarter of the steps
    row = {
        "startup_s": begin[0] - launched,
        "first_step_s": end[0] - begin[0],
        "step_s": window / measured,
        "step_inner_s": statistics.median(e - b for b, e in zip(begin[k:], end[k:])),
        "gen_tokens_per_s": tokens / window,
        "samples_per_s": samples / window,
        "gen_tokens_per_step": tokens / measured,
        "reward_first": statistics.fmean(clock["reward_mean"][:q]),
        "reward_last": statistics.fmean(clock["reward_mean"][-q:]),
        "info": clock.get("info", {}),
    }
    gpu_peak = clock.get("info", {}).get("cuda_max_memory_allocated_mb")
    if gpu_peak is not None:  # --device cuda: torch's peak allocation in the runner (rank 0) process
        row["peak_gpu_mb"] = float(gpu_peak)
    row |= logprob_diff_summary(clock.get("logprob_diff") or [])
    if clock.get("phases"):
        phases = clock["phases"][k:]
        row["phases_s"] = {name: statistics.median(p.get(name, 0.0) for p in phases)
                           for name in sorted({n for p in phases for n in p})}
    return row


def logprob_diff_summary(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The run's mismatch column from per-step ``{"max", "mean"}``: the largest per-step max and the
    mean of the per-step means, over every step (a framework's first step samples from the same
    weights as its later ones; a drifting engine shows at once). Empty when the runner recorded none."""
    if not per_step:
        return {}
    return {"logprob_diff_max": max(d["max"] for d in per_step),
            "logprob_diff_mean": statistics.fmean(d["mean"] for d in per_step)}


# ───────────────────────────────────── repeats, medians, ratios ─────────────────────────────────────


def interleaved_runs(frameworks: Sequence[str], w: Workload, prepared: Prepared, repeats: int,
                     run_root: Path, label: str = "", timeout_s: float = 3600) -> dict[str, list[dict]]:
    """Run every framework ``repeats`` times, rotating the order each round (drift hits all alike)."""
    rows: dict[str, list[dict]] = {f: [] for f in frameworks}
    for r in range(repeats):
        order = list(frameworks[r % len(frameworks):]) + list(frameworks[: r % len(frameworks)])
        for fw in order:
            tag = f"{label} " if label else ""
            print(f"[bench] {tag}repeat {r + 1}/{repeats}: {fw} ...", flush=True)
            row = run_framework(fw, w, prepared, run_root / f"{label or 'run'}-{fw}-r{r}", timeout_s)
            row["repeat"] = r
            if "error" in row:
                print(f"[bench] {row['error']}", file=sys.stderr, flush=True)
            else:
                print(f"[bench]   {fw}: {row['step_s']:.3f} s/step, {row['gen_tokens_per_s']:.0f} tok/s, "
                      f"{row['samples_per_s']:.1f} samples/s, peak {row['peak_rss_mb']:.0f} MB, "
                      f"tree PSS {row['peak_tree_pss_mb']:.0f} MB (RSS {row['peak_tree_rss_mb']:.0f})", flush=True)
            rows[fw].append(row)
    return rows


MEDIAN_KEYS = ("step_s", "step_inner_s", "startup_s", "gen_tokens_per_s", "samples_per_s", "gen_tokens_per_step",
               "peak_rss_mb", "peak_tree_rss_mb", "peak_tree_pss_mb", "reward_first", "reward_last")
# present only in some runs: --device cuda; the mismatch column (runners that can see both log-probs)
OPTIONAL_MEDIAN_KEYS = ("peak_gpu_mb", "logprob_diff_max", "logprob_diff_mean")


def median_row(runs: list[dict]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"ok_runs": 0, "error": runs[0].get("error") if runs else "no runs"}
    out: dict[str, Any] = {"ok_runs": len(ok)}
    for key in MEDIAN_KEYS:
        out[key] = statistics.median(r[key] for r in ok)
    for key in OPTIONAL_MEDIAN_KEYS:
        if all(key in r for r in ok):
            out[key] = statistics.median(r[key] for r in ok)
    out["tree_pss_source"] = ", ".join(sorted({r.get("tree_pss_source", "smaps_rollup") for r in ok}))
    phase_names = sorted({n for r in ok for n in r.get("phases_s", {})})
    if phase_names:
        out["phases_s"] = {n: statistics.median(r.get("phases_s", {}).get(n, 0.0) for r in ok) for n in phase_names}
    return out


def paired_ratios(num: list[dict], den: list[dict], key: str = "samples_per_s") -> dict[str, float]:
    """num/den of ``key`` per repeat (same round = same machine state), and their median/min/max."""
    pairs = [a[key] / b[key] for a, b in zip(num, den) if "error" not in a and "error" not in b and b[key]]
    if not pairs:
        return {}
    return {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs), "per_repeat": pairs}


# ───────────────────────────────────────── reporting ─────────────────────────────────────────


def environment() -> dict[str, Any]:
    """Machine, versions, load and revision: what a reader needs to trust (or redo) the figures."""
    # versions from the package metadata: importing torch here would map it into the harness parent
    env: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(), "torch": _version("torch"), "transformers": _version("transformers"),
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "cpu_model": _cpu_model(),
        "load_avg_1_5_15_at_start": _LOAD_AT_START, "load_avg_1_5_15_at_end": list(os.getloadavg()), "command": " ".join(["python", "-m", *_module_argv()]),
    }
    env["trl"] = _version("trl")
    env["git"] = _git_revision()
    return env


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _module_argv() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return [spec.name if spec else sys.argv[0], *sys.argv[1:]]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# The mismatch column beside the speed (``logprob_diff_summary``): a faster engine that drifts further
# from the trainer shows it. '-' where a framework has no separate sampler log-probs to compare.
MISMATCH_COLUMNS = [("|dlogp| max", "logprob_diff_max", ".2e"), ("|dlogp| mean", "logprob_diff_mean", ".2e")]


def format_table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Plain-text table. ``columns``: (header, key, format spec such as '.3f'); missing values print '-'."""
    rows = list(rows)
    cells = [[h for h, _, _ in columns]]
    for row in rows:
        line = []
        for _, key, fmt in columns:
            value = row.get(key)
            line.append("-" if value is None else (format(value, fmt) if fmt else str(value)))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = []
    for j, line in enumerate(cells):
        out.append("  ".join(c.rjust(wd) if i else c.ljust(wd) for i, (c, wd) in enumerate(zip(line, widths))))
        if j == 0:
            out.append("  ".join("-" * wd for wd in widths))
    return "\n".join(out)


def save_results(name: str, payload: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``<results_dir>/<name>.json`` (with the environment block added) and return its path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    data = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


# Layer shapes of real models (the byte tokenizer keeps the vocabulary small, so these are the layers' cost);
# "-vocab": the whole shape, with the real vocabulary (filler tokens beyond the bytes) and the tied LM head,
# where the log-softmax over 151,936 tokens, not the layers, decides the update's memory and time
SHAPES = {
    "qwen2.5-0.5b": {"hidden_size": 896, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864},
    "qwen2.5-0.5b-vocab": {"hidden_size": 896, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864,
                           "vocab_size": 151936, "tie_word_embeddings": True},
}


def add_workload_args(p: argparse.ArgumentParser, defaults: Workload = Workload()) -> None:
    """Command-line flags shared by the benchmark scripts (each maps to a ``Workload`` field)."""
    p.add_argument("--steps", type=int, default=defaults.steps, help="training steps per run (incl. warm-up)")
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help="steps excluded from timing")
    p.add_argument("--repeats", type=int, default=3, help="runs per framework (alternated; medians reported)")
    p.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    p.add_argument("--n", type=int, default=defaults.n, help="samples per prompt")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    p.add_argument("--num-layers", type=int, default=defaults.num_layers)
    p.add_argument("--num-heads", type=int, default=defaults.num_heads)
    p.add_argument("--num-kv-heads", type=int, default=defaults.num_kv_heads)
    p.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size, help="default: 2 × hidden")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a named layer shape (sets hidden/heads/intermediate size, and with -vocab the vocabulary; "
                        "--num-layers still applies)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="pad the byte tokenizer's vocabulary to this many tokens (default: ~260)")
    p.add_argument("--warm-start-steps", type=int, default=defaults.warm_start_steps,
                   help="SFT steps on arithmetic before RL (0: random weights); for the learning check")
    p.add_argument("--model-path", default=None, help="an HF model directory (or rlfoundry://name) instead of "
                   "the random tiny model built from the config")
    p.add_argument("--threads", type=int, default=defaults.threads, help="torch threads per framework process")
    p.add_argument("--device", choices=DEVICES, default=defaults.device,
                   help="cpu: fp32; cuda: one GPU, fp32 master weights computing in bf16 (rlfoundry and TRL; "
                        "the floor runs on the CPU only)")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="models, data and run directories")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a single run is killed")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--rlfoundry-backend", default=defaults.rlfoundry_backend, choices=["local", "process", "ray"],
                   help="rlfoundry's trainer.worker_backend")
    p.add_argument("--rlfoundry-workers", type=int, default=defaults.rlfoundry_workers,
                   help="rlfoundry ranks (trainer.n_gpus_per_node); they share --threads between them")
    p.add_argument("--rlfoundry-keys", choices=["tuned", "verl"], default=defaults.rlfoundry_keys,
                   help="tuned: the runner's speed keys; verl: only verl's keys, rlfoundry's defaults for the rest")
    p.add_argument("--rlfoundry-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for the rlfoundry run (repeatable), e.g. to measure a knob")


def workload_from_args(a: argparse.Namespace, **changes: Any) -> Workload:
    shape = SHAPES[a.shape] if getattr(a, "shape", None) else {
        "hidden_size": a.hidden_size, "num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads,
        "intermediate_size": a.intermediate_size}
    if getattr(a, "vocab_size", None):
        shape = {**shape, "vocab_size": a.vocab_size}
    return Workload(steps=a.steps, warmup_steps=a.warmup_steps, prompts_per_step=a.prompts_per_step, n=a.n,
                    lr=a.lr, **shape, num_layers=a.num_layers, model_path=a.model_path,
                    warm_start_steps=a.warm_start_steps,
                    threads=a.threads, rlfoundry_backend=a.rlfoundry_backend, rlfoundry_workers=a.rlfoundry_workers,
                    rlfoundry_overrides=tuple(a.rlfoundry_override),
                    rlfoundry_keys=a.rlfoundry_keys, device=getattr(a, "device", "cpu")).replace(**changes)
