"""`describe_compact_state`: how a compact optimizer state stores each leaf.

Imported by ``mixprec.optax`` only (it imports optax).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax

from . import codes, fields as fields_lib
from .state import CompactState


def _is_compressed(x: Any) -> bool:
    return isinstance(x, codes.Compressed)


def _is_state(x: Any) -> bool:
    return isinstance(x, CompactState)


@dataclasses.dataclass(frozen=True)
class StateLeafRecord:
    """How one leaf of an optimizer state is stored.

    Attributes:
      path: the leaf's path in the state (``jax.tree_util.keystr``).
      shape: the leaf's shape.
      dtype: the leaf's own dtype (a compressed leaf decodes to it).
      stored: its tier (``"int8"``, ``"float8"``, ``"bfloat16-sr"``) if it is
        compressed, else the dtype it is stored in.
      kind: ``"moment"``, ``"parameter copy"``, ``"kept"`` (stored as it is),
        ``"weights"`` (the low 16 bits of ``"bfloat16-exact"`` weights) or
        ``"counter"`` (the compact state's own counters).
      source: the field of a known optax state type the leaf is in
        (``"ScaleByAdamState.mu"``), or ``None``.
      reason: why it is stored so.
      bytes: the bytes it takes (codes and block scales).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    stored: str
    kind: str
    source: str | None
    reason: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the record."""
        out = dataclasses.asdict(self)
        out["shape"] = list(self.shape)
        return out


@dataclasses.dataclass(frozen=True)
class CompactStateReport:
    """How a compact optimizer state stores each of its leaves, and why.

    Returned by `describe_compact_state`. ``str(report)`` is a plain-text
    table, ``report.to_dict()`` a JSON-serialisable dict.

    Attributes:
      leaves: one `StateLeafRecord` per leaf of the state, in
        ``jax.tree.leaves`` order (a compressed leaf counts as one).
      num_params: the number of parameter elements.
      param_bytes: the bytes of the params as given.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import mixprec.optax
      >>> opt = mixprec.optax.compact_state(
      ...     optax.adam(1e-3), weights="float32", moments="int8", policy="float32")
      >>> report = mixprec.optax.describe_compact_state(opt, {"w": jnp.zeros((4, 256))})
      >>> moments = report.find("moment")
      >>> [(r.path, r.stored) for r in moments]  # doctest: +NORMALIZE_WHITESPACE
      [(".inner_state[0].mu['w']", 'int8'), (".inner_state[0].nu['w']", 'int8')]
      >>> round(report.state_bytes_per_param, 3), round(report.bytes_per_param, 3)
      (2.047, 10.047)
      >>> report.to_dict()["leaves"][2]["reason"]
      'moment (ScaleByAdamState.mu)'

    """

    leaves: tuple[StateLeafRecord, ...]
    num_params: int
    param_bytes: int

    @property
    def state_bytes(self) -> int:
        """Bytes of the whole optimizer state."""
        return sum(leaf.bytes for leaf in self.leaves)

    @property
    def state_bytes_per_param(self) -> float:
        """Bytes of the optimizer state per parameter."""
        return self.state_bytes / max(self.num_params, 1)

    @property
    def bytes_per_param(self) -> float:
        """Bytes per parameter of the weights and gradients (both in the
        params' dtype) and the optimizer state: the training state's size."""
        return (2 * self.param_bytes + self.state_bytes) / max(self.num_params, 1)

    def find(self, kind: str) -> list[StateLeafRecord]:
        """The records of one ``kind`` (``"moment"``, ``"parameter copy"``...)."""
        return [leaf for leaf in self.leaves if leaf.kind == kind]

    def summary(self) -> str:
        """One line: bytes per parameter, state and total."""
        return (
            f"{self.num_params} params: optimizer state "
            f"{self.state_bytes_per_param:.2f} bytes/param; weights + gradients "
            f"+ state {self.bytes_per_param:.2f} bytes/param"
        )

    def table(self) -> str:
        """The records as an aligned plain-text table, then the summary."""
        columns = ("path", "shape", "stored", "bytes", "why")
        rows = [
            (
                leaf.path or "state",
                "x".join(map(str, leaf.shape)) or "()",
                leaf.stored,
                str(leaf.bytes),
                leaf.reason,
            )
            for leaf in self.leaves
        ]
        widths = [len(c) for c in columns]
        for row in rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
            for row in rows
        ]
        lines.append(self.summary())
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the whole report."""
        return {
            "num_params": self.num_params,
            "param_bytes": self.param_bytes,
            "state_bytes": self.state_bytes,
            "state_bytes_per_param": self.state_bytes_per_param,
            "bytes_per_param": self.bytes_per_param,
            "leaves": [leaf.to_dict() for leaf in self.leaves],
        }


def _nbytes(x: Any) -> int:
    if _is_compressed(x):
        return sum(_nbytes(a) for a in (x.codes, x.scale) if a is not None)
    if not hasattr(x, "dtype"):
        return 0
    return int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _record(path: Any, leaf: Any, kind: str, source: str | None, reason: str) -> Any:
    if _is_compressed(leaf):
        shape, dtype, stored = tuple(leaf.codes.shape), leaf.dtype, leaf.tier
    else:
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = getattr(leaf, "dtype", type(leaf).__name__)
        stored = np.dtype(dtype).name if hasattr(leaf, "dtype") else str(dtype)
    return StateLeafRecord(
        path=jax.tree_util.keystr(path),
        shape=shape,
        dtype=np.dtype(dtype).name if hasattr(leaf, "dtype") else str(dtype),
        stored=stored,
        kind=kind,
        source=source,
        reason=reason,
        bytes=_nbytes(leaf),
    )


_COUNTERS = {
    "step": "CompactState.step: the number of updates (keys the random bits)",
    "num_missed": "CompactState.num_missed: weight elements that missed",
    "codes_format": "CompactState.codes_format: the layout of the codes",
}


def describe_compact_state(optimizer_or_state: Any, params: Any) -> CompactStateReport:
    """How `compact_state` stores each leaf of an optimizer's state, and why.

    A leaf is compressed as a moment only where it is known to be one: a
    field of an optax state type that holds gradient statistics (Adam's
    ``mu`` and ``nu``, momentum's ``trace``...). A copy of the parameters
    (``optax.contrib.mechanize``'s ``x0``, ``prodigy``'s ``params0``,
    schedule-free's ``z``, SAM's ``cache``) is stored as the weights are:
    ``"bfloat16-sr"`` under ``weights="bfloat16-sr"``, float32 otherwise.
    Every other leaf is kept as it is. The report lists each leaf: its tier,
    which of these rules decided it, and its bytes; and the bytes per
    parameter of the whole state.

    Args:
      optimizer_or_state: an optimizer from `compact_state` (possibly wrapped,
        e.g. in `loss_scaled`), whose ``init(params)`` is traced abstractly
        (nothing is computed), or a state holding a `CompactState`.
      params: the params (those the model reads, or float32 ones).

    Returns:
      A `CompactStateReport`: ``str(report)`` is a table, ``report.to_dict()``
      the same as data.

    Raises:
      ValueError: if the state holds no `CompactState`.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import mixprec.optax
      >>> opt = mixprec.optax.compact_state(
      ...     optax.contrib.prodigy(), weights="float32", moments="int8",
      ...     policy="float32")
      >>> report = mixprec.optax.describe_compact_state(
      ...     opt, {"w": jnp.zeros((8, 256))})
      >>> for r in report.leaves:
      ...     print(f"{r.path:30} {r.stored:8} {r.kind}")
      .step                          int32    counter
      .inner_state.exp_avg['w']      int8     moment
      .inner_state.exp_avg_sq['w']   int8     moment
      .inner_state.grad_sum['w']     float32  kept
      .inner_state.params0['w']      float32  parameter copy
      .inner_state.estim_lr          float32  kept
      .inner_state.numerator_weighted float32  kept
      .inner_state.count             int32    kept
      .num_missed                    int32    counter
      .codes_format                  int32    counter
      >>> print(report.leaves[3].reason)  # doctest: +NORMALIZE_WHITESPACE
      ProdigyState.grad_sum: its magnitudes are summed into the step-size
      estimate, and rounding noise biases a magnitude upwards; kept as is
      >>> print(report.summary())  # doctest: +NORMALIZE_WHITESPACE
      2048 params: optimizer state 10.04 bytes/param; weights + gradients
      + state 18.04 bytes/param
    """
    if isinstance(optimizer_or_state, optax.GradientTransformation):
        state = jax.eval_shape(optimizer_or_state.init, params)
    else:
        state = optimizer_or_state
    found = [s for s in jax.tree.leaves(state, is_leaf=_is_state) if _is_state(s)]
    if not found:
        raise ValueError(
            "`mixprec.optax.describe_compact_state(optimizer_or_state, params)` "
            "expects an optimizer from `mixprec.optax.compact_state` or its "
            f"state, got a {type(optimizer_or_state).__name__} holding no "
            "`CompactState`."
        )
    records: list[StateLeafRecord] = []
    top = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_state)[0]
    for path, node in top:
        if not _is_state(node):
            records.append(
                _record(path, node, fields_lib.KEPT, None, "outside the compact state")
            )
            continue
        for name in CompactState._fields:
            value = getattr(node, name)
            here = (*path, jax.tree_util.GetAttrKey(name))
            if name in _COUNTERS:
                records.append(_record(here, value, "counter", None, _COUNTERS[name]))
            elif name == "remainder":
                for sub, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                    records.append(
                        _record(
                            (*here, *sub),
                            leaf,
                            "weights",
                            None,
                            "low 16 bits of the float32 master weights "
                            '("bfloat16-exact")',
                        )
                    )
            else:
                flat = jax.tree_util.tree_flatten_with_path(
                    value, is_leaf=_is_compressed
                )[0]
                plans = fields_lib.plan(value, params, is_leaf=_is_compressed)
                for (sub, leaf), p in zip(flat, plans, strict=True):
                    records.append(
                        _record((*here, *sub), leaf, p.kind, p.source, p.reason)
                    )
    leaves = jax.tree.leaves(params)
    return CompactStateReport(
        leaves=tuple(records),
        num_params=sum(int(np.prod(np.shape(p), dtype=np.int64)) for p in leaves),
        param_bytes=sum(_nbytes(p) for p in leaves),
    )
