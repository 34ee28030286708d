"""Agents that ship with rlfoundry, loadable from any directory by module path
(``actor_rollout_ref.rollout.agent.openai.path=rlfoundry.agents.react_calculator``): the demos' agents,
written against the OpenAI chat API only (``agent_name: openai_agent``, docs/agents.md)."""
