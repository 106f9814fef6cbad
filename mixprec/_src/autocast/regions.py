"""Regions of a function that autocast treats differently.

``x.astype(jnp.float32)`` on a float32 value leaves no trace in a jaxpr, so "keep
this part in float32" cannot be said with casts. A region is a
``jax.named_scope`` with a reserved name that the interpreter finds in each
equation's ``source_info.name_stack``:

* ``mixprec_float32``: :func:`float32_scope`. Ops inside run at the precision
  they were written in (Keras's advice: keep the final softmax in float32).
* ``mixprec_policy_<n>``: :func:`precision_scope`. Ops inside run under their own
  policy (``n`` indexes a registry of policies).
* ``mixprec_ctx_<n>``: a nested :func:`mixprec.autocast` with a configuration
  that differs from the enclosing one.

The innermost region wins. Name stacks survive ``jit``, ``grad`` (as
``jvp(...)``/``transpose(...)``) and ``vmap``, so the backward pass of a region is
in the region too. Equations inside the body of a ``scan``/``cond``/... inherit
the region of the higher-order equation. Only these reserved names are regions:
a user's own scope or layer name (``"norm"``, ``"mean"``) means nothing here.
"""

from __future__ import annotations

import contextlib
import functools as ft
import re
import threading
from collections.abc import Iterator
from typing import Any

import jax

from mixprec._src.policy import Policy, get_policy


__all__ = ["float32_scope", "precision_scope"]

FLOAT32_SCOPE = "mixprec_float32"
_MARKER = re.compile(r"mixprec_(float32|policy_(\d+)|ctx_(\d+))")

_lock = threading.Lock()
_policies: list[Policy] = []
_policy_ids: dict[Policy, int] = {}
_contexts: list[Any] = []
_context_ids: dict[Any, int] = {}


def _policy_id(policy: Policy) -> int:
    with _lock:
        if policy not in _policy_ids:
            _policy_ids[policy] = len(_policies)
            _policies.append(policy)
        return _policy_ids[policy]


def context_marker(ctx: Any) -> str:
    """The scope name of a nested autocast configuration ``ctx``."""
    with _lock:
        if ctx not in _context_ids:
            _context_ids[ctx] = len(_contexts)
            _contexts.append(ctx)
        return f"mixprec_ctx_{_context_ids[ctx]}"


@contextlib.contextmanager
def float32_scope() -> Iterator[None]:
    """Ops traced inside run at their original precision under autocast.

    Use it for the parts of a model that must stay in float32 whatever the op
    lists say (Keras keeps the final softmax in float32): autocast casts their
    inputs back to the dtypes they were traced with. Outside an autocast
    transform it does nothing (it is a ``jax.named_scope``).

    Yields:
        None.

    Examples:
        >>> import jax.numpy as jnp
        >>> import mixprec
        >>> x, w = jnp.full((1, 1), 1.001), jnp.ones((1, 1))
        >>> def f(x, w):
        ...     with mixprec.float32_scope():
        ...         a = x @ w  # as written: float32
        ...     return a, x @ w  # allow list: bfloat16, 1.001 rounds to 1.0
        >>> a, b = mixprec.autocast(f, "mixed_bfloat16")(x, w)
        >>> float(a[0, 0]), float(b[0, 0])
        (1.001, 1.0)
    """
    with jax.named_scope(FLOAT32_SCOPE):
        yield


@contextlib.contextmanager
def precision_scope(policy: Policy | str) -> Iterator[Policy]:
    """Ops traced inside run under ``policy`` when autocast meets them.

    The enclosing :func:`mixprec.autocast` keeps its mode and op lists; only the
    policy (hence the low dtype) changes inside the region. A
    ``float32`` policy makes allow-list ops run in float32.

    Args:
        policy: a :class:`mixprec.Policy` or a string for
            :func:`mixprec.get_policy`.

    Yields:
        The parsed policy.

    Examples:
        >>> import jax.numpy as jnp
        >>> import mixprec
        >>> x, w = jnp.full((1, 1), 1.001), jnp.ones((1, 1))
        >>> def f(x, w):
        ...     with mixprec.precision_scope("float32"):
        ...         a = x @ w  # float32 dot
        ...     return a, x @ w  # bfloat16 dot: 1.001 rounds to 1.0
        >>> a, b = mixprec.autocast(f, "mixed_bfloat16")(x, w)
        >>> float(a[0, 0]), float(b[0, 0])
        (1.001, 1.0)
    """
    p = get_policy(policy)
    with jax.named_scope(f"mixprec_policy_{_policy_id(p)}"):
        yield p


@ft.lru_cache(maxsize=4096)
def parse_name_stack(stack: str) -> tuple[str, Any] | None:
    """The innermost region named in ``stack``.

    Returns ``("float32", None)``, ``("policy", Policy)``, ``("ctx", config)``
    or None.
    """
    if "mixprec_" not in stack:
        return None
    m = list(_MARKER.finditer(stack))[-1] if _MARKER.search(stack) else None
    if m is None:
        return None
    if m.group(1) == "float32":
        return ("float32", None)
    if m.group(2) is not None:
        return ("policy", _policies[int(m.group(2))])
    return ("ctx", _contexts[int(m.group(3))])
