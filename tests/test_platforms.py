"""Formulations chosen by the platform a computation is lowered for.

What a GPU will run is checked on this CPU host by exporting for ``cuda``
(``jax.export`` lowers without a GPU) and reading the StableHLO.
"""

import collections
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import executed_lines
from jax import export

import mixprec


F8 = ("f8E4M3FN", "f8E5M2")


def _mlp(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"][None, :])
    return jnp.mean((h @ p["w2"]) ** 2)


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (256, 512)) / 16,
        "b1": jnp.zeros(512),
        "w2": jax.random.normal(k2, (512, 128)) / 22,
    }


X = jax.random.normal(jax.random.key(1), (128, 256))


def _loss_only(policy):
    return jax.jit(jax.value_and_grad(mixprec.autocast(_mlp, policy)))


def _whole_step(policy):
    opt = optax.sgd(0.1)

    def step(p, x):
        loss, g = jax.value_and_grad(_mlp)(p, x)
        updates, _ = opt.update(g, opt.init(p), p)
        return optax.apply_updates(p, updates), loss

    return jax.jit(mixprec.autocast(step, policy))


def _dots(module_text):
    """``(operand types, result type)`` of every ``stablehlo.dot_general``."""
    out = []
    for line in executed_lines(module_text):
        if "stablehlo.dot_general" not in line:
            continue
        sig = line.rsplit(" : ", 1)[1]
        ins, result = sig.split(" -> ")
        types = re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", ins)
        out.append((tuple(types), re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", result)[-1]))
    return out


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("where", ["loss", "step"])
def test_cuda_export_runs_16_bit_gemms_without_cpu_rewrites(low, where):
    policy = f"mixed_{low}"
    f = _loss_only(policy) if where == "loss" else _whole_step(policy)
    text = export.export(f, platforms=["cuda"])(_params(), X).mlir_module()
    short = {"bfloat16": "bf16", "float16": "f16"}[low]
    dots = _dots(text)
    assert len(dots) == 5  # two forward, three backward (x needs none)
    for operands, result in dots:
        assert operands == (short, short), dots
        assert result in (short, "f32"), dots
    # The gradients of the two float32 weights leave their GEMMs in float32;
    # the activation gradient in 16 bits, wrapped loss or whole step alike.
    wide = sum(result == "f32" for _, result in dots)
    assert wide == 2, dots
    # None of the CPU formulation's rewrites (barriers around canonical dots).
    assert "optimization_barrier" not in text


def _dot_bytes(dots_with_shapes):
    return sum(n * {"f32": 4, "bf16": 2, "f16": 2}[t] for n, t in dots_with_shapes)


def _dot_results(module_text):
    """``(elements, element type)`` of the result of every dot_general."""
    out = []
    for line in executed_lines(module_text):
        if "stablehlo.dot_general" not in line:
            continue
        result = line.rsplit(" : ", 1)[1].split(" -> ")[1]
        dims, dtype = re.findall(r"tensor<((?:[\d]+x)*)(\w+)>", result)[-1]
        n = int(np.prod([int(d) for d in dims.split("x") if d], dtype=np.int64))
        out.append((n, dtype))
    return out


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_whole_step_cuda_export_runs_the_gemms_of_a_wrapped_loss(low, monkeypatch):
    # A GPT (attention, LayerNorm, tied embedding): wrapping the whole train
    # step must give the GEMMs that wrapping only the loss gives, the
    # activation gradients in 16 bits included, while the master weights and
    # the optimizer stay float32.
    import functools as ft

    from mixprec._src import _compat
    from mixprec._src.workloads import gpt2

    # As if cuDNN were installed: both get its fused attention, forward and
    # backward, and the same GEMMs for the rest.
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    fused = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")
    checks = [export.DisabledSafetyCheck.custom_call(c) for c in fused]

    cfg = gpt2.GPT2Config(
        vocab_size=256, seq_len=32, d_model=64, num_heads=4, num_layers=2
    )
    params = jax.tree.map(jnp.asarray, gpt2.init(cfg))
    x, y = gpt2.batch(cfg, 2)
    f32 = ft.partial(gpt2.loss, config=cfg)
    opt = optax.adamw(1e-3)
    policy = f"mixed_{low}"

    def train_step(loss):
        def step(state, x, y):
            p, opt_state = state
            value, g = jax.value_and_grad(loss)(p, x, y)
            updates, opt_state = opt.update(g, opt_state, p)
            return (optax.apply_updates(p, updates), opt_state), value

        return step

    state = (params, opt.init(params))
    loss_only = jax.jit(train_step(mixprec.autocast(f32, policy)))
    whole = jax.jit(mixprec.autocast(train_step(f32), policy))
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction
        texts = [
            export.export(f, platforms=["cuda"], disabled_checks=checks)(
                state, x, y
            ).mlir_module()
            for f in (loss_only, whole)
        ]
        out = jax.eval_shape(whole, state, x, y)
    for text in texts:
        calls = collections.Counter(re.findall(r"custom_call @([\w$]+)", text))
        assert [calls[c] for c in fused] == [cfg.num_layers] * 2, calls
    a, b = (sorted(_dot_results(t)) for t in texts)
    # Forward, and the two gradients of each: four projections per layer
    # and the tied embedding's logits.
    assert len(a) == 3 * (4 * cfg.num_layers + 1)
    assert a == b
    assert _dot_bytes(a) == _dot_bytes(b)
    short = {"bfloat16": "bf16", "float16": "f16"}[low]
    assert sorted(_dots(texts[0])) == sorted(_dots(texts[1]))
    assert {ops for ops, _ in _dots(texts[1])} == {(short, short)}
    # The new state is float32, as it came in.
    for got, want in zip(jax.tree.leaves(out[0]), jax.tree.leaves(state), strict=True):
        assert got.dtype == want.dtype


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "rowwise_e4m3"])
@pytest.mark.parametrize("where", ["loss", "step"])
def test_cuda_export_of_float8_hands_float8_arrays_to_the_gemms(scaling, where):
    policy = mixprec.Policy("float32", "bfloat16", "float32", float8=scaling)
    f = _loss_only(policy) if where == "loss" else _whole_step(policy)
    text = export.export(f, platforms=["cuda"])(_params(), X).mlir_module()
    dots = _dots(text)
    f8_dots = [ops for ops, _ in dots if set(ops) <= set(F8)]
    # The gradient operands' format: e5m2, except under rowwise_e4m3 (DeepSeek-V3's
    # choice), whose gradients are e4m3 too and whose GEMMs see no e5m2 at all.
    with_e5m2 = sum("f8E5M2" in ops for ops in f8_dots)
    if where == "loss":
        # Forward in e4m3; both backward products take the cotangent.
        assert len(f8_dots) == len(dots) == 5, dots
        assert with_e5m2 == (0 if scaling == "rowwise_e4m3" else 3), dots
    else:
        # The whole step's backward dots are equations of their own: each is
        # a float8 product too (its gradient operand in the gradient format).
        assert len(f8_dots) == len(dots) == 5, dots
        if scaling == "rowwise_e4m3":
            assert with_e5m2 == 0, dots
        else:
            assert with_e5m2 > 0, dots
    if scaling == "rowwise_e4m3":
        assert all(ops == ("f8E4M3FN", "f8E4M3FN") for ops in f8_dots), dots
        assert "f8E5M2" not in text
    # No float8 value is converted back to a wider type: XLA's GPU pipeline
    # would fold f32 -> f8 -> bf16 into one convert and lose the rounding.
    assert not re.search(r"stablehlo\.convert[^\n]*\(tensor<[^>]*xf8E", text)


@pytest.mark.parametrize(
    "policy",
    ["mixed_bfloat16", "mixed_float16", "mixed_float8"],
)
def test_multi_platform_export_runs_on_cpu_with_the_cpu_formulation(policy):
    f = _loss_only(policy)
    exp = export.export(f, platforms=["cpu", "cuda"])(_params(), X)
    assert exp.platforms == ("cpu", "cuda")
    got = exp.call(_params(), X)
    want = f(_params(), X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Both formulations are in the module: the CPU one is what ran here.
    both = set(_dots(exp.mlir_module()))
    for platform in ("cpu", "cuda"):
        one = export.export(f, platforms=[platform])(_params(), X).mlir_module()
        assert set(_dots(one)) <= both, platform


def test_creating_autocast_initialises_no_jax_backend():
    # An unmodified program that configures JAX after building its functions
    # (as Equinox's examples set `jax_num_cpu_devices`) must keep working:
    # JAX refuses such settings once a backend is initialised.
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        import mixprec
        f = mixprec.autocast(lambda x: (x @ x).sum(), "mixed_bfloat16")
        g = mixprec.autocast(lambda x: (x @ x).sum(), "mixed_float8")
        jax.config.update("jax_num_cpu_devices", 3)
        print(len(jax.devices("cpu")), float(f(jnp.ones((4, 4)))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["3", "64.0"]


def _nested_jits(jaxpr):
    """The nested ``jit`` equations of ``jaxpr`` (top level)."""
    return [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]


def test_products_of_one_formulation_share_one_traced_call():
    # Every product of a formulation at the same operand types is one nested
    # `jit` of the same jaxpr (lowered once per module), computing what
    # `lax.platform_dependent` computes, bit for bit, in both passes.
    from mixprec._src.autocast import platforms

    ws = [jax.random.normal(jax.random.key(i), (64, 64)) / 8 for i in range(3)]
    x = jax.random.normal(jax.random.key(9), (16, 64))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x**2)

    f = jax.jit(jax.value_and_grad(mixprec.autocast(loss, "mixed_bfloat16")))
    calls = _nested_jits(jax.make_jaxpr(f)(ws, x).eqns[0].params["jaxpr"].jaxpr)
    shared = collections.Counter(id(e.params["jaxpr"]) for e in calls)
    assert max(shared.values()) >= 3, "the three forward products: one traced call"

    got = f(ws, x)
    replay = platforms._staged_call
    try:
        platforms._staged_call = lambda *a: None  # lax.platform_dependent per product
        g = jax.jit(jax.value_and_grad(mixprec.autocast(loss, "mixed_bfloat16")))
        assert not _nested_jits(jax.make_jaxpr(g)(ws, x).eqns[0].params["jaxpr"].jaxpr)
        want = g(ws, x)
    finally:
        platforms._staged_call = replay
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _double(x):
    return 2 * x


def test_a_traced_call_is_replayed_only_where_it_was_traced_alike():
    from mixprec._src.autocast import platforms

    def f(x):
        return platforms.per_platform((x,), platform=None, default=_double, cpu=jnp.sin)

    x = jnp.ones(3)
    jaxpr = jax.make_jaxpr(f)(x)
    (call,) = _nested_jits(jaxpr)
    assert jax.make_jaxpr(f)(x).eqns[0].params["jaxpr"] is call.params["jaxpr"]
    # Other operand types or another tracing configuration: traced anew.
    other = jax.make_jaxpr(f)(jnp.ones(4)).eqns[0].params["jaxpr"]
    assert other is not call.params["jaxpr"]
    with jax.default_matmul_precision("highest"):
        highest = jax.make_jaxpr(f)(x).eqns[0].params["jaxpr"]
    assert highest is not call.params["jaxpr"]
    # A closure (it may hold traced values) runs through `lax.platform_dependent`.
    closure = jax.make_jaxpr(
        lambda x: platforms.per_platform(
            (x,), platform=None, default=lambda v: v * x, cpu=jnp.sin
        )
    )(x)
    assert not _nested_jits(closure)
    assert [e.primitive.name for e in closure.eqns] == ["platform_index", "cond"]
    # Not traced (eager): the platform's function runs directly.
    np.testing.assert_array_equal(f(x), jnp.sin(x))
    assert float(jax.jit(f)(x)[0]) == float(jnp.sin(1.0))


def test_no_cudnn_on_the_tracing_host_keeps_attention_unfused_without_tracing_it(
    monkeypatch,
):
    from mixprec._src import _compat
    from mixprec._src.autocast.fusions.attention import rule as attention_rule

    def missing():
        raise RuntimeError("cuDNN is not detected.")

    def never(*args):
        raise AssertionError("the fused call was traced")

    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", missing
    )
    assert attention_rule._shapes(never, [jnp.ones(2)]) is None
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )
    with pytest.raises(AssertionError, match="was traced"):
        attention_rule._shapes(never, [jnp.ones(2)])
