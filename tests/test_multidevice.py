"""Data-parallel mixed-precision training on 8 (CPU) devices.

The finite decision and the loss scale must be identical on every device, and
one device's inf must make every device skip. Two styles: `jit` over sharded
global arrays (XLA inserts the collectives) and `shard_map` with an axis name.
"""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, load_benchmark
from jax.sharding import NamedSharding, PartitionSpec as P

import mixprec
import mixprec.optax as mpo
from mixprec._src.autocast import capability


pytestmark = pytest.mark.standard_promotion  # optax's momentum update

N_DEV = 8
OPT = mpo.loss_scaled(optax.sgd(0.1, momentum=0.9), mixprec.DynamicLossScale(2.0**10))


def _st(state) -> mpo.LossScaledState:
    """The typed view of an optimizer state (optax types `update` loosely)."""
    assert isinstance(state, mpo.LossScaledState)
    return state


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N_DEV:
        pytest.skip("needs 8 devices")
    return jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _data():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (64, 16))
    return x, jnp.tanh(x @ jax.random.normal(kw, (16, 8)))


def _params():
    return {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}


def _loss(params, x, y):
    h = x.astype(jnp.bfloat16) @ params["w"].astype(jnp.bfloat16)
    h = h.astype(jnp.float32) + params["b"][None, :]
    return jnp.mean((h - y) ** 2)


def _step(params, opt_state, x, y, bad_col):
    _, grads, _ = mixprec.value_and_grad(_loss)(params, x, y, loss_scale=opt_state)
    # Inject an inf into one column of w's gradient (one device's shard when
    # w is sharded by column); bad_col < 0 injects nothing.
    cols = jnp.arange(8)[None, :]
    grads["w"] = jnp.where(cols == bad_col, jnp.inf, grads["w"])
    updates, opt_state = OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def _run(step, params, opt_state, x, y, bads):
    for bad in bads:
        params, opt_state = step(params, opt_state, x, y, bad)
    return params, opt_state


def _replicas_identical(arr):
    shards = [np.asarray(s.data) for s in arr.addressable_shards]
    assert len(shards) == N_DEV
    for s in shards[1:]:
        np.testing.assert_array_equal(s, shards[0])


BADS = [-1, -1, 3, -1, -1, 5, -1, -1]  # steps 2 and 5 carry one bad column


def test_jit_sharded_global_arrays(mesh):
    x, y = _data()
    ref_params, ref_state = _run(
        jax.jit(_step), _params(), OPT.init(_params()), x, y, BADS
    )

    data = NamedSharding(mesh, P("data"))
    cols = NamedSharding(mesh, P(None, "data"))  # w sharded by column: 1 per device
    repl = NamedSharding(mesh, P())
    params = {
        "w": jax.device_put(_params()["w"], cols),
        "b": jax.device_put(_params()["b"], repl),
    }
    opt_state = jax.device_put(OPT.init(_params()), repl)
    opt_state = opt_state._replace(
        inner_state=jax.tree.map(
            lambda a, p: jax.device_put(a, p.sharding),
            _st(opt_state).inner_state,
            (optax.TraceState(trace=params), optax.EmptyState()),
        )
    )
    xs, ys = jax.device_put(x, data), jax.device_put(y, data)
    step = jax.jit(_step)

    # One step with an inf in device 3's shard only: every device skips.
    p1, s1 = step(params, opt_state, xs, ys, 3)
    assert not bool(_st(s1).last_finite) and int(_st(s1).num_skipped) == 1
    jax.tree.map(np.testing.assert_array_equal, p1, params)
    for leaf in (
        _st(s1).loss_scale.loss_scale,
        _st(s1).last_finite,
        _st(s1).num_skipped,
    ):
        _replicas_identical(leaf)
    assert float(_st(s1).loss_scale.loss_scale) == 512.0

    params, opt_state = _run(step, params, opt_state, xs, ys, BADS)
    assert params["w"].sharding == cols
    assert int(_st(opt_state).num_skipped) == 2
    _replicas_identical(_st(opt_state).loss_scale.loss_scale)
    assert float(_st(opt_state).loss_scale.loss_scale) == float(
        _st(ref_state).loss_scale.loss_scale
    )
    jax.tree.map(
        ft.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), params, ref_params
    )


def _shard_map_train(mesh, *, reduce_grads, axis_name):
    opt = mpo.loss_scaled(
        optax.sgd(0.1, momentum=0.9),
        mixprec.DynamicLossScale(2.0**10),
        axis_name=axis_name,
    )

    def step(params, opt_state, x, y, bad_dev):
        _, grads, _ = mixprec.value_and_grad(_loss)(params, x, y, loss_scale=opt_state)
        # The inf goes into one device's local gradients, before any reduction.
        me = jax.lax.axis_index("data")
        grads = jax.tree.map(lambda g: jnp.where(me == bad_dev, jnp.inf, g), grads)
        if reduce_grads:
            grads = jax.lax.pmean(grads, "data")
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # Per-device views of the decision, stacked along the mesh axis.
        stats = mpo.loss_scale_stats(opt_state)
        return params, opt_state, jax.tree.map(lambda a: a[None], stats)

    return opt, jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data"), P()),
            out_specs=(P(), P(), P("data")),
            check_vma=False,
        )
    )


@pytest.mark.parametrize(
    "reduce_grads,axis_name",
    [(True, None), (False, "data")],
    ids=["pmean", "axis_name"],
)
def test_shard_map_every_device_skips_together(mesh, reduce_grads, axis_name):
    x, y = _data()
    opt, step = _shard_map_train(mesh, reduce_grads=reduce_grads, axis_name=axis_name)
    params, state = _params(), opt.init(_params())
    p1, s1, stats = step(params, state, x, y, jnp.int32(3))
    assert np.asarray(stats["last_finite"]).tolist() == [False] * N_DEV
    assert np.asarray(stats["num_skipped"]).tolist() == [1] * N_DEV
    assert np.asarray(stats["loss_scale"]).tolist() == [512.0] * N_DEV
    jax.tree.map(np.testing.assert_array_equal, p1, params)
    if reduce_grads:
        # Equals the single-device run (mean of per-shard means = global mean).
        bads = [-1, -1, 3, -1, -1]
        ref_params, ref_state = _run(
            jax.jit(_step),
            _params(),
            OPT.init(_params()),
            x,
            y,
            [b if b < 0 else 0 for b in bads],
        )
        for bad in bads:
            params, state, stats = step(params, state, x, y, jnp.int32(bad))
        assert int(np.asarray(stats["num_skipped"])[0]) == 1
        # bf16 matmuls over 8-row shards instead of 64 rows: the per-shard means
        # round differently (measured max rel. error ~4e-4), well inside bf16's.
        assert_trees_close(params, ref_params, dtype=jnp.bfloat16)
        assert float(_st(state).loss_scale.loss_scale) == float(
            _st(ref_state).loss_scale.loss_scale
        )


def test_without_axis_name_unreduced_grads_would_diverge(mesh):
    # The control: without the axis name only device 3 skips. This is why the
    # wrapper takes `axis_name` for gradients that are not reduced.
    x, y = _data()
    opt, step = _shard_map_train(mesh, reduce_grads=False, axis_name=None)
    _, _, stats = step(_params(), opt.init(_params()), x, y, jnp.int32(3))
    flags = np.asarray(stats["last_finite"]).tolist()
    assert flags == [True, True, True, False, True, True, True, True]


# --- Autocast over a batch sharded on an Auto mesh -------------------------------

_H, _D = 4, 16


def _attn_params():
    ks = jax.random.split(jax.random.key(0), 4)
    return {
        n: jax.random.normal(k, (_H * _D, _H * _D)) * 0.05
        for n, k in zip(("wq", "wk", "wv", "wo"), ks, strict=True)
    }


def _attn_loss(p, x):
    b, t, _ = x.shape
    q = (x @ p["wq"]).reshape(b, t, _H, _D)
    k = (x @ p["wk"]).reshape(b, t, _H, _D)
    v = (x @ p["wv"]).reshape(b, t, _H, _D)
    s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(jnp.float32(_D)).astype(q.dtype)
    a = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, _H * _D)
    return jnp.mean((o @ p["wo"]) ** 2)


_ATTN_OPT = optax.sgd(0.1, momentum=0.9)


def _attn_step(p, s, x):
    loss, g = jax.value_and_grad(_attn_loss)(p, x)
    u, s = _ATTN_OPT.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


def _attn_loss_only_step(p, s, x, *, policy):
    loss, g = jax.value_and_grad(mixprec.autocast(_attn_loss, policy))(p, x)
    u, s = _ATTN_OPT.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


@pytest.mark.parametrize("formulation", ["native", "emulated"])
@pytest.mark.parametrize("where", ["whole_step", "loss_only"])
def test_autocast_attention_train_step_on_auto_mesh(mesh, formulation, where):
    # The transpose of a dot under a mesh carries an out_sharding on the Auto
    # mesh that shards nothing; treating it as explicit kept a bf16 x bf16 ->
    # f32 dot that XLA:CPU's DotThunk cannot run (native formulation).
    x = jax.random.normal(jax.random.key(1), (16, 32, _H * _D))
    p = _attn_params()
    s = _ATTN_OPT.init(p)
    ref = jax.jit(_attn_step)(p, s, x)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    with capability.override(formulation):
        if where == "whole_step":
            f = mixprec.autocast(_attn_step, "mixed_bfloat16")
        else:
            f = ft.partial(_attn_loss_only_step, policy="mixed_bfloat16")
        p1, s1, loss = jax.jit(f)(p, s, xs)
    assert loss.dtype == jnp.float32 and bool(jnp.isfinite(loss))
    assert_trees_close(loss, ref[2], dtype=jnp.bfloat16)
    # One SGD step: the update is -0.1 x the gradient.
    update = jax.tree.map(jnp.subtract, p1, p)
    ref_update = jax.tree.map(jnp.subtract, ref[0], p)
    assert_trees_close(update, ref_update, dtype=jnp.bfloat16, grad=True)
    for leaf in jax.tree.leaves(p1):
        assert leaf.dtype == jnp.float32
        _replicas_identical(leaf)


# --- communication under autocast: what the partitioner reduces and gathers in ----


_BENCH = load_benchmark("bench_scaleout")
_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _mlp_loss(p, x):
    h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def _sgd(p, g):
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def _comm_step(where, policy):
    if where == "whole_step":
        return mixprec.autocast(lambda p, x: _sgd(p, jax.grad(_mlp_loss)(p, x)), policy)
    return lambda p, x: _sgd(p, jax.grad(mixprec.autocast(_mlp_loss, policy))(p, x))


def _assert_step_like_float32(step, loss, policy, p, x, p1):
    """The autocast step ``p -> p1`` updates the parameters as the float32 step
    does (the update, a gradient times the step size, within the compute
    dtype's gradient tolerance), and its loss under the policy is float32's
    (within the compute dtype's tolerance), on the same sharded inputs."""
    low = mixprec.get_policy(policy).compute_dtype
    ref = jax.jit(step)(p, x)
    upd = jax.tree.map(jnp.subtract, p1, p)
    ref_upd = jax.tree.map(jnp.subtract, ref, p)
    assert_trees_close(upd, ref_upd, dtype=low, grad=True)
    got_loss = jax.jit(mixprec.autocast(loss, policy))(p, x)
    assert got_loss.dtype == jnp.float32
    assert_trees_close(got_loss, loss(p, x), dtype=low)


def _comm_inputs(mesh, fsdp):
    ps = NamedSharding(mesh, P("data") if fsdp else P())
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    p = {
        "w1": jax.device_put(jax.random.normal(k1, (64, 128)) * 0.1, ps),
        "w2": jax.device_put(jax.random.normal(k2, (128, 64)) * 0.1, ps),
    }
    x = jax.device_put(jax.random.normal(k3, (128, 64)), NamedSharding(mesh, P("data")))
    return p, x


@pytest.mark.parametrize("formulation", ["native", "emulated"])
@pytest.mark.parametrize("where", ["loss_only", "whole_step"])
@pytest.mark.parametrize(
    "policy,reduce",
    [
        ("mixed_bfloat16", "float32"),
        ("mixed_bfloat16", "bfloat16"),
        ("mixed_float16", "float32"),
        ("mixed_float16", "float16"),
    ],
)
def test_gradient_reductions_follow_the_policy(
    mesh, policy, reduce, where, formulation
):
    # Read from the HLO right after SPMD partitioning (XLA:CPU widens 16-bit
    # collectives later): every gradient all-reduce is in the reduce dtype.
    pol = mixprec.get_policy(policy).with_reduce_dtype(reduce)
    p, x = _comm_inputs(mesh, fsdp=True)
    with capability.override(formulation):
        lowered = jax.jit(_comm_step(where, pol)).lower(p, x)
        hlo, compiled = _BENCH.partitioned_hlo(lowered)
    comm = _BENCH.collective_bytes(hlo)
    reductions = {**comm.get("all-reduce", {}), **comm.get("reduce-scatter", {})}
    want = _NAMES[reduce]
    assert set(reductions) == {want}, comm
    # Both weights' gradients, whole, once each: 2 x 8192 elements.
    assert sum(reductions.values()) == 2 * 8192 * np.dtype(jnp.dtype(reduce)).itemsize
    # Parameters are gathered in the compute dtype where the formulation
    # multiplies 16-bit operands (CPU native bfloat16; float16 is upcast on CPU
    # after the gather, in float32, for every formulation but the GPU's).
    if policy == "mixed_bfloat16" and formulation == "native":
        assert set(comm["all-gather"]) == {"bf16"}, comm
    p1 = compiled(p, x)
    for leaf in jax.tree.leaves(p1):
        assert leaf.dtype == jnp.float32
        assert leaf.sharding.spec == P("data")
    with capability.override(formulation):
        _assert_step_like_float32(
            lambda p, x: _sgd(p, jax.grad(_mlp_loss)(p, x)), _mlp_loss, pol, p, x, p1
        )


def _three_layer_loss(p, x):
    # Every weight but the first is read by a backward product too (the
    # gradient of its input), so a formulation that lays out or rounds a
    # parameter per product gathers it more than once.
    h = jax.nn.gelu(x @ p["w1"])
    h = jax.nn.gelu(h @ p["w2"])
    return jnp.mean((h @ p["w3"]) ** 2)


def _gather_step(where, formulation):
    if where == "hand_bf16":

        def loss(p, x):
            p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
            return _three_layer_loss(p16, x.astype(jnp.bfloat16)).astype(jnp.float32)

        return lambda p, x: _sgd(p, jax.grad(loss)(p, x))
    if formulation == "gpu":
        # The GPU formulation, pinned (CastConfig.platform): its partitioned
        # program, compiled here for the CPU devices.
        from mixprec._src.autocast import api, config

        make = api.make_config
        api.make_config = ft.partial(config.make_config, platform="cuda")
        try:
            return _comm_step_for(where, "mixed_bfloat16", _three_layer_loss)
        finally:
            api.make_config = make
    return _comm_step_for(where, "mixed_bfloat16", _three_layer_loss)


def _comm_step_for(where, policy, loss):
    if where == "whole_step":
        return mixprec.autocast(lambda p, x: _sgd(p, jax.grad(loss)(p, x)), policy)
    return lambda p, x: _sgd(p, jax.grad(mixprec.autocast(loss, policy))(p, x))


@pytest.mark.parametrize(
    "where,formulation,dtype",
    [
        ("hand_bf16", "native", "bf16"),
        ("whole_step", "native", "bf16"),
        ("loss_only", "native", "bf16"),
        ("whole_step", "gpu", "bf16"),
        ("loss_only", "gpu", "bf16"),
        # Emulated: float32 GEMMs on rounded weights, widened where JAX lowers
        # the dot (before the partitioner gathers): once, in float32.
        ("whole_step", "emulated", "f32"),
    ],
)
def test_each_sharded_weight_is_gathered_once(mesh, where, formulation, dtype):
    # FSDP: the weights sharded on their first axis. Read from the program
    # right after SPMD partitioning: the forward and the backward products of
    # a weight read one rounded copy, so the partitioner gathers each weight
    # once per step, as in hand-written bfloat16 code.
    ps = NamedSharding(mesh, P("data"))
    k1, k2, k3, k4 = jax.random.split(jax.random.key(5), 4)
    p = {
        "w1": jax.device_put(jax.random.normal(k1, (64, 128)) * 0.1, ps),
        "w2": jax.device_put(jax.random.normal(k2, (128, 128)) * 0.1, ps),
        "w3": jax.device_put(jax.random.normal(k3, (128, 64)) * 0.1, ps),
    }
    x = jax.device_put(jax.random.normal(k4, (128, 64)), ps)
    with capability.override("native" if formulation == "gpu" else formulation):
        step = _gather_step(where, formulation)
        hlo, compiled = _BENCH.partitioned_hlo(jax.jit(step).lower(p, x))
    gathers = _BENCH.parameter_gathers(hlo)
    # Entry parameters 0, 1, 2: w1, w2, w3 (the dict's order); 3 is x.
    assert {k: gathers.get(k) for k in range(3)} == {k: [dtype] for k in range(3)}, (
        gathers
    )
    p1 = compiled(p, x)
    for leaf in jax.tree.leaves(p1):
        assert leaf.dtype == jnp.float32 and leaf.sharding.spec == P("data")
    with capability.override("native" if formulation == "gpu" else formulation):
        _assert_step_like_float32(
            lambda p, x: _sgd(p, jax.grad(_three_layer_loss)(p, x)),
            _three_layer_loss,
            "mixed_bfloat16",
            p,
            x,
            p1,
        )


def test_bfloat16_reductions_stay_within_bfloat16_tolerance(mesh):
    p, x = _comm_inputs(mesh, fsdp=False)
    ref = jax.jit(lambda p, x: _sgd(p, jax.grad(_mlp_loss)(p, x)))(p, x)
    out = {}
    for reduce in ("float32", "bfloat16"):
        pol = mixprec.get_policy("mixed_bfloat16").with_reduce_dtype(reduce)
        out[reduce] = jax.jit(_comm_step("whole_step", pol))(p, x)
        upd = jax.tree.map(jnp.subtract, out[reduce], p)
        ref_upd = jax.tree.map(jnp.subtract, ref, p)
        assert_trees_close(upd, ref_upd, dtype=jnp.bfloat16, grad=True)
        for leaf in jax.tree.leaves(out[reduce]):
            _replicas_identical(leaf)
    # The reductions differ: bfloat16 rounds each device's partial gradient.
    assert not all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(
            jax.tree.leaves(out["float32"]),
            jax.tree.leaves(out["bfloat16"]),
            strict=True,
        )
    )


def _autocast_train(where, policy):
    def loss(params, x, y):
        h = x @ params["w"] + params["b"][None, :]
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, x, y, bad_col):
        if where == "whole_step":
            _, grads, _ = mixprec.value_and_grad(loss)(
                params, x, y, loss_scale=opt_state
            )
        else:
            _, grads, _ = mixprec.value_and_grad(mixprec.autocast(loss, policy))(
                params, x, y, loss_scale=opt_state
            )
        cols = jnp.arange(8)[None, :]
        grads["w"] = jnp.where(cols == bad_col, jnp.inf, grads["w"])
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return mixprec.autocast(step, policy) if where == "whole_step" else step


@pytest.mark.parametrize("formulation", ["native", "emulated"])
@pytest.mark.parametrize("where", ["loss_only", "whole_step"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_autocast_every_device_skips_together(mesh, policy, where, formulation):
    x, y = _data()
    cols = NamedSharding(mesh, P(None, "data"))
    repl = NamedSharding(mesh, P())
    params = {
        "w": jax.device_put(jax.random.normal(jax.random.key(5), (16, 8)) * 0.1, cols),
        "b": jax.device_put(jnp.zeros(8), repl),
    }
    opt_state = jax.device_put(OPT.init(_params()), repl)
    opt_state = opt_state._replace(
        inner_state=jax.tree.map(
            lambda a, p: jax.device_put(a, p.sharding),
            _st(opt_state).inner_state,
            (optax.TraceState(trace=params), optax.EmptyState()),
        )
    )
    xs, ys = jax.device_put(x, NamedSharding(mesh, P("data"))), jax.device_put(y, repl)
    with capability.override(formulation):
        step = jax.jit(_autocast_train(where, policy))
        # An inf in device 5's column of the gradient only: every device skips,
        # and the parameters are bit-identical to before.
        p1, s1 = step(params, opt_state, xs, ys, 5)
        assert not bool(_st(s1).last_finite) and int(_st(s1).num_skipped) == 1
        jax.tree.map(np.testing.assert_array_equal, p1, params)
        _replicas_identical(_st(s1).last_finite)
        _replicas_identical(_st(s1).loss_scale.loss_scale)
        # Then finite steps: every device updates, replicas stay identical.
        p2, s2 = step(p1, s1, xs, ys, -1)
        p2, s2 = step(p2, s2, xs, ys, -1)
    assert bool(_st(s2).last_finite) and int(_st(s2).num_skipped) == 1
    assert not bool(jnp.array_equal(p2["w"], params["w"]))
    assert p2["w"].sharding == cols and p2["w"].dtype == jnp.float32
    _replicas_identical(p2["b"])
    _replicas_identical(_st(s2).loss_scale.loss_scale)


@pytest.mark.parametrize(
    "policy,reduce",
    [
        ("mixed_bfloat16", "float32"),
        ("mixed_bfloat16", "bfloat16"),
        ("mixed_float16", "float16"),
    ],
)
def test_shard_map_psum_follows_the_reduce_dtype(mesh, policy, reduce):
    # Data parallel written by hand: per-device gradients, then a psum.
    def step(p, x):
        g = jax.grad(_mlp_loss)(p, x)
        g = jax.tree.map(lambda a: jax.lax.psum(a, "data") / N_DEV, g)
        return _sgd(p, g)

    pol = mixprec.get_policy(policy).with_reduce_dtype(reduce)
    f = jax.jit(
        jax.shard_map(
            mixprec.autocast(step, pol),
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=P(),
            check_vma=False,
        )
    )
    p, x = _comm_inputs(mesh, fsdp=False)
    hlo, compiled = _BENCH.partitioned_hlo(f.lower(p, x))
    comm = _BENCH.collective_bytes(hlo)
    itemsize = np.dtype(jnp.dtype(reduce)).itemsize
    assert comm == {"all-reduce": {_NAMES[reduce]: 2 * 8192 * itemsize}}, comm
    p1 = compiled(p, x)
    ref = jax.jit(lambda p, x: _sgd(p, jax.grad(_mlp_loss)(p, x)))(p, x)
    for a in jax.tree.leaves(p1):
        assert a.dtype == jnp.float32  # the sum comes back in its operand's dtype
        _replicas_identical(a)
    upd = jax.tree.map(jnp.subtract, p1, p)
    ref_upd = jax.tree.map(jnp.subtract, ref, p)
    assert_trees_close(
        upd, ref_upd, dtype=jnp.dtype(policy.removeprefix("mixed_")), grad=True
    )


# --- One process, two meshes ------------------------------------------------------

_MESH_POLICIES = ["mixed_bfloat16", "mixed_float16"]


def _tp_mesh():
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(auto, auto))


def _mlp_ref_loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"] ** 2) * 0.5


def _tp_mlp_loss(p, x):
    # Column-parallel w1, row-parallel w2 (one psum over "model"), the batch
    # over "data"; its scalar ops (`* 0.5`) are those of the 8-device program.
    partial = jnp.tanh(x @ p["w1"]) @ p["w2"] ** 2
    local = jnp.mean(jax.lax.psum(partial, "model"))
    return jax.lax.pmean(local, "data") * 0.5


@pytest.mark.parametrize("policy", _MESH_POLICIES)
def test_autocast_grad_of_shard_map_on_a_second_mesh(mesh, policy, monkeypatch):
    # A program on the (8,) mesh, then a tensor-parallel one on a (2, 4) mesh,
    # both differentiated under autocast in one process: the second must not
    # reuse what the first traced on its mesh (an inline jit of `mul` by the
    # literal 0.5, typed on the (8,) mesh: "context mesh ... should match the
    # aval mesh").
    from mixprec._src import _compat

    monkeypatch.setattr(_compat, "_CALLS", {})
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k1, (16, 16)) * 0.3
    x = jax.random.normal(k2, (64, 16))

    def dp_loss(w, x):
        return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "data") * 0.5

    dp = jax.shard_map(dp_loss, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    loss8, g8 = jax.jit(jax.value_and_grad(mixprec.autocast(dp, policy)))(w, x)
    ref8 = jax.value_and_grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2) * 0.5)(w, x)

    p = {
        "w1": jax.random.normal(k3, (16, 32)) * 0.3,
        "w2": jax.random.normal(k1, (32, 16)) * 0.3,
    }
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    tp = jax.shard_map(
        _tp_mlp_loss, mesh=_tp_mesh(), in_specs=(specs, P("data")), out_specs=P()
    )
    loss24, g24 = jax.jit(jax.value_and_grad(mixprec.autocast(tp, policy)))(p, x)
    ref24 = jax.value_and_grad(_mlp_ref_loss)(p, x)

    dtype = jnp.dtype(policy.removeprefix("mixed_"))
    for (loss, grads), (ref_loss, ref_grads) in [
        ((loss8, g8), ref8),
        ((loss24, g24), ref24),
    ]:
        assert loss.dtype == jnp.float32
        assert_trees_close(loss, ref_loss, dtype=dtype)
        assert_trees_close(grads, ref_grads, dtype=dtype, grad=True)
        assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("policy", _MESH_POLICIES)
def test_autocast_cache_is_per_mesh(mesh, policy):
    # A function whose arguments name no mesh (NumPy), called twice in a
    # shard_map body (walked, then built and cached), then on another mesh:
    # the jaxpr cached on the (8,) mesh holds its axis sizes (`axis_size`,
    # `pmean`'s divisor) and must not be replayed on the (2, 4) mesh.
    def g(c):
        idx = jax.lax.axis_index("data").astype(c.dtype)
        return c * jax.lax.axis_size("data") + jax.lax.pmean(idx, "data")

    ag = mixprec.autocast(g, policy)
    c = np.ones((), np.float32)

    def body(x):
        return x + ag(c) + ag(c)

    for m, size in [(mesh, N_DEV), (_tp_mesh(), 2)]:
        f = jax.jit(
            jax.shard_map(body, mesh=m, in_specs=P("data"), out_specs=P("data"))
        )
        out = f(jnp.zeros(16))
        np.testing.assert_array_equal(out, np.full(16, 2 * (size + (size - 1) / 2)))
        assert out.dtype == jnp.float32


def test_autocast_cache_is_per_vmap_axis_size():
    # The same under vmap with a named axis: eager calls share the cached
    # jaxpr, which must not carry the first axis size into the second.
    ag = mixprec.autocast(lambda c: c * jax.lax.axis_size("i"), "mixed_bfloat16")
    c = np.ones((), np.float32)
    for size in (8, 4):
        out = jax.vmap(lambda x: x + ag(c), axis_name="i")(jnp.zeros(size))
        np.testing.assert_array_equal(out, np.full(size, float(size)))
