"""The fusions: patterns JAX emits as several equations that autocast runs as
one op, each an entry of the op table declared in a folder of its own.

A fusion's folder holds its pattern (the recogniser and the rewrite pass that
puts one equation of a private primitive in place of the equations it proves),
its rule (how the walk runs that equation, fused or as the equations it
replaced), and ``entry.py``, which declares all of it as one :class:`Fusion`.
:data:`REGISTERED` names the folders, one line each; the pass list
(:mod:`~mixprec._src.autocast.rewrites`), the op table's entries and rules
(:mod:`~mixprec._src.autocast.rules`), the FLOP count
(:func:`~mixprec._src.numerics.record.eqn_flops`) and the notes of ``explain``
and ``diagnose`` are built from the registered entries.

Examples:
    >>> [f.name for f in registered()]
    ['dot_product_attention', 'rms_norm']
    >>> entry_for("rms_norm").primitive.name
    'rms_norm'
    >>> entry_for("exp") is None
    True
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
from jax.extend.core import Jaxpr, JaxprEqn, Primitive


__all__ = [
    "REGISTERED",
    "Fusion",
    "entry_for",
    "passes",
    "registered",
    "traced_notes",
    "unfused_notes",
]

#: The registered fusions, in the order their rewrite passes run: one line per
#: fusion, the name of its folder (whose ``entry.py`` declares ``FUSION``).
REGISTERED: Final[tuple[str, ...]] = (
    "attention",
    "norm",
)

Pass = Callable[[Jaxpr, Sequence[Any], Sequence[Any]], Jaxpr]
Notes = Callable[[Jaxpr, Sequence[Any], Sequence[Any]], list[str]]


def _no_notes(jaxpr: Jaxpr, consts: Sequence[Any], known: Sequence[Any]) -> list[str]:
    del jaxpr, consts, known
    return []


@dataclasses.dataclass(frozen=True)
class Fusion:
    """One fusion: everything autocast and its reports know of it.

    Attributes:
      primitive: the private primitive its rewrite puts in place of the
        equations it recognised; its name is the op table's entry (class
        allow, flag :data:`~mixprec._src.autocast.ops.FUSION`). Each equation
        carries ``params["fusion"]`` (what was recognised: its ``eqns``, its
        ``pattern`` for reports) and ``params["part"]`` (``"forward"``, or
        ``"backward"`` for a proven backward pass).
      reason: the op table's reason for the entry.
      passes: its rewrite passes, in the order they run,
        ``rewrite(jaxpr, consts, known) -> jaxpr``.
      rule: the walk's rule for the primitive (``rule(ctx, *invals, **params)``).
      flops: the FLOPs of one of its equations (``explain``'s count).
      decided_by: which of the replaced equations decide it
        (:func:`~mixprec._src.autocast.decide.decide_fusion`): each must run in
        the same 16-bit dtype, a product (a matmul) as decided on its own,
        another equation by its scope.
      fused_reason: the reason of a fused decision, from what was recognised,
        the dtype and the part.
      unfused_notes: ``explain``/``diagnose`` notes for instances the pass
        recognises but cannot fuse, ``notes(jaxpr, consts, known)``.
    """

    primitive: Primitive
    reason: str
    passes: tuple[Pass, ...]
    rule: Callable[..., Any]
    flops: Callable[[JaxprEqn], int]
    decided_by: Callable[[JaxprEqn], bool]
    fused_reason: Callable[[Any, np.dtype, str], str]
    unfused_notes: Notes = _no_notes

    @property
    def name(self) -> str:
        """The op table's name of its primitive."""
        return self.primitive.name


@functools.cache
def registered() -> tuple[Fusion, ...]:
    """The registered fusions, in the order of :data:`REGISTERED`.

    (Loaded on first use: a fusion's rule imports the interpreter, which
    imports the pass list.)

    Raises:
      TypeError: a registered folder's ``entry.FUSION`` is not a :class:`Fusion`.
    """
    out = []
    for name in REGISTERED:
        module = importlib.import_module(f"{__name__}.{name}.entry")
        entry = getattr(module, "FUSION", None)
        if not isinstance(entry, Fusion):
            raise TypeError(
                f"fusions.REGISTERED: {module.__name__}.FUSION must be a "
                f"fusions.Fusion, got {type(entry).__name__}."
            )
        out.append(entry)
    return tuple(out)


@functools.cache
def _by_name() -> dict[str, Fusion]:
    return {f.name: f for f in registered()}


def entry_for(name: str) -> Fusion | None:
    """The registered fusion whose primitive is called ``name``, or ``None``."""
    return _by_name().get(name)


def passes() -> tuple[Pass, ...]:
    """The rewrite passes of the registered fusions, in order."""
    return tuple(p for f in registered() for p in f.passes)


def unfused_notes(
    jaxpr: Jaxpr, consts: Sequence[Any], known: Sequence[Any] = ()
) -> list[str]:
    """Every registered fusion's notes for what it recognises in ``jaxpr``
    but cannot fuse."""
    return [n for f in registered() for n in f.unfused_notes(jaxpr, consts, known)]


def traced_notes(config: Any, source: Any) -> list[str]:
    """:func:`unfused_notes` of a traced function (none under a policy that
    computes in float32: nothing would be fused)."""
    if np.dtype(config.low_dtype) == np.dtype(np.float32):
        return []
    return unfused_notes(source.jaxpr, (), source.consts)
