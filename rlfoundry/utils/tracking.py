"""Experiment tracking: one ``Tracking`` object fans each step's metrics out to the chosen back ends.

Back ends (``trainer.logger``, a name or a list of names, as in verl):

- ``console``      one compact line per step with the headline numbers, and a tqdm progress bar
                   with ETA over ``total_training_steps``
- ``file``         ``<run_dir>/metrics.jsonl``: one JSON object per step, flushed every step. Always
                   on (``always_file=True``) so every run leaves a record ``rlfoundry report`` can plot
- ``tensorboard``  ``torch.utils.tensorboard.SummaryWriter`` in ``<run_dir>/tensorboard``
                   (or ``$TENSORBOARD_DIR``, verl's variable)
- ``wandb``        optional dependency; ``WANDB_MODE=offline`` works without network
- ``mlflow``       optional dependency (``mlflow-skinny`` is enough): a run in the tracking store
                   ``$MLFLOW_TRACKING_URI`` (verl's variable), by default the local directory
                   ``<run_dir>/mlruns`` (``mlflow ui --backend-store-uri <run_dir>/mlruns`` shows it)

Validation samples (``trainer.log_val_generations``, verl's generations table) go to the same back
ends through ``log_generations(samples, step)``: ``console`` prints them under the step's line,
``file`` appends them to ``<run_dir>/val_generations.jsonl`` (one line per sample: step, input,
output, score), ``tensorboard`` adds them as the text ``val/generations``, ``wandb`` as the table
``val/generations`` (one row per validation, as verl's) and ``mlflow`` as the artifact
``val_step<N>.json`` (verl's ``log_table`` file).

Resuming: pass ``resume_step=N`` (the global step of the checkpoint the run continues from). Records
after step N, written by the interrupted run after its last checkpoint, are dropped, so the file keeps
exactly one record per completed step; TensorBoard purges the same steps.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Tracking", "SUPPORTED_BACKENDS", "read_metrics_jsonl", "METRICS_FILE", "GENERATIONS_FILE", "missing_packages"]

SUPPORTED_BACKENDS = ("console", "file", "tensorboard", "wandb", "mlflow")
# verl back ends a user's script may name; they get a specific message rather than "unknown".
VERL_ONLY_BACKENDS = ("swanlab", "vemlp_wandb", "clearml", "trackio")
MLFLOW_INSTALL = "pip install mlflow-skinny  (or pip install 'rlfoundry[mlflow]')"


def missing_packages(names: list[str]) -> list[str]:
    """For the start-up checks: each back end among ``names`` whose optional package is not installed
    (mlflow), with how to install it."""
    import importlib.util

    if "mlflow" in names and importlib.util.find_spec("mlflow") is None:
        return [f"trainer.logger includes 'mlflow', which is not installed: {MLFLOW_INSTALL}"]
    return []
METRICS_FILE = "metrics.jsonl"
GENERATIONS_FILE = "val_generations.jsonl"  # trainer.log_val_generations, file back end

Scalar = int | float | str
Sample = tuple[str, str, float]  # one validation generation: (input, output, score), verl's order


# --------------------------------------------------------------------------- value cleaning

def _scalar(value: Any) -> Scalar | None:
    """A plain Python scalar for ``value`` (0-d/1-element tensors and numpy scalars unwrapped); None
    when the value is not a single number, bool or string (a whole tensor, a list, an object)."""
    if hasattr(value, "numel") and hasattr(value, "item"):  # torch.Tensor
        return _scalar(value.item()) if value.numel() == 1 else None
    if hasattr(value, "size") and hasattr(value, "item") and getattr(value, "size", 0) == 1:  # numpy
        return _scalar(value.item())
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    return None


def _json_value(value: Scalar) -> Scalar:
    """JSON has no NaN/Infinity; write them as the strings "nan"/"inf"/"-inf" (valid JSON that
    ``float()`` reads back), so a diverging loss stays visible in the record instead of vanishing."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _config_dict(config: Any) -> dict:
    """A JSON-able dict from an OmegaConf node, a dataclass or a mapping."""
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config) if isinstance(config, Mapping) else {"config": str(config)}


def read_metrics_jsonl(path: str | Path) -> list[dict]:
    """Records of a ``metrics.jsonl``, one per step in step order (later lines for a step win).

    The non-finite strings written by the file back end are turned back into floats. A truncated
    last line (a crash mid-write) is skipped rather than failing the whole read.
    """
    by_step: dict[int, dict] = {}
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}:{i + 1} is not valid JSON: {line[:80]!r}") from None
        record = {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in record.items()}
        by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


# --------------------------------------------------------------------------- back ends

class _FileBackend:
    """``metrics.jsonl`` with exactly one record per step.

    Appending is the common case; a second ``log`` for the step just written (e.g. validation after
    the training metrics) is merged into that record, and the file is rewritten atomically.
    """

    def __init__(self, run_dir: Path, resume_step: int | None, config: dict) -> None:
        self.path = run_dir / METRICS_FILE
        self.generations = _GenerationsFile(run_dir / GENERATIONS_FILE, resume_step)
        self.records = self._initial_records(resume_step)
        self._rewrite()
        if config:
            (run_dir / "run_config.json").write_text(json.dumps(config, indent=2, default=str), encoding="utf-8")
        self._fh = self.path.open("a", encoding="utf-8")

    def _initial_records(self, resume_step: int | None) -> list[dict]:
        if not self.path.exists():
            return []
        if resume_step is None:
            # A fresh run in a used directory: keep the old record beside it instead of mixing runs.
            self.path.replace(self.path.with_suffix(".jsonl.bak"))
            print(f"[tracking] previous {self.path.name} moved to {self.path.name}.bak (fresh run)", file=sys.stderr)
            return []
        return [r for r in read_metrics_jsonl(self.path) if r["step"] <= resume_step]

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records), encoding="utf-8")
        tmp.replace(self.path)  # atomic: a crash leaves the old or the new file, never half of one

    def log(self, data: Mapping[str, Scalar], step: int) -> None:
        record = {"step": step, **{k: _json_value(v) for k, v in data.items() if k != "step"}}
        last = self.records[-1]["step"] if self.records else None
        if last is None or step > last:
            self.records.append(record)
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
            return
        if step < last:
            warnings.warn(f"[tracking] step {step} logged after step {last}; dropping records after step {step}")
            self.records = [r for r in self.records if r["step"] < step] + [{"step": step}]
        self.records[-1].update(record)
        self._fh.close()
        self._rewrite()
        self._fh = self.path.open("a", encoding="utf-8")

    def log_generations(self, samples: list[Sample], step: int) -> None:
        self.generations.log(samples, step)

    def finish(self) -> None:
        self._fh.close()


class _GenerationsFile:
    """``val_generations.jsonl``: one line per logged validation sample, kept like ``metrics.jsonl``
    (a fresh run sets an old file aside; a resumed one drops the lines after its checkpoint's step)."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        if not path.exists():
            return
        if resume_step is None:
            path.replace(path.with_suffix(".jsonl.bak"))
            return
        kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                if line.strip() and _step_of(line) is not None and _step_of(line) <= resume_step]
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def log(self, samples: list[Sample], step: int) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            for text_in, text_out, score in samples:
                f.write(json.dumps({"step": step, "input": text_in, "output": text_out,
                                    "score": _json_value(float(score))}, ensure_ascii=False) + "\n")


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None  # a line cut short by a crash


def _generations_markdown(samples: list[Sample], step: int) -> str:
    """verl's TensorBoard text for the validation samples of one step."""
    parts = [f"**Generation Results - Step {step}**\n\n"]
    for i, (text_in, text_out, score) in enumerate(samples):
        parts.append(f"### Sample {i + 1}\n**Input:** {text_in}\n\n**Output:** {text_out}\n\n"
                     f"**Score:** {score}\n\n---\n\n")
    return "".join(parts)


class _TensorBoardBackend:
    def __init__(self, run_dir: Path, resume_step: int | None, config: dict) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise ImportError(
                "trainer.logger includes 'tensorboard' but the tensorboard package is missing: "
                "pip install tensorboard  (or pip install 'rlfoundry[tensorboard]')"
            ) from e
        self.log_dir = Path(os.environ.get("TENSORBOARD_DIR") or run_dir / "tensorboard")
        # purge_step hides events the interrupted run wrote after its last checkpoint.
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, data: Mapping[str, Scalar], step: int) -> None:
        for key, value in data.items():
            if _is_number(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, samples: list[Sample], step: int) -> None:
        self.writer.add_text("val/generations", _generations_markdown(samples, step), step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class _WandbBackend:
    def __init__(self, project: str, experiment: str, run_dir: Path, resume_step: int | None, config: dict) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "trainer.logger includes 'wandb' but wandb is not installed: pip install wandb  "
                "(or pip install 'rlfoundry[wandb]'). Without network, also set WANDB_MODE=offline "
                "and sync later with `wandb sync`."
            ) from e
        self.wandb = wandb
        id_file = run_dir / "wandb_run_id.txt"
        # Reusing the run id makes a resumed run continue the same wandb run instead of a new one.
        run_id = id_file.read_text().strip() if resume_step is not None and id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        # mode=None lets wandb read WANDB_MODE (offline/disabled) itself.
        self.run = wandb.init(project=project, name=experiment, id=run_id, resume="allow", config=config,
                              dir=str(run_dir), mode=os.environ.get("WANDB_MODE") or None)
        self.generation_rows: list[list[Any]] = []

    def log(self, data: Mapping[str, Scalar], step: int) -> None:
        self.run.log(dict(data), step=step)

    def log_generations(self, samples: list[Sample], step: int) -> None:
        """verl's table: one row per validation (step, input_1, output_1, score_1, ...), re-logged
        whole each time (a logged wandb Table cannot grow: wandb issue 2981)."""
        columns = ["step"] + [f"{c}_{i + 1}" for i in range(len(samples)) for c in ("input", "output", "score")]
        self.generation_rows.append([step] + [v for sample in samples for v in sample])
        self.run.log({"val/generations": self.wandb.Table(columns=columns, data=self.generation_rows)}, step=step)

    def finish(self) -> None:
        self.run.finish()


class _MlflowBackend:
    """One MLflow run per training run, in ``$MLFLOW_TRACKING_URI`` or the local file store
    ``<run_dir>/mlruns``: the experiment is the project, the run is named after the experiment (verl's
    mapping), the config its parameters. A resumed run continues its run (the id is kept in the run
    directory); ``$MLFLOW_RUN_ID`` attaches to a run made elsewhere, as in verl."""

    def __init__(self, project: str, experiment: str, run_dir: Path, resume_step: int | None, config: dict) -> None:
        try:
            import mlflow
        except ImportError as e:
            raise ImportError(f"trainer.logger includes 'mlflow' but mlflow is not installed: {MLFLOW_INSTALL}") from e
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a directory needs no server nor database (MLflow >= 3.7 asks for this opt-in to use one)
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(project)
        id_file = run_dir / "mlflow_run_id.txt"
        run_id = os.environ.get("MLFLOW_RUN_ID") or (
            id_file.read_text().strip() if resume_step is not None and id_file.exists() else None)
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else experiment)
        id_file.write_text(self.run.info.run_id)
        if config and run_id is None:  # a run's parameters cannot change once logged
            mlflow.log_params(_flat_params(config))

    def log(self, data: Mapping[str, Scalar], step: int) -> None:
        numbers = {_mlflow_name(k): float(v) for k, v in data.items() if _is_number(v)}
        if numbers:
            self.mlflow.log_metrics(numbers, step=step, run_id=self.run.info.run_id)

    def log_generations(self, samples: list[Sample], step: int) -> None:
        rows = [{"input": i, "output": o, "score": s} for i, o, s in samples]
        self.mlflow.log_dict(rows, f"val_step{step}.json", run_id=self.run.info.run_id)  # verl's artifact name

    def finish(self) -> None:
        self.mlflow.end_run()


def _mlflow_name(key: str) -> str:
    """verl's rule for MLflow metric names (MLflow allows letters, digits and ``_ - . / :`` and space):
    '@' becomes '_at_', runs of '/' one '/', any other character '_'."""
    key = re.sub("/+", "/", key.replace("@", "_at_"))
    return re.sub(r"[^/\w.\- :]", "_", key)


def _flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as MLflow parameters: nested keys joined with '/', values as text (lists as JSON)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat_params(value, name + "/"))
        else:
            out[_mlflow_name(name)] = json.dumps(value, default=str) if isinstance(value, (list, dict)) else str(value)
    return out


# Headline numbers for the console line: (label, keys tried in order). A key ending in "*" matches
# the first metric with that prefix (validation names carry the data source and N).
_CONSOLE_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("score", ("critic/score/mean",)),
    ("val", ("val-core/*/acc/mean@*", "val-core/*/reward/mean@*")),
    ("loss", ("train/loss", "actor/pg_loss")),
    ("val_loss", ("val/loss",)),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")),
    ("ent", ("actor/entropy",)),
    ("len", ("response_length/mean",)),
    ("lr", ("train/lr",)),
    ("s/step", ("perf/time_per_step", "timing_s/step")),
    ("tok/s", ("perf/throughput",)),
)


def _match(data: Mapping[str, Any], pattern: str) -> Any:
    """Value of the first key matching ``pattern`` ("*" = any run of characters), else None."""
    import fnmatch

    if "*" not in pattern:
        return data.get(pattern)
    return next((v for k, v in data.items() if fnmatch.fnmatchcase(k, pattern)), None)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _short(text: str, keep: int = 300) -> str:
    """A console-sized sample text: the end of a long prompt holds the question, so keep that."""
    return text if len(text) <= keep else "…" + text[-keep:]


class _ConsoleBackend:
    """A compact line per step (via ``tqdm.write``, so it does not tear the bar) and a progress bar."""

    def __init__(self, experiment: str, total_steps: int | None, resume_step: int | None) -> None:
        from tqdm import tqdm

        self.initial = resume_step or 0
        self.total = total_steps
        self.started = time.monotonic()
        self.bar = tqdm(total=total_steps, initial=self.initial, desc=experiment, unit="step",
                        dynamic_ncols=True, file=sys.stderr, leave=True)
        self._write = tqdm.write

    def set_total_steps(self, total: int | None) -> None:
        self.total = total
        self.bar.total = total
        self.bar.refresh()

    def _eta(self, step: int) -> str:
        """Remaining time from the mean step time of this process (so resumed runs are not skewed)."""
        done = step - self.initial
        if not self.total or done <= 0:
            return ""
        from tqdm import tqdm

        remaining = (time.monotonic() - self.started) / done * max(0, self.total - step)
        return f" | eta {tqdm.format_interval(remaining)}"

    def line(self, data: Mapping[str, Any], step: int) -> str:
        fields = []
        for label, patterns in _CONSOLE_FIELDS:
            value = next((v for v in map(lambda p: _match(data, p), patterns) if v is not None), None)
            if value is not None:
                fields.append(f"{label} {_fmt(value)}")
        if not fields:  # none of the headline metrics: show the first few so the line is not empty
            fields = [f"{k} {_fmt(v)}" for k, v in list(data.items())[:6]]
        total = f"/{self.total}" if self.total else ""
        return f"step {step}{total} | " + " | ".join(fields) + self._eta(step)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self._write(self.line(data, step), file=sys.stdout)
        if step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def log_generations(self, samples: list[Sample], step: int) -> None:
        lines = [f"step {step} | validation generations ({len(samples)}):"]
        lines += [f"  [{i + 1}] score {_fmt(float(score))} | {_short(text_in)!r} -> {_short(text_out)!r}"
                  for i, (text_in, text_out, score) in enumerate(samples)]
        self._write("\n".join(lines), file=sys.stdout)

    def finish(self) -> None:
        self.bar.close()


# --------------------------------------------------------------------------- the fan-out

def _normalise_backends(default_backend: str | list[str] | tuple[str, ...] | None, always_file: bool) -> list[str]:
    names = [default_backend] if isinstance(default_backend, str) else list(default_backend or [])
    for name in names:
        if name in SUPPORTED_BACKENDS:
            continue
        if name in VERL_ONLY_BACKENDS:
            raise ValueError(f"trainer.logger: {name!r} is a verl back end rlfoundry does not ship; "
                             f"use one of {list(SUPPORTED_BACKENDS)}")
        close = difflib.get_close_matches(str(name), SUPPORTED_BACKENDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"trainer.logger: unknown back end {name!r}{hint}; use any of {list(SUPPORTED_BACKENDS)}")
    if always_file and "file" not in names:
        names.append("file")
    return list(dict.fromkeys(names))  # de-duplicate, keep order


class Tracking:
    """Fan each step's metrics out to the configured back ends (verl's ``Tracking`` interface).

    ``run_dir`` holds ``metrics.jsonl``, ``tensorboard/`` and the wandb files; it defaults to
    ``checkpoints/<project>/<experiment>`` (verl's ``trainer.default_local_dir``). ``resume_step``
    is the global step of the checkpoint a resumed run continues from (None for a fresh run).
    """

    def __init__(
        self,
        project_name: str,
        experiment_name: str,
        default_backend: str | list[str] | tuple[str, ...] = "console",
        config: Any = None,
        run_dir: str | os.PathLike | None = None,
        total_training_steps: int | None = None,
        resume_step: int | None = None,
        always_file: bool = True,
    ) -> None:
        self.backend_names = _normalise_backends(default_backend, always_file)
        self.run_dir = Path(run_dir) if run_dir is not None else Path("checkpoints") / project_name / experiment_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config_dict = _config_dict(config)
        self.logger: dict[str, Any] = {}
        for name in self.backend_names:
            self.logger[name] = self._make(name, project_name, experiment_name, config_dict,
                                           total_training_steps, resume_step)
        self._dropped: set[str] = set()
        self._finished = False

    def _make(self, name: str, project: str, experiment: str, config: dict, total: int | None, resume: int | None):
        if name == "console":
            return _ConsoleBackend(experiment, total, resume)
        if name == "file":
            return _FileBackend(self.run_dir, resume, config)
        if name == "tensorboard":
            return _TensorBoardBackend(self.run_dir, resume, config)
        if name == "mlflow":
            return _MlflowBackend(project, experiment, self.run_dir, resume, config)
        return _WandbBackend(project, experiment, self.run_dir, resume, config)

    @property
    def metrics_path(self) -> Path | None:
        """Where the file back end writes (None when it is off)."""
        return self.logger["file"].path if "file" in self.logger else None

    def set_total_steps(self, total: int | None) -> None:
        """The number of training steps, once the trainer knows it (for the progress bar and ETA)."""
        if "console" in self.logger:
            self.logger["console"].set_total_steps(total)

    def _clean(self, data: Mapping[str, Any]) -> dict[str, Scalar]:
        """Scalars only; each key that is not one (a whole tensor, a list) is dropped with one warning."""
        out = {}
        for key, value in data.items():
            scalar = _scalar(value)
            if scalar is not None:
                out[str(key)] = scalar
            elif key not in self._dropped:
                self._dropped.add(key)
                warnings.warn(f"[tracking] metric {key!r} is a {type(value).__name__}, not a scalar; not logged")
        return out

    def log(self, data: Mapping[str, Any], step: int, backend: str | list[str] | None = None) -> None:
        """Send ``data`` for ``step`` to every back end (or only those named in ``backend``)."""
        clean = self._clean(data)
        wanted = [backend] if isinstance(backend, str) else backend
        for name, logger in self.logger.items():
            if wanted is None or name in wanted:
                logger.log(clean, int(step))

    def log_generations(self, samples: list[Sample], step: int) -> None:
        """Validation samples ``(input, output, score)`` of ``step`` to every back end (see the module doc)."""
        for logger in self.logger.values():
            logger.log_generations(samples, int(step))

    def finish(self) -> None:
        """Close every back end (flushes TensorBoard, ends the wandb run); safe to call twice."""
        if self._finished:
            return
        self._finished = True
        for logger in self.logger.values():
            logger.finish()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()
