"""Parity of every linear backend available here against eager, prologue/epilogue combinations, dispatch rules."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels import registry
from kernels.linear import LINEAR, linear, linear_eager

TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=6e-2, rtol=3e-2)}


def make_inputs(rows_shape, in_features, out_features, dtype, *, prologue=None, bias=True, residual=False,
                scale=None, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    x_features = 2 * in_features if prologue == "swiglu" else in_features
    kwargs = dict(prologue=prologue)
    if prologue == "rms_norm":
        kwargs["prologue_weight"] = 1 + 0.1 * randn(in_features)
    if residual:
        kwargs["residual"] = randn(*rows_shape, out_features)
    if scale == "scalar":
        kwargs["residual_scale"] = 0.5
    elif scale == "channel":
        kwargs["residual_scale"] = randn(out_features)
    elif scale == "sample":  # a per-sample gate (B, 1, N), as adaLN models use
        kwargs["residual_scale"] = randn(rows_shape[0], *([1] * (len(rows_shape) - 1)), out_features)
    x = randn(*rows_shape, x_features)
    weight = randn(out_features, in_features) / in_features ** 0.5
    return (x, weight, randn(out_features) if bias else None), kwargs


def test_eager_matches_the_formula_written_out():
    (x, weight, bias), kw = make_inputs((2, 5), 16, 8, torch.float32, prologue="rms_norm", residual=True,
                                        scale="channel")
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * kw["prologue_weight"]
    expected = kw["residual"] + kw["residual_scale"] * (xf @ weight.T + bias)
    torch.testing.assert_close(linear_eager(x, weight, bias, **kw), expected, atol=1e-5, rtol=1e-5)
    (x, weight, bias), kw = make_inputs((3,), 6, 5, torch.float32, prologue="swiglu")
    expected = (F.silu(x[:, :6]) * x[:, 6:]) @ weight.T + bias
    torch.testing.assert_close(linear_eager(x, weight, bias, **kw), expected)


@pytest.mark.parametrize("prologue,bias,residual,scale", [
    (p, b, r, s) for p, b, r, s in itertools.product((None, "rms_norm", "swiglu", "gelu_tanh"), (True, False),
                                                      (True, False), (None, "scalar", "channel", "sample"))
    if not (s is not None and not r and p == "gelu_tanh")])  # keep the grid small but every pair covered
def test_every_prologue_epilogue_combination_through_the_public_function(prologue, bias, residual, scale):
    (x, weight, b), kw = make_inputs((2, 3), 12, 7, torch.float32, prologue=prologue, bias=bias,
                                     residual=residual, scale=scale)
    out = linear(x, weight, b, **kw)
    assert out.shape == (2, 3, 7)
    # Independent computation of the same formula.
    h = x
    if prologue == "rms_norm":
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * kw["prologue_weight"]
    elif prologue == "swiglu":
        h = F.silu(x[..., :12]) * x[..., 12:]
    elif prologue == "gelu_tanh":
        h = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))
    y = h @ weight.T + (b if b is not None else 0)
    if scale is not None:
        y = y * kw["residual_scale"]
    if residual:
        y = y + kw["residual"]
    torch.testing.assert_close(out, y, atol=1e-5, rtol=1e-5)


# The compiled backend compiles once per shape class (seconds each on a CPU), so its parity runs
# over a few classes that together cover each prologue, both dtypes, odd sizes, batch 1 and a
# token count that changes between calls (the dynamic dimension).
COMPILED_CASES = [
    ("rms_norm", torch.float32, [(1, 37), (3, 19)], 33, 17, True, True, "channel"),
    ("rms_norm", torch.bfloat16, [(1, 1)], 20, 12, False, True, "sample"),  # the folded norm weight in bf16
    ("swiglu", torch.bfloat16, [(1, 9)], 24, 40, False, True, "scalar"),
    ("gelu_tanh", torch.float32, [(5,)], 31, 13, True, False, None),
]


def _backends_here():
    names = []
    for name in LINEAR.names():
        if LINEAR.backend(name).unavailable_reason() is None:
            names.append(name)
    return names


@pytest.mark.parametrize("name", [n for n in _backends_here() if n != "eager"])
@pytest.mark.parametrize("case", COMPILED_CASES, ids=lambda c: f"{c[0]}-{str(c[1]).split('.')[1]}")
def test_backend_parity_with_eager(name, case):
    prologue, dtype, row_shapes, in_features, out_features, bias, residual, scale = case
    for seed, rows_shape in enumerate(row_shapes):
        (x, weight, b), kw = make_inputs(rows_shape, in_features, out_features, dtype, prologue=prologue,
                                         bias=bias, residual=residual, scale=scale, seed=seed)
        reason = LINEAR.backend(name).decline_reason(x, weight, b, **kw)
        if reason is not None:
            pytest.skip(f"{name} declines here: {reason}")
        out = LINEAR(x, weight, b, backend=name, **kw)
        assert LINEAR.last_backend == name
        expected = linear_eager(x, weight, b, **kw)
        assert out.dtype == expected.dtype and out.shape == expected.shape
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_bfloat16_close_to_float32(dtype):
    (x, weight, b), kw = make_inputs((1, 1), 9, 11, torch.float32, prologue="rms_norm", residual=True, scale="channel")
    cast = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = linear(x.to(dtype), weight.to(dtype), b.to(dtype), **cast)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), linear_eager(x, weight, b, **kw), **TOLERANCE[dtype])


def test_a_declining_backend_passes_to_the_next():
    calls = []

    def refusing_check(x, *args, **kwargs):
        return "odd row count" if x.shape[0] % 2 else None

    def doubled(*args, **kwargs):
        calls.append("even_rows_only")
        return 2 * linear_eager(*args, **kwargs)

    LINEAR.register("even_rows_only", doubled, check=refusing_check, before=LINEAR.names()[0])
    try:
        (x, weight, b), kw = make_inputs((3,), 4, 4, torch.float32)
        torch.testing.assert_close(linear(x, weight, b), linear_eager(x, weight, b))  # declined: next backend ran
        assert calls == [] and LINEAR.last_backend != "even_rows_only"
        (x, weight, b), kw = make_inputs((2,), 4, 4, torch.float32)
        torch.testing.assert_close(linear(x, weight, b), 2 * linear_eager(x, weight, b))
        assert calls == ["even_rows_only"] and LINEAR.last_backend == "even_rows_only"
    finally:
        LINEAR.unregister("even_rows_only")


def test_a_backend_failing_at_run_time_falls_back():
    def broken(*args, **kwargs):
        raise registry.BackendUnavailable("compiler crashed")

    LINEAR.register("broken", broken, before=LINEAR.names()[0])
    try:
        (x, weight, b), _ = make_inputs((2,), 4, 4, torch.float32)
        torch.testing.assert_close(linear(x, weight, b), linear_eager(x, weight, b))
        with pytest.raises(ValueError, match="broken.*failed: compiler crashed"):
            LINEAR(x, weight, b, backend="broken")
    finally:
        LINEAR.unregister("broken")


def test_environment_forces_a_backend_and_says_why_it_cannot_run(monkeypatch):
    (x, weight, b), _ = make_inputs((2,), 4, 4, torch.float32)
    LINEAR.register("gpu_only", linear_eager, check=lambda x, *a, **k: "needs a CUDA tensor", before="eager")
    try:
        monkeypatch.setenv(registry.ENV_VAR, "linear:gpu_only")
        with pytest.raises(ValueError, match="gpu_only.*WEFT_KERNEL_BACKEND.*needs a CUDA tensor"):
            linear(x, weight, b)
        monkeypatch.setenv(registry.ENV_VAR, "eager")
        linear(x, weight, b)
        assert LINEAR.last_backend == "eager"
        monkeypatch.setenv(registry.ENV_VAR, "no_such_backend")
        with pytest.raises(ValueError, match="no op has a backend named 'no_such_backend'"):
            linear(x, weight, b)
    finally:
        LINEAR.unregister("gpu_only")


def test_disable_fused_kernels_forces_eager():
    LINEAR.register("preferred", linear_eager, before=LINEAR.names()[0])
    try:
        (x, weight, b), _ = make_inputs((2,), 4, 4, torch.float32)
        linear(x, weight, b)
        assert LINEAR.last_backend == "preferred"
        registry.disable_fused_kernels()
        linear(x, weight, b)
        assert LINEAR.last_backend == "eager"
    finally:
        registry.disable_fused_kernels(False)
        LINEAR.unregister("preferred")


def test_small_calls_do_not_trigger_compilation():
    (x, weight, b), _ = make_inputs((4,), 8, 8, torch.float32)
    linear(x, weight, b)
    assert LINEAR.last_backend == "eager"


@pytest.mark.parametrize("args,message", [
    (dict(x=(2, 5), w=(3, 4)), "does not fit weight"),
    (dict(x=(2, 4), w=(3, 4), prologue="swiglu"), "swiglu"),
    (dict(x=(2, 4), w=(3, 4), residual=(2, 5)), "residual of shape"),
    (dict(x=(2, 4), w=(3, 4), prologue="layer_norm"), "unknown prologue"),
])
def test_bad_arguments_name_the_shapes(args, message):
    x = torch.randn(*args["x"])
    weight = torch.randn(*args["w"])
    residual = torch.randn(*args["residual"]) if "residual" in args else None
    with pytest.raises(ValueError, match=message):
        linear(x, weight, prologue=args.get("prologue"), residual=residual)


def _compiled_here():
    backend = LINEAR.backend("compiled")
    reason = backend.unavailable_reason()
    if reason is None:
        x = torch.zeros(2, 2)
        reason = backend.decline_reason(x, torch.zeros(2, 2))
    if reason is not None:
        pytest.skip(f"compiled backend unavailable here: {reason}")


@pytest.mark.parametrize("prologue,dtype,scale", [("gelu_tanh", torch.float32, "sample"),
                                                  ("swiglu", torch.bfloat16, "channel")])
def test_compiled_row_chunks_match_eager_and_go_dynamic_once(monkeypatch, prologue, dtype, scale):
    """The chunked CPU graph (forced on small shapes) against eager, over three token counts."""
    _compiled_here()
    from kernels import linear as linear_module

    monkeypatch.setattr(linear_module, "MIN_CHUNK_ROWS", 4)
    monkeypatch.setattr(linear_module, "CHUNK_BYTES", 1600)  # 2-4 chunks of these 30-34 tokens
    in_features, out_features = (11, 9) if prologue == "gelu_tanh" else (8, 13)
    keys = set()
    for seed, rows_shape in enumerate([(2, 15), (4, 8), (2, 17)]):  # 30, 32, 34 tokens
        (x, weight, b), kw = make_inputs(rows_shape, in_features, out_features, dtype, prologue=prologue,
                                         residual=True, scale=scale, seed=seed)
        rows = x.numel() // x.shape[-1]
        chunks = linear_module.row_chunks(rows, x.shape[-1], in_features, out_features, x.element_size(), "cpu")
        assert chunks > 1
        out = LINEAR(x, weight, b, backend="compiled", **kw)
        torch.testing.assert_close(out, linear_eager(x, weight, b, **kw), **TOLERANCE[dtype])
        keys.update(k for k in linear_module._linear_compiler._compiled
                    if k[:3] == (prologue, in_features, out_features) and k[-2] == chunks)
    # Static for the first token count, symbolic from the second: never one graph per count.
    assert len(keys) == 1 and linear_module._linear_compiler.variants(keys.pop()) == 2


def test_row_chunks_plan():
    from kernels.linear import MAX_CHUNKS, MIN_CHUNK_ROWS, row_chunks

    assert row_chunks(4096, 2048, 1024, 1024, 4, "cpu") > 1  # the SwiGLU target shape is chunked
    assert row_chunks(MIN_CHUNK_ROWS, 1024, 1024, 1024, 4, "cpu") == 1  # too few tokens to split
    assert row_chunks(4096, 2048, 1024, 1024, 4, "cuda") == 1  # only the CPU graph chunks
    assert row_chunks(1 << 20, 64, 64, 64, 4, "cpu") == MAX_CHUNKS
    for rows in (600, 1000, 4096, 5000):
        chunks = row_chunks(rows, 1024, 1024, 1024, 4, "cpu")
        assert rows // chunks >= MIN_CHUNK_ROWS


def test_compiled_uses_the_weights_of_each_call():
    """The norm weight is folded into the weight inside the graph: new values are used at once."""
    _compiled_here()
    (x, weight, b), kw = make_inputs((3, 5), 16, 8, torch.float32, prologue="rms_norm", residual=True)
    first = LINEAR(x, weight, b, backend="compiled", **kw)
    weight.mul_(2)  # in place: same tensor object, same address
    kw["prologue_weight"].add_(1)
    second = LINEAR(x, weight, b, backend="compiled", **kw)
    torch.testing.assert_close(second, linear_eager(x, weight, b, **kw), **TOLERANCE[torch.float32])
    assert not torch.allclose(first, second)


def test_float32_products_on_the_cpu_go_to_onednn_where_it_runs():
    if LINEAR.backend("onednn").unavailable_reason() is not None:  # e.g. an AVX2 CPU, where MKL is the faster
        pytest.skip(f"oneDNN unavailable: {LINEAR.backend('onednn').unavailable_reason()}")
    (x, weight, b), kw = make_inputs((96,), 256, 256, torch.float32, residual=True)  # 6.3M multiply-adds
    out = linear(x, weight, b, **kw)
    assert LINEAR.last_backend == "onednn"
    torch.testing.assert_close(out, linear_eager(x, weight, b, **kw), **TOLERANCE[torch.float32])
    (x, weight, b), kw = make_inputs((96,), 256, 256, torch.bfloat16)
    assert "not float32" in LINEAR.backend("onednn").decline_reason(x, weight, b, **kw)


@pytest.mark.parametrize("prologue", [None, "rms_norm", "swiglu"])
def test_compiled_half_products_widen_to_float32_on_a_cpu_without_that_arithmetic(monkeypatch, prologue):
    """Where the CPU emulates bfloat16, the compiled graph multiplies in float32 and rounds once: as eager, within bf16."""
    _compiled_here()
    from kernels import linear as linear_module

    monkeypatch.setattr(linear_module, "_native_half_product", lambda dtype: False)
    (x, weight, b), kw = make_inputs((40,), 24, 16, torch.bfloat16, prologue=prologue, residual=True, scale="channel")
    assert linear_module.widened_on_cpu(x.reshape(-1, x.shape[-1]), weight)
    out = LINEAR(x, weight, b, backend="compiled", **kw)
    assert out.dtype == torch.bfloat16
    assert any(k[-3] for k in linear_module._linear_compiler._compiled if k[:3] == (linear_module.Prologue.parse(prologue), 24, 16))
    torch.testing.assert_close(out, linear_eager(x, weight, b, **kw), **TOLERANCE[torch.bfloat16])
    # Without an epilogue the result still comes back in the input's dtype.
    bare = LINEAR(x, weight, None, backend="compiled", prologue=prologue,
                  prologue_weight=kw.get("prologue_weight"))
    assert bare.dtype == torch.bfloat16
    torch.testing.assert_close(bare, linear_eager(x, weight, None, prologue=prologue,
                                                  prologue_weight=kw.get("prologue_weight")),
                               **TOLERANCE[torch.bfloat16])

def test_onednn_serves_only_cpus_where_torch_runs_avx512(monkeypatch):
    from kernels.linear import _onednn_available

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert "AVX2" in _onednn_available()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    if torch.backends.mkldnn.is_available():
        assert _onednn_available() is None


def test_a_call_shaped_like_an_earlier_one_reuses_its_checks_and_choice(monkeypatch):
    checks = []

    def probe_check(x, weight, bias=None, **_options):
        checks.append(tuple(x.shape))
        return None

    LINEAR.register("probe", linear_eager, check=probe_check, before=LINEAR.names()[0])
    try:
        (x, weight, b), kw = make_inputs((2, 5), 16, 8, torch.float32, prologue="rms_norm", residual=True)
        first = linear(x, weight, b, **kw)
        second = linear(x + 1, weight, b, **kw)  # other values, the same shapes
        assert checks == [(2, 5, 16)] and LINEAR.last_backend == "probe"
        torch.testing.assert_close(second, linear_eager(x + 1, weight, b, **kw))
        assert not torch.equal(first, second)
        linear(x[:1], weight, b, **{**kw, "residual": kw["residual"][:1]})  # another shape: checked again
        assert len(checks) == 2
        monkeypatch.setenv(registry.ENV_VAR, "linear:eager")  # a forced backend is never looked up
        linear(x, weight, b, **kw)
        assert LINEAR.last_backend == "eager" and len(checks) == 2
        monkeypatch.delenv(registry.ENV_VAR)
        for _ in range(2):  # a refused call is refused every time
            with pytest.raises(ValueError, match="does not fit weight"):
                linear(x[..., :15], weight, b, **kw)
    finally:
        LINEAR.unregister("probe")
    linear(x, weight, b, **kw)  # unregistering forgot the choice
    assert LINEAR.last_backend != "probe"
