"""Precision plans: one policy per matmul site, measured or written by hand.

A :class:`Plan` says which policy each matmul-like op of a program runs
under. It is accepted wherever a policy is (``mixprec.autocast(fn, plan)``,
``mixprec.explain(..., policy=plan)``, ``mixprec.diagnose(..., policy=plan)``)
and is resolved where autocast gives every equation its policy (the same
place as ``precision_scope``), so the dtype decision, the fused-attention
decision, float8, ``explain`` and ``diagnose`` all read the one answer.

A *site* is named by what survives re-tracing: the layer path (the module
path and named scopes, without JAX's ``jvp(...)``/``transpose(...)``
wrappers), the primitive, and its occurrence among the forward products of
that layer and primitive (``index``). Its source line is shown, never used
to find it. The policy of a site is, in order:

1. its entry in ``sites`` (measured by :func:`mixprec.plan`, or edited);
2. the first rule in ``rules`` whose ``layers`` regex matches the whole layer
   path and whose ``ops`` (if given) names the primitive;
3. the plan's ``base`` policy, which is also the policy of every op that is
   not a matmul-like product.

This module is data only (no JAX): the naming of a program's sites is
``mixprec/_src/autocast/sites.py``, the measuring ``numerics/plan.py``.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mixprec._src.policy import Policy, get_policy


__all__ = ["FORMAT", "Plan", "Rule", "Site", "load_plan", "policy_rank"]

#: The version of the JSON format :meth:`Plan.save` writes.
FORMAT = 1

_SITE_FIELDS = frozenset(
    ["layer", "op", "index", "policy", "chosen", "source", "flops", "measured"]
)
_RULE_FIELDS = frozenset(["layers", "ops", "policy"])
_TOP_FIELDS = frozenset(
    [
        "format",
        "base",
        "platform",
        "tolerance",
        "candidates",
        "sites",
        "rules",
        "combined",
        "note",
    ]
)


def _policy(value: Any, where: str) -> Policy:
    if not isinstance(value, str | Policy):
        raise TypeError(
            f"`Plan` {where}: expected a policy string such as 'mixed_float8', "
            f"got {value!r} ({type(value).__name__}) instead."
        )
    try:
        return get_policy(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"`Plan` {where}: unknown policy {value!r}: {e}") from None


def policy_rank(policy: Policy) -> tuple[int, int]:
    """How wide a policy's products run: ``(compute bits, not float8)``.

    The widest of several policies is the one a product shared by several
    sites runs under (the safe choice).

    Examples:
        >>> policy_rank(get_policy("float32")) > policy_rank(get_policy("mixed_float8"))
        True
    """
    bits = np.dtype(policy.compute_dtype).itemsize * 8
    return bits, int(policy.float8 is None)


@dataclasses.dataclass(frozen=True)
class Site:
    """One matmul-like op of a program and the policy it runs under.

    Attributes:
        layer: the layer path (``"Net/Dense_0"``; ``""`` outside any scope).
        op: the primitive (``"dot_general"``, ``"conv_general_dilated"``).
        index: its occurrence among the forward products of ``layer`` and
            ``op`` (0 for the first).
        policy: the policy it runs under (a policy string).
        chosen: the policy :func:`mixprec.plan` measured and chose, or
            ``None`` for a site written by hand. ``policy != chosen``: set
            by hand over the measurement.
        source: its user source line when planned (shown, not matched).
        flops: its FLOPs per call (inside ``scan``, times the trip count).
        measured: per candidate, what was measured (see :func:`mixprec.plan`),
            as ``((candidate, ((name, value), ...)), ...)``.

    Examples:
        >>> Site("Net/Dense_0", "dot_general", 0, "mixed_float8").key
        ('Net/Dense_0', 'dot_general', 0)
    """

    layer: str
    op: str
    index: int
    policy: str
    chosen: str | None = None
    source: str = ""
    flops: int = 0
    measured: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()

    @property
    def key(self) -> tuple[str, str, int]:
        """``(layer, op, index)``: what names the site."""
        return (self.layer, self.op, self.index)

    @property
    def overridden(self) -> bool:
        """Whether the policy was set by hand over a measured choice."""
        return self.chosen is not None and self.policy != self.chosen

    def measurements(self) -> dict[str, dict[str, Any]]:
        """``measured`` as ``{candidate: {name: value}}``."""
        return {c: dict(m) for c, m in self.measured}

    def to_dict(self) -> dict[str, Any]:
        """The site's JSON object."""
        d: dict[str, Any] = {
            "layer": self.layer,
            "op": self.op,
            "index": self.index,
            "policy": self.policy,
        }
        if self.chosen is not None:
            d["chosen"] = self.chosen
        if self.source:
            d["source"] = self.source
        if self.flops:
            d["flops"] = self.flops
        if self.measured:
            d["measured"] = self.measurements()
        return d


@dataclasses.dataclass(frozen=True)
class Rule:
    """A hand-written rule: products in the layers the regex ``layers``
    matches (the whole layer path, ``re.fullmatch``), of the primitives
    ``ops`` (all matmul-like ops if empty), run under ``policy``.

    Examples:
        >>> Rule("decoder/.*/mlp.*", ("dot_general",), "mixed_float8").matches(
        ...     "decoder/layers_0/mlp/wi", "dot_general")
        True
    """

    layers: str
    ops: tuple[str, ...]
    policy: str

    def matches(self, layer: str, op: str) -> bool:
        """Whether this rule applies to a product of ``op`` in ``layer``."""
        return (not self.ops or op in self.ops) and _regex(self.layers).fullmatch(
            layer
        ) is not None

    def to_dict(self) -> dict[str, Any]:
        """The rule's JSON object."""
        d: dict[str, Any] = {"layers": self.layers}
        if self.ops:
            d["ops"] = list(self.ops)
        d["policy"] = self.policy
        return d


@ft.lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


@dataclasses.dataclass(frozen=True, init=False)
class Plan:
    """A policy per matmul site: what :func:`mixprec.plan` chose, or what you
    wrote. Pass it wherever a policy goes.

    Attributes:
        base: the policy of everything the plan does not name (and of every
            op that is not matmul-like).
        sites: the sites, each with its policy (first in precedence).
        rules: the hand-written rules, first match wins (after ``sites``).
        platform: the platform whose throughput the costs were computed for.
        tolerance: the tolerance the sites were chosen with.
        candidates: the candidate policies, cheapest first.
        combined: what :func:`mixprec.plan` measured of the finished plan as
            a whole (every site at its policy at once), as ``((name, value),
            ...)``: ``loss_error``, ``grad_error``, ``effect``, ``passed``,
            ``first_effect`` (before any site was raised) and ``raised``
            (``[layer, op, index, from, to]`` per site it raised to pass);
            empty for a plan not measured.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import mixprec
        >>> def f(x, w1, w2):
        ...     with jax.named_scope("hidden"):
        ...         h = jnp.tanh(x @ w1)
        ...     with jax.named_scope("out"):
        ...         return h @ w2
        >>> plan = mixprec.Plan.from_dict({"format": 1, "base": "mixed_bfloat16",
        ...     "rules": [{"layers": "out", "policy": "float32"}]})
        >>> x, w1, w2 = jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.ones((8, 2)) / 3
        >>> y = mixprec.autocast(f, plan)(x, w1, w2)
        >>> report = mixprec.explain(f, x, w1, w2, policy=plan)
        >>> [op.in_dtypes[1] for op in report.find("dot_general")]
        ['bfloat16', 'float32']
    """

    base: Policy
    sites: tuple[Site, ...] = ()
    rules: tuple[Rule, ...] = ()
    platform: str = ""
    tolerance: float | None = None
    candidates: tuple[str, ...] = ()
    combined: tuple[tuple[str, Any], ...] = ()
    #: ``mixprec.plan``'s measuring plans only: runs a site's candidates and
    #: selects one at run time (see ``numerics/plan.py``).
    switch: ClassVar[Any] = None

    def __init__(
        self,
        base: Policy | str,
        sites: Sequence[Site] = (),
        rules: Sequence[Rule] = (),
        platform: str = "",
        tolerance: float | None = None,
        candidates: Sequence[str] = (),
        combined: Mapping[str, Any] | Sequence[tuple[str, Any]] = (),
    ) -> None:
        set_ = ft.partial(object.__setattr__, self)
        set_("base", _policy(base, "`base`"))
        set_("sites", tuple(sites))
        set_("rules", tuple(rules))
        set_("platform", str(platform))
        set_("tolerance", None if tolerance is None else float(tolerance))
        set_("candidates", tuple(str(c) for c in candidates))
        items = combined.items() if isinstance(combined, Mapping) else combined
        set_("combined", _frozen(dict(items)))
        keys = [s.key for s in self.sites]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"`Plan` sites: the site {dup} is listed twice.")

    def __hash__(self) -> int:  # hashed with every configuration lookup
        h = self.__dict__.get("_hash_value")
        if h is None:
            h = hash(
                (
                    self.base,
                    self.sites,
                    self.rules,
                    self.platform,
                    self.tolerance,
                    self.candidates,
                )
            )
            self.__dict__["_hash_value"] = h
        return h

    # -- resolving ---------------------------------------------------------
    @ft.cached_property
    def _by_key(self) -> dict[tuple[str, str, int], Policy]:
        return {s.key: get_policy(s.policy) for s in self.sites}

    @ft.cached_property
    def _rule_policies(self) -> tuple[Policy, ...]:
        return tuple(get_policy(r.policy) for r in self.rules)

    def policy_for(self, layer: str, op: str, index: int | None) -> Policy:
        """The policy of the product ``op`` in ``layer`` (its ``index``-th):
        its site entry, else the first matching rule, else :attr:`base`.
        ``index=None`` (a backward product not traced back to its forward
        site): the widest policy of the sites of ``layer`` and ``op``, else
        the rules and the base.

        Examples:
            >>> plan = Plan("mixed_bfloat16", rules=(Rule("head", (), "float32"),))
            >>> str(plan.policy_for("head", "dot_general", 0))
            'p=f32,c=f32,o=f32'
        """
        if index is not None:
            hit = self._by_key.get((layer, op, index))
            if hit is not None:
                return hit
        else:
            found = [
                p for (ly, o, _), p in self._by_key.items() if ly == layer and o == op
            ]
            if found:
                return max(found, key=policy_rank)
        for rule, policy in zip(self.rules, self._rule_policies, strict=True):
            if rule.matches(layer, op):
                return policy
        return self.base

    def rule_for(self, layer: str, op: str) -> int | None:
        """The index of the first rule matching ``layer`` and ``op``."""
        for i, rule in enumerate(self.rules):
            if rule.matches(layer, op):
                return i
        return None

    def unmatched_rules(
        self, sites: Iterable[tuple[str, str]]
    ) -> list[tuple[int, Rule, list[str]]]:
        """The rules no ``(layer, op)`` of ``sites`` matches, each with the
        closest layer paths (for the warning autocast gives)."""
        sites = list(sites)
        layers = sorted({ly for ly, _ in sites})
        out = []
        for i, rule in enumerate(self.rules):
            if any(rule.matches(ly, op) for ly, op in sites):
                continue
            import difflib

            close = difflib.get_close_matches(rule.layers, layers, n=3, cutoff=0.0)
            out.append((i, rule, close))
        return out

    def unmatched_sites(
        self, sites: Iterable[tuple[str, str]]
    ) -> list[tuple[int, Site, list[str]]]:
        """The entries of :attr:`sites` whose layer and op name no ``(layer,
        op)`` of ``sites`` (a program's products), each with the closest
        layer paths (for the warning autocast gives): a layer renamed, a
        site edited by hand with a typo. (Its index is not checked: a body
        called from two layers is named when the walk reaches it.)

        Examples:
            >>> plan = Plan("mixed_bfloat16", sites=(
            ...     Site("net/dense_1", "dot_general", 0, "float32"),))
            >>> [(i, close[0]) for i, _, close in plan.unmatched_sites(
            ...     [("net/dense_0", "dot_general")])]
            [(0, 'net/dense_0')]
        """
        import difflib

        found = set(sites)
        layers = sorted({ly for ly, _ in found})
        out = []
        for i, site in enumerate(self.sites):
            if (site.layer, site.op) in found:
                continue
            close = difflib.get_close_matches(site.layer, layers, n=3, cutoff=0.0)
            out.append((i, site, close))
        return out

    # -- editing -----------------------------------------------------------
    def with_site_policy(
        self, layer: str, op: str, index: int, policy: str | Policy
    ) -> Plan:
        """This plan with one site set to ``policy`` (by hand: its measured
        choice, if any, is kept in ``chosen``)."""
        text = policy if isinstance(policy, str) else str(policy)
        _policy(text, f"site ({layer!r}, {op!r}, {index})")
        sites = list(self.sites)
        for i, s in enumerate(sites):
            if s.key == (layer, op, index):
                sites[i] = dataclasses.replace(s, policy=text)
                break
        else:
            sites.append(Site(layer, op, index, text))
        return dataclasses.replace(self, sites=tuple(sites))

    # -- files -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as the JSON object :meth:`save` writes."""
        d: dict[str, Any] = {"format": FORMAT, "base": str(self.base)}
        if self.platform:
            d["platform"] = self.platform
        if self.tolerance is not None:
            d["tolerance"] = self.tolerance
        if self.candidates:
            d["candidates"] = list(self.candidates)
        d["sites"] = [s.to_dict() for s in self.sites]
        d["rules"] = [r.to_dict() for r in self.rules]
        if self.combined:
            d["combined"] = dict(self.combined)
        return d

    def to_json(self, *, indent: int | None = 2) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the plan as versioned, human-editable JSON."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Reads a plan written by :meth:`save` (or by hand).

        Raises:
            ValueError: the file is not JSON, or an entry has a bad field
                (the message names the entry and the field).
        """
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"`Plan.load({str(path)!r})`: not JSON: {e}") from None
        return cls.from_dict(data, where=f"`Plan.load({str(path)!r})`")

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "`Plan.from_dict`") -> Plan:
        """Builds a plan from its JSON object (see :meth:`to_dict`)."""
        if not isinstance(data, Mapping):
            raise ValueError(
                f"{where}: expected a JSON object, got {type(data).__name__}."
            )
        _known(data, _TOP_FIELDS, where)
        fmt = data.get("format")
        if fmt != FORMAT:
            raise ValueError(
                f"{where}: field 'format' must be {FORMAT} (the version this "
                f"mixprec reads), got {fmt!r}."
            )
        base = _field(data, "base", str, where)
        _policy(base, f"{where}, field 'base'")
        sites = []
        for i, entry in enumerate(_list(data, "sites", where)):
            at = f"{where}, sites[{i}]"
            if not isinstance(entry, Mapping):
                raise ValueError(f"{at}: expected an object, got {entry!r}.")
            _known(entry, _SITE_FIELDS, at)
            policy = _field(entry, "policy", str, at)
            _policy(policy, f"{at}, field 'policy'")
            chosen = entry.get("chosen")
            if chosen is not None:
                _policy(_field(entry, "chosen", str, at), f"{at}, field 'chosen'")
            index = _field(entry, "index", int, at)
            if index < 0:
                raise ValueError(f"{at}: field 'index' must be >= 0, got {index}.")
            measured = entry.get("measured", {})
            if not isinstance(measured, Mapping):
                raise ValueError(f"{at}: field 'measured' must be an object.")
            op = _field(entry, "op", str, at)
            _check_ops([op], at, field="op")
            flops = entry.get("flops", 0)
            if not isinstance(flops, int) or isinstance(flops, bool) or flops < 0:
                raise ValueError(
                    f"{at}: field 'flops' must be a non-negative integer, got "
                    f"{flops!r}."
                )
            sites.append(
                Site(
                    layer=_field(entry, "layer", str, at),
                    op=op,
                    index=index,
                    policy=policy,
                    chosen=chosen,
                    source=str(entry.get("source", "")),
                    flops=flops,
                    measured=tuple(
                        (str(c), tuple((str(k), v) for k, v in dict(m).items()))
                        for c, m in measured.items()
                    ),
                )
            )
        rules = []
        for i, entry in enumerate(_list(data, "rules", where)):
            at = f"{where}, rules[{i}]"
            if not isinstance(entry, Mapping):
                raise ValueError(f"{at}: expected an object, got {entry!r}.")
            _known(entry, _RULE_FIELDS, at)
            layers = _field(entry, "layers", str, at)
            try:
                _regex(layers)
            except re.error as e:
                raise ValueError(
                    f"{at}: field 'layers' is not a regular expression: {e}."
                ) from None
            ops = entry.get("ops", [])
            if not isinstance(ops, list) or not all(isinstance(o, str) for o in ops):
                raise ValueError(
                    f"{at}: field 'ops' must be a list of primitive names, got {ops!r}."
                )
            _check_ops(ops, at)
            policy = _field(entry, "policy", str, at)
            _policy(policy, f"{at}, field 'policy'")
            rules.append(Rule(layers, tuple(ops), policy))
        tolerance = data.get("tolerance")
        if tolerance is not None and (
            not isinstance(tolerance, int | float) or isinstance(tolerance, bool)
        ):
            raise ValueError(
                f"{where}: field 'tolerance' must be a number, got {tolerance!r}."
            )
        candidates = data.get("candidates", [])
        if not isinstance(candidates, list):
            raise ValueError(f"{where}: field 'candidates' must be a list.")
        for i, c in enumerate(candidates):
            _policy(c, f"{where}, field 'candidates'[{i}]")
        combined = data.get("combined", {})
        if not isinstance(combined, Mapping):
            raise ValueError(f"{where}: field 'combined' must be an object.")
        try:
            return cls(
                base=get_policy(base),
                sites=tuple(sites),
                rules=tuple(rules),
                platform=str(data.get("platform", "")),
                tolerance=None if tolerance is None else float(tolerance),
                candidates=tuple(str(c) for c in candidates),
                combined=_frozen(combined),
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    # -- showing -----------------------------------------------------------
    def table(self) -> str:
        """One row per site: layer, op, source line, FLOPs, the measured
        effect of each candidate, the chosen policy; then the estimated
        speed-up (see :func:`mixprec.plan`)."""
        from mixprec._src.numerics import plan as planner

        return planner.render_plan(self)

    def __str__(self) -> str:
        return self.table()


def _frozen(value: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A JSON object's items, its lists as tuples (a plan stays hashable)."""

    def freeze(x: Any) -> Any:
        return tuple(freeze(y) for y in x) if isinstance(x, list | tuple) else x

    return tuple((str(k), freeze(v)) for k, v in value.items())


def _known(entry: Mapping[str, Any], fields: frozenset[str], where: str) -> None:
    from mixprec._src._errors import format_choices, suggest

    for k in entry:
        if k not in fields:
            raise ValueError(
                f"{where}: unknown field {k!r}.{suggest(str(k), fields)} Valid "
                f"fields: {format_choices(fields)}."
            )


def _field(entry: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in entry:
        raise ValueError(f"{where}: missing field {name!r}.")
    value = entry[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(
            f"{where}: field {name!r} must be a {kind.__name__}, got {value!r}."
        )
    return value


def _list(data: Mapping[str, Any], name: str, where: str) -> Sequence[Any]:
    value = data.get(name, [])
    if not isinstance(value, list):
        raise ValueError(f"{where}: field {name!r} must be a list, got {value!r}.")
    return value


def _check_ops(ops: Sequence[str], where: str, *, field: str = "ops") -> None:
    from mixprec._src._errors import format_choices, suggest
    from mixprec._src.autocast import ops as op_table

    products = [s.name for s in op_table.all_specs() if s.product is not None]
    for op in ops:
        if op not in products:
            raise ValueError(
                f"{where}: field {field!r} names {op!r}, which is not a matmul-like "
                f"op.{suggest(op, products)} Valid: {format_choices(products)}."
            )


def load_plan(value: Any) -> Plan:
    """A :class:`Plan` from a plan, a path to its JSON file, or its dict."""
    if isinstance(value, Plan):
        return value
    if isinstance(value, Mapping):
        return Plan.from_dict(value)
    if isinstance(value, str | os.PathLike):
        return Plan.load(value)
    raise TypeError(
        f"Expected a `mixprec.Plan`, a path to a plan file or its dict, got "
        f"{type(value).__name__} instead."
    )
