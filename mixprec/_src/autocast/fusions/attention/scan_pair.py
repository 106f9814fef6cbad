"""A whole step's attention across the two bodies of a differentiated ``scan``.

JAX's derivative of ``lax.scan`` (the layers of a model stacked and scanned
over, as MaxText, Levanter, Flax's ``nn.scan`` and NNX's ``nnx.scan`` lay them
out) is two scans: the forward body computes the layer and returns, stacked
over the layers, what the backward needs (the residuals: the queries, keys and
values, the attention weights, the softmax's sum); the transposed body, run in
reverse, reads one layer's residuals per iteration. Neither body alone holds
an attention and its backward pass, so :func:`.pattern.rewrite` (which proves
a backward pass within one jaxpr) fuses neither.

:func:`rewrite` puts the two bodies side by side: one iteration of the
forward body, then the transposed body with each residual read in place of
the value the forward body stacked (a slice ``i`` of a residual is what the
forward body's iteration ``i`` computed, whichever way each scan runs), and
each constant both read from the same operand. In that one jaxpr
:func:`.pattern.find` recognises the attention and proves its backward pass as
it does in an unscanned step. Each proven attention is then rewritten in both
bodies:

* the forward body computes it with one equation of
  :data:`.pattern.ATTENTION_P` (``part="forward"``), which also returns the
  fused kernel's residuals (cuDNN's: its queries, keys and values, its output
  and its softmax statistics; see :func:`.rule.residual_shapes`); the
  forward scan stacks them beside the others;
* the transposed scan reads them, and its body computes the backward pass with
  one equation (``part="backward"``) from them: the fused kernel's derivative.

What the forward body returned for the unfused backward (the attention
weights among them) is still returned: on a platform without the fused
kernel the backward runs the same equations as before on it, and the cuda
formulation returns zeros in its place (see :mod:`.rule`). Where anything does
not fit (an attention whose backward cannot be proven, a value the backward
pass needs that the forward scan does not return, a jaxpr the rewrite would
leave reading an undefined value), both scans are left as they are (and
``explain`` and ``diagnose`` name the attention as unfused).

The body of any other ``scan`` (a forward scan whose backward is recomputed
under ``jax.checkpoint`` in the transposed body, say) has its attentions
found here too, with what the program knows of the body's constants: JAX's
derivative hoists the mask and its fill out of the forward body, and the
body's own walk does not know their values.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax import lax
    >>> def attn(q, k, v):
    ...     s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
    ...     return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
    >>> def loss(w, x):
    ...     block = lambda x, w: (x + attn(x @ w[0], x @ w[1], x), None)
    ...     return jnp.sum(lax.scan(block, x, w)[0])
    >>> w, x = jnp.ones((3, 2, 64, 64)), jnp.ones((2, 16, 4, 64))
    >>> closed = jax.make_jaxpr(jax.grad(loss))(w, x)
    >>> scans = [e for e in rewrite(closed.jaxpr, closed.consts).eqns
    ...          if e.primitive.name == "scan"]
    >>> [[e.params["part"] for e in s.params["jaxpr"].jaxpr.eqns
    ...   if e.primitive.name == "dot_product_attention"] for s in scans]
    [['forward'], ['backward']]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, new_jaxpr_eqn

from mixprec._src import _compat
from mixprec._src.autocast import jaxprs
from mixprec._src.autocast.fusions.attention import pattern


__all__ = ["rewrite"]

# The dtype the fused kernel's residual slots are declared in (the rule fills
# them in the decided 16-bit dtype; only their shapes are checked).
_NOMINAL_LOW = np.dtype(jnp.bfloat16)


def rewrite(
    jaxpr: Jaxpr, consts: Sequence[Any] = (), known: Sequence[Any] = ()
) -> Jaxpr:
    """``jaxpr`` with the attentions of each forward/transposed ``scan`` pair
    whose backward pass is proven fused in both bodies, and those of other
    scan bodies found with their known constants (see the module docstring),
    or the same jaxpr."""
    eqns = jaxpr.eqns
    scans = [i for i, e in enumerate(eqns) if e.primitive.name == "scan"]
    if len(scans) < 2:
        return jaxpr
    made = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    new: dict[int, JaxprEqn] = {}
    for j in scans:
        tb = eqns[j]
        if not _compat.eqn_transformed_by(tb.source_info, "transpose"):
            continue
        nc, ncar = _compat.scan_layout(tb.params)
        feeds = {
            made[u]
            for u in tb.invars[nc + ncar :]
            if type(u) is not Literal and u in made
        }
        fwd = [i for i in feeds if eqns[i].primitive.name == "scan" and i not in new]
        if len(fwd) != 1:
            continue
        pair = _pair(jaxpr, consts, known, fwd[0], j)
        if pair is not None:
            new[fwd[0]], new[j] = pair
    # Any other scan's body: its attentions found with what is known of its
    # constants (the mask and fill JAX's derivative hoists out of a forward
    # body whose backward is recomputed under `jax.checkpoint`, say), which
    # its walk does not know.
    given = _given(jaxpr, consts, known)
    for i in scans:
        e = eqns[i]
        body: ClosedJaxpr = e.params["jaxpr"]
        if i in new or sum(q.primitive.name == "dot_general" for q in body.eqns) < 2:
            continue
        nc, _ = _compat.scan_layout(e.params)
        known_body = pattern.constant_values(jaxpr, given, e.invars[:nc])
        if all(x is None for x in known_body):
            continue
        done = pattern.rewrite(body.jaxpr, body.consts, known_body)
        if done is not body.jaxpr:
            new[i] = e.replace(
                params={**e.params, "jaxpr": ClosedJaxpr(done, body.consts)}
            )
    if not new:
        return jaxpr
    return jaxpr.replace(eqns=[new.get(i, e) for i, e in enumerate(eqns)])


def _given(jaxpr: Jaxpr, consts: Sequence[Any], known: Sequence[Any]) -> dict:
    return {
        v: x
        for v, x in (
            *zip(jaxpr.constvars, consts, strict=False),
            *zip(jaxpr.invars, known, strict=False),
        )
        if x is not None and not _compat.is_tracer(x)
    }


@dataclasses.dataclass
class _Side:
    """One body being rewritten: what to put where and what to drop."""

    body: Jaxpr
    put: dict[int, list[JaxprEqn]] = dataclasses.field(default_factory=dict)
    drop: set[int] = dataclasses.field(default_factory=set)
    extra: list[Any] = dataclasses.field(default_factory=list)

    def eqns(self) -> list[JaxprEqn]:
        out: list[JaxprEqn] = []
        for i, e in enumerate(self.body.eqns):
            out += self.put.get(i, ())
            if i not in self.drop:
                out.append(e)
        out += self.put.get(len(self.body.eqns), ())
        return out


def _pair(
    outer: Jaxpr, consts: Sequence[Any], known: Sequence[Any], i: int, j: int
) -> tuple[JaxprEqn, JaxprEqn] | None:
    """The forward scan ``i`` and transposed scan ``j`` of ``outer`` with
    their attentions rewritten, or ``None``."""
    fe, te = outer.eqns[i], outer.eqns[j]
    fc: ClosedJaxpr = fe.params["jaxpr"]
    tc: ClosedJaxpr = te.params["jaxpr"]
    fb, tb = fc.jaxpr, tc.jaxpr
    fnc, fncar = _compat.scan_layout(fe.params)
    tnc, tncar = _compat.scan_layout(te.params)
    # The transposed body's inputs that are the forward body's values.
    stacked = {o: fb.outvars[fncar + k] for k, o in enumerate(fe.outvars[fncar:])}
    shared = {}
    for u, v in zip(fe.invars[:fnc], fb.invars[:fnc], strict=True):
        if type(u) is not Literal:
            shared.setdefault(u, v)
    sub: dict[Any, Any] = {}
    for k, (u, v) in enumerate(zip(te.invars, tb.invars, strict=True)):
        if type(u) is Literal:
            continue
        if k < tnc and u in shared:
            sub[v] = shared[u]
        elif k >= tnc + tncar and u in stacked and type(stacked[u]) is not Literal:
            sub[v] = stacked[u]
    if not sub:
        return None
    # The transposed body's other constants that the outer program computes
    # from literals only (the zeros a transposed `where` reads): computed in
    # the side-by-side program as there, so that they are named as the
    # reference derivative's are.
    prefix: dict[int, JaxprEqn] = {}
    for u, v in zip(te.invars[:tnc], tb.invars[:tnc], strict=True):
        if v not in sub and type(u) is not Literal and _from_literals(outer, u, prefix):
            sub[v] = u
    lead = [outer.eqns[r] for r in sorted(prefix)]
    # The forward body's results read elsewhere than by the transposed scan.
    read_out = {
        u for e in outer.eqns if e is not te for u in e.invars if type(u) is not Literal
    }
    read_out |= {u for u in outer.outvars if type(u) is not Literal}
    kept_ys = [
        fb.outvars[fncar + k] for k, o in enumerate(fe.outvars[fncar:]) if o in read_out
    ]

    def subst(u: Any) -> Any:
        return u if type(u) is Literal else sub.get(u, u)

    merged = _compat.jaxpr_replace(
        fb,
        constvars=[*fb.constvars, *tb.constvars],
        invars=[*fb.invars, *(v for v in tb.invars if v not in sub)],
        outvars=[*fb.outvars[:fncar], *kept_ys, *map(subst, tb.outvars)],
        eqns=[
            *fb.eqns,
            *lead,
            *(
                e.replace(
                    invars=[subst(u) for u in e.invars],
                    source_info=_compat.as_transposed(e.source_info),
                )
                for e in tb.eqns
            ),
        ],
    )
    given = _given(outer, consts, known)
    known_f = pattern.constant_values(outer, given, fe.invars[:fnc])
    matches = pattern.find(merged, [*fc.consts, *tc.consts], known_f)
    nf, nt = len(fb.eqns), len(fb.eqns) + len(lead)
    back = {}
    for v, w in sub.items():
        back.setdefault(w, v)
    fside, tside = _Side(fb), _Side(tb)
    done = 0
    for m in matches.values():
        if m.backward is None or not all(r < nf for r in m.region):
            continue
        if _one(m, nf, nt, back, fside, tside):
            done += 1
    if not done:
        return None
    fbody = _compat.jaxpr_replace(
        fb, eqns=fside.eqns(), outvars=[*fb.outvars, *fside.extra]
    )
    tbody = _compat.jaxpr_replace(
        tb, eqns=tside.eqns(), invars=[*tb.invars, *tside.extra]
    )
    if not (_well_formed(fbody) and _well_formed(tbody)):
        return None
    length = fe.params["length"]
    outs = [
        Var(_compat.shaped_array((length, *v.aval.shape), v.aval.dtype))
        for v in fside.extra
    ]
    new_f = fe.replace(
        outvars=[*fe.outvars, *outs],
        params={
            **_compat.scan_params_more(fe.params, extra_xs=0, extra_ys=len(outs)),
            "jaxpr": ClosedJaxpr(fbody, fc.consts),
        },
    )
    new_t = te.replace(
        invars=[*te.invars, *outs],
        params={
            **_compat.scan_params_more(te.params, extra_xs=len(outs), extra_ys=0),
            "jaxpr": ClosedJaxpr(tbody, tc.consts),
        },
    )
    return new_f, new_t


def _from_literals(outer: Jaxpr, u: Any, found: dict[int, JaxprEqn]) -> bool:
    """Whether ``u`` is computed from literals only in ``outer``; its
    equations are added to ``found`` (by index) where it is."""
    at = jaxprs.positions(outer)
    need: dict[int, JaxprEqn] = {}
    stack = [u]
    while stack:
        w = stack.pop()
        if type(w) is Literal:
            continue
        i = at.get(w)
        if i is None:  # an input of the program
            return False
        if i in need or i in found:
            continue
        e = outer.eqns[i]
        if e.effects:
            return False
        need[i] = e
        stack += e.invars
    found.update(need)
    return True


def _one(
    m: pattern.Match,
    nf: int,
    nt: int,
    back: dict[Any, Any],
    fside: _Side,
    tside: _Side,
) -> bool:
    """Rewrites the proven attention ``m`` of the side-by-side bodies (the
    forward body's equations first, then up to ``nt`` the outer constants'
    and then the transposed body's) into ``fside`` and ``tside``; whether it
    could."""
    from mixprec._src.autocast.fusions.attention import rule  # noqa: PLC0415

    bwd = m.backward
    assert bwd is not None
    fb, tb = fside.body, tside.body
    # The backward pass's equations in the forward body (values such as
    # `1 / sum**2` it returns for the transposed body) stay there, after the
    # fused forward; the others are replaced in the transposed body.
    f_keep = sorted(r for r in bwd.region if r < nf)
    t_region = sorted(r - nt for r in bwd.region if r >= nt)
    f_drop = {r for r in bwd.dropped if r < nf}
    t_drop = {r - nt for r in bwd.dropped if r >= nt}
    if not t_region or fside.drop & (m.region | f_drop) or tside.drop & set(t_region):
        return False
    t_eqns = [tb.eqns[r] for r in t_region]
    produced = {o for e in t_eqns for o in e.outvars}
    reads: list[Any] = [bwd.ct]
    if bwd.ct in back:  # (the cotangent is the transposed body's own)
        return False
    for e in t_eqns:
        for u in e.invars:
            if type(u) is Literal or u in produced or u in reads:
                continue
            reads.append(u)
    grads = tuple(g for g in bwd.grads if g is not None)
    slots = tuple(rule.residual_shapes(m, _NOMINAL_LOW) or ())
    t_bwd = dataclasses.replace(
        bwd,
        region=frozenset(t_region),
        reads=tuple(reads),
        eqns=tuple(t_eqns),
        outvars=grads,
        at=bwd.at - nt,
        dropped=frozenset(t_drop),
    )
    out_var = fb.eqns[m.anchor].outvars[0]
    fused = dataclasses.replace(
        m,
        backward=t_bwd,
        eqns=tuple(fb.eqns[r] for r in sorted(m.region)),
        outvars=(out_var, *bwd.saved),
        residuals=slots,
    )
    f_slots = [Var(_compat.shaped_array(s.shape, s.dtype)) for s in slots]
    t_slots = [Var(_compat.shaped_array(s.shape, s.dtype)) for s in slots]
    flops = m.eqn.params["flops"]
    forward = new_jaxpr_eqn(
        list(m.inputs),
        [*fused.outvars, *f_slots],
        pattern.ATTENTION_P,
        {"part": "forward", "fusion": fused, "flops": flops},
        set(),
        _compat.common_source_info([fb.eqns[r].source_info for r in sorted(m.region)]),
    )
    backward = new_jaxpr_eqn(
        [*reads, *t_slots],
        list(grads),
        pattern.ATTENTION_P,
        {"part": "backward", "fusion": fused, "flops": 2 * flops},
        set(),
        bwd.eqn.source_info,
    )
    fside.put.setdefault(m.anchor, []).extend([forward, *(fb.eqns[r] for r in f_keep)])
    fside.drop |= m.region | f_drop | set(f_keep)
    fside.extra += f_slots
    tside.put.setdefault(t_bwd.at, []).append(backward)
    tside.drop |= set(t_region) | t_drop
    tside.extra += t_slots
    return True


def _well_formed(jaxpr: Jaxpr) -> bool:
    """Whether every value ``jaxpr`` reads is defined before it is read."""
    defined = {*jaxpr.constvars, *jaxpr.invars}
    for e in jaxpr.eqns:
        if any(type(u) is not Literal and u not in defined for u in e.invars):
            return False
        defined.update(e.outvars)
    return all(type(u) is Literal or u in defined for u in jaxpr.outvars)
