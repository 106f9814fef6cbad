"""Helpers that keep error messages uniform: name the argument, the expected
value, what was got, and the valid choices."""

import difflib
from collections.abc import Iterable


def suggest(name: str, choices: Iterable[str], *, n: int = 3) -> str:
    """Returns ``" Did you mean 'x'?"`` for close matches of ``name``, else ``""``.

    Examples:
        >>> suggest("bfloat61", ["bfloat16", "int8"])
        " Did you mean 'bfloat16'?"
    """
    matches = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.6)
    if not matches:
        return ""
    return " Did you mean " + " or ".join(repr(m) for m in matches) + "?"


def format_choices(choices: Iterable[str]) -> str:
    """Returns the sorted choices as ``'a', 'b', 'c'``.

    Examples:
        >>> format_choices(["b", "a"])
        "'a', 'b'"
    """
    return ", ".join(repr(c) for c in sorted(choices))


class AssertValueError(ValueError, AssertionError):
    """A ``ValueError`` that is also an ``AssertionError``.

    JMP checked some arguments with ``assert``, so code written for JMP catches
    ``AssertionError`` where mixprec raises a ``ValueError``; this type
    satisfies both.

    Examples:
        >>> isinstance(AssertValueError("x"), (ValueError, AssertionError))
        True
    """


class AssertTypeError(TypeError, AssertionError):
    """A ``TypeError`` that is also an ``AssertionError`` (see
    :class:`AssertValueError`).

    Examples:
        >>> issubclass(AssertTypeError, AssertionError)
        True
    """
