"""What a matmul-like product is asked to compute: one value, decided once.

:func:`~mixprec._src.autocast.decide.product_request` fills in a
:class:`ProductRequest` from an equation's decision
(:class:`~mixprec._src.autocast.decide.Decision`) and the facts of the walk;
the product rule hands it, as one argument, to the formulation of the op's
table entry (``Product.low`` in :mod:`~mixprec._src.autocast.dots`,
``Product.float8`` in :mod:`~mixprec._src.autocast.float8_dots`), which reads
it and decides nothing. A feature that changes how products run is a field
here, filled in by ``decide.py``, not one more keyword argument of every
formulation.

This module depends on nothing of autocast, so that the formulations (which the
op table imports) and ``decide.py`` (which imports the op table) can both
import it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mixprec._src import float8 as f8


__all__ = ["ProductRequest"]


@dataclasses.dataclass(frozen=True)
class ProductRequest:
    """How one matmul-like product runs.

    Every formulation returns the product in float32; the product rule rounds
    it to ``out_dtype`` (or keeps it for a bias add that follows).

    Attributes:
        low_dtype: the dtype the operands are rounded to (16-bit); under float8,
            the dtype of the residuals a recipe re-quantizes and of tangents.
        out_dtype: the dtype the result is rounded to (a float32 result is
            accumulated in float32 on every platform).
        reduce_dtype: the dtype the policy reduces gradients in, where it
            applies to this product (the backward products write a float32
            operand's cotangent, a parameter's gradient, in it); ``None``:
            float32 cotangents, the formulation's own result dtype.
        gradient: the product itself computes a gradient in a backward pass:
            its GEMM writes its result in ``reduce_dtype``.
        live: per operand, whether it is an input of the transformed function
            (a parameter): its rounding is pinned and kept for the backward
            pass, so that both passes read one value.
        shared: per operand, whether the product rule rounds it once per walk
            for every product that reads it
            (:func:`~mixprec._src.autocast.dots.rounded`).
        custom_vjp: formulate the product as a ``jax.custom_vjp`` (reverse-mode
            AD) rather than in a form ``jax.jvp`` goes through.
        platform: the one platform whose formulation is used, or ``None``:
            each platform's, chosen when the computation is lowered.
        cpu_bf16: the CPU formulation of bfloat16 products (``"native"`` or
            ``"emulated"``; ``None``: this CPU's).
        recipe: the :class:`~mixprec.Float8Recipe` of a product decided float8
            (``None``: the product runs in ``low_dtype``).
        formats: under float8, each operand's float8 format (the recipe's
            format for its role).
        gradients: under float8, which operands are gradients: they take the
            recipe's gradient format and scales
            (:meth:`~mixprec.Float8Recipe.scale_axes`).

    Examples:
        >>> bf16 = np.dtype("bfloat16")
        >>> r = ProductRequest(low_dtype=bf16, out_dtype=bf16)
        >>> r.is_float8, r.live
        (False, (False, False))
    """

    low_dtype: np.dtype
    out_dtype: np.dtype
    reduce_dtype: np.dtype | None = None
    gradient: bool = False
    live: tuple[bool, bool] = (False, False)
    shared: tuple[bool, bool] = (False, False)
    custom_vjp: bool = False
    platform: str | None = None
    cpu_bf16: str | None = None
    recipe: f8.Float8Recipe | None = None
    formats: tuple[np.dtype, np.dtype] | None = None
    gradients: tuple[bool, bool] = (False, False)

    @property
    def is_float8(self) -> bool:
        """Whether the product runs in float8."""
        return self.recipe is not None
