"""``mixprec bench``: workloads x precision x mechanism, timed fairly.

For each workload (the Keras-guide MLP, a GPT-style LM, a ResNet-style CNN; the
models of ``models.py``) it builds one training step per variant:

* ``float32``: the plain ``jax.numpy`` model (the baseline of every ratio);
* ``float32 (flax)``: the same model written with Flax linen (when ``flax`` is among
  the mechanisms), the baseline of the Flax rows;
* for each mixed precision (``mixed_bfloat16``, ``mixed_float16``) and mechanism:

  - ``manual``: hand-written casting, JMP style: ``policy.cast_to_compute`` of the
    parameters and inputs, ``policy.cast_to_output`` of the result;
  - ``flax``: Flax modules with ``dtype=<compute dtype>, param_dtype=float32``;
  - ``autocast``: the unchanged float32 model under ``mixprec.autocast``.

Every step is a full training step: loss-scaled ``mixprec.value_and_grad`` (dynamic
loss scaling for float16), Adam through ``mixprec.optax.loss_scaled`` (the demo's
``train.make_step``). Steps are compiled ahead of time, warmed up, then timed with
``timing.interleaved`` (every variant once per round, the order rotating between
rounds) so that drifts in machine load hit every variant alike. Reported: the
median (and min) time per step over rounds, ratios to float32, XLA's memory
analysis of the compiled step and the bytes saved for the backward pass.
Synthetic inputs of the real shapes are used: this measures speed and memory, not
accuracy (see ``benchmarks/bench_accuracy.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import CLIError


MECHANISMS = ("manual", "flax", "autocast")
WORKLOADS = ("mlp", "lm", "cnn")
SIZE_SETS = ("cpu", "gpu", "tiny")
# Precisions with no hand-written or Flax counterpart: why they run by autocast only.
AUTOCAST_ONLY = {
    "mixed_float8": "float8 matmuls need per-tensor scales, which only "
    "`mixprec.autocast` inserts (there is no hand-written or Flax float8 "
    "variant); run with `-m autocast`",
}


# ----------------------------------------------------------------------------- platform


def current_platform() -> str:
    """``"gpu"`` on a GPU (CUDA or ROCm), else JAX's backend (``"cpu"``, ``"tpu"``)."""
    import jax

    from ..workloads import timing

    return "gpu" if timing.on_gpu() else jax.default_backend()


def default_size_set(platform: str) -> str:
    """The size set run without ``--size``: ``"gpu"`` on a GPU, else ``"cpu"``.

    Examples:
      >>> default_size_set("gpu"), default_size_set("cpu")
      ('gpu', 'cpu')
    """
    return "gpu" if platform == "gpu" else "cpu"


def default_precisions(platform: str) -> list[str]:
    """The mixed precisions compared with float32 without ``--precision``.

    float16 matmuls are native on GPUs only; a CPU emulates them (float32 GEMMs
    on float16-rounded operands) and TPUs have none, so float16 is benchmarked
    on GPUs only unless asked for.

    Examples:
      >>> default_precisions("gpu"), default_precisions("cpu")
      (['mixed_bfloat16', 'mixed_float16'], ['mixed_bfloat16'])
    """
    if platform == "gpu":
        return ["mixed_bfloat16", "mixed_float16"]
    return ["mixed_bfloat16"]


def default_steps(platform: str) -> int:
    """Timed steps per variant and round without ``--steps``: a GPU step takes
    milliseconds, so more of them make a round long enough to time.

    Examples:
      >>> default_steps("gpu"), default_steps("cpu")
      (20, 5)
    """
    return 20 if platform == "gpu" else 5


# ----------------------------------------------------------------------------- sizes


def workload_configs(size_set: str) -> dict[str, tuple[Any, int]]:
    """``workload -> (model config, batch size)`` for a size set.

    ``gpu``: the Keras guide's MLP at 4096 units and batch 8192; a GPT-2-small-sized
    LM (12 layers, d_model 768, 12 heads, context 1024, a GPT-2-sized vocabulary of
    50,304, batch 8); a ResNet-18-style CNN (widths 64-512, 2 blocks per stage,
    128x128x3 images, batch 128).

    Examples:
      >>> config, batch = workload_configs("gpu")["lm"]
      >>> config.d_model, batch
      (768, 8)
    """
    from ..workloads.models import CNNConfig, LMConfig, MLPConfig

    if size_set == "cpu":
        return {
            "mlp": (MLPConfig(units=1024), 512),
            "lm": (
                LMConfig(
                    vocab_size=81, seq_len=128, d_model=128, num_heads=4, num_layers=2
                ),
                16,
            ),
            "cnn": (CNNConfig(image_size=28, in_channels=1, widths=(32, 64)), 64),
        }
    if size_set == "gpu":
        return {
            "mlp": (MLPConfig(units=4096), 8192),
            "lm": (
                LMConfig(
                    vocab_size=50304,
                    seq_len=1024,
                    d_model=768,
                    num_heads=12,
                    num_layers=12,
                ),
                8,
            ),
            "cnn": (
                CNNConfig(
                    image_size=128,
                    in_channels=3,
                    widths=(64, 128, 256, 512),
                    blocks_per_stage=2,
                ),
                128,
            ),
        }
    if size_set == "tiny":
        return {
            "mlp": (MLPConfig(units=32), 16),
            "lm": (
                LMConfig(
                    vocab_size=17, seq_len=16, d_model=16, num_heads=2, num_layers=1
                ),
                4,
            ),
            "cnn": (CNNConfig(image_size=12, in_channels=1, widths=(4, 8)), 4),
        }
    raise CLIError(f"unknown size set {size_set!r}; valid: {', '.join(SIZE_SETS)}")


# ----------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class Spec:
    """One workload: a float32 jnp model, its Flax twin, a synthetic batch."""

    name: str
    title: str
    init: Callable[[Any], Any]
    apply: Callable[[Any, Any], Any]
    flax_module: Callable[[Any], Any]  # compute dtype -> linen Module
    batch: tuple[Any, Any]
    # XLA options for compiling its steps (``SMOKE_COMPILE_OPTIONS`` for tiny).
    compile_options: dict[str, Any] | None = None


def make_spec(name: str, config: Any, batch_size: int) -> Spec:
    """Builds one workload's models and synthetic batch.

    Examples:
      >>> from mixprec._src.workloads.models import MLPConfig
      >>> make_spec("mlp", MLPConfig(units=8), 4).batch[0].shape
      (4, 784)
    """
    import functools as ft

    import jax
    import jax.numpy as jnp

    from ..workloads import models

    # The initialisers are jitted: one compilation per workload, where eager
    # `jax.random` calls compile one small program per parameter shape.
    rng = np.random.default_rng(0)
    b = batch_size
    if name == "mlp":
        batch = (
            jnp.asarray(rng.random((b, config.in_features), np.float32)),
            jnp.asarray(rng.integers(0, config.classes, b), jnp.int32),
        )
        return Spec(
            name,
            f"Keras-guide MLP {config.sizes}, batch {b}",
            jax.jit(ft.partial(models.mlp_init, config=config)),
            models.mlp_apply,
            ft.partial(models.flax_mlp, config),
            batch,
        )
    if name == "lm":
        tokens = rng.integers(0, config.vocab_size, (b, config.seq_len + 1))
        tokens = tokens.astype(np.int32)
        title = (
            f"GPT-style LM, {config.num_layers} layers, d_model {config.d_model}, "
            f"{config.num_heads} heads, context {config.seq_len}, vocab "
            f"{config.vocab_size}, {config.num_params / 1e6:.1f} M params, batch {b}"
        )
        return Spec(
            name,
            title,
            jax.jit(ft.partial(models.lm_init, config=config)),
            ft.partial(models.lm_apply, num_heads=config.num_heads),
            ft.partial(models.flax_lm, config),
            (jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])),
        )
    if name == "cnn":
        shape = (b, config.image_size, config.image_size, config.in_channels)
        batch = (
            jnp.asarray(rng.random(shape, np.float32)),
            jnp.asarray(rng.integers(0, config.classes, b), jnp.int32),
        )
        title = (
            f"ResNet-style CNN, widths {'-'.join(map(str, config.widths))}, "
            f"{config.blocks_per_stage} blocks/stage, {config.image_size}x"
            f"{config.image_size}x{config.in_channels} images, batch {b}"
        )
        return Spec(
            name,
            title,
            jax.jit(ft.partial(models.cnn_init, config=config)),
            models.cnn_apply,
            ft.partial(models.flax_cnn, config),
            batch,
        )
    raise CLIError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")


# ----------------------------------------------------------------------------- variants


@dataclasses.dataclass
class Variant:
    """One (workload, precision, mechanism) training step and its measurements."""

    workload: str
    precision: str
    mechanism: str
    baseline: str  # label of the float32 variant of the same implementation
    times_ms: list[float] = dataclasses.field(default_factory=list)
    compile_s: float = math.nan
    memory: dict[str, int | None] = dataclasses.field(default_factory=dict)
    final_loss: float = math.nan
    skipped_steps: int = 0
    error: str | None = None
    step: Any = None
    state: Any = None
    metrics: Any = None

    @property
    def label(self) -> str:
        if self.precision == "float32":
            return "float32" if self.mechanism == "float32" else "float32 (flax)"
        return f"{self.precision} ({self.mechanism})"

    @property
    def median_ms(self) -> float:
        return float(np.median(self.times_ms)) if self.times_ms else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "label": self.label,
            "precision": self.precision,
            "mechanism": self.mechanism,
            "times_ms": self.times_ms,
            "median_ms": self.median_ms,
            "min_ms": min(self.times_ms) if self.times_ms else math.nan,
            "compile_s": self.compile_s,
            "memory": self.memory,
            "final_loss": self.final_loss,
            "skipped_steps": self.skipped_steps,
            "error": self.error,
        }


def _build(variant: Variant, spec: Spec) -> None:
    """Compiles the variant's training step (sets ``step``, ``state``, memory)."""
    import jax
    import jax.numpy as jnp
    import optax

    import mixprec

    from ..workloads import models, timing, train

    policy = (
        None
        if variant.precision == "float32"
        else mixprec.get_policy(variant.precision)
    )
    key = jax.random.key(0)
    fwd: Callable[[Any, Any], Any]
    if variant.mechanism in ("flax", "flax-float32"):
        dtype = jnp.float32 if policy is None else policy.compute_dtype
        module = spec.flax_module(dtype)
        params = jax.jit(module.init)(key, spec.batch[0])

        def flax_fwd(p: Any, x: Any) -> Any:
            return module.apply(p, x)

        fwd = flax_fwd
    else:
        params = spec.init(key)
        if policy is None:
            fwd = spec.apply
        elif variant.mechanism == "manual":
            pol = policy

            def manual_fwd(p: Any, x: Any) -> Any:
                out = spec.apply(pol.cast_to_compute(p), pol.cast_to_compute(x))
                return pol.cast_to_output(out)

            fwd = manual_fwd
        elif variant.mechanism == "autocast":
            fwd = mixprec.autocast(spec.apply, policy)
        else:  # pragma: no cover - guarded by the CLI
            raise CLIError(f"unknown mechanism {variant.mechanism!r}")

    def loss_fn(p: Any, batch: Any) -> tuple[Any, Any]:
        x, y = batch
        return models.cross_entropy(fwd(p, x), y), None

    ls = train.initial_loss_scale(variant.precision, period=2000)
    step, state = train.make_step(loss_fn, params, optax.adam(1e-4), ls)
    t0 = time.perf_counter()
    compiled = (
        jax.jit(step, donate_argnums=0)
        .lower(state, spec.batch)
        .compile(spec.compile_options)
    )
    variant.compile_s = time.perf_counter() - t0
    variant.memory = timing.memory_analysis(compiled)
    variant.memory["residual_bytes"] = timing.residual_bytes(
        lambda p, b: loss_fn(p, b)[0], params, spec.batch
    )
    variant.step, variant.state = compiled, state


def _steps_fn(variant: Variant, batch: Any, n: int) -> Callable[[], Any]:
    """A function that runs ``n`` of the variant's steps back to back."""

    def run() -> Any:
        for _ in range(n):
            variant.state, variant.metrics = variant.step(variant.state, batch)
        return variant.state, variant.metrics

    return run


# ----------------------------------------------------------------------------- run


def _log(enabled: bool, msg: str) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def run_bench(
    *,
    workloads: Sequence[str] = WORKLOADS,
    precisions: Sequence[str] | None = None,
    mechanisms: Sequence[str] = MECHANISMS,
    size_set: str | None = None,
    repeats: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    out: str | pathlib.Path = "mixprec-out/bench",
    progress: bool = True,
) -> int:
    """Runs the benchmark; writes ``bench.json`` and ``bench.md``; prints the table.

    Args:
      workloads: from :data:`WORKLOADS`.
      precisions: mixed precisions to compare with float32 (default:
        :func:`default_precisions` of this platform: bfloat16, and float16 too
        on a GPU).
      mechanisms: from :data:`MECHANISMS`.
      size_set: ``"cpu"``, ``"gpu"`` or ``"tiny"`` (default:
        :func:`default_size_set`: ``"gpu"`` on a GPU, ``"cpu"`` elsewhere).
      repeats: interleaved timing rounds (default 5; 2 for ``"tiny"``).
      steps: timed steps per variant per round (default: :func:`default_steps`,
        5 on CPU, 20 on GPU; 1 for ``"tiny"``).
      warmup: untimed steps per variant after compiling (default 2; 1 for
        ``"tiny"``).
      out: output folder.
      progress: log progress to stderr.

    Returns:
      0 when every variant ran.

    Raises:
      CLIError: a bad size set or workload, or variants that failed (raised after
        the others' results are written).
    """
    import jax

    from ..workloads import timing

    here = current_platform()
    size_set = size_set or default_size_set(here)
    configs = workload_configs(size_set)
    if precisions is None:
        precisions = default_precisions(here)
    smoke = size_set == "tiny"
    if steps is None:
        steps = 1 if smoke else default_steps(here)
    if repeats is None:
        repeats = 2 if smoke else 5
    if warmup is None:
        warmup = 1 if smoke else 2
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with_flax = "flax" in mechanisms

    t_start = time.perf_counter()
    load_start = timing.loadavg()
    specs: dict[str, Spec] = {}
    variants: list[Variant] = []
    not_run: dict[str, dict[str, None]] = {}  # precision -> mechanisms
    for name in workloads:
        if name not in configs:
            raise CLIError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
        specs[name] = make_spec(name, *configs[name])
        if smoke:
            specs[name] = dataclasses.replace(
                specs[name], compile_options=SMOKE_COMPILE_OPTIONS
            )
        variants.append(Variant(name, "float32", "float32", "float32"))
        if with_flax:
            variants.append(Variant(name, "float32", "flax-float32", "float32 (flax)"))
        for precision in precisions:
            for mech in mechanisms:
                if precision in AUTOCAST_ONLY and mech != "autocast":
                    not_run.setdefault(precision, {})[mech] = None
                    continue
                base = "float32 (flax)" if mech == "flax" else "float32"
                variants.append(Variant(name, precision, mech, base))

    if smoke:
        _log(progress, SMOKE_WARNING)
    for i, v in enumerate(variants):
        elapsed = time.perf_counter() - t_start
        eta = f", about {elapsed / i * (len(variants) - i):.0f} s left" if i else ""
        _log(
            progress,
            f"[{elapsed:5.0f} s] compiling {v.workload}: {v.label} ({i + 1} of "
            f"{len(variants)}{eta}) ...",
        )
        try:
            _build(v, specs[v.workload])
            if warmup:
                jax.block_until_ready(_steps_fn(v, specs[v.workload].batch, warmup)())
            # GPU: the process's high-water mark so far (None on CPU); variants
            # run in this order, so only an increase is this variant's.
            v.memory["device_peak_bytes"] = timing.device_peak_bytes()
        except Exception as e:  # a variant that fails is reported, not fatal
            v.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            _log(progress, f"  failed: {v.error}")

    live = [v for v in variants if v.error is None]
    _log(
        progress,
        f"[{time.perf_counter() - t_start:5.0f} s] timing {len(live)} variants x "
        f"{repeats} interleaved rounds of {steps} steps ...",
    )
    times = timing.interleaved(
        {
            str(i): _steps_fn(v, specs[v.workload].batch, steps)
            for i, v in enumerate(live)
        },
        rounds=repeats,
    )
    for i, v in enumerate(live):
        v.times_ms = [1e3 * t / steps for t in times[str(i)]]
        if v.metrics is not None:
            m = jax.device_get(v.metrics)
            v.final_loss = float(m["loss"])
            if "num_skipped" in m:
                v.skipped_steps = int(m["num_skipped"])

    env = timing.environment()
    meta = {
        **({"smoke test": SMOKE_WARNING} if smoke else {}),
        "date": env["date"],
        "device": env["device"],
        "jax": env["jax"],
        "jaxlib": env["jaxlib"],
        "mixprec": env["mixprec"],
        "python": env["python"],
        "machine": env["machine"],
        "cpu": env["cpu_model"],
        "cpu cores": env["cpu_count"],
        "cpu flags": timing.flags_summary(env["cpu_flags"]),
        "load average at start (1, 5, 15 min)": _load_text(load_start),
        "load average at end (1, 5, 15 min)": _load_text(env["loadavg"]),
        "16-bit matmuls": _matmul_support(env["backend"]),
        "platform": here,
        "size set": size_set,
        "precisions": ", ".join(precisions),
        "repeats": repeats,
        "timed steps per round": steps,
        "warm-up steps": warmup,
        "wall time (s)": round(time.perf_counter() - t_start, 1),
        **(
            {
                "not run": "; ".join(
                    f"{p} with {', '.join(m)}: {AUTOCAST_ONLY[p]}"
                    for p, m in not_run.items()
                )
            }
            if not_run
            else {}
        ),
    }
    payload = {
        "meta": meta,
        "smoke": smoke,
        "environment": env,
        "workloads": {name: spec.title for name, spec in specs.items()},
        "variants": [_with_ratios(v, variants, smoke=smoke) for v in variants],
    }
    (out_dir / "bench.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = markdown(payload)
    (out_dir / "bench.md").write_text(md)
    print(md)
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'}")
    failed = [v for v in variants if v.error is not None]
    if failed:
        raise CLIError(
            f"{len(failed)} of {len(variants)} variants failed ("
            + "; ".join(f"{v.workload} {v.label}: {v.error}" for v in failed)
            + f"); the others are in {out_dir / 'bench.md'}"
        )
    return 0


def _matmul_support(platform: str) -> str:
    from ..autocast import capability
    from .demo.report import matmul_support

    return matmul_support(
        platform, capability.cpu_bf16() if platform == "cpu" else None
    )


SMOKE_WARNING = (
    "SMOKE TEST (--size tiny): toy models for a few steps, to check that every "
    "variant builds and runs, compiled with cheap optimisations only; its step "
    "times and ratios are not measurements (use --size cpu or gpu for those)"
)


# A smoke test's steps are compiled with LLVM's cheap optimisations only: half
# the compile time of a tiny LM step on CPU (2.0 s of CPU against 4.6 s), and
# its timings are not measurements anyway.
SMOKE_COMPILE_OPTIONS: dict[str, Any] = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def _load_text(load: Sequence[float] | None) -> str:
    return "unknown" if load is None else ", ".join(f"{x:.2f}" for x in load)


def _with_ratios(
    v: Variant, variants: Sequence[Variant], *, smoke: bool = False
) -> dict[str, Any]:
    """The variant's JSON with its ratios to float32 and their noise: the
    per-round range of each ratio (``timing.round_ratios``) and whether it
    includes 1.0 (``*_within_noise``)."""
    from ..workloads.timing import ratio, round_ratios, within_noise

    d = v.to_dict()
    same = [w for w in variants if w.workload == v.workload and w.error is None]
    f32 = next((w for w in same if w.label == "float32"), None)
    base = next((w for w in same if w.label == v.baseline), None)
    for key, ref in (("vs_float32", f32), ("vs_own_float32", base)):
        d[f"speedup_{key}"] = ratio(ref.median_ms, v.median_ms) if ref else math.nan
        spread = round_ratios(ref.times_ms, v.times_ms) if ref else None
        d[f"speedup_{key}_round_range"] = None if spread is None else list(spread)
        d[f"speedup_{key}_within_noise"] = ref is not v and within_noise(spread)
    d["timing_is_measurement"] = not smoke
    return d


def _ratio_cell(v: dict[str, Any], key: str, smoke: bool) -> str:
    cell = f"{_fmt(v[f'speedup_{key}'], '.2f')}x"
    if smoke:
        return cell + " (smoke)"
    return cell + " (noise)" if v.get(f"speedup_{key}_within_noise") else cell


def _fmt(x: Any, fmt: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, fmt)


def markdown(payload: dict[str, Any]) -> str:
    """The benchmark's markdown report (one table, grouped by workload).

    Examples:
      >>> p = {"meta": {"device": "cpu"}, "workloads": {"mlp": "MLP"}, "variants": []}
      >>> markdown(p).splitlines()[0]
      '# mixprec bench'
    """
    mib = 1024.0 * 1024.0
    smoke = bool(payload.get("smoke"))
    lines = ["# mixprec bench", ""]
    if smoke:
        lines += [f"**{SMOKE_WARNING}.**", ""]
    lines += [f"- {k}: {v}" for k, v in payload["meta"].items() if k != "smoke test"]
    lines += [""]
    lines += [f"- **{k}**: {v}" for k, v in payload["workloads"].items()]
    lines += [
        "",
        "| workload | variant | ms/step (median) | min | vs float32 | vs own float32 "
        "| XLA temp MiB | saved-for-bwd MiB | compile s | skipped steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in payload["variants"]:
        if v["error"]:
            lines.append(
                f"| {v['workload']} | {v['label']} | failed: {v['error']} "
                + "| " * 7
                + "|"
            )
            continue
        temp = v["memory"].get("temp_bytes")
        res = v["memory"].get("residual_bytes")
        lines.append(
            f"| {v['workload']} | {v['label']} | {_fmt(v['median_ms'], '.2f')} "
            f"| {_fmt(v['min_ms'], '.2f')} "
            f"| {_ratio_cell(v, 'vs_float32', smoke)} "
            f"| {_ratio_cell(v, 'vs_own_float32', smoke)} "
            f"| {_fmt(temp / mib if temp is not None else None, '.1f')} "
            f"| {_fmt(res / mib if res is not None else None, '.1f')} "
            f"| {_fmt(v['compile_s'], '.1f')} | {v['skipped_steps']} |"
        )
    lines += [
        "",
        "vs float32: the plain float32 model's median step time / this one's (>1 is "
        "faster). vs own float32: the same against the float32 run of the same "
        "implementation (Flax rows against Flax float32). Full training steps (loss-"
        "scaled gradients + Adam), interleaved rounds, warm-up and compilation "
        "excluded. skipped steps: non-finite steps (float16) over warm-up and timing; "
        "a variant that skips every step is not training, whatever its speed. "
        "(noise): the ratio of the per-round times was above 1 in some rounds "
        "and below in others, so the two step times cannot be told apart "
        "(bench.json has each ratio's per-round range).",
    ]
    return "\n".join(lines) + "\n"
