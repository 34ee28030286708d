"""The interaction interface: verl's ``BaseInteraction`` life cycle, so a verl interaction ports by
changing imports.

Per trajectory whose row carries ``extra_info.interaction_kwargs`` (``name`` plus the interaction's own
keys, e.g. the ground truth): ``start_interaction`` → after each assistant turn without a tool call,
``generate_response(instance_id, messages)`` returns ``(should_terminate, text for the user turn,
score of this turn, metrics)`` → ``finalize_interaction``. Every method is async; each call runs on a
thread of its own under a time limit, and a failure ends that trajectory only.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

__all__ = ["BaseInteraction"]


class BaseInteraction:
    def __init__(self, config: dict):
        self.config = dict(config or {})
        self.name = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        return True, "", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        pass
