"""Multi-turn rollouts (``rollout.multi_turn.enable=True``): agent loops over a rollout engine.

:class:`AgentLoop` has the engines' ``generate_sequences`` contract. Each of the ``n`` samples of each
prompt is one trajectory, run by the agent loop its row names (``agent_name``, else
``rollout.agent.default_agent_loop``; ``base.py``); all of them run at once on one event loop, and
their generation requests share engine calls (``server.py``): a trajectory waiting on a slow tool
does not hold up the others for longer than ``rollout.agent.max_wait_s``.

The token sequence is the one the policy saw, which re-tokenising the final chat need not reproduce;
``tokenization_sanity_check_mode`` compares the two (``strict``: token for token; ``ignore_strippable``:
the decoded texts without whitespace) and a mismatch is logged with its first differing position and
counted in ``multi_turn/sanity_check_failures`` (the trajectory is kept: its tokens are the truth).
Whether the engine sampled each row's policy tokens after exactly the row's tokens before them is
checked too, against the engine calls themselves (``server.py``): a loop that gives the engine a context
other than the row's (``use_inference_chat_template``, a custom loop that re-encodes a turn) makes the
row's ``retokenised_from`` column the response position where that starts (-1: none), which the
mismatch audit names as re-tokenisation (docs/on_policy.md).
The per-row ``num_turns``, ``sanity_check_failed`` and the loops' ``extra_fields`` become non-tensor
columns, which the driver turns into the step's metrics (``trainer/metric_utils.multi_turn_metrics``).

A loop may give a trajectory several rows (``openai_agent``'s segments): each repeats its sample's
columns and its ``trajectory_id`` (one per trajectory, unique); a row it marks ``excluded`` (a lost
sample, padding; the ``excluded`` column) gets a ``uid`` of its own, so group estimators leave it out of
its prompt's group, and metrics over turns leave it out too; an ``extra_info`` it returns replaces the row's.

Image rows (a ``multi_modal_inputs`` column, (B, 3, Tp) ``position_ids``; docs/vision.md) go to loops
that take images (``takes_images``: ``tool_agent``, ``single_turn_agent``) with their
``prompt_vision``; the output keeps the columns and its positions are 3-D, the prompt's and then each
response token one past the one before in all three axes, as the single-turn rollout gives them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from rlfoundry.config.schema import SPO_FORMAT
from rlfoundry.protocol import DataProto
from rlfoundry.utils.tokenizer import pad_id
from rlfoundry.utils.trajectories import format_trajectory
from rlfoundry.models.vision import continued_positions
from rlfoundry.utils.torch_functional import rollout_layout
from rlfoundry.workers.rollout.agent_loop.base import (
    AgentLoopBase,
    AgentLoopError,
    AgentLoopOutput,
    register,
    resolve_agent_loops,
)
from rlfoundry.workers.rollout.base import ENGINE_ONLY
from rlfoundry.workers.rollout.agent_loop.server import GenerationServer, PromptVision, prefix_digests
from rlfoundry.workers.rollout.agent_loop.tool_agent import apply_template, truncate_text

__all__ = ["ENGINE_ONLY", "AgentLoop", "AgentLoopBase", "AgentLoopError", "AgentLoopOutput", "build_agent_loop", "format_trajectory",
           "register", "resolve_agent_loops", "truncate_text"]

logger = logging.getLogger(__name__)


def build_agent_loop(engine: Any, tokenizer: Any, rollout: Any) -> AgentLoop | None:
    """``rollout.multi_turn.enable`` (``rollout``: the typed ``actor_rollout_ref.rollout``): the agent loops
    over ``engine``, with the configured tools and interactions (a bad loop name or config fails here, at
    start-up); None when multi-turn is off."""
    if not rollout.multi_turn.enable:
        return None
    from rlfoundry.interactions import initialize_interactions_from_config
    from rlfoundry.tools.registry import initialize_tools_from_config

    multi_turn = rollout.multi_turn
    tools = initialize_tools_from_config(multi_turn.tool_config_path) if multi_turn.tool_config_path else []
    interactions = (initialize_interactions_from_config(multi_turn.interaction_config_path)
                    if multi_turn.interaction_config_path else {})
    # the data set rendered the prompts with the same tools (trainer/main_ppo.rollout_data_config)
    kwargs = {"tools": [t.get_openai_tool_schema().model_dump() for t in tools]} if tools else {}
    loop = AgentLoop(engine, tokenizer, multi_turn, {t.name: t for t in tools}, rollout.response_length,
                     chat_template_kwargs=kwargs, agent=rollout.agent, interactions=interactions,
                     prompt_tools_known=bool(multi_turn.tool_config_path))
    resolve_agent_loops({loop.default_loop}, loop.loop_config_path)
    if loop.default_loop == "spo_tool_agent" and "code_interpreter" not in loop.tools:
        raise AgentLoopError("the spo_tool_agent loop runs code with a tool named 'code_interpreter'; "
                             f"actor_rollout_ref.rollout.multi_turn.tool_config_path lists {sorted(loop.tools)}")
    return loop


class AgentLoop:
    """Runs ``rollout.n`` trajectories per prompt on a rollout engine (see the module docstring).

    Args:
        engine: a rollout engine whose ``generate_sequences`` takes left-padded token rows (HF, vLLM).
        tokenizer: the policy's tokenizer (its chat template renders the tool and user messages).
        config: the typed ``rollout.multi_turn`` subtree.
        tools: the tools by name (``tools/registry.py``).
        response_length: the token budget of a whole trajectory after its prompt.
        chat_template_kwargs: ``data.apply_chat_template_kwargs`` (the ``tools`` offered included).
        agent: the typed ``rollout.agent`` subtree (default loop, loop config file, ``max_wait_s``).
        interactions: simulated users by name (``interactions/registry.py``).
        prompt_tools_known: whether ``chat_template_kwargs`` says which tools the data set's prompts offer
            (False: they came from ``data.apply_chat_template_kwargs.tools``, which the worker does not
            see; the start-up check of an agent's ``TOOLS`` is then left to the endpoint's 400).
    """

    def __init__(self, engine: Any, tokenizer: Any, config: Any, tools: dict, response_length: int,
                 chat_template_kwargs: dict[str, Any] | None = None, agent: Any = None,
                 interactions: dict | None = None, prompt_tools_known: bool = True):
        self.engine, self.tokenizer, self.config, self.tools = engine, tokenizer, config, tools
        self.response_length = int(response_length)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # as the data set rendered the prompts
        self.interactions = dict(interactions or {})
        # format=spo is verl's SPO scripts' way of naming their loop (config/spo.py)
        implied = "spo_tool_agent" if getattr(config, "format", None) == SPO_FORMAT else "tool_agent"
        self.default_loop = getattr(agent, "default_agent_loop", None) or implied
        self.loop_config_path = getattr(agent, "agent_loop_config_path", None)
        self.max_wait_s = float(getattr(agent, "max_wait_s", 1.0))
        self.agent = agent
        if self.default_loop == "openai_agent":  # a missing or broken agent, or unrendered tools: fail at start-up
            from rlfoundry.workers.rollout.agent_loop.openai_agent import check_prompt_tools, load_agent_function

            fn = load_agent_function(agent.openai.path, agent.openai.name)
            if prompt_tools_known:
                check_prompt_tools(fn, tokenizer, self.chat_template_kwargs, f"{agent.openai.path}.{agent.openai.name}")
        self.pad_id = pad_id(tokenizer)
        self.last_engine_calls = 0  # engine calls of the last batch (tests, profiling)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Same contract as the engines' ``generate_sequences`` (B·n rows, prompt i's at i·n …), plus
        the per-row columns named in the module docstring."""
        rollout = self.engine.config  # n samples per prompt, as the engine itself would take
        default_n = rollout.val_kwargs.n if prompts.meta_info.get("validate") else rollout.n
        n = int(prompts.meta_info.get("n", default_n))
        rows = [self._row(prompts, i) for i in range(len(prompts)) for _ in range(n)]
        classes = resolve_agent_loops({r["agent_name"] for r in rows}, self.loop_config_path)
        for r in rows:
            if r.get("prompt_vision") is not None and not getattr(classes[r["agent_name"]], "takes_images", False):
                raise AgentLoopError(f"agent loop {r['agent_name']!r} does not take image rows (its class sets no "
                                     "takes_images = True); use tool_agent or single_turn_agent for them")
        with ThreadPoolExecutor(1, thread_name_prefix="rlfoundry-agent-loop") as pool:  # callers may own a loop
            results, server = pool.submit(asyncio.run, self._run_all(rows, classes, dict(prompts.meta_info))).result()
        outputs, sample = [], []  # one entry per row; a loop may give a trajectory several rows
        for k, result in enumerate(results):
            for out in result if isinstance(result, list) else [result]:
                outputs.append(out)
                sample.append(k)
                self._check_tokenization(out)
        batch = self._assemble(prompts, n, outputs, sample)
        batch.non_tensor_batch["retokenised_from"] = _retokenised_from(server, batch, sample)
        batch.non_tensor_batch.update(_version_columns(server, sample))
        return batch

    def _row(self, prompts: DataProto, i: int) -> dict[str, Any]:
        batch = prompts.batch
        row = {k: v[i] for k, v in prompts.non_tensor_batch.items()}
        row["prompt_ids"] = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        row["agent_name"] = row.get("agent_name") or self.default_loop
        positions = batch["position_ids"][i] if "position_ids" in batch.keys() else None
        if row.get("multi_modal_inputs") and positions is not None and positions.dim() == 2:  # (3, Tp)
            row["prompt_vision"] = PromptVision(row["multi_modal_inputs"],
                                                positions[:, batch["attention_mask"][i].bool()].cpu(),
                                                row.get("multi_modal_data") or None)
        return row

    async def _run_all(self, rows: list[dict], classes: dict[str, type], meta: dict) -> tuple[list, GenerationServer]:
        server = GenerationServer(self.engine, self.pad_id, meta, self.max_wait_s)
        loops = [classes[row["agent_name"]](
            server=server, tokenizer=self.tokenizer, config=self.config, tools=self.tools,
            interactions=self.interactions, response_length=self.response_length,
            chat_template_kwargs=self.chat_template_kwargs, key=k, agent=self.agent) for k, row in enumerate(rows)]

        async def one(loop: AgentLoopBase, row: dict) -> AgentLoopOutput | list[AgentLoopOutput]:
            try:
                return await loop.run(meta, **row)
            finally:
                server.leave()

        for _ in loops:
            server.join()
        serving = asyncio.create_task(server.serve())
        try:
            return await asyncio.gather(*(one(loop, row) for loop, row in zip(loops, rows))), server
        finally:
            serving.cancel()
            self.last_engine_calls = server.engine_calls

    def _check_tokenization(self, out: AgentLoopOutput) -> None:
        """Our tokens against the re-tokenised chat (see the module docstring)."""
        mode = self.config.tokenization_sanity_check_mode
        out.extra_fields["sanity_check_failed"] = False
        if mode == "disable" or out.cut_by_length or not out.messages:
            return  # a turn cut by the budget has no end the template could reproduce
        ours = out.prompt_ids + out.response_ids
        kwargs = self.chat_template_kwargs if out.chat_template_kwargs is None else out.chat_template_kwargs
        text = apply_template(self.tokenizer, kwargs, out.messages, out.messages[-1]["role"] != "assistant")
        theirs = self.tokenizer.encode(text, add_special_tokens=False)
        if mode == "ignore_strippable":
            same = "".join(self.tokenizer.decode(ours).split()) == "".join(text.split())
        else:  # the template may close the last turn with more than its end token (ChatML: "\n")
            tail = theirs[len(ours):]
            same = theirs[:len(ours)] == ours and not self.tokenizer.decode(tail).strip()
        if not same:
            out.extra_fields["sanity_check_failed"] = True
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            logger.warning("multi-turn: the trajectory's tokens differ from the re-tokenised chat at position %d "
                           "(%r vs %r); training on the sampled tokens", at, ours[at:at + 5], theirs[at:at + 5])

    def _assemble(self, prompts: DataProto, n: int, outputs: list[AgentLoopOutput], sample: list[int]) -> DataProto:
        """The engines' output layout: prompts as given (one row per output, its sample's prompt; padding
        where the output has no prompt ids), responses padded to the budget."""
        device = prompts.batch["input_ids"].device  # the caller's (the worker's device): the output stays there
        prompt_of = np.array([k // n for k in sample], dtype=np.int64)
        index = torch.as_tensor(prompt_of, device=device)
        # an output without prompt ids has its whole context in the response (openai_agent's fresh segments)
        no_prompt = torch.tensor([not out.prompt_ids for out in outputs], dtype=torch.bool, device=device).unsqueeze(1)
        prompt_ids = prompts.batch["input_ids"][index].masked_fill(no_prompt, self.pad_id)
        prompt_mask = prompts.batch["attention_mask"][index].masked_fill(no_prompt, 0)
        for out in outputs:
            if len(out.response_ids) > self.response_length:
                raise AgentLoopError(f"an agent loop returned {len(out.response_ids)} response tokens, more than the "
                                     f"budget {self.response_length} (data.max_response_length): a custom loop must "
                                     "pass its remaining budget to server.generate")
        tensors = rollout_layout(prompt_ids, prompt_mask, [o.response_ids for o in outputs],
                                 [o.response_mask for o in outputs], [o.response_logprobs for o in outputs],
                                 self.response_length, self.pad_id)
        if "position_ids" in prompts.batch.keys() and prompts.batch["position_ids"].dim() == 3:
            tensors["position_ids"] = _positions_3d(prompts.batch["position_ids"][index], no_prompt.squeeze(1),
                                                    tensors["position_ids"], self.response_length)
        extras = {k: v[prompt_of] for k, v in prompts.non_tensor_batch.items()}
        columns = _columns(outputs)
        own_info = columns.pop("extra_info", None)
        extras.update(columns)
        extras["excluded"] = np.array([bool(v) for v in columns.get("excluded", [False] * len(outputs))], dtype=object)
        names = [uuid.uuid4().hex for _ in range(max(sample, default=-1) + 1)]  # unique across a step's batches
        extras["trajectory_id"] = np.array([names[k] for k in sample], dtype=object)
        for r in range(len(outputs)):
            if own_info is not None and own_info[r] is not None:
                extras.setdefault("extra_info", np.full(len(outputs), None, dtype=object))[r] = own_info[r]
            if extras["excluded"][r] and "uid" in extras:
                extras["uid"][r] = f"{extras['uid'][r]}/excluded/{r}"
        return DataProto.from_dict(tensors=tensors, non_tensors=extras, meta_info=dict(prompts.meta_info))


def _retokenised_from(server: GenerationServer, batch: DataProto, sample: list[int]) -> np.ndarray:
    """Per row, the first response position whose policy token the engine did not sample after the row's own
    tokens before it (-1: none): the mismatch audit's evidence of re-tokenisation (see the module docstring),
    read from the batch's tensors, the ids the trainer gets. Every row's prefix digests in one pass; per row,
    only its requests' sampled ids compared."""
    tensors = batch.batch.cpu()  # one copy per tensor from the worker's device, then host-side indexing
    real, prompt_width = tensors["attention_mask"].bool(), tensors["prompts"].shape[1]
    digests, ids = prefix_digests(tensors["input_ids"], real), tensors["input_ids"]
    # a row's real tokens are contiguous: the prompt's, right-aligned, then the response's
    first, count, prompt = real.int().argmax(-1).tolist(), real.sum(-1).tolist(), real[:, :prompt_width].sum(-1).tolist()
    covered = torch.zeros_like(real[:, prompt_width:])
    for r, k in enumerate(sample):
        row = slice(first[r], first[r] + count[r])
        for a, b in server.sampled_spans(k, ids[r, row], digests[r, row]):
            covered[r, max(a - prompt[r], 0):max(b - prompt[r], 0)] = True
    missing = tensors["response_mask"].bool() & ~covered
    column = np.empty(len(sample), dtype=object)
    column[:] = torch.where(missing.any(-1), missing.int().argmax(-1), -1).tolist()
    return column


def _version_columns(server: GenerationServer, sample: list[int]) -> dict[str, np.ndarray]:
    """Where the engine reported the weight versions each turn was sampled under (partial rollout): per row,
    its trajectory's first and last (``param_version_start`` / ``_end``) and the actor version of its first
    tokens (``param_version``, the oldest); {} otherwise."""
    if not sample or any(k not in server.versions for k in sample):
        return {}
    names = server.versions[sample[0]].keys()
    return {name: np.array([server.versions[k][name] for k in sample], dtype=object) for name in names}


def _positions_3d(prompt_pos: torch.Tensor, no_prompt: torch.Tensor, flat: torch.Tensor, width: int) -> torch.Tensor:
    """(B, 3, Tp + width) positions of an image batch's rows: the prompt's, then the response going on from its
    last one in every axis (HF rollout's layout); a row without prompt ids counts over its own tokens
    (``flat``, (B, Tp + width)) in each axis."""
    positions = continued_positions(prompt_pos, width)
    return torch.where(no_prompt.view(-1, 1, 1), flat.unsqueeze(1).expand_as(positions), positions)


def _columns(outputs: list[AgentLoopOutput]) -> dict[str, np.ndarray]:
    """``num_turns`` and every loop's ``extra_fields`` as object columns (None where a loop lacks a key)."""
    keys = sorted({k for out in outputs for k in out.extra_fields})
    columns = {"num_turns": [out.num_turns for out in outputs]}
    columns.update({k: [out.extra_fields.get(k) for out in outputs] for k in keys})
    result = {k: np.empty(len(values), dtype=object) for k, values in columns.items()}
    for k, values in columns.items():
        for i, value in enumerate(values):  # element-wise: a list value must stay one cell
            result[k][i] = value
    return result
