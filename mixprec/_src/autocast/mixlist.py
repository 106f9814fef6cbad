"""``modify_mixlist``: edit the op lists with Ascend AMP's ``modify_mixlist`` JSON.

The spec has up to four top-level keys, each with ``"to-add"`` and/or
``"to-remove"`` lists of op names (JAX primitive names such as ``"dot_general"``
or composite names such as ``"log_softmax"``)::

    {
      "black-list": {"to-remove": ["exp"], "to-add": ["dot_general"]},
      "white-list": {"to-remove": ["conv_general_dilated"], "to-add": ["add"]}
    }

Semantics (Ascend AMP's ``modify_mixlist``; black = deny, white = allow,
gray = infer):

* ``"<list>": {"to-add": [op]}`` moves ``op`` into that list from whichever list
  it was in ("白名单或灰名单算子转换为黑名单算子").
* ``"<list>": {"to-remove": [op]}`` takes ``op`` out of that list. If the spec
  does not add it to another list, it becomes gray ("对于只从黑/白名单中删除,
  而不添加到白/黑名单的情况,系统会将该算子添加到灰名单中"). Removing and adding
  elsewhere in one spec is the same as just adding elsewhere.
* ``"gray-list"`` and ``"clear-list"`` (mixprec's fourth class) work
  the same way; an op removed from the gray list must be added to another list
  in the same spec (there is no default to fall back to).

Errors (``ValueError``, naming the problem): unknown top-level or inner keys,
unknown op names (with close matches), higher-order primitives and opaque kernels
(their precision is not a list choice), an op both added to and removed from one
list, an op added to two lists, removing an op from a list it is not in,
malformed JSON, a missing file. ``//`` line comments, as in Ascend's examples,
are allowed in JSON text. :func:`load_spec` is the one loader: autocast and
``mixprec.diagnose`` read a spec the same way.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping

from mixprec._src._errors import format_choices, suggest
from mixprec._src.autocast.ops import (
    OPAQUE,
    OpClass,
    OpLists,
    all_specs,
    default_op_lists,
)


def _known_names() -> frozenset[str]:
    return frozenset(s.name for s in all_specs() if not s.is_higher_order)


def _higher_order_names() -> frozenset[str]:
    return frozenset(s.name for s in all_specs() if s.is_higher_order)


def _opaque_names() -> frozenset[str]:
    return frozenset(s.name for s in all_specs() if OPAQUE in s.flags)


# Names that are not ops JAX emits: these functions are inlined into primitives,
# so there is no single op to list. What to do instead.
_INLINED = {
    "softmax": "jax.nn.softmax is inlined as reduce_max, sub, exp, reduce_sum, div",
    "logsumexp": "jax.nn.logsumexp is inlined as reduce_max, exp, reduce_sum, log",
    "layer_norm": "layer norms are inlined as reduce_sum, sub, mul, rsqrt",
    "rms_norm": "RMS norms are inlined as mul, reduce_sum, rsqrt",
    "group_norm": "group norms are inlined as reduce_sum, sub, mul, rsqrt",
    "batch_norm": "batch norms are inlined as reduce_sum, sub, mul, rsqrt",
    "mean": "jnp.mean is inlined as reduce_sum and div",
    "cross_entropy": "cross-entropy losses are inlined (log_softmax or exp/log)",
    "mse_loss": "squared-error losses are inlined as sub, square, reduce_sum",
}


#: Top-level spec keys and the class each maps to.
LIST_KEYS: dict[str, OpClass] = {
    "black-list": "deny",
    "white-list": "allow",
    "gray-list": "infer",
    "clear-list": "clear",
}
#: Inner spec keys.
ACTION_KEYS: tuple[str, str] = ("to-add", "to-remove")

# Ascend / TensorFlow op types users may write (Ascend's examples use "Matmul",
# "Conv2D", "Cast", "Bias"), mapped to the JAX name to suggest.
_FOREIGN_NAMES: dict[str, str] = {
    "matmul": "dot_general",
    "batchmatmul": "dot_general",
    "batchmatmulv2": "dot_general",
    "einsum": "dot_general",
    "linear": "dot_general",
    "conv2d": "conv_general_dilated",
    "conv3d": "conv_general_dilated",
    "conv1d": "conv_general_dilated",
    "depthwiseconv2d": "conv_general_dilated",
    "depthwiseconv2dnative": "conv_general_dilated",
    "conv2dbackpropinput": "conv_general_dilated",
    "cast": "convert_element_type",
    "bias": "add",
    "biasadd": "add",
    "addv2": "add",
    "realdiv": "div",
    "sigmoid": "logistic",
    "relu": "max",
    "maximum": "max",
    "minimum": "min",
    "sum": "reduce_sum",
    "reducesum": "reduce_sum",
    "prod": "reduce_prod",
    "select": "select_n",
    "where": "select_n",
    "erfinv": "erf_inv",
    "logsoftmax": "log_softmax",
    "layernorm": "layer_norm",
    "gather": "gather",
    "gatherv2": "gather",
    "concatv2": "concatenate",
}


def _strip_line_comments(text: str) -> str:
    """Removes ``//`` comments outside JSON strings (Ascend's examples have them)."""
    out: list[str] = []
    in_string = escaped = False
    i = 0
    while i < len(text):
        ch = text[i]
        if in_string:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif text.startswith("//", i):
            newline = text.find("\n", i)
            if newline == -1:
                break
            i = newline
            continue
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(
                f"`modify_mixlist(spec=...)`: duplicate key {key!r} in the JSON; "
                "merge the two entries into one."
            )
        out[key] = value
    return out


def _parse_json(text: str, source: str) -> object:
    try:
        return json.loads(
            _strip_line_comments(text), object_pairs_hook=_no_duplicate_keys
        )
    except json.JSONDecodeError as e:
        raise ValueError(
            f"`modify_mixlist(spec=...)`: malformed JSON in {source}: {e.msg} at "
            f"line {e.lineno} column {e.colno}. Expected an object such as "
            '{"black-list": {"to-add": ["dot_general"]}}.'
        ) from None


def load_spec(spec: Mapping[str, object] | str | os.PathLike[str]) -> object:
    """Reads a ``modify_mixlist`` spec: a mapping (returned as is), JSON text or
    the path of a JSON file (``//`` line comments allowed in both).

    Raises:
        ValueError: malformed JSON, duplicate keys, or a path that is not a file.
        TypeError: ``spec`` is of another type.
    """
    if isinstance(spec, Mapping):
        return spec
    if isinstance(spec, os.PathLike) or (
        isinstance(spec, str) and not spec.lstrip().startswith(("{", "["))
    ):
        path = pathlib.Path(spec)
        if not path.is_file():
            raise ValueError(
                f"`modify_mixlist(spec=...)`: {str(spec)!r} is neither a JSON file "
                "nor JSON text (JSON text starts with '{')."
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"`modify_mixlist(spec=...)`: cannot read {str(path)!r}: {e}."
            ) from e
        return _parse_json(text, f"file {str(path)!r}")
    if isinstance(spec, str):
        return _parse_json(spec, "the JSON string")
    raise TypeError(
        "`modify_mixlist(spec=...)` must be a dict, a JSON string or a path to a "
        f"JSON file, got {type(spec).__name__} instead."
    )


def _unknown_name_message(name: str, where: str, known: frozenset[str]) -> str:
    hint = suggest(name, known)
    foreign = _FOREIGN_NAMES.get(name.lower().replace("_", ""))
    if foreign is not None:
        hint = f" Did you mean {foreign!r} (the JAX primitive for {name!r})?"
    return (
        f"`modify_mixlist`: unknown op {name!r} in {where}. Op names are JAX "
        "primitive names (`prim.name`, e.g. 'dot_general', 'exp', 'add') or "
        f"composite names (e.g. 'log_softmax', 'var'); see docs/op_table.md." + hint
    )


def _check_name(name: object, where: str, known: frozenset[str]) -> str:
    if not isinstance(name, str):
        raise ValueError(
            f"`modify_mixlist`: op names in {where} must be strings, got "
            f"{name!r} ({type(name).__name__})."
        )
    if name in _higher_order_names() or name in _opaque_names():
        opaque = name in _opaque_names()
        what = "an opaque" if opaque else "a higher-order primitive"
        if opaque:
            what += " kernel/callback (it always runs at its original dtypes)"
        else:
            what += " (autocast classifies the ops in its body one by one)"
        raise ValueError(
            f"`modify_mixlist`: {name!r} in {where} is {what}; it cannot be put in "
            "an op list."
        )
    if name not in known:
        if name in _INLINED:
            raise ValueError(
                f"`modify_mixlist`: {name!r} in {where} is not an op JAX emits: "
                f"{_INLINED[name]}. List those primitives, or wrap the code in "
                "`mixprec.float32_scope()` to keep it in float32."
            )
        raise ValueError(_unknown_name_message(name, where, known))
    return name


def modify_mixlist(
    lists: OpLists | None, spec: Mapping[str, object] | str | os.PathLike[str]
) -> OpLists:
    """Returns a copy of ``lists`` edited by a ``modify_mixlist`` spec.

    Args:
        lists: the lists to edit; ``None`` means :func:`default_op_lists`.
        spec: a dict, a JSON string, or a path to a JSON file with keys
            ``"black-list"`` (deny), ``"white-list"`` (allow), ``"gray-list"``
            (infer) and ``"clear-list"``, each ``{"to-add": [...],
            "to-remove": [...]}``.

    Returns:
        The new :class:`OpLists` (``lists`` is not changed).

    Raises:
        ValueError: unknown keys or op names, an op both added and removed, an op
            added to two lists, removing an op from a list it is not in, malformed
            JSON, or a missing file.
        TypeError: ``spec`` or ``lists`` has the wrong type.

    Examples:
        Move ``exp`` from the black list to the white list:

        >>> lists = modify_mixlist(None, {"white-list": {"to-add": ["exp"]}})
        >>> lists.classify("exp")
        'allow'

        Removing an op from the white list without adding it elsewhere makes it
        gray:

        >>> spec = '{"white-list": {"to-remove": ["conv_general_dilated"]}}'
        >>> modify_mixlist(None, spec).classify("conv_general_dilated")
        'infer'

        Unknown names suggest close matches:

        >>> modify_mixlist(None, {"black-list": {"to-add": ["dot_genral"]}})
        Traceback (most recent call last):
        ...
        ValueError: ... Did you mean 'dot_general'...
    """
    if lists is None:
        lists = default_op_lists()
    if not isinstance(lists, OpLists):
        raise TypeError(
            "`modify_mixlist(lists=...)` must be an OpLists (e.g. "
            f"`default_op_lists()`) or None, got {type(lists).__name__} instead."
        )
    data = load_spec(spec)
    if not isinstance(data, Mapping):
        raise ValueError(
            "`modify_mixlist(spec=...)` must be a JSON object with keys "
            f"{format_choices(LIST_KEYS)}, got {type(data).__name__} instead."
        )
    known = _known_names() | lists.names()
    adds: dict[str, tuple[str, OpClass]] = {}
    removes: dict[str, tuple[str, OpClass]] = {}
    for key, body in data.items():
        if key not in LIST_KEYS:
            raise ValueError(
                f"`modify_mixlist`: unknown key {key!r}; expected "
                f"{format_choices(LIST_KEYS)}." + suggest(str(key), LIST_KEYS)
            )
        if not isinstance(body, Mapping):
            raise ValueError(
                f"`modify_mixlist`: {key!r} must be an object with "
                f"{format_choices(ACTION_KEYS)}, got {body!r}."
            )
        target = LIST_KEYS[key]
        for action, names in body.items():
            if action not in ACTION_KEYS:
                hint = suggest(str(action), ACTION_KEYS)
                raise ValueError(
                    f"`modify_mixlist`: unknown key {action!r} in {key!r}; expected "
                    f"{format_choices(ACTION_KEYS)}.{hint}"
                )
            where = f"{key!r} {action!r}"
            if isinstance(names, str) or not isinstance(names, list | tuple):
                raise ValueError(
                    f"`modify_mixlist`: {where} must be a list of op names, got "
                    f"{names!r}."
                )
            table = adds if action == "to-add" else removes
            for raw in names:
                name = _check_name(raw, where, known)
                if name in table:
                    prev_key, prev_cls = table[name]
                    if prev_cls != target:
                        verb = "added to" if action == "to-add" else "removed from"
                        raise ValueError(
                            f"`modify_mixlist`: op {name!r} is {verb} both "
                            f"{prev_key!r} and {key!r}; an op goes to one list."
                        )
                table[name] = (key, target)
    for name, (key, target) in removes.items():
        if name in adds and adds[name][1] == target:
            raise ValueError(
                f"`modify_mixlist`: op {name!r} is both added to and removed from "
                f"{key!r}; list it in one of 'to-add' or 'to-remove'."
            )
        current = lists.classify(name) if name in lists.names() else None
        if current != target:
            where_now = f"the {current} list" if current else "no list"
            raise ValueError(
                f"`modify_mixlist`: cannot remove {name!r} from {key!r}: it is in "
                f"{where_now}."
            )
        if target == "infer" and name not in adds:
            raise ValueError(
                f"`modify_mixlist`: {name!r} is removed from 'gray-list' but not "
                "added to another list; add it to 'black-list', 'white-list' or "
                "'clear-list' in the same spec."
            )
    new: dict[str, set[str]] = {
        "allow": set(lists.allow),
        "deny": set(lists.deny),
        "infer": set(lists.infer),
        "clear": set(lists.clear),
    }
    destination: dict[str, OpClass] = {name: "infer" for name in removes}
    destination.update({name: target for name, (_, target) in adds.items()})
    for name, target in destination.items():
        for members in new.values():
            members.discard(name)
        new[target].add(name)
    return OpLists(
        allow=frozenset(new["allow"]),
        deny=frozenset(new["deny"]),
        infer=frozenset(new["infer"]),
        clear=frozenset(new["clear"]),
    )
