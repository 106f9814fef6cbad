"""A whole train step over ``scan``-stacked layers fuses its attention.

JAX's derivative of a scan over layers puts each layer's attention forward in
the forward scan's body and its backward in the transposed scan's body, with
the attention weights stacked between them; autocast proves the backward
across the two bodies and rewrites both (fusions/attention/scan_pair.py). The
stacks are written with plain ``lax.scan``, Flax's ``nn.scan``, NNX's
``nnx.scan`` and Equinox's ``filter_vmap`` + ``lax.scan``. On this CPU host:
the cuda export's cuDNN calls (the whole step's the loss-only wrap's), which
ops explain reports, values and gradients against float32 (the CPU
formulation, and the fused one with JAX's XLA implementation standing in for
cuDNN), and the note where it cannot fuse.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close
from jax import lax
from test_autocast_attention import _cuda_text, _pin_cuda_attention

import mixprec
from mixprec._src import _compat
from mixprec._src.autocast.fusions.attention import rule as attention_rule, scan_pair


B, T, N, H, L = 2, 16, 2, 16, 3
D = N * H
LOWS = ["bfloat16", "float16"]


def causal_attention(q, k, v):
    t = q.shape[1]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


def _mix(x, wqkv, wproj):
    """One layer: projections, causal attention, output projection."""
    b, t, d = x.shape
    q, k, v = (a.reshape(b, t, N, H) for a in jnp.split(x @ wqkv, 3, -1))
    return x + causal_attention(q, k, v).reshape(b, t, d) @ wproj


def _x():
    return jax.random.normal(jax.random.key(1), (B, T, D))


def _weights(key):
    k1, k2 = jax.random.split(key)
    return (
        jax.random.normal(k1, (D, 3 * D)) / math.sqrt(D),
        jax.random.normal(k2, (D, D)) / math.sqrt(D),
    )


def lax_scan():
    wqkv, wproj = jax.vmap(_weights)(jax.random.split(jax.random.key(0), L))
    params = {"qkv": wqkv, "proj": wproj}

    def loss(params, x):
        y, _ = lax.scan(lambda x, p: (_mix(x, p["qkv"], p["proj"]), None), x, params)
        return jnp.mean(y**2)

    return loss, params, _x()


def flax_nn_scan():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            wqkv = self.param("qkv", nn.initializers.lecun_normal(), (D, 3 * D))
            wproj = self.param("proj", nn.initializers.lecun_normal(), (D, D))
            return _mix(x, wqkv, wproj), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=L,
            )
            return stack(name="layers")(x, None)[0]

    model = Stack()
    x = _x()
    params = model.init(jax.random.key(0), x)["params"]

    def loss(params, x):
        return jnp.mean(model.apply({"params": params}, x) ** 2)

    return loss, params, x


def nnx_scan():
    pytest.importorskip("flax.nnx")
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            wqkv, wproj = _weights(rngs.params())
            self.qkv, self.proj = nnx.Param(wqkv), nnx.Param(wproj)

        def __call__(self, x):
            return _mix(x, self.qkv[...], self.proj[...])

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
        return Block(rngs)

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = stacked(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, layer):
                return layer(x)

            return body(x, self.layers)

    graphdef, state = nnx.split(Stack(nnx.Rngs(0)))

    def loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    return loss, state, _x()


def equinox_scan():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        qkv: jax.Array
        proj: jax.Array

        def __init__(self, key):
            self.qkv, self.proj = _weights(key)

        def __call__(self, x):
            return _mix(x, self.qkv, self.proj)

    blocks = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), L))
    params, static = eqx.partition(blocks, eqx.is_array)

    def loss(params, x):
        def body(x, p):
            return eqx.combine(p, static)(x), None

        return jnp.mean(lax.scan(body, x, params)[0] ** 2)

    return loss, params, _x()


STACKS = {
    "lax_scan": lax_scan,
    "flax_nn_scan": flax_nn_scan,
    "nnx_scan": nnx_scan,
    "equinox_scan": equinox_scan,
}


def _step(loss):
    """A whole train step: the loss, its gradient, an SGD update."""

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def _fmha_counts(fn, *args):
    calls = re.findall(r"custom_call @(__cudnn\$fmha\w*)", _cuda_text(fn, *args))
    backward = sum(c.endswith("Backward") for c in calls)
    return len(calls) - backward, backward


@pytest.fixture
def cudnn(monkeypatch):
    """JAX traces cuDNN's attention as if the host had cuDNN 9.1."""
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )


@pytest.mark.usefixtures("cudnn")
@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_whole_step_cuda_export_has_the_loss_only_kernels(stack, low):
    loss, params, x = STACKS[stack]()
    policy = f"mixed_{low}"
    whole = _fmha_counts(mixprec.autocast(_step(loss), policy), params, x)
    loss_only = _fmha_counts(_step(mixprec.autocast(loss, policy)), params, x)
    # One forward kernel in the forward scan's body, one backward kernel in
    # the transposed scan's body (each body is one layer).
    assert loss_only == (1, 1)
    assert whole == loss_only
    text = _cuda_text(mixprec.autocast(_step(loss), policy), params, x)
    short = {"bfloat16": "bf16", "float16": "f16"}[low]
    sig = re.search(r"custom_call @__cudnn\$fmhaSoftmax\(.* : \(([^)]*)\) ->", text)
    assert sig is not None and short in sig.group(1) and "f32" not in sig.group(1)


@pytest.mark.usefixtures("cudnn")
def test_whole_step_cuda_export_without_the_scan_pair_rewrite_has_none(monkeypatch):
    # What the rewrite changes: without it the whole step has no cuDNN call.
    loss, params, x = lax_scan()
    monkeypatch.setattr(scan_pair, "_pair", lambda *a: None)
    assert _fmha_counts(mixprec.autocast(_step(loss), "mixed_bfloat16"), params, x) == (
        0,
        0,
    )


@pytest.mark.usefixtures("cudnn")
@pytest.mark.parametrize("policy", [None, "dots_with_no_batch_dims_saveable"])
def test_whole_step_with_checkpointed_layers_has_the_loss_only_kernels(policy):
    # `jax.checkpoint` on the scanned layer (the MaxText layout): the forward
    # scan's body computes the attention with the mask and fill JAX hoisted
    # out of it, the transposed body recomputes it and runs its backward
    # (fused in the checkpoint's body).
    loss_stack, params, x = lax_scan()
    del loss_stack
    saves = None if policy is None else getattr(jax.checkpoint_policies, policy)
    layer = jax.checkpoint(
        lambda x, p: (_mix(x, p["qkv"], p["proj"]), None), policy=saves
    )

    def loss(params, x):
        return jnp.mean(lax.scan(layer, x, params)[0] ** 2)

    for low in LOWS:
        whole = _fmha_counts(mixprec.autocast(_step(loss), f"mixed_{low}"), params, x)
        loss_only = _fmha_counts(
            _step(mixprec.autocast(loss, f"mixed_{low}")), params, x
        )
        # The forward's kernel, its recomputation's, and the backward's.
        assert loss_only == (2, 1)
        assert whole == loss_only
    want = jax.value_and_grad(loss)(params, x)
    got = jax.jit(mixprec.autocast(jax.value_and_grad(loss), "mixed_bfloat16"))(
        params, x
    )
    assert_trees_close(got[1], want[1], dtype="bfloat16", grad=True)


def _attention_entries(fn, *args, policy):
    report = mixprec.explain(fn, *args, policy=policy)
    return [
        (op.path, op.backward, op.reason.split(" (")[0], op.dtype)
        for op in report.ops
        if op.primitive == "dot_product_attention"
    ]


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_whole_step_explains_both_passes_fused_in_the_scan_bodies(stack):
    loss, params, x = STACKS[stack]()
    for low in LOWS:
        assert _attention_entries(_step(loss), params, x, policy=f"mixed_{low}") == [
            ("scan/body", False, "attention", low),
            ("scan/body", True, "attention's gradient", low),
        ]


@pytest.mark.parametrize("low", LOWS)
def test_whole_step_has_no_unfused_attention_note(low):
    loss, params, x = lax_scan()
    report = mixprec.diagnose(_step(loss), params, x, policy=f"mixed_{low}")
    assert not [n for n in report.notes if n.startswith("dot_product_attention")]


@pytest.mark.parametrize("low", LOWS)
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_whole_step_cpu_formulation_matches_float32(stack, low):
    loss, params, x = STACKS[stack]()
    want = jax.value_and_grad(loss)(params, x)
    got = jax.jit(mixprec.autocast(jax.value_and_grad(loss), f"mixed_{low}"))(params, x)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    assert_trees_close(got[0], want[0], dtype=low)
    assert_trees_close(got[1], want[1], dtype=low, grad=True)


@pytest.mark.parametrize("stack", ["lax_scan", "nnx_scan"])
def test_whole_step_cpu_formulation_is_the_unfused_one(stack, monkeypatch):
    loss, params, x = STACKS[stack]()
    whole = jax.jit(mixprec.autocast(_step(loss), "mixed_bfloat16"))
    got = whole(params, x)
    monkeypatch.setattr(scan_pair, "_pair", lambda *a: None)
    want = jax.jit(mixprec.autocast(_step(loss), "mixed_bfloat16"))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_whole_step_fused_formulation_matches_float32(stack, monkeypatch):
    # The fused kernel's formulation run here, JAX's XLA implementation
    # standing in for cuDNN: its residuals cross from the forward scan to the
    # transposed one. (Its float16 derivative has GEMMs XLA:CPU cannot run;
    # float16 is checked by the cuda export above.)
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    loss, params, x = STACKS[stack]()
    want = jax.value_and_grad(loss)(params, x)
    # (JAX's XLA implementation of attention relies on implicit promotion in
    # its derivative; cuDNN's does not.)
    with jax.numpy_dtype_promotion("standard"):
        whole = mixprec.autocast(jax.value_and_grad(loss), "mixed_bfloat16")
        got = jax.jit(whole)(params, x)
        loss_only = jax.jit(
            jax.value_and_grad(mixprec.autocast(loss, "mixed_bfloat16"))
        )(params, x)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    assert_trees_close(got[0], want[0], dtype="bfloat16")
    assert_trees_close(got[1], want[1], dtype="bfloat16", grad=True)
    assert_trees_close(got, loss_only, dtype="bfloat16", grad=True)


def test_whole_step_fused_formulation_stacks_no_attention_weights(monkeypatch):
    # What crosses between the scans once fused: the kernel's residuals. The
    # weights the unfused backward would read are zeros in the fused
    # formulation, and XLA drops them (compiled here with JAX's XLA
    # implementation standing in for cuDNN).
    loss, params, x = lax_scan()

    def stacked_weights(fn):
        hlo = jax.jit(fn).lower(params, x).compile().as_text()
        return len(re.findall(rf"\w+\[{L},{B},{N},{T},{T}\]", hlo))

    whole = mixprec.autocast(jax.value_and_grad(loss), "mixed_bfloat16")
    assert stacked_weights(whole) > 0  # the CPU formulation: the ops, unfused
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    with jax.numpy_dtype_promotion("standard"):
        assert stacked_weights(whole) == 0


# ------------------------------------------------- where it cannot fuse


def _weights_returned():
    # The layer also returns its attention weights, stacked by the scan: the
    # fused kernel never materialises them, so neither pass is fused.
    wqkv, wproj = jax.vmap(_weights)(jax.random.split(jax.random.key(0), L))

    def layer(x, p):
        b, t, d = x.shape
        q, k, v = (a.reshape(b, t, N, H) for a in jnp.split(x @ p[0], 3, -1))
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(H)
        w = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("bhts,bshd->bthd", w, v).reshape(b, t, d)
        return x + out @ p[1], w

    def loss(params, x):
        y, w = lax.scan(layer, x, params)
        return jnp.mean(y**2) + jnp.mean(w**2)

    return loss, (wqkv, wproj), _x()


@pytest.mark.usefixtures("cudnn")
@pytest.mark.parametrize("low", LOWS)
def test_whole_step_that_returns_the_weights_stays_unfused_with_its_note(low):
    loss, params, x = _weights_returned()
    policy = f"mixed_{low}"
    assert _fmha_counts(mixprec.autocast(_step(loss), policy), params, x) == (0, 0)
    report = mixprec.diagnose(_step(loss), params, x, policy=policy, refine=False)
    [note] = [n for n in report.notes if n.startswith("dot_product_attention")]
    assert "not fused, forward or backward" in note
    assert "the values its backward pass reads leave that body" in note
    assert "mixprec.autocast(loss, policy)" in note
    # And its numbers are float32's.
    want = jax.value_and_grad(loss)(params, x)
    got = jax.jit(mixprec.autocast(jax.value_and_grad(loss), policy))(params, x)
    assert_trees_close(got[1], want[1], dtype=low, grad=True)


def _padded_bias_loss():
    """Scanned layers reading a Hugging Face-style padding bias (0 or the
    float32 minimum per key) that arrives as an argument."""

    def mix(x, wqkv, wproj, bias):
        b, t, d = x.shape
        q, k, v = (a.reshape(b, t, N, H) for a in jnp.split(x @ wqkv, 3, -1))
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(H) + bias
        o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
        return x + o.reshape(b, t, d) @ wproj

    keep = jnp.arange(T)[None, :] < jnp.array([[T], [T - 5]])
    bias = jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min)[:, None, None, :]

    def loss(params, x, bias):
        def layer(x, p):
            return mix(x, p["qkv"], p["proj"], bias), None

        y, _ = lax.scan(layer, x, params)
        return jnp.mean((y * keep[..., None].astype(y.dtype)) ** 2)

    wqkv, wproj = jax.vmap(_weights)(jax.random.split(jax.random.key(0), L))
    return loss, {"qkv": wqkv, "proj": wproj}, _x(), bias


@pytest.mark.usefixtures("cudnn")
@pytest.mark.parametrize("low", LOWS)
def test_whole_step_with_a_padding_bias_argument_fuses_and_matches_float32(low):
    loss, params, x, bias = _padded_bias_loss()
    policy = f"mixed_{low}"

    def step(params, x, bias):
        value, grads = jax.value_and_grad(loss)(params, x, bias)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    whole = _fmha_counts(mixprec.autocast(step, policy), params, x, bias)
    loss_only = _fmha_counts(
        jax.value_and_grad(mixprec.autocast(loss, policy)), params, x, bias
    )
    assert whole == loss_only == (1, 1)
    want = jax.value_and_grad(loss)(params, x, bias)
    got = jax.jit(mixprec.autocast(jax.value_and_grad(loss), policy))(params, x, bias)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    assert_trees_close(got[0], want[0], dtype=low)
    assert_trees_close(got[1], want[1], dtype=low, grad=True)


@pytest.mark.usefixtures("cudnn")
@pytest.mark.parametrize("low", LOWS)
def test_whole_step_obeys_a_float32_scope_inside_the_scanned_attention(
    low, monkeypatch
):
    # The ·v product of every layer in float32: the two matmuls no longer
    # share a 16-bit dtype, so neither pass is fused, in either body.
    def scoped(q, k, v):
        t = q.shape[1]
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
        with mixprec.float32_scope():
            return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    monkeypatch.setitem(globals(), "causal_attention", scoped)
    loss, params, x = lax_scan()
    policy = f"mixed_{low}"
    assert _fmha_counts(mixprec.autocast(_step(loss), policy), params, x) == (0, 0)
    want = jax.value_and_grad(loss)(params, x)
    got = jax.jit(mixprec.autocast(jax.value_and_grad(loss), policy))(params, x)
    assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype(jnp.float32)}
    assert_trees_close(got[0], want[0], dtype=low)
    assert_trees_close(got[1], want[1], dtype=low, grad=True)
