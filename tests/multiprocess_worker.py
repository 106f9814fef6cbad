"""One process of the multi-process tests in `test_multiprocess.py` (not a test).

    python tests/multiprocess_worker.py PHASE OUT_DIR \\
        [--process-id I --num-processes N --port PORT]

With ``--num-processes`` > 1 the process joins a JAX multi-process job whose
coordinator is on 127.0.0.1:PORT (CPU collectives over gloo); otherwise it runs
alone. Either way the mesh is one ``data`` axis over the 8 global devices, and
every process writes what it saw to ``OUT_DIR/PHASE-<process id>.json``: the
loss-scale statistics and finite flags of every step and a digest of every
addressable shard of the training state, for the test to compare across
processes and phases. The phases:

``train`` (2 processes)
    Data parallel with ``jit`` over global arrays (replicated parameters, the
    batch sharded), 6 steps with an inf in process 1's part of the batch at
    step 3. Then fully sharded (``shard_map``; parameters, Adam moments and
    gradients sharded over ``data``), 8 steps with infs at steps 2 and 6 that
    reach one device's gradient shard only, on the *other* process; the state
    after 4 steps is saved with orbax by both processes.
``resume_single`` (1 process)
    The data-parallel run again, for comparison; restores the 2-process
    checkpoint, resumes steps 4-7 and saves the state after 6 steps.
``resume_multi`` (2 processes)
    Restores the 1-process checkpoint and resumes steps 6-7.

The sharded run reduces gradients in a fixed order (an ``all_to_all`` and a
local sum), so it is bit for bit the same on one process or two whatever the
values: XLA's all-reduce and reduce-scatter over gloo add the partial sums in
another order than within one process.
"""

import argparse
import hashlib
import json
import os
import sys


N_DEVICES = 8
BATCH = 64
FEATURES = 16
DP_STEPS = 6
DP_INF = {3: (37, 2)}  # step: (global row, column); rows 32-63 are process 1's
FSDP_STEPS = 8
# Feature 5 is in the parameter shard of device 2 (process 0), row 40 in process
# 1's data; feature 13 is device 6's (process 1), row 3 process 0's.
FSDP_INF = {2: (40, 5), 6: (3, 13)}
SAVE_AFTER = {"train": 4, "resume_single": 6}
START = {"train": 0, "resume_single": 4, "resume_multi": 6}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=sorted(START))
    parser.add_argument("out_dir")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            # JAX's default is every interface ([::]); this job is local.
            coordinator_bind_address=f"127.0.0.1:{args.port}",
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    if jax.device_count() != N_DEVICES:
        raise SystemExit(f"expected {N_DEVICES} global devices, got {jax.devices()}")

    record: dict = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
    }
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    record["mesh_processes"] = [d.process_index for d in mesh.devices.flat]
    if args.phase in ("train", "resume_single"):
        record["dp"] = _data_parallel(mesh)
    if args.phase == "train":
        record["autocast"] = _autocast_data_parallel(mesh)
    record["fsdp"] = _fully_sharded(mesh, args.phase, args.out_dir)

    path = os.path.join(args.out_dir, f"{args.phase}-{args.process_id}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return 0


# ---- helpers ---------------------------------------------------------------------


def _local_rows(global_batch, jax):
    """This process's rows of a global batch (processes own contiguous blocks)."""
    per = global_batch.shape[0] // jax.process_count()
    start = jax.process_index() * per
    return global_batch[start : start + per], start


def _batch(step, jax, np, mesh, infs, w_true):
    """The global batch of ``step``; each process builds only its own rows."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = np.tanh(x @ w_true).astype(np.float32) if w_true.ndim == 2 else x * w_true
    local_x, start = _local_rows(x, jax)
    local_y, _ = _local_rows(y.astype(np.float32), jax)
    local_x = local_x.copy()
    if step in infs:
        row, col = infs[step]
        if start <= row < start + local_x.shape[0]:  # only the owner injects it
            local_x[row - start, col] = np.inf
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    return tuple(
        jax.make_array_from_process_local_data(sharding, a, (BATCH, *a.shape[1:]))
        for a in (local_x, local_y)
    )


def _put(tree, shardings, jax):
    """Global arrays from host values every process knows in full."""
    return jax.tree.map(
        lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]),
        tree,
        shardings,
    )


def _index_key(index):
    return ",".join(f"{s.start}:{s.stop}" for s in index) or "scalar"


def _digest(tree, jax, np):
    """{path: {shard index: sha256 of its bytes}} over this process's shards.

    Replicas of one index held by this process must be identical; a mismatch
    is recorded as such, for the test to report.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shards = {}
        for shard in leaf.addressable_shards:
            data = np.asarray(shard.data)
            h = hashlib.sha256(str(data.dtype).encode() + data.tobytes()).hexdigest()
            key = _index_key(shard.index)
            if shards.setdefault(key, h[:20]) != h[:20]:
                shards[key] = "replicas differ"
        out[jax.tree_util.keystr(path)] = shards
    return out


def _replicated_value(x, np):
    """The value of a replicated scalar, checking every local replica holds it."""
    replicas = [np.asarray(s.data) for s in x.addressable_shards]
    if len({r.tobytes() for r in replicas}) != 1:  # bytes: NaN equals itself
        return f"replicas differ: {[r.item() for r in replicas]}"
    return replicas[0].item()


def _stats(opt_state, jax, np):
    import mixprec
    import mixprec.optax as mpo

    stats = mpo.loss_scale_stats(opt_state)
    ls = mpo.current_loss_scale(opt_state)
    assert isinstance(ls, mixprec.DynamicLossScale)
    out = {k: _replicated_value(v, np) for k, v in stats.items()}
    out["counter"] = _replicated_value(ls.counter, np)
    out["config"] = [ls.period, ls.factor, ls.min_loss_scale]
    return out


# ---- data parallel: jit over global arrays ----------------------------------------


def _data_parallel(mesh):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import mixprec
    import mixprec.optax as mpo

    policy = mixprec.get_policy("p=f32,c=f16,o=f32")

    def loss_fn(params, x, y):
        p, x = policy.cast_to_compute((params, x))
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        out = policy.cast_to_output(h @ p["w2"] + p["b2"])
        return jnp.mean((out - y) ** 2)

    opt = mpo.loss_scaled(optax.adam(1e-2), mixprec.DynamicLossScale(2.0**12, period=2))

    def step(params, opt_state, x, y):
        vg = mixprec.value_and_grad(loss_fn)
        loss, grads, finite = vg(params, x, y, loss_scale=opt_state)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, finite

    rng = np.random.default_rng(0)
    host = {
        "w1": (rng.standard_normal((FEATURES, 32)) / 4).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "w2": (rng.standard_normal((32, 4)) / 6).astype(np.float32),
        "b2": np.zeros(4, np.float32),
    }
    w_true = rng.standard_normal((FEATURES, 4)).astype(np.float32)
    repl = NamedSharding(mesh, P())
    params = _put(host, jax.tree.map(lambda _: repl, host), jax)
    opt_state = jax.jit(opt.init, out_shardings=repl)(params)
    step = jax.jit(step, out_shardings=repl)

    steps = []
    for i in range(DP_STEPS):
        x, y = _batch(i, jax, np, mesh, DP_INF, w_true)
        params, opt_state, loss, finite = step(params, opt_state, x, y)
        steps.append(
            {
                "stats": _stats(opt_state, jax, np),
                "grads_finite": _replicated_value(finite, np),
                "loss": _replicated_value(loss, np),
                "params": _digest(params, jax, np),
                "params_values": {
                    k: np.asarray(v.addressable_data(0)).tolist()
                    for k, v in params.items()
                },
            }
        )
    return steps


# ---- data parallel under autocast ----------------------------------------------

AUTOCAST_STEPS = 4
AUTOCAST_INF = {2: (37, 2)}  # in process 1's rows
# (policy, where autocast goes, CPU bfloat16 formulation, reduce dtype)
AUTOCAST_VARIANTS = (
    ("mixed_bfloat16", "whole_step", "native", "float32"),
    ("mixed_bfloat16", "loss_only", "emulated", "float32"),
    ("mixed_bfloat16", "whole_step", "emulated", "bfloat16"),
    ("mixed_bfloat16", "loss_only", "native", "bfloat16"),
    ("mixed_float16", "whole_step", "native", "float16"),
    ("mixed_float16", "loss_only", "native", "float32"),
)


def _bench_module():
    import importlib.util

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "benchmarks",
        "bench_scaleout.py",
    )
    spec = importlib.util.spec_from_file_location("bench_scaleout", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scaleout"] = module
    spec.loader.exec_module(module)
    return module


def _autocast_data_parallel(mesh):
    """Float32 code under autocast, replicated parameters, the batch sharded
    over both processes: per variant, what the partitioner reduces the
    gradients in, and every step's verdict and parameter digests."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import mixprec
    import mixprec.optax as mpo
    from mixprec._src.autocast import capability

    bench = _bench_module()

    def loss_fn(params, x, y):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)

    opt = mpo.loss_scaled(optax.adam(1e-2), mixprec.DynamicLossScale(2.0**12, period=2))
    rng = np.random.default_rng(0)
    host = {
        "w1": (rng.standard_normal((FEATURES, 32)) / 4).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "w2": (rng.standard_normal((32, 16)) / 6).astype(np.float32),
        "b2": np.zeros(16, np.float32),
    }
    w_true = rng.standard_normal((FEATURES, 16)).astype(np.float32)
    repl = NamedSharding(mesh, P())
    out = {}
    for policy_name, where, formulation, reduce in AUTOCAST_VARIANTS:
        policy = mixprec.get_policy(policy_name).with_reduce_dtype(reduce)

        def step(params, opt_state, x, y, policy=policy, where=where):
            f = loss_fn if where == "whole_step" else mixprec.autocast(loss_fn, policy)
            loss, grads, finite = mixprec.value_and_grad(f)(
                params, x, y, loss_scale=opt_state
            )
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, finite

        if where == "whole_step":
            step = mixprec.autocast(step, policy)
        params = _put(host, jax.tree.map(lambda _: repl, host), jax)
        opt_state = jax.jit(opt.init, out_shardings=repl)(params)
        x0, y0 = _batch(0, jax, np, mesh, {}, w_true)
        with capability.override(formulation):
            lowered = jax.jit(step, out_shardings=repl).lower(params, opt_state, x0, y0)
            hlo, compiled = bench.partitioned_hlo(lowered)
        steps = []
        for i in range(AUTOCAST_STEPS):
            x, y = _batch(i, jax, np, mesh, AUTOCAST_INF, w_true)
            params, opt_state, loss, finite = compiled(params, opt_state, x, y)
            steps.append(
                {
                    "stats": _stats(opt_state, jax, np),
                    "grads_finite": _replicated_value(finite, np),
                    "params": _digest(params, jax, np),
                    "dtypes": sorted({str(v.dtype) for v in params.values()}),
                }
            )
        key = f"{policy_name}/{where}/{formulation}/r={reduce}"
        out[key] = {"collectives": bench.collective_bytes(hlo), "steps": steps}
    return out


# ---- fully sharded: shard_map, sharded parameters and optimizer state ----------


def _fully_sharded(mesh, phase, out_dir):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import mixprec
    import mixprec.optax as mpo
    import mixprec.orbax

    n = mesh.size
    policy = mixprec.get_policy("p=f32,c=f16,o=f32")
    opt = mpo.loss_scaled(
        optax.adam(1e-2),
        mixprec.DynamicLossScale(2.0**12, period=3, min_loss_scale=16.0),
        axis_name="data",
    )

    def local_loss(full, x, y):
        p, x = policy.cast_to_compute((full, x))
        pred = policy.cast_to_output(x * p["w"][None] + p["v"][None])
        return jnp.mean((pred - y) ** 2)

    def reduce_scatter_mean(g):
        # Device j receives chunk j of every device's gradient, in device
        # order, and sums them itself: the same order on any topology.
        parts = jax.lax.all_to_all(g.reshape(n, -1), "data", 0, 0, tiled=True)
        return jnp.sum(parts, axis=0) / n

    def step(params, opt_state, x, y):
        full = jax.tree.map(lambda p: jax.lax.all_gather(p, "data", tiled=True), params)
        vg = mixprec.value_and_grad(local_loss)
        loss, grads, _ = vg(full, x, y, loss_scale=opt_state)
        grads = jax.tree.map(reduce_scatter_mean, grads)
        # This device's view of its gradient shard, and the agreed verdict.
        flags = jnp.stack(
            [mixprec.all_finite(grads), mixprec.all_finite(grads, axis_name="data")]
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        loss = jnp.mean(jax.lax.all_gather(loss, "data"))
        return params, opt_state, loss, flags[None]

    rng = np.random.default_rng(1)
    host = {
        "w": (0.5 + rng.standard_normal(FEATURES) / 8).astype(np.float32),
        "v": np.zeros(FEATURES, np.float32),
    }
    w_true = rng.standard_normal(FEATURES).astype(np.float32)
    sharded = NamedSharding(mesh, P("data"))
    params = _put(host, jax.tree.map(lambda _: sharded, host), jax)

    def spec(leaf):
        return P("data") if leaf.ndim else P()

    abstract = jax.eval_shape(opt.init, params)
    state_specs = jax.tree.map(spec, abstract)
    state_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs)
    opt_state = jax.jit(opt.init, out_shardings=state_shardings)(params)
    step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P("data"), state_specs, P("data"), P("data")),
            out_specs=(P("data"), state_specs, P(), P("data")),
            check_vma=False,
        )
    )

    result = {"steps": {}}
    start = START[phase]
    if start:
        source = "ckpt_train" if phase == "resume_single" else "ckpt_resume_single"
        target = {"params": params, "opt_state": opt_state}
        restored = mixprec.orbax.restore(os.path.join(out_dir, source), target)
        params, opt_state = restored["params"], restored["opt_state"]
        result["restored"] = {
            "state": _digest(restored, jax, np),
            "stats": _stats(opt_state, jax, np),
            "params_sharded": [
                params["w"].sharding.spec == P("data"),
                len(params["w"].sharding.device_set),
            ],
        }
    for i in range(start, FSDP_STEPS):
        x, y = _batch(i, jax, np, mesh, FSDP_INF, w_true)
        params, opt_state, loss, flags = step(params, opt_state, x, y)
        per_device = {
            _index_key(s.index): np.asarray(s.data)[0].tolist()
            for s in flags.addressable_shards
        }
        result["steps"][i] = {
            "stats": _stats(opt_state, jax, np),
            "flags": per_device,
            "loss": _replicated_value(loss, np),
            "state": _digest({"params": params, "opt_state": opt_state}, jax, np),
        }
        if SAVE_AFTER.get(phase) == i + 1:
            mixprec.orbax.save(
                os.path.join(out_dir, f"ckpt_{phase}"),
                {"params": params, "opt_state": opt_state},
            )
    return result


if __name__ == "__main__":
    sys.exit(main())
