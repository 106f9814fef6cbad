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

import functools as ft
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from mixprec._src import _compat
from mixprec._src.autocast import capability


__all__ = [
    "conv_general_dilated",
    "conv_note",
    "dot_general",
    "formulation",
    "formulation_note",
]

_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)

# (lhs_contract, rhs_contract), (lhs_batch, rhs_batch), all tuples of ints.
_DimNums = tuple[
    tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]
]


def _platform(platform: str | None) -> str:
    if platform is not None:
        return platform
    return jax.default_backend()


def _explicitly_sharded(*xs: jax.Array) -> bool:
    """Whether any operand carries an explicit sharding (``AxisType.Explicit``)."""
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


def _contract(
    a: jax.Array,
    a_labels: Sequence[int],
    b: jax.Array,
    b_labels: Sequence[int],
    out_labels: Sequence[int],
    precision: Any,
    acc_dtype: np.dtype,
    native: bool = True,
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
    # with ``Unsupported element type for DotThunk::Execute``.
    a_c, b_c = lax.optimization_barrier((a_c, b_c))
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
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dn)`` through :func:`_contract`."""
    lhs_labels, rhs_labels, out_labels = _dot_labels(lhs.ndim, rhs.ndim, dn)
    return _contract(
        lhs, lhs_labels, rhs, rhs_labels, out_labels, precision, acc_dtype, native
    )


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


# --- CPU: bf16 x bf16 -> f32 forward and backward ------------------------------


@ft.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _cpu_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    dn: _DimNums,
    precision: Any,
    low: np.dtype,
    out: np.dtype,
    lhs_dtype: np.dtype,
    rhs_dtype: np.dtype,
) -> jax.Array:
    del lhs_dtype, rhs_dtype
    lhs_l, rhs_l = lhs.astype(low), rhs.astype(low)
    return _canonical_dot(lhs_l, rhs_l, dn, precision, _F32, low == _BF16).astype(out)


def _cpu_dot_fwd(lhs, rhs, dn, precision, low, out, lhs_dtype, rhs_dtype):
    del lhs_dtype, rhs_dtype
    lhs_l, rhs_l = lhs.astype(low), rhs.astype(low)
    res = _canonical_dot(lhs_l, rhs_l, dn, precision, _F32, low == _BF16)
    return res.astype(out), (lhs_l, rhs_l)


def _cpu_dot_bwd(dn, precision, low, out, lhs_dtype, rhs_dtype, residuals, g):
    del out
    lhs_l, rhs_l = residuals
    g_l = g.astype(low)
    d_lhs, d_rhs = _canonical_dot_vjp(
        g_l, lhs_l, rhs_l, dn, precision, _F32, low == _BF16
    )
    return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)


_cpu_dot.defvjp(_cpu_dot_fwd, _cpu_dot_bwd)


# --- CPU without native bf16: float32 GEMMs on bf16-rounded operands ----------


def _rounded_f32_dot(
    lhs_l: jax.Array, rhs_l: jax.Array, dn: _DimNums, precision: Any
) -> jax.Array:
    """The product of low-precision operands as one float32 ``dot_general``."""
    return lax.dot_general(
        lhs_l.astype(_F32), rhs_l.astype(_F32), dn, precision=precision
    )


# An operand's (ndim, dtype): static, for the cotangent it gets back.
_Meta = tuple[int, np.dtype]


@ft.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _cpu_dot_emulated(
    lhs: jax.Array,
    rhs: jax.Array,
    dn: _DimNums,
    precision: Any,
    low: np.dtype,
    out: np.dtype,
    lhs_meta: _Meta,
    rhs_meta: _Meta,
) -> jax.Array:
    del lhs_meta, rhs_meta
    return _rounded_f32_dot(lhs.astype(low), rhs.astype(low), dn, precision).astype(out)


def _saved(x: jax.Array, x_low: jax.Array) -> jax.Array:
    """What the emulated dot keeps of one operand for the backward pass.

    A float32 operand is kept as it is: it is usually a parameter, which the
    caller holds anyway, so keeping it costs nothing, while a bfloat16 copy
    would be new memory (and one more rounding pass). An operand that arrives
    in 16 bits (an activation under autocast) is kept in bfloat16.
    """
    return x if x.dtype.itemsize > x_low.dtype.itemsize else x_low


def _cpu_dot_emulated_fwd(lhs, rhs, dn, precision, low, out, lhs_meta, rhs_meta):
    # Symbolic zeros: `lhs` and `rhs` come with `.perturbed`, so an operand is
    # kept only when the other one's cotangent is needed (as JAX does for its
    # own dots: the first layer's weight is not kept for the input's gradient).
    del lhs_meta, rhs_meta
    lhs_l, rhs_l = lhs.value.astype(low), rhs.value.astype(low)
    res = _rounded_f32_dot(lhs_l, rhs_l, dn, precision)
    keep_lhs = _saved(lhs.value, lhs_l) if rhs.perturbed else None
    keep_rhs = _saved(rhs.value, rhs_l) if lhs.perturbed else None
    return res.astype(out), (keep_lhs, keep_rhs)


def _cpu_dot_emulated_bwd(dn, precision, low, out, lhs_meta, rhs_meta, residuals, g):
    del low, out
    kept_lhs, kept_rhs = residuals
    if _compat.is_symbolic_zero(g):
        return None, None
    (lhs_ndim, lhs_dtype), (rhs_ndim, rhs_dtype) = lhs_meta, rhs_meta
    lhs_labels, rhs_labels, out_labels = _dot_labels(lhs_ndim, rhs_ndim, dn)
    # Plain float32 dots (no canonical layout): the transposes JAX would emit
    # for a float32 dot. The cotangent and the float32 operands kept as they
    # are are not rounded: that would cost passes and buy no speed here.
    args = (precision, _F32, False)
    g = g.astype(_F32)
    d_lhs = d_rhs = None
    if kept_rhs is not None:
        rhs_f = kept_rhs.astype(_F32)
        d_lhs = _contract(g, out_labels, rhs_f, rhs_labels, lhs_labels, *args)
        d_lhs = d_lhs.astype(lhs_dtype)
    if kept_lhs is not None:
        lhs_f = kept_lhs.astype(_F32)
        d_rhs = _contract(g, out_labels, lhs_f, lhs_labels, rhs_labels, *args)
        d_rhs = d_rhs.astype(rhs_dtype)
    return d_lhs, d_rhs


_cpu_dot_emulated.defvjp(
    _cpu_dot_emulated_fwd, _cpu_dot_emulated_bwd, symbolic_zeros=True
)


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


def formulation(
    low_dtype: DTypeLike, *, platform: str | None = None, cpu_bf16: str | None = None
) -> str:
    """Which formulation :func:`dot_general` uses for ``low_dtype`` dots.

    Args:
      low_dtype: the dtype the operands are rounded to.
      platform: the backend (default: JAX's default backend).
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
    if _platform(platform) != "cpu":
        return "accelerator"
    if np.dtype(low_dtype) != _BF16:
        return "cpu_upcast"
    return f"cpu_{_cpu_choice(cpu_bf16)}"


def formulation_note(
    low_dtype: DTypeLike, *, platform: str | None = None, cpu_bf16: str | None = None
) -> str:
    """One sentence for reports: does the backend have native matmuls in
    ``low_dtype``, and how are the dots computed?

    Examples:
      >>> import jax.numpy as jnp
      >>> print(formulation_note(jnp.bfloat16, platform="cpu", cpu_bf16="emulated"))
      Dots: no native bfloat16 matmul ... on this CPU, where a bfloat16 GEMM ...
    """
    kind = formulation(low_dtype, platform=platform, cpu_bf16=cpu_bf16)
    name = np.dtype(low_dtype).name
    if kind == "accelerator":
        return (
            f"Dots: {_platform(platform)} matmuls in {name} are native: they run "
            f"{name} x {name} -> {name} (accumulated in float32 by the hardware), "
            "backward dots too."
        )
    if kind == "cpu_upcast":
        return (
            f"Dots: XLA:CPU has no native {name} matmul: dots take {name}-rounded "
            f"operands and accumulate in float32, so {name} gives {name} numerics "
            "and saves memory on a CPU, but no speed-up (use bfloat16 for speed)."
        )
    cap = capability.cpu_bf16()
    if cpu_bf16 is not None and cpu_bf16 != cap.formulation:
        cap = capability.Capability(cpu_bf16 == "native", "argument", cpu_bf16)
    if kind == "cpu_native":
        return (
            f"Dots: {cap.describe()} on this CPU: dots run as bfloat16 x bfloat16 "
            "-> float32 GEMMs, backward dots too (MIXPREC_CPU_BF16=emulated "
            "forces float32 GEMMs)."
        )
    return (
        f"Dots: {cap.describe()} on this CPU, where a bfloat16 GEMM is slower "
        "than a float32 one: dots run as float32 GEMMs on bfloat16-rounded "
        "operands and keep bfloat16 activations for the backward pass, i.e. "
        "bfloat16 numerics and memory at about float32's speed, no speed-up "
        "(MIXPREC_CPU_BF16=native forces bfloat16 GEMMs)."
    )


def dot_general(
    lhs: ArrayLike,
    rhs: ArrayLike,
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
) -> jax.Array:
    """A ``lax.dot_general`` with inputs rounded to ``low_dtype``, in ``out_dtype``.

    The backend decides how the product runs (see the module docstring): on a
    CPU with native bfloat16 matmuls ``low x low -> float32`` with
    low-precision backward dots through a ``custom_vjp``; on a CPU without,
    float32 GEMMs on operands rounded to bfloat16, keeping 16-bit activations
    in bfloat16 for the backward pass; on GPU/TPU ``low x low -> low``.
    Gradients with respect to ``lhs`` and ``rhs`` come back in their own
    dtypes.

    Args:
      lhs: left operand (any floating dtype).
      rhs: right operand (any floating dtype).
      dimension_numbers: as for ``jax.lax.dot_general``.
      precision: as for ``jax.lax.dot_general``.
      preferred_element_type: the original equation's parameter. It is not
        used: ``out_dtype`` decides the result dtype, and the product itself
        is float32 on CPU and ``low_dtype`` (accumulated in float32 by the
        hardware) on GPU/TPU.
      low_dtype: the dtype the operands are rounded to (``bfloat16`` or
        ``float16``).
      out_dtype: the dtype of the result.
      forward_mode_ad: if True, do not use a ``custom_vjp``, so that the result
        can be differentiated in forward mode (``jax.jvp``, ``jax.jacfwd``).
      out_sharding: passed through to ``jax.lax.dot_general`` when not None.
      platform: the backend to formulate for (``"cpu"``, ``"gpu"``, ``"tpu"``);
        defaults to ``jax.default_backend()``.
      cpu_bf16: for bfloat16 on CPU: ``"native"`` (bfloat16 GEMMs) or
        ``"emulated"`` (float32 GEMMs on rounded operands); ``None``: what this
        CPU has (:func:`mixprec._src.autocast.capability.cpu_bf16`).

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
    lhs = jnp.asarray(lhs)
    rhs = jnp.asarray(rhs)
    low, out = _check_dtypes("dot_general", low_dtype, out_dtype)
    dn = _canon_dn(dimension_numbers)
    if not (_is_float(lhs) and _is_float(rhs)):
        raise TypeError(
            "`dot_general(lhs, rhs, ...)` expects floating operands, got "
            f"{lhs.dtype} and {rhs.dtype}."
        )
    plat = _platform(platform)
    emulated = formulation(low, platform=plat, cpu_bf16=cpu_bf16) == "cpu_emulated"
    if out_sharding is not None or _explicitly_sharded(lhs, rhs):
        # Explicit sharding: the reshapes of the canonical layout and the
        # custom backward would need output shardings of their own, so keep
        # JAX's formulation (and its sharding-aware transpose rules).
        lhs_l, rhs_l = lhs.astype(low), rhs.astype(low)
        if emulated:
            lhs_l, rhs_l = lhs_l.astype(_F32), rhs_l.astype(_F32)
        res = lax.dot_general(
            lhs_l,
            rhs_l,
            dn,
            precision=precision,
            preferred_element_type=_F32,
            out_sharding=out_sharding,
        )
        return res.astype(out)
    if plat != "cpu":
        res = lax.dot_general(lhs.astype(low), rhs.astype(low), dn, precision=precision)
        return res.astype(out)
    if emulated:
        if forward_mode_ad:
            res = _rounded_f32_dot(lhs.astype(low), rhs.astype(low), dn, precision)
            return res.astype(out)
        return _cpu_dot_emulated(
            lhs,
            rhs,
            dn,
            precision,
            low,
            out,
            (lhs.ndim, lhs.dtype),
            (rhs.ndim, rhs.dtype),
        )
    if forward_mode_ad:
        lhs_l, rhs_l = lhs.astype(low), rhs.astype(low)
        res = _canonical_dot(lhs_l, rhs_l, dn, precision, _F32, low == _BF16)
        return res.astype(out)
    return _cpu_dot(lhs, rhs, dn, precision, low, out, lhs.dtype, rhs.dtype)


def conv_note(low_dtype: DTypeLike, *, platform: str | None = None) -> str:
    """One sentence for reports on how :func:`conv_general_dilated` runs.

    Examples:
      >>> import jax.numpy as jnp
      >>> print(conv_note(jnp.bfloat16, platform="cpu"))
      Convolutions: XLA:CPU has no bfloat16 convolution kernel: ...
    """
    name = np.dtype(low_dtype).name
    if _platform(platform) != "cpu":
        return f"Convolutions: {name} x {name} -> {name}, native on this backend."
    return (
        f"Convolutions: XLA:CPU has no {name} convolution kernel: convolutions "
        f"take {name}-rounded operands and accumulate in float32 ({name} "
        "numerics, float32 speed)."
    )


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
      platform: the backend to formulate for; defaults to
        ``jax.default_backend()``.
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
    plat = _platform(platform)
    params["preferred_element_type"] = _F32 if plat == "cpu" else None
    res = lax.conv_general_dilated_p.bind(lhs.astype(low), rhs.astype(low), **params)
    return res.astype(out)
