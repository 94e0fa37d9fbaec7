"""Primitive values, PreviewAny, a safe math expression node and a lazy switch."""
from __future__ import annotations

import ast
import json
import math
import operator
import reprlib
from dataclasses import dataclass
from typing import Any, Callable

from nodes.spec import Input, NodeOutput, NodeSpec, Output

INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def _primitive(node_id: str, display: str, type_: str, make_input, description: str) -> NodeSpec:
    return NodeSpec(
        node_id=node_id, display_name=display, category="utils/primitive", description=description,
        inputs=[make_input()], outputs=[Output(type_)], execute=lambda value: (value,),
    )


# A repr that stops a few levels down, so a deeply nested or self-containing value stays short.
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 2000


def _describe(value: Any) -> str:
    """One value that JSON cannot hold, as text: its own summary, its shape, or its repr."""
    summary = getattr(value, "preview_summary", None)
    if callable(summary):
        return summary()
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) == 0 and callable(getattr(value, "item", None)):
        value, shape = value.item(), None  # a numpy scalar or 0-d tensor is one value: show it
    if shape is not None:
        return f"{type(value).__name__} of shape {list(shape)}, dtype {getattr(value, 'dtype', '?')}"
    return _SHORT_REPR.repr(value)


def _preview_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if getattr(value, "shape", None) is not None or callable(getattr(value, "preview_summary", None)):
        return _describe(value)
    try:
        # `default` describes each value JSON cannot hold without calling json again, so no object
        # (a model, a value that refers to itself) can send this into endless recursion.
        return json.dumps(value, indent=2, default=_describe)
    except (TypeError, ValueError, RecursionError):  # circular or far too deeply nested
        return _describe(value)


def preview_any(source: Any) -> NodeOutput:
    return NodeOutput((), ui={"text": [_preview_text(source)]})


# ---------------------------------------------------------------------- math expressions
# The expression language is numbers in, numbers out: every value is an int, a float or a bool. Its cost
# is bounded in three ways, so that no expression can hold a worker: the text is short and shallow (so the
# number of steps is small), every operator and function is checked against the size of its result before
# it runs (so no single step is slow or large), and every intermediate result is checked after it runs.
MAX_EXPRESSION_CHARS = 4096
MAX_EXPRESSION_DEPTH = 100
MAX_INT_BITS = 4096
# round(x, n) builds 10**|n| for an int x; 1000 digits (about 3300 bits) stays under MAX_INT_BITS.
MAX_ROUND_DIGITS = 1000

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}
_CONSTANTS = {"pi": math.pi, "e": math.e, "True": True, "False": False}


class ExpressionError(ValueError):
    """An expression that is not valid arithmetic over the given names."""


def _bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _too_big(what: str) -> str:
    return f"{what} would have more than {MAX_INT_BITS} bits (the limit on integer size)"


def _binary_refusal(op: type, left: Any, right: Any) -> str | None:
    """Why `left op right` may not run, judged from its operands alone; None when it may."""
    both_int = isinstance(left, int) and isinstance(right, int)
    if op is ast.Pow and both_int and right > 0 and abs(left) > 1 and (_bits(left) - 1) * right > MAX_INT_BITS:
        return _too_big("a power")
    if op is ast.Mult and both_int and _bits(left) + _bits(right) - 1 > MAX_INT_BITS:
        return _too_big("a product")
    # Sums, differences, quotients and remainders of ints under the limit stay within one bit of it, and
    # float arithmetic is constant-time; _check_result catches that one bit.
    return None


def _round_refusal(arguments: list) -> str | None:
    if len(arguments) == 2:
        digits = arguments[1]
        if not isinstance(digits, int):
            return f"round's digit count must be an integer, not {digits!r}"
        if abs(digits) > MAX_ROUND_DIGITS:
            return f"round's digit count {digits} is beyond ±{MAX_ROUND_DIGITS} (the limit on rounding)"
    return None


def _pow_refusal(arguments: list) -> str | None:
    # math.pow works in floats, so its size is bounded by float overflow; the check keeps an int pair
    # from ever being handed on by a later change to operator.pow.
    return _binary_refusal(ast.Pow, *arguments) if len(arguments) == 2 else None


@dataclass(frozen=True)
class _Function:
    """A function the expression language offers: its arity and a check run on the arguments before it."""

    call: Callable[..., Any]
    min_arguments: int
    max_arguments: int
    refusal: Callable[[list], str | None] = lambda arguments: None


# Every function works on floats (bounded by float range) or returns a result no larger than its
# arguments, except the two with a check: round with a digit count and pow on ints.
_FUNCTIONS = {
    "min": _Function(min, 2, 100), "max": _Function(max, 2, 100), "abs": _Function(abs, 1, 1),
    "round": _Function(round, 1, 2, _round_refusal),
    "floor": _Function(math.floor, 1, 1), "ceil": _Function(math.ceil, 1, 1),
    "sqrt": _Function(math.sqrt, 1, 1), "sin": _Function(math.sin, 1, 1), "cos": _Function(math.cos, 1, 1),
    "tan": _Function(math.tan, 1, 1), "log": _Function(math.log, 1, 2), "exp": _Function(math.exp, 1, 1),
    "pow": _Function(math.pow, 2, 2, _pow_refusal),
    "int": _Function(int, 1, 1), "float": _Function(float, 1, 1), "bool": _Function(bool, 1, 1),
    "clamp": _Function(lambda x, low, high: max(low, min(high, x)), 3, 3),
}


def _check_result(value: Any, expression: str) -> Any:
    """Refuse an intermediate result outside the language's values or over the size limit."""
    if isinstance(value, complex):
        raise ExpressionError(f"{expression!r}: a step gave a complex number")
    if not isinstance(value, (int, float)):
        raise ExpressionError(f"{expression!r}: a step gave {type(value).__name__}, not a number")
    if isinstance(value, int) and _bits(value) > MAX_INT_BITS:
        raise ExpressionError(f"{expression!r}: an intermediate integer has more than {MAX_INT_BITS} bits "
                              f"(the limit on integer size)")
    return value


def _parse(expression: str) -> ast.Expression:
    """Parse, refusing text long or deep enough to make the parser or the walk costly."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression is {len(expression)} characters long; the limit is "
                              f"{MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"expression {expression!r} is not valid: {exc.msg}") from None
    except (RecursionError, MemoryError):  # the parser's own depth limit
        raise ExpressionError(f"expression nests deeper than {MAX_EXPRESSION_DEPTH} levels") from None
    pending = [(tree, 0)]
    while pending:  # depth measured without recursion, so the measuring cannot overflow the stack
        node, depth = pending.pop()
        if depth > MAX_EXPRESSION_DEPTH:
            raise ExpressionError(f"expression nests deeper than {MAX_EXPRESSION_DEPTH} levels")
        pending.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return tree


def evaluate_expression(expression: str, names: dict[str, Any]) -> Any:
    """Evaluate arithmetic over `names` by walking the syntax tree: no eval, no attribute access."""
    tree = _parse(expression)
    for name, value in names.items():
        if isinstance(value, complex) or not isinstance(value, (int, float)):
            raise ExpressionError(f"input {name!r} is {type(value).__name__}; expressions take numbers")
    number_names = {name: _check_result(value, expression) for name, value in names.items()}

    def walk(node: ast.AST) -> Any:
        return _check_result(step(node), expression)

    def run(operation: Callable[..., Any], *arguments: Any) -> Any:
        try:
            return operation(*arguments)
        except ZeroDivisionError:
            raise ExpressionError(f"division by zero in {expression!r}") from None
        except OverflowError:
            raise ExpressionError(f"{expression!r}: a result is too large for a float") from None
        except (ValueError, TypeError) as exc:  # sqrt(-1), log(0), floor(nan)
            raise ExpressionError(f"{expression!r}: {exc}") from None

    def step(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in number_names:
                return number_names[node.id]
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise ExpressionError(f"unknown name {node.id!r} in {expression!r}; inputs are {sorted(names)}")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            refusal = _binary_refusal(type(node.op), left, right)
            if refusal:
                raise ExpressionError(f"{expression!r}: {refusal}")
            return run(_BINARY[type(node.op)], left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BoolOp):
            values = [walk(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            left = walk(node.left)
            for op, comparator in zip(node.ops, node.comparators):
                right = walk(comparator)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return walk(node.body) if walk(node.test) else walk(node.orelse)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
                and not node.keywords:
            function = _FUNCTIONS[node.func.id]
            arguments = [walk(a) for a in node.args]
            if not function.min_arguments <= len(arguments) <= function.max_arguments:
                raise ExpressionError(f"{expression!r}: {node.func.id} takes {function.min_arguments} to "
                                      f"{function.max_arguments} arguments, not {len(arguments)}")
            refusal = function.refusal(arguments)
            if refusal:
                raise ExpressionError(f"{expression!r}: {refusal}")
            return run(function.call, *arguments)
        raise ExpressionError(f"unsupported syntax {type(node).__name__} in {expression!r}")

    return walk(tree)


def math_expression(expression: str, values: dict[str, Any]) -> tuple:
    result = evaluate_expression(expression, {k: v for k, v in values.items() if v is not None})
    try:
        number = float(result)
    except OverflowError:
        raise ExpressionError(f"{expression!r}: the result is too large for the FLOAT output") from None
    if isinstance(result, int) and not isinstance(result, bool):
        as_int = result
    else:
        as_int = int(math.floor(number)) if math.isfinite(number) else 0
    return number, as_int, bool(result)


# ---------------------------------------------------------------------- switch
def switch_lazy(switch: bool, on_false: Any = None, on_true: Any = None) -> list[str]:
    return ["on_true" if switch else "on_false"]


def switch(switch: bool, on_false: Any = None, on_true: Any = None) -> tuple:
    return (on_true if switch else on_false,)


NODES = [
    _primitive("PrimitiveInt", "Int", "INT",
               lambda: Input.int("value", 0, min=INT_MIN, max=INT_MAX, control_after_generate=True),
               "An integer constant."),
    _primitive("PrimitiveFloat", "Float", "FLOAT", lambda: Input.float("value", 0.0, min=-1e308, max=1e308),
               "A floating-point constant."),
    _primitive("PrimitiveString", "String", "STRING", lambda: Input.string("value", ""), "A one-line string."),
    _primitive("PrimitiveStringMultiline", "String (Multiline)", "STRING",
               lambda: Input.string("value", "", multiline=True), "A multi-line string."),
    _primitive("PrimitiveBoolean", "Boolean", "BOOLEAN", lambda: Input.boolean("value", False), "A boolean."),
    NodeSpec(
        node_id="PreviewAny", display_name="Preview Any", category="utils",
        description="Shows any value as text in the editor (and in the run's outputs).",
        inputs=[Input.link("source", "*")], outputs=[], output_node=True, execute=preview_any,
    ),
    NodeSpec(
        node_id="ComfyMathExpression", display_name="Math Expression", category="math",
        description="Evaluates arithmetic over its inputs a, b, c, ... (+ - * / // % **, comparisons, "
                    "min, max, abs, round, floor, ceil, sqrt, ...). No Python code runs.",
        inputs=[
            Input.string("expression", "a + b", multiline=True, tooltip="Arithmetic over the inputs' names"),
            Input.autogrow("values", Input.link("value", "FLOAT,INT,BOOLEAN"),
                           names=tuple("abcdefghijklmnopqrstuvwxyz"), min=1),
        ],
        outputs=[Output("FLOAT"), Output("INT"), Output("BOOLEAN", "BOOL")],
        execute=math_expression,
    ),
    NodeSpec(
        node_id="ComfySwitchNode", display_name="Switch", category="logic",
        description="Passes on_true or on_false through; only the chosen branch is computed.",
        inputs=[
            Input.match_type("on_false", "T", lazy=True, optional=False),
            Input.match_type("on_true", "T", lazy=True, optional=False),
            Input.boolean("switch", False),
        ],
        outputs=[Output("COMFY_MATCHTYPE_V3", "output", match_type="T")],
        execute=switch, check_lazy_status=switch_lazy,
    ),
]
