"""The precision names of the command line: one meaning in every ``mixprec`` command.

On the command line a short name is always a *mixed* precision: ``bf16`` is
``mixed_bfloat16`` (float32 parameters and outputs, bfloat16 compute) in
``mixprec demo -p``, ``mixprec bench -p`` and ``mixprec inspect/diagnose
--policy`` alike, because a mixed policy is what those commands are about.

The library keeps JMP's grammar: ``mixprec.get_policy("bf16")`` is pure
bfloat16 (parameters included, ``p=bf16,c=bf16,o=bf16``), as ``jmp.get_policy``
has it, so that ``import mixprec as jmp`` code keeps working. ``--policy``
accepts JMP strings as well: ``--policy p=bf16,c=bf16,o=bf16`` is the pure
policy. :func:`resolve_policy` says which meaning it picked when the two differ.

Raw float8 (``--policy float8_e4m3fn``: every op, parameters included, in an
8-bit float with no scaling) is refused with a pointer to ``mixed_float8``.
"""

from __future__ import annotations

import difflib
from typing import Any

from .errors import UsageError


# Aliases accepted on the command line for the precisions.
PRECISION_ALIASES = {
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "mixed_bfloat16": "mixed_bfloat16",
    "bf16": "mixed_bfloat16",
    "bfloat16": "mixed_bfloat16",
    "mixed_float16": "mixed_float16",
    "f16": "mixed_float16",
    "fp16": "mixed_float16",
    "float16": "mixed_float16",
    "mixed_float8": "mixed_float8",
    "f8": "mixed_float8",
    "fp8": "mixed_float8",
    "float8": "mixed_float8",
}
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16", "mixed_float8")
# Without `--precision`, the demo runs these (float8 is emulated on CPUs).
DEMO_PRECISIONS = PRECISIONS[:3]
BENCH_PRECISIONS = ("mixed_bfloat16", "mixed_float16", "mixed_float8")


def resolve_policy(text: str, *, command: str) -> tuple[Any, str | None]:
    """The policy ``--policy TEXT`` names on the command line, and a note.

    A precision alias (``bf16``, ``f16``, ``fp8``...) is the mixed precision it
    names in ``mixprec demo`` too; anything else is parsed by
    :func:`mixprec.get_policy` (JMP strings such as ``p=f32,c=bf16,o=f32``, Keras
    names). The note, when not ``None``, says how the alias differs from
    ``mixprec.get_policy(TEXT)``.

    Args:
      text: the value of ``--policy``.
      command: the subcommand, for messages (``"inspect"``).

    Returns:
      ``(policy, note)``: a :class:`mixprec.Policy` and a note or ``None``.

    Raises:
      UsageError: a policy ``mixprec.get_policy`` rejects (the message lists
        the command line's precisions), or raw float8.

    Examples:
      >>> policy, note = resolve_policy("bf16", command="inspect")
      >>> str(policy)
      'p=f32,c=bf16,o=f32'
      >>> print(note)
      `--policy bf16` means mixed_bfloat16 (p=f32,c=bf16,o=f32) on the command ...
      >>> resolve_policy("p=f32,c=bf16,o=f32", command="inspect")[1] is None
      True
      >>> resolve_policy("float8_e4m3fn", command="inspect")
      Traceback (most recent call last):
      ...
      mixprec._src.cli.errors.UsageError: argument --policy: 'float8_e4m3fn' runs ...
    """
    import mixprec

    canonical = PRECISION_ALIASES.get(text.strip().lower())
    try:
        policy = mixprec.get_policy(canonical or text)
    except (ValueError, TypeError) as e:
        raise UsageError("--policy", _bad_policy(text, e)) from None
    note = None
    if canonical is not None:
        try:
            library = mixprec.get_policy(text)
        except (ValueError, TypeError):
            library = None
        if library is not None and library != policy:
            note = (
                f"`--policy {text}` means {canonical} ({policy}) on the command "
                f"line, as in `mixprec demo -p {text}`; `mixprec.get_policy("
                f"{text!r})` is JMP's {library}. Pass `--policy {library}` for that."
            )
    _refuse_raw_float8(policy, text, command)
    return policy, note


def precision_choices() -> str:
    """The precisions of the command line with their aliases, for messages.

    Examples:
      >>> print(precision_choices())
      float32 (f32, fp32), mixed_bfloat16 (bf16, bfloat16), ...
    """
    parts = []
    for name in PRECISIONS:
        aliases = [a for a, v in PRECISION_ALIASES.items() if v == name and a != name]
        parts.append(f"{name} ({', '.join(aliases)})")
    return ", ".join(parts)


def _bad_policy(text: str, error: Exception) -> str:
    """Why ``--policy TEXT`` is refused: a misspelt precision gets the closest
    command-line names and the list of them; a JMP string the reason
    ``mixprec.get_policy`` gives.

    Examples:
      >>> print(_bad_policy("mixed_bfloat61", ValueError("Unknown dtype")))
      unknown policy 'mixed_bfloat61'; did you mean 'mixed_bfloat16' or ...
    """
    if "=" in text:  # a JMP string: p=...,c=...,o=...
        return (
            f"invalid policy {text!r}: {error} A JMP string sets the dtypes of "
            "the parameters, the compute and the outputs, e.g. "
            "p=f32,c=bf16,o=f32."
        )
    close = difflib.get_close_matches(
        text.strip().lower(), list(PRECISION_ALIASES), n=2, cutoff=0.6
    )
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return (
        f"unknown policy {text!r}{hint} (choose from {precision_choices()}, or a "
        "JMP string such as p=f32,c=bf16,o=f32)"
    )


def _refuse_raw_float8(policy: Any, text: str, command: str) -> None:
    import numpy as np

    dtypes = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    raw = [d for d in dtypes if np.dtype(d).itemsize == 1]
    if raw and policy.float8 is None:
        raise UsageError(
            "--policy",
            f"{text!r} runs every op in {np.dtype(raw[0]).name} "
            f"({policy}): no scaling, and softmax, norms, sums and the parameters "
            "in 8 bits, where most values overflow or flush to zero. float8 is "
            "meant for matmuls only, with per-tensor scales: use `--policy "
            "mixed_float8` (bfloat16 compute, scaled float8 matmuls), or a JMP "
            "string with a recipe such as `p=f32,c=bf16,o=f32,f8=rowwise`.",
        )
