"""Does ``rlfoundry plan`` answer for every one of verl's RL command lines? A planning pass over a
report of ``scripts/verl_compat_check.py``:

    python scripts/verl_plan_check.py january.json --repo /work/.mirror/volcengine+verl/repo --rev b178a3cd5 \\
        --submodule recipe=/work/.mirror/verl-project+verl-recipe/repo@21892b92 --out january_plan.json

The verl tree is materialised as the harness does (its ``materialise``, imported), and every command
line of the families main_ppo, one_step_off and fully_async that validated there (status clean,
ignored_keys or warned) is planned in this process, from the directory the script ran in, with the
same arguments: ``rlfoundry plan --json --no-fixes --gpu GPU`` under the rlfoundry module's own
default ``--config-name`` and ``async_training.mode`` (its ``ENTRY``, as ``main_ppo.run`` applies
them). The model paths the planner opens (``actor_rollout_ref.model.path``, ``critic.model.path``)
point at config-only directories: the named model's config.json where its figures are known
(``tests/plan/configs.py``), else Qwen2.5-7B's as a stand-in, and each line's row says which.

Outcomes: ``fits`` / ``does_not_fit`` (exit 0 / 1, matching the plan's verdict), ``refused_by_trainer``
(exit 2 with the message the trainer's own ``--cfg job`` gives for the same arguments) and ``crashed``:
a traceback, an exit status that disagrees with the verdict, or a refusal the trainer does not make.
A crash is a planner bug.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import io
import json
import re
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # rlfoundry and tests.plan.configs from this checkout

from tests.plan import configs  # noqa: E402
from tests.scripts import load_compat_harness  # noqa: E402 - the harness's materialise, protect_tree

PLANNED = ("main_ppo", "one_step_off", "fully_async")  # the RL entries; SFT is not a run to plan
VALIDATED = ("clean", "ignored_keys", "warned")
MODEL_KEYS = ("actor_rollout_ref.model.path", "critic.model.path")  # what build.py opens
# Stand-ins for a model whose figures are not here, each one the trainer accepts for the line's layout
# (it checks the layout against config.json): a dense 7B; Qwen3-8B where a Ulysses size does not divide
# the 7B's 28 heads (Qwen3-8B: 32 heads, 8 KV heads); a MoE model for a line that sets up experts
# (expert parallelism or moe_* settings are refused on a dense model).
STAND_IN, SP_STAND_IN, MOE_STAND_IN = "Qwen2.5-7B", "Qwen3-8B", "Qwen3-30B-A3B"
MOE_LINE = re.compile(r"(expert_model_parallel_size=(?!1$)\d+|override_transformer_config\.moe_)")
ULYSSES = re.compile(r"ulysses_sequence_parallel_size=(\d+)$")
# A model's name as the line spells it (the path's last part, lower case, without the suffixes a
# post-trained checkpoint adds to its base's name) → its config.json figures. Only names whose
# architecture is known exactly; every other model is planned with the stand-in.
KNOWN = {"qwen2.5-0.5b": configs.QWEN25_05B, "qwen2.5-1.5b": configs.QWEN25_15B, "qwen2.5-3b": configs.QWEN25_3B,
         "qwen2.5-7b": configs.QWEN25_7B, "qwen2.5-math-7b": configs.QWEN25_7B, "qwen2-7b": configs.QWEN25_7B,
         "qwen2.5-14b": configs.QWEN25_14B, "qwen2.5-32b": configs.QWEN25_32B, "qwen2.5-72b": configs.QWEN25_72B,
         "qwen2-72b": configs.QWEN25_72B, "qwen3-0.6b": configs.QWEN3_06B, "qwen3-4b": configs.QWEN3_4B,
         "qwen3-8b": configs.QWEN3_8B, "qwen3-32b": configs.QWEN3_32B, "qwen3-30b-a3b": configs.QWEN3_30B_A3B,
         "qwen3-235b-a22b": configs.QWEN3_235B_A22B, "deepseek-v3": configs.DEEPSEEK_V3,
         "deepseek-llm-7b": configs.DEEPSEEK_LLM_7B}
SUFFIXES = re.compile(r"-(instruct-2507|instruct|base|chat)$")


# ═══════════════════════════════════════ models ═══════════════════════════════════════


def model_name(path: str | None) -> str | None:
    """The KNOWN name a model path designates, or None (a stand-in is planned)."""
    if not path:
        return None
    name = SUFFIXES.sub("", path.rstrip("/").rsplit("/", 1)[-1].lower())
    return name if name in KNOWN else None


def write_models(directory: Path) -> dict[str, str]:
    """One config-only directory per KNOWN name and per stand-in: name → path."""
    dirs = {name: configs.write_config(directory / name, cfg) for name, cfg in KNOWN.items()}
    dirs[STAND_IN] = configs.write_config(directory / f"stand-in-{STAND_IN}", configs.QWEN25_7B)
    dirs[SP_STAND_IN] = configs.write_config(directory / f"stand-in-{SP_STAND_IN}", configs.QWEN3_8B)
    dirs[MOE_STAND_IN] = configs.write_config(directory / f"stand-in-{MOE_STAND_IN}", configs.QWEN3_30B_A3B)
    return dirs


def stand_in_for(argv: Sequence[str]) -> str:
    if any(MOE_LINE.search(a) for a in argv):
        return MOE_STAND_IN
    sizes = [int(m.group(1)) for m in map(ULYSSES.search, argv) if m]
    return SP_STAND_IN if any(configs.QWEN25_7B["num_attention_heads"] % n for n in sizes if n) else STAND_IN


def with_models(argv: Sequence[str], dirs: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    """The line with each model path the planner opens pointed at a config-only directory (the
    policy's added when the line leaves it to a config file), and, per key, the model the line
    named and the one planned (``stand-in NAME`` where its figures are not known here)."""
    stand_in = stand_in_for(argv)
    out, models = [], {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") in MODEL_KEYS:
            planned = model_name(value) or stand_in
            models[key.lstrip("+")] = {"named": value, "planned": planned if planned in KNOWN else f"stand-in {planned}"}
            arg = f"{key}={dirs[planned]}"
        out.append(arg)
    if MODEL_KEYS[0] not in models:
        models[MODEL_KEYS[0]] = {"named": None, "planned": f"stand-in {stand_in}"}
        out.append(f"{MODEL_KEYS[0]}={dirs[stand_in]}")
    return out, models


# ═══════════════════════════════════════ planning ═══════════════════════════════════════


def call(fn: Callable[[], int]) -> tuple[int | None, str, str, str]:
    """``fn()``'s exit status, stdout and stderr, and the traceback of any exception it raised
    (status None then): a planner that raises is a crash, not a refusal."""
    out, err, tb = io.StringIO(), io.StringIO(), ""
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        warnings.simplefilter("ignore")  # the harness's report already holds the config's warnings
        try:
            code = fn()
        except SystemExit as e:  # argparse's own refusal
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        except Exception:  # noqa: BLE001 - a bug in the planner: recorded, the pass goes on
            code, tb = None, traceback.format_exc()
    return code, out.getvalue(), err.getvalue(), tb


def plan_line(row: dict[str, Any], tree: Path, dirs: dict[str, str], gpu: str, fixes: bool = False) -> dict[str, Any]:
    """One validated command line planned; its outcome with the verdict or the reason."""
    from rlfoundry.plan_cli import main as plan_main

    argv, models = with_models(row["argv"], dirs)  # the report's names ({tree}, not this run's copy)
    argv = [a.replace("{tree}", str(tree)) for a in argv]
    module, cwd = row["rlfoundry_module"], tree / row["cwd"]
    flags = ["--json", "--gpu", gpu, "--entry", module, *([] if fixes else ["--no-fixes"])]
    with _harness().in_line_dir(cwd, row.get("world_size")):
        code, out, err, tb = call(lambda: plan_main([*flags, *argv]))
    result = judge(code, out, err, tb, lambda: trainer_refusal(module, argv, cwd, row.get("world_size")))
    stand_in = any(m["planned"].startswith("stand-in") for m in models.values())
    return {k: row[k] for k in ("path", "index", "family", "rlfoundry_module", "cwd")} | {
        "models": models, "stand_in": stand_in, "exit": code, **{k: _portable(v, tree) for k, v in result.items()}}


def trainer_refusal(module: str, argv: Sequence[str], cwd: Path, world_size: int | None) -> list[str]:
    """The error lines of ``python -m MODULE ARGS --cfg job`` as the harness checks it (the module's own
    ``__main__``), stripped; [] when the trainer accepts the line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _harness().check_in_process(module, argv, cwd, world_size)
    return _lines(result.detail) if result.status in ("rejected", "error") else []


@functools.cache
def _harness():
    return load_compat_harness()


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def judge(code: int | None, out: str, err: str, tb: str, trainer: Callable[[], list[str]]) -> dict[str, Any]:
    if tb:
        return {"outcome": "crashed", "error": _where(tb)}
    if code == 2:
        message = err.strip().split(": ", 1)[-1]
        refusal = trainer()
        if message and all(line in refusal for line in _lines(message)):
            return {"outcome": "refused_by_trainer", "message": _first_problem(message)}
        trainer_says = f"refuses it otherwise: {refusal[0][:150]}" if refusal else "accepts the line"
        return {"outcome": "crashed", "error": f"exit 2 ({message.strip()[:200]}); the trainer {trainer_says}"}
    try:
        plan = json.loads(out)
    except json.JSONDecodeError:
        return {"outcome": "crashed", "error": f"exit {code} without a JSON plan: {(err or out).strip()[:300]}"}
    wrong = _inconsistent(code, plan)
    if wrong:
        return {"outcome": "crashed", "error": wrong}
    return {"outcome": "fits" if plan["fits"] else "does_not_fit", "verdict": plan["verdict"],
            "worst": plan["worst"], "capacity_bytes": plan["capacity_bytes"], "problems": plan["problems"],
            "params_total": plan["model"]["params_total"], "layout": plan["layout"]}


def _inconsistent(code: int | None, plan: dict[str, Any]) -> str:
    """Why a printed plan contradicts itself or its exit status ('' when it does not)."""
    if code != (0 if plan["fits"] else 1):
        return f"exit {code} with fits={plan['fits']}"
    phases = [p for pool in plan["pools"] for p in pool["phases"]]
    if not phases or plan["worst"]["bytes"] != max(p["bytes"] for p in phases):
        return "the worst phase is not the largest"
    if any(p["bytes"] != sum(p["device"].values()) for p in phases):
        return "a phase's total is not the sum of its items"
    return ""


def _first_problem(message: str) -> str:
    """``N config problem(s):`` lists its problems on the lines below: the first of them."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    listed = [line[2:] for line in lines[1:] if line.startswith("- ")]
    return (listed[0] if listed else lines[0])[:300]


def _where(tb: str) -> str:
    """A traceback's last line and the innermost rlfoundry frame: what to fix, and where."""
    frames = re.findall(r'File "([^"]*rlfoundry/[^"]+)", line (\d+), in (\w+)', tb)
    place = f" ({Path(frames[-1][0]).relative_to(REPO_ROOT)}:{frames[-1][1]} in {frames[-1][2]})" if frames else ""
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "(no message)")[:300] + place


def _portable(value: Any, tree: Path) -> Any:
    return value.replace(str(tree), "{tree}") if isinstance(value, str) else value


# ═══════════════════════════════════════ report ═══════════════════════════════════════


def plan_report(report: dict[str, Any], tree: Path, gpu: str, work: Path, fixes: bool = False) -> list[dict[str, Any]]:
    dirs = write_models(work / "models")
    rows = [r for r in report["scripts"] if r["family"] in PLANNED and r["status"] in VALIDATED]
    return [plan_line(row, tree, dirs, gpu, fixes) for row in rows]


def summarise(result: dict[str, Any]) -> str:
    rows = result["lines"]
    lines = [f"verl plan check: {result['repo']} @ {result['rev']}" + "".join(f" + {s}" for s in result["submodules"]),
             f"rlfoundry {result['rlfoundry_commit']}, {result['date']}, --gpu {result['gpu']}; "
             f"{len(rows)} validated command lines of {', '.join(PLANNED)} from {result['report']}", ""]
    for family in PLANNED:
        lines += _family_lines(family, [r for r in rows if r["family"] == family])
    crashed = [r for r in rows if r["outcome"] == "crashed"]
    lines += [f"crashed ({len(crashed)}):"] + [f"  {r['path']}[{r['index']}]: {r['error']}" for r in crashed]
    refused = Counter(r["message"] for r in rows if r["outcome"] == "refused_by_trainer")
    lines += ["refused by the trainer too:"] + [f"  {n:4d}  {m}" for m, n in refused.most_common()]
    return "\n".join(lines) + "\n"


def _family_lines(family: str, rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    n = Counter(r["outcome"] for r in rows)
    named = [r for r in rows if not r["stand_in"] and r["outcome"] in ("fits", "does_not_fit")]
    phases = Counter(r["worst"]["phase"] for r in rows if r["outcome"] == "does_not_fit")
    return [f"== {family}: {len(rows)} lines; answered {n['fits'] + n['does_not_fit']} (fits {n['fits']}, "
            f"does not fit {n['does_not_fit']}), refused by the trainer {n['refused_by_trainer']}, "
            f"crashed {n['crashed']}",
            f"  planned with a stand-in model ({STAND_IN}; {SP_STAND_IN} or {MOE_STAND_IN} where the line's "
            f"layout needs one): "
            f"{sum(r['stand_in'] for r in rows)} lines; of the "
            f"{len(named)} answered with the named model's own figures, {sum(r['outcome'] == 'fits' for r in named)} fit",
            "  does not fit, peak phase: " + (", ".join(f"{p} {c}" for p, c in phases.most_common()) or "-"), ""]


def _same_rev(repo: Path, rev: str, report: dict[str, Any]) -> None:
    """The command lines' paths and working directories are the report's tree's: plan in that tree."""
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", rev], capture_output=True, text=True)
    if done.returncode or done.stdout.strip() != report["rev"]:
        raise SystemExit(f"--repo {repo} --rev {rev} is not the tree the report was made from ({report['rev']}); "
                         "give the report's --repo and --rev")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path, help="a JSON report of scripts/verl_compat_check.py")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--repo", type=Path, help="the verl git repository the report was made from")
    where.add_argument("--tree", type=Path, help="an already materialised verl tree (read only)")
    p.add_argument("--rev", default="HEAD")
    p.add_argument("--submodule", action="append", default=[], metavar="PATH=MIRROR@REV")
    p.add_argument("--gpu", default="h100-80g")
    p.add_argument("--fixes", action="store_true", help="also search for changes that fit (slower; plan's default)")
    p.add_argument("--out", type=Path, help="the JSON result")
    p.add_argument("--summary", type=Path, help="the printed summary, also written here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = json.loads(args.report.read_text())
    with tempfile.TemporaryDirectory(prefix="verl_plan_") as tmp:
        tree = args.tree
        if tree is None:
            _same_rev(args.repo, args.rev, report)
            harness = _harness()
            tree = Path(tmp) / "tree"
            harness.materialise(args.repo, args.rev, tree, args.submodule)
            harness.protect_tree(tree)
        result = {"report": str(args.report), "repo": str(args.repo or args.tree), "rev": report.get("rev", args.rev),
                  "submodules": args.submodule, "gpu": args.gpu, "rlfoundry_commit": _harness()._rlfoundry_state(None),
                  "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "lines": plan_report(report, tree.resolve(), args.gpu, Path(tmp), args.fixes)}
    _harness().print_and_write(summarise(result), result, args.out, args.summary)
    return 1 if any(r["outcome"] == "crashed" for r in result["lines"]) else 0


if __name__ == "__main__":
    sys.exit(main())
