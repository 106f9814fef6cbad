"""Accuracy of float8 training under autocast, per recipe, against bfloat16.

Trains the two workloads of ``mixprec demo`` (the digits MLP and the Shakespeare
char-LM, CPU sizes) from the same initialisation on the same batches under
``float32``, ``mixed_bfloat16`` and ``mixed_float8`` with each named float8
recipe of mixprec's recipe table (``RECIPES`` in ``mixprec/_src/float8.py``:
tensorwise and rowwise current scaling, and rowwise with e4m3 gradients), each
by ``mixprec.autocast`` on the unchanged float32 model, and compares the
held-out loss and accuracy of every float8 run with bfloat16's. The targets:
eval loss within 1.5% of bfloat16's, accuracy within 0.5 points.

    python benchmarks/bench_float8_accuracy.py                  # CPU sizes, 1 seed
    python benchmarks/bench_float8_accuracy.py --seeds 0,1,2    # seed spread
    python benchmarks/bench_float8_accuracy.py --size tiny --steps 5   # smoke

CPUs have no float8 arithmetic: the float8 products run emulated (exactly: the
float8 values in bfloat16, float32 accumulation, scaled), so the step times in
the JSON say nothing about float8 speed. Writes
``benchmarks/results/float8_accuracy_<platform>.json`` (and ``.md``) with the
machine (JAX version, CPU flags) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import mixprec  # noqa: E402
from mixprec._src.float8 import RECIPES as _RECIPE_TABLE  # noqa: E402
from mixprec._src.workloads import timing, train  # noqa: E402


LOSS_TARGET = 0.015  # relative to bfloat16's eval loss
ACC_TARGET = 0.005  # absolute (0.5 points)
# Every named recipe, read from the table a new recipe is added to.
RECIPES = tuple(_RECIPE_TABLE)


def _variants(recipes: list[str], with_f32: bool) -> list[tuple[str, str, object]]:
    """``(label, precision, policy)`` of every run of a workload."""
    out: list[tuple[str, str, object]] = []
    if with_f32:
        out.append(("float32", "float32", None))
    out.append(("mixed_bfloat16", "mixed_bfloat16", None))
    for recipe in recipes:
        policy = mixprec.get_policy("mixed_float8").with_float8(recipe)
        out.append((f"mixed_float8 ({recipe})", "mixed_float8", policy))
    return out


def _meets(variant: str, meets: list[bool]) -> str:
    if not variant.startswith("mixed_float8"):
        return "-"
    if not meets:
        return "n/a: no product ran in float8"
    return f"{sum(meets)}/{len(meets)} seeds"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workloads", default="digits,lm")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument(
        "--steps", type=int, default=None, help="default: 200 digits, 400 lm"
    )
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--eval-batches", type=int, default=16, help="lm only")
    parser.add_argument("--no-float32", action="store_true")
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results"), metavar="DIR"
    )
    args = parser.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    recipes = [r for r in args.recipes.split(",") if r]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    for r in recipes:
        if r not in RECIPES:
            parser.error(f"--recipes: unknown recipe {r!r} (choose from {RECIPES})")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    t_start = time.perf_counter()
    env = timing.environment()
    runs = []
    titles = {}
    for name in names:
        if name == "lm":
            workload = train.lm_workload(
                size=args.size, n_eval_batches=args.eval_batches
            )
        else:
            workload = train.make_workload(name, size=args.size)
        titles[name] = workload.title
        steps = args.steps or {"digits": 200, "lm": 400}[name]
        print(f"{name}: {workload.title}, {steps} steps", file=sys.stderr)
        for seed in seeds:
            for label, precision, policy in _variants(recipes, not args.no_float32):
                r = train.train(
                    workload, precision, steps=steps, seed=seed, policy=policy
                )
                run = {
                    "workload": name,
                    "variant": label,
                    "policy": str(policy or train.precision_policy(precision)),
                    "seed": seed,
                    "steps": steps,
                    "eval_loss": r.eval_loss,
                    "eval_accuracy": r.eval_accuracy,
                    "final_train_loss": r.losses[-1],
                    "skipped_steps": r.skipped_steps,
                    "float8_flop_fraction": r.float8_flop_fraction,
                    "median_step_ms": r.median_step_s * 1e3,
                    "wall_s": r.wall_s,
                }
                runs.append(run)
                print(
                    f"  seed {seed} {label:>24}: eval loss {r.eval_loss:.4f}, "
                    f"accuracy {r.eval_accuracy:.4f}, {r.wall_s:.0f} s",
                    file=sys.stderr,
                )

    # Compare each float8 run with the bfloat16 run of the same workload and seed.
    bf16 = {
        (r["workload"], r["seed"]): r for r in runs if r["variant"] == "mixed_bfloat16"
    }
    for r in runs:
        ref = bf16[(r["workload"], r["seed"])]
        r["eval_loss_vs_bf16"] = r["eval_loss"] / ref["eval_loss"] - 1
        r["accuracy_vs_bf16"] = r["eval_accuracy"] - ref["eval_accuracy"]
        if r["variant"].startswith("mixed_float8") and r["float8_flop_fraction"]:
            r["meets_targets"] = bool(
                r["eval_loss_vs_bf16"] <= LOSS_TARGET
                and r["accuracy_vs_bf16"] >= -ACC_TARGET
            )
    wall = time.perf_counter() - t_start

    meta = {
        "date": env["date"],
        "device": env["device"],
        "jax": env["jax"],
        "jaxlib": env["jaxlib"],
        "mixprec": env["mixprec"],
        "cpu": env["cpu_model"],
        "cpu flags": timing.flags_summary(env["cpu_flags"]),
        "size": args.size,
        "seeds": seeds,
        "command": "python benchmarks/bench_float8_accuracy.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "targets": f"eval loss <= bf16 * (1 + {LOSS_TARGET}), accuracy >= bf16 - "
        f"{ACC_TARGET}",
        "wall time (s)": round(wall, 1),
    }
    payload = {"meta": meta, "workloads": titles, "environment": env, "runs": runs}

    lines = [
        f"# float8 training accuracy per recipe ({env['device']}, JAX {env['jax']})",
        "",
        f"CPU: {env['cpu_model']} ({meta['cpu flags']}). Seeds {seeds}; "
        f"wall time {wall:.0f} s. float8 is emulated on CPU (same numbers as a "
        "float8 GEMM with float32 accumulation); step times are not float8 speed.",
        "",
        f"Targets: eval loss within +{100 * LOSS_TARGET:.1f}% of mixed_bfloat16's, "
        f"accuracy within {100 * ACC_TARGET:.1f} points.",
        "",
    ]
    for name in names:
        lines += [f"## {name}: {titles[name]}", ""]
        lines += [
            "| variant | fp8 share of fwd FLOPs | eval loss | vs bf16 | accuracy "
            "| vs bf16 (points) | meets targets |",
            "|---|---|---|---|---|---|---|",
        ]
        variants = dict.fromkeys(r["variant"] for r in runs if r["workload"] == name)
        for variant in variants:
            group = [
                r for r in runs if r["workload"] == name and r["variant"] == variant
            ]
            loss = statistics.mean(r["eval_loss"] for r in group)
            acc = statistics.mean(r["eval_accuracy"] for r in group)
            d_loss = statistics.mean(r["eval_loss_vs_bf16"] for r in group)
            d_acc = statistics.mean(r["accuracy_vs_bf16"] for r in group)
            share = group[0]["float8_flop_fraction"]
            meets = [r["meets_targets"] for r in group if "meets_targets" in r]
            lines.append(
                f"| {variant} | {'-' if share is None else f'{100 * share:.0f}%'} "
                f"| {loss:.4f} | {100 * d_loss:+.2f}% | {100 * acc:.2f}% "
                f"| {100 * d_acc:+.2f} "
                f"| {_meets(variant, meets)} |"
            )
        lines.append("")
    md = "\n".join(lines)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"float8_accuracy_{env['backend']}"
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
