"""Multi-turn tool-calling rollouts (``rollout.multi_turn.enable=True``), token in, token out.

A trajectory starts from the prompt's token ids (rendered by the data set with the tools offered,
``data.apply_chat_template_kwargs.tools``) and alternates:

1. the engine generates an assistant turn (every trajectory still running, one engine call);
2. hermes tool calls are parsed from the turn's text; a malformed call becomes an error message;
3. the calls run (``tools/runner.py``: concurrently, each under ``tool_timeout_s``, failures
   contained), their texts are cut to ``max_tool_response_length`` characters;
4. the tool messages are appended as the chat template renders them after an assistant turn,
   tokenised once (the turn's own tokens are never re-tokenised);

until a turn has no call, a turn limit is reached, or the response budget (``data.max_response_length``
tokens over all turns) runs out. The response is everything after the prompt; ``response_mask`` is
1 exactly on the tokens the policy sampled, ``rollout_log_probs`` their log-probs (0 elsewhere).

The token sequence is the one the policy saw, which re-tokenising the final chat need not reproduce;
``tokenization_sanity_check_mode`` compares the two (``strict``: token for token; ``ignore_strippable``:
the decoded texts without whitespace) and a mismatch is logged with its first differing position and
counted in ``multi_turn/sanity_check_failures`` (the trajectory is kept: its tokens are the truth).

Per row the output carries ``num_turns``, ``tool_calls``, ``tool_errors``, ``tool_reward`` (the tools'
``calc_reward`` plus step rewards), ``stop_reason`` (``no_call``, ``length``, ``max_assistant_turns``,
``max_user_turns``), ``sanity_check_failed`` and ``last_turn_start`` (rule rewards score the final
assistant turn) as non-tensor columns, which the driver turns into the step's metrics
(``trainer/metric_utils.multi_turn_metrics``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.parser import parse_hermes
from rlfoundry.tools.runner import ToolCall, ToolCallResult, run_in_thread, run_tool_calls

__all__ = ["AgentLoop", "truncate_text"]

logger = logging.getLogger(__name__)

_LIFECYCLE_TIMEOUT_S = 30.0  # create / calc_reward / release of one tool instance


def truncate_text(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters, keeping the start (``left``), the end (``right``) or both
    ends (``middle``), with a marker where it was cut (verl's convention)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]


@dataclass
class _Trajectory:
    prompt_ids: list[int]
    messages: list[dict]  # the chat so far (for the sanity check)
    tools_kwargs: dict[str, Any]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    instances: dict[str, str] = field(default_factory=dict)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    errors: Counter = field(default_factory=Counter)
    step_reward: float = 0.0
    stop: str | None = None
    sanity_failed: bool = False
    last_turn_start: int = 0  # where the last assistant turn begins in the response (rule rewards read it)

    def append(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)


class AgentLoop:
    """Runs ``rollout.n`` trajectories per prompt on a rollout engine (see the module docstring).

    Args:
        engine: a rollout engine whose ``generate_sequences`` takes left-padded token rows (HF, vLLM).
        tokenizer: the policy's tokenizer (its chat template renders the tool messages).
        config: the typed ``rollout.multi_turn`` subtree.
        tools: the tools by name (``tools/registry.py``).
        response_length: the token budget of a whole trajectory after its prompt.
        chat_template_kwargs: ``data.apply_chat_template_kwargs`` (the ``tools`` offered included).
    """

    def __init__(self, engine: Any, tokenizer: Any, config: Any, tools: dict[str, BaseTool], response_length: int,
                 chat_template_kwargs: dict[str, Any] | None = None):
        self.engine, self.tokenizer, self.config, self.tools = engine, tokenizer, config, tools
        self.response_length = int(response_length)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # as the data set rendered the prompts
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = set(getattr(engine, "eos_token_ids", None) or [tokenizer.eos_token_id])

    # ---- the loop -------------------------------------------------------------------------

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Same contract as the engines' ``generate_sequences`` (B·n rows, prompt i's at i·n …), plus
        the per-row columns named in the module docstring."""
        rollout = self.engine.config  # n samples per prompt, as the engine itself would take
        default_n = rollout.val_kwargs.n if prompts.meta_info.get("validate") else rollout.n
        n = int(prompts.meta_info.get("n", default_n))
        trajectories = [self._start(prompts, i) for i in range(len(prompts)) for _ in range(n)]
        self._lifecycle(trajectories, "create")
        while running := [t for t in trajectories if t.stop is None]:
            self._tool_turn(self._assistant_turn(running, prompts.meta_info))
        self._lifecycle(trajectories, "finish")
        self._check_tokenization(trajectories)
        return self._assemble(prompts, n, trajectories)

    def _start(self, prompts: DataProto, row: int) -> _Trajectory:
        batch, extras = prompts.batch, prompts.non_tensor_batch
        ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
        messages = list(extras["raw_prompt"][row]) if "raw_prompt" in extras else []
        extra = extras["extra_info"][row] if "extra_info" in extras else None
        kwargs = (extra or {}).get("tools_kwargs", {}) if isinstance(extra, dict) else {}
        return _Trajectory(prompt_ids=ids, messages=messages, tools_kwargs=dict(kwargs or {}))

    def _assistant_turn(self, running: list[_Trajectory], meta: dict) -> list[tuple[_Trajectory, list, list]]:
        """One engine call for every running trajectory; returns, for those that called tools, their
        calls to run and the answers already known (malformed calls, calls over the limit)."""
        budget = max(self.response_length - len(t.response_ids) for t in running)
        out = self.engine.generate_sequences(self._batch(running, {**meta, "n": 1, "response_length": budget}))
        waiting = []
        for k, traj in enumerate(running):
            length = int(out.batch["response_mask"][k].sum())
            room = self.response_length - len(traj.response_ids)
            ids = out.batch["responses"][k][: min(length, room)].tolist()
            traj.last_turn_start = len(traj.response_ids)
            traj.append(ids, True, out.batch["rollout_log_probs"][k][: len(ids)].tolist())
            traj.assistant_turns += 1
            calls = self._after_turn(traj, ids)
            if calls is not None:
                waiting.append((traj, *calls))
        return waiting

    def _after_turn(self, traj: _Trajectory, ids: list[int]) -> tuple[list[ToolCall], list[ToolCallResult]] | None:
        """Why the trajectory stops after this turn, or the calls it made (None: it stopped)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        traj.messages.append({"role": "assistant", "content": text})
        turn = parse_hermes(text)
        if not (ids and ids[-1] in self.eos_ids):
            traj.stop = "length"
        elif not turn.calls and not turn.errors:
            traj.stop = "no_call"
        elif self.config.max_assistant_turns is not None and traj.assistant_turns >= self.config.max_assistant_turns:
            traj.stop = "max_assistant_turns"
        if traj.stop is not None:
            return None
        limit = self.config.max_parallel_calls
        calls = [ToolCall(traj.instances.get(c.name, ""), c) for c in turn.calls[:limit]]
        refused = [ToolCallResult(c.name, f"error: at most {limit} tool calls per turn", error="too_many_calls")
                   for c in turn.calls[limit:]]
        return calls, [ToolCallResult("", e, error="bad_call") for e in turn.errors] + refused

    def _tool_turn(self, waiting: list[tuple[_Trajectory, list[ToolCall], list[ToolCallResult]]]) -> None:
        """Every waiting trajectory's calls at once (a slow one holds up only its own answer's
        arrival), then each one's tool messages appended."""
        jobs = [(i, job) for i, (_, calls, _) in enumerate(waiting) for job in calls]
        results = run_tool_calls(self.tools, [job for _, job in jobs], max_parallel=max(1, len(jobs)),
                                 timeout_s=self.config.tool_timeout_s)
        answers: list[list[ToolCallResult]] = [[] for _ in waiting]
        for (i, _), result in zip(jobs, results):
            answers[i].append(result)
        for i, (traj, _, early) in enumerate(waiting):
            self._append_tool_messages(traj, answers[i] + early)

    def _append_tool_messages(self, traj: _Trajectory, answers: list[ToolCallResult]) -> None:
        traj.tool_calls += len(answers)
        for a in answers:
            traj.step_reward += a.reward
            if a.error:
                traj.errors[f"{a.tool or 'parse'}/{a.error}"] += 1
        limit, side = self.config.max_tool_response_length, self.config.tool_response_truncate_side
        messages = [{"role": "tool", "content": truncate_text(a.text, limit, side)} for a in answers]
        ids = self._render_after_assistant(messages, traj.response_ids[-1])
        room = self.response_length - len(traj.response_ids)
        traj.append(ids[:room], False)
        traj.messages += messages
        traj.user_turns += 1
        if len(ids) >= room:
            traj.stop = "length"
        elif self.config.max_user_turns is not None and traj.user_turns >= self.config.max_user_turns:
            traj.stop = "max_user_turns"

    # ---- the chat template ------------------------------------------------------------------

    def _render_after_assistant(self, messages: list[dict], end_token: int) -> list[int]:
        """The tokens the chat template puts after an assistant turn that ended with ``end_token``:
        what follows that token in the template's text, the tool messages, the next generation prompt."""
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        before = self._template(base, add_generation_prompt=False)
        full = self._template(base + messages, add_generation_prompt=True)
        end_text = self.tokenizer.convert_ids_to_tokens(end_token)
        cut = before.rfind(end_text) if isinstance(end_text, str) else -1
        trailing = before[cut + len(end_text):] if cut >= 0 else ""
        return self.tokenizer.encode(trailing + full[len(before):], add_special_tokens=False)

    def _template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        kwargs = {k: v for k, v in self.chat_template_kwargs.items() if k != "add_generation_prompt"}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)

    def _check_tokenization(self, trajectories: list[_Trajectory]) -> None:
        """Our tokens against the re-tokenised chat (see the module docstring); counts failures."""
        mode = self.config.tokenization_sanity_check_mode
        for traj in trajectories:
            if mode == "disable" or traj.stop == "length" or not traj.messages:
                continue  # a turn cut by the budget has no end the template could reproduce
            ours = traj.prompt_ids + traj.response_ids
            text = self._template(traj.messages, add_generation_prompt=traj.messages[-1]["role"] == "tool")
            theirs = self.tokenizer.encode(text, add_special_tokens=False)
            if mode == "ignore_strippable":
                same = "".join(self.tokenizer.decode(ours).split()) == "".join(text.split())
            else:  # the template may close the last turn with more than its end token (ChatML: "\n")
                tail = theirs[len(ours):]
                same = theirs[:len(ours)] == ours and not self.tokenizer.decode(tail).strip()
            if not same:
                traj.sanity_failed = True
                at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                logger.warning("multi-turn: the trajectory's tokens differ from the re-tokenised chat at position %d "
                               "(%r vs %r); training on the sampled tokens", at, ours[at:at + 5], theirs[at:at + 5])

    # ---- tool instances -----------------------------------------------------------------------

    def _lifecycle(self, trajectories: list[_Trajectory], phase: str) -> None:
        """``create`` every tool instance of every trajectory, or ``calc_reward`` + ``release`` them;
        all at once on one event loop, bounded in time; a failure costs that instance only."""

        async def create(traj: _Trajectory, name: str, tool: BaseTool) -> None:
            kwargs = dict((traj.tools_kwargs.get(name) or {}).get("create_kwargs") or {})
            created = await asyncio.wait_for(tool.create(**kwargs), _LIFECYCLE_TIMEOUT_S)
            traj.instances[name] = created[0] if isinstance(created, tuple) else created

        async def finish(traj: _Trajectory, name: str, tool: BaseTool) -> None:
            if name not in traj.instances:
                return
            kwargs = dict((traj.tools_kwargs.get(name) or {}).get("calc_reward_kwargs") or {})
            traj.step_reward += float(await asyncio.wait_for(tool.calc_reward(traj.instances[name], **kwargs),
                                                             _LIFECYCLE_TIMEOUT_S))
            await asyncio.wait_for(tool.release(traj.instances[name]), _LIFECYCLE_TIMEOUT_S)

        step = create if phase == "create" else finish
        pairs = [(traj, name, tool) for traj in trajectories for name, tool in self.tools.items()]

        async def run_all():
            return await asyncio.gather(*(step(*p) for p in pairs), return_exceptions=True)

        done, results = run_in_thread(run_all, _LIFECYCLE_TIMEOUT_S * 2)
        for (traj, name, _), result in zip(pairs, results if done else [TimeoutError()] * len(pairs)):
            if isinstance(result, BaseException):
                traj.errors[f"{name}/{phase}_failed"] += 1
                logger.warning("multi-turn: %s.%s failed: %s: %s", name, step.__name__, type(result).__name__, result)

    # ---- batches ------------------------------------------------------------------------------

    def _batch(self, running: list[_Trajectory], meta: dict) -> DataProto:
        """The running trajectories' tokens so far as left-padded rows."""
        rows = [t.prompt_ids + t.response_ids for t in running]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": position_ids},
                                   meta_info=meta)

    def _assemble(self, prompts: DataProto, n: int, trajectories: list[_Trajectory]) -> DataProto:
        """The engines' output layout: prompts as given (B·n, Tp), responses padded to the budget."""
        prompt_ids = prompts.batch["input_ids"].repeat_interleave(n, dim=0)
        prompt_mask = prompts.batch["attention_mask"].repeat_interleave(n, dim=0)
        rows, width = len(trajectories), self.response_length
        responses = torch.full((rows, width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((rows, width), dtype=torch.long)
        log_probs = torch.zeros((rows, width), dtype=torch.float32)
        attention = torch.zeros((rows, width), dtype=prompt_mask.dtype)
        for i, t in enumerate(trajectories):
            m = len(t.response_ids)
            responses[i, :m] = torch.tensor(t.response_ids, dtype=torch.long)
            response_mask[i, :m] = torch.tensor(t.mask, dtype=torch.long)
            log_probs[i, :m] = torch.tensor(t.log_probs, dtype=torch.float32)
            attention[i, :m] = 1
        attention_mask = torch.cat([prompt_mask, attention], dim=1)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        tensors = {"prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
                   "rollout_log_probs": log_probs, "input_ids": torch.cat([prompt_ids, responses], dim=1),
                   "attention_mask": attention_mask, "position_ids": position_ids}
        extras = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        extras.update(_per_row_columns(trajectories))
        return DataProto.from_dict(tensors=tensors, non_tensors=extras, meta_info=dict(prompts.meta_info))


def _per_row_columns(trajectories: list[_Trajectory]) -> dict[str, np.ndarray]:
    def column(values: list) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    return {
        "num_turns": column([t.assistant_turns + t.user_turns for t in trajectories]),
        "tool_calls": column([t.tool_calls for t in trajectories]),
        "tool_errors": column([dict(t.errors) for t in trajectories]),
        "tool_reward": column([t.step_reward for t in trajectories]),
        "stop_reason": column([t.stop for t in trajectories]),
        "sanity_check_failed": column([t.sanity_failed for t in trajectories]),
        "last_turn_start": column([t.last_turn_start for t in trajectories]),
    }
