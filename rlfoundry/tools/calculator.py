"""A calculator tool: evaluates an arithmetic expression exactly (integers stay integers).

Only numbers, parentheses, + - * / // % ** and unary signs are accepted (parsed with ``ast``, never
``eval``); powers and results are bounded so that ``9**9**9`` is an error, not a hung worker.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.schemas import ToolResponse

__all__ = ["CalculatorTool", "evaluate"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_DIGITS = 1000  # a result longer than this is refused (and so is an exponent that would make one)


def evaluate(expression: str) -> int | float:
    """The value of ``expression``; ValueError with the reason for anything else."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * len(str(abs(int(left)))) > _MAX_DIGITS:
            raise ValueError("the power is too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise ValueError("division by zero") from e
        if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 4:
            raise ValueError("the result is too large")
        return value
    raise ValueError(f"unsupported element {ast.unparse(node)!r}: use numbers, + - * / // % ** and parentheses")


class CalculatorTool(BaseTool):
    """``calculator(expression)`` → the value as text, or ``error: ...``."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            return ToolResponse(text="error: give the expression as a string argument 'expression'"), 0.0, {"error": 1}
        try:
            value = evaluate(expression)
        except ValueError as e:
            return ToolResponse(text=f"error: {e}"), 0.0, {"error": 1}
        text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        return ToolResponse(text=text), 0.0, {}
