"""Where the autocast walk is: the rules' view of it.

:class:`Walk` (configuration, region, pass, path, observer and the facts of
the jaxpr being walked; never changed once made) and :class:`Observer` (what
``explain`` and ``diagnose`` plug into the walk) are what every rule and every
tool of the walk reads. They sit below the interpreter and the operand casts
(:mod:`~mixprec._src.autocast.operands`, which holds the
:class:`~mixprec._src.autocast.operands.CastContext` a rule receives), so
that rules import this module, ``operands`` and the interpreter without an
import cycle.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn

from mixprec._src import _compat, plan as plan_lib
from mixprec._src.autocast import ops, regions, sites as sites_lib
from mixprec._src.autocast.config import CastConfig
from mixprec._src.autocast.decide import Decision
from mixprec._src.autocast.facts import Facts


__all__ = ["Observer", "PlanWarning", "Walk", "check_rules"]


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

    def site_keys(self, eqn: JaxprEqn) -> list[Any]:
        """The plan sites ``eqn`` runs: its own, or a fused op's products'."""
        eqns: Sequence[JaxprEqn] = (eqn,)
        if ops.FUSION in getattr(ops.spec_for(eqn.primitive.name), "flags", ()):
            fusion = eqn.params.get("fusion")
            if eqn.params.get("part") == "backward":
                fusion = getattr(fusion, "backward", None)
            eqns = tuple(getattr(fusion, "eqns", ()))
        return [k for e in eqns for k in self.sites.get(id(e), ())]

    def _planned_policy(self, eqn: JaxprEqn) -> Any:
        """The policy the plan gives ``eqn`` if it differs from the walk's
        (a product's site; a fused attention's products, the widest), else
        ``None``."""
        plan = self.config.plan
        assert plan is not None
        keys = self.site_keys(eqn)
        if not keys:
            return None
        policy = max((plan.policy_for(*k) for k in keys), key=plan_lib.policy_rank)
        return None if policy == self.config.policy else policy


@ft.lru_cache(maxsize=1024)
def _site_config(config: CastConfig, policy: Any) -> CastConfig:
    """``config`` for one product a plan gives ``policy`` (the plan kept)."""
    return config.with_policy(policy)


_checked: set[tuple[Any, int]] = set()


def check_rules(plan: Any, jaxpr: Jaxpr) -> None:
    """Warns, once per plan and program, of each rule that matches no
    product of the program, and of each site entry whose layer holds none
    of its op, with the closest layer paths."""
    if not (plan.rules or plan.sites) or (plan, id(jaxpr)) in _checked:
        return
    _checked.add((plan, id(jaxpr)))
    found = sites_lib.program_sites(jaxpr)
    # A program whose products no module path, scope or parameter path
    # names (a plain function of its weights) has only "" for a layer path.
    unnamed = (
        " Its products have no layer path (no module path, `jax.named_scope` "
        "or path of a parameter they read names them: the weights are "
        'arguments themselves): name them in "sites" by index, with '
        '"layer": "".'
        if found and all(not ly for ly, _ in found)
        else ""
    )
    for i, rule, close in plan.unmatched_rules(found):
        near = ", ".join(repr(c) for c in close) or "none (no products)"
        warnings.warn(
            f"`Plan` rules[{i}] ({rule.layers!r}, ops={list(rule.ops)}) matches no "
            f"matmul site of this program. The closest layer paths: {near}."
            f"{unnamed if rule.layers else ''}",
            PlanWarning,
            stacklevel=2,
        )
    for i, site, close in plan.unmatched_sites(found):
        near = ", ".join(repr(c) for c in close) or "none (no products)"
        warnings.warn(
            f"`Plan` sites[{i}] ({site.layer!r}, {site.op!r}, {site.index}): no "
            f"{site.op} of this program is in that layer, so it is not applied. "
            f"The closest layer paths: {near}.{unnamed if site.layer else ''}",
            PlanWarning,
            stacklevel=2,
        )


class PlanWarning(UserWarning):
    """A plan says something that does not apply to the program."""


def _trip(n: Any) -> int:
    try:
        return max(int(n), 1)
    except jax.errors.InconclusiveDimensionOperation:  # a symbolic length
        return 1


@ft.lru_cache(maxsize=8192)
def _stack_info(name_stack: Any) -> tuple[tuple[str, Any] | None, bool]:
    text = str(name_stack)
    if not text:
        return None, False
    backward = _compat.name_stack_transformed_by(name_stack, "transpose")
    return regions.parse_name_stack(text), backward
