"""A ReAct agent for the calculator task, written only against the OpenAI chat API (the ``openai`` client).

It knows nothing of rlfoundry's training: trained through ``agent_name: openai_agent``
(``rlfoundry train --config-name calculator_openai_agent``, from any directory: the config names it by module,
``rlfoundry.agents.react_calculator``), it is handed a ``base_url`` and ``api_key``. ``TOOLS`` is the list it
offers; the start-up check compares it with the tools the data set's prompts are rendered with.
The calculator is its own function; its replies are the texts of ``rlfoundry/tools/calculator.py``.
"""

import json

from openai import BadRequestError, OpenAI

from rlfoundry.tools.calculator import evaluate  # any safe arithmetic evaluator would do

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": 'The expression, e.g. "123 * 456 + 7".'}}}}}]


def calculator(arguments: str) -> str:
    expression = json.loads(arguments).get("expression")
    if not isinstance(expression, str):
        return "error: give the expression as a string argument 'expression'"
    try:
        value = evaluate(expression)
    except ValueError as e:
        return f"error: {e}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def run_agent(base_url: str, api_key: str, prompt: list, extra_info: dict, max_turns: int = 2) -> str | None:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    for _ in range(max_turns):  # think/act, observe, ... until an answer without a call
        try:
            choice = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0]
        except BadRequestError as e:  # the conversation outgrew the context: no answer, as with any API
            if getattr(e, "code", None) == "context_length_exceeded":
                return None
            raise
        if not choice.message.tool_calls or choice.finish_reason == "length":
            return choice.message.content
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            known = call.function.name == "calculator"
            text = calculator(call.function.arguments) if known else \
                f"error: no tool named {call.function.name!r}; available: ['calculator']"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return None
