"""Plan sites across bodies: a product in a `cond` branch or a called
function's body is its own site, not the one of the same layer outside it;
a `scan` body stays one site for all its iterations."""

import jax
import jax.numpy as jnp
import numpy as np

import mixprec
from mixprec._src.plan import Plan, Site


def _f(w, x, p):
    with jax.named_scope("mlp"):
        h = jnp.tanh(x @ w["a"])
        h = jax.lax.cond(p, lambda h: h @ w["b"], lambda h: jnp.tanh(h @ w["c"]), h)

        def body(h, _):
            return jnp.tanh(h @ w["d"]), None

        h, _ = jax.lax.scan(body, h, None, length=3)
        h = jax.jit(lambda h: h @ w["e"])(h)
    return jnp.mean(h**2)


def _args():
    k = jax.random.split(jax.random.key(0), 6)
    w = {n: jax.random.normal(k[i], (16, 16)) / 4 for i, n in enumerate("abcde")}
    return w, jax.random.normal(k[5], (8, 16)), jnp.bool_(True)


def _forward(report):
    return [(op.site, op.source.split(":")[-1]) for op in report.find("dot_general")]


def test_bodies_do_not_share_the_sites_of_their_layer():
    w, x, p = _args()
    report = mixprec.explain(_f, w, x, p, policy=Plan("mixed_bfloat16"))
    sites = [op.site for op in report.find("dot_general")]
    assert sites == [("mlp", "dot_general", i) for i in range(5)]
    # a plan that names one branch's product changes that product alone
    plan = Plan("mixed_bfloat16", sites=(Site("mlp", "dot_general", 2, "float32"),))
    report = mixprec.explain(_f, w, x, p, policy=plan)
    dtypes = [op.in_dtypes[0] for op in report.find("dot_general")]
    assert dtypes == ["bfloat16", "bfloat16", "float32", "bfloat16", "bfloat16"]
    got = mixprec.autocast(_f, plan)(w, x, p)
    assert got.dtype == jnp.float32


def test_a_whole_step_keeps_the_forward_names_and_its_backward_follows():
    """Under `autocast(jax.grad(f))` the forward products keep the names
    they have in `f`; the backward products in the bodies are traced back
    to none (their residual crossed the body) and take the widest of their
    layer, the outside one follows its forward site."""
    w, x, p = _args()
    plan = Plan("mixed_bfloat16", sites=(Site("mlp", "dot_general", 2, "float32"),))
    report = mixprec.explain(jax.grad(_f), w, x, p, policy=plan)
    rows = report.find("dot_general")
    fwd = [op.site for op in rows if not op.backward]
    assert fwd == [("mlp", "dot_general", i) for i in range(5)]
    bwd = [op for op in rows if op.backward]
    assert bwd and all(op.site[2] in (None, 0) for op in bwd)
    for op in bwd:
        want = "float32" if op.site[2] is None else "bfloat16"
        assert op.in_dtypes[0] == want, (op.site, op.source)


def test_a_scan_body_and_a_function_called_twice_are_one_site():
    def f(w, x):
        g = jax.jit(lambda h, m: jnp.tanh(h @ m))
        with jax.named_scope("blk"):
            h = g(x, w["a"])
            h = g(h, w["a"])

            def body(h, m):
                return jnp.tanh(h @ m), None

            h, _ = jax.lax.scan(body, h, jnp.stack([w["b"]] * 4))
        return jnp.sum(h)

    w, x, _ = _args()
    report = mixprec.explain(f, w, x, policy=Plan("mixed_bfloat16"))
    sites = [op.site for op in report.find("dot_general")]
    assert sites == [("blk", "dot_general", 0)] * 2 + [("blk", "dot_general", 1)]
    plan = mixprec.plan(f, w, x, candidates=("mixed_bfloat16", "float32"))
    assert [s.key for s in plan.sites] == [
        ("blk", "dot_general", 0),
        ("blk", "dot_general", 1),
    ]
    np.testing.assert_allclose(
        plan.sites[1].flops, 4 * 2 * 8 * 16 * 16, rtol=0
    )  # counted over the iterations
