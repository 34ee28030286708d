"""What an ``openai_agent`` run checks before and around its first request: the packaged demo agent loads
from any directory (by module path), an agent whose tools the data set's prompts were not rendered with
fails at start-up naming the key, and an agent that does not declare its tools gets the same advice in
its 400 ``context_length_exceeded``."""

from __future__ import annotations

import pytest

from rlfoundry.config.schema import AgentConfig, MultiTurnConfig, OpenAIAgentConfig
from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.tools.registry import initialize_tools_from_config
from rlfoundry.workers.rollout.agent_loop import AgentLoop, AgentLoopError
from rlfoundry.workers.rollout.agent_loop.openai_agent import load_agent_function
from tests.workers.test_agent_loop import CALL, TOOLS, ScriptedPolicy, _prompts
from tests.workers.test_openai_agent import TOOL_SCHEMAS, _agent_loop, _client

openai = pytest.importorskip("openai")

DEMO = "rlfoundry.agents.react_calculator"
SEEN: dict[str, str] = {}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def undeclared_tools(base_url, api_key, prompt, extra_info):
    """Offers the calculator without saying so in a TOOLS list: only its first request can tell."""
    try:
        _client(base_url, api_key).chat.completions.create(model="policy", messages=prompt, tools=TOOL_SCHEMAS)
    except openai.BadRequestError as e:
        SEEN["undeclared"] = f"{e.code}: {e.message}"


def test_the_demo_config_loads_its_agent_from_any_directory(tmp_path, monkeypatch):
    """The packaged demo names its agent by module, so a run started elsewhere finds the same function
    (before: ``scripts/react_calculator_agent.py``, relative to the working directory)."""
    from rlfoundry.agents import react_calculator
    from rlfoundry.trainer.config import load_config

    monkeypatch.chdir(tmp_path)
    settings = load_config([], config_name="calculator_openai_agent").actor_rollout_ref.rollout.agent.openai
    load_agent_function.cache_clear()
    assert settings.path == DEMO
    assert load_agent_function(settings.path, settings.name) is react_calculator.run_agent
    with pytest.raises(AgentLoopError, match=r"openai.path='scripts/react_calculator_agent.py' cannot be loaded"):
        load_agent_function("scripts/react_calculator_agent.py", "run_agent")  # the old, relative path


def _startup(tokenizer, chat_template_kwargs: dict, prompt_tools_known: bool = True) -> AgentLoop:
    agent = AgentConfig(default_agent_loop="openai_agent", openai=OpenAIAgentConfig(path=DEMO, name="run_agent"))
    return AgentLoop(None, tokenizer, MultiTurnConfig(enable=True), {}, 64, chat_template_kwargs, agent=agent,
                     prompt_tools_known=prompt_tools_known)


def test_an_agent_whose_tools_the_prompts_lack_fails_at_start_up(tokenizer):
    """The demo agent declares TOOLS: with no tool config the prompts offer none, and the loop refuses to
    start, naming the key; with the packaged calculator config (rendered the same as the agent's list,
    which is what lets its first request continue the data set's prompt) it starts."""
    with pytest.raises(AgentLoopError, match=r"offers the tools \['calculator'\].*rendered with no tools.*"
                                             r"actor_rollout_ref\.rollout\.multi_turn\.tool_config_path"):
        _startup(tokenizer, {})
    schemas = [t.get_openai_tool_schema().model_dump() for t in initialize_tools_from_config(TOOLS)]
    assert _startup(tokenizer, {"tools": schemas}).default_loop == "openai_agent"
    # no tool config: the prompts' tools may come from data.apply_chat_template_kwargs, which the worker
    # does not see; the check stands aside (the endpoint's 400 still names the key)
    assert _startup(tokenizer, {}, prompt_tools_known=False).default_loop == "openai_agent"


def test_an_undeclared_tool_list_gets_the_keys_in_its_400(tokenizer):
    """Prompts rendered without tools, an agent offering one: its first request does not continue the row's
    prompt, the rendered chat counts against the 40-token budget, and the 400 says which key fixes it."""
    question = "What is 123*456?"
    loop = _agent_loop(ScriptedPolicy(tokenizer, {question: [CALL]}), tokenizer, "undeclared_tools",
                       response_length=40, path="tests.workers.test_openai_agent_startup")
    loop.generate_sequences(_prompts(tokenizer, {}, [question]))
    assert SEEN["undeclared"].startswith("context_length_exceeded: ")
    assert "does not start with the data set's prompt" in SEEN["undeclared"]
    assert "actor_rollout_ref.rollout.multi_turn.tool_config_path" in SEEN["undeclared"]
