"""The jaxpr facts shared by the rewrite passes and the walk: structural names
found going forward from chosen leaves (what the attention backward proof
uses), and the per-jaxpr tables."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mixprec._src.autocast import jaxprs


def _masked_softmax(s):
    # A constant causal mask (iota-based, computed from literals only) and a
    # jit body: both must be named like the reference's.
    n = s.shape[-1]
    mask = lax.broadcasted_iota(jnp.int32, (n, n), 0) >= lax.broadcasted_iota(
        jnp.int32, (n, n), 1
    )
    return jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)


def _found(program, leaves_of, ref, ref_args):
    names = jaxprs.StructuralNames()
    leaves = [names.leaf(k) for k in range(len(ref_args))]
    ref_closed = jax.make_jaxpr(ref)(*ref_args)
    outs = names.of_jaxpr(ref_closed.jaxpr, ref_closed.consts, leaves)
    stop = frozenset(leaves)
    keep = names.ancestors(outs, stop) - stop
    found = jaxprs.names_from(
        program,
        names,
        dict(zip(leaves_of, leaves, strict=True)),
        keep,
        jaxprs.users(program),
    )
    return names, outs, found


def test_names_from_finds_exactly_the_reference_computation():
    s = jnp.ones((4, 4))
    w = jnp.ones((4, 4))

    def program(s, w, other):
        p = _masked_softmax(s)  # the reference's computation
        q = jax.nn.softmax(s, axis=-1)  # unmasked: a different computation
        r = _masked_softmax(other)  # the same computation of a foreign input
        return p @ w, q, r

    closed = jax.make_jaxpr(program)(s, w, s)
    jaxpr = closed.jaxpr
    names, [want], found = _found(jaxpr, [jaxpr.invars[0]], _masked_softmax, [s])
    # The program's softmax result carries the reference's name.
    [dot] = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert found[dot.invars[0]] == want
    # Nothing computed from the foreign input or by the unmasked softmax, nor
    # the product after it, is named.
    q_var, r_var = jaxpr.outvars[1], jaxpr.outvars[2]
    assert q_var not in found and r_var not in found
    assert jaxpr.outvars[0] not in found
    # Every named value is one of the reference's.
    assert set(found.values()) <= names.ancestors([want], frozenset())


def test_names_from_costs_what_it_reaches_not_the_program():
    """The table grows with the equations reached from the leaves, not with
    the rest of the program: a long chain after the reference's computation
    (reading its result) or beside it adds no names."""

    def program(n):
        def f(s, x):
            p = _masked_softmax(s)
            y = p
            for _ in range(n):
                x = jnp.sin(x) * 1.5 + 0.25
                y = jnp.sin(y) * 1.5 + 0.25
            return p, x, y

        return jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones(3)).jaxpr

    sizes = []
    for n in (2, 50):
        jaxpr = program(n)
        names, [want], found = _found(
            jaxpr, [jaxpr.invars[0]], _masked_softmax, [jnp.ones((4, 4))]
        )
        assert found[jaxpr.outvars[0]] == want
        sizes.append(len(names.table))
    assert sizes[0] == sizes[1]


def test_constant_vars_and_positions():
    def f(x):
        mask = lax.broadcasted_iota(jnp.int32, (3,), 0) > 0
        return jnp.where(mask, x, 0.0)

    jaxpr = jax.make_jaxpr(f)(np.ones(3, np.float32)).jaxpr
    const = jaxprs.constant_vars(jaxpr)
    at = jaxprs.positions(jaxpr)
    # The iota and the comparison are constant; the select reads x.
    by_name = {e.primitive.name: e for e in jaxpr.eqns}
    assert by_name["iota"].outvars[0] in const
    assert jaxpr.outvars[0] not in const
    for i, e in enumerate(jaxpr.eqns):
        assert all(at[o] == i for o in e.outvars)


def test_backward_eqns_are_those_jax_transposition_emitted():
    def loss(w, x):
        with jax.named_scope("transpose"):  # a scope of that name is no transform
            h = jnp.tanh(x @ w)
        return jnp.sum(h * h)

    w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
    jaxpr = jax.make_jaxpr(jax.grad(loss))(w, x).jaxpr
    backward = jaxprs.backward_eqns(jaxpr)
    by_text = {
        i
        for i, e in enumerate(jaxpr.eqns)
        if "transpose(" in str(e.source_info.name_stack)
    }
    assert backward == by_text
    assert backward and len(backward) < len(jaxpr.eqns)
