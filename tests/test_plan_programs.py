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
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_dtypes, assert_trees_close, executed_lines
from plan_models import F8, D, batch, equinox_mlp, hlo_dots

import mixprec
import mixprec.optax
from mixprec._src.autocast.walk import PlanWarning
from mixprec._src.plan import Rule, Site


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


def _site(op):
    """The site explain names for a product (every product has one)."""
    assert op.site is not None, op
    return op.site


def _dots(fn, *args, policy):
    """``(site, backward, in_dtypes)`` of each product explain reports."""
    report = mixprec.explain(fn, *args, policy=policy)
    return [(_site(op), op.backward, op.in_dtypes) for op in report.find("dot_general")]


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
    hlo = hlo_dots(mixprec.autocast(fn, plan), w, x, y)
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
    scale = mixprec.optax.current_loss_scale
    assert np.asarray(scale(s2).loss_scale) < np.asarray(scale(state).loss_scale)
    # and the next good batch trains
    _, s3, loss3, _ = step(w, s2, x, y)
    assert int(s3.num_skipped) == 2 and bool(jnp.isfinite(loss3))


# ------------------------------------------- Haiku, Equinox and Flax NNX models


def _haiku_model():
    hk = pytest.importorskip("haiku")
    net = hk.without_apply_rng(
        hk.transform(
            lambda x: hk.nets.MLP([D, D, D], activation=jnp.tanh, name="mlp")(x)
        )
    )
    x, y = batch()
    params = net.init(jax.random.key(0), x)

    def loss(params, x, y):
        return jnp.mean((net.apply(params, x) - y) ** 2)

    return loss, params, jax.grad


def _equinox_model():
    eqx = pytest.importorskip("equinox")
    loss, model = equinox_mlp()
    return loss, model, eqx.filter_grad


def _nnx_model():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(D, D, rngs=rngs)
            self.l2 = nnx.Linear(D, D, rngs=rngs)
            self.head = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.l2(jnp.tanh(self.l1(x)))))

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    return loss, MLP(nnx.Rngs(0)), nnx.grad


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
# gives its products: Haiku's module names; Equinox and Flax NNX, whose name
# stacks name no layer of the user's, the paths of the parameters the
# products read. Each keeps the last layer in float32 and runs the others in
# float8.
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
            {"layer": "layers/2", "op": "dot_general", "index": 0, "policy": "float32"}
        ],
        "rules": [{"layers": "layers/.*", "policy": "mixed_float8"}],
    },
    "nnx": {
        "format": 1,
        "base": "mixed_float8",
        "rules": [{"layers": "head", "policy": "float32"}],
    },
}
_LAST = {"haiku": ("mlp/linear_2", 0), "equinox": ("layers/2", 0), "nnx": ("head", 0)}


@pytest.mark.parametrize("library", sorted(MODELS))
def test_a_hand_written_plan_file_runs_what_explain_reports(library, tmp_path):
    loss, model, grad = MODELS[library]()
    x, y = batch()
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
        if _site(op)[::2] == last:
            assert op.decision == "float32" and op.in_dtypes == ("float32",) * 2
        else:
            assert op.decision == "float8", op
            want = ("float8_e5m2" if op.backward else "float8_e4m3fn", "float8_e4m3fn")
            assert op.in_dtypes == want, op
    explained = sorted(
        tuple(F8.get(t, _HLO.get(t)) for t in op.in_dtypes) for op in ops
    )
    assert sorted(hlo_dots(mixprec.autocast(fn, plan), model, x, y)) == explained
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
    x, y = batch()
    # Two input channels 1e5 times the rest, read by first-layer weights
    # 1e5 times smaller: float8 (tensorwise) flushes the rest of that
    # layer's input to zero, bfloat16 does not.
    x = x.at[:, :2].multiply(1e5)
    model = _scale_first_layer_inputs(library, model, 1e-5)
    plan = mixprec.plan(loss, model, x, y, platform="h100")
    assert [s.policy for s in plan.sites] == ["mixed_bfloat16"] + ["mixed_float8"] * 2
    # Each site shows the user's line that calls the library's layer (the
    # Equinox model's lines are plan_models.equinox_mlp's).
    user = "plan_models.py:" if library == "equinox" else "test_plan_programs.py:"
    for s in plan.sites:
        assert user in s.source, s
    plan.save(tmp_path / "plan.json")
    plan = mixprec.Plan.load(tmp_path / "plan.json")
    policies: dict[tuple, str] = {s.key: s.policy for s in plan.sites}
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
        assert op.decision == want[policies[_site(op)]], (op, policies)
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


# ------------------------------------------- a padded, masked attention

_B, _T, _N, _H = 2, 64, 4, 64  # the projections' M = 128: float8 can run them

_CUDNN = (
    "__cudnn$fmhaSoftmax",
    "__cudnn$fmhaSoftmaxBackward",
    "__cudnn$fmhaScaleBiasSoftmax",
    "__cudnn$fmhaScaleBiasSoftmaxBackward",
)


def _cuda_program(fn, *args):
    """The dots (operand element types) and cuDNN attention calls the cuda
    export of ``fn`` executes."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in _CUDNN]
    exported = jax.export.export(
        jax.jit(fn), platforms=["cuda"], disabled_checks=checks
    )(*args)
    dots, calls = [], []
    for line in executed_lines(exported.mlir_module()):
        if "stablehlo.dot_general" in line:
            ins = line.rsplit(" : ", 1)[1].split(" -> ")[0]
            dots.append(tuple(re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", ins)))
        called = re.search(r"custom_call @(__cudnn\$\w+)", line)
        if called:
            calls.append(called.group(1))
    return sorted(dots), calls


def _padding_bias(origin):
    """A padding bias for batch row 1's last 6 keys, ``(1 - mask) *
    finfo(float32).min`` as Hugging Face builds it: an argument, or built
    from constants inside the model."""
    mask = np.ones((_B, _T), np.float32)
    mask[1, 10:] = 0.0
    if origin == "argument":
        bias = jnp.asarray((1 - mask) * np.finfo(np.float32).min)[:, None, None, :]
        return (lambda arg: arg), bias
    const = np.asarray(mask)

    def built(arg):
        del arg
        m = jnp.asarray(const)
        return ((1.0 - m) * jnp.finfo(jnp.float32).min)[:, None, None, :]

    return built, jnp.zeros(())


def _attention_model(origin, *, scope_values=False):
    make_bias, bias_arg = _padding_bias(origin)
    d = _N * _H

    def loss(w, x, bias_arg):
        with jax.named_scope("qkv"):
            qkv = x @ w["qkv"]
        q, k, v = jnp.split(qkv.reshape(_B, _T, 3 * _N, _H), 3, axis=2)
        with jax.named_scope("attn"):
            s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0 + make_bias(bias_arg)
            p = jax.nn.softmax(s, axis=-1)
            if scope_values:
                with mixprec.float32_scope():
                    o = jnp.einsum("bhts,bshd->bthd", p, v)
            else:
                o = jnp.einsum("bhts,bshd->bthd", p, v)
        with jax.named_scope("out"):
            out = o.reshape(_B, _T, d) @ w["o"]
        return jnp.mean(out[0] ** 2) + jnp.mean(out[1, :10] ** 2)

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = {
        "qkv": jax.random.normal(k1, (d, 3 * d)) / 16,
        "o": jax.random.normal(k2, (d, d)) / 16,
    }
    return loss, w, jax.random.normal(k3, (_B, _T, d)), bias_arg


_QK, _PV = "attn/bthd,bshd->bhts", "attn/bhts,bshd->bthd"


@pytest.fixture
def _cudnn(monkeypatch):
    from mixprec._src import _compat

    monkeypatch.setattr(
        _compat.cudnn_attention_module(), "check_cudnn_version", lambda: 91000
    )


def _explained(fn, plan, *args):
    report = mixprec.explain(fn, *args, policy=plan)
    fused = [op for op in report.ops if op.primitive == "dot_product_attention"]
    dots = report.find("dot_general")
    lowered = sorted(tuple(F8.get(t) or _HLO[t] for t in op.in_dtypes) for op in dots)
    return fused, dots, lowered


@pytest.mark.usefixtures("_cudnn")
@pytest.mark.parametrize("origin", ["argument", "constant"])
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_padded_attention_is_fused_in_the_widest_policy_of_its_sites(low, origin):
    loss, w, x, bias = _attention_model(origin)
    fn = jax.grad(loss)
    ref = fn(w, x, bias)
    base = LOW[low]

    # Both of its products at the base: one fused kernel each way.
    plan = mixprec.Plan(base)
    fused, dots, lowered = _explained(fn, plan, w, x, bias)
    assert [op.backward for op in fused] == [False, True]
    assert all(op.dtype == low for op in fused)
    assert {_site(op)[0] for op in dots} == {"qkv", "out"}
    hlo, calls = _cuda_program(mixprec.autocast(fn, plan), w, x, bias)
    assert hlo == lowered and len(calls) == 2, (hlo, calls)
    g = jax.jit(mixprec.autocast(fn, plan))(w, x, bias)
    assert_tree_dtypes(g, jnp.float32)
    assert_trees_close(g, ref, dtype=low, grad=True)

    # ·v float32 in the plan: the widest is float32, which is not fused; each
    # product runs at its own site's policy, forward and backward.
    plan = mixprec.Plan(base, rules=(Rule("attn/bhts.*", (), "float32"),))
    fused, dots, lowered = _explained(fn, plan, w, x, bias)
    assert not fused
    for op in dots:
        assert op.in_dtypes == ((("float32",) if _site(op)[0] == _PV else (low,)) * 2)
    assert sum(_site(op)[0] == _PV for op in dots) == 3
    assert sum(_site(op)[0] == _QK for op in dots) == 3
    hlo, calls = _cuda_program(mixprec.autocast(fn, plan), w, x, bias)
    assert hlo == lowered and not calls, (hlo, calls)
    g = jax.jit(mixprec.autocast(fn, plan))(w, x, bias)
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(g))
    assert_trees_close(g, ref, dtype=low, grad=True)

    # ·v in the other 16-bit type: not fused either, each at its own.
    other = OTHER[low]
    plan = mixprec.Plan(base, rules=(Rule("attn/bhts.*", (), LOW[other]),))
    fused, dots, lowered = _explained(fn, plan, w, x, bias)
    assert not fused
    for op in dots:
        assert op.in_dtypes == (((other,) if _site(op)[0] == _PV else (low,)) * 2)
    hlo, calls = _cuda_program(mixprec.autocast(fn, plan), w, x, bias)
    assert hlo == lowered and not calls, (hlo, calls)
    g = jax.jit(mixprec.autocast(fn, plan))(w, x, bias)
    assert_trees_close(g, ref, dtype="bfloat16", grad=True)


@pytest.mark.usefixtures("_cudnn")
def test_a_float8_site_of_an_attention_fuses_at_its_wider_partner():
    # q·kᵀ bfloat16, ·v float8: the widest is bfloat16, one fused kernel in
    # it (no float8 attention kernel); the projections run float8.
    loss, w, x, bias = _attention_model("argument")
    fn = jax.grad(loss)
    plan = mixprec.Plan("mixed_float8", rules=(Rule(_QK, (), "mixed_bfloat16"),))
    fused, dots, lowered = _explained(fn, plan, w, x, bias)
    assert [op.dtype for op in fused] == ["bfloat16", "bfloat16"]
    # Each fused row names the sites it runs and the policy each has.
    bf16, f8 = (str(mixprec.get_policy(p)) for p in ("mixed_bfloat16", "mixed_float8"))
    for op in fused:
        assert op.reason.startswith(f"plan: policy {bf16}, the widest of"), op.reason
        assert re.search(rf"{_QK}\S*: {re.escape(bf16)}", op.reason), op.reason
        assert re.search(rf"{_PV}\S*: {re.escape(f8)}", op.reason), op.reason
    assert len(dots) == 2 + 3 and all(op.decision == "float8" for op in dots)
    hlo, calls = _cuda_program(mixprec.autocast(fn, plan), w, x, bias)
    assert hlo == lowered and len(calls) == 2, (hlo, calls)


@pytest.mark.usefixtures("_cudnn")
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_a_float32_scope_in_an_attention_wins_over_the_plan(low):
    loss, w, x, bias = _attention_model("argument", scope_values=True)
    fn = jax.grad(loss)
    # The plan says the ·v product (and everything) runs low; the code's
    # float32_scope around it wins: not fused, ·v and its gradients float32.
    plan = mixprec.Plan(LOW[low], rules=(Rule(".*", (), LOW[low]),))
    fused, dots, lowered = _explained(fn, plan, w, x, bias)
    assert not fused
    pv = [op for op in dots if _site(op)[0] == _PV]
    assert len(pv) == 3 and all(op.in_dtypes == ("float32",) * 2 for op in pv)
    assert all(op.in_dtypes == (low,) * 2 for op in dots if op not in pv)
    hlo, calls = _cuda_program(mixprec.autocast(fn, plan), w, x, bias)
    assert hlo == lowered and not calls
    g = jax.jit(mixprec.autocast(fn, plan))(w, x, bias)
    assert_trees_close(g, fn(w, x, bias), dtype=low, grad=True)


# ------------------------------------------- the compact optimizer state


def _cast_loss(w, x, y):
    # The model reads the compact state's bfloat16 weights as float32.
    with jax.named_scope("l0"):
        h = jnp.tanh(x @ w["a"].astype(jnp.float32))
    with jax.named_scope("l1"):
        h = jnp.tanh(h @ w["b"].astype(jnp.float32))
    with jax.named_scope("l2"):
        out = h @ w["c"].astype(jnp.float32)
    return jnp.mean((out - y) ** 2)


def _three_site_plan():
    plan = mixprec.Plan(
        "mixed_float8",
        sites=(
            Site("l1", "dot_general", 0, "mixed_float16"),
            Site("l2", "dot_general", 0, "float32"),
        ),
    )
    return plan, {"l0": "float8", "l1": "low", "l2": "float32"}


def _cast_chain():
    k = jax.random.split(jax.random.key(0), 5)
    w = {
        n: jax.random.normal(kk, (D, D)) / 11
        for n, kk in zip("abc", k[:3], strict=True)
    }
    return w, jax.random.normal(k[3], (128, D)), jax.random.normal(k[4], (128, D))


def _loss_scaled_step(loss_fn, opt):
    """A whole train step: ``loss_fn``'s gradients under the loss scale in
    ``opt``'s state (``mixprec.optax.loss_scaled``), then ``opt``'s update;
    returns the new weights, state and loss."""

    def train_step(w, state, x, y):
        vg = mixprec.value_and_grad(loss_fn)
        loss, grads, _ = vg(w, x, y, loss_scale=state)
        updates, state = opt.update(grads, state, w)
        return optax.apply_updates(w, updates), state, loss

    return train_step


@pytest.mark.parametrize("policy", ["plan", "mixed_float8"])
def test_a_whole_step_from_a_loss_scale_gives_float8_its_e5m2_gradients(policy):
    w, x, y = _cast_chain()
    opt = mixprec.optax.loss_scaled(optax.sgd(0.1))
    state = opt.init(w)
    train_step = _loss_scaled_step(_cast_loss, opt)

    if policy == "plan":
        policy, want = _three_site_plan()
    else:
        want = {"l0": "float8", "l1": "float8", "l2": "float8"}
    report = mixprec.explain(train_step, w, state, x, y, policy=policy)
    ops = report.find("dot_general")
    assert len(ops) == 3 + 5
    for op in ops:
        assert op.decision == want[_site(op)[0]], op
        if op.decision == "float8" and op.backward:
            # The backward pass starts from the loss scale times 1.0, a
            # gradient all the same: its float8 operand is e5m2 (it was
            # e4m3, taken for no gradient).
            assert op.in_dtypes[0] == "float8_e5m2", op
    got = jax.jit(mixprec.autocast(train_step, policy))(w, state, x, y)
    ref = jax.jit(train_step)(w, state, x, y)
    assert_tree_dtypes(got, jax.tree.map(lambda a: a.dtype, ref))
    assert int(got[1].num_skipped) == 0
    assert_trees_close(got[2], ref[2], dtype="bfloat16")
    delta = jax.tree.map(lambda a, b: a - b, got[0], w)
    _assert_float8_close(delta, jax.tree.map(lambda a, b: a - b, ref[0], w))


def test_the_compact_state_trains_under_a_plan():
    # With the compact state's bfloat16 weights, autocast wraps the loss (a
    # whole step would hand the weights back in the output dtype).
    w32, x, y = _cast_chain()
    compact = mixprec.optax.compact_state(
        optax.sgd(10.0, momentum=0.9),  # steps far over a bfloat16 ulp
        weights="bfloat16-sr",
        moments="int8",
        policy="p=bf16,c=bf16,o=f32",
    )
    opt = mixprec.optax.loss_scaled(compact)
    w16 = mixprec.optax.compact_params(w32, "bfloat16-sr")
    state = opt.init(w32)
    plan, want = _three_site_plan()

    ops = mixprec.explain(jax.grad(_cast_loss), w16, x, y, policy=plan).find(
        "dot_general"
    )
    assert [want[_site(op)[0]] == op.decision for op in ops] == [True] * 8
    step = jax.jit(_loss_scaled_step(mixprec.autocast(_cast_loss, plan), opt))
    ref_step = jax.jit(_loss_scaled_step(_cast_loss, opt))
    got, ref = step(w16, state, x, y), ref_step(w16, state, x, y)
    assert_tree_dtypes(got, jax.tree.map(lambda a: a.dtype, ref))
    assert got[0]["a"].dtype == jnp.bfloat16
    assert int(got[1].num_skipped) == 0
    assert_trees_close(got[2], ref[2], dtype="bfloat16")
    delta = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b, got[0], w32)
    ref_delta = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b, ref[0], w32)
    _assert_float8_close(delta, ref_delta)
    # A second step reads the first's state (its int8 momentum) as it is.
    again, ref_again = step(*got[:2], x, y), ref_step(*ref[:2], x, y)
    assert_tree_dtypes(again, jax.tree.map(lambda a: a.dtype, ref_again))
    assert_trees_close(again[2], ref_again[2], dtype="bfloat16")


# ------------------------------------------- scanned layers


def _scanned_loss(w, x):
    with jax.named_scope("inp"):
        h = x @ w["inp"]

    def body(h, wl):
        with jax.named_scope("layer"):
            return jnp.tanh(h @ wl), None

    h, _ = jax.lax.scan(body, h, w["layers"])
    with jax.named_scope("head"):
        return jnp.mean((h @ w["head"]) ** 2)


@pytest.mark.parametrize("body", ["float32", "mixed_bfloat16"])
def test_scanned_layers_under_a_plan_and_the_gradient_after_the_scan(body):
    k = jax.random.split(jax.random.key(0), 4)
    w = {
        "inp": jax.random.normal(k[0], (D, D)) / 11,
        "layers": jax.random.normal(k[1], (3, D, D)) / 11,
        "head": jax.random.normal(k[2], (D, D)) / 11,
    }
    x = jax.random.normal(k[3], (128, D))
    plan = mixprec.Plan("mixed_float8", rules=(Rule("layer", (), body),))
    fn = jax.grad(_scanned_loss)
    ops = mixprec.explain(fn, w, x, policy=plan).find("dot_general")
    assert len(ops) == 3 + 5  # x needs no gradient: one for `inp`
    low = "float32" if body == "float32" else "bfloat16"
    for op in ops:
        if _site(op)[0] == "layer":
            assert op.in_dtypes == (low, low), op
        elif op.backward:
            # The weight gradient of `inp` reads the cotangent the transposed
            # scan returns: a gradient, e5m2 (it was e4m3, its mark lost).
            assert op.in_dtypes == ("float8_e5m2", "float8_e4m3fn"), op
        else:
            assert op.in_dtypes == ("float8_e4m3fn",) * 2, op
    explained = sorted(tuple(F8.get(t) or _HLO[t] for t in op.in_dtypes) for op in ops)
    hlo = hlo_dots(mixprec.autocast(fn, plan), w, x)
    # (A scan body's dots appear once in the module, for all its iterations.)
    assert sorted(hlo) == explained
    g = jax.jit(mixprec.autocast(fn, plan))(w, x)
    assert_tree_dtypes(g, jnp.float32)
    _assert_float8_close(g, fn(w, x))


# ------------------------------------------- eight devices


def test_a_whole_step_under_a_plan_on_eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    w, x, y = _cast_chain()
    opt = mixprec.optax.loss_scaled(optax.sgd(0.1))
    state = opt.init(w)
    train_step = _loss_scaled_step(_cast_loss, opt)

    plan, want = _three_site_plan()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    shard = jax.NamedSharding(mesh, jax.P("data"))
    xs, ys = jax.device_put(x, shard), jax.device_put(y, shard)
    step = jax.jit(mixprec.autocast(train_step, plan))
    report = mixprec.explain(train_step, w, state, xs, ys, policy=plan)
    ops = report.find("dot_general")
    assert [op.decision == want[_site(op)[0]] for op in ops] == [True] * 8
    got8, got1 = step(w, state, xs, ys), step(w, state, x, y)
    assert got8[0]["a"].sharding.is_fully_replicated
    assert_tree_dtypes(got8, jax.tree.map(lambda a: a.dtype, got1))
    for a, b in zip(jax.tree.leaves(got8), jax.tree.leaves(got1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    ref = jax.jit(train_step)(w, state, x, y)
    assert_trees_close(got8[2], ref[2], dtype="bfloat16")


# ------------------------------------------- diagnose's suggested plan


def test_diagnose_suggests_a_plan_that_passes_when_re_run():
    loss, model, grad = _nnx_model()
    x, y = batch()
    # Channels 1e6 times the rest into the first layer: tensorwise float8
    # flushes every other value of its input to zero.
    x = x.at[:, :2].multiply(1e6)
    model = _scale_first_layer_inputs("nnx", model, 1e-6)
    fn = grad(loss)
    report = mixprec.diagnose(fn, model, x, y, policy="mixed_float8")
    plan = report.suggested_plan
    f8, bf16 = "p=f32,c=bf16,o=f32,f8=tensorwise", "p=f32,c=bf16,o=f32"
    assert [s.policy for s in plan.sites] == [bf16, f8, f8]
    assert report.plan_verified is True
    again = mixprec.diagnose(fn, model, x, y, policy=plan)
    assert again.plan_verified is True
    assert [s.policy for s in again.suggested_plan.sites] == [bf16, f8, f8]
    assert not [op for op in again.problems if op.site is not None]
    ops = mixprec.explain(fn, model, x, y, policy=plan).find("dot_general")
    assert [op.decision for op in ops if not op.backward] == ["low", "float8", "float8"]
    g = jax.jit(mixprec.autocast(fn, plan))(model, x, y)
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(g))
    _assert_float8_close(g, fn(model, x, y))
    g8 = jax.jit(mixprec.autocast(fn, "mixed_float8"))(model, x, y)
    with pytest.raises(AssertionError, match="in float8"):
        _assert_float8_close(g8, fn(model, x, y))  # what the plan fixes


# ------------------------------------------- a hand-edited file that is off


def test_a_site_entry_that_names_no_site_warns_with_the_closest():
    # A site edited by hand with its layer misspelt would otherwise be
    # silently ignored: the product runs at the base.
    w, x, y = _chain()
    site = {"layer": "L1", "op": "dot_general", "index": 0, "policy": "float32"}
    plan = mixprec.Plan.from_dict(
        {"format": 1, "base": "mixed_bfloat16", "sites": [site]}
    )
    with pytest.warns(
        PlanWarning,
        match=r"sites\[0\] \('L1', 'dot_general', 0\): no dot_general of this "
        r"program is in that layer.*closest layer paths: 'l1'",
    ):
        mixprec.autocast(_chain_loss, plan)(w, x, y)
    ok = mixprec.Plan(plan.base, sites=(Site("l1", "dot_general", 0, "float32"),))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)
        mixprec.autocast(_chain_loss, ok)(w, x, y)


def test_a_jitted_layer_called_from_two_layers_is_a_site_in_each():
    @jax.jit
    def dense(x, w):
        return jnp.tanh(x @ w)

    def loss(w, x, y):
        with jax.named_scope("l0"):
            h = dense(x, w["a"])
        with jax.named_scope("l1"):
            h = dense(h, w["b"])
        with jax.named_scope("l2"):
            return jnp.mean((h @ w["c"] - y) ** 2)

    w, x, y = _chain()
    plan = mixprec.Plan(
        "mixed_bfloat16", sites=(Site("l1", "dot_general", 0, "float32"),)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)  # (l1's site is there)
        ops = mixprec.explain(jax.grad(loss), w, x, y, policy=plan).find("dot_general")
    assert len(ops) == 3 + 5
    for op in ops:
        want = "float32" if _site(op)[0] == "l1" else "bfloat16"
        assert op.in_dtypes == (want, want), op


def test_a_rule_over_layers_without_a_path_says_how_to_name_their_sites():
    # No scope names these products and no argument leaf with a path is
    # read (the weights are the arguments themselves).
    def loss(a, b, x):
        return jnp.mean(jnp.tanh(x @ a) @ b)

    w = jnp.ones((D, D)) / D
    x, _ = batch()
    plan = mixprec.Plan.from_dict(
        {
            "format": 1,
            "base": "mixed_bfloat16",
            "rules": [{"layers": "head", "policy": "float32"}],
        }
    )
    with pytest.warns(
        PlanWarning, match=r"rules\[0\].*no layer path.*\"sites\" by index"
    ):
        mixprec.autocast(loss, plan)(w, w, x)


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"op": "dot"}, r"sites\[0\]: field 'op' names 'dot', which is not a matmul"),
        ({"flops": "16M"}, r"sites\[0\]: field 'flops' must be a non-negative integer"),
        ({"flops": -1}, r"sites\[0\]: field 'flops' must be a non-negative integer"),
    ],
)
def test_a_malformed_site_field_names_the_entry_and_the_field(entry, match):
    site = {"layer": "l1", "op": "dot_general", "index": 0, "policy": "float32"}
    with pytest.raises(ValueError, match=match):
        mixprec.Plan.from_dict(
            {"format": 1, "base": "mixed_bfloat16", "sites": [{**site, **entry}]}
        )


@pytest.mark.parametrize(
    "top, match",
    [
        (
            {"candidates": ["mixed_float8", "mixed_bf16x"]},
            r"field 'candidates'\[1\]: unknown policy 'mixed_bf16x'",
        ),
        ({"tolerance": True}, "field 'tolerance' must be a number, got True"),
    ],
)
def test_malformed_top_fields_name_the_field(top, match):
    with pytest.raises(ValueError, match=match):
        mixprec.Plan.from_dict({"format": 1, "base": "mixed_bfloat16", **top})


def _one_policy_calls():
    """Calls that take one policy (they cast a module's parameters and
    inputs; a plan's per-matmul policies apply through autocast)."""

    def equinox(plan):
        eqx = pytest.importorskip("equinox")
        import mixprec.equinox

        mixprec.equinox.MixedPrecision(eqx.nn.Linear(4, 4, key=jax.random.key(0)), plan)

    def haiku(plan):
        hk = pytest.importorskip("haiku")
        import mixprec.haiku

        mixprec.haiku.set_policy(hk.Linear, plan)

    def flax(plan):
        nn = pytest.importorskip("flax.linen")
        import mixprec.flax

        params = {"params": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)}}
        mixprec.flax.apply(nn.Dense(4), params, jnp.ones((2, 4)), policy=plan)

    def scope(plan):
        with mixprec.policy_scope(plan):
            pass

    return {"equinox": equinox, "haiku": haiku, "flax": flax, "policy_scope": scope}


@pytest.mark.parametrize("call", sorted(_one_policy_calls()))
def test_a_plan_where_one_policy_is_needed_says_where_plans_go(call):
    plan = mixprec.Plan("mixed_bfloat16", rules=(Rule("head", (), "float32"),))
    with pytest.raises(
        TypeError, match=r"got Plan.*`mixprec.autocast\(fn, plan\)`.*`plan.base`"
    ):
        _one_policy_calls()[call](plan)
