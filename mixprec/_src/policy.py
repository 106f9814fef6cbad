"""Precision policies: which dtype parameters, computation and outputs use.

A :class:`Policy` is static configuration (a frozen, hashable dataclass, not a
pytree), so it can be a ``jit`` static argument or a dict key. It parses from
JMP's strings (``"p=f32,c=bf16,o=f32"``) and Keras's names
(``"mixed_bfloat16"``), and ``str(policy)`` parses back to an equal policy.

A policy may also carry a :class:`~mixprec.Float8Recipe` (``"mixed_float8"``):
autocast then runs matmuls and convolutions in float8, scaled, and everything
else as the policy's dtypes say. Only autocast reads it; ``cast_to_compute``
and the other casts use the dtypes alone.
"""

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from . import casting
from ._errors import format_choices, suggest
from .float8 import Float8Recipe


T = TypeVar("T")


class _DtypeNames(Mapping[np.dtype, tuple[str, ...]]):
    """The names of each policy dtype; the first is the one ``str(Policy)`` writes.

    JMP's ``dtype_to_names``, keyed so that any form of a dtype finds its
    names: ``np.float16``, ``jnp.float16``, ``np.dtype("float16")`` and
    ``"float16"`` are one key (JMP's table is keyed by scalar types, so
    ``np.dtype`` keys raise ``KeyError``). float32 is written ``f32``; JMP
    writes ``full``. Both parse.

    Examples:
        >>> import jax.numpy as jnp, numpy as np
        >>> dtype_to_names[jnp.float32]
        ('f32', 'full', 'float32')
        >>> dtype_to_names[np.dtype("bfloat16")] == dtype_to_names[jnp.bfloat16]
        True
        >>> np.int32 in dtype_to_names
        False
    """

    def __init__(self, names: dict[DTypeLike, tuple[str, ...]]):
        self._names = {np.dtype(jnp.dtype(k)): v for k, v in names.items()}

    def __getitem__(self, dtype: DTypeLike) -> tuple[str, ...]:
        try:
            key = np.dtype(jnp.dtype(dtype))
        except (TypeError, ValueError):
            raise KeyError(dtype) from None
        return self._names[key]

    def __iter__(self) -> Iterator[np.dtype]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"dtype_to_names({self._names!r})"


dtype_to_names = _DtypeNames(
    {
        jnp.bfloat16: ("bf16", "bfloat16"),
        jnp.float16: ("f16", "float16"),
        jnp.float32: ("f32", "full", "float32"),
        jnp.float64: ("f64", "float64"),
    }
)
# Every name a policy string may use. "half" is resolved when parsed (it
# depends on the backend).
_DTYPE_NAMES: dict[str, DTypeLike | str] = {
    name: dtype for dtype, names in dtype_to_names.items() for name in names
}
_DTYPE_NAMES["half"] = "half"
# Keras names: "mixed_*" keeps float32 master weights and float32 outputs.
_KERAS_POLICIES = {
    "mixed_float16": ("float32", "float16", "float32"),
    "mixed_bfloat16": ("float32", "bfloat16", "float32"),
}
# "mixed_float8": matmuls and convolutions in float8 (the default recipe), the
# rest as "mixed_bfloat16".
_FLOAT8_POLICIES = {"mixed_float8": ("float32", "bfloat16", "float32")}
_KEYS = {
    "p": "param",
    "params": "param",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
    "f8": "float8",
    "float8": "float8",
    "g": "gather",
    "gather": "gather",
    "r": "reduce",
    "reduce": "reduce",
}


def _parse_dtype(name: str, *, spec: str, whole: bool = False) -> np.dtype:
    key = name.strip().lower()
    if key not in _DTYPE_NAMES:
        valid = (
            [*_DTYPE_NAMES, *_KERAS_POLICIES, *_FLOAT8_POLICIES]
            if whole
            else list(_DTYPE_NAMES)
        )
        try:  # Any other floating dtype NumPy knows, e.g. "float8_e4m3fn".
            dtype = np.dtype(jnp.dtype(key))
            if jnp.issubdtype(dtype, jnp.floating):
                return dtype
        except TypeError:
            pass
        raise ValueError(
            f"`get_policy({spec!r})`: Unknown dtype {name.strip()!r}."
            f"{suggest(key, valid)} Valid names are {format_choices(valid)}, "
            "or any floating dtype name."
        )
    value = _DTYPE_NAMES[key]
    if isinstance(value, str):  # "half" (`np.dtype("float16") == "half"` is True)
        return casting.half_dtype()
    return np.dtype(jnp.dtype(value))


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
    """The dtypes of a mixed-precision computation.

    Attributes:
        param_dtype: the dtype parameters are stored in (the "master weights").
        compute_dtype: the dtype the computation runs in.
        output_dtype: the dtype of the function's outputs.

        float8: a :class:`~mixprec.Float8Recipe` under which autocast runs
            matmuls and convolutions in float8 (``None``: it does not). The
            casts of this class ignore it.
        gather_dtype: the communication dtype parameters are gathered in
            when they are sharded (FSDP/ZeRO-3): ``None`` (default) gathers
            them in :attr:`compute_dtype`, each gathered once per step and
            reused by the backward pass. A wider dtype (``float32``) leaves
            the rounding to each product, after the partitioner's gather of
            the master weight. It may not be narrower than
            :attr:`compute_dtype`.
        reduce_dtype: the communication dtype gradients are reduced in across
            devices (the all-reduce or reduce-scatter of a data-parallel or
            FSDP gradient, a ``psum`` of gradients in ``shard_map``): float32 by
            default, whether autocast wraps the loss or the whole step;
            ``bfloat16`` halves the bytes of every gradient reduction at the
            cost of rounding each device's partial gradient (measured in
            ``docs/many_devices.md``). Any floating dtype.

    Together these two fields are the policy's *communication policy*; they
    appear in the policy string as ``g=`` and ``r=`` when not the defaults.

    Each dtype accepts a NumPy dtype, a ``jnp`` scalar type or a name
    (``"bfloat16"``, ``"bf16"``, ``"half"``, ...) and is stored as an ``np.dtype``,
    so equal dtypes given in different forms make equal, equally hashed policies.

    Examples:
        >>> import jax.numpy as jnp
        >>> policy = Policy(jnp.float32, "bf16", np.dtype("float32"))
        >>> str(policy)
        'p=f32,c=bf16,o=f32'
        >>> policy == get_policy("mixed_bfloat16")
        True
        >>> params = {"w": jnp.ones(2), "step": jnp.array(0)}
        >>> policy.cast_to_compute(params)["w"].dtype
        dtype(bfloat16)
        >>> str(Policy("f32", "bf16", "f32", float8=Float8Recipe("rowwise")))
        'p=f32,c=bf16,o=f32,f8=rowwise'
        >>> comm = Policy("f32", "bf16", "f32", reduce_dtype="bf16")
        >>> str(comm), comm.resolved_gather_dtype, comm.reduce_dtype
        ('p=f32,c=bf16,o=f32,r=bf16', dtype(bfloat16), dtype(bfloat16))
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    float8: Float8Recipe | None = None
    gather_dtype: np.dtype | None = None
    reduce_dtype: np.dtype = np.dtype(np.float32)

    def __init__(
        self,
        param_dtype: DTypeLike,
        compute_dtype: DTypeLike,
        output_dtype: DTypeLike,
        *,
        float8: Float8Recipe | str | None = None,
        gather_dtype: DTypeLike | None = None,
        reduce_dtype: DTypeLike = np.float32,
    ):
        given = dict(
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
            output_dtype=output_dtype,
        )
        for field, value in given.items():
            if isinstance(value, str) and value.strip().lower() in _DTYPE_NAMES:
                dtype = _parse_dtype(value, spec=value)
            else:
                dtype = casting.canonical_float_dtype(value, argname=field)
            object.__setattr__(self, field, dtype)
        if isinstance(float8, str):
            float8 = Float8Recipe.parse(float8)
        if float8 is not None and not isinstance(float8, Float8Recipe):
            raise TypeError(
                "Expected `Policy(..., float8=...)` to be a mixprec.Float8Recipe, a "
                f"recipe name such as 'tensorwise', or None, got {float8!r} instead."
            )
        object.__setattr__(self, "float8", float8)
        reduce = _comm_dtype(reduce_dtype, "reduce_dtype")
        object.__setattr__(self, "reduce_dtype", reduce)
        gather = None
        if gather_dtype is not None:
            gather = _comm_dtype(gather_dtype, "gather_dtype")
            if gather != self.compute_dtype and not _widens(self.compute_dtype, gather):
                raise ValueError(
                    "Expected `Policy(..., gather_dtype=...)` to be the compute "
                    f"dtype {self.compute_dtype.name} or a dtype that holds every "
                    f"{self.compute_dtype.name} value exactly, got {gather.name} "
                    "instead: gathering parameters narrower than they are computed "
                    "in would round them twice. Valid choices are "
                    f"{_comm_choices(self.compute_dtype)} or None (the compute dtype)."
                )
            if gather == self.compute_dtype:
                gather = None  # the default, spelled out: equal policies
        object.__setattr__(self, "gather_dtype", gather)

    @property
    def resolved_gather_dtype(self) -> np.dtype:
        """The dtype parameters are gathered in: :attr:`gather_dtype`, or
        :attr:`compute_dtype` when that is ``None``.

        Examples:
            >>> get_policy("mixed_bfloat16").resolved_gather_dtype
            dtype(bfloat16)
            >>> get_policy("p=f32,c=bf16,g=f32").resolved_gather_dtype
            dtype('float32')
        """
        return self.compute_dtype if self.gather_dtype is None else self.gather_dtype

    def cast_to_param(self, x: T) -> T:
        """Casts floating array leaves of ``x`` to :attr:`param_dtype`.

        Examples:
            >>> get_policy("p=bf16").cast_to_param(jnp.ones(2)).dtype
            dtype(bfloat16)
        """
        return casting.cast_tree(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Casts floating array leaves of ``x`` to :attr:`compute_dtype`.

        Examples:
            >>> get_policy("mixed_float16").cast_to_compute(jnp.ones(2)).dtype
            dtype('float16')
        """
        return casting.cast_tree(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Casts floating array leaves of ``x`` to :attr:`output_dtype`.

        Examples:
            >>> get_policy("mixed_float16").cast_to_output(jnp.ones(2, "f2")).dtype
            dtype('float32')
        """
        return casting.cast_tree(x, self.output_dtype)

    def with_param_dtype(self, param_dtype: DTypeLike) -> "Policy":
        """Returns a copy with ``param_dtype`` replaced.

        Examples:
            >>> str(get_policy("float32").with_param_dtype("bf16"))
            'p=bf16,c=f32,o=f32'
        """
        return dataclasses.replace(self, param_dtype=param_dtype)

    def with_compute_dtype(self, compute_dtype: DTypeLike) -> "Policy":
        """Returns a copy with ``compute_dtype`` replaced.

        Examples:
            >>> str(get_policy("float32").with_compute_dtype("f16"))
            'p=f32,c=f16,o=f32'
        """
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def with_output_dtype(self, output_dtype: DTypeLike) -> "Policy":
        """Returns a copy with ``output_dtype`` replaced.

        Examples:
            >>> str(get_policy("bf16").with_output_dtype("f32"))
            'p=bf16,c=bf16,o=f32'
        """
        return dataclasses.replace(self, output_dtype=output_dtype)

    def with_float8(self, float8: "Float8Recipe | str | None") -> "Policy":
        """Returns a copy with the float8 recipe replaced (``None``: no float8).

        Examples:
            >>> str(get_policy("mixed_bfloat16").with_float8("rowwise"))
            'p=f32,c=bf16,o=f32,f8=rowwise'
        """
        return dataclasses.replace(self, float8=float8)

    def with_gather_dtype(self, gather_dtype: DTypeLike | None) -> "Policy":
        """Returns a copy with :attr:`gather_dtype` replaced (``None``: the
        compute dtype).

        Examples:
            >>> str(get_policy("mixed_bfloat16").with_gather_dtype("f32"))
            'p=f32,c=bf16,o=f32,g=f32'
        """
        return dataclasses.replace(self, gather_dtype=gather_dtype)

    def with_reduce_dtype(self, reduce_dtype: DTypeLike) -> "Policy":
        """Returns a copy with :attr:`reduce_dtype` replaced.

        Examples:
            >>> str(get_policy("mixed_bfloat16").with_reduce_dtype("bf16"))
            'p=f32,c=bf16,o=f32,r=bf16'
        """
        return dataclasses.replace(self, reduce_dtype=reduce_dtype)

    def __str__(self) -> str:
        def name(dtype: np.dtype) -> str:
            return dtype_to_names.get(dtype, (dtype.name,))[0]

        text = (
            f"p={name(self.param_dtype)},c={name(self.compute_dtype)},"
            f"o={name(self.output_dtype)}"
        )
        if self.float8 is not None:
            text = f"{text},f8={self.float8}"
        if self.gather_dtype is not None:
            text = f"{text},g={name(self.gather_dtype)}"
        if self.reduce_dtype != np.dtype(np.float32):
            text = f"{text},r={name(self.reduce_dtype)}"
        return text


_COMM_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _comm_dtype(value: DTypeLike, field: str) -> np.dtype:
    """A communication dtype of the policy: any floating dtype, else an error
    naming ``field`` and the choices."""
    try:
        if isinstance(value, str) and value.strip().lower() in _DTYPE_NAMES:
            return _parse_dtype(value, spec=value)
        dtype = np.dtype(jnp.dtype(value))
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"Expected `Policy(..., {field}=...)` to be a floating dtype, got "
            f"{value!r} instead. Valid choices are {', '.join(_COMM_DTYPES)}."
        )
    return dtype


def _widens(narrow: np.dtype, wide: np.dtype) -> bool:
    """Whether every ``narrow`` value is exactly a ``wide`` value."""
    fn, fw = jnp.finfo(narrow), jnp.finfo(wide)
    return fw.nmant >= fn.nmant and fw.maxexp >= fn.maxexp and fw.minexp <= fn.minexp


def _comm_choices(compute: np.dtype) -> str:
    names = [
        n
        for n in _COMM_DTYPES
        if n == compute.name or _widens(compute, np.dtype(jnp.dtype(n)))
    ]
    return ", ".join(names)


def plan_hint(value: Any) -> str:
    """For a :class:`mixprec.Plan` given where one policy is needed, the
    sentence that says where a plan goes; ``""`` for anything else."""
    from mixprec._src.plan import Plan  # (plan.py imports this module)

    if not isinstance(value, Plan):
        return ""
    return (
        " A `mixprec.Plan` gives each matmul its own policy and is applied by "
        "`mixprec.autocast(fn, plan)` (and `explain`/`diagnose` with "
        "`policy=plan`); where one policy is needed, pass its base policy, "
        "`plan.base`."
    )


def get_policy(spec: "str | Policy") -> Policy:
    """Parses a policy from a string (or returns a :class:`Policy` unchanged).

    Two grammars are understood:

    * JMP's: comma-separated ``key=dtype`` pairs with keys ``p``/``params``,
      ``c``/``compute`` and ``o``/``output``; params default to float32, compute
      follows params and output follows compute. A single dtype name sets all
      three. Dtype names: ``full f32 float32 half f16 float16 bf16 bfloat16 f64
      float64`` (``half`` is :func:`half_dtype`).
    * Keras's: ``mixed_float16`` and ``mixed_bfloat16`` (float32 params and
      outputs, 16-bit compute); ``float32``, ``float16``, ``bfloat16`` set all
      three.
    * ``mixed_float8``: ``mixed_bfloat16`` whose matmuls and convolutions
      autocast runs in float8 with the default :class:`~mixprec.Float8Recipe`
      (tensorwise current scaling). The key ``f8`` (``float8``) adds a recipe to
      a JMP string: ``"p=f32,c=bf16,o=f32,f8=rowwise"``.
    * The communication policy: ``g``/``gather`` (the dtype sharded parameters
      are gathered in, default the compute dtype) and ``r``/``reduce`` (the
      dtype gradients are reduced in, default float32):
      ``"p=f32,c=bf16,o=f32,r=bf16"``.

    Args:
        spec: the policy string, or a ``Policy``.

    Returns:
        The parsed ``Policy``.

    Raises:
        ValueError: for an unknown key or dtype name; the message lists the
            valid ones.
        TypeError: if ``spec`` is neither a string nor a ``Policy``.

    Examples:
        >>> str(get_policy("params=float32,compute=bfloat16"))
        'p=f32,c=bf16,o=bf16'
        >>> str(get_policy("mixed_float16"))
        'p=f32,c=f16,o=f32'
        >>> str(get_policy("bf16"))
        'p=bf16,c=bf16,o=bf16'
        >>> str(get_policy("mixed_float8"))
        'p=f32,c=bf16,o=f32,f8=tensorwise'
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"Expected `get_policy(spec)` to be a str or a mixprec.Policy, "
            f"got {type(spec).__name__} instead.{plan_hint(spec)}"
        )
    text = spec.strip()
    if text.lower() in _KERAS_POLICIES:
        return Policy(*_KERAS_POLICIES[text.lower()])
    if text.lower() in _FLOAT8_POLICIES:
        return Policy(*_FLOAT8_POLICIES[text.lower()], float8=Float8Recipe())
    if "=" not in text:
        dtype = _parse_dtype(text, spec=spec, whole=True)
        return Policy(dtype, dtype, dtype)

    dtypes: dict[str, np.dtype] = {}
    float8: Float8Recipe | None = None
    for part in text.split(","):
        head = part.partition("=")[0].strip().lower()
        if part.count("=") != 1 and not (
            part.count("=") > 1 and _KEYS.get(head) == "float8"
        ):
            raise ValueError(
                f"`get_policy({spec!r})`: expected comma-separated `key=dtype` "
                f"pairs such as 'p=f32,c=bf16,o=f32', got the part {part!r}."
            )
        key, value = (s.strip().lower() for s in part.split("=", 1))
        if key not in _KEYS:
            raise ValueError(
                f"`get_policy({spec!r})`: Unknown key {key!r}.{suggest(key, _KEYS)} "
                f"Valid keys are {format_choices(_KEYS)}."
            )
        if _KEYS[key] in dtypes or (_KEYS[key] == "float8" and float8 is not None):
            raise ValueError(
                f"`get_policy({spec!r})`: the {_KEYS[key]} dtype is given twice."
            )
        if _KEYS[key] == "float8":
            try:
                float8 = Float8Recipe.parse(value)
            except ValueError as e:
                raise ValueError(f"`get_policy({spec!r})`: {e}") from None
            continue
        dtypes[_KEYS[key]] = _parse_dtype(value, spec=spec)
    param = dtypes.get("param", np.dtype(jnp.float32))
    compute = dtypes.get("compute", param)
    output = dtypes.get("output", compute)
    try:
        return Policy(
            param,
            compute,
            output,
            float8=float8,
            gather_dtype=dtypes.get("gather"),
            reduce_dtype=dtypes.get("reduce", np.dtype(np.float32)),
        )
    except ValueError as e:
        raise ValueError(f"`get_policy({spec!r})`: {e}") from None


# The process-wide policy, and a per-thread stack of scoped overrides.
_FULL = Policy(jnp.float32, jnp.float32, jnp.float32)
_global_lock = threading.Lock()
_global_policy: Policy = _FULL
_scoped = threading.local()


def _stack() -> list[Policy]:
    if not hasattr(_scoped, "stack"):
        _scoped.stack = []
    return _scoped.stack


def get_global_policy() -> Policy:
    """The policy in effect: the innermost :func:`policy_scope` of this thread,
    else the one set by :func:`set_global_policy` (float32 by default, or the
    ``MIXPREC_POLICY`` environment variable at import).

    Examples:
        >>> str(get_global_policy())
        'p=f32,c=f32,o=f32'
        >>> with policy_scope("mixed_bfloat16"):
        ...     str(get_global_policy())
        'p=f32,c=bf16,o=f32'
    """
    stack = _stack()
    if stack:
        return stack[-1]
    return _global_policy


def set_global_policy(policy: "Policy | str") -> None:
    """Sets the process-wide default policy (seen by every thread).

    Args:
        policy: a ``Policy`` or any string :func:`get_policy` accepts.

    Examples:
        >>> set_global_policy("mixed_bfloat16")
        >>> str(get_global_policy())
        'p=f32,c=bf16,o=f32'
        >>> set_global_policy("float32")
    """
    global _global_policy
    parsed = get_policy(policy)
    with _global_lock:
        _global_policy = parsed


@contextlib.contextmanager
def policy_scope(policy: "Policy | str") -> Iterator[Policy]:
    """Overrides the global policy inside a ``with`` block, in this thread only.

    Scopes nest; the previous policy is restored on exit, also on error.

    Args:
        policy: a ``Policy`` or any string :func:`get_policy` accepts.

    Yields:
        The parsed policy.

    Examples:
        >>> with policy_scope("p=f32,c=f16") as p:
        ...     get_global_policy() is p
        True
    """
    parsed = get_policy(policy)
    stack = _stack()
    stack.append(parsed)
    try:
        yield parsed
    finally:
        stack.pop()
