"""``single_turn_agent``: one assistant turn, every response token sampled (rows that need no tools)."""

from __future__ import annotations

from typing import Any

from rlfoundry.workers.rollout.agent_loop.base import AgentLoopBase, AgentLoopOutput, register

__all__ = ["SingleTurnAgentLoop"]


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    takes_images = True

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        turn = await self.server.generate(self.key, row["prompt_ids"], self.response_length, row.get("prompt_vision"))
        eos = self.server.eos_ids or {self.tokenizer.eos_token_id}
        return AgentLoopOutput(prompt_ids=list(row["prompt_ids"]), response_ids=turn.token_ids,
                               response_mask=[1] * len(turn.token_ids), response_logprobs=turn.log_probs,
                               num_turns=2, cut_by_length=not (turn.token_ids and turn.token_ids[-1] in eos),
                               extra_fields={"last_turn_start": 0})
