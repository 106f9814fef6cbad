"""``mixprec bench``: workloads x precision x mechanism, timed fairly.

For each workload (the Keras-seed MLP, a GPT-style LM, a ResNet-style CNN) it builds
one training step per variant:

* ``float32``: the plain ``jax.numpy`` model (the baseline of every ratio);
* ``float32 (flax)``: the same model written with Flax linen (when ``flax`` is among
  the mechanisms), the baseline of the Flax rows;
* for each mixed precision (``mixed_bfloat16``, ``mixed_float16``) and mechanism:

  - ``manual``: hand-written casting, JMP style: ``policy.cast_to_compute`` of the
    parameters and inputs, ``policy.cast_to_output`` of the result;
  - ``flax``: Flax modules with ``dtype=<compute dtype>, param_dtype=float32``;
  - ``autocast``: the unchanged float32 model under ``mixprec.autocast``.

Every step is a full training step: loss-scaled ``mixprec.value_and_grad`` (dynamic
loss scaling for float16), Adam through ``mixprec.optax.loss_scaled``. Steps are
compiled ahead of time, warmed up, then timed in interleaved rounds (every variant
once per round, the order rotating between rounds) so that drifts in machine load
hit every variant alike. Reported: the median (and min) time per step over rounds,
ratios to float32, XLA's memory analysis of the compiled step and the bytes saved
for the backward pass. Synthetic inputs of the real shapes are used: this measures
speed and memory, not accuracy (see ``benchmarks/bench_accuracy.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


MECHANISMS = ("manual", "flax", "autocast")
WORKLOADS = ("mlp", "lm", "cnn")
SIZE_SETS = ("cpu", "gpu", "tiny")


class BenchError(Exception):
    """A user-facing error of the benchmark (bad combination of options, ...)."""


# ----------------------------------------------------------------------------- sizes


def workload_sizes(size_set: str) -> dict[str, dict[str, Any]]:
    """Model and batch sizes per workload for a size set.

    ``gpu``: the Keras guide's MLP at 4096 units and batch 8192; a GPT-2-small-sized
    LM (12 layers, d_model 768, 12 heads, context 1024, a GPT-2-sized vocabulary of
    50,304, batch 8); a ResNet-18-style CNN (widths 64-512, 2 blocks per stage,
    128x128x3 images, batch 128).

    Examples:
      >>> workload_sizes("gpu")["lm"]["d_model"]
      768
    """
    if size_set == "cpu":
        return {
            "mlp": {"units": 1024, "batch": 512},
            "lm": {
                "vocab": 81,
                "seq_len": 128,
                "d_model": 128,
                "heads": 4,
                "layers": 2,
                "batch": 16,
            },
            "cnn": {
                "image": 28,
                "channels": 1,
                "widths": (32, 64),
                "blocks": 1,
                "batch": 64,
            },
        }
    if size_set == "gpu":
        return {
            "mlp": {"units": 4096, "batch": 8192},
            "lm": {
                "vocab": 50304,
                "seq_len": 1024,
                "d_model": 768,
                "heads": 12,
                "layers": 12,
                "batch": 8,
            },
            "cnn": {
                "image": 128,
                "channels": 3,
                "widths": (64, 128, 256, 512),
                "blocks": 2,
                "batch": 128,
            },
        }
    if size_set == "tiny":
        return {
            "mlp": {"units": 32, "batch": 16},
            "lm": {
                "vocab": 17,
                "seq_len": 16,
                "d_model": 16,
                "heads": 2,
                "layers": 1,
                "batch": 4,
            },
            "cnn": {
                "image": 12,
                "channels": 1,
                "widths": (4, 8),
                "blocks": 1,
                "batch": 4,
            },
        }
    raise BenchError(f"unknown size set {size_set!r}; valid: {', '.join(SIZE_SETS)}")


# ----------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class Spec:
    """One workload: a float32 jnp model, its Flax twin, a synthetic batch."""

    name: str
    title: str
    init: Callable[[Any], Any]
    apply: Callable[[Any, Any], Any]
    flax_module: Callable[[Any], Any] | None  # compute dtype -> linen Module
    batch: tuple[Any, Any]


def _flax_modules() -> dict[str, Callable[..., Any]]:
    """Flax linen versions of the three models (imports flax lazily)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class MLP(nn.Module):
        units: int
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x: Any) -> Any:
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            x = nn.relu(nn.Dense(self.units, **kw)(x))
            x = nn.relu(nn.Dense(self.units, **kw)(x))
            logits = nn.Dense(10, **kw)(x)
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    class Block(nn.Module):
        d_model: int
        heads: int
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x: Any, mask: Any) -> Any:
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            h = nn.LayerNorm(**kw)(x)
            h = nn.MultiHeadDotProductAttention(num_heads=self.heads, **kw)(
                h, h, mask=mask
            )
            x = x + h
            h = nn.LayerNorm(**kw)(x)
            h = nn.gelu(nn.Dense(4 * self.d_model, **kw)(h))
            return x + nn.Dense(self.d_model, **kw)(h)

    class LM(nn.Module):
        vocab: int
        seq_len: int
        d_model: int
        heads: int
        layers: int
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            x = nn.Embed(self.vocab, self.d_model, **kw)(tokens)
            pos = self.param(
                "pos_emb", nn.initializers.normal(0.01), (self.seq_len, self.d_model)
            )
            x = x + pos[None, : tokens.shape[1]].astype(x.dtype)
            mask = nn.make_causal_mask(tokens)
            for _ in range(self.layers):
                x = Block(self.d_model, self.heads, dtype=self.dtype)(x, mask)
            x = nn.LayerNorm(**kw)(x)
            logits = nn.Dense(self.vocab, **kw)(x)
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    class CNN(nn.Module):
        widths: tuple[int, ...]
        blocks: int
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x: Any) -> Any:
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32, use_bias=False)
            x = nn.relu(nn.Conv(self.widths[0], (3, 3), **kw)(x))
            cin = self.widths[0]
            for s, width in enumerate(self.widths):
                for b in range(self.blocks):
                    stride = 2 if (s > 0 and b == 0) else 1
                    h = nn.relu(nn.Conv(width, (3, 3), strides=stride, **kw)(x))
                    h = nn.Conv(width, (3, 3), **kw)(h)
                    gain = self.param(f"gain_{s}_{b}", nn.initializers.zeros, ())
                    short = x
                    if b == 0 and (cin != width or s > 0):
                        short = nn.Conv(width, (1, 1), strides=stride, **kw)(x)
                    x = nn.relu(short + gain.astype(h.dtype) * h)
                    cin = width
            x = jnp.mean(x, axis=(1, 2))
            logits = nn.Dense(10, dtype=self.dtype, param_dtype=jnp.float32)(x)
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    return {"mlp": MLP, "lm": LM, "cnn": CNN}


def make_spec(name: str, sizes: dict[str, Any], *, with_flax: bool) -> Spec:
    """Builds one workload's models and synthetic batch."""
    import jax
    import jax.numpy as jnp

    from .demo import models

    rng = np.random.default_rng(0)
    flax_cls = _flax_modules()[name] if with_flax else None
    if name == "mlp":
        cfg = models.MLPConfig(units=sizes["units"])
        b = sizes["batch"]
        batch = (
            jnp.asarray(rng.random((b, 784), np.float32)),
            jnp.asarray(rng.integers(0, 10, b), jnp.int32),
        )
        title = f"Keras-seed MLP 784-{cfg.units}-{cfg.units}-10, batch {b}"
        return Spec(
            name,
            title,
            lambda key: models.mlp_init(key, cfg),
            models.mlp_apply,
            (lambda dt: flax_cls(units=cfg.units, dtype=dt)) if flax_cls else None,
            batch,
        )
    if name == "lm":
        cfg = models.LMConfig(
            vocab_size=sizes["vocab"],
            seq_len=sizes["seq_len"],
            d_model=sizes["d_model"],
            num_heads=sizes["heads"],
            num_layers=sizes["layers"],
        )
        b = sizes["batch"]
        tokens = rng.integers(0, cfg.vocab_size, (b, cfg.seq_len + 1)).astype(np.int32)
        batch = (jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))
        title = (
            f"GPT-style LM, {cfg.num_layers} layers, d_model {cfg.d_model}, "
            f"{cfg.num_heads} heads, context {cfg.seq_len}, vocab {cfg.vocab_size}, "
            f"{cfg.num_params / 1e6:.1f} M params, batch {b}"
        )
        heads = cfg.num_heads

        def lm_apply(p: Any, t: Any) -> Any:
            return models.lm_apply(p, t, num_heads=heads)

        return Spec(
            name,
            title,
            lambda key: models.lm_init(key, cfg),
            lm_apply,
            (
                lambda dt: flax_cls(
                    vocab=cfg.vocab_size,
                    seq_len=cfg.seq_len,
                    d_model=cfg.d_model,
                    heads=cfg.num_heads,
                    layers=cfg.num_layers,
                    dtype=dt,
                )
            )
            if flax_cls
            else None,
            batch,
        )
    if name == "cnn":
        cfg = models.CNNConfig(
            image_size=sizes["image"],
            in_channels=sizes["channels"],
            widths=tuple(sizes["widths"]),
            blocks_per_stage=sizes["blocks"],
        )
        b = sizes["batch"]
        shape = (b, cfg.image_size, cfg.image_size, cfg.in_channels)
        batch = (
            jnp.asarray(rng.random(shape, np.float32)),
            jnp.asarray(rng.integers(0, 10, b), jnp.int32),
        )
        title = (
            f"ResNet-style CNN, widths {'-'.join(map(str, cfg.widths))}, "
            f"{cfg.blocks_per_stage} blocks/stage, {cfg.image_size}x{cfg.image_size}"
            f"x{cfg.in_channels} images, batch {b}"
        )
        return Spec(
            name,
            title,
            lambda key: models.cnn_init(key, cfg),
            models.cnn_apply,
            (
                lambda dt: flax_cls(
                    widths=cfg.widths, blocks=cfg.blocks_per_stage, dtype=dt
                )
            )
            if flax_cls
            else None,
            batch,
        )
    del jax
    raise BenchError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")


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

    from .demo import models, train

    policy = (
        None
        if variant.precision == "float32"
        else mixprec.get_policy(variant.precision)
    )
    key = jax.random.key(0)
    fwd: Callable[[Any, Any], Any]
    if variant.mechanism in ("flax", "flax-float32"):
        if spec.flax_module is None:  # pragma: no cover - built with_flax
            raise BenchError("the Flax models were not built")
        dtype = jnp.float32 if policy is None else policy.compute_dtype
        module = spec.flax_module(dtype)
        params = module.init(key, spec.batch[0])

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
            raise BenchError(f"unknown mechanism {variant.mechanism!r}")

    def loss_fn(p: Any, batch: Any) -> tuple[Any, Any]:
        x, y = batch
        return models.cross_entropy(fwd(p, x), y), None

    ls = train.initial_loss_scale(variant.precision, period=2000)
    step, state = train.make_step(loss_fn, params, optax.adam(1e-4), ls)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(state, spec.batch).compile()
    variant.compile_s = time.perf_counter() - t0
    variant.memory = train._memory_analysis(compiled)
    variant.memory["residual_bytes"] = train.residual_bytes(
        lambda p, b: loss_fn(p, b)[0], params, spec.batch
    )
    variant.step, variant.state = compiled, state


def _run_steps(variant: Variant, batch: Any, n: int) -> float:
    """Runs ``n`` steps back to back; returns the mean seconds per step."""
    import jax

    t = time.perf_counter()
    metrics = None
    for _ in range(n):
        variant.state, metrics = variant.step(variant.state, batch)
    jax.block_until_ready((variant.state, metrics))
    dt = (time.perf_counter() - t) / max(n, 1)
    if metrics is not None:
        m = jax.device_get(metrics)
        variant.final_loss = float(m["loss"])
        if "num_skipped" in m:
            variant.skipped_steps = int(m["num_skipped"])
    return dt


# ----------------------------------------------------------------------------- run


def _log(enabled: bool, msg: str) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def run_bench(
    *,
    workloads: Sequence[str] = WORKLOADS,
    precisions: Sequence[str] | None = None,
    mechanisms: Sequence[str] = MECHANISMS,
    gpu: bool = False,
    size_set: str | None = None,
    repeats: int = 5,
    steps: int | None = None,
    warmup: int = 2,
    out: str | pathlib.Path = "mixprec-out/bench",
    progress: bool = True,
) -> int:
    """Runs the benchmark; writes ``bench.json`` and ``bench.md``; prints the table.

    Args:
      workloads: from :data:`WORKLOADS`.
      precisions: mixed precisions to compare with float32 (default: bfloat16 on
        CPU, bfloat16 and float16 on GPU; float16 is not native on CPUs).
      mechanisms: from :data:`MECHANISMS`.
      gpu: use the GPU size set.
      size_set: ``"cpu"``, ``"gpu"`` or ``"tiny"`` (overrides ``gpu``).
      repeats: interleaved timing rounds.
      steps: timed steps per variant per round (default: 5 on CPU, 20 on GPU).
      warmup: untimed steps per variant after compiling.
      out: output folder.
      progress: log progress to stderr.

    Returns:
      0 if every variant ran, 1 otherwise.
    """
    import jax

    import mixprec

    from .demo import train

    size_set = size_set or ("gpu" if gpu else "cpu")
    sizes = workload_sizes(size_set)
    if precisions is None:
        precisions = (
            ["mixed_bfloat16", "mixed_float16"]
            if train.on_gpu()
            else ["mixed_bfloat16"]
        )
    if "autocast" in mechanisms and not hasattr(mixprec, "autocast"):
        raise BenchError("the `autocast` mechanism needs `mixprec.autocast`")
    if steps is None:
        steps = 20 if train.on_gpu() else 5
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with_flax = "flax" in mechanisms

    t_start = time.perf_counter()
    specs = {}
    variants: list[Variant] = []
    for name in workloads:
        spec = make_spec(name, sizes[name], with_flax=with_flax)
        specs[name] = spec
        variants.append(Variant(name, "float32", "float32", "float32"))
        if with_flax:
            variants.append(Variant(name, "float32", "flax-float32", "float32 (flax)"))
        for precision in precisions:
            for mech in mechanisms:
                base = "float32 (flax)" if mech == "flax" else "float32"
                variants.append(Variant(name, precision, mech, base))

    for v in variants:
        _log(progress, f"compiling {v.workload}: {v.label} ...")
        try:
            _build(v, specs[v.workload])
            _run_steps(v, specs[v.workload].batch, warmup)
        except Exception as e:  # a variant that fails is reported, not fatal
            v.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            _log(progress, f"  failed: {v.error}")

    live = [v for v in variants if v.error is None]
    for r in range(repeats):
        _log(progress, f"round {r + 1}/{repeats}")
        shift = r % max(len(live), 1)
        for v in live[shift:] + live[:shift]:
            v.times_ms.append(1e3 * _run_steps(v, specs[v.workload].batch, steps))

    dev = jax.devices()[0]
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{dev.platform}: {getattr(dev, 'device_kind', '')}",
        "jax": jax.__version__,
        "jaxlib": _jaxlib_version(),
        "mixprec": mixprec.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "size set": size_set,
        "repeats": repeats,
        "timed steps per round": steps,
        "warm-up steps": warmup,
        "wall time (s)": round(time.perf_counter() - t_start, 1),
    }
    titles = {name: spec.title for name, spec in specs.items()}
    payload = {
        "meta": meta,
        "workloads": titles,
        "variants": [_with_ratios(v, variants) for v in variants],
    }
    (out_dir / "bench.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = markdown(payload)
    (out_dir / "bench.md").write_text(md)
    print(md)
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'}")
    return 0 if all(v.error is None for v in variants) else 1


def _jaxlib_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return None


def _with_ratios(v: Variant, variants: Sequence[Variant]) -> dict[str, Any]:
    d = v.to_dict()
    same = [w for w in variants if w.workload == v.workload and w.error is None]
    f32 = next((w for w in same if w.label == "float32"), None)
    base = next((w for w in same if w.label == v.baseline), None)
    d["speedup_vs_float32"] = (
        f32.median_ms / v.median_ms if f32 and v.median_ms > 0 else math.nan
    )
    d["speedup_vs_own_float32"] = (
        base.median_ms / v.median_ms if base and v.median_ms > 0 else math.nan
    )
    return d


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
    lines = ["# mixprec bench", ""]
    lines += [f"- {k}: {v}" for k, v in payload["meta"].items()]
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
            f"| {_fmt(v['speedup_vs_float32'], '.2f')}x "
            f"| {_fmt(v['speedup_vs_own_float32'], '.2f')}x "
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
        "a variant that skips every step is not training, whatever its speed.",
    ]
    return "\n".join(lines) + "\n"
