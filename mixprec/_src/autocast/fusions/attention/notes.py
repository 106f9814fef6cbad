"""The notes ``explain`` and ``diagnose`` give about attentions autocast
recognises but cannot fuse: one whose backward pass JAX put in another body
(a whole step over ``lax.scan``-stacked layers), and one whose backward pass is
recomputed inside a ``jax.checkpoint`` body (fused forward only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from mixprec._src import _compat
from mixprec._src.autocast import jaxprs
from mixprec._src.autocast.fusions.attention import pattern as attention
from mixprec._src.numerics.record import short_source


__all__ = ["traced_attention_notes", "unfused_attention_notes"]


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
    fused (:func:`~mixprec._src.autocast.fusions.attention.pattern.unpaired`).

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


#: The primitives of ``jax.checkpoint`` (``jax.remat``) across JAX releases.
_REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint", "remat_opt"})


def _recomputed_backward_notes(
    jaxpr: Jaxpr, consts: Sequence[Any], known: Sequence[Any], where: str
) -> list[str]:
    """Notes for the attentions of a differentiated ``jaxpr`` fused forward
    only, because their backward pass is recomputed inside a
    ``jax.checkpoint`` body of ``jaxpr``'s backward pass: the forward is
    proven and fused here, the backward (the recomputed weights and their
    derivative, with no ``·v`` of their own) is in another jaxpr."""
    remats = [
        eqn
        for eqn in jaxpr.eqns
        if eqn.primitive.name in _REMAT_PRIMITIVES
        and _compat.eqn_transformed_by(eqn.source_info, "transpose")
        and any(
            sum(e.primitive.name == "dot_general" for e in _open(body).eqns) >= 2
            for _, body in _bodies(eqn)
        )
    ]
    if not remats:
        return []
    remat = short_source(_compat.eqn_source_summary(remats[0].source_info))
    notes = []
    for m in attention.find(jaxpr, consts, known).values():
        if m.backward is not None:
            continue
        source = short_source(_compat.eqn_source_summary(m.eqn.source_info))
        at = f" [in {where}]" if where else ""
        notes.append(
            f"dot_product_attention ({m.pattern}) at {source or '<unknown>'}{at}: "
            "forward fused, backward not. Its backward pass is recomputed inside "
            f"a jax.checkpoint body ({remat or '<unknown>'}) of the backward pass, "
            "another jaxpr, where autocast cannot prove it against the fused "
            "forward: it runs op by op (on a GPU: no cuDNN backward kernel, and the "
            "attention weights are recomputed and materialised). To fuse both "
            "passes, apply autocast to the loss alone (inside or outside the "
            "checkpoint) and differentiate that: JAX then differentiates the "
            "fused kernel."
        )
    return notes


def _open(body: Any) -> Jaxpr:
    return body.jaxpr if isinstance(body, ClosedJaxpr) else body


def traced_attention_notes(config: Any, source: Any) -> list[str]:
    """:func:`unfused_attention_notes` of a traced function (none under a
    policy that computes in float32: nothing would be fused)."""
    if np.dtype(config.low_dtype) == np.dtype(np.float32):
        return []
    return unfused_attention_notes(source.jaxpr, (), source.consts)
