"""The triton backend of the unified Linear: parity with eager under Triton's CPU interpreter, and its refusals.

No GPU here, so the kernel runs through Triton's interpreter (TRITON_INTERPRET=1), which must be set
before triton is imported: every parity case runs in ONE subprocess started with it (this file run
as a script), which reports per case; the pytest process itself never interprets. The in-process
tests check what a machine without CUDA does with the backend: declines, says why, is never chosen.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {"float32": dict(atol=2e-4, rtol=2e-4), "bfloat16": dict(atol=6e-2, rtol=3e-2),
             "float16": dict(atol=1e-2, rtol=1e-2)}
SCALES = (None, "scalar", "channel", "full", "sample")


def parity_cases() -> list[dict]:
    """Every case the interpreter subprocess runs: name -> shapes, dtype, prologue, epilogue."""
    cases = []
    # Every prologue x epilogue combination, float32, 3-D x (2, 3, .) over two N tiles and two K steps.
    for prologue, bias, residual, scale in itertools.product((None, "rms_norm", "swiglu", "gelu_tanh"), (True, False),
                                                              (True, False), SCALES):
        cases.append(dict(prologue=prologue, dtype="float32", rows=(2, 3), k=20, n=18, bias=bias,
                          residual=residual, scale=scale))
    # bfloat16: each prologue with a few epilogues (each epilogue kind appears once per prologue pair).
    for prologue, (bias, residual, scale) in itertools.product(
            (None, "rms_norm", "swiglu", "gelu_tanh"),
            ((True, True, "channel"), (False, True, "sample"), (True, False, "full"), (False, False, None),
             (True, True, "scalar"))):
        cases.append(dict(prologue=prologue, dtype="bfloat16", rows=(2, 3), k=20, n=18, bias=bias,
                          residual=residual, scale=scale))
    # Odd sizes over several tiles in M, N and K (and a partial band of row tiles), both dtypes.
    for prologue, dtype in itertools.product((None, "rms_norm", "swiglu", "gelu_tanh"), ("float32", "bfloat16")):
        cases.append(dict(prologue=prologue, dtype=dtype, rows=(37,), k=48, n=29, bias=True, residual=True,
                          scale="channel"))
    # A batch of one row: (1, K) and a bare (K,) vector.
    for prologue, rows in (("rms_norm", (1,)), ("swiglu", (1,)), ("gelu_tanh", ()), (None, ())):
        cases.append(dict(prologue=prologue, dtype="float32", rows=rows, k=24, n=9, bias=True, residual=True,
                          scale="scalar"))
    cases.append(dict(prologue="rms_norm", dtype="bfloat16", rows=(1, 1), k=20, n=12, bias=False, residual=True,
                      scale="sample"))
    # 4-D x with a per-sample gate (B, 1, 1, N); a residual of another dtype than x (the output takes it).
    cases.append(dict(prologue="gelu_tanh", dtype="float32", rows=(2, 2, 3), k=16, n=17, bias=True, residual=True,
                      scale="sample"))
    cases.append(dict(prologue="swiglu", dtype="bfloat16", rows=(5,), k=16, n=20, bias=True, residual=True,
                      residual_dtype="float32", scale="channel"))
    cases.append(dict(prologue=None, dtype="float32", rows=(4,), k=16, n=20, bias=True, residual=True,
                      residual_dtype="bfloat16", scale="full"))
    # Non-contiguous inputs: x a strided slice, weight a transposed view, residual transposed.
    cases.append(dict(prologue="rms_norm", dtype="float32", rows=(7,), k=20, n=18, bias=True, residual=True,
                      scale="channel", strided=True))
    cases.append(dict(prologue="swiglu", dtype="bfloat16", rows=(7,), k=20, n=18, bias=False, residual=True,
                      scale="full", strided=True))
    # rms_norm without a norm weight, and float16.
    cases.append(dict(prologue="rms_norm", dtype="float32", rows=(5,), k=20, n=18, bias=True, residual=False,
                      scale=None, norm_weight=False))
    cases.append(dict(prologue="rms_norm", dtype="float16", rows=(5,), k=20, n=18, bias=True, residual=True,
                      scale="channel"))
    cases.append(dict(prologue="gelu_tanh", dtype="float16", rows=(5,), k=20, n=18, bias=False, residual=False,
                      scale="scalar"))
    for case in cases:
        case["name"] = "-".join(str(case[key]) for key in ("prologue", "dtype", "rows", "k", "n")) + (
            f"-bias{int(case['bias'])}-res{int(case['residual'])}-scale_{case['scale']}"
            f"{'-res_' + case['residual_dtype'] if 'residual_dtype' in case else ''}"
            f"{'-strided' if case.get('strided') else ''}{'-no_norm_weight' if case.get('norm_weight') is False else ''}")
    return cases


def make_inputs(case: dict, seed: int) -> tuple[tuple, dict]:
    """The (x, weight, bias) and keyword arguments of one case, seeded."""
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case["dtype"])
    rows, k, n, prologue = tuple(case["rows"]), case["k"], case["n"], case["prologue"]

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=generator).to(dtype)

    x_features = 2 * k if prologue == "swiglu" else k
    if case.get("strided"):
        x = randn(*rows, 2 * x_features)[..., ::2]  # every other feature: stride 2 along K
        weight = (randn(k, n) / k ** 0.5).t()  # (N, K) with stride (1, N)
    else:
        x = randn(*rows, x_features)
        weight = randn(n, k) / k ** 0.5
    kwargs = dict(prologue=prologue)
    if prologue == "rms_norm" and case.get("norm_weight", True):
        kwargs["prologue_weight"] = 1 + 0.1 * randn(k)
    if case["residual"]:
        residual_dtype = getattr(torch, case.get("residual_dtype", case["dtype"]))
        if case.get("strided"):
            kwargs["residual"] = randn(n, *rows, dtype=residual_dtype).movedim(0, -1)
        else:
            kwargs["residual"] = randn(*rows, n, dtype=residual_dtype)
    scale = case["scale"]
    if scale == "scalar":
        kwargs["residual_scale"] = 0.5
    elif scale == "channel":
        kwargs["residual_scale"] = randn(n)
    elif scale == "full":
        kwargs["residual_scale"] = randn(*rows, n)
    elif scale == "sample":  # a per-sample gate: (B, 1, ..., N)
        kwargs["residual_scale"] = randn(*(rows[:1] + (1,) * (len(rows) - 1)), n)
    bias = randn(n) if case["bias"] else None
    return (x, weight, bias), kwargs


def run_cases_here() -> dict:
    """Run every case through the triton backend in this (interpreting) process; results by case name."""
    from kernels.linear import LINEAR, linear, linear_eager
    from kernels.triton_linear import interpreting

    report = {"interpreting": interpreting(), "cases": {}, "dispatch": {}}
    for seed, case in enumerate(parity_cases()):
        (x, weight, bias), kwargs = make_inputs(case, seed)
        result = {}
        try:
            result["decline"] = LINEAR.backend("triton").decline_reason(x, weight, bias, **kwargs)
            out = LINEAR(x, weight, bias, backend="triton", **kwargs)
            result["backend"] = LINEAR.last_backend
            expected = linear_eager(x, weight, bias, **kwargs)
            result["shape"], result["expected_shape"] = list(out.shape), list(expected.shape)
            result["dtype"], result["expected_dtype"] = str(out.dtype), str(expected.dtype)
            result["max_error"] = (out.float() - expected.float()).abs().max().item()
            try:
                # The looser of x's and the output's dtype: a bfloat16 output rounds where float32 x did not.
                loosest = max((case["dtype"], case.get("residual_dtype", case["dtype"])),
                              key=lambda name: TOLERANCE[name]["atol"])
                torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[loosest])
                result["close"] = True
            except AssertionError as error:
                result["close"], result["mismatch"] = False, str(error)[:600]
        except Exception as error:  # reported per case, so one failure does not hide the others
            result["error"] = f"{type(error).__name__}: {error}"[:600]
        report["cases"][case["name"]] = result

    # Dispatch under the interpreter: automatic choice passes it over, the environment forces it.
    (x, weight, bias), kwargs = make_inputs(parity_cases()[0], 0)
    linear(x, weight, bias, **kwargs)
    report["dispatch"]["automatic"] = LINEAR.last_backend
    os.environ["WEFT_KERNEL_BACKEND"] = "triton"
    try:
        out = linear(x, weight, bias, **kwargs)
        report["dispatch"]["env_forced"] = LINEAR.last_backend
        report["dispatch"]["env_forced_close"] = torch.allclose(out, linear_eager(x, weight, bias, **kwargs),
                                                                atol=2e-4, rtol=2e-4)
    finally:
        del os.environ["WEFT_KERNEL_BACKEND"]
    return report


TRITON_MISSING = importlib.util.find_spec("triton") is None
needs_triton = pytest.mark.skipif(TRITON_MISSING, reason="the triton package is not installed")


@pytest.fixture(scope="module")
def interpreter_report() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("WEFT_KERNEL_BACKEND", None)
    completed = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
    if completed.returncode != 0:
        pytest.fail(f"the interpreter subprocess failed (rc {completed.returncode}):\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("case", parity_cases(), ids=lambda case: case["name"])
def test_triton_kernel_matches_eager_under_the_interpreter(interpreter_report, case):
    assert interpreter_report["interpreting"]
    result = interpreter_report["cases"][case["name"]]
    assert "error" not in result, result["error"]
    assert result["decline"] is None
    assert result["backend"] == "triton"
    assert result["shape"] == result["expected_shape"]
    assert result["dtype"] == result["expected_dtype"]
    assert result["close"], f"max error {result['max_error']}: {result.get('mismatch')}"


@needs_triton
def test_interpreter_runs_only_when_forced(interpreter_report):
    dispatch = interpreter_report["dispatch"]
    assert dispatch["automatic"] != "triton"
    assert dispatch["env_forced"] == "triton" and dispatch["env_forced_close"]


# ---------------------------------------------------------------------------------------------
# In this process: no interpreter (and no CUDA device on this machine).

def _not_interpreting():
    from kernels import triton_linear

    if triton_linear.interpreting():
        pytest.skip("this pytest process runs with TRITON_INTERPRET set")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the backend is meant to run here")


def test_backend_declines_cpu_tensors_with_a_readable_reason():
    from kernels import triton_linear

    _not_interpreting()
    x, weight = torch.randn(3, 8), torch.randn(4, 8)
    reason = triton_linear.check(x, weight)
    assert reason is not None and "CUDA" in reason and "cpu" in reason
    if not TRITON_MISSING:
        assert "no CUDA device" in triton_linear.available()


def test_check_names_what_it_cannot_take(monkeypatch):
    from kernels import triton_linear

    monkeypatch.setattr(triton_linear, "interpreting", lambda: True)  # so the device check passes on CPU
    x, weight = torch.randn(3, 8), torch.randn(4, 8)
    assert triton_linear.check(x, weight) is None
    assert "float64" in triton_linear.check(x.double(), weight.double())
    assert "differ in dtype" in triton_linear.check(x, weight.bfloat16())
    assert "require grad" in triton_linear.check(x, weight.requires_grad_())
    with torch.no_grad():
        assert triton_linear.check(x, weight) is None
    assert "residual has dtype torch.int64" in triton_linear.check(x, weight.detach(),
                                                                   residual=torch.zeros(3, 4, dtype=torch.long))
    assert "empty" in triton_linear.check(torch.randn(0, 8), weight.detach())
    assert "different devices" in triton_linear.check(x, weight.detach(), bias=torch.zeros(4, device="meta"))


def test_forcing_it_here_raises_naming_why(monkeypatch):
    from kernels import registry
    from kernels.linear import LINEAR, linear

    _not_interpreting()
    x, weight = torch.randn(3, 8), torch.randn(4, 8)
    monkeypatch.setenv(registry.ENV_VAR, "triton")
    with pytest.raises(ValueError, match=r"backend 'triton' \(forced by WEFT_KERNEL_BACKEND='triton'\) cannot run "
                                         r"this call: .*(CUDA|not installed)"):
        linear(x, weight)
    monkeypatch.delenv(registry.ENV_VAR)
    with pytest.raises(ValueError, match="'triton'.*cannot run this call"):
        LINEAR(x, weight, backend="triton")


def test_automatic_choice_on_cpu_never_picks_it():
    from kernels.linear import LINEAR, linear

    _not_interpreting()
    assert LINEAR.names().index("triton") < LINEAR.names().index("compiled")  # tried first where it can run
    assert "triton" not in LINEAR.available_names()
    for prologue in (None, "rms_norm", "swiglu", "gelu_tanh"):
        x = torch.randn(2, 5, 16 if prologue == "swiglu" else 8)
        linear(x, torch.randn(4, 8), prologue=prologue, residual=torch.randn(2, 5, 4))
        assert LINEAR.last_backend != "triton"


def test_module_imports_and_reports_without_triton():
    """With triton unimportable, kernels.linear still imports and the backend says triton is missing."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from kernels.linear import LINEAR, linear\n"
            "import torch\n"
            "print(LINEAR.backend('triton').unavailable_reason())\n"
            "linear(torch.randn(2, 4), torch.randn(3, 4)); print(LINEAR.last_backend)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("WEFT_KERNEL_BACKEND", None)
    completed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    reason, backend = completed.stdout.strip().splitlines()[-2:]
    assert reason == "the triton package is not installed"
    assert backend == "eager"


if __name__ == "__main__":
    # The interpreter subprocess: TRITON_INTERPRET=1 is in the environment before anything imports triton.
    sys.path.insert(0, str(ROOT))
    torch.set_grad_enabled(False)
    print(json.dumps(run_cases_here()))


def test_a_kernel_that_fails_to_build_passes_the_call_on(monkeypatch):
    """A compile or launch failure is remembered per shape class and reported as BackendUnavailable,
    which the registry answers by trying the next backend (never by failing the job)."""
    from kernels import triton_linear
    from kernels.registry import BackendUnavailable

    launches = []

    class BrokenKernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                raise RuntimeError("PassManager::run failed")
            return launch

    monkeypatch.setattr(triton_linear, "_build_kernel", lambda interpret: BrokenKernel())
    monkeypatch.setattr(triton_linear, "_failures", {})
    x, weight = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(BackendUnavailable, match="PassManager::run failed"):
        triton_linear.linear_triton(x, weight, prologue="rms_norm")
    with pytest.raises(BackendUnavailable, match="failed for this shape class"):
        triton_linear.linear_triton(x, weight, prologue="rms_norm")
    assert len(launches) == 1  # the second call declined without trying again
