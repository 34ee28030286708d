"""Trajectories a user can audit: what ``trainer.rollout_data_dir`` and ``trainer.validation_data_dir`` write,
and the reader that gives them back token for token (docs/agents.md, "Auditing trajectories").

One JSON line per sample in ``<dir>/<step>.jsonl``. verl's fields stay as verl writes them (``input``,
``output``, ``gts``, ``score``, ``step``; validation dumps add the reward function's extra info), so a
verl reader keeps working; beside them, the tokens the step trained on:

- ``prompt_ids`` / ``response_ids``: the row's tokens without padding (``prompt_ids`` is empty where a
  segment carries its whole context in the response); ``response_mask`` (aligned with ``response_ids``):
  1 on the tokens the policy sampled and the loss trains, 0 on tool, user and template tokens;
  ``rollout_log_probs`` (aligned) where the engine returned them;
- ``turns``: ``[role, start, end]`` spans of ``response_ids`` (``assistant`` sampled; ``tool``, ``user``,
  ``context`` not), as the agent loop appended them; a single-turn row is one ``assistant`` span;
- ``stop_reason``: the agent loop's (``no_call``, ``length``, ``agent_done`` …); for a single-turn row
  ``length`` when the response fills the budget without an end token, else ``stop``;
- ``param_version`` (actor updates behind the sampling weights, where the rollout recorded it; a partial
  rollout's ``param_version_start`` / ``param_version_end`` too);
- ``rewards``: ``[position, value]`` of every non-zero token-level score (``score`` is their sum), and the
  loop's ``tool_reward`` / ``turn_scores``; ``tool_results`` (``{tool, text, error}`` per call answered);
- the loop's columns where present: ``num_turns``, ``tool_calls``, ``tool_errors``, ``segments_dropped``,
  ``excluded`` (a lost sample's or padding row: no loss), ``trajectory_id`` (a trajectory's rows share it),
  ``data_source``, ``index`` (the row's data-set index), ``retokenised_from`` (the first response position
  the engine did not sample after the row's own tokens, -1: none; docs/on_policy.md). The group ``uid`` is left out: it is drawn at
  random, and two runs that train the same rows write the same dump.

``read_trajectories(path)`` returns them as :class:`Trajectory` objects; ``rlfoundry trajectories DIR
[--step N] [--model PATH]`` prints them, the untrained spans between ⟦ ⟧.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["Trajectory", "format_trajectory", "generation_records", "main", "read_trajectories", "write_generations"]

# non-tensor columns copied as they are (those a batch has)
_COLUMNS = ("num_turns", "tool_calls", "tool_errors", "tool_reward", "turn_scores", "tool_results", "segments_dropped",
            "excluded", "trajectory_id", "data_source", "sanity_check_failed", "retokenised_from",
            "param_version_start", "param_version_end")


def generation_records(batch: Any, scores: list[float], tokenizer: Any, step: int,
                       token_scores: Any = None) -> list[dict[str, Any]]:
    """One dict per row of ``batch`` (a ``DataProto`` after generation): the module docstring's fields.
    ``token_scores`` (B, Tr): the token-level scores (default: the batch's ``token_level_scores``)."""
    tensors, rows = batch.batch, batch.non_tensor_batch
    decode = lambda key: tokenizer.batch_decode(tensors[key], skip_special_tokens=True)  # noqa: E731
    if token_scores is None and "token_level_scores" in tensors.keys():
        token_scores = tensors["token_level_scores"]
    records = []
    for i, (prompt, response) in enumerate(zip(decode("prompts"), decode("responses"))):
        info = rows["extra_info"][i] if "extra_info" in rows else None
        record = {"input": prompt, "output": response, "score": scores[i], "step": step,
                  "gts": (rows["reward_model"][i] or {}).get("ground_truth") if "reward_model" in rows else None,
                  "index": info.get("index") if isinstance(info, dict) else None}
        if "param_version" in rows:
            record["param_version"] = int(rows["param_version"][i])
        record |= _tokens(tensors, i) | {k: rows[k][i] for k in _COLUMNS if k in rows}
        if token_scores is not None:
            record["rewards"] = [[p, float(token_scores[i, p])] for p in token_scores[i].nonzero().flatten().tolist()]
        records.append(record | _turns(record, rows, i, tensors["responses"].shape[1], tokenizer.eos_token_id))
    return records


def _turns(record: dict, rows: dict, i: int, width: int, eos: int) -> dict[str, Any]:
    """``stop_reason`` and ``turns``: the loop's columns, else a single-turn row's (one sampled turn, stopped
    by the budget when it fills ``width`` without ``eos``)."""
    ids = record["response_ids"]
    if "stop_reason" in rows:
        stop = rows["stop_reason"][i]
    else:
        stop = "length" if len(ids) == width and ids[-1] != eos else "stop"
    turns = rows["turns"][i] if "turns" in rows else None
    if turns is None:
        return {"stop_reason": stop, "turns": [["assistant", 0, len(ids)]] if ids else []}
    return {"stop_reason": stop, "turns": [list(t) for t in turns]}


def _tokens(tensors: Any, i: int) -> dict[str, list]:
    """Row i's prompt and response ids without padding, the response mask and log-probs aligned with them."""
    width = tensors["prompts"].shape[1]
    attention = tensors["attention_mask"][i].bool()
    real = attention[width:]
    mask = tensors["response_mask"][i] if "response_mask" in tensors.keys() else attention[width:].long()
    out = {"prompt_ids": tensors["prompts"][i][attention[:width]].tolist(),
           "response_ids": tensors["responses"][i][real].tolist(), "response_mask": mask[real].long().tolist()}
    if "rollout_log_probs" in tensors.keys():
        out["rollout_log_probs"] = tensors["rollout_log_probs"][i][real].tolist()
    return out


def write_generations(records: list[dict[str, Any]], directory: Path, step: int) -> Path:
    """``<directory>/<step>.jsonl``, one JSON line per record (numpy values as plain numbers and lists)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record, default=_plain, ensure_ascii=False) + "\n")
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


@dataclass
class Trajectory:
    """One dumped row, token for token (the module docstring's fields; ``record`` holds all of them)."""

    step: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    turns: list[tuple[str, int, int]]
    stop_reason: str | None
    score: float
    param_version: int | None = None
    rewards: list[tuple[int, float]] = field(default_factory=list)
    tool_results: list[dict[str, Any]] = field(default_factory=list)
    record: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def input_ids(self) -> list[int]:
        """The row's sequence as the actor saw it: prompt, then response."""
        return self.prompt_ids + self.response_ids

    @property
    def trained_ids(self) -> list[int]:
        """The tokens the loss trains (``response_mask`` 1), in order."""
        return [t for t, m in zip(self.response_ids, self.response_mask) if m]

    def turn_ids(self, role: str | None = None) -> list[list[int]]:
        """Each turn's tokens (only ``role``'s when given)."""
        return [self.response_ids[a:b] for r, a, b in self.turns if role is None or r == role]

    def text(self, tokenizer: Any) -> str:
        """The response decoded, the untrained spans between ⟦ ⟧."""
        return format_trajectory(tokenizer, self.response_ids, self.response_mask)


def read_trajectories(path: str | Path, step: int | None = None) -> list[Trajectory]:
    """The trajectories of a dump directory (every ``<step>.jsonl``, in step order; only ``step``'s when
    given) or of one ``.jsonl`` file."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted((p for p in path.glob("*.jsonl") if p.stem.isdigit()), key=lambda p: int(p.stem))
        files = [p for p in files if step is None or int(p.stem) == step]
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"{path}: no such dump (trainer.rollout_data_dir / trainer.validation_data_dir)")
    out = []
    for file in files:
        for line in file.read_text().splitlines():
            if line.strip():
                out.append(_trajectory(json.loads(line), file))
    return out


def _trajectory(record: dict[str, Any], file: Path) -> Trajectory:
    if "response_ids" not in record:
        raise ValueError(f"{file}: a record without token ids (written by verl or an rlfoundry before 2026-11-29); "
                         "its text fields (input, output) are all it holds")
    return Trajectory(step=int(record["step"]), prompt_ids=list(record["prompt_ids"]),
                      response_ids=list(record["response_ids"]), response_mask=list(record["response_mask"]),
                      turns=[tuple(t) for t in record.get("turns") or ()], stop_reason=record.get("stop_reason"),
                      score=float(record["score"]), param_version=record.get("param_version"),
                      rewards=[tuple(r) for r in record.get("rewards") or ()],
                      tool_results=list(record.get("tool_results") or ()), record=record)


def format_trajectory(tokenizer: Any, response_ids: list[int], response_mask: list[int], open_mark: str = "⟦",
                      close_mark: str = "⟧") -> str:
    """A response as text with the spans the policy did not sample (tool replies, user turns, template
    tokens; ``response_mask`` 0) between ``open_mark`` and ``close_mark``: what the loss does not see."""
    parts, start = [], 0
    for end in range(1, len(response_ids) + 1):
        if end == len(response_ids) or response_mask[end] != response_mask[start]:
            text = tokenizer.decode(response_ids[start:end])
            parts.append(text if response_mask[start] else open_mark + text + close_mark)
            start = end
    return "".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """``rlfoundry trajectories DIR [--step N] [--model PATH]``: each trajectory's step, stop reason, policy
    version, score and turns; with ``--model`` (a tokenizer directory or ``rlfoundry://NAME``) its text."""
    import argparse

    parser = argparse.ArgumentParser(prog="rlfoundry trajectories", description=main.__doc__)
    parser.add_argument("path", help="trainer.rollout_data_dir / validation_data_dir, or one <step>.jsonl")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--model", default=None, help="decode with this model's tokenizer")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.model:
        from transformers import AutoTokenizer

        packaged = Path(__file__).resolve().parents[1] / "assets"  # rlfoundry://NAME, as the trainer reads it
        path = packaged / args.model[len("rlfoundry://"):] if args.model.startswith("rlfoundry://") else args.model
        tokenizer = AutoTokenizer.from_pretrained(path)
    for t in read_trajectories(args.path, args.step):
        turns = " ".join(f"{r}[{a}:{b}]" for r, a, b in t.turns)
        print(f"step {t.step} stop={t.stop_reason} param_version={t.param_version} score={t.score:g} "
              f"tokens={len(t.prompt_ids)}+{len(t.response_ids)} trained={sum(t.response_mask)} turns: {turns}")
        if tokenizer is not None:
            print(t.text(tokenizer))
    return 0
