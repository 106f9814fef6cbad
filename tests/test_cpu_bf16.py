"""Tests for bfloat16 dots on CPUs with and without native bfloat16 matmuls:
the capability probe and its overrides (autocast/capability.py), the two CPU
formulations of autocast/dots.py, and what explain and the demo say about them."""

import importlib
import json
import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mixprec
from mixprec._src import _compat, _config
from mixprec._src.autocast import capability, dots
from mixprec._src.autocast.config import make_config
from mixprec._src.cli.demo import report
from mixprec._src.workloads import timing, train
from tests.helpers import assert_tree_dtypes, assert_trees_close, iter_eqns


BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
FORMULATIONS = ("native", "emulated")
ON_CPU = jax.default_backend() == "cpu"
needs_cpu = pytest.mark.skipif(not ON_CPU, reason="CPU formulations")

DOT_CASES = {
    "matmul": ((16, 24), (24, 32), (((1,), (0,)), ((), ()))),
    "xT_g": ((24, 16), (24, 32), (((0,), (0,)), ((), ()))),
    "g_wT": ((16, 24), (32, 24), (((1,), (1,)), ((), ()))),
    "attn_bthd": ((2, 16, 3, 8), (2, 24, 3, 8), (((3,), (3,)), ((0, 2), (0, 2)))),
    "two_contract": ((16, 4, 6), (6, 4, 32), (((1, 2), (1, 0)), ((), ()))),
    "matvec": ((16, 24), (24,), (((1,), (0,)), ((), ()))),
}


def _inputs(lhs_shape, rhs_shape, dtype=F32, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, lhs_shape, jnp.float32).astype(dtype)
    rhs = jax.random.normal(k2, rhs_shape, jnp.float32).astype(dtype)
    return lhs, rhs


def _dot(lhs, rhs, dn, formulation, **kw):
    return dots.dot_general(
        lhs,
        rhs,
        dimension_numbers=dn,
        low_dtype=BF16,
        out_dtype=F32,
        platform="cpu",
        cpu_bf16=formulation,
        **kw,
    )


def _f64(x):
    return np.asarray(x, np.float64)


# ------------------------------------------------------------------ the probe


@pytest.mark.parametrize(
    ("features", "proc", "machine", "native", "source"),
    [
        ({"AVX2": True, "AVX512BF16": True}, None, "x86_64", True, "CPU features"),
        ({"AVX2": True, "AVX512F": True}, None, "x86_64", False, "CPU features"),
        # NumPy's run-time view wins over /proc/cpuinfo (a CPUID mask, a VM).
        ({"AVX2": True}, {"avx512_bf16"}, "x86_64", False, "CPU features"),
        (None, {"avx2", "amx_bf16"}, "AMD64", True, "/proc/cpuinfo"),
        (None, {"avx2", "fma"}, "x86_64", False, "/proc/cpuinfo"),
    ],
)
def test_capability_from_cpu_features(features, proc, machine, native, source):
    cap = capability.from_features(
        features, machine, None if proc is None else frozenset(proc)
    )
    assert cap is not None
    assert (cap.native, cap.source) == (native, source)
    assert cap.formulation == ("native" if native else "emulated")


@pytest.mark.parametrize(
    ("features", "machine"),
    [({"ASIMD": True}, "aarch64"), (None, "x86_64"), ({}, "arm64")],
)
def test_capability_unknown_features_leave_it_to_the_probe(features, machine):
    assert capability.from_features(features, machine, None) is None


@pytest.mark.parametrize(
    ("bf16_s", "f32_s", "native"),
    [(1.0, 0.7, False), (1.0, 1.1, False), (1.0, 1.2, True), (0.3, 1.0, True)],
)
def test_capability_from_probe_timings(bf16_s, f32_s, native):
    cap = capability.from_timings(bf16_s, f32_s)
    assert (cap.native, cap.source) == (native, "probe")
    assert f"{f32_s / bf16_s:.2f}x" in cap.evidence


@needs_cpu
def test_detection_matches_this_cpu(monkeypatch):
    # What the process sees (cpuid via NumPy), decided the documented way.
    monkeypatch.setattr(_config, "cpu_bf16", "auto")  # as if MIXPREC_CPU_BF16 unset
    detected = capability._detected()
    expected = capability.from_features(
        _compat.cpu_features(), platform.machine(), capability._proc_cpuinfo_flags()
    )
    if expected is not None:
        assert detected == expected
    else:
        assert detected.source == "probe"
    assert capability.cpu_bf16() == detected


@needs_cpu
def test_probe_runs_eagerly_inside_a_trace():
    seen = {}

    def f(x):
        seen["times"] = capability.probe_gemm_seconds(n=32, rounds=1)
        return x * 2

    jax.jit(f).trace(jnp.ones(3))
    bf16_s, f32_s = seen["times"]
    assert isinstance(bf16_s, float) and bf16_s > 0 and f32_s > 0


@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_override_forces_the_formulation(formulation):
    with capability.override(formulation):
        cap = capability.cpu_bf16()
        assert cap.formulation == formulation and cap.source == "override"
        assert make_config("mixed_bfloat16", platform="cpu").cpu_bf16 == formulation
        # Only bfloat16 on CPU has two formulations.
        assert make_config("mixed_float16", platform="cpu").cpu_bf16 is None
        assert make_config("mixed_bfloat16", platform="gpu").cpu_bf16 is None
    assert capability.cpu_bf16().source != "override"


def test_override_rejects_bad_values():
    with pytest.raises(ValueError, match=r"`override\(formulation=...\)`.*native"):
        with capability.override("fast"):
            pass
    with pytest.raises(ValueError, match=r"`dot_general\(..., cpu_bf16=...\)`"):
        _dot(jnp.ones((8, 8)), jnp.ones((8, 8)), (((1,), (0,)), ((), ())), "AVX")


@pytest.fixture
def reload_config(monkeypatch):
    before = _config.cpu_bf16
    saved = {k: os.environ.get(k) for k in ("MIXPREC_CPU_BF16", "MIXPREC_POLICY")}
    yield monkeypatch
    for key, value in saved.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    importlib.reload(_config)
    assert _config.cpu_bf16 == before


@pytest.mark.parametrize("value", ["emulated", " Native "])
def test_env_var_forces_the_formulation(reload_config, value):
    reload_config.setenv("MIXPREC_CPU_BF16", value)
    importlib.reload(_config)
    cap = capability.cpu_bf16()
    assert (cap.formulation, cap.source) == (value.strip().lower(), "MIXPREC_CPU_BF16")
    assert f"MIXPREC_CPU_BF16={cap.formulation}" in cap.describe()
    # An override in code still wins over the environment.
    with capability.override("native" if cap.formulation == "emulated" else "emulated"):
        assert capability.cpu_bf16().source == "override"


def test_env_var_rejects_bad_values(reload_config):
    reload_config.setenv("MIXPREC_CPU_BF16", "avx2")
    with pytest.raises(ValueError, match=r"MIXPREC_CPU_BF16.*auto, native, emulated"):
        importlib.reload(_config)


# ------------------------------------------------------ the two formulations


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("case", sorted(DOT_CASES))
def test_forward_matches_float32_within_bf16_tolerance(formulation, case):
    lhs_shape, rhs_shape, dn = DOT_CASES[case]
    lhs, rhs = _inputs(lhs_shape, rhs_shape)
    out = jax.jit(lambda a, b: _dot(a, b, dn, formulation))(lhs, rhs)
    assert out.dtype == F32
    ref = lax.dot_general(lhs, rhs, dn, precision=lax.Precision.HIGHEST)
    assert out.shape == ref.shape
    assert_trees_close(out, ref, dtype=BF16)
    # Both are a product of the bfloat16-rounded operands, accumulated in
    # float32: XLA must not drop the rounding of the emulated formulation.
    rounded = _f64(lhs.astype(BF16)), _f64(rhs.astype(BF16))
    oracle = np.asarray(
        lax.dot_general(*rounded, dn, precision=lax.Precision.HIGHEST), np.float64
    )
    np.testing.assert_allclose(_f64(out), oracle, rtol=2e-5, atol=2e-5)
    unrounded_err = np.max(np.abs(_f64(ref) - oracle))
    assert np.max(np.abs(_f64(out) - oracle)) < unrounded_err / 20


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("out_dtype", [F32, BF16])
def test_output_dtype(formulation, out_dtype):
    lhs, rhs = _inputs((8, 16), (16, 8))
    out = dots.dot_general(
        lhs,
        rhs,
        dimension_numbers=(((1,), (0,)), ((), ())),
        low_dtype=BF16,
        out_dtype=out_dtype,
        platform="cpu",
        cpu_bf16=formulation,
    )
    assert out.dtype == out_dtype and out.shape == (8, 8)


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("case", ["matmul", "xT_g", "attn_bthd", "two_contract"])
@pytest.mark.parametrize("in_dtype", [F32, BF16])
def test_gradients_match_float32(formulation, case, in_dtype):
    lhs_shape, rhs_shape, dn = DOT_CASES[case]
    lhs, rhs = _inputs(lhs_shape, rhs_shape, dtype=in_dtype)
    out_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), lhs, rhs).shape
    cot = jax.random.normal(jax.random.key(7), out_shape, jnp.float32)

    def loss(dot, a, b):
        return jnp.sum(dot(a, b) * cot)

    grads = jax.jit(
        jax.grad(
            lambda a, b: loss(lambda x, y: _dot(x, y, dn, formulation), a, b), (0, 1)
        )
    )(lhs, rhs)
    ref = jax.grad(
        lambda a, b: loss(
            lambda x, y: lax.dot_general(
                x.astype(F32), y.astype(F32), dn, precision=lax.Precision.HIGHEST
            ),
            a,
            b,
        ),
        (0, 1),
    )(lhs, rhs)
    assert_tree_dtypes(grads, (in_dtype, in_dtype))
    assert_trees_close(grads, ref, dtype=BF16, grad=True)


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_forward_mode_ad(formulation):
    lhs, rhs = _inputs((16, 24), (24, 32))
    dn = (((1,), (0,)), ((), ()))

    def f(a, b):
        return _dot(a, b, dn, formulation, forward_mode_ad=True)

    primal, tangent = jax.jvp(f, (lhs, rhs), (jnp.ones_like(lhs), rhs))
    ref = jax.jvp(
        lambda a, b: lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST),
        (lhs, rhs),
        (jnp.ones_like(lhs), rhs),
    )
    assert_tree_dtypes((primal, tangent), (F32, F32))
    assert_trees_close((primal, tangent), ref, dtype=BF16)


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("lhs_dtype", [F32, BF16])
def test_saved_residuals(lhs_dtype, formulation):
    # The rule, the same for every formulation and platform (the residuals of
    # a custom_vjp cannot depend on where it is lowered): every operand is
    # kept as the forward product read it, in bfloat16. For a parameter (an
    # input of the transformed function) that is the one rounded copy both
    # passes read, so that a sharded parameter is gathered once.
    lhs, rhs = _inputs((64, 96), (96, 48))
    lhs = lhs.astype(lhs_dtype)
    dn = (((1,), (0,)), ((), ()))

    def saved(alive):
        leaves = jax.eval_shape(
            lambda a, b: jax.tree.leaves(
                jax.vjp(lambda x, y: _dot(x, y, dn, formulation, alive=alive), a, b)[1]
            ),
            lhs,
            rhs,
        )
        return sorted((r.shape, jnp.dtype(r.dtype).name) for r in leaves)

    assert saved((False, False)) == sorted(
        [(lhs.shape, "bfloat16"), (rhs.shape, "bfloat16")]
    )
    # An activation and a float32 weight: the weight's rounding, not a
    # second copy made by the backward pass.
    assert saved((False, True)) == sorted(
        [(lhs.shape, "bfloat16"), (rhs.shape, "bfloat16")]
    )


def test_autocast_keeps_parameters_and_activations_in_16_bits():
    # Through autocast: the weights are inputs (kept as their one rounding,
    # which the backward pass reads), the hidden activation is computed (kept
    # in bfloat16).
    w1, w2 = jnp.ones((32, 64)), jnp.ones((64, 16))
    x = jnp.ones((8, 32))

    def loss(w1, w2, x):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    f = mixprec.autocast(loss, "mixed_bfloat16")
    leaves = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(f, *a)[1]), w1, w2, x)
    kinds = {(r.shape, jnp.dtype(r.dtype).name) for r in leaves}
    assert ((32, 64), "bfloat16") in kinds  # w1, rounded once
    assert ((64, 16), "bfloat16") in kinds  # w2 likewise
    assert ((8, 64), "bfloat16") in kinds  # tanh(x @ w1): a 16-bit activation
    assert ((32, 64), "float32") not in kinds  # no float32 weight as well
    assert ((64, 16), "float32") not in kinds


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_keeps_only_what_the_needed_cotangents_use(formulation):
    # Only the weight is differentiated (the first layer: x is data, an input
    # of the function): the weight itself is not kept, as JAX's own dot would
    # not keep it, and x is kept as the forward product read it.
    x, w = _inputs((64, 96), (96, 48))
    dn = (((1,), (0,)), ((), ()))

    def dot(v):
        return _dot(x, v, dn, formulation, alive=(True, True))

    kept = jax.eval_shape(lambda w: jax.tree.leaves(jax.vjp(dot, w)[1]), w)
    assert [(r.shape, r.dtype) for r in kept] == [(x.shape, BF16)]
    grad_w = jax.jit(jax.grad(lambda v: jnp.sum(dot(v) ** 2)))(w)
    ref = jax.grad(
        lambda v: jnp.sum(lax.dot_general(x, v, dn, precision="highest") ** 2)
    )(w)
    assert grad_w.dtype == F32
    assert_trees_close(grad_w, ref, dtype=BF16, grad=True)


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_unused_product_and_vmap_of_grad(formulation):
    lhs, rhs = _inputs((4, 16, 24), (24, 32))
    dn = (((1,), (0,)), ((), ()))

    # A product whose cotangent is (symbolically) zero.
    def f(a, b):
        unused = _dot(a, b, dn, formulation)
        return jnp.sum(a * a) + 0 * jnp.sum(b), unused

    g = jax.grad(lambda a, b: f(a, b)[0], (0, 1))(lhs[0], rhs)
    np.testing.assert_allclose(g[0], 2 * lhs[0], rtol=1e-6)
    np.testing.assert_array_equal(g[1], jnp.zeros_like(rhs))
    # Per-example gradients.
    per_example = jax.jit(
        jax.vmap(
            jax.grad(lambda a, b: jnp.sum(_dot(a, b, dn, formulation) ** 2), 1),
            in_axes=(0, None),
        )
    )(lhs, rhs)
    ref = jax.vmap(
        jax.grad(
            lambda a, b: jnp.sum(lax.dot_general(a, b, dn, precision="highest") ** 2),
            1,
        ),
        in_axes=(0, None),
    )(lhs, rhs)
    assert per_example.shape == (4, 24, 32) and per_example.dtype == F32
    assert_trees_close(per_example, ref, dtype=BF16, grad=True)


@needs_cpu
def test_emulated_runs_float32_dots_only():
    lhs, rhs = _inputs((64, 96), (96, 48))
    dn = (((1,), (0,)), ((), ()))
    # Float32 dots only (no bf16 GEMM, no layout copies or optimization
    # barriers), forward and backward.
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda a, b: jnp.sum(_dot(a, b, dn, "emulated")), (0, 1))
    )(lhs.astype(BF16), rhs)
    eqns = list(iter_eqns(jaxpr))
    dot_eqns = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dot_eqns) == 3
    for e in dot_eqns:
        assert [v.aval.dtype for v in e.invars] == [F32, F32]
    assert not [e for e in eqns if e.primitive.name == "optimization_barrier"]


def _mlp_loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"][None])
    h = jax.nn.relu(h @ p["w2"] + p["b2"][None])
    logits = h @ p["w3"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def _mlp(batch=64, d=128):
    k = jax.random.split(jax.random.key(0), 5)
    p = {
        "w1": jax.random.normal(k[0], (96, d)) / 10,
        "b1": jnp.zeros(d),
        "w2": jax.random.normal(k[1], (d, d)) / 11,
        "b2": jnp.zeros(d),
        "w3": jax.random.normal(k[2], (d, 10)) / 11,
    }
    x = jax.random.normal(k[3], (batch, 96))
    y = jax.random.randint(k[4], (batch,), 0, 10)
    return p, x, y


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_autocast_mlp_values_gradients_and_saved_bytes(formulation):
    # Batch 1024: activations outweigh the parameters, as in training.
    p, x, y = _mlp(batch=1024)
    with capability.override(formulation):
        loss = mixprec.autocast(_mlp_loss, "mixed_bfloat16")
    value, grads = jax.jit(jax.value_and_grad(loss))(p, x, y)
    ref_value, ref_grads = jax.value_and_grad(_mlp_loss)(p, x, y)
    assert value.dtype == F32
    assert_trees_close(value, ref_value, dtype=BF16)
    assert_tree_dtypes(grads, p)
    assert_trees_close(grads, ref_grads, dtype=BF16, grad=True)
    # What mixed precision still gives without native bf16: less memory saved
    # for the backward pass, at most 0.7x float32's.
    saved = timing.residual_bytes(loss, p, x, y)
    assert saved <= 0.7 * timing.residual_bytes(_mlp_loss, p, x, y)


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_autocast_under_shard_map(formulation):
    # Inside shard_map the operands carry varying manual axes; the custom
    # backward must give cotangents of the same type (a replicated weight
    # used with a sharded batch, as in data parallelism).
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (16, 8))

    def loss(w, x):
        def local(w, x):
            return lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "data")

        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()
        )(w, x)

    with capability.override(formulation):
        f = mixprec.autocast(loss, "mixed_bfloat16")
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    value, grad = jax.jit(jax.value_and_grad(f, (0, 1)))(w, xs)
    ref_value, ref_grad = jax.value_and_grad(loss, (0, 1))(w, x)
    assert value.dtype == F32
    assert_tree_dtypes(grad, (F32, F32))
    assert_trees_close(value, ref_value, dtype=BF16)
    assert_trees_close(grad, ref_grad, dtype=BF16, grad=True)


@needs_cpu
def test_autocast_formulations_compile_to_the_dots_they_promise():
    p, x, y = _mlp()
    kinds = {}
    for formulation in FORMULATIONS:
        with capability.override(formulation):
            loss = mixprec.autocast(_mlp_loss, "mixed_bfloat16")
        jaxpr = jax.make_jaxpr(jax.grad(loss))(p, x, y)
        kinds[formulation] = {
            tuple(str(v.aval.dtype) for v in e.invars)
            for e in iter_eqns(jaxpr)
            if e.primitive.name == "dot_general"
        }
    assert kinds["native"] == {("bfloat16", "bfloat16")}
    assert kinds["emulated"] == {("float32", "float32")}


# --------------------------------------------------------- telling the user


@needs_cpu
@pytest.mark.parametrize("formulation", FORMULATIONS)
def test_explain_notes_the_formulation_that_runs(formulation):
    p, x, y = _mlp()
    with capability.override(formulation):
        report_ = mixprec.explain(_mlp_loss, p, x, y, policy="mixed_bfloat16")
    notes = [n for n in report_.notes if n.startswith("Dots:")]
    assert len(notes) == 1, report_.notes
    note = notes[0]
    if formulation == "native":
        assert "native bfloat16 matmuls" in note
        assert "bfloat16 x bfloat16 -> float32 GEMMs" in note
    else:
        assert "no native bfloat16 matmul" in note
        assert "float32 GEMMs on bfloat16-rounded operands" in note
    assert f"override={formulation}" in note
    assert note in str(report_)
    # ... and the jaxpr explain reports on is the one with those dots.
    dtypes = {
        str(e.invars[0].aval.dtype)
        for e in iter_eqns(report_.jaxpr)
        if e.primitive.name == "dot_general"
    }
    assert dtypes == {"bfloat16" if formulation == "native" else "float32"}


@needs_cpu
def test_explain_notes_detected_capability_and_float16(monkeypatch):
    monkeypatch.setattr(_config, "cpu_bf16", "auto")  # as if MIXPREC_CPU_BF16 unset
    p, x, y = _mlp()
    rep = mixprec.explain(_mlp_loss, p, x, y, policy="mixed_bfloat16")
    detected = capability.cpu_bf16()
    (note,) = [n for n in rep.notes if n.startswith("Dots:")]
    assert detected.describe() in note
    rep16 = mixprec.explain(_mlp_loss, p, x, y, policy="mixed_float16")
    (note16,) = [n for n in rep16.notes if n.startswith("Dots:")]
    assert "no native float16 matmul" in note16 and "no speed-up" in note16
    rep32 = mixprec.explain(_mlp_loss, p, x, y, policy="float32")
    assert not [n for n in rep32.notes if n.startswith("Dots:")]


def _run(precision, seconds, mechanism="autocast", workload="digits"):
    return train.RunResult(
        workload, precision, mechanism, 9, round_times_s=[seconds] * 3
    )


def test_demo_says_why_a_run_is_slower():
    emulated = capability.Capability(False, "CPU features", "no AVX512BF16")
    native = capability.Capability(True, "CPU features", "AVX512BF16")
    runs = [
        _run("float32", 1.0),
        _run("mixed_bfloat16", 1.05),
        _run("mixed_float16", 1.6),
    ]
    notes = report.speed_notes(runs, platform="cpu", cpu_bf16=emulated, load=3.0)
    assert len(notes) == 2
    bf16, f16 = notes
    assert bf16.startswith("digits mixed_bfloat16: 0.95x float32 - ")
    assert "no native bfloat16 matmul" in bf16 and "float32 GEMMs" in bf16
    assert "load average 3.0" in bf16
    assert f16.startswith("digits mixed_float16: 0.62x float32 - ")
    assert "no float16 matmul" in f16
    # Faster runs need no excuse; a slower one on a native CPU still gets one.
    fast = [_run("float32", 1.0), _run("mixed_bfloat16", 0.5)]
    assert report.speed_notes(fast, platform="cpu", cpu_bf16=native) == []
    slow = [_run("float32", 1.0), _run("mixed_bfloat16", 1.2)]
    (why,) = report.speed_notes(slow, platform="cpu", cpu_bf16=native)
    assert "no known cause" in why
    forced = capability.Capability(True, "MIXPREC_CPU_BF16", "set to native")
    (why,) = report.speed_notes(slow, platform="cpu", cpu_bf16=forced)
    assert "bfloat16 GEMMs were forced" in why and "MIXPREC_CPU_BF16=native" in why
    fp8 = [_run("float32", 1.0), _run("mixed_float8", 2.0)]
    (why,) = report.speed_notes(fp8, platform="cpu", cpu_bf16=native)
    assert "no float8 arithmetic" in why
    manual = [_run("float32", 1.0), _run("mixed_bfloat16", 1.2, "manual")]
    (why,) = report.speed_notes(manual, platform="cpu", cpu_bf16=native)
    assert "hand-written casting" in why
    md = report.markdown(slow, {"digits": "MLP"}, {"why slower": [why]})
    assert "Slower than float32, and why:" in md and why in md


def test_demo_states_which_matmuls_are_native():
    emulated = capability.Capability(False, "CPU features", "no AVX512BF16")
    line = report.matmul_support("cpu", emulated)
    assert line.startswith("bfloat16: no native bfloat16 matmul (no AVX512BF16")
    assert "float16: no native CPU matmul" in line
    native = capability.Capability(True, "CPU features", "AVX512BF16")
    assert "bfloat16 GEMMs" in report.matmul_support("cpu", native)
    assert "natively" in report.matmul_support("gpu")


@needs_cpu
def test_conftest_pins_the_formulation_for_the_suite():
    # See the root conftest.py: every other test module sees this (native
    # unless MIXPREC_CPU_BF16 was set for the run).
    pinned = os.environ["MIXPREC_CPU_BF16"]
    assert pinned in ("native", "emulated")
    assert _config.cpu_bf16 == pinned
    assert make_config("mixed_bfloat16", platform="cpu").cpu_bf16 == pinned


@needs_cpu
def test_environment_records_the_formulation():
    env = timing.environment()
    assert env["cpu_bf16"]["formulation"] == capability.cpu_bf16().formulation
    assert env["cpu_bf16"]["describe"] == capability.cpu_bf16().describe()


# ----------------------------------------------------------------- benchmark


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _can_emulate_avx2() -> bool:
    flags = capability._proc_cpuinfo_flags() or frozenset()
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and "cpuid_fault" in flags
        and (shutil.which("cc") or shutil.which("gcc")) is not None
    )


def _bench(tmp_path, *extra):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    env.pop("MIXPREC_CPU_BF16", None)  # detect, as a user's run does
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(_ROOT, "benchmarks", "bench_cpu_bf16.py"),
            "--quick",
            "--workloads",
            "mlp",
            "--variants",
            "autocast,autocast_native,autocast_emulated",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert set(rows) == {"float32", "autocast", "autocast_native", "autocast_emulated"}
    assert rows["autocast_native"]["dots"] == {"bf16 x bf16 -> f32": 8}
    assert rows["autocast_emulated"]["dots"] == {"f32 x f32 -> f32": 8}
    for r in rows.values():
        assert r["median_s"] > 0 and r["residual_bytes"] > 0
    assert set(data["cpu_flags"]) <= set(timing.CPU_FLAGS)
    assert out.with_suffix(".md").read_text().count("|") > 10
    return data, rows


@needs_cpu
def test_benchmark_records_the_cpu_and_both_formulations(tmp_path):
    data, rows = _bench(tmp_path)
    assert data["emulation"] is None
    detected = data["cpu"]["detected_formulation"]
    assert detected == capability._detected().formulation
    assert rows["autocast"]["dots"] == rows[f"autocast_{detected}"]["dots"]


@needs_cpu
@pytest.mark.skipif(not _can_emulate_avx2(), reason="needs cc and CPUID faulting")
def test_benchmark_emulates_an_avx2_cpu(tmp_path):
    data, rows = _bench(tmp_path, "--emulate-cpu", "avx2")
    assert data["emulation"]["isa"] == "avx2"
    assert data["emulation"]["cpuid_calls_masked"] > 0
    seen = data["cpu"]["runtime_features"]
    assert seen["AVX2"] and not seen["AVX512F"] and not seen["AVX512BF16"]
    # The probe sees what the process sees, whatever /proc/cpuinfo lists.
    assert data["cpu"]["detected_formulation"] == "emulated"
    assert rows["autocast"]["dots"] == {"f32 x f32 -> f32": 8}
