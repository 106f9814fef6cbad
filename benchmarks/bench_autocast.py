"""Benchmark: mixed-precision training steps in JAX (and PyTorch) on one machine.

Every variant of a workload runs the same model and the same training step
(forward, backward, SGD update) and is timed in ONE interleaved run: each round
times one step of every variant in turn (the order rotating between rounds),
after warm-up steps that are not counted, and the report gives medians and their
ratio to the float32 variant. Interleaving matters on a shared machine: a burst of
load from elsewhere slows every variant of that round, not just one.

The models are those of ``mixprec demo`` and ``mixprec bench``
(``mixprec/_src/workloads/models.py``); the timing, memory and machine helpers
are ``mixprec/_src/workloads/timing.py``.

Workloads (default sizes; ``--quick`` shrinks them for a smoke test):

* ``mlp``: the Keras-guide MLP 784-4096-4096-10, batch 1024.
* ``lm``: GPT-style char-LM, 4 layers, d_model 256, 4 heads, seq 256, batch 8.

JAX variants:

* ``float32``: the plain model.
* ``jmp_casting``: hand-written JMP-style casting (params, and the MLP's inputs,
  cast to bfloat16: the whole model in bfloat16, the output cast to float32).
* ``flax_float32`` / ``flax_bf16``: the same model in Flax linen, with
  ``dtype=jnp.bfloat16`` (float32 params) for the latter.
* ``bf16_dots_f32out``: every dot as ``bf16 x bf16 -> f32`` by hand
  (``preferred_element_type=float32``), JAX's own autodiff.
* ``dots_bf16``: every dot through ``mixprec._src.autocast.dots.dot_general``.
* ``autocast`` / ``autocast_flax``: ``mixprec.autocast(loss, "mixed_bfloat16")``
  around the float32 jnp / Flax model.
* ``torch_float32`` / ``torch_autocast_bf16``: the same models in PyTorch, plain
  and under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (skipped when torch
  is not installed; ``pip install torch==2.13.0``). Their ratio is to
  ``torch_float32``.

Also measured, for the JAX variants: XLA's ``compiled.memory_analysis()`` and
the bytes of the residuals saved for the backward pass (the leaves of the
``jax.vjp`` closure, computed with ``jax.eval_shape``: nothing runs) of the MLP
at batch 8192; the trace+compile time of the step with plain bf16 dots, with
``dots`` and under ``autocast``, against the float32 step under plain
``jax.jit``; and the trace cost of autocast (``--trace-only`` runs just that): a
residual MLP (``h = h + tanh(h @ w + b)``, d=64, batch 32) at 16, 64 and 256
layers, trace+lower time of ``value_and_grad(loss)`` and of a whole SGD train
step, plain vs ``mixprec.autocast`` vs written by hand in bfloat16, against
the equation counts of the traced jaxprs, and XLA's compile time of the
autocast step vs the same step written by hand in bfloat16.

Usage::

    python benchmarks/bench_autocast.py [--quick] [--repeats N] [--out PATH]
    python benchmarks/bench_autocast.py --trace-only [--trace-repeats N]

Prints the tables last and writes JSON (and a Markdown copy next to it); every
JSON records the JAX version, the device and the CPU's flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools as ft
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402

import mixprec  # noqa: E402
from mixprec._src.autocast import dots  # noqa: E402
from mixprec._src.workloads import models, timing  # noqa: E402
from mixprec._src.workloads.models import LMConfig, MLPConfig  # noqa: E402


BF16 = jnp.bfloat16
F32 = jnp.float32
LR = 1e-3

# --- configuration -------------------------------------------------------------

FULL: dict[str, dict[str, Any]] = dict(
    mlp=dict(model=MLPConfig(units=4096), batch=1024, memory_batch=8192),
    lm=dict(
        model=LMConfig(
            vocab_size=65, seq_len=256, d_model=256, num_heads=4, num_layers=4
        ),
        batch=8,
    ),
)
QUICK: dict[str, dict[str, Any]] = dict(
    mlp=dict(model=MLPConfig(units=128, in_features=64), batch=32, memory_batch=64),
    lm=dict(
        model=LMConfig(
            vocab_size=17, seq_len=16, d_model=32, num_heads=2, num_layers=1
        ),
        batch=2,
    ),
)
TRACE_LAYERS = (16, 64, 256)
QUICK_TRACE_LAYERS = (2, 8)


def mm_bf16_f32out(a: jax.Array, b: jax.Array, dn: Any) -> jax.Array:
    return lax.dot_general(
        a.astype(BF16), b.astype(BF16), dn, preferred_element_type=F32
    )


def mm_dots(a: jax.Array, b: jax.Array, dn: Any) -> jax.Array:
    return dots.dot_general(a, b, dimension_numbers=dn, low_dtype=BF16, out_dtype=F32)


DOTS: dict[str, models.Dot | None] = {
    "float32": None,
    "bf16_dots_f32out": mm_bf16_f32out,
    "dots_bf16": mm_dots,
}

# --- steps -------------------------------------------------------------------------


def sgd(params: Any, grads: Any) -> Any:
    return jax.tree.map(lambda p, g: p - LR * g.astype(p.dtype), params, grads)


def make_step(loss: Callable[..., jax.Array]) -> Callable[..., Any]:
    def step(params: Any, *batch: jax.Array) -> Any:
        return sgd(params, jax.grad(loss)(params, *batch))

    return step


def plain_loss(
    workload: str, cfg: dict[str, Any], dot: models.Dot | None
) -> Callable[..., jax.Array]:
    """A fresh loss function of the jnp model with dots ``dot``."""
    config = cfg["model"]
    if workload == "mlp":

        def mlp_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            return models.cross_entropy(models.mlp_apply(p, x, dot=dot), y)

        return mlp_loss

    def lm_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        log_probs = models.lm_apply(p, x, num_heads=config.num_heads, dot=dot)
        return models.cross_entropy(log_probs, y)

    return lm_loss


def init_params(workload: str, cfg: dict[str, Any]) -> Any:
    init = models.mlp_init if workload == "mlp" else models.lm_init
    return init(jax.random.key(0), cfg["model"])


def jax_variants(workload: str, cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> dict(loss=fn(params, x, y), params=...)."""
    policy = mixprec.get_policy("p=f32,c=bf16,o=f32")
    config = cfg["model"]
    params = init_params(workload, cfg)
    if workload == "mlp":

        def jmp_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            out = models.mlp_apply(policy.cast_to_compute(p), policy.cast_to_compute(x))
            return models.cross_entropy(policy.cast_to_output(out), y)

        flax_model = ft.partial(models.flax_mlp, config)
        sample = jnp.zeros((1, config.in_features), F32)
    else:

        def jmp_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            out = models.lm_apply(
                policy.cast_to_compute(p), x, num_heads=config.num_heads
            )
            return models.cross_entropy(policy.cast_to_output(out), y)

        flax_model = ft.partial(models.flax_lm, config)
        sample = jnp.zeros((1, config.seq_len), jnp.int32)

    out: dict[str, dict[str, Any]] = {}
    out["float32"] = dict(loss=plain_loss(workload, cfg, None), params=params)
    out["jmp_casting"] = dict(loss=jmp_loss, params=params)
    flax_params = flax_model(F32).init(jax.random.key(0), sample)
    for name, dtype in (("flax_float32", F32), ("flax_bf16", BF16)):
        module = flax_model(dtype)

        def flax_loss(
            p: Any, x: jax.Array, y: jax.Array, module: Any = module
        ) -> jax.Array:
            return models.cross_entropy(module.apply(p, x), y)

        out[name] = dict(loss=flax_loss, params=flax_params)
    for name in ("bf16_dots_f32out", "dots_bf16"):
        out[name] = dict(loss=plain_loss(workload, cfg, DOTS[name]), params=params)
    out["autocast"] = dict(
        loss=mixprec.autocast(plain_loss(workload, cfg, None), "mixed_bfloat16"),
        params=params,
    )
    out["autocast_flax"] = dict(
        loss=mixprec.autocast(out["flax_float32"]["loss"], "mixed_bfloat16"),
        params=flax_params,
    )
    return out


def make_data(
    workload: str, cfg: dict[str, Any], batch: int
) -> tuple[jax.Array, jax.Array]:
    key = jax.random.key(1)
    config = cfg["model"]
    if workload == "mlp":
        x = jax.random.normal(key, (batch, config.in_features), F32)
        y = jax.random.randint(key, (batch,), 0, config.classes)
        return x, y
    tokens = jax.random.randint(key, (batch, config.seq_len + 1), 0, config.vocab_size)
    return tokens[:, :-1], tokens[:, 1:]


# --- PyTorch ---------------------------------------------------------------------


def torch_variants(workload: str, cfg: dict[str, Any]) -> dict[str, Callable[[], None]]:
    """The same models in PyTorch (the one framework the shared models do not
    cover), plain and under ``torch.autocast``."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}
    torch.manual_seed(0)
    config = cfg["model"]
    if workload == "mlp":
        u = config.units
        model = torch.nn.Sequential(
            torch.nn.Linear(config.in_features, u),
            torch.nn.ReLU(),
            torch.nn.Linear(u, u),
            torch.nn.ReLU(),
            torch.nn.Linear(u, config.classes),
        )
        x = torch.randn(cfg["batch"], config.in_features)
        y = torch.randint(0, config.classes, (cfg["batch"],))
    else:
        d, heads, t = config.d_model, config.num_heads, config.seq_len

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln1 = torch.nn.LayerNorm(d)
                self.qkv = torch.nn.Linear(d, 3 * d)
                self.o = torch.nn.Linear(d, d)
                self.ln2 = torch.nn.LayerNorm(d)
                self.fc1 = torch.nn.Linear(d, config.mlp_ratio * d)
                self.fc2 = torch.nn.Linear(config.mlp_ratio * d, d)

            def forward(self, h: Any) -> Any:
                b = h.shape[0]
                q, k, v = (
                    self.qkv(self.ln1(h)).view(b, t, 3, heads, d // heads).unbind(2)
                )
                a = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    is_causal=True,
                )
                h = h + self.o(a.transpose(1, 2).reshape(b, t, d))
                return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))

        class GPT(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = torch.nn.Embedding(config.vocab_size, d)
                self.pos = torch.nn.Parameter(torch.randn(t, d) * 0.01)
                self.blocks = torch.nn.ModuleList(
                    [Block() for _ in range(config.num_layers)]
                )
                self.ln = torch.nn.LayerNorm(d)
                self.head = torch.nn.Linear(d, config.vocab_size)

            def forward(self, tokens: Any) -> Any:
                h = self.embed(tokens) + self.pos
                for blk in self.blocks:
                    h = blk(h)
                return self.head(self.ln(h))

        model = GPT()
        x = torch.randint(0, config.vocab_size, (cfg["batch"], t))
        y = torch.randint(0, config.vocab_size, (cfg["batch"], t))

    def step(autocast: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)
        )
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
                    p.grad = None

    return {
        "torch_float32": ft.partial(step, False),
        "torch_autocast_bf16": ft.partial(step, True),
    }


# --- measurements --------------------------------------------------------------------


def jax_runner(
    step: Callable[..., Any], params: Any, x: jax.Array, y: jax.Array
) -> Callable[[], Any]:
    compiled = jax.jit(step).lower(params, x, y).compile()
    state = {"params": params}

    def run() -> Any:
        # Feed the updated params back in, as a training loop does.
        state["params"] = compiled(state["params"], x, y)
        return state["params"]

    return run


def memory_rows(
    workload: str, cfg: dict[str, Any], variants: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    batch = cfg["memory_batch"]
    x, y = make_data(workload, cfg, batch)
    rows = []
    for name, v in variants.items():
        step = make_step(v["loss"])
        compiled = jax.jit(step).lower(v["params"], x, y).compile()
        row: dict[str, Any] = dict(workload=workload, batch=batch, variant=name)
        row.update(timing.memory_analysis(compiled))
        row["residual_bytes"] = timing.residual_bytes(v["loss"], v["params"], x, y)
        rows.append(row)
    base = {r["variant"]: r for r in rows}
    for r in rows:
        flax = r["variant"].startswith(("flax", "autocast_flax"))
        ref = base.get("flax_float32", base["float32"]) if flax else base["float32"]
        r["residual_ratio"] = r["residual_bytes"] / max(ref["residual_bytes"], 1)
        r["temp_ratio"] = (r["temp_bytes"] or 0) / max(ref["temp_bytes"] or 0, 1)
    return rows


def compile_rows(
    workload: str, cfg: dict[str, Any], repeats: int
) -> list[dict[str, Any]]:
    """Trace+compile time of the step: plain jit vs jit(autocast), interleaved."""
    x, y = make_data(workload, cfg, cfg["batch"])
    params = init_params(workload, cfg)

    def fresh(name: str) -> Callable[[], Any]:
        # Fresh functions every round, so that no cache (jit's or autocast's) is
        # hit: this is the cost of the first call.
        loss = plain_loss(workload, cfg, DOTS.get(name))
        if name == "autocast":
            loss = mixprec.autocast(loss, "mixed_bfloat16")
        step = make_step(loss)
        return lambda: jax.jit(step).lower(params, x, y).compile()

    names = ("float32", "bf16_dots_f32out", "dots_bf16", "autocast")
    times = timing.interleaved(
        {name: ft.partial(fresh, name) for name in names}, rounds=repeats, setup=True
    )
    base = timing.median(times["float32"])
    return [
        dict(
            workload=workload,
            variant=name,
            median_s=timing.median(t),
            times_s=t,
            ratio_vs_float32=timing.ratio(timing.median(t), base),
        )
        for name, t in times.items()
    ]


# --- trace cost ------------------------------------------------------------------


def count_eqns(jaxpr: Any) -> int:
    """Equations of a jaxpr, those of its sub-jaxprs (jit, custom_vjp, ...) included."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
                    n += count_eqns(sub)
    return n


def residual_mlp(layers: int, d: int = 64, batch: int = 32) -> tuple[Any, jax.Array]:
    """Parameters of ``layers`` residual layers and a batch."""
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = [
        dict(
            w=jax.random.normal(k, (d, d), F32) * (1.0 / d**0.5),
            b=jnp.zeros((d,), F32),
        )
        for k in keys[:-1]
    ]
    return params, jax.random.normal(keys[-1], (batch, d), F32)


def residual_loss() -> Callable[[Any, jax.Array], jax.Array]:
    """A fresh loss function: ``h = h + tanh(h @ w + b)`` per layer, float32 code."""

    def loss(params: Any, x: jax.Array) -> jax.Array:
        h = x
        for layer in params:
            h = h + jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean(jnp.square(h))

    return loss


def residual_loss_bf16() -> Callable[[Any, jax.Array], jax.Array]:
    """The same loss written by hand in bfloat16: each layer rounds ``h``, ``w`` and
    ``b`` to bfloat16, computes ``tanh(h @ w + b)`` in bfloat16 and adds it to the
    float32 residual stream (which is what autocast keeps in float32 too)."""

    def loss(params: Any, x: jax.Array) -> jax.Array:
        h = x
        for layer in params:
            z = h.astype(BF16) @ layer["w"].astype(BF16) + layer["b"].astype(BF16)
            h = h + jnp.tanh(z).astype(F32)
        return jnp.mean(jnp.square(h))

    return loss


def trace_functions() -> dict[str, Callable[[], Callable[..., Any]]]:
    """name -> a factory of a fresh function to trace (autocast caches per object)."""

    def step_of(loss: Callable[..., Any]) -> Callable[..., Any]:
        def step(params: Any, x: jax.Array) -> Any:
            grads = jax.grad(loss)(params, x)
            return jax.tree.map(lambda p, g: p - LR * g, params, grads)

        return step

    return {
        "value_and_grad/plain": lambda: jax.value_and_grad(residual_loss()),
        "value_and_grad/autocast": lambda: jax.value_and_grad(
            mixprec.autocast(residual_loss(), "mixed_bfloat16")
        ),
        "value_and_grad/hand_bf16": lambda: jax.value_and_grad(residual_loss_bf16()),
        "step/plain": lambda: step_of(residual_loss()),
        "step/autocast": lambda: mixprec.autocast(
            step_of(residual_loss()), "mixed_bfloat16"
        ),
        "step/hand_bf16": lambda: step_of(residual_loss_bf16()),
    }


def _lower(
    factory: Callable[[], Any], cpu_log: list[float], *args: Any
) -> Callable[[], Any]:
    """Setup: a fresh function; timed: ``jax.jit(fn).trace(*args).lower()``.

    The call also logs the process CPU time it took: tracing is single-threaded
    Python, so on a shared machine the CPU time is the cost without the waits
    for a core that inflate the wall time.
    """
    fn = factory()

    def run() -> Any:
        t0 = time.process_time()
        lowered = jax.jit(fn).trace(*args).lower()
        cpu_log.append(time.process_time() - t0)
        return lowered

    return run


def _compile(factory: Callable[[], Any], *args: Any) -> Callable[[], Any]:
    """Setup: a fresh function traced and lowered; timed: XLA's compile."""
    return jax.jit(factory()).trace(*args).lower().compile


def trace_rows(layers: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """Trace+lower time and equation counts, plain vs autocast; XLA compile time of
    the step: float32, autocast and by hand in bfloat16."""
    factories = trace_functions()
    traced = tuple(
        f"{what}/{how}"
        for what in ("value_and_grad", "step")
        for how in ("plain", "autocast", "hand_bf16")
    )
    compiled = ("step/plain", "step/autocast", "step/hand_bf16")
    rows = []
    for n in layers:
        params, x = residual_mlp(n)
        print(f"[trace] {n} layers: trace+lower x {repeats} ...", flush=True)

        cpu: dict[str, list[float]] = {name: [] for name in traced}
        t_lower = timing.interleaved(
            {
                name: ft.partial(_lower, factories[name], cpu[name], params, x)
                for name in traced
            },
            rounds=repeats,
            setup=True,
        )
        eqns = {
            name: count_eqns(jax.jit(factories[name]()).trace(params, x).jaxpr)
            for name in traced
        }
        print(f"[trace] {n} layers: XLA compile x {repeats} ...", flush=True)

        t_compile = timing.interleaved(
            {
                name: ft.partial(_compile, factories[name], params, x)
                for name in compiled
            },
            rounds=repeats,
            setup=True,
        )
        row: dict[str, Any] = dict(layers=n, eqns=eqns)
        for what in ("value_and_grad", "step"):
            plain = timing.median(t_lower[f"{what}/plain"])
            auto = timing.median(t_lower[f"{what}/autocast"])
            n_plain, n_auto = eqns[f"{what}/plain"], eqns[f"{what}/autocast"]
            cpu_plain = timing.median(cpu[f"{what}/plain"])
            cpu_auto = timing.median(cpu[f"{what}/autocast"])
            row[what] = dict(
                plain_s=plain,
                autocast_s=auto,
                plain_times_s=t_lower[f"{what}/plain"],
                autocast_times_s=t_lower[f"{what}/autocast"],
                ratio=timing.ratio(auto, plain),
                plain_cpu_s=cpu_plain,
                autocast_cpu_s=cpu_auto,
                plain_cpu_times_s=cpu[f"{what}/plain"],
                autocast_cpu_times_s=cpu[f"{what}/autocast"],
                cpu_ratio=timing.ratio(cpu_auto, cpu_plain),
                eqns_plain=n_plain,
                eqns_autocast=n_auto,
                plain_us_per_eqn=1e6 * plain / n_plain,
                autocast_us_per_eqn=1e6 * auto / n_auto,
                plain_cpu_us_per_eqn=1e6 * cpu_plain / n_plain,
                autocast_cpu_us_per_eqn=1e6 * cpu_auto / n_auto,
                # The time ratio over the equation-count ratio: 1.0 when an
                # autocast equation costs what a plain one does.
                ratio_per_eqn=timing.ratio(auto / n_auto, plain / n_plain),
                cpu_ratio_per_eqn=timing.ratio(cpu_auto / n_auto, cpu_plain / n_plain),
                extra_us_per_plain_eqn=1e6 * (auto - plain) / n_plain,
                extra_cpu_us_per_plain_eqn=1e6 * (cpu_auto - cpu_plain) / n_plain,
                # The same computation written by hand in bf16: its casts are
                # equations too, so this is the floor for emitting them.
                hand_bf16_cpu_s=timing.median(cpu[f"{what}/hand_bf16"]),
                hand_bf16_cpu_times_s=cpu[f"{what}/hand_bf16"],
                eqns_hand_bf16=eqns[f"{what}/hand_bf16"],
                hand_bf16_cpu_ratio=timing.ratio(
                    timing.median(cpu[f"{what}/hand_bf16"]), cpu_plain
                ),
                cpu_ratio_vs_hand_bf16=timing.ratio(
                    cpu_auto, timing.median(cpu[f"{what}/hand_bf16"])
                ),
            )
        row["compile"] = {
            name.split("/")[1]: dict(
                median_s=timing.median(t), times_s=t, eqns=eqns[name]
            )
            for name, t in t_compile.items()
        }
        row["compile"]["autocast_vs_hand_bf16"] = timing.ratio(
            row["compile"]["autocast"]["median_s"],
            row["compile"]["hand_bf16"]["median_s"],
        )
        rows.append(row)
    return rows


# --- report -------------------------------------------------------------------


def fmt_trace_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| layers | traced + lowered | plain ms | autocast ms | ratio | plain CPU ms "
        "| autocast CPU ms | CPU ratio | eqns plain | eqns autocast | plain CPU "
        "us/eqn | autocast CPU us/eqn | CPU ratio per eqn | hand bf16 CPU ms "
        "| hand bf16 / plain | autocast / hand bf16 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for what in ("value_and_grad", "step"):
            m = r[what]
            lines.append(
                f"| {r['layers']} | {what} | {1e3 * m['plain_s']:.1f} "
                f"| {1e3 * m['autocast_s']:.1f} | {m['ratio']:.2f}x "
                f"| {1e3 * m['plain_cpu_s']:.1f} | {1e3 * m['autocast_cpu_s']:.1f} "
                f"| {m['cpu_ratio']:.2f}x | {m['eqns_plain']} | {m['eqns_autocast']} "
                f"| {m['plain_cpu_us_per_eqn']:.0f} "
                f"| {m['autocast_cpu_us_per_eqn']:.0f} "
                f"| {m['cpu_ratio_per_eqn']:.2f} "
                f"| {1e3 * m['hand_bf16_cpu_s']:.1f} | {m['hand_bf16_cpu_ratio']:.2f}x "
                f"| {m['cpu_ratio_vs_hand_bf16']:.2f}x |"
            )
    lines += [
        "",
        "Medians of interleaved rounds, fresh functions every round. ms: wall "
        "time; CPU ms: the process's CPU time over the same calls (tracing is "
        "single-threaded, so this is the cost without the waits for a core that "
        "load on a shared machine adds to the wall time). ratio: autocast / plain. "
        "eqns: equations of the traced jaxpr, sub-jaxprs included. us/eqn flat "
        "across depths = cost linear in the equation count. CPU ratio per eqn: "
        "CPU ratio / (eqns autocast / eqns plain), the cost of an autocast "
        "equation relative to a plain one. hand bf16: the same computation written "
        "by hand in bfloat16 (casts included), CPU time; the floor for a jaxpr "
        "that holds the casts. The JSON has the wall-time per-equation figures too.",
    ]
    lines += [
        "",
        "| layers | XLA compile of the step | float32 s | autocast s | hand bf16 s "
        "| autocast / hand bf16 | eqns autocast | eqns hand bf16 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r["compile"]
        lines.append(
            f"| {r['layers']} | step | {c['plain']['median_s']:.2f} "
            f"| {c['autocast']['median_s']:.2f} | {c['hand_bf16']['median_s']:.2f} "
            f"| {c['autocast_vs_hand_bf16']:.2f}x | {c['autocast']['eqns']} "
            f"| {c['hand_bf16']['eqns']} |"
        )
    return "\n".join(lines)


def fmt_table(data: dict[str, Any]) -> str:
    lines = []
    if data["results"]:
        lines.append("| workload | variant | median step (ms) | speedup vs float32 |")
        lines.append("|---|---|---:|---:|")
        for r in data["results"]:
            lines.append(
                f"| {r['workload']} | {r['variant']} | {r['median_s'] * 1e3:.1f} | "
                f"{r['speedup_vs_float32']:.2f}x |"
            )
    if data["memory"]:
        lines.append("")
        lines.append(
            "| workload | batch | variant | residuals (MiB) | vs f32 | temp (MiB) | "
            "argument (MiB) | output (MiB) |"
        )
        lines.append("|---|---:|---|---:|---:|---:|---:|---:|")
        mib = 2.0**20
        for r in data["memory"]:
            lines.append(
                f"| {r['workload']} | {r['batch']} | {r['variant']} | "
                f"{r['residual_bytes'] / mib:.1f} | {r['residual_ratio']:.2f}x | "
                f"{(r['temp_bytes'] or 0) / mib:.1f} | "
                f"{(r['argument_bytes'] or 0) / mib:.1f} | "
                f"{(r['output_bytes'] or 0) / mib:.1f} |"
            )
    if data["compile"]:
        lines.append("")
        lines.append(
            "| workload | step traced+compiled with | median (s) | vs plain jit |"
        )
        lines.append("|---|---|---:|---:|")
        for r in data["compile"]:
            lines.append(
                f"| {r['workload']} | {r['variant']} | {r['median_s']:.2f} | "
                f"{r['ratio_vs_float32']:.2f}x |"
            )
    if data["trace"]:
        lines.append("")
        lines.append(fmt_trace_table(data["trace"]))
    return "\n".join(lines).strip("\n")


def header(cfg: dict[str, Any]) -> str:
    env = cfg["environment"]
    load = env["loadavg"] or [float("nan")]
    end = cfg.get("loadavg_end") or [float("nan")]
    return (
        f"Measured {env['date']} on {env['device']} / {env['cpu_model']} "
        f"({env['cpu_count']} CPUs, {env['backend']}; CPU flags: "
        f"{timing.flags_summary(env['cpu_flags'])}), jax {env['jax']}, torch "
        f"{cfg['torch']}; load average {load[0]:.1f} -> {end[0]:.1f}. "
        f"Command: `{cfg['command']}`."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes (CI smoke test)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed steps per variant"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps per variant"
    )
    parser.add_argument("--compile-repeats", type=int, default=None)
    parser.add_argument("--workloads", default="mlp,lm", help="comma-separated: mlp,lm")
    parser.add_argument(
        "--variants", default=None, help="comma-separated subset to run"
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument(
        "--trace-only",
        action="store_true",
        help="run only the trace-cost section (residual MLP, plain vs autocast)",
    )
    parser.add_argument(
        "--no-trace", action="store_true", help="skip the trace-cost section"
    )
    parser.add_argument(
        "--trace-layers",
        default=None,
        help="comma-separated depths of the residual MLP (default: 16,64,256; "
        "--quick: 2,8)",
    )
    parser.add_argument(
        "--trace-repeats",
        type=int,
        default=None,
        help="interleaved rounds of the trace-cost section (default: 5; --quick: 1)",
    )
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.trace_only and args.no_trace:
        parser.error("--trace-only and --no-trace contradict each other")

    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 7)
    compile_repeats = args.compile_repeats or (1 if args.quick else 3)
    trace_repeats = args.trace_repeats or (1 if args.quick else 5)
    try:
        trace_layers = (
            tuple(int(n) for n in args.trace_layers.split(",") if n.strip())
            if args.trace_layers
            else (QUICK_TRACE_LAYERS if args.quick else TRACE_LAYERS)
        )
    except ValueError:
        parser.error(f"--trace-layers: expected integers, got {args.trace_layers!r}")
    for value, flag in (
        (repeats, "--repeats"),
        (compile_repeats, "--compile-repeats"),
        (trace_repeats, "--trace-repeats"),
        (min(trace_layers, default=0), "--trace-layers"),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    workloads = (
        []
        if args.trace_only
        else [w.strip() for w in args.workloads.split(",") if w.strip()]
    )
    for w in workloads:
        if w not in FULL:
            parser.error(f"unknown workload {w!r}; choose from {sorted(FULL)}")
    env = timing.environment()
    stem = "bench_autocast_trace" if args.trace_only else "bench_autocast"
    out_path = args.out or os.path.join(
        _ROOT,
        "benchmarks",
        "results",
        f"{stem}_{env['backend']}{'_quick' if args.quick else ''}.json",
    )
    torch_version = None
    if not (args.no_torch or args.trace_only):
        try:
            import torch

            torch_version = torch.__version__
        except ImportError:
            pass

    data: dict[str, Any] = dict(
        config=dict(
            quick=args.quick,
            repeats=repeats,
            warmup=args.warmup,
            compile_repeats=compile_repeats,
            trace_repeats=trace_repeats,
            trace_layers=None if args.no_trace else list(trace_layers),
            workloads={
                w: {
                    **{k: v for k, v in sizes[w].items() if k != "model"},
                    "model": dataclasses.asdict(sizes[w]["model"]),
                }
                for w in workloads
            },
            environment=env,
            jax=env["jax"],
            cpu_flags=env["cpu_flags"],
            torch=torch_version,
            command=" ".join(["python", *sys.argv]),
        ),
        results=[],
        memory=[],
        compile=[],
        trace=[],
    )
    only = set(args.variants.split(",")) if args.variants else None
    t_start = time.perf_counter()

    for w in workloads:
        cfg = sizes[w]
        print(f"[{w}] building variants ...", flush=True)
        variants = jax_variants(w, cfg)
        if only:
            variants = {
                k: v for k, v in variants.items() if k in only or k == "float32"
            }
        x, y = make_data(w, cfg, cfg["batch"])
        runners: dict[str, Callable[[], Any]] = {}
        for name, v in variants.items():
            t0 = time.perf_counter()
            runners[name] = jax_runner(make_step(v["loss"]), v["params"], x, y)
            print(f"  compiled {name} in {time.perf_counter() - t0:.1f}s", flush=True)
        if not args.no_torch:
            tv = torch_variants(w, cfg)
            if only:
                tv = {k: v for k, v in tv.items() if k in only or k == "torch_float32"}
            runners.update(tv)
        print(
            f"[{w}] timing {len(runners)} variants x {repeats} interleaved rounds",
            flush=True,
        )
        times = timing.interleaved(runners, rounds=repeats, warmup=args.warmup)
        med = {k: timing.median(t) for k, t in times.items()}
        for name, t in times.items():
            base = med["torch_float32"] if name.startswith("torch") else med["float32"]
            data["results"].append(
                dict(
                    workload=w,
                    variant=name,
                    framework="torch" if name.startswith("torch") else "jax",
                    median_s=med[name],
                    min_s=min(t),
                    times_s=t,
                    speedup_vs_float32=timing.ratio(base, med[name]),
                    speedup_vs_jax_float32=timing.ratio(med["float32"], med[name]),
                )
            )
        if w == "mlp" and not args.no_memory:
            print(f"[{w}] memory at batch {cfg['memory_batch']} ...", flush=True)
            data["memory"].extend(memory_rows(w, cfg, variants))
        if not args.no_compile:
            print(f"[{w}] trace+compile time ...", flush=True)
            data["compile"].extend(compile_rows(w, cfg, compile_repeats))
    if not args.no_trace:
        data["trace"] = trace_rows(trace_layers, trace_repeats)

    data["config"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    data["config"]["loadavg_end"] = timing.environment()["loadavg"]
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(data, f, indent=1)
    table = fmt_table(data)
    md_path = os.path.splitext(out_path)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(header(data["config"]) + "\n\n" + table + "\n")
    print(f"wrote {out_path} and {md_path}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
