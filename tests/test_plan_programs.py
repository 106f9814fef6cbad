"""Precision plans on programs shaped like the ones people run: a whole train
step with optax and a loss scale, Flax NNX, Equinox and Haiku models under a
measured plan and a hand-written rules file, a padded attention, the compact
optimizer state, eight devices, and diagnose's suggested plan re-run.

Each test checks what runs (explain's decisions against the lowered program)
and its values against float32 with the per-dtype tolerances of
``tests/helpers.py``.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_dtypes, assert_trees_close, executed_lines

import mixprec
import mixprec.optax
from mixprec._src.plan import Site


LOW = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
OTHER = {"bfloat16": "float16", "float16": "bfloat16"}


def _chain_loss(w, x, y):
    with jax.named_scope("l0"):
        h = jnp.tanh(x @ w["a"])
    with jax.named_scope("l1"):
        h = h @ w["b"]
    with jax.named_scope("l2"):
        out = jnp.tanh(h) @ w["c"]
    return jnp.mean((out - y) ** 2)


def _chain(d=32, n=16):
    k = jax.random.split(jax.random.key(0), 5)
    w = {
        n_: jax.random.normal(kk, (d, d)) / 6
        for n_, kk in zip("abc", k[:3], strict=True)
    }
    return w, jax.random.normal(k[3], (n, d)), jax.random.normal(k[4], (n, d))


def _dots(fn, *args, policy):
    """``(site, backward, in_dtypes)`` of each product explain reports."""
    report = mixprec.explain(fn, *args, policy=policy)
    return [(op.site, op.backward, op.in_dtypes) for op in report.find("dot_general")]


def _hlo_dots(fn, *args, platform="cuda"):
    """The operand element types of each ``dot_general`` the lowered program
    executes (a called function's once per call)."""
    text = jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
    dots = []
    for line in executed_lines(text):
        if "stablehlo.dot_general" in line:
            ins = line.rsplit(" : ", 1)[1].split(" -> ")[0]
            dots.append(tuple(re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", ins)))
    return dots


_HLO = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


# ------------------------------------------- a site in another 16-bit dtype


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_site_in_the_other_16_bit_dtype_runs_in_it(low):
    # The base lowers the activations to `low`; the site reading them runs
    # in the other 16-bit dtype, as the plan says (it used to run as
    # written, in float32: its operand was in neither float32 nor its own
    # compute dtype).
    site = OTHER[low]
    w, x, y = _chain()
    plan = mixprec.Plan(LOW[low], sites=(Site("l1", "dot_general", 0, LOW[site]),))
    fn = jax.grad(_chain_loss)
    dots = _dots(fn, w, x, y, policy=plan)
    assert len(dots) == 3 + 5
    for key, _, dtypes in dots:
        assert dtypes == ((site,) * 2 if key[0] == "l1" else (low,) * 2), dots
    hlo = _hlo_dots(mixprec.autocast(fn, plan), w, x, y)
    assert sorted(hlo) == sorted((_HLO[d[0]],) * 2 for _, _, d in dots)
    g = jax.jit(mixprec.autocast(fn, plan))(w, x, y)
    assert_tree_dtypes(g, jnp.float32)
    assert_trees_close(g, fn(w, x, y), dtype="bfloat16", grad=True)


def test_a_precision_scope_in_the_other_16_bit_dtype_runs_in_it():
    def f(x, a, b):
        h = jnp.tanh(x @ a)
        with mixprec.precision_scope("mixed_float16"):
            return h @ b

    x, a, b = jnp.ones((8, 16)), jnp.ones((16, 16)) / 4, jnp.ones((16, 16)) / 4
    ops = mixprec.explain(f, x, a, b, policy="mixed_bfloat16").find("dot_general")
    assert [op.in_dtypes for op in ops] == [("bfloat16",) * 2, ("float16",) * 2]
    out = mixprec.autocast(f, "mixed_bfloat16")(x, a, b)
    assert out.dtype == jnp.float32
    assert_trees_close(out, f(x, a, b), dtype="bfloat16")


# ------------------------------------------- a whole train step with optax


def _hot_chain_loss(w, x, y):
    # No squashing before `l1`: a batch row scaled by 1e5 overflows float16
    # there (and nowhere in bfloat16 or float32).
    with jax.named_scope("l0"):
        h = x @ w["a"]
    with jax.named_scope("l1"):
        h = h @ w["b"]
    with jax.named_scope("l2"):
        out = jnp.tanh(h) @ w["c"]
    return jnp.mean((out - y) ** 2)


def test_whole_train_step_with_a_float16_site_and_loss_scaled_optax():
    w, x, y = _chain()
    opt = mixprec.optax.loss_scaled(optax.sgd(0.1))

    def train_step(w, state, x, y):
        vg = mixprec.value_and_grad(_hot_chain_loss)
        loss, grads, _ = vg(w, x, y, loss_scale=state)
        updates, state = opt.update(grads, state, w)
        return optax.apply_updates(w, updates), state, loss, grads

    plan = mixprec.Plan(
        "mixed_bfloat16", sites=(Site("l1", "dot_general", 0, "mixed_float16"),)
    )
    state = opt.init(w)
    for key, _, dtypes in _dots(train_step, w, state, x, y, policy=plan):
        assert dtypes == (("float16",) * 2 if key[0] == "l1" else ("bfloat16",) * 2)
    step = jax.jit(mixprec.autocast(train_step, plan))
    ref = jax.jit(train_step)
    new_w, new_state, loss, grads = step(w, state, x, y)
    ref_w, _, ref_loss, ref_grads = ref(w, state, x, y)
    assert int(new_state.num_skipped) == 0
    assert_tree_dtypes((new_w, loss, grads), jnp.float32)
    assert_trees_close(loss, ref_loss, dtype="bfloat16")
    assert_trees_close(grads, ref_grads, dtype="bfloat16", grad=True)
    assert_trees_close(new_w, ref_w, dtype="bfloat16")

    # One batch row 1e5 times the rest: float16 overflows at `l1`, the step
    # is skipped (parameters unchanged), twice in a row backs the scale off.
    hot = x.at[0].multiply(1e5)
    _, ref_state, ref_loss, _ = ref(w, state, hot, y)
    assert bool(jnp.isfinite(ref_loss)) and int(ref_state.num_skipped) == 0
    bf16 = jax.jit(mixprec.autocast(train_step, "mixed_bfloat16"))
    assert int(bf16(w, state, hot, y)[1].num_skipped) == 0
    skipped_w, s1, _, _ = step(w, state, hot, y)
    assert int(s1.num_skipped) == 1
    for a, b in zip(jax.tree.leaves(skipped_w), jax.tree.leaves(w), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _, s2, _, _ = step(w, s1, hot, y)
    assert int(s2.num_skipped) == 2
    assert float(s2.loss_scale.loss_scale) < float(state.loss_scale.loss_scale)
    # and the next good batch trains
    _, s3, loss3, _ = step(w, s2, x, y)
    assert int(s3.num_skipped) == 2 and bool(jnp.isfinite(loss3))


# ------------------------------------------- Haiku, Equinox and Flax NNX models

_D = 128  # every product at or over the float8 recipe's min_dim

_F8 = {"float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2"}


def _haiku_model():
    hk = pytest.importorskip("haiku")
    net = hk.without_apply_rng(
        hk.transform(
            lambda x: hk.nets.MLP([_D, _D, _D], activation=jnp.tanh, name="mlp")(x)
        )
    )
    x, y = _batch()
    params = net.init(jax.random.key(0), x)

    def loss(params, x, y):
        return jnp.mean((net.apply(params, x) - y) ** 2)

    return loss, params, jax.grad


def _equinox_model():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        layers: list

        def __init__(self, key):
            keys = jax.random.split(key, 3)
            self.layers = [eqx.nn.Linear(_D, _D, key=k) for k in keys]

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = jnp.tanh(layer(x))
            return self.layers[-1](x)

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return loss, Model(jax.random.key(0)), eqx.filter_grad


def _nnx_model():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(_D, _D, rngs=rngs)
            self.l2 = nnx.Linear(_D, _D, rngs=rngs)
            self.head = nnx.Linear(_D, _D, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.l2(jnp.tanh(self.l1(x)))))

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    return loss, MLP(nnx.Rngs(0)), nnx.grad


def _batch():
    k1, k2 = jax.random.split(jax.random.key(1))
    return jax.random.normal(k1, (128, _D)), jax.random.normal(k2, (128, _D))


def _assert_float8_close(tree, reference):
    """Gradients of a program with float8 products against float32: each
    leaf's largest error under 0.2 of its largest value. (float8 has no row
    in the tables of ``tests/helpers.py``; e5m2 gradients keep two mantissa
    bits. Measured on these models: 0.01-0.13 per leaf with every product in
    float8, 0.002-0.009 in bfloat16.)"""
    leaves, ref = jax.tree.leaves(tree), jax.tree.leaves(reference)
    assert len(leaves) == len(ref)
    for a, r in zip(leaves, ref, strict=True):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        err = np.max(np.abs(a - r)) / max(np.max(np.abs(r)), 1e-30)
        assert err <= 0.2, f"relative error {err:.3g} > 0.2 in float8"


MODELS = {"haiku": _haiku_model, "equinox": _equinox_model, "nnx": _nnx_model}

# A plan file as a user writes it for each library, over the layer paths it
# gives its products: Haiku's module names; Equinox's class names (its
# products are told apart by index); Flax NNX names no module in the name
# stack (its layer path is "", its products told apart by index). Each keeps
# the last layer in float32 and runs the others in float8.
_FILES = {
    "haiku": {
        "format": 1,
        "base": "mixed_bfloat16",
        "rules": [
            {
                "layers": "mlp/linear_[01]",
                "ops": ["dot_general"],
                "policy": "mixed_float8",
            },
            {"layers": "mlp/linear_2", "policy": "float32"},
        ],
    },
    "equinox": {
        "format": 1,
        "base": "mixed_bfloat16",
        "sites": [
            {
                "layer": "eqx.nn.Linear",
                "op": "dot_general",
                "index": 2,
                "policy": "float32",
            }
        ],
        "rules": [{"layers": r"eqx\.nn\.Linear", "policy": "mixed_float8"}],
    },
    "nnx": {
        "format": 1,
        "base": "mixed_float8",
        "sites": [{"layer": "", "op": "dot_general", "index": 2, "policy": "float32"}],
    },
}
_LAST = {"haiku": ("mlp/linear_2", 0), "equinox": ("eqx.nn.Linear", 2), "nnx": ("", 2)}


@pytest.mark.parametrize("library", sorted(MODELS))
def test_a_hand_written_plan_file_runs_what_explain_reports(library, tmp_path):
    loss, model, grad = MODELS[library]()
    x, y = _batch()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_FILES[library], indent=2))
    plan = mixprec.Plan.load(path)
    fn = grad(loss)
    report = mixprec.explain(fn, model, x, y, policy=plan)
    ops = report.find("dot_general")
    assert len(ops) == 3 + 5
    last = _LAST[library]
    for op in ops:
        assert op.site is not None
        if op.site[::2] == last:
            assert op.decision == "float32" and op.in_dtypes == ("float32",) * 2
        else:
            assert op.decision == "float8", op
            want = ("float8_e5m2" if op.backward else "float8_e4m3fn", "float8_e4m3fn")
            assert op.in_dtypes == want, op
    explained = sorted(
        tuple(_F8.get(t, _HLO.get(t)) for t in op.in_dtypes) for op in ops
    )
    assert sorted(_hlo_dots(mixprec.autocast(fn, plan), model, x, y)) == explained
    g = jax.jit(mixprec.autocast(fn, plan))(model, x, y)
    ref = fn(model, x, y)
    assert_tree_dtypes(g, jnp.float32)
    _assert_float8_close(g, ref)


def _scale_first_layer_inputs(library, model, factor):
    """``model`` with the first layer's weights of input channels 0 and 1
    multiplied by ``factor``."""
    if library == "haiku":
        params = dict(model)
        w = params["mlp/~/linear_0"]["w"]
        params["mlp/~/linear_0"] = {
            **params["mlp/~/linear_0"],
            "w": w.at[:2].multiply(factor),
        }
        return params
    if library == "equinox":
        import equinox as eqx

        w = model.layers[0].weight  # (out, in)
        return eqx.tree_at(
            lambda m: m.layers[0].weight, model, w.at[:, :2].multiply(factor)
        )
    model.l1.kernel[...] = model.l1.kernel[...].at[:2].multiply(factor)
    return model


def _train_step(library, loss):
    """A train step as each library writes it (SGD, so that the update is
    the gradient times the learning rate)."""
    if library == "nnx":
        from flax import nnx

        def nnx_step(model, opt, x, y):
            value, grads = nnx.value_and_grad(loss)(model, x, y)
            opt.update(model, grads)
            return value

        return nnx_step
    opt = optax.sgd(0.1)

    def step(model, state, x, y):
        if library == "equinox":
            import equinox as eqx

            value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
            updates, state = opt.update(grads, state)
            return eqx.apply_updates(model, updates), state, value
        value, grads = jax.value_and_grad(loss)(model, x, y)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(model, updates), state, value

    return step


def _params(library, model):
    if library == "nnx":
        from flax import nnx

        return jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    if library == "equinox":
        import equinox as eqx

        return eqx.filter(model, eqx.is_array)
    return model


def _run_step(library, step, model, x, y, *, policy):
    """One step from ``model``; the parameters after it."""
    if library == "nnx":
        from flax import nnx

        model = nnx.clone(model)
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        fn = step if policy is None else mixprec.autocast(step, policy)
        value = nnx.jit(fn)(model, opt, x, y)
        return _params(library, model), value
    fn = step if policy is None else mixprec.autocast(step, policy)
    state = optax.sgd(0.1).init(_params(library, model))
    if library == "equinox":
        import equinox as eqx

        new, _, value = eqx.filter_jit(fn)(model, state, x, y)
    else:
        new, _, value = jax.jit(fn)(model, state, x, y)
    return _params(library, new), value


@pytest.mark.parametrize("library", sorted(MODELS))
def test_a_measured_plan_runs_as_planned_in_a_whole_train_step(library, tmp_path):
    loss, model, _ = MODELS[library]()
    x, y = _batch()
    # Two input channels 1e5 times the rest, read by first-layer weights
    # 1e5 times smaller: float8 (tensorwise) flushes the rest of that
    # layer's input to zero, bfloat16 does not.
    x = x.at[:, :2].multiply(1e5)
    model = _scale_first_layer_inputs(library, model, 1e-5)
    plan = mixprec.plan(loss, model, x, y, platform="h100")
    assert [s.policy for s in plan.sites] == ["mixed_bfloat16"] + ["mixed_float8"] * 2
    plan.save(tmp_path / "plan.json")
    plan = mixprec.Plan.load(tmp_path / "plan.json")
    policies = {s.key: s.policy for s in plan.sites}
    step = _train_step(library, loss)
    if library == "nnx":
        from flax import nnx

        opt = nnx.Optimizer(nnx.clone(model), optax.sgd(0.1), wrt=nnx.Param)
        report = mixprec.explain(step, nnx.clone(model), opt, x, y, policy=plan)
    else:
        state = optax.sgd(0.1).init(_params(library, model))
        report = mixprec.explain(step, model, state, x, y, policy=plan)
    ops = report.find("dot_general")
    assert len(ops) == 3 + 5
    want = {"mixed_float8": "float8", "mixed_bfloat16": "low", "float32": "float32"}
    for op in ops:
        assert op.site is not None and op.site in policies, op
        assert op.decision == want[policies[op.site]], (op, policies)
        assert op.reason.startswith("plan: policy")
    before = _params(library, model)
    got, value = _run_step(library, step, model, x, y, policy=plan)
    ref, ref_value = _run_step(library, step, model, x, y, policy=None)
    assert_tree_dtypes(got, jnp.float32)
    assert value.dtype == jnp.float32
    assert_trees_close(value, ref_value, dtype="bfloat16")
    delta = jax.tree.map(lambda a, b: a - b, got, before)
    ref_delta = jax.tree.map(lambda a, b: a - b, ref, before)
    _assert_float8_close(delta, ref_delta)
