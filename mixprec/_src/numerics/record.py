"""What the numerics tools know about one equation autocast ran.

The interpreter's walk reports each equation to an observer
(:class:`~mixprec._src.autocast.interpreter.Observer`); :class:`Recorder` turns
the reports into :class:`OpRecord`\\ s for ``mixprec.explain``, and
``mixprec.diagnose``'s records are the same type with its measurements added
(:class:`~mixprec._src.numerics.diagnose.OpDiagnosis`, built by the same
:meth:`OpRecord.observed`). This module also holds what both
reports need about an equation: its user source line, whether it belongs to a
backward pass, its FLOPs (one formula), and the tensor-core alignment lint.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Self

import numpy as np
from jax.extend import core as jex_core

from mixprec._src import _compat
from mixprec._src.autocast import fusions, ops


__all__ = [
    "AlignmentIssue",
    "OpRecord",
    "Recorder",
    "dtype_name",
    "eqn_flops",
    "eqn_source",
    "lint_eqn",
    "lint_product",
    "parse_source",
    "short_source",
]

_SOURCE_RE = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?: \((?P<fn>.*)\))?$")
# A transformation in a name stack wraps the scope it was applied in:
# `transpose(jvp(Net))`, `vmap(eqx.nn.MLP)`, `vmap()`.
_TRANSFORM_RE = re.compile(r"[A-Za-z_]\w*\(([^()]*)\)")
_REGION_RE = re.compile(r"^mixprec_(float32|policy_\d+|ctx_\d+)$")


def eqn_source(eqn: jex_core.JaxprEqn) -> str:
    """``"file.py:LINE (function)"`` of the user code behind ``eqn`` (or ``""``)."""
    return _compat.eqn_source_summary(eqn.source_info)


def layer_path(name_stack: str) -> str:
    """The module path in a name stack: scope names, without the JAX
    transformations around them or mixprec's own region markers.

    Flax linen names its modules there (``"Net/Block_0/Dense_0"``), Haiku its
    module names (``"mlp/linear_1"``), Equinox its class names
    (``"Model/eqx.nn.Linear"``); ``jax.named_scope`` adds the user's names.

    Examples:
        >>> layer_path("transpose(jvp(Net))/Dense_0")
        'Net/Dense_0'
        >>> layer_path("vmap(eqx.nn.MLP)/vmap()/mixprec_float32")
        'eqx.nn.MLP'
    """
    text = name_stack
    while True:
        unwrapped = _TRANSFORM_RE.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    parts = [p for p in text.split("/") if p and not _REGION_RE.match(p)]
    return "/".join(parts)


def eqn_layer(eqn: jex_core.JaxprEqn, scope: str = "") -> tuple[str, str]:
    """``(layer, call_site)`` of ``eqn``.

    ``layer`` is the module path from its name stack (after ``scope``, the
    name stack of the higher-order equations around it); when the name stack
    names no module (Flax NNX, plain functions), the user's call site instead.
    ``call_site`` is the innermost line of the user's own code behind it
    (outside JAX, mixprec and installed packages), or ``""`` when that is the
    equation's source line itself.
    """
    stack = _compat.eqn_name_stack(eqn.source_info)
    full = f"{scope}/{stack}" if scope and stack else scope or stack
    call_site = _compat.eqn_call_site(eqn.source_info)
    if call_site == eqn_source(eqn):
        call_site = ""
    layer = layer_path(full)
    return layer or short_source(call_site), call_site


def layer_label(layer: str, call_site: str) -> str:
    """How a report shows where an op is: the layer, and the user's line that
    called it when the layer is a module path (``"Net/Dense_0 @ model.py:30"``).

    Examples:
        >>> layer_label("Net/Dense_0", "/a/model.py:30 (__call__)")
        'Net/Dense_0 @ model.py:30'
        >>> layer_label("model.py:30 (__call__)", "/a/model.py:30 (__call__)")
        'model.py:30 (__call__)'
    """
    if not call_site:
        return layer
    short = short_source(call_site)
    if not layer or layer == short:
        return short
    file, line, _ = parse_source(call_site)
    return f"{layer} @ {os.path.basename(file)}:{line}"


def parse_source(source: str) -> tuple[str, int | None, str]:
    """Split ``"file.py:LINE (function)"`` into ``(file, line, function)``.

    Examples:
        >>> parse_source("/a/model.py:12 (mlp)")
        ('/a/model.py', 12, 'mlp')
    """
    match = _SOURCE_RE.match(source)
    if match is None:
        return source, None, ""
    return match["file"], int(match["line"]), match["fn"] or ""


def short_source(source: str) -> str:
    """``source`` with the directory dropped: ``"model.py:12 (mlp)"``.

    Examples:
        >>> short_source("/a/model.py:12 (mlp)")
        'model.py:12 (mlp)'
    """
    file, line, fn = parse_source(source)
    if line is None:
        return source
    text = f"{os.path.basename(file)}:{line}"
    return f"{text} ({fn})" if fn else text


def _size(shape: Sequence[Any]) -> int:
    try:
        return int(math.prod(int(d) for d in shape))
    except Exception:  # noqa: BLE001  (symbolic dimensions)
        return 0


def _shape(v: Any) -> tuple[Any, ...]:
    aval = getattr(v, "aval", v)
    return tuple(getattr(aval, "shape", ()))


def product_dims(eqn: jex_core.JaxprEqn) -> Any:
    """The :class:`~mixprec._src.autocast.dots.ProductDims` of a matmul-like
    equation (one whose op-table entry has a ``Product``), else ``None``."""
    spec = ops.spec_for(eqn.primitive.name)
    if spec is None or spec.product is None:
        return None
    return spec.product.dims(
        [_shape(v) for v in eqn.invars], _shape(eqn.outvars[0]), eqn.params
    )


def eqn_flops(eqn: jex_core.JaxprEqn) -> int:
    """Floating-point operations of one equation (its sub-jaxprs excluded).

    The op of a fusion: its entry's count (``Fusion.flops``: the attention's
    matmuls). Matmul-like ops: their ``Product``'s count (``dot_general``:
    ``2·batch·M·N·K``; convolutions: ``2·out·C_in/groups·window``); reductions:
    one per input element; ops without arithmetic (clear data movement,
    higher-order primitives, integer ops): zero; every other floating op: one
    per output element.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> eqns = jax.make_jaxpr(lambda x: jnp.tanh(x @ x).reshape(-1))(
        ...     jnp.ones((4, 4))).eqns
        >>> [(e.primitive.name, eqn_flops(e)) for e in eqns]
        [('dot_general', 128), ('tanh', 16), ('reshape', 0)]
    """
    name = eqn.primitive.name
    fusion = fusions.entry_for(name)
    if fusion is not None and eqn.primitive is fusion.primitive:
        return fusion.flops(eqn)
    out_size = sum(_size(_shape(v)) for v in eqn.outvars)
    dims = product_dims(eqn)
    if dims is not None:
        return dims.flops
    spec = ops.spec_for(name)
    if spec is None or spec.op_class in (None, "clear"):
        return 0
    if not any(_is_float_aval(v) for v in eqn.outvars):
        return 0
    if name.startswith(("reduce_", "cum", "arg")):
        return sum(_size(_shape(v)) for v in eqn.invars)
    return out_size


def _is_float_aval(v: Any) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    try:
        return (
            dtype is not None
            and bool(np.issubdtype(dtype, np.floating))
            or (str(dtype) == "bfloat16")
        )
    except TypeError:
        return False


# ---------------------------------------------------------------- alignment


def alignment_multiple(dtype: Any) -> int | None:
    """8 for 16-bit floats, 16 for 8-bit types, ``None`` for wider dtypes.

    Examples:
        >>> alignment_multiple("bfloat16"), alignment_multiple("float32")
        (8, None)
    """
    if dtype is None:
        return None
    bits = np.dtype(dtype).itemsize * 8
    return {16: 8, 8: 16}.get(bits)


@dataclasses.dataclass(frozen=True)
class AlignmentIssue:
    """A matmul or convolution whose dimensions do not suit tensor cores.

    NVIDIA tensor cores need the matrix dimensions of 16-bit matmuls to be
    multiples of 8 (multiples of 16 for 8-bit types); otherwise cuBLAS/cuDNN pick
    slower kernels or pad internally (Keras mixed-precision guide).

    Attributes:
      primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
      source: user source location ``"file.py:LINE (function)"``.
      path: nesting through higher-order primitives.
      dtype: the dtype the op runs in.
      multiple: the required multiple (8 or 16).
      dims: every relevant dimension, e.g. ``{"M": 64, "N": 10, "K": 784}``.
      misaligned: the names of the dimensions that are not multiples.

    Examples:
      >>> issue = AlignmentIssue("dot_general", "m.py:3 (f)", "", "float16", 8,
      ...                        {"M": 32, "N": 10, "K": 64}, ("N",))
      >>> print(issue.message())
      dot_general at m.py:3 (f) [float16]: N=10 not a multiple of 8 (pad N to 16)
    """

    primitive: str
    source: str
    path: str
    dtype: str
    multiple: int
    dims: Mapping[str, int]
    misaligned: tuple[str, ...]

    def message(self) -> str:
        """One line naming the op, its line, and what to pad."""
        bad = ", ".join(f"{d}={self.dims[d]}" for d in self.misaligned)
        pads = ", ".join(
            f"{d} to {-(-self.dims[d] // self.multiple) * self.multiple}"
            for d in self.misaligned
        )
        where = short_source(self.source) or "<unknown>"
        verb = "not a multiple" if len(self.misaligned) == 1 else "not multiples"
        return (
            f"{self.primitive} at {where} [{self.dtype}]: {bad} {verb} of "
            f"{self.multiple} (pad {pads})"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        d["dims"] = dict(self.dims)
        d["misaligned"] = list(self.misaligned)
        d["message"] = self.message()
        return d


def lint_eqn(
    eqn: jex_core.JaxprEqn, dtype: Any, *, source: str | None = None, path: str = ""
) -> AlignmentIssue | None:
    """The alignment issue of one dot/conv equation run in ``dtype``, if any."""
    multiple = alignment_multiple(dtype)
    if multiple is None:
        return None
    dims = product_dims(eqn)
    if dims is None:
        return None
    bad = tuple(d for d, size in dims.align if size and size % multiple)
    if not bad:
        return None
    return AlignmentIssue(
        primitive=eqn.primitive.name,
        source=eqn_source(eqn) if source is None else source,
        path=path,
        dtype=str(np.dtype(dtype)),
        multiple=multiple,
        dims={k: v for k, v in dims.report if k != "window"},
        misaligned=bad,
    )


def lint_product(
    eqn: jex_core.JaxprEqn,
    decision: str,
    dtype: Any,
    float8_skip: str | None,
    *,
    source: str,
    path: str,
) -> AlignmentIssue | None:
    """The alignment issue of a product that ran in low precision: float8's
    multiples of 16 for a float8 product and for one a float8 recipe kept
    16-bit for its alignment, the 16-bit multiples of 8 otherwise."""
    if decision == "float8" or float8_skip == "alignment":
        return lint_eqn(eqn, np.dtype("float8_e4m3fn"), source=source, path=path)
    if decision == "low":
        return lint_eqn(eqn, dtype, source=source, path=path)
    return None


# ---------------------------------------------------------------- records


def _dtype_str(dtype: Any) -> str:
    try:
        return str(np.dtype(dtype))
    except TypeError:  # extended dtypes (PRNG keys)
        return str(dtype)


def dtype_name(x: Any) -> str:
    """The dtype of a value as a report writes it (its type's name if none).

    Examples:
        >>> import numpy as np
        >>> dtype_name(np.ones(2, np.float16)), dtype_name(3)
        ('float16', 'int')
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return type(x).__name__
    return str(dtype)


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One equation as autocast runs it.

    Attributes:
        index: position in evaluation order.
        primitive: the primitive name (``"dot_general"``).
        source: ``"file.py:LINE (function)"`` of the user code, or ``""``.
        path: the nesting, e.g. ``"jit(f)/scan/body"`` (``""`` at top level).
        backward: the equation belongs to a backward pass (JAX names those
            ``transpose(...)``).
        in_dtypes: the dtypes its operands run in (after autocast's casts).
        out_dtypes: the dtypes of its results.
        in_shapes: the operand shapes.
        out_shapes: the result shapes.
        op_class: ``"allow"``, ``"deny"``, ``"infer"`` or ``"clear"``.
        decision: ``"low"``, ``"float32"``, ``"received"`` (as the operands
            arrive) or ``"original"`` (as written).
        dtype: the dtype floating operands were cast to, or None.
        reason: why.
        flops: floating-point operations, times the trip count of an
            enclosing ``scan``.
        eqn: the equation itself (not compared, not serialised).
        float8: the float8 recipe (``"tensorwise"``, ``"rowwise"``) of a
            matmul or convolution that ran in float8, or that the recipe kept
            in the low dtype; ``None`` otherwise.
        float8_skip: why the recipe kept it out of float8 (``"alignment"``,
            ``"size"``, ``"symbolic"``), or ``None``.
        float8_skip_reason: the same in words (``"N=10 not a multiple of 16"``).
        layer: the layer the op belongs to: the module path from the
            equation's name stack (``"Net/Block_0/Dense_0"`` in Flax linen,
            ``"mlp/linear_1"`` in Haiku, ``"Model/eqx.nn.Linear"`` in Equinox,
            the names of ``jax.named_scope``), or, when the name stack is empty
            (Flax NNX), the user's line that called the layer; ``""`` for an
            op of a plain function.
        call_site: the innermost line of the user's own code behind the op
            when its ``source`` is in an installed package (``flax/linen/
            linear.py``), ``""`` otherwise.
        site: under a :class:`mixprec.Plan`, the plan site of a matmul-like
            op, ``(layer, op, index)`` (a backward product: its forward
            site's; ``index`` ``None`` when not traced back to one); ``None``
            otherwise.

    Examples:
        >>> import jax.numpy as jnp
        >>> import mixprec
        >>> ops = mixprec.explain(lambda x: jnp.exp(x @ x), jnp.ones((2, 2)),
        ...                       policy="mixed_bfloat16").ops
        >>> [(op.primitive, op.decision, op.out_dtypes) for op in ops]
        [('dot_general', 'low', ('bfloat16',)), ('exp', 'float32', ('float32',))]
    """

    index: int
    primitive: str
    source: str
    path: str
    backward: bool
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    op_class: str
    decision: str
    dtype: str | None
    reason: str
    flops: int
    eqn: Any = dataclasses.field(default=None, compare=False, repr=False)
    float8: str | None = None
    float8_skip: str | None = None
    float8_skip_reason: str | None = None
    layer: str = ""
    call_site: str = ""
    site: tuple[str, str, int | None] | None = None

    @classmethod
    def observed(
        cls,
        walk: Any,
        eqn: jex_core.JaxprEqn,
        decision: Any,
        ran_with: Sequence[Any],
        outs: Sequence[Any],
        *,
        index: int,
        **more: Any,
    ) -> Self:
        """The record of ``eqn`` as the walk reports it to an observer: where
        it is (``walk``), what was decided, the dtypes its operands ran in
        (``ran_with``) and its results (``outs``). ``more`` sets the fields a
        subclass adds, or replaces computed ones."""
        fields = record_fields(walk, eqn, decision, ran_with)
        fields.update(
            index=index,
            out_dtypes=tuple(dtype_name(o) for o in outs),
            out_shapes=tuple(tuple(np.shape(o)) for o in outs),
            eqn=eqn,
        )
        fields.update(more)
        return cls(**fields)

    @property
    def line(self) -> int | None:
        """The user source line number, or ``None``."""
        return parse_source(self.source)[1]

    @property
    def where(self) -> str:
        """The layer as reports show it (:func:`layer_label`)."""
        return layer_label(self.layer, self.call_site)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "eqn"
        }
        for key in ("in_dtypes", "out_dtypes"):
            d[key] = list(d[key])
        for key in ("in_shapes", "out_shapes"):
            d[key] = [[_int(x) for x in s] for s in d[key]]
        d["line"] = self.line
        return d


def _int(x: Any) -> Any:
    try:
        return int(x)
    except Exception:  # noqa: BLE001  (symbolic dimensions)
        return str(x)


def record_fields(
    walk: Any, eqn: jex_core.JaxprEqn, decision: Any, ran_with: Sequence[Any]
) -> dict[str, Any]:
    """The fields of an :class:`OpRecord` that do not depend on values."""
    source = eqn_source(eqn) or getattr(walk, "parent_source", "")
    layer, call_site = eqn_layer(eqn, getattr(walk, "scope", ""))
    reason = decision.reason
    keys = getattr(walk, "sites", {}).get(id(eqn), ())
    site = keys[0] if keys else None
    if site is not None and walk.config.plan is not None:
        reason = f"plan: policy {walk.config.policy} for its site; {reason}"
    elif walk.config.plan is not None and hasattr(walk, "site_keys"):
        # A fused op: the widest of its products' sites' policies.
        inner = list(dict.fromkeys(walk.site_keys(eqn)))
        if inner:
            named = "; ".join(
                f"{'/'.join(str(p) for p in k)}: {walk.config.plan.policy_for(*k)}"
                for k in inner
            )
            reason = (
                f"plan: policy {walk.config.policy}, the widest of its products' "
                f"sites ({named}); {reason}"
            )
    return {
        "site": site,
        "layer": layer,
        "call_site": call_site,
        "primitive": eqn.primitive.name,
        "source": source,
        "path": walk.path,
        "backward": bool(walk.backward),
        "in_dtypes": tuple(_dtype_str(d) for d in ran_with),
        "in_shapes": tuple(_shape(v) for v in eqn.invars),
        "op_class": decision.op_class or "clear",
        "decision": decision.label,
        "dtype": None if decision.dtype is None else str(decision.dtype),
        "reason": reason,
        "flops": eqn_flops(eqn) * walk.trip,
        "float8": None if decision.float8 is None else str(decision.float8),
        "float8_skip": None
        if decision.float8_skip is None
        else decision.float8_skip[0],
        "float8_skip_reason": None
        if decision.float8_skip is None
        else decision.float8_skip[1],
    }


class Recorder:
    """An observer of the walk that keeps one :class:`OpRecord` per equation.

    Examples:
        >>> import jax.numpy as jnp
        >>> from mixprec._src.autocast import api, config
        >>> rec = Recorder()
        >>> _, _ = api.trace_transformed(lambda x: (x @ x).sum(),
        ...     config.make_config("mixed_bfloat16"), (jnp.ones((2, 2)),), {},
        ...     observer=rec)
        >>> [(r.primitive, r.out_dtypes[0]) for r in rec.records]
        [('dot_general', 'bfloat16'), ('reduce_sum', 'float32')]
    """

    #: The walk traces (``explain`` observes the walk autocast stages out):
    #: each higher-order equation runs its rule, bodies are walked once.
    steps = False
    #: It sees what autocast runs: a fused op as one equation.
    fuses = True

    def __init__(self) -> None:
        self.records: list[OpRecord] = []
        self.notes: list[str] = []

    def on_eqn(
        self,
        walk: Any,
        eqn: jex_core.JaxprEqn,
        decision: Any,
        ran_with: Sequence[Any],
        invals: Sequence[Any],
        outs: Sequence[Any],
        rerun: Any = None,
    ) -> None:
        del invals, rerun
        if id(eqn) in getattr(getattr(walk, "sites", None), "dead", ()):
            return  # a product whose result is used nowhere (`sites.is_unused`)
        self.records.append(
            OpRecord.observed(
                walk, eqn, decision, ran_with, outs, index=len(self.records)
            )
        )

    def on_note(self, walk: Any, eqn: jex_core.JaxprEqn, text: str) -> None:
        del walk, eqn
        self.notes.append(text)

    def on_own(
        self,
        walk: Any,
        eqn: jex_core.JaxprEqn,
        decision: Any,
        ran_with: Sequence[Any],
        invals: Sequence[Any],
        outs: Sequence[Any],
    ) -> None:
        """An op autocast adds by itself is recorded like the user's ops."""
        self.on_eqn(walk, eqn, decision, ran_with, invals, outs)
