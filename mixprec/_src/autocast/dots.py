"""Low-precision dots and convolutions, formulated per backend.

The autocast interpreter routes every ``dot_general`` and ``conv_general_dilated``
it lowers through :func:`dot_general` and :func:`conv_general_dilated`. They
take the operands at whatever floating dtype they arrive in, run the product
with inputs rounded to ``low_dtype`` and return the result in ``out_dtype``.

How the product is computed depends on the backend, because what is fast
differs (see ``docs/performance.md`` for the measurements):

* **CPU** (XLA:CPU, jaxlib 0.10.x). Only ``bfloat16 x bfloat16 -> float32``
  runs natively (YNNPACK with AVX-512 BF16), and only for row-major operands
  with the lhs contraction trailing; everything else, including
  ``bfloat16 -> bfloat16`` dots and the weight-gradient dot ``x^T g``, is
  silently converted to a float32 dot. So every product here is written as one
  canonical 2-D/3-D matmul ``(batch, m, k) x (batch, k, n)`` (or
  ``(batch, n, k)``) with ``preferred_element_type=float32``, transposes it needs
  are materialised as real row-major copies (a split-transpose-merge reshape
  that XLA cannot turn into a layout change), and a ``jax.custom_vjp`` makes
  the two cotangent dots of the backward pass canonical ``bf16 x bf16 -> f32``
  matmuls as well, with the cotangent rounded to bfloat16 and bfloat16
  residuals. Optimization barriers around each canonical dot keep XLA from
  folding transposes back into it after it has chosen the bf16 kernel, which
  is what triggers the jaxlib 0.10.2 bug ``Unsupported element type for
  DotThunk::Execute: BF16 x BF16 = F32``. Matrix-vector and tiny products
  (no bf16 kernel) are computed in float32 from the rounded inputs.
  ``float16`` is never native on CPU: the dot takes the float16 inputs (and
  cotangents) with a float32 result, which XLA:CPU computes by upcasting, so
  the numerics are those of a float16 GPU dot with float32 accumulation. It is
  correct, not fast.
* **CPU without native bfloat16** (no AVX-512 BF16 or AMX-BF16: AVX2-only
  x86 CPUs, many laptops and cloud machines; decided by
  :mod:`~mixprec._src.autocast.capability`). XLA:CPU still hands
  ``bf16 x bf16 -> f32`` dots to YNNPACK, whose AVX2 kernel widens bfloat16
  on the fly and runs at about 0.7x of its float32 GEMM, so the formulation
  above makes a training step slower than float32. Here each dot rounds its
  operands to bfloat16 and multiplies them as float32 (a plain float32 GEMM,
  in whatever layout JAX gives it: no copies, no barriers). Its
  ``custom_vjp`` keeps for the backward pass the operands that arrived in
  16 bits (activations under autocast) in bfloat16, and float32 operands
  (parameters) as they are, which costs no memory; the backward dots are
  float32 GEMMs on those and the float32 cotangent. The forward numerics are
  those of a bfloat16 GEMM with float32 accumulation; what mixed precision
  still gives on such a CPU is the memory: bfloat16 activations and
  residuals, at about float32's speed.
* **GPU/TPU**. ``low x low -> low``: cuBLAS and the TPU MXU accumulate in
  float32 internally, and JAX's own transpose rules already give low-precision
  backward dots, so no custom derivative is needed.

With ``forward_mode_ad=True`` no ``custom_vjp`` is used (a ``custom_vjp``
function cannot be differentiated in forward mode), so ``jax.jvp`` and
``jax.jacfwd`` work; reverse mode then uses JAX's transpose rules, whose
backward dots take a float32 cotangent and so run in float32 on CPU.

Convolutions: XLA:CPU has no bf16 convolution kernel (a ``bf16`` convolution
is converted to float32), so on CPU the inputs are rounded to ``low_dtype`` and
the convolution accumulates in float32 (``preferred_element_type=float32``);
on GPU/TPU it runs ``low x low -> low``. Both use JAX's derivative rules.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from mixprec._src import _compat
from mixprec._src.autocast import capability
from mixprec._src.autocast.platforms import canonical_platform, per_platform
from mixprec._src.autocast.request import ProductRequest


__all__ = [
    "ProductDims",
    "conv_dims",
    "conv_general_dilated",
    "conv_note",
    "conv_product",
    "dot_general",
    "dot_general_dims",
    "dot_general_product",
    "formulation",
    "formulation_note",
    "Rounded",
    "ragged_dot_dims",
    "ragged_dot_product",
    "rounded",
    "wide_dot_general",
]

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)

# (lhs_contract, rhs_contract), (lhs_batch, rhs_batch), all tuples of ints.
_DimNums = tuple[
    tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]
]


def _constrains(sharding: Any) -> bool:
    """Whether a sharding says anything: a mesh axis of type ``Explicit``, or a
    partition spec that shards some dimension.

    JAX's transpose of a ``dot_general`` under a mesh carries
    ``out_sharding=NamedSharding(<Auto mesh>, P(None, ...))``: that says
    nothing, and the product must still get the CPU's own formulation.
    """
    if sharding is None:
        return False
    mesh = getattr(sharding, "mesh", None)
    if any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ()) or ()):
        return True
    spec = getattr(sharding, "spec", None)
    return spec is not None and any(s is not None for s in spec)


def explicitly_sharded(out_sharding: Any, *xs: jax.Array) -> bool:
    """Whether a product must keep JAX's own formulation for its shardings:
    its ``out_sharding`` or an operand's sharding (``AxisType.Explicit``)
    constrains something."""
    if _constrains(out_sharding):
        return True
    for x in xs:
        try:
            spec = jax.typeof(x).sharding.spec
        except (AttributeError, TypeError):
            continue
        if any(s is not None for s in spec):
            return True
    return False


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _check_dtypes(
    call: str, low_dtype: DTypeLike, out_dtype: DTypeLike
) -> tuple[np.dtype, np.dtype]:
    low, out = np.dtype(low_dtype), np.dtype(out_dtype)
    for name, dt in (("low_dtype", low), ("out_dtype", out)):
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(
                f"`{call}(..., {name}=...)` must be a floating dtype such as "
                f"bfloat16, float16 or float32, got {dt}."
            )
    return low, out


def _canon_dn(dimension_numbers: Any) -> _DimNums:
    (lc, rc), (lb, rb) = dimension_numbers
    return (
        (tuple(int(d) for d in lc), tuple(int(d) for d in rc)),
        (tuple(int(d) for d in lb), tuple(int(d) for d in rb)),
    )


def _free_dims(ndim: int, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
    used = set(contract) | set(batch)
    return [d for d in range(ndim) if d not in used]


def _smallest_factor(n: int) -> int:
    for p in range(2, int(n**0.5) + 1):
        if n % p == 0:
            return p
    return n


def _materialized_transpose(x: jax.Array, perm: Sequence[int]) -> jax.Array:
    """``lax.transpose(x, perm)`` that XLA:CPU keeps as a row-major copy.

    XLA gives a plain ``transpose`` a permuted *layout* instead of moving data,
    and XLA:CPU's bf16 dot kernels (YNNPACK) only take row-major operands, so a
    dot fed by a transpose is silently upcast to float32 (or, when a later pass
    rewrites it, fails with ``DotThunk::Execute: BF16 x BF16 = F32``). Splitting
    one dimension before the transpose and merging it after turns the transpose
    into a reshape that is not a bitcast, which gets a real row-major copy.
    """
    perm = tuple(perm)
    if perm == tuple(range(x.ndim)):
        return x
    out_shape = tuple(x.shape[p] for p in perm)
    # Split the largest dimension that has a non-trivial factor.
    split = None
    for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        f = _smallest_factor(x.shape[d])
        if 1 < f < x.shape[d]:
            split = (d, f)
            break
    if split is None:
        return lax.transpose(x, perm)
    d, f = split
    shape = list(x.shape)
    expanded = [*shape[:d], f, shape[d] // f, *shape[d + 1 :]]
    # Expanded index of each original dimension.
    idx = [[i] if i < d else [i + 1] for i in range(x.ndim)]
    idx[d] = [d, d + 1]
    big_perm = [j for p in perm for j in idx[p]]
    y = lax.transpose(x.reshape(expanded), big_perm)
    return y.reshape(out_shape)


# XLA:CPU (YNNPACK) takes a bf16 dot only when one of m, n, k is at least this.
_MIN_NATIVE_DIM = 8


def _upcast_contract(
    a: jax.Array,
    a_labels: list[int],
    b: jax.Array,
    b_labels: list[int],
    out_labels: list[int],
    batch: list[int],
    contract: list[int],
    precision: Any,
    acc_dtype: np.dtype,
) -> jax.Array:
    """The same contraction as :func:`_contract`, on operands cast to ``acc_dtype``."""
    dims: _DimNums = (
        (
            tuple(a_labels.index(lab) for lab in contract),
            tuple(b_labels.index(lab) for lab in contract),
        ),
        (
            tuple(a_labels.index(lab) for lab in batch),
            tuple(b_labels.index(lab) for lab in batch),
        ),
    )
    if a.dtype == b.dtype == np.float16:
        # XLA:CPU accepts f16 x f16 -> f32 in every layout (checked on jaxlib
        # 0.10.2, including the layouts that crash for bf16). It upcasts
        # internally, so this is no faster, but the jaxpr, `explain` and the
        # saved residuals show the float16 operands that were really used.
        out = lax.dot_general(
            a, b, dims, precision=precision, preferred_element_type=acc_dtype
        )
    else:
        out = lax.dot_general(
            a.astype(acc_dtype), b.astype(acc_dtype), dims, precision=precision
        )
    res_labels = [
        *batch,
        *(lab for lab in a_labels if lab not in batch and lab not in contract),
        *(lab for lab in b_labels if lab not in batch and lab not in contract),
    ]
    perm = tuple(res_labels.index(lab) for lab in out_labels)
    return out if perm == tuple(range(out.ndim)) else lax.transpose(out, perm)


def labeled_dot(
    a: jax.Array,
    a_labels: Sequence[int],
    b: jax.Array,
    b_labels: Sequence[int],
    out_labels: Sequence[int],
    precision: Any,
    preferred: Any,
    out_sharding: Any = None,
) -> jax.Array:
    """``lax.dot_general`` of two labelled operands, result in ``out_labels``
    order (labels as in :func:`_contract`), with ``preferred_element_type``."""
    a_labels, b_labels, out_labels = list(a_labels), list(b_labels), list(out_labels)
    batch = [lab for lab in out_labels if lab in a_labels and lab in b_labels]
    contract = [lab for lab in a_labels if lab in b_labels and lab not in out_labels]
    dn = (
        (
            tuple(a_labels.index(lab) for lab in contract),
            tuple(b_labels.index(lab) for lab in contract),
        ),
        (
            tuple(a_labels.index(lab) for lab in batch),
            tuple(b_labels.index(lab) for lab in batch),
        ),
    )
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    out = lax.dot_general(
        a, b, dn, precision=precision, preferred_element_type=preferred, **kw
    )
    res = [
        *batch,
        *(lab for lab in a_labels if lab not in batch and lab not in contract),
        *(lab for lab in b_labels if lab not in batch and lab not in contract),
    ]
    perm = tuple(res.index(lab) for lab in out_labels)
    return out if perm == tuple(range(out.ndim)) else lax.transpose(out, perm)


def _contract(
    a: jax.Array,
    a_labels: Sequence[int],
    b: jax.Array,
    b_labels: Sequence[int],
    out_labels: Sequence[int],
    precision: Any,
    acc_dtype: np.dtype,
    native: bool = True,
    pinned: tuple[bool, bool] = (False, False),
) -> jax.Array:
    """An einsum of two operands as one canonical matmul, result in ``acc_dtype``.

    Each dimension carries a label. Labels in ``a``, ``b`` and the output are
    batch dimensions, labels in ``a`` and ``b`` only are contracted, and labels in
    one operand and the output are free. The operands are laid out as
    ``(batch, m, k)`` and ``(batch, k, n)`` (groups merged into one dimension,
    the batch dimension dropped when there is none) with real row-major copies
    where a transpose is needed, so that XLA:CPU sees the one layout its bf16
    kernels take. The free dimensions are ordered (and the two operands swapped
    when that helps) so that the result comes out in ``out_labels`` order with no
    transpose after the dot: XLA folds a transpose of a dot's result back into
    the dot, which undoes the canonical layout.
    """
    a_labels, b_labels, out_labels = list(a_labels), list(b_labels), list(out_labels)
    sizes = dict(zip(a_labels, a.shape, strict=True))
    sizes.update(zip(b_labels, b.shape, strict=True))
    a_set, b_set, out_set = set(a_labels), set(b_labels), set(out_labels)
    batch = [lab for lab in out_labels if lab in a_set and lab in b_set]
    contract = [lab for lab in a_labels if lab in b_set and lab not in out_set]
    a_free = [lab for lab in out_labels if lab in a_set and lab not in b_set]
    b_free = [lab for lab in out_labels if lab in b_set and lab not in a_set]
    nb = len(batch)
    rest = out_labels[nb:]
    if out_labels[:nb] == batch and rest == [*b_free, *a_free] and a_free:
        # The output wants b's free dimensions first: compute b . a.
        a, a_labels, b, b_labels = b, b_labels, a, a_labels
        a_free, b_free = b_free, a_free
        pinned = (pinned[1], pinned[0])
        if isinstance(precision, tuple):
            precision = precision[::-1]
    if not all(isinstance(d, int) for d in sizes.values()):
        # Symbolic dimensions (``jax.export`` with a polymorphic batch): the
        # canonical layout needs concrete sizes; the rounded operands give the
        # same numbers through a float32 dot.
        native = False
    mm_labels = [*batch, *a_free, *b_free]
    bshape = [sizes[lab] for lab in batch]
    mshape = [sizes[lab] for lab in a_free]
    nshape = [sizes[lab] for lab in b_free]
    m = n = k = 0
    if native:
        m, n = math.prod(mshape), math.prod(nshape)
        k = math.prod(sizes[lab] for lab in contract)
        native = min(m, n) > 1 and max(m, n, k) >= _MIN_NATIVE_DIM
    if not native:
        # float16, matrix-vector and tiny products have no low-precision kernel
        # on XLA:CPU (they run in float32 either way): skip the layout work.
        return _upcast_contract(
            a,
            a_labels,
            b,
            b_labels,
            out_labels,
            batch,
            contract,
            precision,
            acc_dtype,
        )
    a_c = _materialized_transpose(
        a, [a_labels.index(lab) for lab in [*batch, *a_free, *contract]]
    )
    # The rhs may be (batch, k, n) or (batch, n, k): both run natively, so a
    # transpose is only materialised when the rhs is in neither order.
    b_nk = b_labels == [*batch, *b_free, *contract]
    if not b_nk:
        b_c = _materialized_transpose(
            b, [b_labels.index(lab) for lab in [*batch, *contract, *b_free]]
        )
    else:
        b_c = b
    lead = (math.prod(bshape),) if batch else ()
    nl = len(lead)
    a_c = a_c.reshape(*lead, m, k)
    b_c = b_c.reshape(*lead, n, k) if b_nk else b_c.reshape(*lead, k, n)
    dims: _DimNums = (
        ((nl + 1,), (nl + 1 if b_nk else nl,)),
        ((0,), (0,)) if batch else ((), ()),
    )
    # The barriers keep XLA's algebraic simplifier from folding transposes (of
    # the operands, or of the result, e.g. the user's ``y.T``) back into the dot
    # after XLA:CPU has decided to run it in bf16: a folded, non-canonical
    # bf16 x bf16 -> f32 dot has no kernel in jaxlib 0.10.2 and fails at run time
    # with ``Unsupported element type for DotThunk::Execute``. A pinned operand
    # used as it is already sits behind a barrier shared by its products.
    a_c, b_c = (
        x if pin and x is orig else lax.optimization_barrier(x)
        for x, orig, pin in ((a_c, a, pinned[0]), (b_c, b, pinned[1]))
    )
    out = lax.dot_general(
        a_c, b_c, dims, precision=precision, preferred_element_type=acc_dtype
    )
    out = lax.optimization_barrier(out)
    out = out.reshape(*bshape, *mshape, *nshape)
    return _materialized_transpose(out, [mm_labels.index(lab) for lab in out_labels])


def _dot_labels(
    lhs_ndim: int, rhs_ndim: int, dn: _DimNums
) -> tuple[list[int], list[int], list[int]]:
    """Labels of the lhs, rhs and output dimensions of ``dot_general``."""
    (lc, rc), (lb, rb) = dn
    lhs_labels = list(range(lhs_ndim))
    rhs_labels = [lhs_ndim + i for i in range(rhs_ndim)]
    for l_dim, r_dim in zip((*lc, *lb), (*rc, *rb), strict=True):
        rhs_labels[r_dim] = lhs_labels[l_dim]
    lf = _free_dims(lhs_ndim, lc, lb)
    rf = _free_dims(rhs_ndim, rc, rb)
    out_labels = [
        *(lhs_labels[d] for d in lb),
        *(lhs_labels[d] for d in lf),
        *(rhs_labels[d] for d in rf),
    ]
    return lhs_labels, rhs_labels, out_labels


def _canonical_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    dn: _DimNums,
    precision: Any,
    acc_dtype: np.dtype,
    native: bool = True,
    pinned: tuple[bool, bool] = (False, False),
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dn)`` through :func:`_contract`."""
    lhs_labels, rhs_labels, out_labels = _dot_labels(lhs.ndim, rhs.ndim, dn)
    return _contract(
        lhs, lhs_labels, rhs, rhs_labels, out_labels, precision, acc_dtype, native,
        pinned,
    )  # fmt: skip


def _canonical_dot_vjp(
    g: jax.Array,
    lhs: jax.Array,
    rhs: jax.Array,
    dn: _DimNums,
    precision: Any,
    acc_dtype: np.dtype,
    native: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Cotangents of ``lhs`` and ``rhs`` for the output cotangent ``g``."""
    lhs_labels, rhs_labels, out_labels = _dot_labels(lhs.ndim, rhs.ndim, dn)
    args = (precision, acc_dtype, native)
    d_lhs = _contract(g, out_labels, rhs, rhs_labels, lhs_labels, *args)
    d_rhs = _contract(g, out_labels, lhs, lhs_labels, rhs_labels, *args)
    return d_lhs, d_rhs


# --- the products, per platform --------------------------------------------


class _Plan(NamedTuple):
    """How one product is computed (static: a custom derivative's
    non-differentiable argument)."""

    dn: _DimNums
    precision: Any
    low: np.dtype
    cpu: str  # "native", "emulated" or "upcast": the CPU formulation
    f32_out: bool  # the caller keeps a float32 result: accumulate in float32
    # The dtype the GEMM writes its result in, when the communication policy
    # says (its gradient reduction dtype); None: the formulation's own.
    emit: np.dtype | None = None
    # The dtype the backward GEMMs write a float32 operand's cotangent in
    # (the gradient of a parameter); None: float32.
    reduce: np.dtype | None = None


class Rounded(NamedTuple):
    """An input of the function (a parameter) rounded once for all the products
    that read it (:func:`rounded`).

    Under a sharded parameter (FSDP) the partitioner gathers a value where a
    product needs it whole, once per value: every product, forward and
    backward, on every platform, reads these fields as they are, so each
    parameter is gathered once, and in ``low`` where the GEMM takes 16 bits.

    Attributes:
        low: the rounded parameter; on CPU behind an optimization barrier of
            its own, so that the canonical layout needs no barrier per product.
        wide: its float32 copy for the CPU's emulated formulation (float32
            GEMMs on rounded operands), made once; ``None`` otherwise. JAX
            lowers the widening before the dot, so the partitioner gathers
            this copy, in float32.
    """

    low: jax.Array
    wide: jax.Array | None = None


def _identity(x: jax.Array) -> jax.Array:
    return x


def _round_once(x: jax.Array, low: np.dtype, cpu: str, platform: str | None) -> Rounded:
    x_low = x.astype(low)
    pinned = per_platform(
        (x_low,), platform=platform, cpu=lax.optimization_barrier, default=_identity
    )
    wide = None
    if cpu == "emulated" and platform in (None, "cpu"):
        # Outside the platform branch: one copy for every product (off CPU it
        # has no reader and XLA drops it).
        wide = pinned.astype(_F32)
    return Rounded(pinned, wide)


def rounded(
    x: ArrayLike,
    low_dtype: DTypeLike,
    *,
    platform: str | None = None,
    cpu_bf16: str | None = None,
) -> Rounded:
    """``x`` rounded to ``low_dtype`` once, for every :func:`wide_dot_general`
    that reads it (pass the :class:`Rounded` as its operand).

    Examples:
      >>> import jax.numpy as jnp
      >>> r = rounded(jnp.ones((3, 4)), jnp.bfloat16, platform="cpu",
      ...             cpu_bf16="emulated")
      >>> r.low.dtype, r.wide.dtype
      (dtype(bfloat16), dtype('float32'))
    """
    low = np.dtype(low_dtype)
    plat = canonical_platform(platform)
    return _round_once(jnp.asarray(x), low, _cpu_kind(low, cpu_bf16), plat)


def _value(x: Any) -> jax.Array:
    return x.low if isinstance(x, Rounded) else x


def _cpu_forward(
    plan: _Plan, pinned: tuple[bool, bool], lhs: Rounded, rhs: Rounded
) -> jax.Array:
    """The float32 product of rounded operands on CPU."""
    if plan.cpu == "emulated":
        a, b = (x.low if x.wide is None else x.wide for x in (lhs, rhs))
        return _rounded_f32_dot(a, b, plan.dn, plan.precision, plan.emit)
    return _canonical_dot(
        lhs.low, rhs.low, plan.dn, plan.precision, plan.emit or _F32,
        plan.cpu == "native", pinned,
    ).astype(_F32)  # fmt: skip


def _accelerator_forward(plan: _Plan, lhs: Rounded, rhs: Rounded) -> jax.Array:
    """``low x low -> low`` (cuBLAS and the TPU MXU accumulate in float32),
    widened to float32: the same numbers, for one result type per platform;
    ``low x low -> float32`` when the caller keeps a float32 result."""
    out = lax.dot_general(
        lhs.low,
        rhs.low,
        plan.dn,
        precision=plan.precision,
        preferred_element_type=_accelerator_emit(plan),
    )
    return out.astype(_F32)


def _accelerator_emit(plan: _Plan) -> np.dtype | None:
    if plan.emit is not None:
        return plan.emit
    return _F32 if plan.f32_out else None


def _forward(plan: _Plan, platform: str | None, lhs: Any, rhs: Any) -> jax.Array:
    # Only what differs per platform is inside the branches: a rounding or a
    # copy made there is made per product, and gathered per product.
    pinned = (isinstance(lhs, Rounded), isinstance(rhs, Rounded))
    lhs, rhs = (
        x if isinstance(x, Rounded) else Rounded(x.astype(plan.low)) for x in (lhs, rhs)
    )
    return per_platform(
        (lhs, rhs),
        platform=platform,
        cpu=ft.partial(_cpu_forward, plan, pinned),
        default=ft.partial(_accelerator_forward, plan),
    )


def _rounded_f32_dot(
    lhs_l: jax.Array,
    rhs_l: jax.Array,
    dn: _DimNums,
    precision: Any,
    emit: np.dtype | None = None,
) -> jax.Array:
    """The product of low-precision operands as one float32 ``dot_general``
    (its result written in ``emit`` when given), in float32."""
    return lax.dot_general(
        lhs_l.astype(_F32),
        rhs_l.astype(_F32),
        dn,
        precision=precision,
        preferred_element_type=emit,
    ).astype(_F32)


# An operand's (ndim, dtype): static, for the cotangent it gets back.
_Meta = tuple[int, np.dtype]


def _cotangent_dtype(plan: _Plan, dtype: np.dtype) -> np.dtype:
    """The dtype a backward GEMM writes an operand's cotangent in: a float32
    operand's (a parameter's gradient) in the policy's reduce dtype, where a
    partitioner reduces it across devices; others in their own dtype."""
    if plan.reduce is not None and np.dtype(dtype).itemsize >= 4:
        return plan.reduce
    return np.dtype(dtype)


def _cotangents(
    plan: _Plan,
    g: jax.Array,
    kept_lhs: jax.Array | None,
    kept_rhs: jax.Array | None,
    lhs_meta: _Meta,
    rhs_meta: _Meta,
    *,
    low_inputs: bool,
    contract: Any,
) -> tuple[jax.Array | None, jax.Array | None]:
    """``d_lhs = g . rhs`` and ``d_rhs = g . lhs`` (``None`` where the other
    operand was not kept: its cotangent is not needed). ``contract(a,
    a_labels, b, b_labels, out_labels, out_dtype, side)`` computes one
    product; ``side`` is the operand ``b`` was (0: lhs, 1: rhs)."""
    (lhs_ndim, lhs_dtype), (rhs_ndim, rhs_dtype) = lhs_meta, rhs_meta
    lhs_labels, rhs_labels, out_labels = _dot_labels(lhs_ndim, rhs_ndim, plan.dn)
    cast = plan.low if low_inputs else _F32
    g = g.astype(cast)
    d_lhs = d_rhs = None
    if kept_rhs is not None:
        d_lhs = contract(
            g, out_labels, kept_rhs.astype(cast), rhs_labels, lhs_labels,
            _cotangent_dtype(plan, lhs_dtype), 1,
        ).astype(lhs_dtype)  # fmt: skip
    if kept_lhs is not None:
        d_rhs = contract(
            g, out_labels, kept_lhs.astype(cast), lhs_labels, rhs_labels,
            _cotangent_dtype(plan, rhs_dtype), 0,
        ).astype(rhs_dtype)  # fmt: skip
    return d_lhs, d_rhs


def _cpu_backward(plan, lhs_meta, rhs_meta, alive, g, kept_lhs, kept_rhs):
    # native: bfloat16 x bfloat16 -> float32 GEMMs in the canonical layout.
    # emulated: plain float32 dots (no canonical layout), the transposes JAX
    # would emit for a float32 dot; the cotangent is not rounded: that would
    # cost a pass and buy no speed. float16 (no native kernel): rounded
    # operands, float32 accumulation.
    native = plan.cpu == "native"

    def contract(a, a_labels, b, b_labels, out_labels, out_dtype, side):
        # float32 accumulators, written narrower only for a parameter's
        # gradient under a narrower reduce dtype. A kept parameter is the
        # forward's pinned rounding: read as it is.
        acc = out_dtype if out_dtype == plan.reduce else _F32
        return _contract(
            a, a_labels, b, b_labels, out_labels, plan.precision, acc, native,
            (False, alive[side]),
        ).astype(_F32)  # fmt: skip

    return _cotangents(
        plan, g, kept_lhs, kept_rhs, lhs_meta, rhs_meta,
        low_inputs=plan.cpu != "emulated", contract=contract,
    )  # fmt: skip


def _accelerator_backward(plan, lhs_meta, rhs_meta, g, kept_lhs, kept_rhs):
    # 16-bit GEMMs. A cotangent for a float32 operand (a master weight) comes
    # out of the GEMM in float32 (accumulated there, never rounded to 16
    # bits); one for a 16-bit operand (an activation) in 16 bits.
    def contract(a, a_labels, b, b_labels, out_labels, out_dtype, side):
        del side
        out_dtype = np.dtype(out_dtype)
        preferred = out_dtype if out_dtype != plan.low else None
        return labeled_dot(
            a, a_labels, b, b_labels, out_labels, plan.precision, preferred
        )

    return _cotangents(
        plan, g, kept_lhs, kept_rhs, lhs_meta, rhs_meta,
        low_inputs=True, contract=contract,
    )  # fmt: skip


@ft.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _low_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    plan: _Plan,
    platform: str | None,
    lhs_meta: _Meta,
    rhs_meta: _Meta,
    alive: tuple[bool, bool],
) -> jax.Array:
    del lhs_meta, rhs_meta
    return _forward(plan, platform, *_operands(plan, platform, alive, lhs, rhs))


def _operands(
    plan: _Plan, platform: str | None, alive: tuple[bool, bool], *xs: jax.Array
) -> list[Any]:
    """Each operand rounded for the forward product: an input of the function
    (``alive``, a parameter) as a :class:`Rounded` that the backward pass
    reuses, anything else (an activation) plainly."""
    return [
        _round_once(x, plan.low, plan.cpu, platform) if a else x.astype(plan.low)
        for x, a in zip(xs, alive, strict=True)
    ]


def _low_dot_fwd(lhs, rhs, plan, platform, lhs_meta, rhs_meta, alive):
    # Symbolic zeros: `lhs` and `rhs` come with `.perturbed`, so an operand is
    # kept only when the other one's cotangent is needed (as JAX does for its
    # own dots: the first layer's weight is not kept for the input's gradient).
    # What is kept is the rounding the forward product read, parameters
    # included: one rounded (and, sharded, one gathered) copy for both passes,
    # as hand-written 16-bit code keeps; the backward pass never rounds again.
    del lhs_meta, rhs_meta
    ops = _operands(plan, platform, alive, lhs.value, rhs.value)
    res = _forward(plan, platform, *ops)
    keep_lhs, keep_rhs = (_value(x) for x in ops)
    return res, (
        keep_lhs if rhs.perturbed else None,
        keep_rhs if lhs.perturbed else None,
    )


def _low_dot_bwd(plan, platform, lhs_meta, rhs_meta, alive, residuals, g):
    kept_lhs, kept_rhs = residuals
    if _compat.is_symbolic_zero(g):
        return None, None
    return per_platform(
        (g, kept_lhs, kept_rhs),
        platform=platform,
        cpu=ft.partial(_cpu_backward, plan, lhs_meta, rhs_meta, alive),
        default=ft.partial(_accelerator_backward, plan, lhs_meta, rhs_meta),
    )


_low_dot.defvjp(_low_dot_fwd, _low_dot_bwd, symbolic_zeros=True)


# --- which formulation runs --------------------------------------------------


def _cpu_choice(cpu_bf16: str | None) -> str:
    if cpu_bf16 is None:
        return capability.cpu_bf16().formulation
    if cpu_bf16 not in capability.CHOICES:
        raise ValueError(
            "`dot_general(..., cpu_bf16=...)` must be one of "
            f"{', '.join(capability.CHOICES)} or None, got {cpu_bf16!r}."
        )
    return cpu_bf16


def _cpu_kind(low: np.dtype, cpu_bf16: str | None) -> str:
    """The CPU formulation for ``low``: native, emulated (bfloat16) or upcast."""
    if low != _BF16:
        return "upcast"
    return _cpu_choice(cpu_bf16)


def formulation(
    low_dtype: DTypeLike, *, platform: str | None = None, cpu_bf16: str | None = None
) -> str:
    """Which formulation :func:`dot_general` uses for ``low_dtype`` dots on
    ``platform`` (``None``: the CPU's, as a CPU lowering would).

    Args:
      low_dtype: the dtype the operands are rounded to.
      platform: ``"cpu"``, ``"gpu"``/``"cuda"``, ``"rocm"``, ``"tpu"``.
      cpu_bf16: ``"native"``, ``"emulated"`` or ``None`` (this CPU's
        capability); only consulted for bfloat16 on CPU.

    Returns:
      ``"cpu_native"`` (bfloat16 GEMMs, forward and backward),
      ``"cpu_emulated"`` (float32 GEMMs on bfloat16-rounded operands, 16-bit
      activations kept in bfloat16 for the backward pass), ``"cpu_upcast"``
      (float16 and other dtypes on CPU: float32 accumulation of the rounded
      operands), or ``"accelerator"`` (``low x low -> low``, GPU and TPU).

    Examples:
      >>> import jax.numpy as jnp
      >>> formulation(jnp.bfloat16, platform="cpu", cpu_bf16="emulated")
      'cpu_emulated'
      >>> formulation(jnp.float16, platform="cpu")
      'cpu_upcast'
      >>> formulation(jnp.bfloat16, platform="gpu")
      'accelerator'
    """
    plat = canonical_platform(platform)
    if plat not in (None, "cpu"):
        return "accelerator"
    return f"cpu_{_cpu_kind(np.dtype(low_dtype), cpu_bf16)}"


def _cpu_note(name: str, kind: str, cpu_bf16: str | None) -> str:
    if kind == "cpu_upcast":
        return (
            f"XLA:CPU has no native {name} matmul: dots take {name}-rounded "
            f"operands and accumulate in float32, so {name} gives {name} numerics "
            "and saves memory on a CPU, but no speed-up (use bfloat16 for speed)."
        )
    cap = capability.cpu_bf16()
    if cpu_bf16 is not None and cpu_bf16 != cap.formulation:
        cap = capability.Capability(cpu_bf16 == "native", "argument", cpu_bf16)
    if kind == "cpu_native":
        return (
            f"{cap.describe()} on this CPU: dots run as bfloat16 x bfloat16 "
            "-> float32 GEMMs, backward dots too (MIXPREC_CPU_BF16=emulated "
            "forces float32 GEMMs)."
        )
    return (
        f"{cap.describe()} on this CPU, where a bfloat16 GEMM is slower "
        "than a float32 one: dots run as float32 GEMMs on bfloat16-rounded "
        "operands and keep bfloat16 activations for the backward pass, i.e. "
        "bfloat16 numerics and memory at about float32's speed, no speed-up "
        "(MIXPREC_CPU_BF16=native forces bfloat16 GEMMs)."
    )


def _accelerator_note(name: str, platform: str) -> str:
    return (
        f"{platform} matmuls in {name} are native: they run {name} x {name} -> "
        f"{name} (accumulated in float32 by the hardware), backward dots too; "
        "the gradient of a float32 weight leaves its GEMM in float32."
    )


def formulation_note(
    low_dtype: DTypeLike, *, platform: str | None = None, cpu_bf16: str | None = None
) -> str:
    """One sentence for reports: does the backend have native matmuls in
    ``low_dtype``, and how are the dots computed? With ``platform=None``
    (each platform's formulation, chosen at lowering) it says both.

    Examples:
      >>> import jax.numpy as jnp
      >>> print(formulation_note(jnp.bfloat16, platform="cpu", cpu_bf16="emulated"))
      Dots: no native bfloat16 matmul ... on this CPU, where a bfloat16 GEMM ...
      >>> print(formulation_note(jnp.bfloat16, platform="cuda"))
      Dots: cuda matmuls in bfloat16 are native: ...
    """
    name = np.dtype(low_dtype).name
    plat = canonical_platform(platform)
    if plat is not None and plat != "cpu":
        return "Dots: " + _accelerator_note(name, plat)
    kind = formulation(low_dtype, platform="cpu", cpu_bf16=cpu_bf16)
    cpu = _cpu_note(name, kind, cpu_bf16)
    if plat == "cpu":
        return "Dots: " + cpu
    return (
        "Dots: formulated per platform when the computation is lowered. On CPU, "
        + cpu
        + " On GPU and TPU, "
        + _accelerator_note(name, "GPU/TPU")
    )


def dot_general(
    lhs: ArrayLike | Rounded,
    rhs: ArrayLike | Rounded,
    *,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: DTypeLike | None = None,
    low_dtype: DTypeLike,
    out_dtype: DTypeLike,
    forward_mode_ad: bool = False,
    out_sharding: Any = None,
    platform: str | None = None,
    cpu_bf16: str | None = None,
    alive: tuple[bool, bool] = (False, False),
    reduce_dtype: DTypeLike | None = None,
    gradient: bool = False,
) -> jax.Array:
    """A ``lax.dot_general`` with inputs rounded to ``low_dtype``, in ``out_dtype``.

    The platform the computation is lowered for decides how the product runs
    (see the module docstring; :mod:`~mixprec._src.autocast.platforms`): on a
    CPU with native bfloat16 matmuls ``low x low -> float32`` in one canonical
    layout; on a CPU without, float32 GEMMs on operands rounded to bfloat16;
    on GPU/TPU ``low x low -> low``. Under reverse-mode AD the product is a
    ``custom_vjp`` whose backward products are formulated the same way (16-bit
    GEMMs where those are fast); it keeps each operand for them in the low
    dtype, the very rounding the forward product read (for an operand that is
    ``alive``, a parameter, the one copy that a partitioner gathers).
    Gradients with respect to ``lhs`` and ``rhs`` come back in their own
    dtypes.

    Args:
      lhs: left operand (any floating dtype), or a parameter rounded once for
        every product that reads it (:func:`rounded`), read as it is.
      rhs: right operand, likewise.
      dimension_numbers: as for ``jax.lax.dot_general``.
      precision: as for ``jax.lax.dot_general``.
      preferred_element_type: the original equation's parameter. It is not
        used: ``out_dtype`` decides the result dtype.
      low_dtype: the dtype the operands are rounded to (``bfloat16`` or
        ``float16``).
      out_dtype: the dtype of the result.
      forward_mode_ad: if True, do not use a ``custom_vjp``, so that the result
        can be differentiated in forward mode (``jax.jvp``, ``jax.jacfwd``).
      out_sharding: passed through to ``jax.lax.dot_general`` when it
        constrains the result's sharding.
      platform: pin the formulation of one platform (``"cpu"``, ``"gpu"``/
        ``"cuda"``, ``"rocm"``, ``"tpu"``); ``None`` (default): each
        platform's, chosen when the computation is lowered.
      cpu_bf16: for bfloat16 on CPU: ``"native"`` (bfloat16 GEMMs) or
        ``"emulated"`` (float32 GEMMs on rounded operands); ``None``: what this
        CPU has (:func:`mixprec._src.autocast.capability.cpu_bf16`).
      alive: per operand, whether it is an input of the transformed function
        (a parameter): its rounding is pinned (on CPU, behind one barrier) and
        kept for the backward pass, so that both passes read one value.
      reduce_dtype: the dtype gradients are reduced in (the policy's): the
        backward products write a float32 operand's cotangent (a parameter's
        gradient) in it, and with ``gradient=True`` this product writes its
        own result in it. A partitioner sums a product's partial results
        across devices (the gradient of sharded data, a row-parallel layer)
        in the dtype its GEMM writes. ``None``: the formulation's own
        (float32 on CPU, the low dtype elsewhere unless ``out_dtype`` is
        float32).
      gradient: this product computes a gradient in a backward pass.

    Returns:
      The product, with dtype ``out_dtype``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from mixprec._src.autocast.dots import dot_general
      >>> x = jnp.ones((2, 3)); w = jnp.ones((3, 4))
      >>> y = dot_general(x, w, dimension_numbers=(((1,), (0,)), ((), ())),
      ...                 low_dtype=jnp.bfloat16, out_dtype=jnp.float32)
      >>> y.dtype, y.shape, float(y[0, 0])
      (dtype('float32'), (2, 4), 3.0)
    """
    del preferred_element_type
    return wide_dot_general(
        lhs,
        rhs,
        dimension_numbers=dimension_numbers,
        precision=precision,
        low_dtype=low_dtype,
        out_dtype=out_dtype,
        forward_mode_ad=forward_mode_ad,
        out_sharding=out_sharding,
        platform=platform,
        cpu_bf16=cpu_bf16,
        alive=alive,
        reduce_dtype=reduce_dtype,
        gradient=gradient,
    ).astype(out_dtype)


def wide_dot_general(
    lhs: ArrayLike | Rounded,
    rhs: ArrayLike | Rounded,
    *,
    dimension_numbers: Any,
    precision: Any = None,
    low_dtype: DTypeLike,
    out_dtype: DTypeLike,
    forward_mode_ad: bool = False,
    out_sharding: Any = None,
    platform: str | None = None,
    cpu_bf16: str | None = None,
    alive: tuple[bool, bool] = (False, False),
    reduce_dtype: DTypeLike | None = None,
    gradient: bool = False,
) -> jax.Array:
    """:func:`dot_general` before its result is rounded to ``out_dtype``.

    The product in float32: on CPU the float32 accumulator (which a bias add
    can use before rounding once, as a GEMM epilogue does); on GPU/TPU the
    16-bit GEMM result, widened (exact). ``out_dtype`` says what the caller
    rounds it to: a float32 result is accumulated in float32 on every
    platform.

    Examples:
      >>> import jax.numpy as jnp
      >>> x = jnp.full((2, 3), 1 / 3); w = jnp.ones((3, 4))
      >>> wide_dot_general(x, w, dimension_numbers=(((1,), (0,)), ((), ())),
      ...                  low_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16).dtype
      dtype('float32')
    """
    given = (lhs, rhs)
    lhs, rhs = (x.low if isinstance(x, Rounded) else jnp.asarray(x) for x in given)
    low, out = _check_dtypes("dot_general", low_dtype, out_dtype)
    dn = _canon_dn(dimension_numbers)
    if not (_is_float(lhs) and _is_float(rhs)):
        raise TypeError(
            "`dot_general(lhs, rhs, ...)` expects floating operands, got "
            f"{lhs.dtype} and {rhs.dtype}."
        )
    plat = canonical_platform(platform)
    kind = _cpu_kind(low, cpu_bf16)
    reduce = None if reduce_dtype is None else np.dtype(reduce_dtype)
    plan = _Plan(
        dn, precision, low, kind, out == _F32, reduce if gradient else None, reduce
    )
    if explicitly_sharded(out_sharding, lhs, rhs):
        # Explicit sharding: the reshapes of the canonical layout and the
        # custom backward would need output shardings of their own, so keep
        # JAX's formulation (and its sharding-aware transpose rules).
        return per_platform(
            (lhs, rhs),
            platform=plat,
            cpu=ft.partial(_explicit_cpu, plan, out_sharding),
            default=ft.partial(_explicit_accelerator, plan, out, out_sharding),
        )
    if forward_mode_ad:
        # A Rounded operand is read as it is, shared with the other products.
        return _forward(plan, plat, *(
            x if isinstance(x, Rounded) else v
            for x, v in zip(given, (lhs, rhs), strict=True)
        ))  # fmt: skip
    lhs_meta, rhs_meta = (lhs.ndim, lhs.dtype), (rhs.ndim, rhs.dtype)
    keep = (bool(alive[0]), bool(alive[1]))
    return _low_dot(lhs, rhs, plan, plat, lhs_meta, rhs_meta, keep)


def _explicit_cpu(plan: _Plan, out_sharding: Any, lhs: Any, rhs: Any) -> jax.Array:
    lhs_l, rhs_l = lhs.astype(plan.low), rhs.astype(plan.low)
    if plan.cpu == "emulated":
        lhs_l, rhs_l = lhs_l.astype(_F32), rhs_l.astype(_F32)
    return lax.dot_general(
        lhs_l,
        rhs_l,
        plan.dn,
        precision=plan.precision,
        preferred_element_type=plan.emit or _F32,
        out_sharding=out_sharding if _constrains(out_sharding) else None,
    ).astype(_F32)


def _explicit_accelerator(
    plan: _Plan, out: np.dtype, out_sharding: Any, lhs: Any, rhs: Any
) -> jax.Array:
    del out
    res = lax.dot_general(
        lhs.astype(plan.low),
        rhs.astype(plan.low),
        plan.dn,
        precision=plan.precision,
        preferred_element_type=_accelerator_emit(plan),
        out_sharding=out_sharding if _constrains(out_sharding) else None,
    )
    return res.astype(_F32)


def conv_note(
    low_dtype: DTypeLike, *, platform: str | None = None, cpu_bf16: str | None = None
) -> str:
    """One sentence for reports on how :func:`conv_general_dilated` runs.

    Examples:
      >>> import jax.numpy as jnp
      >>> print(conv_note(jnp.bfloat16, platform="cpu"))
      Convolutions: XLA:CPU has no bfloat16 convolution kernel: ...
    """
    del cpu_bf16  # one CPU formulation for convolutions
    name = np.dtype(low_dtype).name
    plat = canonical_platform(platform)
    accel = f"{name} x {name} -> {name}, native on GPUs and TPUs."
    cpu = (
        f"XLA:CPU has no {name} convolution kernel: convolutions take "
        f"{name}-rounded operands and accumulate in float32 ({name} numerics, "
        "float32 speed)."
    )
    if plat is None:
        return f"Convolutions, per platform: on CPU, {cpu} Elsewhere, {accel}"
    return "Convolutions: " + (cpu if plat == "cpu" else accel)


def conv_general_dilated(
    lhs: ArrayLike,
    rhs: ArrayLike,
    *,
    low_dtype: DTypeLike,
    out_dtype: DTypeLike,
    forward_mode_ad: bool = False,
    platform: str | None = None,
    **conv_params: Any,
) -> jax.Array:
    """A ``lax.conv_general_dilated`` with inputs rounded to ``low_dtype``.

    ``conv_params`` are the parameters of ``jax.lax.conv_general_dilated_p``
    as they appear in a jaxpr equation (``window_strides``, ``padding`` as
    pairs, ``lhs_dilation``, ``rhs_dilation``, ``dimension_numbers``,
    ``feature_group_count``, ``batch_group_count``, ``precision``,
    ``preferred_element_type``, ``out_sharding``). ``preferred_element_type``
    is replaced: float32 accumulation on CPU, ``low_dtype`` elsewhere.

    Args:
      lhs: input (any floating dtype).
      rhs: kernel (any floating dtype).
      low_dtype: the dtype the operands are rounded to.
      out_dtype: the dtype of the result.
      forward_mode_ad: accepted for symmetry with :func:`dot_general`; the
        convolution uses JAX's own derivative rules, which support both modes.
      platform: pin one platform's formulation; ``None`` (default): each
        platform's, chosen when the computation is lowered.
      **conv_params: the ``conv_general_dilated_p`` parameters.

    Returns:
      The convolution, with dtype ``out_dtype``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jax import lax
      >>> from mixprec._src.autocast.dots import conv_general_dilated
      >>> x = jnp.ones((1, 2, 5, 5)); k = jnp.ones((3, 2, 3, 3))
      >>> y = conv_general_dilated(
      ...     x, k, low_dtype=jnp.bfloat16, out_dtype=jnp.float32,
      ...     window_strides=(1, 1), padding=((1, 1), (1, 1)),
      ...     lhs_dilation=(1, 1), rhs_dilation=(1, 1),
      ...     dimension_numbers=lax.ConvDimensionNumbers(
      ...         (0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)),
      ...     feature_group_count=1, batch_group_count=1, precision=None,
      ...     preferred_element_type=None)
      >>> y.dtype, y.shape, float(y[0, 0, 2, 2])
      (dtype('float32'), (1, 3, 5, 5), 18.0)
    """
    del forward_mode_ad
    lhs = jnp.asarray(lhs)
    rhs = jnp.asarray(rhs)
    low, out = _check_dtypes("conv_general_dilated", low_dtype, out_dtype)
    if not (_is_float(lhs) and _is_float(rhs)):
        raise TypeError(
            "`conv_general_dilated(lhs, rhs, ...)` expects floating operands, got "
            f"{lhs.dtype} and {rhs.dtype}."
        )
    params = dict(conv_params)
    params.setdefault("out_sharding", None)

    def conv(preferred: Any, a: jax.Array, b: jax.Array) -> jax.Array:
        res = lax.conv_general_dilated_p.bind(
            a, b, **{**params, "preferred_element_type": preferred}
        )
        return res.astype(out)

    return per_platform(
        (lhs.astype(low), rhs.astype(low)),
        platform=platform,
        cpu=ft.partial(conv, _F32),
        default=ft.partial(conv, None),
    )


# --- the products as the op table sees them ------------------------------------


@dataclasses.dataclass(frozen=True)
class ProductDims:
    """The sizes of one matmul-like product (symbolic sizes count as 0).

    Attributes:
        sizes: the dimensions a float8 recipe's size rule looks at
            (``M``, ``N``, ``K`` per batch element of a matmul).
        align: the dimensions tensor cores want in multiples of 8 (16-bit)
            or 16 (8-bit).
        flops: floating-point operations of the product.
        contracting: per operand, its contracted axes (a rowwise float8
            scale is taken over them).
        report: the dimensions a report shows.
    """

    sizes: tuple[tuple[str, int], ...]
    align: tuple[tuple[str, int], ...]
    flops: int
    contracting: tuple[tuple[int, ...], tuple[int, ...]]
    report: tuple[tuple[str, int], ...]


def _static_size(shape: Sequence[Any]) -> int:
    """The product of ``shape``, or 0 if a dimension is symbolic."""
    n = 1
    for d in shape:
        if not isinstance(d, int | np.integer):
            return 0
        n *= int(d)
    return n


def dot_general_dims(
    in_shapes: Sequence[Sequence[Any]], out_shape: Sequence[Any], params: Any
) -> ProductDims:
    """:class:`ProductDims` of a ``dot_general`` equation.

    Examples:
        >>> d = dot_general_dims([(8, 784), (784, 10)], (8, 10),
        ...                      {"dimension_numbers": (((1,), (0,)), ((), ()))})
        >>> d.sizes, d.flops
        ((('M', 8), ('N', 10), ('K', 784)), 125440)
    """
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs = in_shapes
    k = _static_size([lhs[i] for i in lc])
    m = _static_size([d for i, d in enumerate(lhs) if i not in set(lc) | set(lb)])
    n = _static_size([d for i, d in enumerate(rhs) if i not in set(rc) | set(rb)])
    batch = _static_size([lhs[i] for i in lb])
    dims = (("M", m), ("N", n), ("K", k))
    return ProductDims(
        sizes=dims,
        align=dims,
        flops=2 * _static_size(out_shape) * k,
        contracting=(tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
        report=(*dims, ("batch", batch)),
    )


def conv_dims(
    in_shapes: Sequence[Sequence[Any]], out_shape: Sequence[Any], params: Any
) -> ProductDims:
    """:class:`ProductDims` of a ``conv_general_dilated`` equation: output
    positions ``M``, ``C_out`` and ``K = C_in x window`` for the size rule,
    ``C_in`` and ``C_out`` (per group) for alignment.

    Examples:
        >>> from jax import lax
        >>> dn = lax.ConvDimensionNumbers((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3))
        >>> conv_dims([(2, 16, 8, 8), (32, 16, 3, 3)], (2, 32, 8, 8),
        ...           {"dimension_numbers": dn}).align
        (('C_in', 16), ('C_out', 32))
    """
    dn = params["dimension_numbers"]
    rhs = in_shapes[1]
    rhs_spec, out_spec = tuple(dn.rhs_spec), tuple(dn.out_spec)
    c_out = _static_size([rhs[rhs_spec[0]]])
    c_in = _static_size([rhs[rhs_spec[1]]])  # already C_in / groups
    window = _static_size([rhs[i] for i in rhs_spec[2:]])
    m = _static_size([out_shape[out_spec[0]], *(out_shape[i] for i in out_spec[2:])])
    return ProductDims(
        sizes=(("M", m), ("C_out", c_out), ("K", c_in * window)),
        align=(("C_in", c_in), ("C_out", c_out)),
        flops=2 * _static_size(out_shape) * c_in * window,
        contracting=((), ()),
        report=(("C_in", c_in), ("C_out", c_out), ("window", window)),
    )


def dot_general_product(
    request: ProductRequest, lhs: Any, rhs: Any, **params: Any
) -> jax.Array:
    """A ``dot_general`` equation (``params``) run in 16 bits as ``request``
    says: the float32 product of :func:`wide_dot_general`.

    Examples:
      >>> import jax.numpy as jnp
      >>> req = ProductRequest(low_dtype=_BF16, out_dtype=_BF16, custom_vjp=True)
      >>> dot_general_product(req, jnp.ones((2, 3)), jnp.ones((3, 4)),
      ...                     dimension_numbers=(((1,), (0,)), ((), ()))).dtype
      dtype('float32')
    """
    return wide_dot_general(
        lhs,
        rhs,
        dimension_numbers=params["dimension_numbers"],
        precision=params.get("precision"),
        low_dtype=request.low_dtype,
        out_dtype=request.out_dtype,
        forward_mode_ad=not request.custom_vjp,
        out_sharding=params.get("out_sharding"),
        platform=request.platform,
        cpu_bf16=request.cpu_bf16,
        alive=request.live,
        reduce_dtype=request.reduce_dtype,
        gradient=request.gradient,
    )


def conv_product(
    request: ProductRequest, lhs: Any, rhs: Any, **params: Any
) -> jax.Array:
    """A ``conv_general_dilated`` equation (``params``) run in 16 bits, in
    float32: accumulated in float32 on CPU, the 16-bit result widened elsewhere
    (JAX's own derivative rules, in both modes). It reads the request's low
    dtype and platform."""
    return conv_general_dilated(
        _value(lhs), _value(rhs), low_dtype=request.low_dtype, out_dtype=_F32,
        platform=request.platform, **params,
    )  # fmt: skip


def ragged_dot_dims(
    in_shapes: Sequence[Sequence[Any]], out_shape: Sequence[Any], params: Any
) -> ProductDims:
    """:class:`ProductDims` of a ``ragged_dot_general`` (a grouped, MoE-style
    matmul: each row of the lhs meets the rhs matrix of its group).

    Examples:
        >>> from jax import lax
        >>> rdn = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
        >>> ragged_dot_dims([(8, 16), (2, 16, 4), (2,)], (8, 4),
        ...                 {"ragged_dot_dimension_numbers": rdn}).sizes
        (('M', 8), ('N', 4), ('K', 16))
    """
    rdn = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
    lhs, rhs = in_shapes[0], in_shapes[1]
    groups = set(rdn.rhs_group_dimensions)
    k = _static_size([lhs[i] for i in lc])
    m = _static_size([d for i, d in enumerate(lhs) if i not in set(lc) | set(lb)])
    free = set(rc) | set(rb) | groups
    n = _static_size([d for i, d in enumerate(rhs) if i not in free])
    dims = (("M", m), ("N", n), ("K", k))
    return ProductDims(
        sizes=dims,
        align=dims,
        flops=2 * _static_size(out_shape) * k,
        contracting=(tuple(int(i) for i in lc), tuple(int(i) for i in rc)),
        report=(*dims, ("groups", _static_size([rhs[i] for i in groups]))),
    )


def ragged_dot_product(
    request: ProductRequest, lhs: Any, rhs: Any, group_sizes: Any, **params: Any
) -> jax.Array:
    """A ``ragged_dot_general`` equation run in 16 bits, in float32: operands
    rounded to the request's low dtype, accumulated in float32 on CPU (XLA:CPU
    has no 16-bit grouped-matmul kernel), ``low x low -> low`` elsewhere
    (float32 when the caller keeps a float32 result); JAX's derivative rules."""
    low_dtype = request.low_dtype
    kw = {k: v for k, v in params.items() if k != "preferred_element_type"}
    if kw.get("out_sharding") is None:
        kw.pop("out_sharding", None)
    wide_out = request.out_dtype == _F32

    def run(preferred: Any, a: jax.Array, b: jax.Array, g: jax.Array) -> jax.Array:
        res = lax.ragged_dot_general(a, b, g, preferred_element_type=preferred, **kw)
        return res.astype(_F32)

    return per_platform(
        (_value(lhs).astype(low_dtype), _value(rhs).astype(low_dtype), group_sizes),
        platform=request.platform,
        cpu=ft.partial(run, _F32),
        default=ft.partial(run, _F32 if wide_out else None),
    )
