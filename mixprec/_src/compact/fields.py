"""What each field of an optax optimizer state holds, and so how it is stored.

`compact_state` compresses a state leaf only where it is *known* to be a
gradient statistic: a field this table lists as a moment. A field listed as a
parameter copy (an optimizer that keeps the initial weights, or a weight-like
sequence of its own) is stored as the weights are. Everything else, including
every field of a state type not in the table, is kept exactly as it is: a
shape that happens to equal a parameter's says nothing about what a leaf holds
(adafactor's row statistics of a square matrix have a bias's shape; the
accumulated gradient of `optax.MultiSteps` has the parameter's own).

Imported by ``mixprec.optax`` only (it imports optax).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp

from . import codes


@dataclasses.dataclass(frozen=True)
class StateFields:
    """What the fields of one optax state type hold.

    Attributes:
      moments: fields holding gradient statistics (a running mean of the
        gradients, of their squares, of their differences): stored in the
        ``moments`` tier.
      copies: fields holding copies of the parameters (initial weights, a
        weight-like sequence): stored as the weights are.
      kept: fields that look like moments but are kept as they are, each with
        the reason.
      note: what the optimizer keeps, and why the fields are classed so.
    """

    moments: tuple[str, ...] = ()
    copies: tuple[str, ...] = ()
    kept: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""


_ADAM = "first and second moments: running means of the gradients and of their squares"

# (where the type lives, its name, its fields). Types missing from the
# installed optax are skipped (optax adds optimizers between releases); the
# `WithCount` variants are not exported by optax, and are read from the module
# of their exported sibling.
_ENTRIES: list[tuple[str, str, StateFields]] = [
    (
        "optax",
        "ScaleByAdamState",
        StateFields(
            moments=("mu", "nu"),
            note=f"adam, adamw, nadam, radam, yogi, adamax, lamb, adopt: {_ADAM} "
            "(adamax's nu: a running maximum of their magnitudes)",
        ),
    ),
    (
        "optax",
        "ScaleByAmsgradState",
        StateFields(
            moments=("mu", "nu", "nu_max"),
            note=f"amsgrad: {_ADAM}, and the running maximum of the second",
        ),
    ),
    (
        "optax",
        "ScaleByBeliefState",
        StateFields(
            moments=("mu", "nu"),
            note="adabelief: running means of the gradients and of the squared "
            "difference from that mean",
        ),
    ),
    (
        "optax",
        "ScaleByLionState",
        StateFields(moments=("mu",), note="lion: a running mean of the gradients"),
    ),
    (
        "optax",
        "ScaleByRmsState",
        StateFields(
            moments=("nu",), note="rmsprop: a running mean of the squared gradients"
        ),
    ),
    (
        "optax:ScaleByRmsState",
        "ScaleByRmsWithCountState",
        StateFields(
            moments=("nu",),
            note="rmsprop with bias correction: a running mean of the squared "
            "gradients",
        ),
    ),
    (
        "optax",
        "ScaleByRStdDevState",
        StateFields(
            moments=("mu", "nu"),
            note="centered rmsprop: running means of the gradients and of their "
            "squares",
        ),
    ),
    (
        "optax:ScaleByRStdDevState",
        "ScaleByRStdDevWithCountState",
        StateFields(
            moments=("mu", "nu"),
            note="centered rmsprop with bias correction: running means of the "
            "gradients and of their squares",
        ),
    ),
    (
        "optax",
        "ScaleByAdaDeltaState",
        StateFields(
            moments=("e_g", "e_x"),
            note="adadelta: running means of the squared gradients and of the "
            "squared updates",
        ),
    ),
    (
        "optax",
        "ScaleByRssState",
        StateFields(
            moments=("sum_of_squares",),
            note="adagrad: the sum of the squared gradients",
        ),
    ),
    (
        "optax",
        "ScaleByNovogradState",
        StateFields(
            moments=("mu",),
            note="novograd: a running mean of the normalized gradients (its nu is "
            "one number per parameter)",
        ),
    ),
    (
        "optax",
        "ScaleBySM3State",
        StateFields(
            moments=("nu",),
            kept={"mu": "one accumulator per axis of the parameter"},
            note="sm3: nu is the momentum of the preconditioned gradients",
        ),
    ),
    (
        "optax",
        "ScaleByAdanState",
        StateFields(
            moments=("m", "v", "n"),
            kept={
                "g": "the previous gradient, subtracted from the next one: its "
                "rounding error would be the difference's"
            },
            note="adan: running means of the gradients, of their differences and "
            "of the squares",
        ),
    ),
    (
        "optax",
        "TraceState",
        StateFields(
            moments=("trace",),
            note="sgd with momentum, lars, nesterov: the momentum (a running sum "
            "of the gradients)",
        ),
    ),
    (
        "optax",
        "EmaState",
        StateFields(
            moments=("ema",),
            note="optax.ema (adafactor's momentum): a running mean of the updates "
            "it is given",
        ),
    ),
    (
        "optax",
        "FactoredState",
        StateFields(
            moments=("v",),
            kept={
                "v_row": "adafactor's factored row statistics",
                "v_col": "adafactor's factored column statistics",
            },
            note="adafactor: v is the second moment of a parameter too small to "
            "factor (of a factored one, a placeholder of shape (1,))",
        ),
    ),
    (
        "optax.contrib",
        "MuonState",
        StateFields(moments=("mu",), note="muon: the momentum it orthogonalizes"),
    ),
    (
        "optax.contrib",
        "SophiaState",
        StateFields(
            moments=("mu", "nu"),
            note="sophia: running means of the gradients and of a diagonal "
            "Hessian estimate",
        ),
    ),
    (
        "optax.contrib",
        "ScaleByAdemamixState",
        StateFields(
            moments=("m1", "m2", "nu"),
            note="ademamix: a fast and a slow running mean of the gradients, and "
            "of their squares",
        ),
    ),
    (
        "optax.contrib",
        "ScaleBySimplifiedAdEMAMixState",
        StateFields(
            moments=("m", "n"),
            note="simplified ademamix: running means of the gradients and of "
            "their squares",
        ),
    ),
    (
        "optax.contrib",
        "MomoState",
        StateFields(moments=("exp_avg",), note="momo: the momentum"),
    ),
    (
        "optax.contrib",
        "MomoAdamState",
        StateFields(moments=("exp_avg", "exp_avg_sq"), note=f"momo_adam: {_ADAM}"),
    ),
    (
        "optax.contrib",
        "DAdaptAdamWState",
        StateFields(
            moments=("exp_avg", "exp_avg_sq"),
            kept={
                "grad_sum": "its magnitudes are summed into the step-size "
                "estimate, and rounding noise biases a magnitude upwards"
            },
            note=f"dadapt_adamw: {_ADAM}",
        ),
    ),
    (
        "optax.contrib",
        "ProdigyState",
        StateFields(
            moments=("exp_avg", "exp_avg_sq"),
            copies=("params0",),
            kept={
                "grad_sum": "its magnitudes are summed into the step-size "
                "estimate, and rounding noise biases a magnitude upwards"
            },
            note=f"prodigy: {_ADAM}; params0, the initial weights, whose "
            "distance from the weights estimates the step size",
        ),
    ),
    (
        "optax.contrib",
        "MechanicState",
        StateFields(
            copies=("x0",),
            note="mechanize: x0, the initial weights, from which every step is "
            "rescaled (its r, m, v and s hold one number per scale)",
        ),
    ),
    (
        "optax.contrib",
        "ScheduleFreeState",
        StateFields(
            copies=("z",),
            note="schedule_free: z, the weight-like sequence the model's weights "
            "are interpolated from",
        ),
    ),
    (
        "optax.contrib",
        "SAMState",
        StateFields(
            copies=("cache",),
            note="sam: cache, the outer weights the adversarial steps leave",
        ),
    ),
    (
        "optax.contrib",
        "MadgradState",
        StateFields(
            moments=("grad_sum_sq",),
            copies=("x0",),
            kept={
                "s": "the dual-averaging sum, from which the weights are computed: "
                "its rounding error would move the weights themselves"
            },
            note="madgrad: x0, the initial weights; grad_sum_sq, a sum of squared "
            "gradients",
        ),
    ),
    (
        "optax.contrib",
        "DoGState",
        StateFields(copies=("init_params",), note="dog: the initial weights"),
    ),
    (
        "optax.contrib",
        "DoWGState",
        StateFields(copies=("init_params",), note="dowg: the initial weights"),
    ),
    (
        "optax.contrib",
        "COCOBState",
        StateFields(
            copies=("init_particles",),
            note="cocob: the initial weights; its bets and rewards are kept as "
            "they are",
        ),
    ),
]


def _resolve(where: str, name: str) -> type | None:
    module_name, _, sibling = where.partition(":")
    module: Any = importlib.import_module(module_name)
    if sibling:
        anchor = getattr(module, sibling, None)
        if anchor is None:
            return None
        module = importlib.import_module(anchor.__module__)
    cls = getattr(module, name, None)
    return cls if isinstance(cls, type) else None


_state_fields: dict[type, StateFields] = {
    cls: fields
    for where, name, fields in _ENTRIES
    if (cls := _resolve(where, name)) is not None
}


def state_fields() -> dict[type, StateFields]:
    """The table: each known optax state type and what its fields hold."""
    return dict(_state_fields)


MOMENT, COPY, KEPT = "moment", "parameter copy", "kept"


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one state leaf is stored, and why.

    Attributes:
      kind: ``"moment"`` (stored in the moment tier), ``"parameter copy"``
        (stored as the weights are) or ``"kept"`` (as it is).
      source: ``"ScaleByAdamState.mu"``: the field of a known state type the
        leaf is in; ``None`` for a leaf under no known field.
      reason: why, in words.
      owner: the path key of the parameter the leaf belongs to (for a moment
        or a copy), or ``None``.
    """

    kind: str
    source: str | None
    reason: str
    owner: tuple[str, ...] | None = None


def _path_key(path: Any) -> tuple[str, ...]:
    return tuple(str(k) for k in path)


def param_suffix(key: tuple[str, ...], known: Any) -> tuple[str, ...] | None:
    """The longest non-empty suffix of a state leaf's path key that is in
    ``known`` (parameters' path keys): ``('[0]', '.mu', "['w']")`` names the
    parameter ``("['w']",)``; ``None`` if there is none."""
    return next((key[k:] for k in range(len(key)) if key[k:] in known), None)


def plan(tree: Any, params: Any, *, is_leaf: Any = None) -> list[LeafPlan]:
    """One `LeafPlan` per leaf of ``tree`` (an inner optimizer state), in
    ``jax.tree.leaves(tree, is_leaf=is_leaf)`` order.

    A leaf is a moment or a parameter copy where it lies in a field that the
    table lists as one, is floating point and has the shape of its parameter
    (the parameter whose path its own path ends with; with no such parameter,
    the shape of some parameter); every other leaf is kept.
    """
    labels: list[tuple[str, str | None, str]] = []

    def known(x: Any) -> bool:
        return type(x) in _state_fields

    def stop(x: Any) -> bool:
        return known(x) or (is_leaf is not None and is_leaf(x))

    def walk(sub: Any, label: tuple[str, str | None, str]) -> None:
        for node in jax.tree.leaves(sub, is_leaf=stop):
            if not known(node):
                labels.append(label)
                continue
            entry = _state_fields[type(node)]
            kind_name = type(node).__name__
            for name in node._fields:
                source = f"{kind_name}.{name}"
                if name in entry.moments:
                    child = (MOMENT, source, "")
                elif name in entry.copies:
                    child = (COPY, source, "")
                else:
                    why = entry.kept.get(name, "not a moment or parameter copy")
                    child = (KEPT, source, why)
                walk(getattr(node, name), child)

    walk(tree, (KEPT, None, "unknown: kept as is"))

    pflat = jax.tree_util.tree_flatten_with_path(params)[0]
    owners = {_path_key(path): tuple(getattr(p, "shape", ())) for path, p in pflat}
    shapes = set(owners.values())
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    out = []
    for (path, leaf), (kind, source, why) in zip(flat, labels, strict=True):
        if kind == KEPT:
            reason = why if source is None else f"{source}: {why}; kept as is"
            out.append(LeafPlan(KEPT, source, reason))
            continue
        dtype = getattr(leaf, "dtype", None)
        stored = leaf.codes if isinstance(leaf, codes.Compressed) else leaf
        shape = tuple(getattr(stored, "shape", ())) if dtype is not None else ()
        owner = param_suffix(_path_key(path), owners)
        fits = owners[owner] == shape if owner is not None else shape in shapes
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or not shape:
            out.append(
                LeafPlan(
                    KEPT,
                    source,
                    f"{source}: a scalar or not floating point; kept as is",
                )
            )
        elif not fits:
            out.append(
                LeafPlan(
                    KEPT, source, f"{source}: not shaped like its parameter; kept as is"
                )
            )
        elif kind == MOMENT:
            out.append(LeafPlan(MOMENT, source, f"moment ({source})", owner))
        else:
            out.append(
                LeafPlan(
                    COPY,
                    source,
                    f"parameter copy ({source}): stored as the weights are",
                    owner,
                )
            )
    return out
