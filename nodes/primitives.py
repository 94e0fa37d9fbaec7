"""Primitive values, PreviewAny, a safe math expression node and a lazy switch."""
from __future__ import annotations

import ast
import json
import math
import operator
from typing import Any

from nodes.spec import Input, NodeOutput, NodeSpec, Output

INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def _primitive(node_id: str, display: str, type_: str, make_input, description: str) -> NodeSpec:
    return NodeSpec(
        node_id=node_id, display_name=display, category="utils/primitive", description=description,
        inputs=[make_input()], outputs=[Output(type_)], execute=lambda value: (value,),
    )


def _preview_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) == 0 and callable(getattr(value, "item", None)):
        value, shape = value.item(), None  # a numpy scalar or 0-d tensor is one value: show it
    if shape is not None:
        return f"{type(value).__name__} of shape {list(shape)}, dtype {getattr(value, 'dtype', '?')}"
    try:
        return json.dumps(value, indent=2, default=lambda o: _preview_text(o))
    except (TypeError, ValueError):
        return repr(value)


def preview_any(source: Any) -> NodeOutput:
    return NodeOutput((), ui={"text": [_preview_text(source)]})


# ---------------------------------------------------------------------- math expressions
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
}
_FUNCTIONS = {
    "min": min, "max": max, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil,
    "sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan, "log": math.log,
    "exp": math.exp, "pow": math.pow, "int": int, "float": float, "bool": bool,
    "clamp": lambda x, low, high: max(low, min(high, x)),
}
_CONSTANTS = {"pi": math.pi, "e": math.e, "True": True, "False": False}
_MAX_POWER = 10_000  # keeps 10**10**10 from freezing the process
# Every intermediate result stays under these sizes, so no step of an expression can hold the
# process for long: (9**9999)**2500 is refused before it is computed, not after a minute.
MAX_INT_BITS = 4096
MAX_SEQUENCE_LENGTH = 10_000


class ExpressionError(ValueError):
    """An expression that is not valid arithmetic over the given names."""


def _bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_operands(op: ast.operator, left: Any, right: Any, expression: str) -> None:
    """Refuse a multiplication or power whose integer result would pass MAX_INT_BITS (before computing it)."""
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0 \
            and abs(left) > 1 and (_bits(left) - 1) * right > MAX_INT_BITS:
        raise ExpressionError(f"{expression!r}: a power would have more than {MAX_INT_BITS} bits "
                              f"(the limit on integer size)")
    if isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int) \
            and _bits(left) + _bits(right) - 1 > MAX_INT_BITS:
        raise ExpressionError(f"{expression!r}: a product would have more than {MAX_INT_BITS} bits "
                              f"(the limit on integer size)")
    if isinstance(op, ast.Mult) and isinstance(left, (str, list, tuple)) != isinstance(right, (str, list, tuple)):
        count = right if isinstance(left, (str, list, tuple)) else left
        sequence = left if isinstance(left, (str, list, tuple)) else right
        if isinstance(count, int) and len(sequence) * count > MAX_SEQUENCE_LENGTH:
            raise ExpressionError(f"{expression!r}: a repeated sequence would be longer than "
                                  f"{MAX_SEQUENCE_LENGTH} items (the limit on string and list length)")


def _check_result(value: Any, expression: str) -> Any:
    """Refuse an intermediate result over the size limits."""
    if isinstance(value, int) and _bits(value) > MAX_INT_BITS:
        raise ExpressionError(f"{expression!r}: an intermediate integer has more than {MAX_INT_BITS} bits "
                              f"(the limit on integer size)")
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_SEQUENCE_LENGTH:
        raise ExpressionError(f"{expression!r}: an intermediate value is longer than {MAX_SEQUENCE_LENGTH} "
                              f"items (the limit on string and list length)")
    return value


def evaluate_expression(expression: str, names: dict[str, Any]) -> Any:
    """Evaluate arithmetic over `names` by walking the syntax tree: no eval, no attribute access."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"expression {expression!r} is not valid: {exc.msg}") from None

    def walk(node: ast.AST) -> Any:
        return _check_result(step(node), expression)

    def step(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise ExpressionError(f"unknown name {node.id!r} in {expression!r}; inputs are {sorted(names)}")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
                raise ExpressionError(f"exponent {right} too large in {expression!r}")
            _check_operands(node.op, left, right, expression)
            try:
                return _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ExpressionError(f"division by zero in {expression!r}") from None
            except OverflowError:
                raise ExpressionError(f"{expression!r}: a result is too large for a float") from None
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
            arguments = [walk(a) for a in node.args]
            if node.func.id == "pow" and len(arguments) == 2:
                _check_operands(ast.Pow(), *arguments, expression)
            try:
                return _FUNCTIONS[node.func.id](*arguments)
            except OverflowError:
                raise ExpressionError(f"{expression!r}: a result is too large for a float") from None
        raise ExpressionError(f"unsupported syntax {type(node).__name__} in {expression!r}")

    return walk(tree)


def math_expression(expression: str, values: dict[str, Any]) -> tuple:
    result = evaluate_expression(expression, {k: v for k, v in values.items() if v is not None})
    if isinstance(result, complex):
        raise ExpressionError(f"expression {expression!r} gave a complex number")
    number = float(result)
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
