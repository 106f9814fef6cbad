"""The notes ``explain`` and ``diagnose`` give about attentions autocast
recognises but cannot fuse: one whose backward pass JAX put in another body
(a whole step over ``lax.scan``-stacked layers), and one whose backward pass is
recomputed inside a ``jax.checkpoint`` body (fused forward only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from mixprec._src import _compat
from mixprec._src.autocast import jaxprs
from mixprec._src.autocast.fusions.attention import (
    pattern as attention,
    remat,
    scan_pair,
)
from mixprec._src.numerics.record import short_source


__all__ = ["unfused_attention_notes"]


def _bodies(eqn: Any) -> list[tuple[str, Any]]:
    """The bodies of a higher-order equation, with their parameter names."""
    out = []
    for name, value in eqn.params.items():
        for body in value if isinstance(value, tuple | list) else (value,):
            if isinstance(body, Jaxpr | ClosedJaxpr):
                out.append((name, body))
    return out


def _known_operands(
    jaxpr: Jaxpr, given: dict[Any, Any], eqn: Any, body: Jaxpr
) -> list[Any]:
    """The values a body of ``eqn`` knows of its leading (constant) inputs:
    a scan's constants, a call's operands."""
    name = eqn.primitive.name
    if name == "scan":
        operands = eqn.invars[: _compat.scan_layout(eqn.params)[0]]
    elif name != "while" and len(body.invars) == len(eqn.invars):
        operands = eqn.invars
    else:
        return []
    return attention.constant_values(jaxpr, given, operands)


def unfused_attention_notes(
    jaxpr: Jaxpr, consts: Sequence[Any], known: Sequence[Any] = ()
) -> list[str]:
    """Notes for the attentions autocast recognises in ``jaxpr`` but cannot
    fuse because their backward pass is in another body.

    The rule: in a differentiated program (one with equations JAX's
    transposition emitted, at its level or above), an attention recognised in
    the body of a higher-order equation whose values other than its result
    leave that body (the residuals JAX returns from the forward body of a
    differentiated ``lax.scan`` or ``jit`` for a backward pass it puts in
    another body) has no backward pass beside it to prove: neither pass is
    fused (:func:`~mixprec._src.autocast.fusions.attention.pattern.unpaired`),
    unless it is in the forward body of a ``scan`` whose transposed body's
    backward pass :mod:`~mixprec._src.autocast.fusions.attention.scan_pair`
    proves (both passes are then fused: nothing to say).

    Args:
      jaxpr: the traced program (as autocast walks it).
      consts: the values of its constvars.
      known: the values of its first invars where they are constants.

    Returns:
      One note per such attention: which, where, why, and what to do.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> def layer(x, w):
      ...     s = jnp.einsum("btd,bsd->bts", x @ w, x) * 0.25
      ...     return jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), x), None
      >>> loss = lambda w, x: jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)
      >>> w, x = jnp.ones((2, 16, 16)), jnp.ones((2, 8, 16))
      >>> closed = jax.make_jaxpr(jax.grad(loss))(w, x)
      >>> notes = unfused_attention_notes(closed.jaxpr, closed.consts)
      >>> [n.split(":")[0] for n in notes]
      ['dot_product_attention (scaled q·kᵀ, softmax, ·v) at ...']
    """
    notes: list[str] = []

    def visit(
        jaxpr: Jaxpr,
        consts: Sequence[Any],
        known_of: Callable[[], Sequence[Any]],
        derived: bool,
        where: str,
    ) -> None:
        # Constants are evaluated only where an attention may be looked for.
        memo: dict[str, Any] = {}

        def known() -> Sequence[Any]:
            if "known" not in memo:
                memo["known"] = list(known_of())
            return memo["known"]

        def given() -> dict[Any, Any]:
            if "given" not in memo:
                memo["given"] = {
                    v: x
                    for v, x in (
                        *zip(jaxpr.constvars, consts, strict=False),
                        *zip(jaxpr.invars, known(), strict=False),
                    )
                    if x is not None
                }
            return memo["given"]

        if sum(e.primitive.name == "scan" for e in jaxpr.eqns) >= 2:
            # The scan pairs autocast fuses across their two bodies.
            jaxpr = scan_pair.rewrite(jaxpr, consts, known())
        derived = derived or bool(jaxprs.backward_eqns(jaxpr))
        dots = sum(e.primitive.name == "dot_general" for e in jaxpr.eqns)
        if where and derived and dots >= 2:
            for m in attention.unpaired(jaxpr, consts, known()):
                source = short_source(_compat.eqn_source_summary(m.eqn.source_info))
                notes.append(
                    f"dot_product_attention ({m.pattern}) at {source or '<unknown>'}"
                    f" [in {where}]: not fused, forward or backward. It is in the "
                    "body of a higher-order op of a differentiated program (such "
                    "as a whole train step over lax.scan-stacked layers) and the "
                    "values its backward pass reads leave that body, so JAX put "
                    "its backward pass in another body, where autocast cannot "
                    "prove it against the forward. Its ops run one by one (on a "
                    "GPU: no cuDNN kernel, and the attention weights are "
                    "materialised). To fuse both passes, apply autocast to the "
                    "loss alone and differentiate that: jax.value_and_grad("
                    "mixprec.autocast(loss, policy)); JAX then differentiates the "
                    "fused kernel."
                )
        if derived and dots >= 2:
            notes.extend(_recomputed_backward_notes(jaxpr, consts, known(), where))
        for eqn in jaxpr.eqns:
            bodies = _bodies(eqn)
            if not bodies:
                continue
            source = short_source(_compat.eqn_source_summary(eqn.source_info))
            inner = f"{eqn.primitive.name} at {source or '<unknown>'}"
            for _, body in bodies:
                open_body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
                body_consts = body.consts if isinstance(body, ClosedJaxpr) else ()
                visit(
                    open_body,
                    body_consts,
                    lambda jaxpr=jaxpr, eqn=eqn, body=open_body: _known_operands(
                        jaxpr, given(), eqn, body
                    ),
                    derived,
                    f"{where}, {inner}" if where else inner,
                )

    visit(jaxpr, consts, lambda: known, False, "")
    return notes


def _policy_saves(policy: Any) -> str | None:
    """The name of a ``jax.checkpoint`` policy that saves values (``None``
    for one that saves none, JAX's default)."""
    if policy is None or policy is jax.checkpoint_policies.nothing_saveable:
        return None
    return getattr(policy, "__name__", None) or repr(policy)


def _recomputed_backward_notes(
    jaxpr: Jaxpr, consts: Sequence[Any], known: Sequence[Any], where: str
) -> list[str]:
    """Notes for the attentions of a differentiated ``jaxpr`` whose backward
    pass is recomputed inside a ``jax.checkpoint`` body of ``jaxpr``'s
    backward pass and not fused there.

    Such a body recomputes the checkpointed forward and runs its backward
    (:mod:`~mixprec._src.autocast.fusions.attention.remat`): an attention
    fused forward here is fused there too where its backward is proven
    against the recomputed forward. Two cases stay unfused and are named:
    the backward is not proven (the forward is fused here, the backward runs
    op by op), and the checkpoint's policy saves a value of the attention
    (``dots_saveable`` saves its scores), which splits its forward between
    ``jaxpr`` and the body (neither pass is fused)."""
    remats = [
        eqn
        for eqn in jaxpr.eqns
        if eqn.primitive.name in remat.REMAT_PRIMITIVES
        and _compat.eqn_transformed_by(eqn.source_info, "transpose")
    ]
    if not remats:
        return []
    given = {
        v: x
        for v, x in (
            *zip(jaxpr.constvars, consts, strict=False),
            *zip(jaxpr.invars, known, strict=False),
        )
        if x is not None
    }
    at = f" [in {where}]" if where else ""
    notes = []
    fused: dict[str, int] = {}  # per source, the attentions fused in a body
    first = None
    saving = []  # the checkpoints whose policy saves values
    for eqn in remats:
        place = short_source(_compat.eqn_source_summary(eqn.source_info))
        saves = _policy_saves(eqn.params.get("policy"))
        if saves is not None:
            saving.append((eqn, place, saves))
        for _, body in _bodies(eqn):
            inner = _open(body)
            if sum(e.primitive.name == "dot_general" for e in inner.eqns) < 2:
                continue
            first = first or place
            body_known = _known_operands(jaxpr, given, eqn, inner)
            _, proven = remat.recomputed_attentions(inner, body_known)
            for m in proven:
                key = _compat.eqn_source_summary(m.eqn.source_info)
                fused[key] = fused.get(key, 0) + 1
    if saving:
        # An attention whose values such a checkpoint reads (its residuals)
        # is split between this jaxpr and the checkpoint's body: what
        # `unpaired` finds of this jaxpr with those values as its results.
        drop = {id(eqn) for eqn, _, _ in saving}
        view = jaxpr.replace(
            eqns=[e for e in jaxpr.eqns if id(e) not in drop],
            outvars=[
                *jaxpr.outvars,
                *(
                    u
                    for eqn, _, _ in saving
                    for u in eqn.invars
                    if type(u) is not Literal
                ),
            ],
        )
        _, place, saves = saving[0]
        for m in attention.unpaired(view, consts, known):
            source = short_source(_compat.eqn_source_summary(m.eqn.source_info))
            notes.append(
                f"dot_product_attention ({m.pattern}) at {source or '<unknown>'}"
                f"{at}: not fused, forward or backward. The policy of its "
                f"jax.checkpoint ({place or '<unknown>'}) saves values of the "
                f"attention ({saves}: dots_saveable saves its scores), so its "
                "forward is split between the step and the checkpoint's body of "
                "the backward pass, and autocast cannot prove it: its ops run one "
                "by one (on a GPU: no cuDNN kernel, and the attention weights are "
                "materialised). To fuse both passes, checkpoint with a policy that "
                "saves none of its values (jax.checkpoint_policies.nothing_saveable "
                "or dots_with_no_batch_dims_saveable), or apply autocast to the "
                "loss alone and differentiate that."
            )
    if first is None:
        return notes
    for m in attention.find(jaxpr, consts, known).values():
        if m.backward is not None:
            continue
        key = _compat.eqn_source_summary(m.eqn.source_info)
        if fused.get(key, 0) > 0:
            fused[key] -= 1
            continue
        source = short_source(key)
        notes.append(
            f"dot_product_attention ({m.pattern}) at {source or '<unknown>'}{at}: "
            "forward fused, backward not. Its backward pass is recomputed inside "
            f"a jax.checkpoint body ({first or '<unknown>'}) of the backward pass, "
            "where autocast could not prove it against the recomputed forward "
            "(as for jax.nn.dot_product_attention's XLA formulation, whose "
            "products have a unit group axis): it runs op by op (on a GPU: no "
            "cuDNN backward kernel, and the attention weights are recomputed and "
            "materialised). To fuse both passes, write the attention out, or "
            "apply autocast to the loss alone (inside or outside the checkpoint) "
            "and differentiate that: JAX then differentiates the fused kernel."
        )
    return notes


def _open(body: Any) -> Jaxpr:
    return body.jaxpr if isinstance(body, ClosedJaxpr) else body
