"""How many of verl's own example and recipe command lines validate under rlfoundry, and why the rest fail.

    python scripts/verl_compat_check.py --repo /work/.mirror/volcengine+verl/repo --rev b178a3cd5 \\
        --submodule recipe=/work/.mirror/verl-project+verl-recipe/repo@21892b92 \\
        --out /tmp/verl_check/january.json --summary /tmp/verl_check/january.txt

Three stages, none of which writes into the verl checkout or this repository:

1. *Materialise* the tree at ``--rev`` (``git archive``; submodules from their own mirrors) in a
   temporary directory.
2. *Capture*: every ``*.sh`` under ``--scan`` (default ``examples recipe``) that names a verl
   module runs under bash, inside ``bwrap`` (read-only host, no network, its own copy of the tree as
   the working directory, a throwaway ``$HOME``) with shims first on ``PATH``: ``python``,
   ``python3``, ``torchrun``, ``ray job submit``, ``uv run`` … record the command line when it
   starts a ``verl.*`` / ``recipe.*`` module and exit 0; ``nvidia-smi``, ``hf``, ``pip``, ``wget``,
   ``git``, ``sleep`` … do nothing. Scripts get no arguments, so each command line carries the
   script's own defaults (a script that insists gets the fewest of ``8 $HOME/save_path`` its usage
   check accepts; one stopped by ``set -u`` on an upper-case variable gets a placeholder for it).
3. *Check*: the module name is mapped (``verl.X`` → ``rlfoundry.X``) and the command line runs as
   ``python -m rlfoundry.X ARGS --cfg job`` from the directory the script was in (relative
   ``--config-path`` values resolve as they would for the user). The module runs in this process as
   ``__main__`` (runpy: its own ``if __name__ == "__main__"`` block, so the same argument handling
   and loader as ``python -m``; ``--subprocess`` spawns one interpreter per command line instead and
   checks that claim) when it has ``--cfg job``; SFT without it through ``load_sft_config``.
   ``--cfg job`` loads, validates and prints the config; it does not open data or model paths, so
   the figure is *config validity*.

Statuses: ``clean`` (exit 0, no warning), ``ignored_keys`` (exit 0 with the "accepted but have no
effect" warning), ``warned`` (exit 0, another warning), ``rejected`` (exit != 0; ``message`` is the
error's first line, ``causes`` the kinds of every problem it lists: the unknown key, the missing config
file …), ``error`` (a traceback: a bug here, not a user mistake), ``unchecked`` (no rlfoundry dry run
exists for it). The loader stops at the first unknown key, so with ``--all-causes`` such a rejection
is re-checked without that key until it passes or fails otherwise: ``blockers`` lists every cause,
and the summary can say how many command lines each fix would unlock on its own.

The script is also its own shim (``--shim NAME``): the wrappers on the sandbox's ``PATH`` call it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RLFOUNDRY = [REPO_ROOT]  # the rlfoundry checked against: this working tree, or --rlfoundry-rev's copy
ENTRY = re.compile(r"^(verl|recipe)(\.\w+)+$")
MENTIONS_ENTRY = re.compile(r"\b(verl|recipe)\.\w+|ENTRYPOINT")
FAMILIES = (
    ("main_ppo", re.compile(r"^verl\.trainer\.main_ppo$")),
    ("one_step_off", re.compile(r"\.one_step_off_policy\.")),
    ("fully_async", re.compile(r"\.fully_async_policy\.")),
    ("sft", re.compile(r"^verl\.trainer\.(fsdp_sft_trainer|sft_trainer|sft_trainer_ray)$")),
)
NO_EFFECT = "accepted but have no effect"
SANDBOX = "/tmp/vcc"  # where a script's own directory appears inside bwrap
SANDBOX_ROOT = f"{SANDBOX}/verl"  # the tree copy: the script's working directory

# ═══════════════════════════════════════ shims (stage 2) ═══════════════════════════════════════
# Launchers forward to the python they start; tools print nothing and succeed.
PYTHONS = ("python", "python3")
LAUNCHERS = ("torchrun", "ray", "uv", "srun", "accelerate", "deepspeed", "mpirun", "sudo")
# done for real, but a missing source (a model's file) or a directory outside the sandbox (/data) does
# not stop the script
TOLERANT = ("cp", "mkdir")
NOOPS = ("nvidia-smi", "npu-smi", "rocm-smi", "huggingface-cli", "hf", "modelscope", "pip", "pip3", "wget",
         "curl", "git", "git-lfs", "sleep", "docker", "ssh", "scp", "rsync", "nvcc", "apt", "apt-get", "conda",
         "wandb", "tensorboard", "swanlab", "ifconfig", "ip", "ibstat", "ibv_devinfo")
FAKE_GPUS = 8  # what `nvidia-smi -L` and `torch.cuda.device_count()` report: one 8-GPU node
PY_VALUE_OPTS = ("-X", "-W", "-Q")
PY_FLAG_OPTS = ("-u", "-B", "-O", "-OO", "-E", "-s", "-S", "-I", "-q", "-b", "-bb", "-d", "-v")
# The launch environment of one 8-GPU node, for scripts that read their cluster's variables without a
# default (Slurm's, and the ARNOLD_* of the cluster some verl scripts were written on).
NODE_ENV = {"SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_GPUS_PER_NODE": str(FAKE_GPUS),
            "SLURM_GPUS_ON_NODE": str(FAKE_GPUS), "SLURM_CPUS_PER_TASK": "16", "ARNOLD_WORKER_GPU": str(FAKE_GPUS),
            "ARNOLD_WORKER_NUM": "1", "ARNOLD_ID": "0"}
# Scripts that insist on arguments (verl's SFT examples: <nproc_per_node> <save_path>) get these.
USAGE_ARGS = (str(FAKE_GPUS), "{home}/save_path")
MAX_RETRIES = 6
# Sourced by bash before the script (BASH_ENV): limits the sandbox may not raise, and vendor
# environment files (Ascend's set_env.sh) that are not installed here, must not stop a script.
PRELUDE = """ulimit() { builtin ulimit "$@" 2>/dev/null || true; }
source() { if [ -f "$1" ]; then builtin source "$@"; fi; }
"""
TORCHRUN_FLAGS = ("--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module")


def _record(module: str, args: Sequence[str], launcher: str, world_size: int | None) -> None:
    entry = {"module": module, "args": list(args), "cwd": os.getcwd(), "launcher": launcher,
             "world_size": world_size}
    with open(os.environ["VCC_RECORD"], "a") as f:
        f.write(json.dumps(entry) + "\n")


def _module_of_path(script: str) -> str | None:
    """``python verl/trainer/main_ppo.py`` names the module by its path in the tree."""
    root = os.environ.get("VCC_ROOT", "")
    path = os.path.realpath(script)
    if not script.endswith(".py") or not root or not path.startswith(os.path.realpath(root) + os.sep):
        return None
    module = os.path.relpath(path, os.path.realpath(root))[:-3].replace(os.sep, ".")
    return module if ENTRY.match(module) else None


def shim_python(argv: Sequence[str], launcher: str = "python", world_size: int | None = None) -> int:
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c", "-"):
        i += 2 if argv[i] in PY_VALUE_OPTS else 1
    if i >= len(argv):
        return 0
    if argv[i] == "-c":
        code = argv[i + 1] if i + 1 < len(argv) else ""
        if "device_count" in code:
            print(FAKE_GPUS)
        # the faked node is an NVIDIA one (nvidia-smi lists H100s): probes for Ascend's torch_npu
        # (`python3 -c 'import torch_npu'`, 23 of verl's August scripts) fail as they would there
        return 1 if "torch_npu" in code else 0
    module = argv[i + 1] if argv[i] == "-m" and i + 1 < len(argv) else _module_of_path(argv[i])
    rest = argv[i + 2:] if argv[i] == "-m" else argv[i + 1:]
    if module and ENTRY.match(module):
        _record(module, rest, launcher, world_size)
    return 0


def shim_torchrun(argv: Sequence[str]) -> int:
    """``torchrun [opts] -m MOD args`` / ``torchrun [opts] script.py args``; the world size is kept
    (SFT validates its batch against it)."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "--module"):
        name, eq, value = argv[i].partition("=")
        if not eq and argv[i] not in TORCHRUN_FLAGS and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        opts[name.lstrip("-").replace("-", "_")] = value
        i += 1
    world = _int(opts.get("nproc_per_node"), 1) * _int(opts.get("nnodes", "1").split(":")[-1], 1)
    if i < len(argv) and argv[i] in ("-m", "--module"):
        return shim_python(["-m", *argv[i + 1:]], "torchrun", world)
    return shim_python(argv[i:], "torchrun", world)


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def shim_launcher(name: str, argv: Sequence[str]) -> int:
    """``ray job submit … -- CMD``, ``uv run … python3 …``, ``srun … CMD``: run the command they wrap."""
    if name == "ray" and "--" in argv:
        rest = list(argv[argv.index("--") + 1:])
    else:
        starts = [i for i, a in enumerate(argv) if os.path.basename(a) in PYTHONS + ("torchrun",)]
        rest = list(argv[starts[0]:]) if starts else []
    if not rest:
        return 0
    os.execvp(rest[0] if "/" not in rest[0] else os.path.basename(rest[0]), rest)
    return 0  # not reached


def shim_noop(name: str, argv: Sequence[str]) -> int:
    if name == "nvidia-smi" and ("-L" in argv or "--list-gpus" in argv):
        print("\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})" for i in range(FAKE_GPUS)))
    elif name == "nvidia-smi" and any(a.startswith("--query-gpu") for a in argv):
        print("\n".join(str(i) for i in range(FAKE_GPUS)))
    return 0


def run_shim(name: str, argv: Sequence[str]) -> int:
    if name in PYTHONS:
        return shim_python(argv)
    if name == "torchrun":
        return shim_torchrun(argv)
    if name in LAUNCHERS:
        return shim_launcher(name, argv)
    return shim_noop(name, argv)


def write_shims(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    me = Path(__file__).resolve()
    for name in PYTHONS + LAUNCHERS + NOOPS + TOLERANT:
        if name in TOLERANT:
            body = f'{shutil.which(name, path="/usr/bin:/bin")} "$@" 2>/dev/null\nexit 0\n'
        elif name in NOOPS and name != "nvidia-smi":
            body = "exit 0\n"  # no interpreter start: most scripts call several of these
        else:
            body = f'exec {sys.executable} -I {me} --shim {name} "$@"\n'
        (directory / name).write_text("#!/bin/sh\n" + body)
        (directory / name).chmod(0o755)


# ═══════════════════════════════════ tree and capture (1, 2) ═══════════════════════════════════


@dataclasses.dataclass
class Captured:
    """One verl command line a script ran (``index``: its order within the script)."""

    path: str
    index: int
    module: str
    args: list[str]
    cwd: str  # relative to the tree's root ('.' = the root)
    launcher: str
    world_size: int | None
    given: dict[str, Any] = dataclasses.field(default_factory=dict)  # env/arguments the script needed


def materialise(repo: Path, rev: str, dest: Path, submodules: Sequence[str] = ()) -> None:
    """``git archive`` of ``rev`` into ``dest``; each ``PATH=MIRROR@REV`` fills the submodule at PATH."""
    dest.mkdir(parents=True, exist_ok=True)
    _untar(["git", "-C", str(repo), "archive", rev], dest)
    for spec in submodules:
        path, _, source = spec.partition("=")
        mirror, _, sub_rev = source.rpartition("@")
        (dest / path).mkdir(parents=True, exist_ok=True)
        _untar(["git", "-C", mirror, "archive", sub_rev], dest / path)


def _untar(archive: list[str], dest: Path) -> None:
    git = subprocess.Popen(archive, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=git.stdout, check=True)
    if git.wait() != 0:
        raise SystemExit(f"{' '.join(archive)} failed")


def protect_tree(tree: Path) -> None:
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(path.stat().st_mode & ~0o222)


def find_scripts(tree: Path, scan: Sequence[str]) -> list[str]:
    """``*.sh`` under the scanned directories that name a verl/recipe module (or an ENTRYPOINT)."""
    found = []
    for top in scan:
        for path in sorted((tree / top).rglob("*.sh")):
            if path.is_file() and MENTIONS_ENTRY.search(path.read_text(errors="replace")):
                found.append(str(path.relative_to(tree)))
    return found


def capture(tree: Path, script: str, work: Path, shims: Path, timeout: float,
            sandbox: bool) -> tuple[list[Captured], str | None]:
    """Run one script on its own copy of the tree; the command lines it started.

    First with no arguments and a one-node environment (NODE_ENV). A script that starts nothing and
    stops on ``set -u`` gets the unbound variable (a path under ``$HOME``, or a count) and runs again;
    one that still starts nothing and fails (a usage check) runs once more with USAGE_ARGS.
    """
    given: dict[str, Any] = {"env": {}, "args": []}
    for _ in range(MAX_RETRIES):
        caps, problem, stderr = _run_script(tree, script, work, shims, timeout, sandbox, given)
        # `set -u` on an unset variable, or `${VAR:?message}`: bash names the variable after the line number
        unbound = re.search(r"line \d+: ([A-Z_][A-Z0-9_]*): ", stderr)
        if caps or problem is None or problem.startswith("timed out"):
            break
        # an UPPER_CASE name is the launch environment's (a lower-case one is the script's own bug); only
        # names whose kind is plain get a value: a path, a count (never a guessed engine or model name)
        value = _placeholder(unbound.group(1), sandbox, work) if unbound else None
        if value is not None and unbound.group(1) not in given["env"]:
            given["env"][unbound.group(1)] = value
        elif len(given["args"]) < len(USAGE_ARGS):  # the fewest arguments its usage check accepts
            home = str(_inside(sandbox, work) / "home")
            given["args"] = [a.replace("{home}", home) for a in USAGE_ARGS[:len(given["args"]) + 1]]
        else:
            break
    for cap in caps:
        cap.given = {k: v for k, v in given.items() if v}
    return caps, problem


def _inside(sandbox: bool, work: Path) -> Path:
    return Path(SANDBOX) if sandbox else work


def _placeholder(name: str, sandbox: bool, work: Path) -> str | None:
    if "GPU" in name:
        return str(FAKE_GPUS)
    if re.search(r"NUM|NODES|COUNT|SIZE", name):
        return "1"
    if "RANK" in name or name.endswith("_ID"):
        return "0"
    if re.search(r"(PATH|DIR|HOME|ROOT|FILES?|DATA|CKPTS?|CHECKPOINTS?|OUTPUT)$", name):
        return str(_inside(sandbox, work) / "home" / name.lower())
    return None


def _run_script(tree: Path, script: str, work: Path, shims: Path, timeout: float, sandbox: bool,
                given: dict[str, Any]) -> tuple[list[Captured], str | None, str]:
    if work.exists():
        shutil.rmtree(work)
    (work / "home").mkdir(parents=True)
    # Hard links: a copy in milliseconds. The tree's files are read-only (protect_tree), so a script can
    # add, replace or delete files in its copy but cannot write through a link into the shared tree.
    subprocess.run(["cp", "-al", str(tree), str(work / "verl")], check=True)
    (work / "prelude.sh").write_text(PRELUDE)
    inside = _inside(sandbox, work)
    env = {**NODE_ENV, "PATH": f"{inside / 'shims'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(inside / "home"),
           "USER": "verl", "LANG": "C.UTF-8", "VCC_RECORD": str(inside / "records.jsonl"),
           "VCC_ROOT": str(inside / "verl"), "TMPDIR": str(inside / "home"), "BASH_ENV": str(inside / "prelude.sh"),
           **given["env"]}
    command = ["bash", str(inside / "verl" / script), *given["args"]]
    if sandbox:
        command = ["bwrap", "--ro-bind", "/", "/", "--tmpfs", "/tmp", *_python_under_tmp(), "--bind", str(work),
                   SANDBOX, "--ro-bind", str(shims), f"{SANDBOX}/shims", "--dev", "/dev", "--proc", "/proc",
                   "--unshare-all", "--die-with-parent", "--chdir", SANDBOX_ROOT, *command]
    else:
        (work / "shims").symlink_to(shims)
    problem, stderr = None, ""
    try:
        done = subprocess.run(command, cwd=work / "verl", env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
        stderr = done.stderr
        if done.returncode != 0:
            problem = f"exit {done.returncode}: {_last_line(stderr)}"
    except subprocess.TimeoutExpired:
        problem = f"timed out after {timeout:g} s"
    return _read_records(work / "records.jsonl", script, str(inside / "verl")), problem, stderr


def _python_under_tmp() -> list[str]:
    """bwrap arguments that keep this Python visible when it lives under /tmp (a venv made there, as CI's
    may be): the sandbox's /tmp is empty, and the shims exec this interpreter."""
    homes = {Path(sys.prefix).resolve(), Path(sys.executable).parent.resolve()}
    return [arg for home in sorted(homes) if home.is_relative_to("/tmp") for arg in ("--ro-bind", str(home), str(home))]


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("+")]
    return lines[-1][:200] if lines else ""


def _read_records(path: Path, script: str, root: str) -> list[Captured]:
    if not path.exists():
        return []
    found = []
    for index, line in enumerate(path.read_text().splitlines()):
        rec = json.loads(line)
        cwd = os.path.relpath(rec["cwd"], root) if (rec["cwd"] + "/").startswith(root + "/") else rec["cwd"]
        args = [a.replace(root, "{tree}") for a in rec["args"]]
        found.append(Captured(script, index, rec["module"], args, cwd, rec["launcher"], rec["world_size"]))
    return found


# ═══════════════════════════════════════ check (stage 3) ═══════════════════════════════════════


@dataclasses.dataclass
class Result:
    status: str
    message: str = ""  # the error's first line (of a list of problems: the first problem)
    causes: list[str] = dataclasses.field(default_factory=list)  # every problem the error lists, grouped
    warnings: list[str] = dataclasses.field(default_factory=list)
    detail: str = ""  # the whole error text
    # what the dry run printed (the in-process check: the config as the run would use it); not in the report
    stdout: str = dataclasses.field(default="", repr=False)


def family_of(module: str) -> str:
    return next((name for name, pattern in FAMILIES if pattern.search(module)), "other")


def rlfoundry_module(module: str) -> str:
    """verl's module path under rlfoundry's package: ``verl.trainer.main_ppo`` → ``rlfoundry.trainer.main_ppo``."""
    head, _, rest = module.partition(".")
    return f"rlfoundry.{rest}" if head == "verl" else f"rlfoundry.{module}"


def classify(rc: int, stderr: str, warned: Sequence[str]) -> Result:
    if rc != 0:
        text = _error_text(stderr)
        problems = [line[2:] for line in text.splitlines()[1:] if line.startswith("- ")] or [text.splitlines()[0]]
        kind = "error" if "Traceback (most recent call last)" in stderr else "rejected"
        return Result(kind, problems[0], list(dict.fromkeys(map(cause_of, problems))), list(warned), text)
    if any(NO_EFFECT in w for w in warned):
        return Result("ignored_keys", warnings=list(warned))
    return Result("warned" if warned else "clean", warnings=list(warned))


def _error_text(stderr: str) -> str:
    """rlfoundry's ``rlfoundry: Kind: message`` (with its problem list), or a traceback's last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for n, line in enumerate(lines):
        if line.startswith("rlfoundry") and ": " in line:
            rest = [x for x in lines[n + 1:] if x.startswith("- ")]
            first = re.sub(r"^\w+(Error|Exception): ", "", line.split(": ", 1)[1])
            return "\n".join([first, *rest])
    tail = [line for line in lines if not line.startswith(("(set RLFOUNDRY_DEBUG", "File ", "^"))]
    return tail[-1] if tail else "(no message)"


CAUSES = (
    (re.compile(r"Unknown config key '([^']+)'"), "unknown key {}"),
    (re.compile(r"Config key '([^']+)' \(from .*\): value .* is not valid; (expected .+?)\.?(?:\.\s|\s*$)"),
     "bad value for {}: {}"),
    (re.compile(r"class_name '([^']+)' cannot be imported"), "tool class cannot be imported: {}"),
    (re.compile(r"Config file '([^']+)' not found"), "config file not found: {}"),
    (re.compile(r"No module named '([^']+)'"), "no module {}"),
)


def cause_of(problem: str) -> str:
    """What to fix, so that rejections group: the unknown key, the missing file, else the problem's
    first clause with numbers generalised (string values stay: they name the feature)."""
    for pattern, template in CAUSES:
        match = pattern.search(problem)
        if match:
            return template.format(_generalise(match.group(1)), *match.groups()[1:])
    first = re.split(r"(?<=[.;])\s", problem, maxsplit=1)[0]
    first = re.sub(r"\s\((did you mean .*|[^()]*\)?)", "", first)  # asides and suggestions
    return re.sub(r"(?<==)-?\d[\d.e+-]*", "N", first).rstrip(".;:, ")[:160]


def _generalise(key: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".N", key)  # list indices: one cause whatever the position


@contextlib.contextmanager
def in_line_dir(cwd: Path, world_size: int | None):
    """Where a command line runs: its directory, first on ``sys.path`` as ``-m`` puts it (recipe.* classes
    import from there), with the launcher's ``WORLD_SIZE``; all restored after."""
    saved = os.getcwd(), list(sys.path), os.environ.get("WORLD_SIZE")
    sys.path.insert(0, str(cwd))
    os.environ["WORLD_SIZE"] = str(world_size or 1)
    try:
        os.chdir(cwd)
        yield
    finally:
        os.chdir(saved[0])
        sys.path[:] = saved[1]
        os.environ.pop("WORLD_SIZE") if saved[2] is None else os.environ.__setitem__("WORLD_SIZE", saved[2])


def check_in_process(module: str, argv: Sequence[str], cwd: Path, world_size: int | None) -> Result:
    """``python -m MODULE ARGS --cfg job`` without a new interpreter: the module runs as ``__main__``
    (runpy: its own ``if __name__ == "__main__"`` block, argument handling and loader), from ``cwd``
    (``in_line_dir``)."""
    import runpy

    out, err = io.StringIO(), io.StringIO()
    saved_argv = list(sys.argv)
    try:
        sys.argv = [module, *argv, "--cfg", "job"]
        with in_line_dir(cwd, world_size), warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception as e:  # a bug, not a user's mistake: the subprocess would show a traceback
                err.write(f"Traceback (most recent call last):\n{type(e).__name__}: {e}\n")
                rc = 1
    finally:
        sys.argv[:] = saved_argv
    result = classify(rc, err.getvalue(), [str(w.message) for w in caught if _ours(w.filename)])
    return dataclasses.replace(result, stdout=out.getvalue())


WARNING_LINE = re.compile(r"^(.+?):\d+: \w*Warning: (.*)$")


def _ours(filename: str) -> bool:
    """A warning rlfoundry gave about the config; not a library's at import (a fresh process imports
    megatron-core and its warnings, an in-process check only once)."""
    path = os.path.abspath(filename)  # (a stacklevel can point past rlfoundry's loader into this script)
    return path.startswith(str(RLFOUNDRY[0] / "rlfoundry") + os.sep) or path == str(Path(__file__).resolve())


def check_subprocess(module: str, argv: Sequence[str], cwd: Path, world_size: int | None, timeout: float,
                     dry_run: Sequence[str] = ("--cfg", "job")) -> Result:
    env = dict(os.environ, PYTHONPATH=str(RLFOUNDRY[0]), WORLD_SIZE=str(world_size or 1))
    try:
        done = subprocess.run([sys.executable, "-m", module, *argv, *dry_run], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Result("error", f"timed out after {timeout:g} s", ["timeout"])
    lines = (WARNING_LINE.match(line) for line in done.stderr.splitlines())
    warned = [m.group(2) for m in lines if m and _ours(m.group(1))]
    return classify(done.returncode, done.stderr, warned)


def check_sft_loader(module: str, argv: Sequence[str], world_size: int | None) -> Result:
    """SFT without a ``--cfg job`` dry run: its loader (typed defaults ← overrides, validated)."""
    import importlib

    loader = importlib.import_module(module).load_sft_config
    err = io.StringIO()
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size or 1)
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            loader(argv)
        rc = 0
    except Exception as e:  # noqa: BLE001 - ConfigError is the rejection; anything else is reported as such
        kind = "rlfoundry: ConfigError" if type(e).__name__ == "ConfigError" else "Traceback (most recent call last)"
        err.write(f"{kind}: {e}\n")
        rc = 2
    finally:
        os.environ.pop("WORLD_SIZE") if old is None else os.environ.__setitem__("WORLD_SIZE", old)
    return classify(rc, err.getvalue(), [str(w.message) for w in caught if _ours(w.filename)])


def check(cap: Captured, tree: Path, timeout: float, in_process: bool) -> Result:
    """Validate one captured command line under the matching rlfoundry module."""
    import importlib.util

    module = rlfoundry_module(cap.module)
    argv = [a.replace("{tree}", str(tree)) for a in cap.args]
    cwd = tree / cap.cwd if not os.path.isabs(cap.cwd) else tree
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return Result("rejected", f"No module named '{module}'", [f"no module {module}"])
    source = Path(spec.origin).read_text() if spec.origin else ""
    if '"cfg"' in source or "'cfg'" in source or "--cfg" in source:  # it has the dry run
        if in_process:
            return _portable(check_in_process(module, argv, cwd, cap.world_size), tree)
        return _portable(check_subprocess(module, argv, cwd, cap.world_size, timeout), tree)
    if "def load_sft_config" in source:
        return _portable(check_sft_loader(module, argv, cap.world_size), tree)
    return Result("unchecked", f"{module} has no --cfg job dry run", ["no dry run"])


def _portable(result: Result, tree: Path) -> Result:
    """The temporary tree's path written as ``{tree}``: causes group across runs and machines."""
    def fix(text: str) -> str:
        return text.replace(str(tree), "{tree}")

    return dataclasses.replace(result, message=fix(result.message), detail=fix(result.detail),
                               causes=[fix(c) for c in result.causes], warnings=[fix(w) for w in result.warnings])


def blockers(cap: Captured, tree: Path, first: Result, timeout: float, in_process: bool,
             limit: int = 12) -> list[str]:
    """Every cause, not only the first: drop the override an unknown-key rejection names and re-check."""
    causes, args, result = list(first.causes), list(cap.args), first
    for _ in range(limit):
        match = re.search(r"\(from '([^']+)'\)", result.message)
        if result.status != "rejected" or not match or match.group(1) not in args:
            break
        args.remove(match.group(1))
        result = check(dataclasses.replace(cap, args=args), tree, timeout, in_process)
        if result.status in ("rejected", "error"):
            causes += result.causes
    return list(dict.fromkeys(causes))


# ═════════════════════════════ verl's own composition (stage 3b) ═════════════════════════════

_HYDRA_MAIN = re.compile(r"@hydra\.main\(([^)]*)\)")
_HYDRA_ARG = re.compile(r"(config_path|config_name)\s*=\s*[\"']([^\"']+)[\"']")


def verl_refuses(cap: Captured, tree: Path) -> str:
    """Whether verl's own Hydra composes the command line (its config tree at the pinned commit, the module's
    ``@hydra.main`` defaults, the line's ``--config-path/--config-name`` and overrides): "" when it does, else
    Hydra's message. A line verl cannot compose fails there too, before any code of verl's runs (unknown keys
    without ``+``, missing config files or search-path packages, unparsable overrides); what verl only finds
    later (types its dataclasses check, a layout that does not divide the GPUs) is not caught here."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    source = tree / (cap.module.replace(".", "/") + ".py")
    found = _HYDRA_MAIN.search(source.read_text()) if source.is_file() else None
    if found is None:
        return ""  # not a Hydra main here: nothing to compare
    main = dict(_HYDRA_ARG.findall(found.group(1)))
    path, name, overrides = main.get("config_path"), main.get("config_name"), []
    args = [a.replace("{tree}", str(tree)) for a in cap.args]
    while args:
        arg = args.pop(0)
        flag, eq, value = arg.partition("=")
        if flag in ("--config-path", "-cp", "--config-name", "-cn"):
            value = value if eq else (args.pop(0) if args else "")
            path, name = (value, name) if flag in ("--config-path", "-cp") else (path, value)
        elif not arg.startswith("-"):
            overrides.append(arg)
    directory = Path(path or ".")
    if not directory.is_absolute():
        # Hydra: relative to the working directory when given on the command line, else to the main's file
        here = tree / cap.cwd / directory
        directory = here if (path and here.is_dir()) else source.parent / directory
    GlobalHydra.instance().clear()
    here = os.getcwd()
    try:
        os.chdir(tree / cap.cwd)  # verl's configs name search paths relative to it (file://verl/trainer/config)
        with warnings.catch_warnings(), _verl_is_the_tree(tree), \
                initialize_config_dir(config_dir=str(directory.resolve()), version_base=None):
            warnings.simplefilter("ignore")
            compose(config_name=(name or "config").removesuffix(".yaml"), overrides=overrides)
    except Exception as e:  # noqa: BLE001 - every Hydra failure is verl's refusal, reported as its message
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:300].replace(str(tree), "{tree}")
    finally:
        os.chdir(here)
        GlobalHydra.instance().clear()
    return ""


@contextlib.contextmanager
def _verl_is_the_tree(tree: Path):
    """``import verl`` answered by the tree's own package while verl's Hydra composes: its configs name search
    paths as ``pkg://verl.trainer.config``, which the in-process checks' verl-import finder (rlfoundry's answers
    to verl imports) would otherwise resolve to a package with no config files."""
    finders = list(sys.meta_path)
    ours = {k: sys.modules.pop(k) for k in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]}
    sys.meta_path[:] = [f for f in finders if type(f).__name__ != "VerlImportFinder"]
    sys.path.insert(0, str(tree))
    try:
        yield
    finally:
        sys.path.remove(str(tree))
        for k in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]:
            del sys.modules[k]
        sys.modules.update(ours)
        sys.meta_path[:] = finders


# ═══════════════════════════════════════════ report ═══════════════════════════════════════════


def run_all(tree: Path, scripts: Sequence[str], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    shims = work / "shims"
    write_shims(shims)
    sandbox = not args.no_sandbox and shutil.which("bwrap") is not None
    rows, silent = [], []
    for n, script in enumerate(scripts):
        caps, problem = capture(tree, script, work / "run", shims, args.script_timeout, sandbox)
        if not caps:
            silent.append({"path": script, "problem": problem or "started no verl module"})
        for cap in caps:
            rows.append(_row(cap, problem, tree, args))
        if args.verbose:
            print(f"[{n + 1}/{len(scripts)}] {script}: " + ", ".join(r["status"] for r in rows[len(rows) - len(caps):]),
                  file=sys.stderr, flush=True)
    shutil.rmtree(work / "run", ignore_errors=True)
    return {"scripts": rows, "no_command": silent, "sandbox": "bwrap" if sandbox else "none"}


def _row(cap: Captured, problem: str | None, tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    family = family_of(cap.module)
    checked = family != "other" or args.check_other
    result = check(cap, tree, args.check_timeout, not args.subprocess) if checked else Result("unchecked")
    row = {"path": cap.path, "index": cap.index, "family": family, "module": cap.module,
           "rlfoundry_module": rlfoundry_module(cap.module), "launcher": cap.launcher,
           "world_size": cap.world_size, "cwd": cap.cwd, "argv": cap.args, "given": cap.given,
           "script_problem": problem,
           **{k: v for k, v in dataclasses.asdict(result).items() if k != "stdout"}}
    if args.all_causes and result.status == "rejected":
        row["blockers"] = blockers(cap, tree, result, args.check_timeout, not args.subprocess)
    if args.verl_compose:
        row["verl_refuses"] = verl_refuses(cap, tree)
    return row


def summarise(report: dict[str, Any]) -> str:
    rows = report["scripts"]
    lines = [f"verl compat check: {report['repo']} @ {report['rev']}"
             + "".join(f" + {s}" for s in report["submodules"]),
             f"rlfoundry {report['rlfoundry_commit']}, {report['date']}, sandbox: {report['sandbox']}",
             f"{len({r['path'] for r in rows})} scripts started {len(rows)} verl command lines; "
             f"{len(report['no_command'])} candidate scripts started none.", ""]
    for family in [f for f, _ in FAMILIES] + ["other"]:
        lines += _family_lines(family, [r for r in rows if r["family"] == family])
    return "\n".join(lines) + "\n"


def _family_lines(family: str, rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    status = Counter(r["status"] for r in rows)
    valid = status["clean"] + status["ignored_keys"] + status["warned"]
    lines = [f"== {family}: {len(rows)} command lines ({len({r['path'] for r in rows})} scripts); "
             f"{valid} validate ({', '.join(f'{k} {v}' for k, v in sorted(status.items()))})"]
    if family == "other":
        lines += [f"   {n:4d}  {m}" for m, n in Counter(r["module"] for r in rows).most_common()]
        return lines + [""]
    lines += _verl_composes(rows, valid)
    failed = [r.get("blockers") or r["causes"] for r in rows if r["status"] in ("rejected", "error")]
    lines += _counted("rejections by first cause (what the user sees)", Counter(c[0] for c in failed))
    lines += _counted("every cause (command lines it blocks)", Counter(x for c in failed for x in c))
    lines += _counted("sole cause (command lines that one fix unlocks)", Counter(c[0] for c in failed if len(c) == 1))
    ignored = Counter(k for r in rows if r["status"] == "ignored_keys" for w in r["warnings"] if NO_EFFECT in w
                      for k in _no_effect_keys(w))
    lines += _counted("accepted with no effect (command lines)", ignored)
    return lines + [""]


def _verl_composes(rows: list[dict[str, Any]], valid: int) -> list[str]:
    """With ``--verl-compose``: the lines verl's own Hydra refuses, and the share of the others that validate."""
    if not rows or "verl_refuses" not in rows[0]:
        return []
    refused = [r for r in rows if r["verl_refuses"]]
    ours = sum(r["status"] in ("clean", "ignored_keys", "warned") for r in rows if not r["verl_refuses"])
    lines = [f"  verl's own config refuses {len(refused)} (they fail in verl before any of its code runs); of the "
             f"{len(rows) - len(refused)} it composes, {ours} validate here"
             + (f" ({ours / (len(rows) - len(refused)):.1%})" if len(rows) > len(refused) else "")]
    lines += [f"     {r['status']:>12}  {r['path']}: {r['verl_refuses'][:150]}" for r in refused]
    return lines


def _no_effect_keys(warning: str) -> list[str]:
    listed = warning.split("no effect in rlfoundry: ", 1)[-1].strip().rstrip(".")
    return [k.strip() for k in re.split(r",\s(?![^\[]*\])", listed) if k.strip()]


def _counted(title: str, counts: Counter) -> list[str]:
    if not counts:
        return []
    return [f"  {title}:"] + [f"   {n:4d}  {cause}" for cause, n in counts.most_common()]


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True)
    return done.stdout.strip()


def _rlfoundry_state(rev: str | None) -> str:
    commit = _git("-C", str(REPO_ROOT), "rev-parse", "--short", rev or "HEAD")
    if rev:
        return commit
    dirty = _git("-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no", "rlfoundry")
    return f"{commit} working tree" + (" (with uncommitted changes)" if dirty else "")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", type=Path, required=True, help="a verl git repository (a bare mirror will do)")
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--submodule", action="append", default=[], metavar="PATH=MIRROR@REV",
                   help="fill a submodule of the tree from its own mirror (repeatable)")
    p.add_argument("--rlfoundry-rev", default=None,
                   help="check against this commit of rlfoundry (default: the working tree)")
    p.add_argument("--scan", nargs="+", default=["examples", "recipe", "verl/experimental"],
                   help="directories searched for *.sh")
    p.add_argument("--only", default=None, help="regex: keep scripts whose path matches")
    p.add_argument("--out", type=Path, help="the JSON report")
    p.add_argument("--summary", type=Path, help="the printed summary, also written here")
    p.add_argument("--script-timeout", type=float, default=30.0)
    p.add_argument("--check-timeout", type=float, default=120.0)
    p.add_argument("--subprocess", action="store_true", help="check main_ppo in a subprocess too (slow)")
    p.add_argument("--all-causes", action="store_true", help="re-check without each unknown key: every blocker")
    p.add_argument("--check-other", action="store_true", help="also check modules outside the four families")
    p.add_argument("--verl-compose", action="store_true",
                   help="also compose each line with verl's own Hydra config (needs hydra-core): which lines verl "
                        "refuses too")
    p.add_argument("--no-sandbox", action="store_true", help="run scripts without bwrap (timeout only)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="verl_compat_") as tmp:
        if args.rlfoundry_rev:  # a committed state, not a working tree others are editing
            RLFOUNDRY[0] = Path(tmp) / "rlfoundry"
            materialise(REPO_ROOT, args.rlfoundry_rev, RLFOUNDRY[0])
        sys.path.insert(0, str(RLFOUNDRY[0]))  # before any rlfoundry import
        tree = Path(tmp) / "tree"
        materialise(args.repo, args.rev, tree, args.submodule)
        protect_tree(tree)
        scripts = [s for s in find_scripts(tree, args.scan) if not args.only or re.search(args.only, s)]
        report = {"repo": str(args.repo), "rev": _git("-C", str(args.repo), "rev-parse", args.rev),
                  "submodules": args.submodule, "scan": args.scan,
                  "rlfoundry_commit": _rlfoundry_state(args.rlfoundry_rev),
                  "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  **run_all(tree, scripts, Path(tmp) / "work", args)}
    print_and_write(summarise(report), report, args.out, args.summary)
    return 0


def print_and_write(text: str, report: dict[str, Any], out: Path | None, summary: Path | None) -> None:
    """The summary printed; the JSON report and the summary written where asked (scripts/verl_plan_check.py too)."""
    print(text, end="")
    for path, content in ((out, json.dumps(report, indent=1) + "\n"), (summary, text)):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--shim":
        sys.exit(run_shim(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
