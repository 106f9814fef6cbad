"""Attention under ``jax.checkpoint`` in a whole train step.

JAX transposes a checkpoint into one body of the backward pass that
recomputes the checkpointed forward and then runs its backward equations.
autocast recognises the recomputed attention there, proves its backward
beside it and fuses both: the cuda export of the whole step has the cuDNN
kernels the loss-only wrap has (the forward, the checkpoint's recomputed
forward, the backward). On this CPU host: what is fused where, the CPU
formulation bit for bit the unfused one, values and gradients against
float32 (the fused formulation run with JAX's XLA implementation), the cuda
export's kernel counts, and the notes for what stays unfused.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close
from test_autocast_attention import (
    POSITIVE,
    B,
    H,
    N,
    T,
    _args,
    _attention_entries,
    _cuda_text,
    _pin_cuda_attention,
    _qkv,
    _sum_loss,
    gpt_causal,
)

import mixprec
from mixprec._src import _compat
from mixprec._src.autocast.fusions.attention import (
    pattern as attention,
    remat,
    rule as attention_rule,
)


POLICIES = {
    "default": None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    # (Saves no product with batch axes: none of the attention's.)
    "dots_with_no_batch_dims_saveable": (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
}
# The forms whose recomputed attention is fused (jax.nn.dot_product_attention's
# XLA implementation, with its unit group axis, is fused at top level only:
# test_dot_product_attention_under_remat_names_its_unfused_backward).
WRITTEN_OUT = sorted(n for n in POSITIVE if not n.startswith("dpa_"))
FUSED = [(False, "attention"), (True, "attention"), (True, "attention's gradient")]


@pytest.fixture
def cudnn_present(monkeypatch):
    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )


def _fmha_counts(fn, *args):
    """The cuDNN attention kernels (forward, backward) of ``fn``'s cuda
    export, and its dot_generals."""
    text = _cuda_text(fn, *args)
    found = re.findall(r"custom_call @([\w$]+)", text)
    fwd = sum(
        c.startswith("__cudnn$fmha") and not c.endswith("Backward") for c in found
    )
    bwd = sum(c.startswith("__cudnn$fmha") and c.endswith("Backward") for c in found)
    return fwd, bwd, text.count("stablehlo.dot_general")


def _steps(fn, policy, low):
    """A whole step under ``jax.checkpoint(fn, policy=policy)`` and the same
    step with autocast around the checkpointed function only."""
    ck = jax.checkpoint(fn, policy=policy)
    whole = mixprec.autocast(jax.grad(_sum_loss(ck), argnums=(0, 1, 2)), f"mixed_{low}")
    loss_only = jax.grad(
        _sum_loss(mixprec.autocast(ck, f"mixed_{low}")), argnums=(0, 1, 2)
    )
    return whole, loss_only


# ------------------------------------------------- what is fused, and where


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", WRITTEN_OUT)
def test_whole_step_under_remat_fuses_the_recomputed_backward(name, policy):
    # The forward at top level; in the checkpoint's body, the recomputed
    # forward and the backward, each one fused entry.
    args = _args(name)
    ck = jax.checkpoint(POSITIVE[name], policy=POLICIES[policy])
    grad = jax.grad(_sum_loss(ck), argnums=(0, 1, 2))
    assert _attention_entries(grad, *args) == FUSED
    report = mixprec.explain(grad, *args, policy="mixed_bfloat16")
    paths = [op.path for op in report.ops if op.primitive == "dot_product_attention"]
    assert paths == ["", "checkpoint", "checkpoint"]
    assert not any("backward not" in n for n in report.notes), report.notes


def test_the_recomputed_product_is_put_back_only_where_it_is_proven():
    # The body recomputes the weights, not their `·v` (nothing reads it):
    # `complete` puts it back as one more result, and finds the backward.
    q, k, v = _qkv()
    grad = jax.grad(_sum_loss(jax.checkpoint(gpt_causal)), argnums=(0, 1, 2))
    closed = jax.make_jaxpr(grad)(q, k, v)
    [body] = [
        e.params["jaxpr"]
        for e in closed.jaxpr.eqns
        if e.primitive.name in remat.REMAT_PRIMITIVES
    ]
    assert attention.find(body) == {}
    done, added = remat.complete(body)
    assert added == 1 and len(done.outvars) == len(body.outvars) + 1
    [m] = attention.find(done).values()
    assert m.backward is not None
    # The recomputation and the backward pass, told apart.
    assert remat.recomputed_eqns(body) and remat.backward_eqns(body)
    assert not remat.recomputed_eqns(body) & remat.backward_eqns(body)

    # Weights read by something else than their gradients' products: nothing
    # is proven, and nothing is put back.
    def loss(q, k, v):
        def f(q, k, v):
            s = jnp.einsum("bthd,bshd->bhts", q, k) * 0.125
            p = jax.nn.softmax(s, axis=-1)
            return jnp.einsum("bhts,bshd->bthd", p, v), jnp.sum(p**2)

        out, extra = jax.checkpoint(f)(q, k, v)
        return jnp.sum(out * v) + extra

    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    [body] = [
        e.params["jaxpr"]
        for e in closed.jaxpr.eqns
        if e.primitive.name in remat.REMAT_PRIMITIVES
    ]
    assert remat.complete(body) == (body, 0)


# ------------------------------------------------- values


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_whole_step_under_remat_matches_float32(low, policy):
    # The CPU formulation (the recognised equations run one by one).
    args = _args("gpt_causal")
    ck = jax.checkpoint(gpt_causal, policy=POLICIES[policy])
    grad = jax.grad(_sum_loss(ck), argnums=(0, 1, 2))
    want = grad(*args)
    got = jax.jit(mixprec.autocast(grad, f"mixed_{low}"))(*args)
    assert [g.dtype for g in got] == [jnp.float32] * 3
    assert_trees_close(got, want, dtype=low, grad=True)
    value = jax.value_and_grad(_sum_loss(ck))
    val, g = jax.jit(mixprec.autocast(value, f"mixed_{low}"))(*args)
    val32, g32 = value(*args)
    assert val.dtype == jnp.float32 and g.dtype == jnp.float32
    assert_trees_close((val, g), (val32, g32), dtype=low, grad=True)


@pytest.mark.parametrize("name", WRITTEN_OUT)
def test_whole_step_under_remat_cpu_formulation_is_the_unfused_one(name, monkeypatch):
    args = _args(name)
    grad = jax.grad(_sum_loss(jax.checkpoint(POSITIVE[name])), argnums=(0, 1, 2))
    got = jax.jit(mixprec.autocast(grad, "mixed_bfloat16"))(*args)
    monkeypatch.setattr(attention, "find", lambda *a, **k: {})
    assert _attention_entries(grad, *args) == []
    want = jax.jit(mixprec.autocast(grad, "mixed_bfloat16"))(*args)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", WRITTEN_OUT)
def test_whole_step_under_remat_fused_formulation_matches_float32(
    name, policy, monkeypatch
):
    # The fused formulation (XLA's implementation standing in for cuDNN, the
    # cuda formulation pinned) of the forward, the recomputed forward and the
    # backward. (Its float16 derivative has GEMMs XLA:CPU cannot run: float16
    # is checked by the cuda export below.)
    monkeypatch.setattr(attention_rule, "_IMPLEMENTATION", "xla")
    _pin_cuda_attention(monkeypatch)
    args = _args(name)
    ck = jax.checkpoint(POSITIVE[name], policy=POLICIES[policy])
    grad = jax.grad(_sum_loss(ck), argnums=(0, 1, 2))
    assert _attention_entries(grad, *args) == FUSED
    with jax.numpy_dtype_promotion("standard"):
        got = jax.jit(mixprec.autocast(grad, "mixed_bfloat16"))(*args)
    assert [g.dtype for g in got] == [jnp.float32] * 3
    assert_trees_close(got, grad(*args), dtype="bfloat16", grad=True)


# ------------------------------------------------- the cuda export


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_cuda_export_of_a_whole_step_under_remat_has_the_loss_only_kernels(
    low, policy, cudnn_present
):
    # Forward, recomputed forward, backward: 2 forward kernels and 1 backward
    # kernel, no dot, as with autocast around the checkpointed function.
    q, k, v = _qkv()
    whole, loss_only = _steps(gpt_causal, POLICIES[policy], low)
    assert _fmha_counts(whole, q, k, v) == _fmha_counts(loss_only, q, k, v)
    assert _fmha_counts(whole, q, k, v) == (2, 1, 0)
    # The forward kernels (the recomputed one too) take 16-bit operands.
    text = _cuda_text(whole, q, k, v)
    sigs = re.findall(r"custom_call @__cudnn\$fmhaSoftmax\(.* : \(([^)]*)\) ->", text)
    short = {"bfloat16": "bf16", "float16": "f16"}[low]
    assert len(sigs) == 2
    assert all(short in sig and "f32" not in sig for sig in sigs), sigs


def _layer(x, w):
    q, k, v = ((x @ w[n]).reshape(B, T, N, H) for n in "qkv")
    return x + gpt_causal(q, k, v).reshape(B, T, N * H) @ w["o"]


def _layer_args(seed=4):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (B, T, N * H))
    w = {
        n: 0.05 * jax.random.normal(k, (N * H, N * H))
        for n, k in zip("qkvo", ks[1:], strict=True)
    }
    return w, x


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_checkpointed_layer_in_a_value_and_grad_step(low, policy, cudnn_present):
    # A layer with its projections: the body recomputes the attention's
    # result too (the output projection's gradient reads it). The step's
    # value and gradients against float32 on the CPU formulation, and the
    # kernels of the loss-only wrap in its cuda export.
    w, x = _layer_args()
    ck = jax.checkpoint(_layer, policy=POLICIES[policy])

    def loss(w, x):
        return jnp.mean(ck(x, w).astype(jnp.float32) ** 2)

    step = jax.value_and_grad(loss)
    whole = mixprec.autocast(step, f"mixed_{low}")
    loss_only = jax.value_and_grad(
        lambda w, x: jnp.mean(
            mixprec.autocast(ck, f"mixed_{low}")(x, w).astype(jnp.float32) ** 2
        )
    )
    assert _fmha_counts(whole, w, x)[:2] == _fmha_counts(loss_only, w, x)[:2] == (2, 1)
    assert _attention_entries(step, w, x, policy=f"mixed_{low}") == FUSED
    val, g = jax.jit(whole)(w, x)
    val32, g32 = step(w, x)
    assert val.dtype == jnp.float32
    assert jax.tree.map(lambda a: a.dtype, g) == jax.tree.map(lambda a: a.dtype, g32)
    assert_trees_close((val, g), (val32, g32), dtype=low, grad=True)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_checkpointed_layer_in_a_scan_fuses_its_recomputed_backward(
    low, cudnn_present
):
    # `jax.checkpoint` around the layer a lax.scan stacks: the transposed
    # scan body holds the transposed checkpoint, whose recomputed attention
    # and backward are fused (one forward, one backward kernel there); the
    # forward scan body's attention is fused by the scan pass
    # (tests/test_autocast_attention_scan.py): the loss-only wrap's kernels.
    w, x = _layer_args()
    ws = jax.tree.map(lambda a: jnp.stack([a, 0.5 * a, -a]), w)

    def loss(ws, x):
        def body(c, wl):
            return jax.checkpoint(_layer)(c, wl), None

        return jnp.mean(jax.lax.scan(body, x, ws)[0].astype(jnp.float32) ** 2)

    step = jax.value_and_grad(loss)
    whole = mixprec.autocast(step, f"mixed_{low}")
    assert _fmha_counts(whole, ws, x)[:2] == (2, 1)
    entries = [
        (op.path, op.reason.split(" (")[0])
        for op in mixprec.explain(step, ws, x, policy=f"mixed_{low}").ops
        if op.primitive == "dot_product_attention"
    ]
    inner = [e for e in entries if e[0].endswith("checkpoint")]
    assert [r for _, r in inner] == ["attention", "attention's gradient"], entries
    val, g = jax.jit(whole)(ws, x)
    val32, g32 = step(ws, x)
    assert_trees_close((val, g), (val32, g32), dtype=low, grad=True)


# ------------------------------------------------- what stays unfused, and says so


SAVING = {
    "dots_saveable": (jax.checkpoint_policies.dots_saveable, (2, 1)),
    "everything_saveable": (jax.checkpoint_policies.everything_saveable, (1, 1)),
}


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("saving", sorted(SAVING))
def test_a_policy_that_saves_the_attentions_values_names_it_unfused(
    saving, low, cudnn_present
):
    # dots_saveable saves the scores product (everything_saveable every
    # value): the forward's values leave it for the checkpoint's body, whose
    # recomputation starts from them (or which recomputes nothing). Neither
    # pass is fused (autocast around the checkpointed function fuses both:
    # its loss-only counts); the gradients are those of float32, and explain
    # and diagnose say why.
    q, k, v = _qkv()
    policy, loss_only_counts = SAVING[saving]
    whole, loss_only = _steps(gpt_causal, policy, low)
    assert _fmha_counts(whole, q, k, v)[:2] == (0, 0)
    assert _fmha_counts(loss_only, q, k, v)[:2] == loss_only_counts
    grad = jax.grad(
        _sum_loss(jax.checkpoint(gpt_causal, policy=policy)), argnums=(0, 1, 2)
    )
    assert _attention_entries(grad, q, k, v, policy=f"mixed_{low}") == []
    assert_trees_close(jax.jit(whole)(q, k, v), grad(q, k, v), dtype=low, grad=True)
    report = mixprec.explain(grad, q, k, v, policy=f"mixed_{low}")
    [note] = [n for n in report.notes if "jax.checkpoint" in n]
    assert note.startswith("dot_product_attention (scaled q·kᵀ, causal mask")
    assert "not fused, forward or backward" in note and "saves" in note
    assert "nothing_saveable" in note
    diag = mixprec.diagnose(grad, q, k, v, policy=f"mixed_{low}")
    assert any("jax.checkpoint" in n and "saves" in n for n in diag.notes)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_dot_product_attention_under_remat_names_its_unfused_backward(
    low, cudnn_present
):
    # jax.nn.dot_product_attention's XLA implementation (a unit group axis in
    # its products): the forward is fused at top level, the recomputed
    # backward is not, and the note says so.
    args = _args("dpa_causal")
    ck = jax.checkpoint(POSITIVE["dpa_causal"])
    grad = jax.grad(_sum_loss(ck), argnums=(0, 1, 2))
    assert _attention_entries(grad, *args, policy=f"mixed_{low}") == [
        (False, "attention")
    ]
    report = mixprec.explain(grad, *args, policy=f"mixed_{low}")
    [note] = [n for n in report.notes if "forward fused, backward not" in n]
    assert "jax.checkpoint" in note
    whole, _ = _steps(POSITIVE["dpa_causal"], None, low)
    assert _fmha_counts(whole, *args)[:2] == (1, 0)
    assert_trees_close(jax.jit(whole)(*args), grad(*args), dtype=low, grad=True)
