"""The JAX-version shims: each is checked on the JAX that is installed, so the
suite run on every supported release checks every branch it takes there."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import mixprec
from mixprec._src import _compat


def _scan_eqn(num_consts: int):
    consts = [jnp.full((3,), float(i + 1)) for i in range(num_consts)]

    def f(c0, xs):
        def body(c, x):
            for k in consts:
                c = c * k
            return c + x, c * x

        return lax.scan(body, c0, xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((4, 3)))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


@pytest.mark.parametrize("num_consts", [0, 2])
def test_scan_layout_reads_consts_and_carry(num_consts):
    eqn = _scan_eqn(num_consts)
    assert _compat.scan_layout(eqn.params) == (num_consts, 1)


def test_scan_params_rebinds_with_extra_leading_consts():
    # Rebinding a scan with one more constant: the body takes it first.
    eqn = _scan_eqn(1)
    params = {k: v for k, v in eqn.params.items() if k != "jaxpr"}
    body = eqn.params["jaxpr"]
    extra = jnp.asarray(0.5)

    def new_body(e, *args):
        outs = jax.core.eval_jaxpr(body.jaxpr, body.consts, *args)
        return [outs[0] * e, *outs[1:]]

    n_in = len(body.in_avals)
    new = jax.make_jaxpr(new_body)(
        extra, *[jnp.zeros(a.shape, a.dtype) for a in body.in_avals]
    )
    assert len(new.in_avals) == n_in + 1
    const = jnp.full((3,), 1.0)
    c0, xs = jnp.ones(3), jnp.arange(12.0).reshape(4, 3)
    rebound = lax.scan_p.bind(
        extra, const, c0, xs, jaxpr=new, **_compat.scan_params(params, extra_consts=1)
    )
    carry, ys = c0, []
    for x in xs:
        c = carry * const
        carry, y = (c + x) * extra, c * x
        ys.append(y)
    np.testing.assert_allclose(rebound[0], carry)
    np.testing.assert_allclose(rebound[1], np.stack(ys))
    assert _compat.scan_layout(_compat.scan_params(params, extra_consts=1)) == (2, 1)


def test_custom_vjp_bwd_is_called_with_this_jax_convention():
    # autocast rebuilds a custom_vjp and calls the user's flattened bwd itself.
    @jax.custom_vjp
    def clip_grad(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        return (jnp.clip(g, -1.0, 1.0),)

    clip_grad.defvjp(fwd, bwd)

    def loss(w, x):
        return jnp.sum(clip_grad(x @ w) * 10.0)

    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    g = jax.grad(mixprec.autocast(loss, "mixed_bfloat16"))(w, x)
    np.testing.assert_allclose(g, jax.grad(loss)(w, x))
    assert g.dtype == jnp.float32


def test_version_tuple():
    assert _compat._version_tuple("0.11.2") == (0, 11, 2)
    assert _compat._version_tuple("0.12.0.1") == (0, 12, 0)
    assert _compat._version_tuple("0.10.2rc1") == (0, 10, 2)
    assert _compat.JAX_VERSION == _compat._version_tuple(jax.__version__)
    assert _compat.OLDEST_SUPPORTED_JAX <= _compat.JAX_VERSION


def test_untested_jax_warns_once(monkeypatch):
    monkeypatch.setattr(_compat, "_warned_untested", [])
    newer = (_compat.NEWEST_TESTED_JAX[0], _compat.NEWEST_TESTED_JAX[1] + 1, 0)
    with pytest.warns(_compat.UntestedJaxWarning, match="tested on JAX 0.10.2"):
        assert _compat.warn_if_untested_jax(newer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compat.warn_if_untested_jax(newer)  # untested, but not again
        assert not _compat.warn_if_untested_jax((*_compat.NEWEST_TESTED_JAX, 9))
        assert not _compat.warn_if_untested_jax(_compat.OLDEST_SUPPORTED_JAX)


def test_installed_jax_is_in_the_tested_range():
    # The suite runs on tested releases only; a newer one warns at import.
    assert not _compat.warn_if_untested_jax()


def test_cpu_miscompile_workaround_turns_off_the_ynn_fusion():
    # The demo's hand-written bfloat16 MLP: from jaxlib 0.11 XLA:CPU fuses it
    # into YNNPACK kernels that return NaN on AVX2 hosts; the options must be
    # accepted by this jaxlib and leave no such fusion in the optimized HLO.
    def mlp(w1, w2, x):
        h = jax.nn.relu(x.astype(jnp.bfloat16) @ w1.astype(jnp.bfloat16))
        return jax.nn.log_softmax(h @ w2.astype(jnp.bfloat16))

    args = (jnp.ones((64, 32)) / 8, jnp.ones((32, 10)) / 8, jnp.ones((100, 64)))
    options = _compat.cpu_miscompile_workaround_options("cpu")
    assert _compat.cpu_miscompile_workaround_options("gpu") == {}
    assert bool(options) == (_compat.JAX_VERSION >= (0, 11))
    # The option is known to every supported jaxlib (0.10.2 makes the same
    # fusions, computed right, so it is not passed there).
    options = options or {"xla_cpu_experimental_ynn_fusion_type": ""}
    compiled = jax.jit(mlp).lower(*args).compile(options)
    assert "__ynn_fusion" not in compiled.as_text()
    out = compiled(*args)
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out).all())


def test_eval_closed_jaxpr_takes_numpy_arguments_in_a_trace():
    # An autocast function called twice inside one jit runs its cached jaxpr
    # with the NumPy argument as a constant of the caller's trace.
    ag = mixprec.autocast(lambda c, x: x * c, "mixed_bfloat16")
    c = np.float64(2.0) * np.ones(4)  # not canonical: float64
    out = jax.jit(lambda x: ag(c, x) + ag(c, x))(jnp.ones(4))
    np.testing.assert_array_equal(out, np.full(4, 4.0))
    assert out.dtype == jnp.float32


def test_match_vma_makes_operands_vary_alike():
    mesh = jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = []

    def f(x):
        a, b = _compat.match_vma([x, np.float32(1.0)])
        seen.append([_compat.varying_axes(jax.typeof(v)) for v in (a, b)])
        return lax.add(a, b)

    g = jax.shard_map(f, mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
    np.testing.assert_array_equal(jax.jit(g)(jnp.zeros(4)), np.ones(4))
    assert seen == [[frozenset({"i"}), frozenset({"i"})]]
