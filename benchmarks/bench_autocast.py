"""Benchmark: mixed-precision training steps in JAX (and PyTorch) on one machine.

Every variant of a workload runs the same model and the same training step
(forward, backward, SGD update) and is timed in ONE interleaved run: each repeat
times one step of every variant in turn, after warm-up steps that are not
counted, and the report gives medians and their ratio to the float32 variant.
Interleaving matters on a shared machine: a burst of load from elsewhere slows
every variant of that repeat, not just one.

Workloads (default sizes; ``--quick`` shrinks them for a smoke test):

* ``mlp``: 784-4096-4096-10 MLP, batch 1024, softmax cross-entropy.
* ``lm``: GPT-style char-LM, 4 layers, d_model 256, 4 heads, seq 256, batch 8.

JAX variants:

* ``float32``: the plain model.
* ``jmp_casting``: hand-written JMP-style casting (params and inputs cast to
  bfloat16, the whole model in bfloat16, logits cast back to float32).
* ``flax_float32`` / ``flax_bf16``: the same model in Flax linen, with
  ``dtype=jnp.bfloat16`` (float32 params) for the latter.
* ``bf16_dots_f32out``: every dot as ``bf16 x bf16 -> f32`` by hand
  (``preferred_element_type=float32``), JAX's own autodiff.
* ``dots_bf16``: every dot through ``mixprec._src.autocast.dots.dot_general``.
* ``autocast`` / ``autocast_flax``: ``mixprec.autocast(loss, "mixed_bfloat16")``
  around the float32 jnp / Flax model (when ``mixprec.autocast`` exists).
* ``torch_float32`` / ``torch_autocast_bf16``: the same models in PyTorch, plain
  and under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (skipped when torch
  is not installed; ``pip install torch==2.13.0``). Their ratio is to
  ``torch_float32``.

Also measured, for the JAX variants: XLA's ``compiled.memory_analysis()`` and
the bytes of the residuals saved for the backward pass (the leaves of the
``jax.vjp`` closure, computed with ``jax.eval_shape``: nothing runs) of the MLP
at batch 8192, and the trace+compile time of the step with plain bf16 dots,
with ``dots`` and under ``autocast``, against the float32 step under plain
``jax.jit``.

Usage::

    python benchmarks/bench_autocast.py [--quick] [--repeats N] [--out PATH]

Prints a table last and writes JSON (and a Markdown table next to it).
"""

from __future__ import annotations

import argparse
import datetime
import functools as ft
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from mixprec._src.autocast import dots  # noqa: E402


BF16 = jnp.bfloat16
F32 = jnp.float32
LR = 1e-3

# --- configuration -------------------------------------------------------------

FULL: dict[str, dict[str, Any]] = dict(
    mlp=dict(sizes=(784, 4096, 4096, 10), batch=1024, memory_batch=8192),
    lm=dict(vocab=65, layers=4, d_model=256, heads=4, seq=256, batch=8),
)
QUICK: dict[str, dict[str, Any]] = dict(
    mlp=dict(sizes=(64, 128, 128, 10), batch=32, memory_batch=64),
    lm=dict(vocab=17, layers=1, d_model=32, heads=2, seq=16, batch=2),
)

Mm = Callable[[jax.Array, jax.Array, Any], jax.Array]


def mm_float32(a: jax.Array, b: jax.Array, dn: Any) -> jax.Array:
    return lax.dot_general(a, b, dn)


def mm_bf16_f32out(a: jax.Array, b: jax.Array, dn: Any) -> jax.Array:
    return lax.dot_general(
        a.astype(BF16), b.astype(BF16), dn, preferred_element_type=F32
    )


def mm_dots(a: jax.Array, b: jax.Array, dn: Any) -> jax.Array:
    return dots.dot_general(a, b, dimension_numbers=dn, low_dtype=BF16, out_dtype=F32)


def dense(x: jax.Array, w: jax.Array, mm: Mm) -> jax.Array:
    return mm(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(F32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


# --- MLP ------------------------------------------------------------------------


def mlp_init(key: jax.Array, sizes: tuple[int, ...]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        dict(
            w=jax.random.normal(k, (i, o), F32) / math.sqrt(i),
            b=jnp.zeros((o,), F32),
        )
        for k, i, o in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_apply(params: list[dict[str, jax.Array]], x: jax.Array, mm: Mm) -> jax.Array:
    h = x
    for i, layer in enumerate(params):
        h = dense(h, layer["w"], mm) + layer["b"].astype(h.dtype)
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return h


def mlp_flax(sizes: tuple[int, ...], dtype: Any) -> Any:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for i, n in enumerate(sizes[1:]):
                x = nn.Dense(n, dtype=dtype, param_dtype=F32)(x)
                if i < len(sizes) - 2:
                    x = nn.relu(x)
            return x

    return MLP()


# --- GPT char-LM ------------------------------------------------------------------


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * lax.rsqrt(var + jnp.asarray(1e-6, x.dtype))
    return y * scale.astype(x.dtype) + bias.astype(x.dtype)


def lm_init(key: jax.Array, cfg: dict[str, int]) -> dict[str, Any]:
    d, v, t = cfg["d_model"], cfg["vocab"], cfg["seq"]
    keys = iter(jax.random.split(key, 4 + 4 * cfg["layers"]))

    def normal(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(next(keys), shape, F32) / math.sqrt(fan_in)

    def ln() -> dict[str, jax.Array]:
        return dict(scale=jnp.ones((d,), F32), bias=jnp.zeros((d,), F32))

    layers = [
        dict(
            ln1=ln(),
            wqkv=normal((d, 3 * d), d),
            wo=normal((d, d), d),
            ln2=ln(),
            w1=normal((d, 4 * d), d),
            b1=jnp.zeros((4 * d,), F32),
            w2=normal((4 * d, d), 4 * d),
            b2=jnp.zeros((d,), F32),
        )
        for _ in range(cfg["layers"])
    ]
    return dict(
        embed=normal((v, d), 1),
        pos=normal((t, d), 1) * 0.02,
        layers=layers,
        ln_f=ln(),
        head=normal((d, v), d),
    )


def lm_apply(
    params: dict[str, Any], tokens: jax.Array, mm: Mm, heads: int
) -> jax.Array:
    dtype = params["embed"].dtype
    b, t = tokens.shape
    h = params["embed"][tokens] + params["pos"][:t].astype(dtype)
    d = h.shape[-1]
    hd = d // heads
    mask = jnp.tril(jnp.ones((t, t), bool))
    for layer in params["layers"]:
        a = layer_norm(h, layer["ln1"]["scale"], layer["ln1"]["bias"])
        qkv = dense(a, layer["wqkv"], mm).reshape(b, t, 3, heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q = q * jnp.asarray(1 / math.sqrt(hd), q.dtype)
        # "bthd,bshd->bhts" and "bhts,bshd->bthd", as Flax writes them.
        s = mm(q, k, (((3,), (3,)), ((0, 2), (0, 2))))
        s = jnp.where(mask, s, jnp.asarray(jnp.finfo(s.dtype).min, s.dtype))
        p = jax.nn.softmax(s, axis=-1)
        o = mm(p, v.astype(p.dtype), (((3,), (1,)), ((0, 1), (0, 2))))  # b h t d
        o = jnp.swapaxes(o, 1, 2).reshape(b, t, d)
        h = h + dense(o, layer["wo"], mm).astype(h.dtype)
        a = layer_norm(h, layer["ln2"]["scale"], layer["ln2"]["bias"])
        f = jax.nn.gelu(dense(a, layer["w1"], mm) + layer["b1"].astype(a.dtype))
        h = h + (dense(f, layer["w2"], mm) + layer["b2"].astype(f.dtype)).astype(
            h.dtype
        )
    h = layer_norm(h, params["ln_f"]["scale"], params["ln_f"]["bias"])
    return dense(h, params["head"], mm)


def lm_flax(cfg: dict[str, int], dtype: Any) -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            a = nn.LayerNorm(dtype=dtype, param_dtype=F32)(x)
            a = nn.MultiHeadDotProductAttention(
                num_heads=cfg["heads"], dtype=dtype, param_dtype=F32, use_bias=False
            )(a, a, mask=mask)
            x = x + a
            a = nn.LayerNorm(dtype=dtype, param_dtype=F32)(x)
            a = nn.Dense(4 * cfg["d_model"], dtype=dtype, param_dtype=F32)(a)
            a = nn.Dense(cfg["d_model"], dtype=dtype, param_dtype=F32)(nn.gelu(a))
            return x + a

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array) -> jax.Array:
            t = tokens.shape[1]
            x = nn.Embed(cfg["vocab"], cfg["d_model"], dtype=dtype, param_dtype=F32)(
                tokens
            )
            pos = self.param(
                "pos", nn.initializers.normal(0.02), (cfg["seq"], cfg["d_model"]), F32
            )
            x = x + pos[:t].astype(x.dtype)
            mask = nn.make_causal_mask(tokens)
            for _ in range(cfg["layers"]):
                x = Block()(x, mask)
            x = nn.LayerNorm(dtype=dtype, param_dtype=F32)(x)
            return nn.Dense(cfg["vocab"], dtype=dtype, param_dtype=F32)(x)

    return GPT()


# --- steps -------------------------------------------------------------------------


def sgd(params: Any, grads: Any) -> Any:
    return jax.tree.map(lambda p, g: p - LR * g.astype(p.dtype), params, grads)


def make_step(loss: Callable[..., jax.Array]) -> Callable[..., Any]:
    def step(params: Any, x: jax.Array, y: jax.Array) -> Any:
        return sgd(params, jax.grad(loss)(params, x, y))

    return step


def autocast_available() -> bool:
    import mixprec

    return hasattr(mixprec, "autocast")


def plain_loss(
    workload: str, cfg: dict[str, Any], mm: Mm
) -> tuple[Callable[..., jax.Array], Any]:
    """A fresh loss function of the jnp model (and its params) with dots ``mm``."""
    key = jax.random.key(0)
    if workload == "mlp":

        def mlp_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            return cross_entropy(mlp_apply(p, x, mm), y)

        return mlp_loss, mlp_init(key, cfg["sizes"])

    def lm_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return cross_entropy(lm_apply(p, x, mm, cfg["heads"]), y)

    return lm_loss, lm_init(key, cfg)


def jax_variants(workload: str, cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> dict(loss=fn(params, x, y), params=..., note=...)."""
    import mixprec

    policy = mixprec.get_policy("p=f32,c=bf16,o=f32")
    key = jax.random.key(0)
    out: dict[str, dict[str, Any]] = {}
    if workload == "mlp":
        sizes = cfg["sizes"]
        params = mlp_init(key, sizes)

        def loss_with(mm: Mm) -> Callable[..., jax.Array]:
            def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
                return cross_entropy(mlp_apply(p, x, mm), y)

            return loss

        def jmp_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            logits = mlp_apply(
                policy.cast_to_compute(p), policy.cast_to_compute(x), mm_float32
            )
            return cross_entropy(policy.cast_to_output(logits), y)

        flax_models = {
            "flax_float32": mlp_flax(sizes, F32),
            "flax_bf16": mlp_flax(sizes, BF16),
        }
        sample = jnp.zeros((1, sizes[0]), F32)
    else:
        params = lm_init(key, cfg)
        heads = cfg["heads"]

        def loss_with(mm: Mm) -> Callable[..., jax.Array]:
            def loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
                return cross_entropy(lm_apply(p, x, mm, heads), y)

            return loss

        def jmp_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
            logits = lm_apply(policy.cast_to_compute(p), x, mm_float32, heads)
            return cross_entropy(policy.cast_to_output(logits), y)

        flax_models = {
            "flax_float32": lm_flax(cfg, F32),
            "flax_bf16": lm_flax(cfg, BF16),
        }
        sample = jnp.zeros((1, cfg["seq"]), jnp.int32)

    out["float32"] = dict(loss=loss_with(mm_float32), params=params)
    out["jmp_casting"] = dict(loss=jmp_loss, params=params)
    flax_params = None
    for name, model in flax_models.items():
        if flax_params is None:
            flax_params = model.init(key, sample)

        def flax_loss(
            p: Any, x: jax.Array, y: jax.Array, model: Any = model
        ) -> jax.Array:
            return cross_entropy(model.apply(p, x), y)

        out[name] = dict(loss=flax_loss, params=flax_params)
    out["bf16_dots_f32out"] = dict(loss=loss_with(mm_bf16_f32out), params=params)
    out["dots_bf16"] = dict(loss=loss_with(mm_dots), params=params)
    if autocast_available():
        out["autocast"] = dict(
            loss=mixprec.autocast(loss_with(mm_float32), "mixed_bfloat16"),
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
    if workload == "mlp":
        x = jax.random.normal(key, (batch, cfg["sizes"][0]), F32)
        y = jax.random.randint(key, (batch,), 0, cfg["sizes"][-1])
        return x, y
    tokens = jax.random.randint(key, (batch, cfg["seq"] + 1), 0, cfg["vocab"])
    return tokens[:, :-1], tokens[:, 1:]


# --- PyTorch ---------------------------------------------------------------------


def torch_variants(workload: str, cfg: dict[str, Any]) -> dict[str, Callable[[], None]]:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}
    torch.manual_seed(0)
    if workload == "mlp":
        sizes = cfg["sizes"]
        mods: list[Any] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            mods.append(torch.nn.Linear(a, b))
            if i < len(sizes) - 2:
                mods.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*mods)
        x = torch.randn(cfg["batch"], sizes[0])
        y = torch.randint(0, sizes[-1], (cfg["batch"],))
    else:
        d, heads, t = cfg["d_model"], cfg["heads"], cfg["seq"]

        class Block(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln1 = torch.nn.LayerNorm(d)
                self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
                self.o = torch.nn.Linear(d, d, bias=False)
                self.ln2 = torch.nn.LayerNorm(d)
                self.fc1 = torch.nn.Linear(d, 4 * d)
                self.fc2 = torch.nn.Linear(4 * d, d)

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
                self.embed = torch.nn.Embedding(cfg["vocab"], d)
                self.pos = torch.nn.Parameter(torch.randn(t, d) * 0.02)
                self.blocks = torch.nn.ModuleList(
                    [Block() for _ in range(cfg["layers"])]
                )
                self.ln = torch.nn.LayerNorm(d)
                self.head = torch.nn.Linear(d, cfg["vocab"])

            def forward(self, tokens: Any) -> Any:
                h = self.embed(tokens) + self.pos
                for blk in self.blocks:
                    h = blk(h)
                return self.head(self.ln(h))

        model = GPT()
        x = torch.randint(0, cfg["vocab"], (cfg["batch"], t))
        y = torch.randint(0, cfg["vocab"], (cfg["batch"], t))

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


def time_interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int
) -> dict[str, list[float]]:
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def jax_runner(
    step: Callable[..., Any], params: Any, x: jax.Array, y: jax.Array
) -> Callable[[], Any]:
    compiled = jax.jit(step).lower(params, x, y).compile()
    state = {"params": params}

    def run() -> Any:
        # Feed the updated params back in, as a training loop does.
        state["params"] = jax.block_until_ready(compiled(state["params"], x, y))

    return run


def nbytes(tree: Any) -> int:
    return sum(
        int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "shape")
    )


def residual_bytes(
    loss: Callable[..., jax.Array], params: Any, x: jax.Array, y: jax.Array
) -> int:
    """Bytes held by the ``jax.vjp`` closure (the residuals), without running."""

    def residuals(p: Any) -> Any:
        _, vjp_fn = jax.vjp(lambda p: loss(p, x, y), p)
        return jax.tree.leaves(vjp_fn)

    return nbytes(jax.eval_shape(residuals, params))


def memory_rows(
    workload: str, cfg: dict[str, Any], variants: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    batch = cfg["memory_batch"]
    x, y = make_data(workload, cfg, batch)
    rows = []
    for name, v in variants.items():
        step = make_step(v["loss"])
        compiled = jax.jit(step).lower(v["params"], x, y).compile()
        ma = compiled.memory_analysis()
        row: dict[str, Any] = dict(workload=workload, batch=batch, variant=name)
        for field in ("temp", "argument", "output", "alias", "generated_code"):
            row[f"{field}_bytes"] = int(getattr(ma, f"{field}_size_in_bytes", 0) or 0)
        row["residual_bytes"] = residual_bytes(v["loss"], v["params"], x, y)
        rows.append(row)
    base = {r["variant"]: r for r in rows}
    for r in rows:
        flax = r["variant"].startswith(("flax", "autocast_flax"))
        ref = base.get("flax_float32", base["float32"]) if flax else base["float32"]
        r["residual_ratio"] = r["residual_bytes"] / max(ref["residual_bytes"], 1)
        r["temp_ratio"] = r["temp_bytes"] / max(ref["temp_bytes"], 1)
    return rows


def compile_rows(
    workload: str, cfg: dict[str, Any], repeats: int
) -> list[dict[str, Any]]:
    """Trace+compile time of the step: plain jit vs jit(autocast)."""
    import mixprec

    if not autocast_available():
        return []
    x, y = make_data(workload, cfg, cfg["batch"])
    times: dict[str, list[float]] = {
        "float32": [],
        "bf16_dots_f32out": [],
        "dots_bf16": [],
        "autocast": [],
    }
    mms = {"dots_bf16": mm_dots, "bf16_dots_f32out": mm_bf16_f32out}
    for _ in range(repeats):
        for name in times:
            # Fresh functions each time, so that no cache (jit's or autocast's)
            # is hit: this is the cost of the first call.
            loss, params = plain_loss(workload, cfg, mms.get(name, mm_float32))
            if name == "autocast":
                loss = mixprec.autocast(loss, "mixed_bfloat16")
            step = make_step(loss)
            t0 = time.perf_counter()
            jax.jit(step).lower(params, x, y).compile()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["float32"])
    return [
        dict(
            workload=workload,
            variant=name,
            median_s=statistics.median(t),
            times_s=t,
            ratio_vs_float32=statistics.median(t) / base,
        )
        for name, t in times.items()
    ]


# --- report -------------------------------------------------------------------


def fmt_table(data: dict[str, Any]) -> str:
    lines = []
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
                f"{r['temp_bytes'] / mib:.1f} | {r['argument_bytes'] / mib:.1f} | "
                f"{r['output_bytes'] / mib:.1f} |"
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
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)

    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (2 if args.quick else 7)
    compile_repeats = args.compile_repeats or (1 if args.quick else 3)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in FULL:
            parser.error(f"unknown workload {w!r}; choose from {sorted(FULL)}")
    backend = jax.default_backend()
    out_path = args.out or os.path.join(
        _ROOT,
        "benchmarks",
        "results",
        f"bench_autocast_{backend}{'_quick' if args.quick else ''}.json",
    )
    try:
        import torch

        torch_version = None if args.no_torch else torch.__version__
    except ImportError:
        torch_version = None

    data: dict[str, Any] = dict(
        config=dict(
            quick=args.quick,
            repeats=repeats,
            warmup=args.warmup,
            compile_repeats=compile_repeats,
            workloads={w: sizes[w] for w in workloads},
            backend=backend,
            device=str(jax.devices()[0].device_kind),
            cpu_model=cpu_model(),
            cpu_count=os.cpu_count(),
            jax=jax.__version__,
            jaxlib=importlib.metadata.version("jaxlib"),
            torch=torch_version,
            python=platform.python_version(),
            machine=platform.machine(),
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            command=" ".join(["python", *sys.argv]),
            loadavg_start=list(os.getloadavg()),
        ),
        results=[],
        memory=[],
        compile=[],
    )
    only = set(args.variants.split(",")) if args.variants else None

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
            f"[{w}] timing {len(runners)} variants x {repeats} interleaved repeats",
            flush=True,
        )
        times = time_interleaved(runners, repeats, args.warmup)
        med = {k: statistics.median(t) for k, t in times.items()}
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
                    speedup_vs_float32=base / med[name],
                    speedup_vs_jax_float32=med["float32"] / med[name],
                )
            )
        if w == "mlp" and not args.no_memory:
            print(f"[{w}] memory at batch {cfg['memory_batch']} ...", flush=True)
            data["memory"].extend(memory_rows(w, cfg, variants))
        if not args.no_compile:
            print(f"[{w}] trace+compile time ...", flush=True)
            data["compile"].extend(compile_rows(w, cfg, compile_repeats))

    data["config"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(data, f, indent=1)
    table = fmt_table(data)
    md_path = os.path.splitext(out_path)[0] + ".md"
    with open(md_path, "w") as f:
        cfg = data["config"]
        f.write(
            f"Measured {cfg['date']} on {cfg['device']} / {cfg['cpu_model']} "
            f"({cfg['cpu_count']} CPUs, "
            f"{cfg['backend']}), jax {cfg['jax']}, torch {cfg['torch']}; "
            f"load average {cfg['loadavg_start'][0]:.1f} -> "
            f"{cfg['loadavg_end'][0]:.1f}. "
            f"Command: `{cfg['command']}`.\n\n"
        )
        f.write(table + "\n")
    print(f"wrote {out_path} and {md_path}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
