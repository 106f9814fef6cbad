"""A corpus of JAX programs written the way users write them, for autocast tests.

Each program builds an :class:`Instance`: parameters, inputs and a loss, and
optionally a whole train step (gradient + optimizer update) with its optimizer
state. ``tests/test_autocast_corpus.py`` runs every program under
``mixprec.autocast`` and checks it against the same program in float32.

Programs are registered with :func:`program` and built lazily (inside the test,
under the test's dtype-promotion mode); :data:`PROGRAMS` maps a name to its
:class:`Program`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax


@dataclasses.dataclass
class Instance:
    """One built program.

    Attributes:
        params: the differentiated argument of ``loss`` (float32 pytree).
        args: the other arguments of ``loss`` (inputs, labels, PRNG keys).
        loss: ``loss(params, *args)``: a scalar, or ``(scalar, aux)`` with
            ``has_aux``. With ``kind="fn"`` any pytree of outputs (compared, not
            differentiated).
        has_aux: ``loss`` returns ``(scalar, aux)``; aux is compared too.
        kind: ``"loss"`` (differentiated) or ``"fn"`` (outputs compared with the
            gradient tolerance: the function computes gradients itself).
        train_state: the state a train step carries (params, optimizer state...).
        step: ``step(train_state, *step_args) -> (new_state, loss, grads)``: a
            whole train step, returning the gradients its update used.
        update: ``update(train_state, grads, *step_args) -> new_state``: the
            optimizer part of ``step`` alone, in float32. autocast(step)'s
            ``exact(new_state)`` must be bit for bit ``jax.jit(update)``'s.
        exact: selects the part of a train state that the optimizer produces
            (default: all of it).
        jit: how the program's own code jits a step (``jax.jit``, or
            ``equinox.filter_jit`` for a model with non-array leaves).
        step_args: the arguments of ``step`` after the state (default ``args``).
        batches: ``batches(i) -> step_args`` for a short run (default: the same
            batch every step).
        step_decreases: the step's loss goes down over a short run.
        accuracy: ``accuracy(train_state) -> float`` on held-out digits.
        highest_dots: forward dots written with ``precision=HIGHEST``.
        check: a program-specific check, ``check(policy, got, ref)`` with the
            outputs of ``jax.value_and_grad(loss, has_aux)`` (or of ``loss`` for
            ``kind="fn"``) under autocast and in float32.
    """

    params: Any
    args: tuple[Any, ...]
    loss: Callable[..., Any]
    has_aux: bool = False
    kind: str = "loss"
    train_state: Any = None
    step: Callable[..., Any] | None = None
    update: Callable[..., Any] | None = None
    exact: Callable[[Any], Any] = lambda state: state
    jit: Callable[..., Any] = jax.jit
    step_args: tuple[Any, ...] | None = None
    batches: Callable[[int], tuple[Any, ...]] | None = None
    step_decreases: bool = True
    accuracy: Callable[[Any], float] | None = None
    highest_dots: int = 0
    check: Callable[[str, Any, Any], None] | None = None


@dataclasses.dataclass(frozen=True)
class Program:
    """A registered program: a name, tags and a builder."""

    name: str
    build: Callable[[], Instance]
    tags: frozenset[str]
    doc: str


PROGRAMS: dict[str, Program] = {}


def program(*tags: str) -> Callable[[Callable[[], Instance]], Callable[[], Instance]]:
    """Registers a builder under its function name.

    Tags (read without building the program): ``"step"`` (has a train step),
    ``"fn"`` (``kind="fn"``), ``"standard_promotion"`` (third-party code that
    needs implicit promotion), ``"derived"`` (a train step around another
    program's model: its loss tests would repeat that program's), ``"masked"``
    (padded attention with fully masked rows), ``"digits"`` (trained for a
    short run on real data).
    """

    def register(build: Callable[[], Instance]) -> Callable[[], Instance]:
        name = build.__name__
        if name in PROGRAMS:
            raise ValueError(f"program {name!r} registered twice")
        doc = (build.__doc__ or "").strip().splitlines()[0] if build.__doc__ else ""
        PROGRAMS[name] = Program(name, build, frozenset(tags), doc)
        return build

    return register


# Importing the modules registers their programs.
from . import (  # noqa: E402, F401
    attention,
    cnn,
    control,
    mlp,
    mnist,
    nlp,
    norms,
    padding_bias,
    rnn,
    scan_layers,
    steps,
    vae,
)
