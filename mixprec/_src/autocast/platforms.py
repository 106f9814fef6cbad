"""Formulations per platform, chosen when a computation is lowered.

What runs fast (and what runs at all) differs between XLA's backends: XLA:CPU
has bfloat16 GEMMs only in one layout and only on some CPUs, and no float8
GEMM; cuBLASLt takes float8 operands directly. autocast therefore writes a
product once per platform and lets JAX pick when it lowers the computation
(``lax.platform_dependent``), not when Python traces it: the same traced
function, jitted on a GPU or exported for ``cuda`` from a CPU host
(``jax.export(..., platforms=["cuda"])``), gets the GPU formulation, and a
multi-platform export (``platforms=["cpu", "cuda"]``) carries each. A host's
CPU features only ever shape the CPU branch.

:func:`per_platform` is the one hook: a formulation is a default function and
optional overrides for ``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``. A
configuration may pin a platform (``CastConfig.platform``), which calls that
platform's function directly (tests, and users who know where they run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from jax import lax


__all__ = ["PLATFORMS", "canonical_platform", "per_platform"]

#: The platforms a formulation may override.
PLATFORMS: Final = ("cpu", "cuda", "rocm", "tpu")
# `jax.default_backend()` says "gpu" for CUDA and ROCm alike.
_ALIASES: Final = {"gpu": "cuda"}


def canonical_platform(platform: str | None) -> str | None:
    """A platform name as :func:`per_platform` takes it (``"gpu"``: ``"cuda"``).

    Raises:
        ValueError: an unknown platform.

    Examples:
        >>> canonical_platform("gpu"), canonical_platform(None)
        ('cuda', None)
    """
    if platform is None:
        return None
    name = _ALIASES.get(platform.lower(), platform.lower())
    if name not in PLATFORMS:
        raise ValueError(
            f"`platform` must be one of {', '.join(repr(p) for p in PLATFORMS)} "
            f"(or 'gpu' for 'cuda'), got {platform!r}."
        )
    return name


def per_platform(
    args: tuple[Any, ...],
    *,
    platform: str | None,
    default: Callable[..., Any],
    **overrides: Callable[..., Any],
) -> Any:
    """``fn(*args)`` for the function of the platform the computation runs on.

    Args:
        args: the operands (pytrees of arrays).
        platform: a pinned platform, or ``None`` for the one the computation is
            lowered for (every function is traced; each lowering keeps one).
        default: the function for platforms without an override.
        **overrides: functions for ``cpu``, ``cuda``, ``rocm`` or ``tpu``.

    Returns:
        What the chosen function returns (every function must return the same
        types).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> f = lambda x: per_platform(
        ...     (x,), platform=None, default=lambda x: x + 1, cpu=lambda x: x * 2)
        >>> jax.jit(f)(jnp.float32(3))  # lowered for this CPU
        Array(6., dtype=float32)
        >>> per_platform((3,), platform="cuda", default=lambda x: x + 1,
        ...              cpu=lambda x: x * 2)
        4
    """
    unknown = set(overrides) - set(PLATFORMS)
    if unknown:
        raise ValueError(
            f"`per_platform` overrides must be among {', '.join(PLATFORMS)}, got "
            f"{', '.join(sorted(unknown))}."
        )
    pinned = canonical_platform(platform)
    if pinned is not None:
        return overrides.get(pinned, default)(*args)
    if not overrides:
        return default(*args)
    return lax.platform_dependent(*args, default=default, **overrides)
