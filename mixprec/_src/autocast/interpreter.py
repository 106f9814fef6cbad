"""The autocast interpreter: one walk over a jaxpr for autocast, explain and diagnose.

Before a jaxpr is walked, the rewrite passes
(:mod:`~mixprec._src.autocast.rewrites`) replace what they recognise (a
written-out attention, and in a differentiated program its proven backward
pass) by one equation of a private primitive with its own op-table entry.
The walk then meets only ordinary equations. :func:`eval_jaxpr` walks a jaxpr
like ``jax.core.eval_jaxpr`` (literals read directly, ``zip(strict=True)``,
each equation under its user source context and ``eqn.ctx.manager``); for
each equation it:

1. finds the op's entry in the op table (:mod:`~mixprec._src.autocast.ops`);
2. for a higher-order primitive, hands the equation to its rule, which walks
   the body with this same interpreter (or, if the observer ``steps``, to the
   stepping path, which walks each iteration on concrete values);
3. otherwise asks :func:`~mixprec._src.autocast.decide.decide_eqn` for the
   precision, once, and runs the op's rule with that
   :class:`~mixprec._src.autocast.decide.Decision`;
4. tells the observer, if there is one, what ran.

The walk decides nothing: dtypes are chosen in
:mod:`~mixprec._src.autocast.decide`, from the op's table entry and the facts
gathered about the jaxpr's values (:mod:`~mixprec._src.autocast.facts`, one
table per jaxpr, passed beside the walk). A :class:`Walk` is where the walk
is (configuration, region, path, observer): never changed once made.

Three clients share the walk, through the same front door
(:mod:`~mixprec._src.autocast.api`). :func:`mixprec.autocast` stages the result
out. ``mixprec.explain`` adds an observer that records each decision while the
transformed jaxpr is traced. ``mixprec.diagnose`` walks concrete values with an
observer that also runs each equation as written (the float32 reference),
op by op (no rewrites), and has loops stepped and branches taken on concrete
values (:mod:`mixprec._src.numerics.diagnose`,
:mod:`mixprec._src.autocast.rules.control_flow`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from jax.extend import source_info_util as siu
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mixprec._src import _compat
from mixprec._src.autocast import (
    facts as facts_lib,
    jaxprs,
    ops,
    rewrites,
    sites as sites_lib,
)
from mixprec._src.autocast.avals import float_dtype
from mixprec._src.autocast.decide import (
    BIG,
    CONST,
    FOLLOWS,
    GRAD,
    HIGHER_ORDER,
    INPUT,
    STAT,
    Decision,
    Precision,
    decide_epilogue,
    decide_eqn,
    literal_mark,
    out_marks,
    runs_as_traced,
)
from mixprec._src.autocast.facts import (
    FOLD_LIMIT,
    Facts,
    KnownRange,
    known_value,
    value_range,
)
from mixprec._src.autocast.operands import (
    CastContext,
    bind,
    cast,
    default_rule,
    ran_with,
    run_default,
    run_own,
)
from mixprec._src.autocast.walk import Observer, PlanWarning, Walk, check_rules


__all__ = [
    "BIG",
    "CONST",
    "FOLLOWS",
    "GRAD",
    "INPUT",
    "STAT",
    "FOLD_LIMIT",
    "CastContext",
    "KnownRange",
    "Observer",
    "PlanWarning",
    "Walk",
    "bind",
    "bind_as_written",
    "cast",
    "default_rule",
    "eval_jaxpr",
    "ran_with",
    "run_own",
    "known_value",
    "run_inline",
    "value_range",
]

# Equations created by mixprec point at the user code that caused them.
siu.register_exclusion(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

_F32 = np.dtype(np.float32)

bind_as_written = jaxprs.bind_as_written


# ------------------------------------------------------------------ running


def _run_rule(
    spec: ops.OpSpec | None, prim: Any, ctx: CastContext, invals: Sequence[Any]
) -> list[Any]:
    rule = None if ctx.epilogue else ops.rule_for(spec)
    if rule is not None:
        outs = rule(ctx, *invals, **ctx.eqn.params)
        return list(outs) if prim.multiple_results else [outs]
    return run_default(ctx, invals)


def run_decided(
    walk: Walk,
    eqn: JaxprEqn,
    decision: Decision,
    invals: Sequence[Any],
    marks: Sequence[int],
    *,
    epilogue: bool = False,
) -> list[Any]:
    """Runs a first-order ``eqn`` with a decision already made (no observer)."""
    spec = ops.spec_for(eqn.primitive.name)
    ctx = CastContext(walk.config, eqn, decision, walk, marks, [], epilogue)
    return _run_rule(spec, eqn.primitive, ctx, invals)


def _no_rerun(values: Sequence[Any]) -> list[Any]:
    del values
    raise NotImplementedError("a fused op is not rerun op by op")


# The rule of every higher-order equation of a walk whose observer `steps`
# (set by `rules/control_flow.py`).
_stepping_rule: list[Callable[..., Any]] = []


def set_stepping_rule(rule: Callable[..., Any]) -> None:
    """Sets the rule that runs the higher-order equations of a walk whose
    observer ``steps``, on concrete values (see :class:`Observer`)."""
    _stepping_rule[:] = [rule]


def run_eqn(
    walk: Walk, eqn: JaxprEqn, invals: list[Any], marks: Sequence[int]
) -> tuple[list[Any], list[int]]:
    """Runs one equation in ``walk``. Returns the outputs and their marks."""
    prim = eqn.primitive
    spec = ops.spec_for(prim.name)
    n_out = len(eqn.outvars)
    if (spec is not None and spec.is_higher_order) or jaxprs.has_jaxpr_params(
        eqn.params
    ):
        walk = walk.at(eqn)
        # What a backward pass computes from a gradient is one, as for a
        # first-order equation (`out_marks`): the cotangents a transposed
        # `scan` or `while` returns (a rule may set its outputs' marks).
        grad = GRAD if walk.backward and any(m & GRAD for m in marks) else 0
        hop_marks = [grad] * n_out
        ctx = CastContext(walk.config, eqn, HIGHER_ORDER, walk, marks, hop_marks)
        rule = ops.higher_order_rule(prim.name)
        if getattr(walk.observer, "steps", False):
            rule = _stepping_rule[0]
        outs = rule(ctx, *invals, **eqn.params)
        outs = list(outs) if prim.multiple_results else [outs]
        return outs, hop_marks
    decision = decide_eqn(walk, eqn, spec, invals, marks)
    epilogue = False
    if walk.facts.wide:
        wide = walk.facts.wide
        products = [type(v) is not Literal and v in wide for v in eqn.invars]
        found = decide_epilogue(eqn, spec, decision, invals, marks, products)
        if found is not None:
            decision, i = found
            invals[i] = wide[eqn.invars[i]]
            epilogue = True
    # (A fused op's rule fills in its results' marks; a fusion not fused runs
    # its equations, each reported on its own, and is not an op itself.)
    rule_marks: list[int] = []
    ctx = CastContext(walk.config, eqn, decision, walk, marks, rule_marks, epilogue)
    outs = _run_rule(spec, prim, ctx, invals)
    if spec is not None and spec.product is not None and not walk.backward:
        _note_partners(walk, eqn, decision, invals)
    fusion = spec is not None and ops.FUSION in spec.flags
    if walk.observer is not None and decision is not HIGHER_ORDER:
        if fusion:
            rerun = _no_rerun
        else:
            plain = walk.probe()

            def rerun(values: Sequence[Any]) -> list[Any]:
                with _eqn_context(eqn):
                    return run_decided(
                        plain, eqn, decision, values, marks, epilogue=epilogue
                    )

        walk.observer.on_eqn(
            walk, eqn, decision, ran_with(decision, eqn, invals), invals, outs, rerun
        )
    if rule_marks:
        return outs, rule_marks
    return outs, out_marks(spec, eqn, marks, n_out, walk.backward, walk)


def _taken_as_traced(
    walk: Walk, eqn: JaxprEqn, invals: Sequence[Any], marks: Sequence[int]
) -> tuple[list[Any], list[int]] | None:
    """The results and marks of ``eqn`` recorded as it was traced (in its own
    source context), where :func:`~mixprec._src.autocast.decide.runs_as_traced`
    says it runs that way and nothing watches the walk; ``None`` otherwise
    (:func:`run_eqn` runs it)."""
    if walk.observer is not None or jaxprs.has_jaxpr_params(eqn.params):
        return None
    spec = ops.spec_for(eqn.primitive.name)
    if (spec is not None and spec.is_higher_order) or not runs_as_traced(
        walk, eqn, spec, invals
    ):
        return None
    outs = _compat.emit_as_written(eqn, invals, own_context=True)
    if outs is None:
        return None
    n = len(eqn.outvars)
    return outs, out_marks(spec, eqn, marks, n, walk.backward, walk)


@contextlib.contextmanager
def _eqn_context(eqn: JaxprEqn) -> Iterator[None]:
    name_stack = siu.current_name_stack() + eqn.source_info.name_stack
    with siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
            yield


def eval_jaxpr(
    walk: Walk,
    jaxpr: Jaxpr | ClosedJaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    marks: Sequence[int] | None = None,
    known: Sequence[Any] = (),
) -> tuple[list[Any], list[int]]:
    """Evaluates ``jaxpr`` on ``args`` with autocast's decisions and rules.

    Args:
        walk: where and how to walk.
        jaxpr: an open ``Jaxpr`` (then ``consts`` are its constvars' values) or
            a ``ClosedJaxpr`` (then ``consts`` must be empty).
        consts: values of the constvars.
        args: values of the invars.
        marks: per invar, the marks of its value (default: none).
        known: the values of the first invars when they are constants known
            before the walk (the closed-over constants the front door passes
            as arguments, the constant operands of a nested ``jit``; ``None``
            where unknown): their ranges decide whether they fit the low
            dtype, and a fill of a known scalar saturates without a clamp.

    Returns:
        The output values and their marks.
    """
    if isinstance(jaxpr, ClosedJaxpr):
        if consts:
            raise ValueError("`eval_jaxpr`: pass no `consts` with a ClosedJaxpr.")
        consts = jaxpr.consts
        jaxpr = jaxpr.jaxpr
    facts = Facts()
    # A fused op's record reaches its backward pass in another body (the
    # transposed body of a scan pair); its keys are the ops' own matches.
    facts.fused = walk.facts.fused
    plan = walk.config.plan
    named = None
    if plan is not None or walk.observer is not None:
        # (An observer reports each product's site, plan or not.)
        open_jaxpr: Jaxpr = jaxpr  # type: ignore[assignment]
        named = sites_lib.name_sites(open_jaxpr, walk.scope, walk.backward, walk.sites)
        if plan is not None and not walk.path and not walk.scope:
            check_rules(plan, open_jaxpr)
    walk = walk.over(facts, named)
    if walk.rewrites:
        jaxpr = rewrites.rewrite(jaxpr, consts, known)  # type: ignore[arg-type]
    env: dict[Any, Any] = {}
    mk: dict[Any, int] = {}
    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
        mk[v] = CONST | INPUT
        facts_lib.note_constant(facts, v, x)
    if marks is None:
        marks = [0] * len(args)
    for v, x, m in zip(jaxpr.invars, args, marks, strict=True):
        env[v] = x
        mk[v] = m
    for v, x in zip(jaxpr.invars, known, strict=False):
        facts_lib.note_constant(facts, v, x)
    for eqn in jaxpr.eqns:
        _step(walk, eqn, env, mk)
    return _read_out(jaxpr.outvars, env, mk)


def run_inline(
    walk: Walk,
    eqns: Sequence[JaxprEqn],
    invars: Sequence[Any],
    invals: Sequence[Any],
    inmarks: Sequence[int],
    outvars: Sequence[Any],
) -> tuple[list[Any], list[int]]:
    """Walks ``eqns`` (equations of the jaxpr ``walk`` is in, taken out of it
    by a rewrite) on ``invals`` as if they were still in place: with the same
    facts, each decided and reported on its own. Returns the values and marks
    of ``outvars``."""
    env = dict(zip(invars, invals, strict=True))
    mk = dict(zip(invars, inmarks, strict=True))
    for eqn in eqns:
        _step(walk, eqn, env, mk)
    return _read_out(outvars, env, mk)


def _read_out(
    outvars: Sequence[Any], env: dict[Any, Any], mk: dict[Any, int]
) -> tuple[list[Any], list[int]]:
    outs = [jaxprs.read(env, v) for v in outvars]
    outmarks = [literal_mark() if type(v) is Literal else mk[v] for v in outvars]
    return outs, outmarks


def _step(walk: Walk, eqn: JaxprEqn, env: dict[Any, Any], mk: dict[Any, int]) -> None:
    """Runs one equation of a jaxpr being evaluated, in ``env``."""
    invals = [jaxprs.read(env, v) for v in eqn.invars]
    inmarks = [literal_mark() if type(v) is Literal else mk[v] for v in eqn.invars]
    walk = walk.for_eqn(eqn)
    plan = walk.config.plan
    taken = None
    if plan is not None and plan.switch is not None:
        # `mixprec.plan`'s measurement: each site's candidates, one chosen
        # at run time (`numerics/plan.py`).
        taken = plan.switch(walk, eqn, invals, inmarks)
    if taken is None:
        taken = _taken_as_traced(walk, eqn, invals, inmarks)
    if taken is None:
        with _eqn_context(eqn):
            taken = run_eqn(walk, eqn, invals, inmarks)
    outs, outmarks = taken
    producers = walk.facts.producers
    for v, x, m in zip(eqn.outvars, outs, outmarks, strict=True):
        env[v] = x
        mk[v] = m
        producers[v] = eqn
    facts_lib.note_scalar(walk.facts, eqn, inmarks)
    facts_lib.fold_constant(walk.facts, eqn, inmarks)


def _note_partners(
    walk: Walk, eqn: JaxprEqn, decision: Decision, invals: Sequence[Any]
) -> None:
    """Remembers, for each operand of a lowered forward product, the dtype the
    other operand ran in (a float32 master weight, a 16-bit activation).

    JAX's transpose of ``dot(x, w)`` is ``dot(g, w)`` (the gradient of ``x``)
    and ``dot(x, g)`` (that of ``w``): the forward operand that a backward
    product keeps as its residual names whose gradient it computes, the
    other one's. An operand seen with partners of different dtypes gets the
    widest.
    """
    if decision.precision not in (Precision.LOW, Precision.FLOAT8):
        return
    if len(eqn.invars) < 2:
        return
    a, b = eqn.invars[:2]
    da, db = float_dtype(invals[0]), float_dtype(invals[1])
    partners = walk.facts.partners
    for var, partner in ((a, db), (b, da)):
        if type(var) is Literal or partner is None:
            continue
        seen = partners.get(var)
        if seen is not None and seen != partner:
            partner = _F32
        partners[var] = partner
