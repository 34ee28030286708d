"""Imports flow one way: protocol/algos/utils/config <- models/data/rewards/single_controller/checkpoint/cpu
<- engines <- workers <- trainer/cli, with no cycles, and the PPO driver imports no worker internals.

Every ``import``/``from ... import`` of an rlfoundry module counts, also those inside functions
(a lazy import is still a dependency). The test reads the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "rlfoundry"

LAYERS = {
    "protocol": 0, "utils": 0, "algos": 0, "config": 0, "sandbox": 0,
    "models": 1, "data": 1, "rewards": 1, "single_controller": 1, "tools": 1, "interactions": 1,
    "agents": 1,  # the packaged demo agents (OpenAI-API clients); they use the tools' evaluators
    "checkpoint": 1,  # below the engines, which save through it; it names engine exporters, never imports them
    "cpu": 1,  # the CPU kernels: conversions the engines, workers and trainer apply; they pass in what a kernel needs
    "engines": 2,
    "workers": 3,
    "trainer": 4, "experimental": 4, "cli": 4,  # experimental: verl's async entry modules
    "recipe": 4,  # verl's recipe entry modules (recipe.dapo.main_dapo), as experimental
    "__main__": 4, "__init__": 4,
    "scripts": 4,  # command-line tools (python -m rlfoundry.scripts.<name>), as cli
    "model_merger": 4,  # verl's model merger command line, on the exporters (as cli's export)
    "plan": 1,  # a function of the resolved config and a config.json; the trainer runs it as its start-up check
    "plan_cli": 4,  # `rlfoundry plan`: composes the trainer's config from train's arguments, then plans it
}
# A low package's ``python -m`` module whose command line lives above it: ``rlfoundry plan`` takes train's
# arguments, so its command line (plan_cli) composes the trainer's config and sits with cli. The entry point is
# as cli and thin: it imports its command line and nothing else, and nothing imports it.
THIN_ENTRY_POINTS = {"rlfoundry.plan.__main__": "rlfoundry.plan_cli"}
# The worker classes the driver builds its groups from: its only way into rlfoundry.workers.
WORKER_ENTRY_POINTS = {"rlfoundry.workers.actor_rollout_ref", "rlfoundry.workers.fsdp_workers", "rlfoundry.workers.critic", "rlfoundry.workers.reward_model",
                       # partial rollout's multi-turn runs the agent loops in the driver, where a sync may come
                       "rlfoundry.workers.rollout.agent_loop"}
# SFT runs its model in-process (no worker groups): it is a role on the engine, like the workers.
IN_PROCESS_TRAINERS = {"rlfoundry.trainer.sft_trainer"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """rlfoundry modules ``path`` imports (relative imports resolved); ``from pkg import name``
    counts as ``pkg.name`` when that is a module, else ``pkg``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rlfoundry"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.startswith("rlfoundry"):
                out.update(_as_module(f"{base}.{a.name}") or base for a in node.names)
    return out


def _as_module(name: str) -> str | None:
    rel = Path(*name.split(".")[1:])
    return name if (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file() else None


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p, _module_name(p)) for p in ROOT.rglob("*.py")}


def _layer(module: str) -> int:
    if module in THIN_ENTRY_POINTS:
        return LAYERS["cli"]
    top = module.split(".")[1] if "." in module else "__init__"
    return LAYERS[top]


def test_every_package_has_a_layer():
    tops = {p.name.removesuffix(".py") for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert tops <= set(LAYERS), f"give these packages a layer in LAYERS: {sorted(tops - set(LAYERS))}"


def test_imports_only_go_down_the_layers():
    wrong = sorted(f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
                   for m, deps in _graph().items() for d in deps
                   if _layer(d) > _layer(m) and not _same_package(m, d))
    assert not wrong, "\n".join(wrong)


def _same_package(a: str, b: str) -> bool:
    return a.split(".")[:2] == b.split(".")[:2]


def test_thin_entry_points_only_hand_over_to_their_command_line():
    graph = _graph()
    wrong = sorted(f"{m} imports {d}: a thin entry point imports its command line {cli} only"
                   for m, cli in THIN_ENTRY_POINTS.items() for d in graph[m] if d != cli)
    wrong += sorted(f"{m} imports the entry point {d}" for m, deps in graph.items() for d in deps if d in THIN_ENTRY_POINTS)
    assert not wrong, "\n".join(wrong)


def test_the_planner_imports_nothing_of_the_trainer():
    """The trainer runs the planner as its start-up check on the config it resolved; composing a config from a
    command line is the trainer's, so it happens in the command line (plan_cli), never under rlfoundry.plan."""
    wrong = sorted(f"{m} imports {d}" for m, deps in _graph().items() if m.split(".")[:2] == ["rlfoundry", "plan"]
                   for d in deps if d.split(".")[:2] == ["rlfoundry", "trainer"])
    assert not wrong, "\n".join(wrong)


def test_the_ppo_driver_imports_no_worker_internals():
    driver = {m: deps for m, deps in _graph().items()
              if (m.startswith("rlfoundry.trainer") or m == "rlfoundry.cli") and m not in IN_PROCESS_TRAINERS}
    wrong = sorted(f"{m} imports {d}" for m, deps in driver.items() for d in deps
                   if (d.startswith("rlfoundry.workers") and d not in WORKER_ENTRY_POINTS)
                   or d.startswith("rlfoundry.engines"))
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_between_modules():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == node or dep not in graph:
                continue
            if state.get(dep) == 1:
                return [*path, node, dep]
            if dep not in state and (cycle := visit(dep, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [])):
            pytest.fail("import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):]))
