"""Plan sites named by the parameter a product reads, where no name stack
names its layer: Flax NNX (no scope per module) and Equinox (only its own
class names, ``eqx.nn.Linear``). The same names under the loss and under
the whole train step; the names of programs with name stacks (Flax linen,
Haiku, ``jax.named_scope``) unchanged.
"""

import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_dtypes
from plan_models import F8, D, batch, equinox_mlp, hlo_dots

import mixprec
from mixprec._src.autocast.walk import PlanWarning


_HLO = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", **F8}


def _nnx_blocks(n=3):
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, D, rngs=rngs)
            self.down = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(n)])
            self.head = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    return loss, Net(nnx.Rngs(0))


def _sites(fn, *args, policy=None):
    """``(site, backward)`` of each product explain reports."""
    policy = mixprec.Plan("mixed_bfloat16") if policy is None else policy
    found = []
    for op in mixprec.explain(fn, *args, policy=policy).find("dot_general"):
        assert op.site is not None, op
        found.append((op.site, op.backward))
    return found


_NNX_LAYERS = [f"blocks/{i}/{p}" for i in range(3) for p in ("up", "down")] + ["head"]
_EQX_LAYERS = ["layers/0", "layers/1", "layers/2"]


def test_nnx_sites_are_named_by_the_parameters_they_read():
    from flax import nnx

    loss, model = _nnx_blocks()
    x, y = batch()
    sites = _sites(nnx.grad(loss), model, x, y)
    forward = [s for s, back in sites if not back]
    assert forward == [(ly, "dot_general", 0) for ly in _NNX_LAYERS]
    # every gradient product follows a forward site of the same layer
    assert {s for s, back in sites if back} <= set(forward)
    assert len(sites) == 7 + 2 * 7 - 1  # (the first layer's input gradient: none)


def test_equinox_sites_are_named_by_the_parameters_they_read():
    eqx = pytest.importorskip("equinox")
    loss, model = equinox_mlp()
    x, y = batch()
    sites = _sites(eqx.filter_grad(loss), model, x, y)
    forward = [s for s, back in sites if not back]
    assert forward == [(ly, "dot_general", 0) for ly in _EQX_LAYERS]
    assert {s for s, back in sites if back} <= set(forward)


def test_a_plain_function_names_its_sites_by_its_parameters_keys():
    # No scope: the keys of the parameters' dict name the layers; a leaf at
    # the top of an argument (`x`) has no path and names nothing.
    def loss(p, x):
        h = jnp.tanh(x @ p["enc"]["kernel"])
        return jnp.mean((h @ p["out"]) ** 2)

    p = {"enc": {"kernel": jnp.ones((8, 8)) / 8}, "out": jnp.ones((8, 8)) / 8}
    sites = _sites(jax.grad(loss), p, jnp.ones((4, 8)))
    assert [s for s, back in sites if not back] == [
        ("enc", "dot_general", 0),
        ("out", "dot_general", 0),
    ]


def _nnx_step(loss):
    from flax import nnx

    def step(model, opt, x, y):
        value, grads = nnx.value_and_grad(loss)(model, x, y)
        opt.update(model, grads)
        return value

    return step


def test_the_whole_step_has_the_sites_of_its_loss():
    from flax import nnx

    loss, model = _nnx_blocks()
    x, y = batch()
    opt = nnx.Optimizer(nnx.clone(model), optax.sgd(0.1), wrt=nnx.Param)
    alone = _sites(nnx.grad(loss), model, x, y)
    whole = _sites(_nnx_step(loss), nnx.clone(model), opt, x, y)
    assert sorted(whole) == sorted(alone)
    # the functional way: nnx.split, the state as the argument
    graphdef, state = nnx.split(model)

    def split_loss(state, x, y):
        return loss(nnx.merge(graphdef, state), x, y)

    split = _sites(jax.grad(split_loss), state, x, y)
    assert sorted(split) == sorted(alone)


def test_the_whole_equinox_step_has_the_sites_of_its_loss():
    eqx = pytest.importorskip("equinox")
    loss, model = equinox_mlp()
    x, y = batch()
    tx = optax.sgd(0.1)

    def step(model, state, x, y):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, state = tx.update(grads, state)
        return eqx.apply_updates(model, updates), state, value

    state = tx.init(eqx.filter(model, eqx.is_array))
    alone = _sites(eqx.filter_grad(loss), model, x, y)
    whole = _sites(step, model, state, x, y)
    assert sorted(whole) == sorted(alone)


# A rules-only plan file over the parameter paths, as a user writes it: the
# middle block and the head in float32, the other blocks in float8.
_NNX_FILE = {
    "format": 1,
    "base": "mixed_bfloat16",
    "rules": [
        {"layers": "blocks/1/.*|head", "policy": "float32"},
        {"layers": "blocks/.*", "ops": ["dot_general"], "policy": "mixed_float8"},
    ],
}
_EQX_FILE = {
    "format": 1,
    "base": "mixed_bfloat16",
    "rules": [
        {"layers": "layers/2", "policy": "float32"},
        {"layers": "layers/[01]", "policy": "mixed_float8"},
    ],
}


@pytest.mark.parametrize("library", ["nnx", "equinox"])
def test_a_rules_only_file_targets_the_layers_its_regexes_name(library, tmp_path):
    if library == "nnx":
        from flax import nnx

        loss, model = _nnx_blocks()
        grad, doc, wide = nnx.grad, _NNX_FILE, re.compile("blocks/1/.*|head")
    else:
        eqx = pytest.importorskip("equinox")
        loss, model = equinox_mlp()
        grad, doc, wide = eqx.filter_grad, _EQX_FILE, re.compile("layers/2")
    x, y = batch()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc, indent=2))
    plan = mixprec.Plan.load(path)
    fn = grad(loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWarning)  # every rule matches
        ops = mixprec.explain(fn, model, x, y, policy=plan).find("dot_general")
    assert ops
    for op in ops:
        assert op.site is not None
        if wide.fullmatch(op.site[0]):
            assert op.decision == "float32" and op.in_dtypes == ("float32",) * 2, op
        else:
            assert op.decision == "float8", op
            want = ("float8_e5m2" if op.backward else "float8_e4m3fn", "float8_e4m3fn")
            assert op.in_dtypes == want, op
    explained = sorted(tuple(_HLO[t] for t in op.in_dtypes) for op in ops)
    assert sorted(hlo_dots(mixprec.autocast(fn, plan), model, x, y)) == explained
    g = jax.jit(mixprec.autocast(fn, plan))(model, x, y)
    leaves = [a for a in jax.tree.leaves(g) if isinstance(a, jax.Array)]
    assert_tree_dtypes(leaves, jnp.float32)
    assert all(np.isfinite(np.asarray(a)).all() for a in leaves)


def test_a_rule_that_names_no_parameter_path_warns_with_the_closest():
    loss, model = _nnx_blocks()
    x, y = batch()
    plan = mixprec.Plan.from_dict(
        {
            "format": 1,
            "base": "mixed_bfloat16",
            "rules": [{"layers": "heads", "policy": "float32"}],
        }
    )
    with pytest.warns(PlanWarning, match=r"rules\[0\].*closest layer paths: 'head'"):
        mixprec.autocast(loss, plan)(model, x, y)


def test_a_measured_nnx_plan_names_its_sites_by_parameter_path(tmp_path):
    loss, model = _nnx_blocks(n=1)
    x, y = batch()
    plan = mixprec.plan(loss, model, x, y, candidates=("mixed_bfloat16", "float32"))
    assert [s.layer for s in plan.sites] == ["blocks/0/up", "blocks/0/down", "head"]
    assert "blocks/0/up" in str(plan)
    plan.save(tmp_path / "plan.json")
    assert mixprec.Plan.load(tmp_path / "plan.json").sites == plan.sites


# ------------------------------------------- name stacks keep their names


def test_linen_and_haiku_sites_keep_their_module_paths():
    nn = pytest.importorskip("flax.linen")
    hk = pytest.importorskip("haiku")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D, name="b")(jnp.tanh(nn.Dense(D, name="a")(x)))

    x, y = batch(8)
    params = Net().init(jax.random.key(0), x)

    def linen_loss(p, x):
        return jnp.mean(Net().apply(p, x) ** 2)

    sites = _sites(jax.grad(linen_loss), params, x)
    assert {s[0] for s, _ in sites} == {"Net/a", "Net/b"}

    net = hk.without_apply_rng(
        hk.transform(lambda x: hk.nets.MLP([D, D], name="mlp")(x))
    )
    hparams = net.init(jax.random.key(0), x)

    def haiku_loss(p, x):
        return jnp.mean(net.apply(p, x) ** 2)

    sites = _sites(jax.grad(haiku_loss), hparams, x)
    assert {s[0] for s, _ in sites} == {"mlp/linear_0", "mlp/linear_1"}


def test_a_named_scope_wins_over_the_parameter_path():
    from flax import nnx

    loss, model = _nnx_blocks(n=1)

    def scoped(model, x, y):
        with jax.named_scope("net"):
            return loss(model, x, y)

    x, y = batch(8)
    sites = _sites(nnx.grad(scoped), model, x, y)
    assert [s for s, back in sites if not back] == [
        ("net", "dot_general", i) for i in range(3)
    ]


def test_a_scanned_nnx_stack_is_one_site_per_parameter_of_its_body():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.up(x))

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Block(nnx.Rngs(key))

    class Net(nnx.Module):
        def __init__(self):
            self.blocks = make(jax.random.split(jax.random.key(0), 3))
            self.head = nnx.Linear(D, D, rngs=nnx.Rngs(1))

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return block(x)

            return self.head(body(x, self.blocks))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    x, _ = batch(8)
    sites = _sites(nnx.grad(loss), Net(), x)
    assert {s for s, _ in sites} == {
        ("blocks/up", "dot_general", 0),
        ("head", "dot_general", 0),
    }
    assert len(sites) == 2 + 4
