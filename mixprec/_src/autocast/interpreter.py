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
import dataclasses
import functools as ft
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from jax.extend import source_info_util as siu
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from mixprec._src import _compat, plan as plan_lib
from mixprec._src.autocast import (
    facts as facts_lib,
    jaxprs,
    ops,
    regions,
    rewrites,
    sites as sites_lib,
)
from mixprec._src.autocast.avals import float_dtype
from mixprec._src.autocast.config import CastConfig
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
    bind,
    cast,
    cast_operands,
    default_rule,
    ran_with,
    run_default,
    run_own,
)


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


class Observer(Protocol):
    """What ``explain`` and ``diagnose`` plug into the walk."""

    #: The walk runs on concrete values and each higher-order equation takes
    #: the stepping path (:func:`set_stepping_rule`): loops stepped, branches
    #: taken, call bodies walked in place, so that the observer sees every
    #: iteration (``diagnose``). ``False``: each runs its rule (``explain``).
    steps: bool
    #: The rewrite passes (:mod:`~mixprec._src.autocast.rewrites`) run on the
    #: jaxprs the walk enters: the observer sees a fused op as one equation
    #: (``explain``). ``False``: it sees the equations a fusion would replace
    #: (``diagnose``, which compares op by op; on its CPU the fused
    #: formulation is those same ops).
    fuses: bool

    def on_eqn(
        self,
        walk: Walk,
        eqn: JaxprEqn,
        decision: Decision,
        ran_with: Sequence[Any],
        invals: Sequence[Any],
        outs: Sequence[Any],
        rerun: Callable[[Sequence[Any]], list[Any]] | None,
    ) -> None:
        """Called after a first-order equation ran, with its operands and
        results; ``rerun(values)`` runs the equation again, with the same
        decision, on other operands. ``rerun`` is ``None`` for a higher-order
        equation the stepping path ran as a whole (one op)."""

    def on_note(self, walk: Walk, eqn: JaxprEqn, text: str) -> None:
        """Called with something a report should say about ``eqn``."""

    def on_own(
        self,
        walk: Walk,
        eqn: JaxprEqn,
        decision: Decision,
        ran_with: Sequence[Any],
        invals: Sequence[Any],
        outs: Sequence[Any],
    ) -> None:
        """Called for an op autocast adds to the program by itself (not an
        equation of the walked jaxpr: its operands are not the walk's values),
        after it ran (see :func:`run_own`)."""


# ------------------------------------------------------------------ the walk


class Walk:
    """Where the interpreter is: configuration, region, path, observer, and the
    facts table of the jaxpr being walked.

    Never changed once made: entering a body, a region or an equation makes a
    new one (cheap: plain slots, nothing copied but references).
    """

    __slots__ = (
        "backward",
        "composite",
        "config",
        "current",
        "facts",
        "float32",
        "float32_lines",
        "observer",
        "parent_source",
        "path",
        "scope",
        "sites",
        "trip",
    )

    config: CastConfig
    observer: Observer | None
    path: str
    trip: int
    float32: bool
    composite: str
    backward: bool
    parent_source: str
    scope: str
    float32_lines: frozenset[tuple[str, int]]
    current: JaxprEqn | None
    facts: Facts
    sites: dict[int, tuple[Any, ...]]

    def __init__(
        self,
        config: CastConfig,
        *,
        observer: Observer | None = None,
        path: str = "",
        trip: int = 1,
        float32: bool = False,
        composite: str = "",
        backward: bool = False,
        parent_source: str = "",
        scope: str = "",
        float32_lines: frozenset[tuple[str, int]] = frozenset(),
        current: JaxprEqn | None = None,
        facts: Facts | None = None,
        sites: dict[int, tuple[Any, ...]] | None = None,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "config", config)
        set_(self, "observer", observer)
        set_(self, "path", path)
        set_(self, "trip", trip)
        set_(self, "float32", float32)
        set_(self, "composite", composite)
        set_(self, "backward", backward)
        # The user source line of the higher-order equation around this body
        # (for equations without one of their own).
        set_(self, "parent_source", parent_source)
        # The name stack of the higher-order equations around this body (the
        # name stacks of a body's equations start afresh).
        set_(self, "scope", scope)
        # User source lines treated as if wrapped in `float32_scope` (what
        # `diagnose` checks its advice with): an equation traced while one of
        # them ran is in a float32 region.
        set_(self, "float32_lines", float32_lines)
        # The higher-order equation whose rule holds this walk.
        set_(self, "current", current)
        set_(self, "facts", Facts() if facts is None else facts)
        # Under a plan: the sites of the jaxpr being walked's products
        # (`sites.name_sites`, by equation id).
        set_(self, "sites", {} if sites is None else sites)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"`Walk` is immutable: cannot set {name!r}.")

    # The facts of the jaxpr being walked, as `decide` and the rules read them.
    @property
    def wide(self) -> dict[Any, Any]:
        """Float32 products of CPU dots, by outvar (:class:`Facts`)."""
        return self.facts.wide

    @property
    def partners(self) -> dict[Any, np.dtype]:
        """Per operand of a forward product, its partner's dtype."""
        return self.facts.partners

    @property
    def casts(self) -> dict[tuple[int, Any], tuple[Any, Any]]:
        """Inputs rounded once for every product that reads them."""
        return self.facts.casts

    def constant_range(self, var: Any) -> tuple[float, float] | None:
        """``(largest finite, smallest non-zero)`` magnitude of a constant
        whose value is known, or ``None``."""
        return self.facts.constant_range(var)

    def producer(self, var: Any) -> JaxprEqn | None:
        """The equation that computed ``var`` in the jaxpr being walked."""
        return self.facts.producers.get(var)

    def _copy(self, **changes: Any) -> Walk:
        kw = {
            "observer": self.observer,
            "path": self.path,
            "trip": self.trip,
            "float32": self.float32,
            "composite": self.composite,
            "backward": self.backward,
            "parent_source": self.parent_source,
            "scope": self.scope,
            "float32_lines": self.float32_lines,
            "current": self.current,
            "facts": self.facts,
            "sites": self.sites,
        }
        config = changes.pop("config", self.config)
        kw.update(changes)
        return Walk(config, **kw)

    def over(self, facts: Facts, sites: dict[int, Any] | None = None) -> Walk:
        """This walk over another jaxpr's facts (and, under a plan, the
        sites of its products)."""
        return self._copy(facts=facts, sites=sites)

    def at(self, eqn: JaxprEqn) -> Walk:
        """This walk, inside the rule of the higher-order equation ``eqn``."""
        return self._copy(current=eqn)

    def body(self, label: str, *, trip: int = 1, composite: str | None = None) -> Walk:
        """The walk for the body ``label`` of the current higher-order
        equation (its facts: a new table, made when the body is walked)."""
        path = f"{self.path}/{label}" if self.path else label
        changes: dict[str, Any] = {"path": path, "trip": self.trip * _trip(trip)}
        planned = self.config.plan is not None
        if (self.observer is not None or planned) and self.current is not None:
            here = _compat.eqn_source_summary(self.current.source_info)
            changes["parent_source"] = here or self.parent_source
            stack = _compat.eqn_name_stack(self.current.source_info)
            if stack:
                changes["scope"] = f"{self.scope}/{stack}" if self.scope else stack
        if composite is not None and not self.float32:
            changes["composite"] = composite
        changes["current"] = None
        return self._copy(**changes)

    def with_float32_lines(self, lines: frozenset[tuple[str, int]]) -> Walk:
        """This walk with the user source ``lines`` (``(file, line)``) treated
        as if wrapped in :func:`~mixprec._src.autocast.regions.float32_scope`."""
        return self._copy(float32_lines=frozenset(lines))

    def probe(self) -> Walk:
        """A walk that observes nothing (a body traced only for its types)."""
        return self._copy(observer=None)

    @property
    def rewrites(self) -> bool:
        """Whether the rewrite passes run on the jaxprs this walk enters
        (not for an observer that compares op by op, such as ``diagnose``)."""
        return self.observer is None or self.observer.fuses

    @property
    def key(self) -> tuple[Any, ...]:
        """What decides how a body is transformed (for caches)."""
        key: tuple[Any, ...] = (
            self.config,
            self.float32,
            self.composite,
            self.backward,
            self.float32_lines,
        )
        if self.config.plan is not None:
            # A plan names a body's sites by the layers around it.
            here = self.current
            stack = "" if here is None else _compat.eqn_name_stack(here.source_info)
            key += (self.scope, stack)
        return key

    def in_region(self, region: tuple[str, Any] | None) -> Walk:
        """This walk inside a region (:mod:`~mixprec._src.autocast.regions`):
        ``float32_scope``, ``precision_scope`` or a nested autocast."""
        if region is None:
            return self
        kind, value = region
        if kind == "float32":
            return self._copy(float32=True, composite="")
        if kind == "policy":
            # A region written in the code wins over a plan inside it.
            config = self.config.with_policy(value)
            if config.plan is not None:
                config = dataclasses.replace(config, plan=None)
            return self._copy(config=config, float32=False, composite="")
        return self._copy(config=value, float32=False, composite="")

    def for_eqn(self, eqn: JaxprEqn) -> Walk:
        """This walk, adjusted for the region and pass ``eqn`` is in."""
        region, backward = _stack_info(eqn.source_info.name_stack)
        if region is None and self.float32_lines and not self.float32:
            lines = _compat.eqn_frame_lines(eqn.source_info)
            if not self.float32_lines.isdisjoint(lines):
                region = ("float32", None)
        planned = None
        if region is None and self.config.plan is not None and not self.float32:
            planned = self._planned_policy(eqn)
        if region is None and planned is None and (not backward or self.backward):
            return self
        walk = self
        if backward and not self.backward:
            walk = walk._copy(backward=True)
        if planned is not None:
            return walk._copy(config=_site_config(self.config, planned))
        return walk.in_region(region)

    def _planned_policy(self, eqn: JaxprEqn) -> Any:
        """The policy the plan gives ``eqn`` if it differs from the walk's
        (a product's site; a fused attention's products, the widest), else
        ``None``."""
        plan = self.config.plan
        assert plan is not None
        eqns: Sequence[JaxprEqn] = (eqn,)
        if ops.FUSION in getattr(ops.spec_for(eqn.primitive.name), "flags", ()):
            fusion = eqn.params.get("fusion")
            part = eqn.params.get("part")
            if part == "backward":
                fusion = getattr(fusion, "backward", None)
            eqns = tuple(getattr(fusion, "eqns", ()))
        keys = [k for e in eqns for k in self.sites.get(id(e), ())]
        if not keys:
            return None
        policy = max((plan.policy_for(*k) for k in keys), key=plan_lib.policy_rank)
        return None if policy == self.config.policy else policy


@ft.lru_cache(maxsize=1024)
def _site_config(config: CastConfig, policy: Any) -> CastConfig:
    """``config`` for one product a plan gives ``policy`` (the plan kept)."""
    return config.with_policy(policy)


_checked: set[tuple[Any, int]] = set()


def _check_rules(plan: Any, jaxpr: Jaxpr) -> None:
    """Warns, once per plan and program, of each rule that matches no
    product of the program, with the closest layer paths."""
    if not plan.rules or (plan, id(jaxpr)) in _checked:
        return
    _checked.add((plan, id(jaxpr)))
    for i, rule, close in plan.unmatched_rules(sites_lib.program_sites(jaxpr)):
        near = ", ".join(repr(c) for c in close) or "none (no products)"
        warnings.warn(
            f"`Plan` rules[{i}] ({rule.layers!r}, ops={list(rule.ops)}) matches no "
            f"matmul site of this program. The closest layer paths: {near}.",
            PlanWarning,
            stacklevel=2,
        )


class PlanWarning(UserWarning):
    """A plan says something that does not apply to the program."""


def _trip(n: Any) -> int:
    try:
        return max(int(n), 1)
    except Exception:  # noqa: BLE001  (a symbolic length)
        return 1


@ft.lru_cache(maxsize=8192)
def _stack_info(name_stack: Any) -> tuple[tuple[str, Any] | None, bool]:
    text = str(name_stack)
    if not text:
        return None, False
    backward = _compat.name_stack_transformed_by(name_stack, "transpose")
    return regions.parse_name_stack(text), backward


# ------------------------------------------------------------------ rules' view


@dataclasses.dataclass(frozen=True)
class CastContext:
    """What a cast rule receives about the equation it runs.

    A rule is called as ``rule(ctx, *invals, **params)`` with the values the
    equation receives (possibly already in a low dtype) and the equation's
    params, and returns the output (a list for primitives with several
    results). ``ctx.decision`` says what to cast the floating operands to;
    :meth:`cast_operands` applies it the way the built-in rules do.

    Attributes:
        config: the transform's :class:`~mixprec._src.autocast.config.CastConfig`.
        eqn: the equation being run.
        decision: its :class:`~mixprec._src.autocast.decide.Decision`.
        walk: where the interpreter is (higher-order rules recurse with it).
        marks: per operand, the interpreter's marks (``FOLLOWS``, ``CONST``).
        out_marks: higher-order rules may fill in the marks of their results.
        epilogue: the equation is a bias add run as the epilogue of the
            matmul before it
            (:func:`~mixprec._src.autocast.decide.decide_epilogue`): it runs
            through the default rule on that matmul's float32 product.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import mixprec
        >>> from jax.extend.core import Primitive
        >>> triple_p = Primitive("triple")
        >>> triple_p.def_impl(lambda x: 3 * x)
        <function <lambda> ...>
        >>> triple_p.def_abstract_eval(lambda x: x)
        <function <lambda> ...>
        >>> @mixprec.register_rule(triple_p)
        ... def _triple_rule(ctx, x):
        ...     return triple_p.bind(*ctx.cast_operands([x]))
        >>> f = mixprec.autocast(lambda x: triple_p.bind(x @ x), "mixed_bfloat16")
        >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 2)))
        >>> [str(e.outvars[0].aval.dtype)
        ...  for e in jaxpr.eqns if e.primitive is triple_p]
        ['bfloat16']
    """

    config: CastConfig
    eqn: JaxprEqn
    decision: Decision
    walk: Walk
    marks: Sequence[int]
    out_marks: list[int]
    epilogue: bool = False

    @property
    def policy(self) -> Any:
        """The policy in effect."""
        return self.config.policy

    @property
    def low_dtype(self) -> np.dtype:
        """The dtype allow-list ops run in."""
        return self.config.low_dtype

    @property
    def platform(self) -> str | None:
        """The platform dots are formulated for, or ``None``: each platform's,
        chosen when the computation is lowered."""
        return self.config.platform

    def cast_operands(self, invals: Sequence[Any]) -> list[Any]:
        """The operands cast as the decision says (see :func:`cast_operands`)."""
        return cast_operands(self, invals)


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
        hop_marks = [0] * n_out
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
        epilogue = decide_epilogue(eqn, spec, decision, invals, marks, products)
        if epilogue is not None:
            decision, i = epilogue
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
    plan = walk.config.plan
    named = None
    if plan is not None or walk.observer is not None:
        # (An observer reports each product's site, plan or not.)
        open_jaxpr: Jaxpr = jaxpr  # type: ignore[assignment]
        named = sites_lib.name_sites(open_jaxpr, walk.scope, walk.backward)
        if plan is not None and not walk.path and not walk.scope:
            _check_rules(plan, open_jaxpr)
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
