"""Shared test helpers: per-dtype tolerances and dtype-checking comparisons."""

import importlib.util
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np


# Forward values and gradients, keyed by the dtype the computation ran in
# (as in jax's public_test_util).
TOL = {
    jnp.dtype(jnp.bfloat16): 1e-2,
    jnp.dtype(jnp.float16): 1e-3,
    jnp.dtype(jnp.float32): 1e-6,
}
GRAD_TOL = {
    jnp.dtype(jnp.bfloat16): 1e-1,
    jnp.dtype(jnp.float16): 1e-2,
    jnp.dtype(jnp.float32): 2e-3,
}


def tol(dtype, *, grad: bool = False) -> float:
    table = GRAD_TOL if grad else TOL
    return table[jnp.dtype(dtype)]


def assert_tree_dtypes(tree, expected) -> None:
    """Every leaf of ``tree`` has the dtype of the matching leaf of ``expected``.

    ``expected`` is a pytree of dtypes (or arrays) with the same structure, or a
    single dtype applied to every floating leaf.
    """
    leaves = jax.tree.leaves(tree)
    if isinstance(expected, (str, type, np.dtype)):
        for leaf in leaves:
            if jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                assert jnp.result_type(leaf) == jnp.dtype(expected), (
                    leaf.dtype,
                    expected,
                )
        return
    exp_leaves = jax.tree.leaves(expected)
    assert len(leaves) == len(exp_leaves)
    for a, b in zip(leaves, exp_leaves, strict=True):
        want = b.dtype if hasattr(b, "dtype") else jnp.dtype(b)
        assert jnp.result_type(a) == want, (jnp.result_type(a), want)


def assert_trees_close(actual, reference, *, dtype, grad: bool = False) -> None:
    """Compare ``actual`` against a float32 ``reference`` with ``dtype``'s tolerance.

    The comparison is relative to each leaf's largest magnitude, so that values
    near zero do not dominate.
    """
    t = tol(dtype, grad=grad)
    a_leaves = jax.tree.leaves(actual)
    r_leaves = jax.tree.leaves(reference)
    assert len(a_leaves) == len(r_leaves)
    for a, r in zip(a_leaves, r_leaves, strict=True):
        a = np.asarray(a, dtype=np.float64)
        r = np.asarray(r, dtype=np.float64)
        assert a.shape == r.shape
        scale = max(np.max(np.abs(r)), 1e-30)
        err = np.max(np.abs(a - r)) / scale if a.size else 0.0
        assert err <= t, f"relative error {err:.3g} > tolerance {t:g} for {dtype}"


BF16 = jnp.dtype(jnp.bfloat16)
F16 = jnp.dtype(jnp.float16)
F32 = jnp.dtype(jnp.float32)


# Primitives a dot formulation (a per-platform `cond` selected by
# `platform_index`) or a cast adds to a traced program by itself: tests that
# match an autocast program's equations against per-op records skip them.
FORMULATION_PRIMITIVES = frozenset(
    {
        "platform_index",
        "convert_element_type",
        "optimization_barrier",
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "dot_general",
        "custom_vjp_call",
        "cond",
    }
)


def platform_branch(eqn, platform):
    """For a ``cond`` that ``lax.platform_dependent`` emitted, the branch a
    lowering for ``platform`` keeps (``None`` for other equations)."""
    platforms = (
        eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
    )
    if platforms is None:
        return None
    for branch, names in zip(eqn.params["branches"], platforms, strict=True):
        if names is None or platform in names:
            return branch
    raise AssertionError(f"no branch for {platform} in {platforms}")


def is_formulation_call(eqn):
    """Whether ``eqn`` is the nested ``jit`` autocast calls a per-platform
    formulation through (one traced call per formulation and operand types)."""
    return eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == (
        "per_platform"
    )


def iter_eqns(jaxpr, platform="cpu"):
    """Every equation of a (closed) jaxpr, recursing into sub-jaxprs; of a
    per-platform formulation (``lax.platform_dependent``), only the branch a
    lowering for ``platform`` keeps (``None``: every branch), and not the
    nested ``jit`` it is called through."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if is_formulation_call(eqn):
            yield from iter_eqns(eqn.params["jaxpr"], platform)
            continue
        yield eqn
        branch = None if platform is None else platform_branch(eqn, platform)
        if branch is not None:
            yield from iter_eqns(branch, platform)
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, tuple | list) else [v]:
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield from iter_eqns(sub, platform)


def executed_lines(module_text, entry="main"):
    """The lines of a StableHLO module's ``entry`` function with every
    ``call`` replaced by the lines of the function it calls (recursively): one
    line per operation executed, where a function called twice (a traced call
    shared by several products) appears twice."""
    bodies, name = {}, None
    for line in module_text.splitlines():
        head = re.match(r"\s*func\.func (?:public |private )?@([\w$.]+)\(", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None and line.rstrip() == "  }":
            name = None
        elif name is not None:
            bodies[name].append(line)

    def expand(fn):
        for line in bodies[fn]:
            called = re.search(r"\bcall @([\w$.]+)\(", line)
            if called and called.group(1) in bodies:
                yield from expand(called.group(1))
            else:
                yield line

    return list(expand(entry))


def load_benchmark(name):
    """The module of ``benchmarks/<name>.py``, imported as ``name`` (registered
    in ``sys.modules``, where dataclasses look their module up)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
