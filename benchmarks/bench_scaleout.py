"""Benchmark: what crosses the wire when mixed precision is scaled out (8 CPU devices).

Two workloads, each jitted as one training step over global arrays (GSPMD):

* ``fsdp``: a 4-layer pre-norm transformer (d 512, 8 heads, ff 2048, vocabulary
  2048, T 64, batch 16; 13.6 M parameters, 26 weight matrices) with its
  parameters and AdamW state sharded on the ``data`` axis of an 8-device mesh
  (FSDP / ZeRO-3) and the batch sharded on the same axis. ``--size tiny``: d 64,
  2 layers, vocabulary 256 (the smoke test).
* ``tp_mlp``: a 2-block residual MLP on a 2 x 4 ``data`` x ``model`` mesh, the
  first matrix of a block column-parallel and the second row-parallel
  (Megatron), the batch on ``data``; d 512, ff 2048, 256 tokens (tiny: d 64).

Variants: ``float32``; ``hand_bf16`` (bfloat16 by hand: parameters cast once at
the top of the loss, norms and softmax in float32); ``loss_only``
(``jax.grad(autocast(loss, policy))``) and ``whole_step`` (``autocast(step,
policy)``) for each reduce dtype (``r=f32`` and ``r=bf16``). Not run by
default: ``compact_sr_int8``, the training state of
``mixprec.optax.compact_state(adamw, weights="bfloat16-sr", moments="int8")``
(bfloat16 parameters the model reads as they are, 8-bit block-wise moments); its
row also records the losses of the same steps on one device
(``losses_one_device``), which must be the same.

Per variant and device-step, from the HLO right after SPMD partitioning (the
partitioner's decision; XLA:CPU later widens every bfloat16 collective to
float32, so the optimized HLO would show float32): the bytes of each collective
kind (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute) by
dtype, the result size of each collective instruction, summed; how many
all-gathers read each parameter (or a copy of it: rounded, laid out). Also the
compiled step's temp memory (``memory_analysis().temp_size_in_bytes``) and the
loss after ``--steps`` steps against ``float32``'s.

The CPU formulation of bfloat16 dots is pinned to ``native``
(``MIXPREC_CPU_BF16``): bfloat16 x bfloat16 GEMMs, the operands a GPU would
gather; ``--cpu-bf16 emulated`` measures the other one.

Usage::

    python benchmarks/bench_scaleout.py                 # both workloads, full size
    python benchmarks/bench_scaleout.py --size tiny --steps 2
    python benchmarks/bench_scaleout.py --grad-error     # gradients vs float32 only

Writes JSON (``--out``, default ``benchmarks/results/bench_scaleout_cpu.json``)
with the CPU's flags, the JAX version and the date, and prints a Markdown table.
``--grad-error`` measures instead, per autocast variant and reduce dtype, each
weight matrix's gradient error against float32's (``..._grad_error.json``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import glob
import json
import os
import platform
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any


N_DEV = 8
if __name__ == "__main__":  # before JAX initialises its backends
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={N_DEV}"
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import mixprec  # noqa: E402
from mixprec._src.autocast import capability  # noqa: E402


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "pred": 1}
_SHAPE = re.compile(r"\b(f32|bf16|f16|f64|s32|u32|pred)\[([0-9,]*)\]")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s+(" + "|".join(KINDS) + r")(?:-start)?\("
)


@dataclasses.dataclass(frozen=True)
class Size:
    d: int
    heads: int
    ff: int
    layers: int
    vocab: int
    seq: int
    batch: int
    mlp_tokens: int


SIZES = {
    "full": Size(
        d=512, heads=8, ff=2048, layers=4, vocab=2048, seq=64, batch=16, mlp_tokens=256
    ),
    "tiny": Size(
        d=64, heads=4, ff=256, layers=2, vocab=256, seq=16, batch=8, mlp_tokens=32
    ),
}


# --- reading collectives from post-partitioning HLO ---------------------------------


def collective_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
    """Bytes per device of each collective kind, by dtype, in an HLO module's text.

    Each collective instruction counts the size of its result (a tuple result
    counts each element).

    Examples:
        >>> text = '''
        ...   %ag = bf16[64,128]{1,0} all-gather(%p), dimensions={0}
        ...   %ar = (f32[16]{0}, f32[4]{0}) all-reduce(%a, %b), to_apply=%add
        ... '''
        >>> collective_bytes(text)
        {'all-gather': {'bf16': 16384}, 'all-reduce': {'f32': 80}}
    """
    out: dict[str, dict[str, int]] = collections.defaultdict(collections.Counter)
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.match(line)
        if m is None:
            continue
        result, kind = m.group(1), m.group(2)
        for dtype, dims in _SHAPE.findall(result):
            n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            out[kind][dtype] += n * _ITEMSIZE[dtype]
    return {k: dict(v) for k, v in out.items()}


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(?:\([^=]*?\)|\S+)\s+([\w-]+)\(")
# What a parameter may pass through between its rounding and its gather.
_PASS_THROUGH = ("convert", "reshape", "transpose", "copy", "bitcast", "opt-barrier")


def parameter_gathers(hlo_text: str) -> dict[int, list[str]]:
    """Per entry parameter, the dtypes of the all-gathers of it: of the
    parameter itself or of a copy of it (converted, reshaped, transposed,
    behind an optimization barrier).

    Examples:
        >>> text = '''
        ...   %p = f32[8,4]{1,0} parameter(1), sharding={devices=[8,1]<=[8]}
        ...   %c = bf16[8,4]{1,0} convert(%p)
        ...   %t = (bf16[8,4]{1,0}) tuple(%c)
        ...   %b = (bf16[8,4]{1,0}) opt-barrier(%t)
        ...   %g = bf16[8,4]{1,0} get-tuple-element(%b), index=0
        ...   %ag = bf16[64,4]{1,0} all-gather(%g), dimensions={0}
        ...   %ag2 = bf16[64,4]{1,0} all-gather(%c), dimensions={0}
        ... '''
        >>> parameter_gathers(text)
        {1: ['bf16', 'bf16']}
    """
    defs = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            defs[m.group(1)] = m.group(2)

    def opcode(text: str) -> str:
        m = _OPCODE.match(text)
        return m.group(1) if m else ""

    def operands(text: str) -> list[str]:
        return re.findall(r"%([\w.\-]+)", text.split("(", 1)[1]) if "(" in text else []

    def source(name: str) -> int | None:
        while name in defs:
            text = defs[name]
            kind = opcode(text)
            if kind == "parameter":
                return int(text.split("parameter(", 1)[1].split(")", 1)[0])
            if kind == "get-tuple-element":
                index = int(text.split("index=", 1)[1].split(",", 1)[0])
                barrier = defs.get(operands(text)[0], "")
                tup = defs.get((operands(barrier) or [""])[0], "")
                if opcode(barrier) != "opt-barrier" or opcode(tup) != "tuple":
                    return None
                name = operands(tup)[index]
            elif kind in _PASS_THROUGH:
                name = operands(text)[0]
            else:
                return None
        return None

    out: dict[int, list[str]] = collections.defaultdict(list)
    for text in defs.values():
        if opcode(text) not in ("all-gather", "all-gather-start"):
            continue
        src = source(operands(text)[0])
        if src is not None:
            out[src].append(text.split("[", 1)[0])
    return dict(sorted(out.items()))


def partitioned_hlo(lowered: Any) -> tuple[str, Any]:
    """The HLO text right after SPMD partitioning, and the compiled executable.

    XLA dumps the module after its ``spmd-partitioning`` pass when asked through
    the compile options (``xla_dump_to`` and ``xla_dump_hlo_pass_re``).
    """
    with tempfile.TemporaryDirectory() as d:
        compiled = lowered.compile(
            compiler_options={
                "xla_dump_to": d,
                "xla_dump_hlo_pass_re": "spmd-partitioning",
            }
        )
        files = sorted(glob.glob(os.path.join(d, "*after_spmd-partitioning*")))
        if not files:
            raise RuntimeError(
                "XLA wrote no HLO after its spmd-partitioning pass; is the "
                "computation sharded over more than one device?"
            )
        with open(files[0]) as f:
            return f.read(), compiled


# --- workloads ----------------------------------------------------------------------


def _init_transformer(size: Size) -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape) * shape[0] ** -0.5, jnp.float32)

    layers = []
    for _ in range(size.layers):
        layers.append(
            {
                "ln1": jnp.ones(size.d),
                "wq": w(size.d, size.d),
                "wk": w(size.d, size.d),
                "wv": w(size.d, size.d),
                "wo": w(size.d, size.d),
                "ln2": jnp.ones(size.d),
                "w1": w(size.d, size.ff),
                "w2": w(size.ff, size.d),
            }
        )
    return {
        "embed": w(size.vocab, size.d),
        "layers": layers,
        "ln_f": jnp.ones(size.d),
        "unembed": w(size.d, size.vocab),
    }


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype) * scale.astype(x.dtype)


def _transformer_loss(size: Size, params: Any, tokens: jax.Array) -> jax.Array:
    b, t = tokens.shape
    hd = size.d // size.heads
    x = params["embed"][tokens]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for lp in params["layers"]:
        h = _norm(x, lp["ln1"])
        q = (h @ lp["wq"]).reshape(b, t, size.heads, hd)
        k = (h @ lp["wk"]).reshape(b, t, size.heads, hd)
        v = (h @ lp["wv"]).reshape(b, t, size.heads, hd)
        s = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32) * hd**-0.5
        s = jnp.where(mask, s, -1e9)
        a = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, size.d)
        x = x + o @ lp["wo"]
        h = _norm(x, lp["ln2"])
        x = x + jax.nn.gelu(h @ lp["w1"]) @ lp["w2"]
    logits = (_norm(x, params["ln_f"]) @ params["unembed"]).astype(jnp.float32)
    targets = jnp.roll(tokens, -1, axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _init_mlp(size: Size) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    blocks = []
    for _ in range(2):
        blocks.append(
            {
                "w1": jnp.asarray(
                    rng.normal(size=(size.d, size.ff)) / size.d**0.5, jnp.float32
                ),
                "b1": jnp.zeros(size.ff),
                "w2": jnp.asarray(
                    rng.normal(size=(size.ff, size.d)) / size.ff**0.5, jnp.float32
                ),
                "b2": jnp.zeros(size.d),
            }
        )
    return {"blocks": blocks}


def _mlp_loss(size: Size, params: Any, xy: tuple[jax.Array, jax.Array]) -> jax.Array:
    del size
    h, y = xy
    for bp in params["blocks"]:
        u = jax.nn.gelu(h @ bp["w1"] + bp["b1"].astype(h.dtype))
        h = h + u @ bp["w2"] + bp["b2"].astype(h.dtype)
    return jnp.mean((h.astype(jnp.float32) - y) ** 2)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    mesh_shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: Callable[[Size], Any]
    loss: Callable[..., jax.Array]
    param_spec: Callable[[tuple[Any, ...], jax.Array], P]
    batch: Callable[[Size], Any]
    batch_spec: Any


def _fsdp_spec(path: tuple[Any, ...], leaf: jax.Array) -> P:
    del path
    return P("data") if leaf.shape[0] % N_DEV == 0 else P()


def _tp_spec(path: tuple[Any, ...], leaf: jax.Array) -> P:
    name = getattr(path[-1], "key", "")
    if name == "w1":
        return P(None, "model")
    if name == "b1":
        return P("model")
    if name == "w2":
        return P("model", None)
    del leaf
    return P()


def _tokens(size: Size) -> jax.Array:
    rng = np.random.default_rng(2)
    return jnp.asarray(rng.integers(0, size.vocab, (size.batch, size.seq)), jnp.int32)


def _mlp_batch(size: Size) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(size.mlp_tokens, size.d)), jnp.float32)
    return x, jnp.tanh(x[:, ::-1])


WORKLOADS = {
    "fsdp": Workload(
        "fsdp",
        (N_DEV,),
        ("data",),
        _init_transformer,
        _transformer_loss,
        _fsdp_spec,
        _tokens,
        P("data"),
    ),
    "tp_mlp": Workload(
        "tp_mlp",
        (2, 4),
        ("data", "model"),
        _init_mlp,
        _mlp_loss,
        _tp_spec,
        _mlp_batch,
        (P("data"), P("data")),
    ),
}


# --- variants -----------------------------------------------------------------------

OPT = optax.adamw(1e-3, weight_decay=0.1)


COMPACT_VARIANTS = ("compact_sr_int8",)


def _optimizer(variant: str) -> Any:
    if variant in COMPACT_VARIANTS:
        import mixprec.optax

        return mixprec.optax.compact_state(
            OPT, weights="bfloat16-sr", moments="int8", policy="p=bf16,c=bf16,o=f32"
        )
    return OPT


def _step_fn(variant: str, wl: Workload, size: Size) -> Callable[..., Any]:
    loss = lambda p, b: wl.loss(size, p, b)  # noqa: E731
    if variant in COMPACT_VARIANTS:
        opt = _optimizer(variant)

        def compact_step(params, opt_state, batch):
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return compact_step
    if variant == "hand_bf16":

        def loss(p, b):  # noqa: F811
            p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
            if isinstance(b, tuple):
                b = (b[0].astype(jnp.bfloat16), b[1])
            return wl.loss(size, p16, b).astype(jnp.float32)

    policy = None
    if variant.startswith(("loss_only", "whole_step")):
        reduce = variant.rsplit("_r", 1)[1]
        policy = mixprec.get_policy("mixed_bfloat16").with_reduce_dtype(reduce)
        if variant.startswith("loss_only"):
            loss = mixprec.autocast(loss, policy)

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    if variant.startswith("whole_step"):
        return mixprec.autocast(step, policy)
    return step


VARIANTS = (
    "float32",
    "hand_bf16",
    "loss_only_rf32",
    "loss_only_rbf16",
    "whole_step_rf32",
    "whole_step_rbf16",
)


def run_variant(wl: Workload, size: Size, variant: str, steps: int) -> dict[str, Any]:
    """Compiles one variant's step, reads its collectives, runs ``steps`` steps."""
    mesh = jax.make_mesh(
        wl.mesh_shape, wl.axes, axis_types=(jax.sharding.AxisType.Auto,) * len(wl.axes)
    )
    params = wl.init(size)
    pspecs = jax.tree_util.tree_map_with_path(wl.param_spec, params)
    shard = lambda tree, specs: jax.tree.map(  # noqa: E731
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs
    )
    opt = _optimizer(variant)
    compact = variant in COMPACT_VARIANTS
    if compact:
        import mixprec.optax

        params32 = shard(params, pspecs)
        params = shard(mixprec.optax.compact_params(params, "bfloat16-sr"), pspecs)
        initial = opt.init(params32)
    else:
        params = shard(params, pspecs)
        initial = opt.init(params)
    # AdamW's moments keep their parameter's sharding; the step count is replicated.
    repl = NamedSharding(mesh, P())
    opt_state = jax.tree.map(
        lambda a: (
            a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, repl)
        ),
        initial,
    )
    one_device = None
    if compact:  # the same steps on one device, for the comparison
        dev0 = jax.devices()[0]
        # Through the host: fresh buffers that the donating step cannot delete.
        host = jax.device_get((params, opt_state, wl.batch(size)))
        one_device = jax.device_put(host, dev0)
    batch = wl.batch(size)
    batch = shard(batch, wl.batch_spec)
    step = jax.jit(_step_fn(variant, wl, size), donate_argnums=(0, 1))
    hlo, compiled = partitioned_hlo(step.lower(params, opt_state, batch))
    mem = compiled.memory_analysis()
    losses = []
    for _ in range(steps):
        params, opt_state, value = compiled(params, opt_state, batch)
        losses.append(float(value))
    leaves_ok = all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    extra: dict[str, Any] = {}
    if one_device is not None:
        single = jax.jit(_step_fn(variant, wl, size))
        p1, s1, b1 = one_device
        one_losses = []
        for _ in range(steps):
            p1, s1, value = single(p1, s1, b1)
            one_losses.append(float(value))
        extra["losses_one_device"] = one_losses
        extra["params_bfloat16"] = all(
            a.dtype == jnp.bfloat16 for a in jax.tree.leaves(params)
        )
    return {
        **extra,
        "variant": variant,
        "collectives": collective_bytes(hlo),
        "parameter_gathers": {str(k): v for k, v in parameter_gathers(hlo).items()},
        "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0))
        if mem is not None
        else None,
        "losses": losses,
        "params_float32": leaves_ok,
    }


def grad_errors(wl: Workload, size: Size) -> dict[str, dict[str, float]]:
    """Per autocast variant and reduce dtype: the relative L2 error of each
    weight matrix's gradient (one batch, the same float32 weights) against the
    float32 gradient, median and max over the matrices."""
    mesh = jax.make_mesh(
        wl.mesh_shape, wl.axes, axis_types=(jax.sharding.AxisType.Auto,) * len(wl.axes)
    )

    def put(tree: Any, specs: Any) -> Any:
        return jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs
        )

    params = wl.init(size)
    params = put(params, jax.tree_util.tree_map_with_path(wl.param_spec, params))
    batch = put(wl.batch(size), wl.batch_spec)

    def loss(p: Any, b: Any) -> jax.Array:
        return wl.loss(size, p, b)

    ref = jax.tree.leaves(jax.jit(jax.grad(loss))(params, batch))
    out = {}
    for where in ("loss_only", "whole_step"):
        for reduce in ("float32", "bfloat16"):
            policy = mixprec.get_policy("mixed_bfloat16").with_reduce_dtype(reduce)
            if where == "loss_only":
                f = jax.grad(mixprec.autocast(loss, policy))
            else:
                f = mixprec.autocast(jax.grad(loss), policy)
            grads = jax.tree.leaves(jax.jit(f)(params, batch))
            errs = [
                float(jnp.linalg.norm((g - r).ravel()) / jnp.linalg.norm(r.ravel()))
                for g, r in zip(grads, ref, strict=True)
                if r.ndim == 2
            ]
            out[f"{where}_r{_NAMES[reduce]}"] = {
                "median": float(np.median(errs)),
                "max": float(np.max(errs)),
            }
    return out


_NAMES = {"float32": "f32", "bfloat16": "bf16"}


# --- report -------------------------------------------------------------------------


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def _cell(c: dict[str, dict[str, int]], kinds: tuple[str, ...]) -> str:
    parts = []
    for dtype in ("bf16", "f16", "f32"):
        n = sum(c.get(k, {}).get(dtype, 0) for k in kinds)
        if n:
            parts.append(f"{_mb(n)} {dtype}")
    return " + ".join(parts) or "0"


def _per_parameter(gathers: dict[str, list[str]]) -> str:
    """The most all-gathers of any one parameter, and their dtypes."""
    if not gathers:
        return "0"
    most = max(len(v) for v in gathers.values())
    dtypes = sorted({d for v in gathers.values() for d in v})
    return f"{most} ({', '.join(dtypes)})"


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| workload | variant | all-gather MB | gathers per parameter "
        "| all-reduce + reduce-scatter MB | other MB | temp MB | loss - float32 |",
        "|---|---|---|---|---|---|---:|---:|",
    ]
    for wl, rows in results.items():
        ref = rows[0]["losses"][-1]
        for r in rows:
            c = r["collectives"]
            lines.append(
                f"| {wl} | {r['variant']} | {_cell(c, ('all-gather',))} | "
                f"{_per_parameter(r.get('parameter_gathers', {}))} | "
                f"{_cell(c, ('all-reduce', 'reduce-scatter'))} | "
                f"{_cell(c, ('all-to-all', 'collective-permute'))} | "
                f"{_mb(r['temp_bytes'] or 0)} | {r['losses'][-1] - ref:+.2e} |"
            )
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    flags, model = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_model": model,
        "cpu_flags": flags,
        "cpu_bf16": capability.cpu_bf16().formulation,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu-bf16", choices=capability.CHOICES, default="native")
    ap.add_argument(
        "--grad-error",
        action="store_true",
        help="measure only the gradients' error against float32 per reduce dtype",
    )
    ap.add_argument(
        "--out",
        default=os.path.join(_ROOT, "benchmarks", "results", "bench_scaleout_cpu.json"),
    )
    args = ap.parse_args(argv)
    if len(jax.devices()) < N_DEV:
        sys.exit(
            f"needs {N_DEV} devices; run as a script (it sets XLA_FLAGS) or set them."
        )
    size = SIZES[args.size]
    if args.grad_error:
        with capability.override(args.cpu_bf16):
            errors = {
                n: grad_errors(WORKLOADS[n], size) for n in args.workloads.split(",")
            }
        data = {"environment": environment(), "size": dataclasses.asdict(size)}
        data["grad_error"] = errors
        path = args.out.replace(".json", "_grad_error.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(json.dumps(errors, indent=1))
        return data
    results: dict[str, list[dict[str, Any]]] = {}
    with capability.override(args.cpu_bf16):
        for name in args.workloads.split(","):
            wl = WORKLOADS[name]
            results[name] = []
            for variant in args.variants.split(","):
                row = run_variant(wl, size, variant, args.steps)
                results[name].append(row)
                print(name, variant, json.dumps(row["collectives"]), flush=True)
    out = {
        "environment": environment(),
        "size": dataclasses.asdict(size),
        "steps": args.steps,
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    md = table(results)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)
    return out


if __name__ == "__main__":
    main()
