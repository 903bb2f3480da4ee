"""Arithmetic for the `calculator` tool: the expression is parsed with `ast` and only numbers,
+ - * / // % **, unary signs, parentheses and a few functions are evaluated. Nothing is ever
passed to `eval`, so a model cannot run code through it, and sizes are bounded so that `9**9**9`
is an error message rather than a frozen process."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from clawr1.envs.tools import ToolError

MAX_CHARS = 500
MAX_EXPONENT = 1000
MAX_INT_BITS = 4096
MAX_NDIGITS = 1000

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., Any]] = {
    "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt,
}


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression. Raises `ToolError` for anything else, for division
    by zero and for results too large to be useful."""
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}: {err.msg}") from None
    return _eval(tree.body)


def format_number(value: float) -> str:
    """Integers exactly, floats to 12 significant digits (so 0.1 + 0.2 reads 0.3)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result is too large") from None
        return _bounded(value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        args = [_eval(a) for a in node.args]
        if node.func.id == "round":
            _check_round(args)
        try:
            return _bounded(_FUNCS[node.func.id](*args))
        except (TypeError, ValueError, OverflowError) as err:
            raise ToolError(f"{node.func.id}: {err}") from None
    raise ToolError(f"unsupported expression: {ast.unparse(node)!r} (numbers, + - * / // % **, parentheses, "
                    f"{', '.join(_FUNCS)} only)")


def _check_power(base: float, exponent: float) -> None:  # float: int included (PEP 484)
    """Refuse a power whose integer result would be too large before Python computes it: the
    size check on the result comes too late for `(2**4000) ** 999`, which is millions of bits."""
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent {exponent} is too large (at most {MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and (base.bit_length() - 1) * exponent > MAX_INT_BITS:
        raise ToolError("result is too large")


def _check_round(args: list[int | float]) -> None:
    """`round(int, -n)` computes 10**n before anything can check the result, holding the GIL
    (n = 10**9 never returns), so `ndigits` is bounded first."""
    if len(args) == 2 and isinstance(args[1], int) and abs(args[1]) > MAX_NDIGITS:
        raise ToolError(f"round: ndigits {args[1]} is out of range (at most {MAX_NDIGITS} either way)")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError("result is too large")
    return value
