"""Benchmark: mixed-precision training on a GPU, one process per variant.

Workloads (``--size gpu``, the default when JAX sees a GPU; ``--size tiny``, the
default on a CPU, runs each variant in seconds as a smoke test):

* ``gpt2``: GPT-2 small (12 layers, d 768, 12 heads, T 1024, batch 8, vocabulary
  50304, output layer tied to the embedding); tiny: 2 layers, d 128, T 64,
  batch 2, vocabulary 512. ``mixprec/_src/workloads/gpt2.py``.
* ``mlp``: a plain float32 MLP, 2 residual blocks ``h + W2 gelu(W1 h + b1) + b2``
  on 16384 tokens of width 4096 (ff 16384), mean squared error; tiny: 256
  tokens, d 128, ff 512.
* ``float8``: one product ``[16384, 4096] x [4096, 16384]`` forward (tiny: 256 x
  128 x 256): bfloat16, ``mixprec.autocast(f, "mixed_float8")`` and a
  ``lax.dot_general`` of float8 operands; for each, the GEMM the optimized HLO
  calls (``__cublas$lt$matmul$f8`` or not) and its error against float32.

A training step is forward, backward and an AdamW update (lr 6e-4, betas 0.9,
0.95, weight decay 0.1) of float32 master weights, jitted with the state
donated. Every variant starts from the same float32 weights and data, drawn
once with NumPy in a fixed order (bit-identical in every process and framework;
each row reports the digest of the weights it started from).

Variants (``--list`` prints them):

* JAX: ``jax_f32`` (float32, default matmul precision), ``flax_f32``,
  ``flax_bf16`` (Flax linen ``dtype=bfloat16``), ``hand_bf16`` (bfloat16 by hand,
  attention written out), ``hand_bf16_cudnn`` (the same with
  ``jax.nn.dot_product_attention(implementation="cudnn")``; on a CPU it runs
  ``implementation="xla"`` and says so).
* mixprec: ``mixprec_loss`` (``autocast(loss, "mixed_bfloat16")``),
  ``mixprec_step`` (the whole train step under autocast), ``mixprec_flax``
  (autocast around the Flax float32 model), ``mixprec_f16_scaled``
  (``"mixed_float16"`` with ``mixprec.value_and_grad`` and
  ``mixprec.optax.loss_scaled``), ``mixprec_f8`` (``"mixed_float8"``),
  ``mixprec_dpa`` (autocast around float32 code that calls
  ``jax.nn.dot_product_attention``).
* PyTorch (if installed): ``torch_f32``, ``torch_bf16`` (``torch.autocast``
  bfloat16, eager) and ``torch_bf16_compile`` (plus ``torch.compile``), all with
  ``F.scaled_dot_product_attention`` and the weights copied from the same NumPy
  arrays (the row's digest is recomputed from the torch module's weights).

Per variant: ms/step (median over ``--rounds`` rounds of ``--steps`` steps,
after the loss steps and ``--warmup`` steps; timed with
``jax.block_until_ready`` / ``torch.cuda.synchronize``), MFU against the
device's bfloat16 dense peak (:data:`PEAK_BF16_TFLOPS`, ``--peak-tflops``; n/a
on a CPU), peak memory (GPU: the device's ``peak_bytes_in_use`` /
``torch.cuda.max_memory_allocated()``; CPU: XLA's ``memory_analysis()``, temp +
argument + output - alias), compile time, the loss of the first step and after
``--loss-steps`` updates and its difference to ``jax_f32``, and the GEMMs of the
optimized HLO.

Usage::

    python benchmarks/bench_gpu.py                      # every variant, default size
    python benchmarks/bench_gpu.py --size tiny --workloads gpt2 \\
        --variants jax_f32,mixprec_loss --steps 2 --rounds 1
    python benchmarks/bench_gpu.py --list

Writes JSON (``--out``, default ``benchmarks/results/bench_gpu_<device>.json``)
and a Markdown table beside it after every variant, so an interrupted run keeps
what it measured; ``--merge`` adds to an existing file instead of replacing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools as ft
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mixprec._src.workloads import gpt2, timing  # noqa: E402


Params = dict[str, Any]

LR = 6e-4
ADAMW = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)

#: Dense bfloat16 peak of a GPU in TFLOP/s (no sparsity), by a part of its
#: device name; the first match wins. JAX and torch both report the name
#: NVIDIA gives, e.g. "NVIDIA H100 80GB HBM3" (SXM) or "NVIDIA H200".
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("GH200", 989.0),
    ("H100", 989.0),  # SXM
    ("H200", 989.0),  # SXM
    ("H800", 989.0),
    ("A100", 312.0),
)

#: Reported on the H100 80GB (JAX 0.11.2, torch 2.11) before this script: GPT-2
#: small, ms/step. For comparison in the README only; never a result of this run.
EARLIER_H100_MS = {
    "jax_f32": 58.8,
    "flax_bf16": 32.3,
    "torch_bf16": 30.3,
    "mixprec_loss": 31.9,
    "mixprec_step": 34.6,
    "hand_bf16_cudnn": 20.2,
    "torch_bf16_compile": 20.8,
}

TORCH_MISSING = "torch is not installed (pip install torch)"
WORKLOADS = ("gpt2", "mlp", "float8")
SIZES = ("gpu", "tiny")
STATUSES = ("ok", "failed", "timeout", "skipped", "not_run")


# ----------------------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running a workload.

    Attributes:
      name: the name ``--variants`` takes.
      framework: ``"jax"`` or ``"torch"``.
      workloads: the workloads it applies to.
      what: one line on how it is written.
    """

    name: str
    framework: str
    workloads: tuple[str, ...]
    what: str


_MODELS = ("gpt2", "mlp")
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("jax_f32", "jax", _MODELS, "float32 jax.numpy, default precision"),
        Variant("flax_f32", "jax", _MODELS, "Flax linen, float32"),
        Variant("flax_bf16", "jax", _MODELS, "Flax linen, dtype=bfloat16"),
        Variant(
            "hand_bf16", "jax", _MODELS, "bfloat16 by hand (GPT-2: einsum attention)"
        ),
        Variant(
            "hand_bf16_cudnn",
            "jax",
            ("gpt2",),
            "bfloat16 by hand, dot_product_attention(implementation='cudnn')",
        ),
        Variant("mixprec_loss", "jax", _MODELS, 'autocast(loss, "mixed_bfloat16")'),
        Variant(
            "mixprec_step", "jax", _MODELS, 'autocast(train_step, "mixed_bfloat16")'
        ),
        Variant(
            "mixprec_flax",
            "jax",
            _MODELS,
            'autocast(Flax float32 loss, "mixed_bfloat16")',
        ),
        Variant(
            "mixprec_f16_scaled",
            "jax",
            _MODELS,
            '"mixed_float16", mixprec.value_and_grad + optax.loss_scaled',
        ),
        Variant("mixprec_f8", "jax", _MODELS, 'autocast(loss, "mixed_float8")'),
        Variant(
            "mixprec_dpa",
            "jax",
            ("gpt2",),
            "autocast of float32 code calling jax.nn.dot_product_attention",
        ),
        Variant("torch_f32", "torch", _MODELS, "PyTorch float32, eager"),
        Variant("torch_bf16", "torch", _MODELS, "torch.autocast(bfloat16), eager"),
        Variant(
            "torch_bf16_compile",
            "torch",
            _MODELS,
            "torch.autocast(bfloat16) + torch.compile",
        ),
        Variant("gemm_bf16", "jax", ("float8",), "bf16 x bf16 -> bf16"),
        Variant(
            "gemm_mixprec_f8",
            "jax",
            ("float8",),
            'autocast(a @ b, "mixed_float8"), bf16 inputs, quantization timed',
        ),
        Variant(
            "gemm_f8_dot",
            "jax",
            ("float8",),
            "dot_general(e4m3, e4m3, preferred=bf16) * scales (pre-quantized)",
        ),
    )
}


# ----------------------------------------------------------------------------- the MLP


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """A plain residual MLP: ``h = h + W2 gelu(W1 h + b1) + b2`` per block.

    Attributes:
      d_model: width of the residual stream.
      d_ff: hidden width of each block.
      num_blocks: blocks.
      tokens: rows of the batch.
    """

    d_model: int = 4096
    d_ff: int = 16384
    num_blocks: int = 2
    tokens: int = 16384

    @property
    def matmul_params(self) -> int:
        return self.num_blocks * 2 * self.d_model * self.d_ff

    def flops_per_token(self) -> int:
        """``6 N``: forward and backward multiply-adds of the matmul weights."""
        return 6 * self.matmul_params


def mlp_init(config: MLPConfig, seed: int = 0) -> Params:
    """Float32 NumPy parameters, in the layout of the Flax module."""
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.d_ff

    def dense(fan_in: int, fan_out: int, std: float) -> Params:
        kernel = std * rng.standard_normal((fan_in, fan_out), dtype=np.float32)
        return {
            "kernel": kernel.astype(np.float32),
            "bias": np.zeros((fan_out,), np.float32),
        }

    proj_std = 0.5 / math.sqrt(f * config.num_blocks)
    return {
        f"block_{i}": {
            "fc": dense(d, f, 1.0 / math.sqrt(d)),
            "proj": dense(f, d, proj_std),
        }
        for i in range(config.num_blocks)
    }


def mlp_batch(config: MLPConfig, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and regression targets, ``float32[tokens, d_model]`` each."""
    rng = np.random.default_rng(seed)
    shape = (config.tokens, config.d_model)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = 0.5 * rng.standard_normal(shape, dtype=np.float32)
    return x, y.astype(np.float32)


def mlp_loss(
    params: Params,
    x: jax.Array,
    y: jax.Array,
    *,
    config: MLPConfig,
    compute_dtype: Any = None,
) -> jax.Array:
    """Mean squared error of the MLP; ``compute_dtype`` as in ``gpt2.apply``."""
    cd = None if compute_dtype is None else jnp.dtype(compute_dtype)

    def cast(a: jax.Array) -> jax.Array:
        return a if cd is None else a.astype(cd)

    def dense(p: Params, h: jax.Array) -> jax.Array:
        out = cast(h) @ cast(p["kernel"])
        return out + cast(p["bias"]).reshape(1, -1)

    h = cast(x)
    for i in range(config.num_blocks):
        blk = params[f"block_{i}"]
        h = h + dense(blk["proj"], jax.nn.gelu(dense(blk["fc"], h)))
    return jnp.mean(jnp.square(h.astype(jnp.float32) - y))


@ft.cache
def _flax_mlp_class() -> Any:
    """The MLP in Flax linen, defined on first use (imports flax)."""
    import flax.linen as nn

    class Block(nn.Module):
        config: MLPConfig
        dtype: Any

        @nn.compact
        def __call__(self, h: Any) -> Any:
            c = self.config
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            out = nn.gelu(nn.Dense(c.d_ff, name="fc", **kw)(h))
            return nn.Dense(c.d_model, name="proj", **kw)(out)

    class MLP(nn.Module):
        config: MLPConfig
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x: Any) -> Any:
            h = x.astype(self.dtype)
            for i in range(self.config.num_blocks):
                h = h + Block(self.config, self.dtype, name=f"block_{i}")(h)
            return h

    return MLP


def flax_mlp(config: MLPConfig, dtype: Any) -> Any:
    """The MLP as a Flax linen module (variables ``{"params": mlp_init(...)}``)."""
    return _flax_mlp_class()(config=config, dtype=jnp.dtype(dtype))


# ----------------------------------------------------------------------------- sizes


def sizes(size: str) -> dict[str, dict[str, Any]]:
    """The configuration of every workload at ``size`` (``"gpu"`` or ``"tiny"``)."""
    if size == "gpu":
        return {
            "gpt2": {"model": gpt2.SMALL, "batch": 8},
            "mlp": {"model": MLPConfig()},
            "float8": {"m": 16384, "k": 4096, "n": 16384},
        }
    return {
        "gpt2": {"model": gpt2.TINY, "batch": 2},
        "mlp": {"model": MLPConfig(d_model=128, d_ff=512, num_blocks=2, tokens=256)},
        "float8": {"m": 256, "k": 128, "n": 256},
    }


def config_json(cfg: dict[str, Any]) -> dict[str, Any]:
    """A workload's configuration as plain JSON values."""
    return {
        k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v  # type: ignore[arg-type]
        for k, v in cfg.items()
    }


def flops_per_step(workload: str, cfg: dict[str, Any]) -> int:
    """Model FLOPs of one step (a training step; one product for ``float8``)."""
    if workload == "gpt2":
        model = cfg["model"]
        return model.flops_per_token() * cfg["batch"] * model.seq_len
    if workload == "mlp":
        return cfg["model"].flops_per_token() * cfg["model"].tokens
    return 2 * cfg["m"] * cfg["k"] * cfg["n"]


def init_params(workload: str, cfg: dict[str, Any]) -> Params:
    """The float32 NumPy initial weights every variant of ``workload`` starts from."""
    if workload == "gpt2":
        return gpt2.init(cfg["model"])
    return mlp_init(cfg["model"])


def make_batch(workload: str, cfg: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The one batch every step of every variant of ``workload`` trains on."""
    if workload == "gpt2":
        return gpt2.batch(cfg["model"], cfg["batch"])
    return mlp_batch(cfg["model"])


# ----------------------------------------------------------------------------- JAX


class Skip(Exception):
    """A variant that cannot run here (reported as ``skipped`` with the reason)."""


def jax_loss(
    workload: str,
    cfg: dict[str, Any],
    *,
    compute_dtype: Any = None,
    attention: str = "einsum",
) -> Callable[..., jax.Array]:
    """``loss(params, x, y)`` of the ``jax.numpy`` model."""
    if workload == "gpt2":
        return ft.partial(
            gpt2.loss,
            config=cfg["model"],
            compute_dtype=compute_dtype,
            attention=attention,
        )
    return ft.partial(mlp_loss, config=cfg["model"], compute_dtype=compute_dtype)


def flax_loss(workload: str, cfg: dict[str, Any], dtype: Any) -> Callable[..., Any]:
    """``loss(params, x, y)`` of the Flax linen model computing in ``dtype``."""
    if workload == "gpt2":
        module = gpt2.flax_model(cfg["model"], dtype)

        def lm_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
            return gpt2.cross_entropy(module.apply({"params": params}, x), y)

        return lm_loss
    module = flax_mlp(cfg["model"], dtype)

    def mse_loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        out = module.apply({"params": params}, x).astype(jnp.float32)
        return jnp.mean(jnp.square(out - y))

    return mse_loss


def train_step(loss_fn: Callable[..., jax.Array], opt: Any) -> Callable[..., Any]:
    """``step((params, opt_state), x, y) -> ((params, opt_state), loss)``."""
    import optax

    def step(state: Any, x: jax.Array, y: jax.Array) -> Any:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


@dataclasses.dataclass
class JaxSetup:
    """What a JAX variant runs: its step, its initial state, notes, and a function
    of the state giving extra numbers to report (the loss scale)."""

    step: Callable[..., Any]
    state: Any
    notes: list[str]
    stats: Callable[[Any], dict[str, Any]] | None = None


def jax_setup(
    variant: str, workload: str, cfg: dict[str, Any], params: Any, on_gpu: bool
) -> JaxSetup:
    """The training step and initial state of a JAX variant of a model workload."""
    import optax

    import mixprec
    import mixprec.optax

    bf16 = jnp.bfloat16
    opt = optax.adamw(LR, **ADAMW)
    notes: list[str] = []
    f32 = jax_loss(workload, cfg)

    if variant == "mixprec_step":
        step = mixprec.autocast(train_step(f32, opt), "mixed_bfloat16")
        return JaxSetup(step, (params, opt.init(params)), notes)
    if variant == "mixprec_f16_scaled":
        scaled = mixprec.optax.loss_scaled(optax.adamw(LR, **ADAMW))
        vg = mixprec.value_and_grad(mixprec.autocast(f32, "mixed_float16"))

        def f16_step(state: Any, x: jax.Array, y: jax.Array) -> Any:
            params, opt_state = state
            loss, grads, _ = vg(params, x, y, loss_scale=opt_state)
            updates, opt_state = scaled.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        def stats(state: Any) -> dict[str, Any]:
            s = mixprec.optax.loss_scale_stats(state[1])
            return {k: np.asarray(v).item() for k, v in s.items()}

        return JaxSetup(f16_step, (params, scaled.init(params)), notes, stats)

    if variant == "jax_f32":
        loss = f32
        prec = getattr(jax.config, "jax_default_matmul_precision", None)
        notes.append(f"jax_default_matmul_precision={prec!r}")
    elif variant == "flax_f32":
        loss = flax_loss(workload, cfg, jnp.float32)
    elif variant == "flax_bf16":
        loss = flax_loss(workload, cfg, bf16)
    elif variant == "hand_bf16":
        loss = jax_loss(workload, cfg, compute_dtype=bf16)
    elif variant == "hand_bf16_cudnn":
        impl = "cudnn" if on_gpu else "xla"
        if not on_gpu:
            notes.append("no GPU: ran implementation='xla' (cuDNN needs a GPU)")
        loss = jax_loss(workload, cfg, compute_dtype=bf16, attention=impl)
    elif variant == "mixprec_loss":
        loss = mixprec.autocast(f32, "mixed_bfloat16")
    elif variant == "mixprec_flax":
        loss = mixprec.autocast(flax_loss(workload, cfg, jnp.float32), "mixed_bfloat16")
    elif variant == "mixprec_f8":
        loss = mixprec.autocast(f32, "mixed_float8")
    elif variant == "mixprec_dpa":
        loss = mixprec.autocast(
            jax_loss(workload, cfg, attention="auto"), "mixed_bfloat16"
        )
    else:
        raise ValueError(f"no JAX training variant {variant!r}")
    return JaxSetup(train_step(loss, opt), (params, opt.init(params)), notes)


def gemm_setup(
    variant: str, cfg: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], jax.Array, list[str]]:
    """The product of the ``float8`` workload: the function, its arguments, the
    float32 reference product and notes."""
    import mixprec

    m, k, n = cfg["m"], cfg["k"], cfg["n"]
    rng = np.random.default_rng(2)
    a = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    b = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
    ref = jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    notes: list[str] = []

    def matmul(x: jax.Array, y: jax.Array) -> jax.Array:
        return x @ y

    if variant == "gemm_bf16":
        return matmul, (a16, b16), ref, notes
    if variant == "gemm_mixprec_f8":
        return mixprec.autocast(matmul, "mixed_float8"), (a16, b16), ref, notes
    if variant == "gemm_f8_dot":
        f8 = jnp.float8_e4m3fn
        big = float(jnp.finfo(f8).max)

        def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            scale = jnp.max(jnp.abs(x)) / big
            return jnp.clip(x / scale, -big, big).astype(f8), scale

        qa, sa = quantize(a)
        qb, sb = quantize(b)

        def f8_dot(
            qa: jax.Array, qb: jax.Array, sa: jax.Array, sb: jax.Array
        ) -> jax.Array:
            out = jax.lax.dot_general(
                qa, qb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16
            )
            return (out.astype(jnp.float32) * (sa * sb)).astype(jnp.bfloat16)

        notes.append("inputs quantized to e4m3 before timing")
        return f8_dot, (qa, qb, sa, sb), ref, notes
    raise ValueError(f"no float8 variant {variant!r}")


def log(message: str) -> None:
    """A progress line of a worker (the last one names where a timeout struck)."""
    print(f"[worker] {message}", file=sys.stderr, flush=True)


def _timed_rounds(
    run: Callable[[], Any], sync: Callable[[Any], Any], rounds: int, steps: int
) -> list[float]:
    """Seconds of each of ``rounds`` rounds of ``steps`` calls of ``run``."""
    out: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        last = None
        for _ in range(steps):
            last = run()
        sync(last)
        out.append(time.perf_counter() - t0)
    return out


def run_jax(spec: dict[str, Any], row: dict[str, Any]) -> None:
    """Runs a JAX variant in this process and fills ``row``."""
    workload, variant = spec["workload"], spec["variant"]
    cfg = sizes(spec["size"])[workload]
    on_gpu = timing.on_gpu()
    dev = jax.devices()[0]
    row["device"] = getattr(dev, "device_kind", dev.platform)
    if workload == "float8":
        fn, args, ref, notes = gemm_setup(variant, cfg)
        jitted = jax.jit(fn)
        state: Any = None
        stats = None
    else:
        params_np = init_params(workload, cfg)
        row["init_digest"] = gpt2.digest(params_np)
        x, y = (jnp.asarray(a) for a in make_batch(workload, cfg))
        setup = jax_setup(variant, workload, cfg, jax.device_put(params_np), on_gpu)
        del params_np
        notes, stats = setup.notes, setup.stats
        jitted = jax.jit(setup.step, donate_argnums=0)
        state, args, ref = setup.state, (x, y), None

    log("tracing and lowering")
    t0 = time.perf_counter()
    lowered = jitted.lower(*args) if state is None else jitted.lower(state, *args)
    t1 = time.perf_counter()
    log("compiling")
    compiled = lowered.compile()
    t2 = time.perf_counter()
    row.update(trace_lower_s=t1 - t0, xla_compile_s=t2 - t1, compile_s=t2 - t0)
    row["compile_measure"] = "jit(step).lower() + .compile()"
    hlo = compiled.as_text()
    row["hlo"] = hlo_summary(hlo)
    if spec.get("hlo_path"):
        os.makedirs(os.path.dirname(spec["hlo_path"]), exist_ok=True)
        with open(spec["hlo_path"], "w") as f:
            f.write(hlo)
        row["hlo_file"] = os.path.relpath(spec["hlo_path"], _ROOT)
    row["xla_memory"] = timing.memory_analysis(compiled)

    log("running")
    if state is None:  # the float8 product: forward only
        out = compiled(*args)
        err = jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
        row["rel_error_vs_f32"] = float(err)
        row["out_dtype"] = str(out.dtype)
        del out, ref

        def call() -> Any:
            return compiled(*args)

        for _ in range(spec["warmup"] + 1):
            jax.block_until_ready(call())
        round_s = _timed_rounds(
            call, jax.block_until_ready, spec["rounds"], spec["steps"]
        )
    else:
        losses = []
        for _ in range(spec["loss_steps"] + 1):
            state, loss = compiled(state, *args)
            losses.append(loss)
        row["losses"] = [float(v) for v in jax.device_get(losses)]
        if stats is not None:
            row["loss_scale_stats"] = stats(state)
        for _ in range(spec["warmup"]):
            state, loss = compiled(state, *args)
        jax.block_until_ready(state)
        box = {"state": state}

        def call() -> Any:
            box["state"], loss = compiled(box["state"], *args)
            return box["state"], loss

        round_s = _timed_rounds(
            call, jax.block_until_ready, spec["rounds"], spec["steps"]
        )
    row["notes"] = notes
    row["round_s"] = round_s
    row["ms_per_step"] = 1e3 * statistics.median(round_s) / spec["steps"]
    if on_gpu:
        row["peak_bytes"] = timing.device_peak_bytes()
        row["memory_measure"] = "jax: device memory_stats()['peak_bytes_in_use']"
    else:
        ma = row["xla_memory"]
        row["peak_bytes"] = (
            (ma["temp_bytes"] or 0)
            + (ma["argument_bytes"] or 0)
            + (ma["output_bytes"] or 0)
            - (ma["alias_bytes"] or 0)
        )
        row["memory_measure"] = "XLA memory_analysis: temp + argument + output - alias"


# ----------------------------------------------------------------------------- PyTorch


def torch_workload(
    workload: str, cfg: dict[str, Any]
) -> tuple[Any, list[tuple[tuple[str, ...], Any, bool]], Callable[..., Any]]:
    """The model in PyTorch, the map from its parameters to the NumPy weights
    (``(path, parameter, transposed)``), and its loss ``loss(out, y)``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    Mapping = list[tuple[tuple[str, ...], Any, bool]]

    def lin(prefix: tuple[str, ...], mod: Any) -> Mapping:
        return [
            ((*prefix, "kernel"), mod.weight, True),
            ((*prefix, "bias"), mod.bias, False),
        ]

    def norm(prefix: tuple[str, ...], mod: Any) -> Mapping:
        return [
            ((*prefix, "scale"), mod.weight, False),
            ((*prefix, "bias"), mod.bias, False),
        ]

    if workload == "mlp":
        c: Any = cfg["model"]

        class MLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.ModuleList(
                    [nn.Linear(c.d_model, c.d_ff) for _ in range(c.num_blocks)]
                )
                self.proj = nn.ModuleList(
                    [nn.Linear(c.d_ff, c.d_model) for _ in range(c.num_blocks)]
                )

            def forward(self, h: Any) -> Any:
                for fc, proj in zip(self.fc, self.proj, strict=True):
                    h = h + proj(F.gelu(fc(h), approximate="tanh"))
                return h

        model: Any = MLP()
        mapping: Mapping = []
        for i in range(c.num_blocks):
            mapping += lin((f"block_{i}", "fc"), model.fc[i])
            mapping += lin((f"block_{i}", "proj"), model.proj[i])

        def mse(out: Any, y: Any) -> Any:
            return F.mse_loss(out.float(), y)

        return model, mapping, mse

    c = cfg["model"]
    d, heads, hd = c.d_model, c.num_heads, c.head_dim

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(d, eps=c.ln_eps)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln_2 = nn.LayerNorm(d, eps=c.ln_eps)
            self.fc = nn.Linear(d, c.mlp_ratio * d)
            self.fc_proj = nn.Linear(c.mlp_ratio * d, d)

        def forward(self, x: Any) -> Any:
            b, t, _ = x.shape
            qkv = self.qkv(self.ln_1(x)).view(b, t, 3, heads, hd)
            q, k, v = (a.transpose(1, 2) for a in qkv.unbind(2))  # [b, heads, t, hd]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            h = F.gelu(self.fc(self.ln_2(x)), approximate="tanh")
            return x + self.fc_proj(h)

    class GPT2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(c.vocab_size, d)
            self.wpe = nn.Embedding(c.seq_len, d)
            self.blocks = nn.ModuleList([Block() for _ in range(c.num_layers)])
            self.ln_f = nn.LayerNorm(d, eps=c.ln_eps)

        def forward(self, tokens: Any) -> Any:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.wte(tokens) + self.wpe(pos)
            for blk in self.blocks:
                x = blk(x)
            return F.linear(self.ln_f(x), self.wte.weight)  # tied output layer

    model = GPT2()
    mapping = [
        (("wte", "embedding"), model.wte.weight, False),
        (("wpe", "embedding"), model.wpe.weight, False),
    ]
    for i, blk in enumerate(model.blocks):
        p = f"block_{i}"
        mapping += norm((p, "ln_1"), blk.ln_1)
        mapping += lin((p, "attn", "qkv"), blk.qkv)
        mapping += lin((p, "attn", "proj"), blk.proj)
        mapping += norm((p, "ln_2"), blk.ln_2)
        mapping += lin((p, "mlp", "fc"), blk.fc)
        mapping += lin((p, "mlp", "proj"), blk.fc_proj)
    mapping += norm(("ln_f",), model.ln_f)

    def lm_loss(out: Any, y: Any) -> Any:
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))

    return model, mapping, lm_loss


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def torch_load(
    mapping: list[tuple[tuple[str, ...], Any, bool]], params: Params
) -> None:
    """Copies the NumPy weights into the torch parameters (kernels transposed)."""
    import torch

    with torch.no_grad():
        for path, param, transposed in mapping:
            value = np.asarray(_get(params, path))
            value = np.ascontiguousarray(value.T if transposed else value)
            if tuple(param.shape) != value.shape:
                raise ValueError(
                    f"torch parameter for {'/'.join(path)} has shape "
                    f"{tuple(param.shape)}, the weights {value.shape}."
                )
            param.copy_(torch.from_numpy(value))


def torch_export(mapping: list[tuple[tuple[str, ...], Any, bool]]) -> Params:
    """The torch parameters back in the NumPy layout (for the digest)."""
    out: Params = {}
    for path, param, transposed in mapping:
        value = param.detach().float().cpu().numpy()
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.ascontiguousarray(value.T if transposed else value)
    return out


def run_torch(spec: dict[str, Any], row: dict[str, Any]) -> None:
    """Runs a PyTorch variant in this process and fills ``row``."""
    try:
        import torch
    except ImportError:
        raise Skip(TORCH_MISSING) from None
    workload, variant = spec["workload"], spec["variant"]
    cfg = sizes(spec["size"])[workload]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    row["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    row["torch"] = torch.__version__
    row["notes"] = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        row["torch_cuda"] = torch.version.cuda
        row["torch_cudnn"] = torch.backends.cudnn.version()
    if variant == "torch_f32":
        prec = torch.get_float32_matmul_precision()
        row["notes"].append(f"float32 matmul precision {prec!r}")

    params = init_params(workload, cfg)
    x_np, y_np = make_batch(workload, cfg)
    model, mapping, loss_of = torch_workload(workload, cfg)
    n_mapped = sum(int(np.prod(p.shape)) for _, p, _ in mapping)
    n_model = sum(p.numel() for p in model.parameters())
    if n_mapped != n_model:
        raise RuntimeError(
            f"the torch model has {n_model} parameters, the weights {n_mapped}"
        )
    torch_load(mapping, params)
    del params
    model.to(device)
    row["init_digest"] = gpt2.digest(torch_export(mapping))
    x = torch.from_numpy(x_np).to(device)
    y = torch.from_numpy(y_np).to(device)
    if workload == "gpt2":
        x, y = x.long(), y.long()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=LR,
        betas=(ADAMW["b1"], ADAMW["b2"]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
        fused=True if cuda else None,
    )
    autocast = variant != "torch_f32"

    def forward_loss(x: Any, y: Any) -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        return loss_of(out, y)

    if variant == "torch_bf16_compile":
        forward_loss = torch.compile(forward_loss)

    def step() -> Any:
        loss = forward_loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync(_: Any = None) -> None:
        if cuda:
            torch.cuda.synchronize()

    log("first step")
    t0 = time.perf_counter()
    losses = [step()]
    sync()
    log("running")
    row["compile_s"] = time.perf_counter() - t0
    row["compile_measure"] = "first step (torch.compile included)"
    for _ in range(spec["loss_steps"]):
        losses.append(step())
    row["losses"] = [float(v) for v in losses]
    for _ in range(spec["warmup"]):
        step()
    sync()
    round_s = _timed_rounds(step, sync, spec["rounds"], spec["steps"])
    row["round_s"] = round_s
    row["ms_per_step"] = 1e3 * statistics.median(round_s) / spec["steps"]
    if cuda:
        row["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        row["memory_measure"] = "torch.cuda.max_memory_allocated()"
    else:
        row["peak_bytes"] = None
        row["memory_measure"] = "n/a (torch on a CPU reports no peak)"


# ----------------------------------------------------------------------------- HLO

_HLO_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \(?(\w+)\[")
_HLO_PARAM = re.compile(r"([\w.\-]+): \(?(\w+)\[")
_HLO_CALL = re.compile(
    r"^\s*(?:ROOT )?%[\w.\-]+ = \(?(\w+)\[.*?\bcustom-call\((.*?)\),"
    r'.*?custom_call_target="([^"]+)"'
)
_HLO_OPERAND = re.compile(r"(?:(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+)?%([\w.\-]+)")
_HLO_FUSION_KIND = re.compile(r'"fusion_backend_config":\{"kind":"([^"]+)"')
_GEMM_WORDS = ("cublas", "gemm", "matmul", "cudnn", "fmha", "dot")


def hlo_summary(hlo_text: str) -> dict[str, dict[str, int]]:
    r"""The GEMMs of optimized HLO (``compiled.as_text()``) and their element types.

    Returns:
      ``calls``: ``"<custom_call_target> <lhs>,<rhs>-><out>"`` -> count, for the
      custom calls whose target names a GEMM, a cuDNN call or a matmul
      (``__cublas$gemm``, ``__cublas$lt$matmul``, ``__cublas$lt$matmul$f8``,
      ``__cudnn$fmha...``); ``fusions``: GEMM fusion kinds (``__triton_gemm``,
      ``__cudnn$fusion``) -> count; ``dots``: ``"<lhs>,<rhs>-><out>"`` -> count of
      the ``dot`` instructions left (on a CPU, every matmul; on a GPU, those
      inside GEMM fusions).

    Examples:
      >>> text = "\n".join([
      ...     "ENTRY %main (a: f8e4m3fn[16,32], b: f8e4m3fn[16,32]) -> bf16[16,16] {",
      ...     "  %a = f8e4m3fn[16,32]{1,0} parameter(0)",
      ...     "  %b = f8e4m3fn[16,32]{1,0} parameter(1)",
      ...     "  %g = (bf16[16,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), "
      ...     'custom_call_target="__cublas$lt$matmul$f8"',
      ...     "}"])
      >>> hlo_summary(text)["calls"]
      {'__cublas$lt$matmul$f8 f8e4m3fn,f8e4m3fn->bf16': 1}
    """
    calls: Counter[str] = Counter()
    fusions: Counter[str] = Counter()
    for block in re.split(r"\n(?=\S)", hlo_text):  # one computation each
        header, _, _ = block.partition("\n")
        types = {m.group(1): m.group(2) for m in _HLO_PARAM.finditer(header)}
        lines = block.splitlines()
        for line in lines:
            if m := _HLO_DEF.match(line):
                types[m.group(1)] = m.group(2)
        for line in lines:
            if (m := _HLO_CALL.match(line)) and any(
                w in m.group(3).lower() for w in _GEMM_WORDS
            ):
                operands = [
                    inline or types.get(name, "?")
                    for inline, name in _HLO_OPERAND.findall(m.group(2))
                ]
                ins = ",".join(operands[:2])
                calls[f"{m.group(3)} {ins}->{m.group(1)}"] += 1
            for kind in _HLO_FUSION_KIND.findall(line):
                if any(w in kind.lower() for w in _GEMM_WORDS):
                    fusions[kind] += 1
    dots = Counter(f"{a},{b}->{o}" for a, b, o in timing.hlo_dot_types(hlo_text))
    return {"calls": dict(calls), "fusions": dict(fusions), "dots": dict(dots)}


def gemm_text(hlo: dict[str, dict[str, int]] | None) -> str:
    """One line for the table: GEMM calls, GEMM fusions, remaining dots."""
    if not hlo:
        return ""
    parts = [f"{k} x{n}" for k, n in sorted(hlo["calls"].items())]
    parts += [f"{k} x{n}" for k, n in sorted(hlo["fusions"].items())]
    parts += [f"dot {k} x{n}" for k, n in sorted(hlo["dots"].items())]
    return "; ".join(parts)


# ----------------------------------------------------------------------------- worker


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def info() -> dict[str, Any]:
    """The machine: JAX's device and environment, and package versions."""
    env = timing.environment()
    dev = jax.devices()[0]
    env["device_kind"] = getattr(dev, "device_kind", dev.platform)
    env["platform"] = dev.platform
    env["versions"] = {
        p: _version(p)
        for p in (
            "jax",
            "jaxlib",
            "jax-cuda12-plugin",
            "jax-cuda13-plugin",
            "flax",
            "optax",
            "torch",
            "numpy",
            "ml_dtypes",
        )
    }
    env["jax_default_matmul_precision"] = getattr(
        jax.config, "jax_default_matmul_precision", None
    )
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # a backend without memory statistics
        stats = {}
    env["device_bytes_limit"] = stats.get("bytes_limit")
    return env


def worker_main(spec_json: str) -> int:
    """Runs one variant (or ``info``) as described by ``spec_json`` and writes its
    row to ``spec["result_path"]``. Failures are written as rows, not raised."""
    spec = json.loads(spec_json)
    t0 = time.perf_counter()
    if spec["kind"] == "info":
        result: dict[str, Any] = info()
    else:
        result = {"status": "ok"}
        try:
            if VARIANTS[spec["variant"]].framework == "torch":
                run_torch(spec, result)
            else:
                run_jax(spec, result)
        except Skip as e:
            result.update(status="skipped", reason=str(e))
        except Exception as e:
            tb = traceback.format_exc()
            first = (str(e).strip().splitlines() or [""])[0]
            result.update(
                status="failed",
                reason=f"{type(e).__name__}: {first}"[:500],
                traceback=tb.splitlines()[-40:],
            )
            print(tb, file=sys.stderr)
    result["worker_s"] = time.perf_counter() - t0
    with open(spec["result_path"], "w") as f:
        json.dump(result, f)
    return 0


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b")


def error_line(output: str) -> str:
    """The line of a worker's output that says what went wrong."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line[:500]
    return (lines[-1] if lines else "no output")[:500]


def run_worker(
    spec: dict[str, Any], *, timeout_s: float, env: dict[str, str]
) -> tuple[dict[str, Any] | None, str, int | None, bool]:
    """Runs this script as a worker process.

    Returns:
      ``(result, output, returncode, timed_out)``; ``result`` is ``None`` when
      the worker wrote none (it crashed or was killed).
    """
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        spec = dict(spec, result_path=os.path.join(tmp, "result.json"))
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker-spec",
            json.dumps(spec),
        ]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=_ROOT,
            start_new_session=True,  # its own process group: a timeout kills all
        )
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        result = None
        if os.path.exists(spec["result_path"]):
            with open(spec["result_path"]) as f:
                result = json.load(f)
    return result, output or "", proc.returncode, timed_out


# ----------------------------------------------------------------------------- parent


def is_gpu(env: dict[str, Any]) -> bool:
    """Whether an environment record (:func:`info`) was taken on a GPU."""
    return env.get("backend") in ("gpu", "cuda", "rocm")


def peak_tflops(device_kind: str, override: float | None) -> tuple[float | None, str]:
    """The bfloat16 dense peak to compute MFU against, and where it came from.

    Examples:
      >>> peak_tflops("NVIDIA H100 80GB HBM3", None)
      (989.0, 'table: H100')
      >>> peak_tflops("NVIDIA H100 PCIe", None)
      (756.0, 'table: H100 PCIe')
      >>> peak_tflops("cpu", None)
      (None, 'no entry for cpu; pass --peak-tflops')
      >>> peak_tflops("cpu", 1.5)
      (1.5, '--peak-tflops')
    """
    if override is not None:
        return override, "--peak-tflops"
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_kind.lower():
            return value, f"table: {key}"
    return None, f"no entry for {device_kind}; pass --peak-tflops"


def device_slug(device_kind: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia_h100_80gb_hbm3"``.

    Examples:
      >>> device_slug("NVIDIA H100 80GB HBM3"), device_slug("cpu")
      ('nvidia_h100_80gb_hbm3', 'cpu')
    """
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "unknown"


def annotate(data: dict[str, Any]) -> None:
    """Derived numbers of every row: MFU, the loss difference to ``jax_f32``."""
    peak = data["config"].get("peak_tflops")
    on_gpu = is_gpu(data["environment"])
    base = {
        r["workload"]: r
        for r in data["results"]
        if r["variant"] == "jax_f32" and r["status"] == "ok"
    }
    for r in data["results"]:
        if r["status"] != "ok":
            continue
        ms = r.get("ms_per_step")
        r["mfu"] = (
            r["flops_per_step"] / (ms * 1e-3) / (peak * 1e12)
            if on_gpu and peak and ms and r["workload"] != "float8"
            else None
        )
        if r["workload"] == "float8" and ms:
            r["tflops"] = r["flops_per_step"] / (ms * 1e-3) / 1e12
        losses = r.get("losses")
        if losses:
            r["loss_first"], r["loss_after"] = losses[0], losses[-1]
            b = base.get(r["workload"])
            if b and b.get("losses"):
                r["loss_diff_vs_f32"] = losses[-1] - b["losses"][-1]
                r["loss_first_diff_vs_f32"] = losses[0] - b["losses"][0]
                r["loss_rel_diff_vs_f32"] = r["loss_diff_vs_f32"] / abs(b["losses"][-1])


def _fmt(value: Any, spec: str, missing: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return format(value, spec)


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def fmt_tables(data: dict[str, Any]) -> str:
    """The Markdown tables of a run: one per workload, and a legend."""
    cfg = data["config"]
    on_gpu = is_gpu(data["environment"])
    n_loss = cfg["loss_steps"]
    out: list[str] = []
    for w in WORKLOADS:
        rows = [r for r in data["results"] if r["workload"] == w]
        if not rows:
            continue
        out.append(f"### {w} ({cfg['size']} size: {json.dumps(cfg['workloads'][w])})")
        out.append("")
        if w == "float8":
            out.append(
                "| variant | how | status | ms/call | TFLOP/s | memory | rel. error vs "
                "f32 | out | GEMMs in optimized HLO | notes |"
            )
            out.append("|---|---|---|---:|---:|---:|---:|---|---|---|")
        else:
            earlier = w == "gpt2" and cfg["size"] == "gpu"
            out.append(
                "| variant | how | status | ms/step | MFU | memory | compile s | "
                f"loss step 1 | loss after {n_loss} | diff vs jax_f32 | "
                + ("earlier H100 ms (not this run) | " if earlier else "")
                + "GEMMs in optimized HLO | notes |"
            )
            out.append(
                "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"
                + ("---:|" if earlier else "")
                + "---|---|"
            )
        for r in rows:
            ok = r["status"] == "ok"
            notes = list(r.get("notes") or [])
            if not ok:
                notes.insert(0, r.get("reason", ""))
            if r.get("loss_scale_stats"):
                s = r["loss_scale_stats"]
                notes.append(
                    f"loss scale {s['loss_scale']:g}, {s['num_skipped']} skipped "
                    f"after {n_loss + 1} steps"
                )
            note = "; ".join(n for n in notes if n).replace("|", "/")
            how = VARIANTS[r["variant"]].what.replace("|", "/")
            if w == "float8":
                out.append(
                    f"| {r['variant']} | {how} | {r['status']} "
                    f"| {_fmt(r.get('ms_per_step'), '.3f')} "
                    f"| {_fmt(r.get('tflops'), '.3g')} "
                    f"| {_bytes(r.get('peak_bytes')) if ok else ''} "
                    f"| {_fmt(r.get('rel_error_vs_f32'), '.2e')} "
                    f"| {r.get('out_dtype', '')} | {gemm_text(r.get('hlo'))} | {note} |"
                )
                continue
            mfu = _fmt(r.get("mfu"), ".1%", "n/a") if ok else ""
            ref = EARLIER_H100_MS.get(r["variant"])
            out.append(
                f"| {r['variant']} | {how} | {r['status']} "
                f"| {_fmt(r.get('ms_per_step'), '.1f')} | {mfu} "
                f"| {_bytes(r.get('peak_bytes')) if ok else ''} "
                f"| {_fmt(r.get('compile_s'), '.1f')} "
                f"| {_fmt(r.get('loss_first'), '.4f')} "
                f"| {_fmt(r.get('loss_after'), '.4f')} "
                f"| {_fmt(r.get('loss_diff_vs_f32'), '+.4f')} "
                + (f"| {_fmt(ref, '.1f')} " if earlier else "")
                + f"| {gemm_text(r.get('hlo'))} | {note} |"
            )
        out.append("")
    mem = (
        "memory: JAX, the device's `peak_bytes_in_use`; torch, "
        "`torch.cuda.max_memory_allocated()` (each variant in its own process)"
        if on_gpu
        else "memory: XLA's `compiled.memory_analysis()`, temp + argument + output "
        "- alias bytes of the step (no GPU; torch on a CPU reports none: n/a)"
    )
    peak = cfg.get("peak_tflops")
    mfu = (
        f"MFU: model FLOPs (6 N_matmul + 12 L T d per token) / step time / "
        f"{peak:g} TFLOP/s ({cfg.get('peak_source')}; the bfloat16 dense peak, "
        "for float32 variants too)"
        if on_gpu and peak
        else "MFU: n/a (no GPU peak)"
    )
    out.append(
        f"ms/step: median of {cfg['rounds']} rounds of {cfg['steps']} steps after "
        f"{n_loss + 1} loss steps and {cfg['warmup']} warm-up steps. {mfu}. {mem}. "
        "compile s: JAX, `lower()` + `compile()` of the step; torch, the first step. "
        f"loss step 1: the loss of the first step (the shared initial weights); "
        f"loss after {n_loss}: the loss computed after {n_loss} AdamW updates, each "
        "variant in its own precision; diff: minus jax_f32's. GEMMs: custom-call "
        "targets with operand and result types, GEMM fusions, and the dot "
        "instructions left in the optimized HLO."
    )
    return "\n".join(out)


def header(data: dict[str, Any]) -> str:
    """Where and how a run was measured, for the Markdown file."""
    env, cfg = data["environment"], data["config"]
    v = env.get("versions", {})
    flags = timing.flags_summary(env.get("cpu_flags") or {})
    return (
        f"Measured {env.get('date')} on {env.get('device_kind')} "
        f"({env.get('backend')}; host CPU {env.get('cpu_model')}, "
        f"{env.get('cpu_count')} CPUs, flags: {flags}), "
        f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, flax {v.get('flax')}, "
        f"optax {v.get('optax')}, torch {v.get('torch')}; load average "
        f"{(env.get('loadavg') or ['?'])[0]} -> "
        f"{(cfg.get('loadavg_end') or ['?'])[0]}. "
        f"Command: `{cfg['command']}`."
    )


def write(data: dict[str, Any], out_path: str) -> str:
    """Writes the JSON and the Markdown table; returns the table."""
    annotate(data)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(data, f, indent=1)
    table = fmt_tables(data)
    with open(os.path.splitext(out_path)[0] + ".md", "w") as f:
        f.write(header(data) + "\n\n" + table + "\n")
    return table


def merge_rows(
    data: dict[str, Any], old: dict[str, Any], *, replaced: set[tuple[str, str]]
) -> None:
    """Puts the rows of ``old`` (an earlier result file) before those of ``data``,
    except the ``(workload, variant)`` pairs in ``replaced``.

    Raises:
      ValueError: if ``old`` was measured on another device, at another size or
        with other step counts.
    """
    keys = ("size", "steps", "rounds", "loss_steps", "warmup")
    ours = (data["environment"]["device_kind"], *(data["config"][k] for k in keys))
    theirs = (
        old["environment"].get("device_kind"),
        *(old["config"].get(k) for k in keys),
    )
    if ours != theirs:
        names = ("device", *keys)
        raise ValueError(
            f"it holds {dict(zip(names, theirs, strict=True))}, this run is "
            f"{dict(zip(names, ours, strict=True))}"
        )
    kept = [r for r in old["results"] if (r["workload"], r["variant"]) not in replaced]
    data["results"] = kept + [
        r for r in data["results"] if (r["workload"], r["variant"]) in replaced
    ]
    data["config"]["commands"] = old["config"].get(
        "commands", [old["config"]["command"]]
    ) + data["config"].get("commands", [data["config"]["command"]])


def combine(paths: Sequence[str], out_path: str) -> int:
    """``--combine``: merges result files into ``out_path``."""
    datas = []
    for path in paths:
        try:
            with open(path) as f:
                datas.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"error: `--combine {path}`: {e}", file=sys.stderr)
            return 2
    data = datas[-1]
    for path, old in zip(paths[-2::-1], datas[-2::-1], strict=True):
        replaced = {(r["workload"], r["variant"]) for r in data["results"]}
        try:
            merge_rows(data, old, replaced=replaced)
        except ValueError as e:
            print(f"error: `--combine {path}`: {e}.", file=sys.stderr)
            return 2
    order = {
        (w, v): i
        for i, (w, v) in enumerate((w, v) for w in WORKLOADS for v in VARIANTS)
    }
    data["results"].sort(key=lambda r: order.get((r["workload"], r["variant"]), 0))
    print(write(data, out_path))
    print(f"wrote {out_path} and its .md")
    return 0


def _names(value: str, flag: str, choices: Sequence[str]) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in choices]
    if bad or not names:
        raise ValueError(
            f"`{flag}` expects a comma-separated list of {', '.join(choices)}; got "
            f"{value!r}" + (f" (unknown: {', '.join(bad)})" if bad else "") + "."
        )
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size",
        choices=SIZES,
        default=None,
        help="workload sizes (default: gpu when JAX sees a GPU, else tiny)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset (default: every variant of each workload; "
        "--list shows them)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=10,
        help="AdamW updates before the reported loss (untimed; also warm-up)",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="further untimed steps before timing"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=300.0, help="per variant (default 300)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock limit of the whole run: a variant still running then is "
        "stopped (timeout), and the rest are reported as not run",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="bfloat16 dense peak for MFU (default: by device name, "
        + ", ".join(f"{k} {v:g}" for k, v in PEAK_BF16_TFLOPS)
        + ")",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default benchmarks/results/bench_gpu_<device>.json; a .md "
        "table is written beside it)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add to the rows of an existing --out file (same device and size) "
        "instead of replacing it",
    )
    parser.add_argument(
        "--dump-hlo",
        action="store_true",
        help="also write the optimized HLO of the model variants (float8 ones "
        "are always written)",
    )
    parser.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: merge the rows of these result files (same device and "
        "size; a later file's row replaces an earlier one's) into --out",
    )
    parser.add_argument("--list", action="store_true", help="list the variants")
    parser.add_argument("--worker-spec", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.workloads = _names(args.workloads, "--workloads", WORKLOADS)
        if args.variants is not None:
            args.variants = _names(args.variants, "--variants", list(VARIANTS))
            for v in args.variants:
                if not set(VARIANTS[v].workloads) & set(args.workloads):
                    raise ValueError(
                        f"`--variants {v}` runs on the workloads "
                        f"{', '.join(VARIANTS[v].workloads)}, none of which is in "
                        f"`--workloads {','.join(args.workloads)}`."
                    )
    except ValueError as e:
        parser.error(str(e))
    for flag, value, low in (
        ("--steps", args.steps, 1),
        ("--rounds", args.rounds, 1),
        ("--loss-steps", args.loss_steps, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value < low:
            parser.error(f"`{flag}` must be an integer >= {low}, got {value}.")
    for flag, value in (
        ("--timeout-s", args.timeout_s),
        ("--budget-s", args.budget_s),
        ("--peak-tflops", args.peak_tflops),
    ):
        if value is not None and not value > 0:
            parser.error(f"`{flag}` must be a positive number, got {value}.")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_spec is not None:
        return worker_main(args.worker_spec)
    if args.list:
        for v in VARIANTS.values():
            print(f"{v.name:20s} {v.framework:6s} {','.join(v.workloads):9s} {v.what}")
        return 0
    if args.combine:
        if not args.out:
            print("error: `--combine` needs `--out PATH`.", file=sys.stderr)
            return 2
        return combine(args.combine, args.out)

    t_start = time.perf_counter()
    base_env = dict(os.environ)
    env_info, out, rc, timed_out = run_worker(
        {"kind": "info"}, timeout_s=args.timeout_s, env=base_env
    )
    if env_info is None:
        print(f"error: the info worker failed: {error_line(out)}", file=sys.stderr)
        return 1
    on_gpu = is_gpu(env_info)
    size = args.size or ("gpu" if on_gpu else "tiny")
    default_size = "gpu" if on_gpu else "tiny"
    peak, peak_source = peak_tflops(env_info["device_kind"], args.peak_tflops)
    slug = device_slug(env_info["device_kind"])
    suffix = "" if size == default_size else f"_{size}"
    out_path = args.out or os.path.join(
        _ROOT, "benchmarks", "results", f"bench_gpu_{slug}{suffix}.json"
    )
    hlo_dir = os.path.splitext(out_path)[0] + "_hlo"
    all_sizes = sizes(size)
    plan = [  # in the order of --variants, if given
        (w, name)
        for w in args.workloads
        for name in (args.variants or VARIANTS)
        if w in VARIANTS[name].workloads
    ]
    config = dict(
        size=size,
        steps=args.steps,
        rounds=args.rounds,
        loss_steps=args.loss_steps,
        warmup=args.warmup,
        timeout_s=args.timeout_s,
        budget_s=args.budget_s,
        peak_tflops=peak if on_gpu else None,
        peak_source=peak_source if on_gpu else "no GPU",
        lr=LR,
        adamw=ADAMW,
        workloads={w: config_json(all_sizes[w]) for w in WORKLOADS},
        command=" ".join(
            ["python", *[os.path.relpath(sys.argv[0], _ROOT)], *sys.argv[1:]]
        )
        if argv is None
        else " ".join(["python benchmarks/bench_gpu.py", *argv]),
    )
    data: dict[str, Any] = dict(environment=env_info, config=config, results=[])
    if args.merge and os.path.exists(out_path):
        with open(out_path) as f:
            old = json.load(f)
        try:
            merge_rows(data, old, replaced=set(plan))
        except ValueError as e:
            print(
                f"error: `--merge` into {out_path}: {e}. Pass another --out.",
                file=sys.stderr,
            )
            return 2
    print(
        f"bench_gpu: {env_info['device_kind']} ({env_info['backend']}), size {size}, "
        f"{len(plan)} variants, one process each -> {os.path.relpath(out_path)}",
        flush=True,
    )
    for workload, variant in plan:
        fw = VARIANTS[variant].framework
        row: dict[str, Any] = dict(
            workload=workload,
            variant=variant,
            framework=fw,
            flops_per_step=flops_per_step(workload, all_sizes[workload]),
        )
        elapsed = time.perf_counter() - t_start
        left = math.inf if args.budget_s is None else args.budget_s - elapsed
        if fw == "torch" and importlib.util.find_spec("torch") is None:
            row.update(status="skipped", reason=TORCH_MISSING)
        elif left < 10:
            row.update(
                status="not_run",
                reason=f"--budget-s {args.budget_s:g}: {max(left, 0):.0f} s left at "
                "its turn",
            )
        else:
            spec = dict(
                kind="variant",
                workload=workload,
                variant=variant,
                size=size,
                steps=args.steps,
                rounds=args.rounds,
                loss_steps=args.loss_steps,
                warmup=args.warmup,
                hlo_path=os.path.join(hlo_dir, f"{workload}_{variant}.txt")
                if workload == "float8" or args.dump_hlo
                else None,
            )
            env = dict(base_env, PYTHONUNBUFFERED="1")
            if fw == "torch":
                env["JAX_PLATFORMS"] = "cpu"  # JAX must not take the GPU's memory
            t0 = time.perf_counter()
            limit = min(args.timeout_s, left)
            result, output, rc, timed_out = run_worker(spec, timeout_s=limit, env=env)
            row["wall_s"] = time.perf_counter() - t0
            if timed_out:
                flag = "--timeout-s" if limit == args.timeout_s else "--budget-s"
                last = [line for line in output.splitlines() if line.strip()]
                row.update(
                    status="timeout",
                    reason=f"stopped after {limit:.0f} s ({flag}); last output: "
                    f"{last[-1][:300] if last else 'none'}",
                )
            elif result is None:
                how = f"killed by signal {-rc}" if rc and rc < 0 else f"exit code {rc}"
                row.update(status="failed", reason=f"{how}: {error_line(output)}")
                row["output_tail"] = output.splitlines()[-40:]
            else:
                row.update(result)
        data["results"].append(row)
        write(data, out_path)
        msg = row.get("reason") or (
            f"{row['ms_per_step']:.2f} ms/step, compile {row.get('compile_s', 0):.1f} s"
        )
        print(
            f"  [{workload}/{variant}] {row['status']}: {msg} "
            f"({row.get('wall_s', 0):.0f} s)",
            flush=True,
        )
    data["config"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    try:
        data["config"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        pass
    table = write(data, out_path)
    print(f"wrote {os.path.relpath(out_path)} and its .md")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
