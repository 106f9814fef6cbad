"""Flax integration: run Flax models under a mixed-precision policy, unedited.

Two entry points, one per Flax API:

* Linen: `apply` is ``module.apply`` under a policy. The ``params`` collection
  is cast to each module's compute dtype at apply (so gradients flow back to the
  float32 master weights), every module call gets its floating inputs cast to
  its compute dtype, and the model's output is cast to the output dtype. Other
  collections (``batch_stats``) are never cast: batch-norm statistics stay
  float32.
* NNX: `set_policy` sets, in place, each submodule's ``dtype`` (Flax's own
  compute-dtype attribute, honoured by every ``nnx`` layer) and casts its
  ``nnx.Param`` values to the param dtype; ``nnx.BatchStat`` and other
  variables are untouched.

Both take ``overrides``, Keras's per-layer ``dtype``: a mapping from a module
path pattern or a module class to the policy for that module and everything
inside it. A string is a regular expression that must match the whole
``/``-joined module path (``"Block_0/LayerNorm_0"``, ``"layers/3"``) or its last
part (``"head"``, ``".*Norm.*"``); a class matches by ``isinstance``. The first
matching entry wins; a module without a match inherits its closest matching
ancestor's policy, else the default policy. The usual choice keeps the logits
layer and the norms in float32::

    overrides = {"head": "float32", nn.LayerNorm: "p=f32,c=f32,o=bf16"}

An overridden module's output is cast to its own policy's output dtype (a norm
inside a bfloat16 block can compute in float32 and hand bfloat16 on).

This module imports flax; ``import mixprec`` never imports it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import flax.linen as nn
import jax
from flax import nnx

from ._src.casting import cast_tree
from ._src.policy import Policy, get_policy


__all__ = ["apply", "set_policy"]

_Overrides = tuple[tuple[Any, Policy], ...]
_M = TypeVar("_M", bound=nnx.Module)


def _check_overrides(overrides: Any, fn_name: str) -> _Overrides:
    if overrides is None:
        return ()
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"`mixprec.flax.{fn_name}(..., overrides=...)` must be a mapping from "
            "path patterns or module classes to policies, got "
            f"{type(overrides).__name__}."
        )
    out = []
    for key, pol in overrides.items():
        if isinstance(key, str):
            try:
                pattern: Any = re.compile(key)
            except re.error as e:
                raise ValueError(
                    f"`mixprec.flax.{fn_name}(..., overrides=...)`: {key!r} is not a "
                    f"valid regular expression: {e}."
                ) from None
        elif isinstance(key, type):
            pattern = key
        else:
            raise TypeError(
                f"`mixprec.flax.{fn_name}(..., overrides=...)` keys must be path "
                f"patterns (str) or module classes, got {key!r}."
            )
        out.append((pattern, get_policy(pol)))
    return tuple(out)


def _own_match(
    path: tuple[str, ...], cls: type | None, overrides: _Overrides
) -> Policy | None:
    joined = "/".join(path)
    last = path[-1] if path else ""
    for key, pol in overrides:
        if isinstance(key, type):
            if cls is not None and issubclass(cls, key):
                return pol
        elif key.fullmatch(joined) or (path and key.fullmatch(last)):
            return pol
    return None


def _resolve(
    path: tuple[str, ...],
    classes: Mapping[tuple[str, ...], type],
    overrides: _Overrides,
    default: Policy,
) -> tuple[Policy, bool]:
    """The policy for the module at ``path`` and whether it matched itself."""
    for n in range(len(path), -1, -1):
        sub = path[:n]
        pol = _own_match(sub, classes.get(sub), overrides)
        if pol is not None:
            return pol, n == len(path)
    return default, False


# --------------------------------------------------------------------------- linen


def _module_path(module: nn.Module) -> tuple[str, ...]:
    scope = module.scope
    return tuple(str(p) for p in scope.path) if scope is not None else ()


def _record_classes(
    module: nn.Module, call: Callable[[], Any]
) -> dict[tuple[str, ...], type]:
    classes: dict[tuple[str, ...], type] = {}

    def record(next_fun, args, kwargs, context):
        classes.setdefault(_module_path(context.module), type(context.module))
        return next_fun(*args, **kwargs)

    del module
    with nn.intercept_methods(record):
        jax.eval_shape(call)
    return classes


def apply(
    module: nn.Module,
    variables: Any,
    *args: Any,
    policy: Policy | str,
    overrides: Mapping[Any, Policy | str] | None = None,
    **kwargs: Any,
) -> Any:
    """``module.apply(variables, *args, **kwargs)`` under a mixed-precision policy.

    Args:
      module: a Linen module, unedited (layers with ``dtype=None``, Flax's
        default, compute in the dtype of what they are given).
      variables: its variables, ``{"params": ..., "batch_stats": ...}``; params
        are the float32 master weights.
      *args: positional arguments of the method.
      policy: the default policy (a `mixprec.Policy` or string).
      overrides: per-module policies by path pattern or class (see the module
        docstring), e.g. ``{"head": "float32", nn.LayerNorm: "float32"}``.
      **kwargs: keyword arguments of ``module.apply`` (``method``, ``mutable``,
        ``rngs``) and of the method.

    Returns:
      What ``module.apply`` returns, the output cast to the policy's output dtype
      (with ``mutable``, the updated collections are returned uncast).

    Examples:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> import mixprec, mixprec.flax
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         x = nn.relu(nn.Dense(8)(x))
      ...         self.sow("intermediates", "hidden", x)
      ...         return nn.Dense(2, name="head")(x)
      >>> model = MLP()
      >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> y, inter = mixprec.flax.apply(model, variables, jnp.ones((1, 3)),
      ...     policy="mixed_bfloat16", overrides={"head": "float32"},
      ...     mutable="intermediates")
      >>> y.dtype, inter["intermediates"]["hidden"][0].dtype
      (dtype('float32'), dtype(bfloat16))
    """
    default = get_policy(policy)
    ovr = _check_overrides(overrides, "apply")
    if not isinstance(module, nn.Module):
        raise TypeError(
            "`mixprec.flax.apply(module, ...)` must be a Linen module, got "
            f"{type(module).__name__}. For NNX models use `mixprec.flax.set_policy`."
        )
    classes: dict[tuple[str, ...], type] = {}
    if any(isinstance(k, type) for k, _ in ovr):
        classes = _record_classes(
            module, lambda: module.apply(variables, *args, **kwargs)
        )

    def cast_params(path: Any, leaf: Any) -> Any:
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        pol, _ = _resolve(keys[:-1], classes, ovr, default)
        return cast_tree(leaf, pol.compute_dtype)

    variables = dict(variables)
    if "params" in variables:
        variables["params"] = jax.tree_util.tree_map_with_path(
            cast_params, variables["params"]
        )

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name in ("setup",):
            return next_fun(*args, **kwargs)
        path = _module_path(context.module)
        pol, own = _resolve(path, classes, ovr, default)
        args, kwargs = pol.cast_to_compute((args, kwargs))
        out = next_fun(*args, **kwargs)
        if own:
            out = pol.cast_to_output(out)
        return out

    mutable = kwargs.get("mutable", False)
    with nn.intercept_methods(interceptor):
        out = module.apply(variables, *args, **kwargs)
    if mutable is not False:
        y, updated = out
        return default.cast_to_output(y), updated
    return default.cast_to_output(out)


# ----------------------------------------------------------------------------- nnx


def set_policy(
    model: _M,
    policy: Policy | str,
    *,
    overrides: Mapping[Any, Policy | str] | None = None,
) -> _M:
    """Puts an NNX model under a mixed-precision policy, in place.

    Every submodule with a ``dtype`` attribute (all ``nnx`` layers: the dtype they
    compute in) gets its policy's compute dtype, and ``param_dtype`` its param
    dtype; its ``nnx.Param`` values are cast to the param dtype. Batch-norm
    statistics (``nnx.BatchStat``), RNG state and other variables are untouched.
    Model outputs are in the compute dtype of the last layer; cast them with
    ``policy.cast_to_output`` if needed.

    Args:
      model: an NNX module.
      policy: the default policy.
      overrides: per-module policies by path pattern (paths such as
        ``"layers/2"``) or class, e.g. ``{nnx.BatchNorm: "float32"}``.

    Returns:
      ``model`` itself (modified in place).

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import mixprec, mixprec.flax
      >>> rngs = nnx.Rngs(0)
      >>> model = nnx.Sequential(
      ...     nnx.Linear(3, 8, rngs=rngs),
      ...     nnx.LayerNorm(8, rngs=rngs),
      ...     nnx.Linear(8, 2, rngs=rngs),
      ... )
      >>> keep_f32 = {nnx.LayerNorm: "float32", "layers/2": "float32"}
      >>> _ = mixprec.flax.set_policy(model, "mixed_bfloat16", overrides=keep_f32)
      >>> model.layers[0].dtype, model.layers[0].kernel[...].dtype
      (dtype(bfloat16), dtype('float32'))
      >>> model(jnp.ones((1, 3))).dtype
      dtype('float32')
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            "`mixprec.flax.set_policy(model, ...)` must be an NNX module, got "
            f"{type(model).__name__}. For Linen models use `mixprec.flax.apply`."
        )
    default = get_policy(policy)
    ovr = _check_overrides(overrides, "set_policy")
    modules = [
        (tuple(str(p) for p in path), m)
        for path, m in nnx.iter_graph(model)
        if isinstance(m, nnx.Module)
    ]
    classes = {path: type(m) for path, m in modules}
    for path, m in modules:
        pol, _ = _resolve(path, classes, ovr, default)
        if hasattr(m, "dtype"):
            m.dtype = pol.compute_dtype  # pyright: ignore[reportAttributeAccessIssue]
        if hasattr(m, "param_dtype"):
            m.param_dtype = pol.param_dtype  # pyright: ignore[reportAttributeAccessIssue]
        for value in list(vars(m).values()):
            if isinstance(value, nnx.Param):
                value.set_value(cast_tree(value.get_value(), pol.param_dtype))
    return model
