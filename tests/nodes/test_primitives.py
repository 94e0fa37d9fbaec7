"""The math expression node: arithmetic only, and no step of it may grow without bound."""
from __future__ import annotations

import time

import pytest

from nodes.primitives import MAX_INT_BITS, ExpressionError, evaluate_expression, math_expression


def test_runaway_power_of_a_power_is_refused_before_it_is_computed():
    started = time.perf_counter()
    with pytest.raises(ExpressionError, match=f"more than {MAX_INT_BITS} bits"):
        evaluate_expression("(9**9999)**2500", {})
    with pytest.raises(ExpressionError, match=f"{MAX_INT_BITS} bits"):
        evaluate_expression("(a**a)**a", {"a": 9999})
    # A value over the limit is refused where it first appears, not at the end.
    with pytest.raises(ExpressionError, match="intermediate integer"):
        evaluate_expression("a - a", {"a": 2**5000})
    assert time.perf_counter() - started < 30  # a generous ceiling: the old code took about a minute


def test_products_and_pow_calls_are_bounded_too():
    with pytest.raises(ExpressionError, match=f"{MAX_INT_BITS} bits"):
        evaluate_expression("a * a * a * a * a * a * a * a * a * a", {"a": 2**1000})
    with pytest.raises(ExpressionError, match="too large for a float"):
        evaluate_expression("pow(10.0, 400)", {})
    with pytest.raises(ExpressionError, match="too large for a float"):
        evaluate_expression("10.0 ** 400", {})


def test_ordinary_arithmetic_is_unchanged():
    assert evaluate_expression("2**64 + 1", {}) == 2**64 + 1
    assert evaluate_expression("a * b", {"a": 2**2000, "b": 2**2000}) == 2**4000
    assert math_expression("a + b", {"a": 1, "b": 2.5}) == (3.5, 3, True)
    assert math_expression("max(a, 3) // 2", {"a": 10}) == (5.0, 5, True)


def test_a_sixteen_character_round_cannot_hold_a_worker():
    # round(5, -10**8) built 10**(10**8) inside round, past every operator check.
    with pytest.raises(ExpressionError, match="round's digit count"):
        evaluate_expression("round(5, -10**8)", {})
    with pytest.raises(ExpressionError, match="round's digit count"):
        evaluate_expression("round(a, -a)", {"a": 10**8})
    with pytest.raises(ExpressionError, match="round's digit count must be an integer"):
        evaluate_expression("round(5, 1.5)", {})
    assert evaluate_expression("round(123456, -3)", {}) == 123000
    assert evaluate_expression("round(2.675, 2)", {}) == round(2.675, 2)


@pytest.mark.parametrize("expression", [
    "pow(2, 10**6)", "pow(10**300, 10**300)", "exp(10**4)", "floor(10.0**308 * 10)", "ceil(a / 0.0)",
    "sqrt(-1)", "log(0)", "log(a, 1)", "int(a / 0.0)", "sin(2**4000)", "a // 0", "a % 0", "min(1)",
    "2**4000 * 2**4000", "(2**4096) + (2**4096)", "float(2**4096)", "(-8) ** 0.5", "clamp(1, 2)",
])
def test_every_function_and_operator_refuses_a_result_it_cannot_bound(expression):
    with pytest.raises(ExpressionError):
        evaluate_expression(expression, {"a": 1})


@pytest.mark.parametrize("expression, why", [
    ("-" * 3000 + "1", "deeper than"),
    ("1" + "+1" * 3000, "characters long|deeper than"),
    ("(" * 250 + "1" + ")" * 250, "not valid"),  # the parser's own limit
    ("a" + " " * 5000, "characters long"),
])
def test_long_or_deep_expressions_are_refused_before_they_are_walked(expression, why):
    with pytest.raises(ExpressionError, match=why):
        evaluate_expression(expression, {"a": 1})


def test_inputs_must_be_numbers():
    # A pack node wired to a FLOAT input may still hand over a string; "%99999999d" % 1 must not run.
    with pytest.raises(ExpressionError, match="input 'a' is str"):
        evaluate_expression("a % b", {"a": "%099999999d", "b": 1})
    with pytest.raises(ExpressionError, match="input 'a' is list"):
        evaluate_expression("a * 100000", {"a": [1]})


def test_an_int_result_too_large_for_a_float_output_is_a_clear_error():
    with pytest.raises(ExpressionError, match="too large for the FLOAT output"):
        math_expression("2**2000", {})


def test_every_offered_function_is_exercised_within_its_bounds():
    from nodes.primitives import _FUNCTIONS
    calls = {"min": "min(a, 2)", "max": "max(a, 2)", "abs": "abs(-a)", "round": "round(a, 3)",
             "floor": "floor(a)", "ceil": "ceil(a)", "sqrt": "sqrt(a)", "sin": "sin(a)", "cos": "cos(a)",
             "tan": "tan(a)", "log": "log(a, 2)", "exp": "exp(a)", "pow": "pow(a, 2)", "int": "int(a)",
             "float": "float(a)", "bool": "bool(a)", "clamp": "clamp(a, 0, 1)"}
    assert set(calls) == set(_FUNCTIONS), "a new function needs a bound and a line here"
    for call in calls.values():
        evaluate_expression(call, {"a": 1.5})
