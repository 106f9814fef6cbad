"""Precision plans: the data model, its file, applying it where autocast gives
equations their policy, and `mixprec.plan` measuring and choosing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixprec
from mixprec._src.autocast.walk import PlanWarning
from mixprec._src.numerics import plan as planner
from mixprec._src.plan import Rule, Site


def _mlp_loss(w, x, y):
    with jax.named_scope("l0"):
        h = jnp.tanh(x @ w["a"])
    # a few massive channels where `gain` says so (a constant, not trained)
    h = h * jax.lax.stop_gradient(w["gain"])[None, :]
    with jax.named_scope("l1"):
        h = jnp.tanh(h @ w["b"])
    with jax.named_scope("l2"):
        out = h @ w["c"]
    return jnp.mean((out - y) ** 2)


def _mlp(ratio=1.0, d=256):
    k = jax.random.split(jax.random.key(0), 5)
    gain = jnp.ones(d).at[:2].set(ratio)
    w = {
        "a": jax.random.normal(k[0], (d, d)) / 16,
        # the weights that read the massive channels are scaled down, so
        # that the layer's output is of order one (as a trained one is)
        "b": (jax.random.normal(k[1], (d, d)) / 16).at[:2].multiply(1 / ratio),
        "c": jax.random.normal(k[2], (d, d)) / 16,
        "gain": gain,
    }
    x = jax.random.normal(k[3], (128, d))
    y = jax.random.normal(k[4], (128, d))
    return w, x, y


def _policies(plan):
    return {s.layer: s.policy for s in plan.sites}


def _dot_dtypes(fn, *args, policy):
    report = mixprec.explain(fn, *args, policy=policy)
    return [
        (op.layer, op.backward, op.decision, op.in_dtypes)
        for op in report.find("dot_general")
    ]


# ------------------------------------------------------------------ the file


def test_save_load_round_trip_gives_the_identical_program(tmp_path):
    w, x, y = _mlp()
    plan = mixprec.Plan(
        "mixed_bfloat16",
        sites=(
            Site("l0", "dot_general", 0, "mixed_float8", chosen="mixed_float8"),
            Site("l1", "dot_general", 0, "float32", chosen="mixed_bfloat16"),
        ),
        rules=(Rule("l2", ("dot_general",), "mixed_float8"),),
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == 1
    assert data["sites"][1] == {
        "layer": "l1",
        "op": "dot_general",
        "index": 0,
        "policy": "float32",
        "chosen": "mixed_bfloat16",
    }
    loaded = mixprec.Plan.load(path)
    assert loaded == plan
    assert loaded.sites[1].overridden and not loaded.sites[0].overridden

    def step(w):
        return jax.grad(mixprec.autocast(_mlp_loss, loaded))(w, x, y)

    def step_orig(w):
        return jax.grad(mixprec.autocast(_mlp_loss, plan))(w, x, y)

    assert str(jax.make_jaxpr(step)(w)) == str(jax.make_jaxpr(step_orig)(w))
    a, b = jax.jit(step)(w), jax.jit(step_orig)(w)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.dtype == v.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_a_measured_plan_saves_and_loads_to_an_equal_plan(tmp_path):
    w, x, y = _mlp()
    plan = mixprec.plan(_mlp_loss, w, x, y, candidates=("mixed_bfloat16", "float32"))
    plan.save(tmp_path / "p.json")
    assert mixprec.Plan.load(tmp_path / "p.json") == plan


def test_rules_first_match_wins_and_sites_come_before_rules():
    w, x, y = _mlp()
    plan = mixprec.Plan.from_dict(
        {
            "format": 1,
            "base": "mixed_bfloat16",
            "sites": [
                {"layer": "l0", "op": "dot_general", "index": 0, "policy": "float32"}
            ],
            "rules": [
                {"layers": "l[01]", "policy": "mixed_float8"},
                {"layers": "l.*", "ops": ["dot_general"], "policy": "float32"},
            ],
        }
    )
    assert str(plan.policy_for("l0", "dot_general", 0)) == "p=f32,c=f32,o=f32"
    assert plan.policy_for("l1", "dot_general", 0).float8 is not None
    assert str(plan.policy_for("l2", "dot_general", 0)) == "p=f32,c=f32,o=f32"
    assert plan.policy_for("other", "dot_general", 0) == plan.base
    fwd = [r for r in _dot_dtypes(_mlp_loss, w, x, y, policy=plan) if not r[1]]
    assert [(layer, dtypes) for layer, _, _, dtypes in fwd] == [
        ("l0", ("float32", "float32")),
        ("l1", ("float8_e4m3fn", "float8_e4m3fn")),
        ("l2", ("float32", "float32")),
    ]


def test_rule_regex_matches_the_whole_layer_path():
    rule = Rule("l1", (), "float32")
    assert rule.matches("l1", "dot_general")
    assert not rule.matches("l10", "dot_general")
    assert not rule.matches("net/l1", "dot_general")


@pytest.mark.parametrize(
    "data, match",
    [
        ({"base": "mixed_bfloat16"}, "field 'format' must be 1"),
        ({"format": 1}, "missing field 'base'"),
        ({"format": 1, "base": "mixed_bfloat61"}, "field 'base': unknown policy"),
        (
            {
                "format": 1,
                "base": "float32",
                "rules": [{"layers": "x", "policy": "f9"}],
            },
            r"rules\[0\], field 'policy': unknown policy 'f9'",
        ),
        (
            {
                "format": 1,
                "base": "float32",
                "rules": [{"layer": "x", "policy": "f32"}],
            },
            r"rules\[0\]: unknown field 'layer'. Did you mean 'layers'",
        ),
        (
            {
                "format": 1,
                "base": "float32",
                "rules": [{"layers": "(", "policy": "f32"}],
            },
            r"rules\[0\]: field 'layers' is not a regular expression",
        ),
        (
            {
                "format": 1,
                "base": "float32",
                "rules": [{"layers": "x", "ops": ["exp"], "policy": "float32"}],
            },
            r"rules\[0\]: field 'ops' names 'exp', which is not a matmul-like op",
        ),
        (
            {
                "format": 1,
                "base": "float32",
                "sites": [{"layer": "x", "op": "dot_general", "policy": "float32"}],
            },
            r"sites\[0\]: missing field 'index'",
        ),
        (
            {
                "format": 1,
                "base": "float32",
                "sites": [
                    {"layer": "x", "op": "dot_general", "index": 0, "policy": "f32"}
                ]
                * 2,
            },
            "listed twice",
        ),
    ],
)
def test_malformed_plans_name_the_entry_and_the_field(data, match):
    with pytest.raises(ValueError, match=match):
        mixprec.Plan.from_dict(data)


def test_a_file_that_is_not_json_is_an_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{format: 1")
    with pytest.raises(ValueError, match="not JSON"):
        mixprec.Plan.load(path)


def test_a_rule_that_matches_no_site_warns_with_the_closest_layers():
    w, x, y = _mlp()
    plan = mixprec.Plan(
        "mixed_bfloat16", rules=(Rule("l3", ("dot_general",), "float32"),)
    )
    with pytest.warns(PlanWarning, match=r"rules\[0\] \('l3'.*closest layer paths: 'l"):
        mixprec.autocast(_mlp_loss, plan)(w, x, y)


# ------------------------------------------------------------------ applying


def test_backward_products_follow_their_forward_site_in_a_whole_step():
    w, x, y = _mlp()
    plan = mixprec.Plan(
        "mixed_bfloat16", sites=(Site("l1", "dot_general", 0, "float32"),)
    )

    def train_step(w, x, y):
        g = jax.grad(_mlp_loss)(w, x, y)
        return jax.tree.map(lambda p, d: p - 0.1 * d, w, g)

    report = mixprec.explain(train_step, w, x, y, policy=plan)
    dots = report.find("dot_general")
    assert len(dots) == 3 + 5  # 3 forward, 2 + 2 + 1 backward
    for op in dots:
        assert op.site is not None and op.site[:2] == (op.layer, "dot_general")
        want = "float32" if op.layer == "l1" else "bfloat16"
        assert op.in_dtypes[1] == want, op
    out = jax.jit(mixprec.autocast(train_step, plan))(w, x, y)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(out))


def test_explain_reports_exactly_what_runs():
    w, x, y = _mlp()
    plan = mixprec.Plan(
        "mixed_float8", sites=(Site("l0", "dot_general", 0, "float32"),)
    )
    fn = jax.grad(_mlp_loss)
    report = mixprec.explain(fn, w, x, y, policy=plan)
    jaxpr = jax.make_jaxpr(mixprec.autocast(fn, plan))(w, x, y)
    assert str(report.jaxpr) == str(jaxpr)
    f8 = {op.layer for op in report.find("dot_general") if op.decision == "float8"}
    assert f8 == {"l1", "l2"}
    assert all("plan: policy" in op.reason for op in report.find("dot_general"))


def test_a_region_written_in_the_code_wins_over_the_plan():
    def f(x, w):
        with mixprec.float32_scope(), jax.named_scope("kept"):
            a = x @ w
        with mixprec.precision_scope("mixed_bfloat16"), jax.named_scope("scoped"):
            b = a @ w
        return b

    x = jnp.ones((4, 8))
    plan = mixprec.Plan("float32", rules=(Rule(".*", (), "mixed_float16"),))
    ops = mixprec.explain(f, x, jnp.ones((8, 8)), policy=plan).find("dot_general")
    assert [op.in_dtypes[0] for op in ops] == ["float32", "bfloat16"]


def test_scan_body_is_one_site_for_every_iteration_and_its_backward():
    def loss(ws, x):
        def body(h, w):
            with jax.named_scope("layer"):
                return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(body, x, ws)
        return jnp.mean(h)

    ws, x = jnp.ones((3, 32, 32)) / 32, jnp.ones((8, 32))
    plan = mixprec.Plan(
        "mixed_bfloat16", sites=(Site("layer", "dot_general", 0, "float32"),)
    )
    ops = mixprec.explain(jax.grad(loss), ws, x, policy=plan).find("dot_general")
    assert ops and all(op.in_dtypes == ("float32", "float32") for op in ops)
    assert {op.site for op in ops if not op.backward} == {("layer", "dot_general", 0)}
    g = jax.jit(jax.grad(mixprec.autocast(loss, plan)))(ws, x)
    ref = jax.grad(loss)(ws, x)
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)
    assert g.dtype == jnp.float32


def test_the_fused_attention_decision_reads_the_plan():
    def attn(q, k, v):
        with jax.named_scope("attn"):
            s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
            return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 16, 4, 64))

    def products(plan):
        report = mixprec.explain(attn, q, k, v, policy=plan)
        return [
            (op.primitive, op.decision)
            for op in report.ops
            if op.primitive in ("dot_product_attention", "dot_general")
        ]

    assert products(mixprec.Plan("mixed_bfloat16")) == [
        ("dot_product_attention", "low")
    ]
    # jnp.einsum names its spec in the name stack: the layer paths are
    # "attn/bthd,bshd->bhts" and "attn/bhts,bshd->bthd".
    keep = mixprec.Plan("mixed_bfloat16", rules=(Rule("attn/.*", (), "float32"),))
    assert products(keep) == [("dot_general", "float32"), ("dot_general", "float32")]


def test_the_cuda_export_runs_float8_gemms_where_the_plan_says():
    import re

    from helpers import executed_lines

    w, x, y = _mlp()
    plan = mixprec.Plan(
        "mixed_bfloat16",
        sites=(
            Site("l0", "dot_general", 0, "mixed_float8"),
            Site("l2", "dot_general", 0, "mixed_float8"),
        ),
    )
    step = jax.jit(jax.grad(mixprec.autocast(_mlp_loss, plan)))
    text = jax.export.export(step, platforms=["cuda"])(w, x, y).mlir_module()
    dots = []
    for line in executed_lines(text):
        if "stablehlo.dot_general" in line:
            ins = line.rsplit(" : ", 1)[1].split(" -> ")[0]
            dots.append(tuple(re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", ins)))
    f8 = [d for d in dots if any(t.startswith("f8") for t in d)]
    # l0: its forward dot and its weight gradient (x needs no gradient);
    # l2: forward and two gradients. l1 (bfloat16): three dots in bf16.
    assert len(f8) == 5 and len(dots) == 8, dots
    assert sum(d == ("bf16", "bf16") for d in dots) == 3, dots


def test_composes_with_jit_grad_vmap_and_remat():
    w, x, y = _mlp(d=32)
    plan = mixprec.Plan(
        "mixed_bfloat16", sites=(Site("l2", "dot_general", 0, "float32"),)
    )
    loss = jax.checkpoint(_mlp_loss)
    g = jax.jit(jax.grad(mixprec.autocast(loss, plan)))(w, x, y)
    ref = jax.grad(_mlp_loss)(w, x, y)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=0.1, atol=2e-3)
    per = jax.vmap(mixprec.autocast(_mlp_loss, plan), in_axes=(None, 0, 0))
    out = per(w, x.reshape(4, 32, 32), y.reshape(4, 32, 32))
    assert out.shape == (4,) and out.dtype == jnp.float32
    ops = mixprec.explain(jax.grad(loss), w, x, y, policy=plan).find("dot_general")
    # l2's products alone run float32: gradients and the recomputed forward
    # (which follows its forward site); the forward itself is used nowhere
    # under `jax.grad` (the loss value is dropped): XLA removes it, and
    # explain does not list it
    f32 = {op.site for op in ops if op.in_dtypes[1] == "float32"}
    assert f32 == {("l2", "dot_general", 0)}
    assert sum(op.in_dtypes[1] == "float32" for op in ops) == 3
    assert all(op.backward for op in ops)


def test_flax_linen_sites_are_module_paths():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jax.nn.relu(nn.Dense(64, name="a")(x))
            return nn.Dense(16, name="b")(x)

    net = Net()
    x = jnp.ones((8, 32))
    params = net.init(jax.random.key(0), x)

    def loss(p, x):
        return jnp.mean(net.apply(p, x) ** 2)

    plan = mixprec.Plan.from_dict(
        {
            "format": 1,
            "base": "mixed_bfloat16",
            "rules": [{"layers": "Net/b", "policy": "float32"}],
        }
    )
    ops = mixprec.explain(jax.grad(loss), params, x, policy=plan).find("dot_general")
    assert {op.site and op.site[0] for op in ops} == {"Net/a", "Net/b"}
    for op in ops:
        assert op.in_dtypes[1] == ("float32" if op.layer == "Net/b" else "bfloat16")
    g = jax.jit(jax.grad(mixprec.autocast(loss, plan)))(params, x)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(g))


def test_float16_plan_with_loss_scaling():
    w, x, y = _mlp(d=32)
    plan = mixprec.Plan(
        "mixed_float16", sites=(Site("l1", "dot_general", 0, "float32"),)
    )
    vg = mixprec.value_and_grad(mixprec.autocast(_mlp_loss, plan))
    loss, grads, finite = vg(w, x, y, loss_scale=mixprec.StaticLossScale(2.0**10))
    assert bool(finite) and loss.dtype == jnp.float32
    ref = jax.grad(_mlp_loss)(w, x, y)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=0.05, atol=1e-3)


def test_on_eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    w, x, y = _mlp(d=32)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    shard = jax.NamedSharding(mesh, jax.P("data"))
    xs, ys = jax.device_put(x, shard), jax.device_put(y, shard)
    plan = mixprec.Plan(
        "mixed_bfloat16", sites=(Site("l1", "dot_general", 0, "float32"),)
    )
    step = jax.jit(jax.grad(mixprec.autocast(_mlp_loss, plan)))
    g8, g1 = step(w, xs, ys), step(w, x, y)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ choosing


def test_well_scaled_sites_get_the_cheapest_candidate():
    w, x, y = _mlp()
    plan = mixprec.plan(_mlp_loss, w, x, y)
    assert _policies(plan) == {
        "l0": "mixed_float8",
        "l1": "mixed_float8",
        "l2": "mixed_float8",
    }
    for s in plan.sites:
        m = s.measurements()
        assert m["mixed_float8"]["effect"] <= planner.DEFAULT_TOLERANCE
        assert m["mixed_bfloat16"]["effect"] < m["mixed_float8"]["effect"]
        assert m["float32"]["effect"] == 0.0
        assert s.flops == 2 * 128 * 256 * 256


@pytest.mark.parametrize("ratio", [1e5, 1e6])
def test_massive_activations_keep_their_layer_out_of_float8(ratio):
    w, x, y = _mlp(ratio)
    plan = mixprec.plan(_mlp_loss, w, x, y)
    assert _policies(plan) == {
        "l0": "mixed_float8",
        "l1": "mixed_bfloat16",
        "l2": "mixed_float8",
    }
    assert plan.sites[1].measurements()["mixed_float8"]["effect"] > plan.tolerance
    text = str(plan)
    assert "FLOPs by dtype: bfloat16 33.3%, float8 66.7%" in text
    assert "vs all-bfloat16 on h100: 1.39x" in text


def test_a_site_every_candidate_but_float32_breaks_gets_float32():
    # 1e6 overflows float16 (largest 65504) and ruins tensorwise float8.
    w, x, y = _mlp(1e6)
    plan = mixprec.plan(
        _mlp_loss, w, x, y, candidates=("mixed_float8", "mixed_float16", "float32")
    )
    assert _policies(plan) == {
        "l0": "mixed_float8",
        "l1": "float32",
        "l2": "mixed_float8",
    }
    m = plan.sites[1].measurements()
    assert m["mixed_float16"]["effect"] is None or m["mixed_float16"]["overflow"] > 0


@pytest.mark.parametrize(
    "platform, want", [("h100", "mixed_float16"), ("cpu", "float32")]
)
def test_plan_with_float16_candidates_and_a_loss_scale(platform, want):
    w, x, y = _mlp(d=128)
    plan = mixprec.plan(
        _mlp_loss,
        w,
        x,
        y,
        candidates=("mixed_float16", "float32"),
        loss_scale=2.0**12,
        platform=platform,
    )
    # On the CPU's table float16 costs float32's (not native): the tie goes
    # to the wider one.
    assert set(_policies(plan).values()) == {want}
    for s in plan.sites:
        assert s.measurements()["mixed_float16"]["effect"] < 1e-2


def test_plan_errors_name_the_argument():
    w, x, y = _mlp(d=16)
    with pytest.raises(ValueError, match=r"candidates=.*unknown policy 'mixed_f9'"):
        mixprec.plan(_mlp_loss, w, x, y, candidates=("mixed_f9",))
    with pytest.raises(ValueError, match="platform=.*'tpu9'"):
        mixprec.plan(_mlp_loss, w, x, y, platform="tpu9")
    with pytest.raises(ValueError, match="tolerance=.*positive"):
        mixprec.plan(_mlp_loss, w, x, y, tolerance=0)


def test_speedup_and_shares_follow_the_throughput_table():
    sites = (
        Site("a", "dot_general", 0, "mixed_float8", flops=100),
        Site("b", "dot_general", 0, "float32", flops=100),
    )
    plan = mixprec.Plan("mixed_bfloat16", sites=sites, platform="h100")
    t = planner.THROUGHPUT["h100"]
    want = (200 / t["bfloat16"]) / (100 / t["float8"] + 100 / t["float32"])
    assert planner.speedup(plan) == pytest.approx(want)
    assert planner.flop_shares(plan) == {"float8": 0.5, "float32": 0.5}


# ------------------------------------------------------------------ diagnose


@pytest.mark.parametrize(
    "policy, raised",
    [("mixed_float8", "p=f32,c=bf16,o=f32"), ("mixed_float16", "p=f32,c=f32,o=f32")],
)
def test_diagnose_suggests_a_plan_that_raises_only_the_broken_site(policy, raised):
    # 1e6: tensorwise float8 flushes the rest of the layer's input to zero,
    # float16 overflows.
    w, x, y = _mlp(1e6)
    report = mixprec.diagnose(jax.grad(_mlp_loss), w, x, y, policy=policy)
    plan = report.suggested_plan
    kept = str(mixprec.get_policy(policy))
    assert _policies(plan) == {"l0": kept, "l1": raised, "l2": kept}
    assert report.plan_verified is True
    assert report.to_dict()["suggested_plan"]["sites"][1]["policy"] == raised
    g = jax.grad(mixprec.autocast(_mlp_loss, plan))(w, x, y)
    finite = all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(g))
    if policy == "mixed_float8":
        assert finite
    else:
        # A plan raises matmuls only: the float16 `mul` by 1e6 before the
        # layer still overflows (diagnose's other advice is for that).
        assert "mul" in {op.primitive for op in report.problems} and not finite


def test_diagnose_of_a_clean_program_keeps_every_site():
    w, x, y = _mlp()
    report = mixprec.diagnose(_mlp_loss, w, x, y, policy="mixed_bfloat16")
    assert set(_policies(report.suggested_plan).values()) == {"p=f32,c=bf16,o=f32"}
    assert report.plan_verified is True


def test_explain_names_each_products_site_without_a_plan():
    w, x, y = _mlp(d=32)
    ops = mixprec.explain(jax.grad(_mlp_loss), w, x, y, policy="mixed_bfloat16")
    sites = {op.site for op in ops.find("dot_general")}
    assert sites == {
        ("l0", "dot_general", 0),
        ("l1", "dot_general", 0),
        ("l2", "dot_general", 0),
    }
    assert all(op.site is None for op in ops.ops if op.primitive != "dot_general")


# ------------------------------------------------------------------ command line

_TARGET = """
import jax, jax.numpy as jnp


def loss(w, x):
    with jax.named_scope("hidden"):
        h = jnp.tanh(x @ w["a"])
    with jax.named_scope("out"):
        return jnp.mean((h @ w["b"]) ** 2)


def loss_example_args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = {"a": jax.random.normal(k1, (128, 128)) / 11,
         "b": jax.random.normal(k2, (128, 128)) / 11}
    return w, jax.random.normal(k3, (128, 128))
"""


def _cli(capsys, argv):
    from mixprec._src.cli.main import main

    status = main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


def test_cli_plan_writes_a_plan_that_inspect_and_diagnose_take(capsys, tmp_path):
    target = tmp_path / "model.py"
    target.write_text(_TARGET)
    out_file = tmp_path / "plan.json"
    status, out, err = _cli(
        capsys,
        ["plan", f"{target}:loss", "-o", str(out_file), "--platform", "cpu"],
    )
    assert status == 0, err
    assert "hidden" in out and f"wrote {out_file}" in out
    plan = mixprec.Plan.load(out_file)
    assert plan.platform == "cpu" and len(plan.sites) == 2
    edited = plan.with_site_policy("out", "dot_general", 0, "float32")
    edited.save(out_file)
    status, out, err = _cli(
        capsys, ["inspect", f"{target}:loss", "--plan", str(out_file), "--json"]
    )
    assert status == 0, err
    ops = [op for op in json.loads(out)["ops"] if op["primitive"] == "dot_general"]
    # (On the CPU's table float8, emulated, costs bfloat16's: the tie goes to
    # the wider bfloat16.)
    assert [op["in_dtypes"][1] for op in ops] == ["bfloat16", "float32"]
    status, out, err = _cli(
        capsys, ["diagnose", f"{target}:loss", "--plan", str(out_file), "--json"]
    )
    assert status == 0, err
    assert (
        json.loads(out)["suggested_plan"]["sites"][1]["policy"] == "p=f32,c=f32,o=f32"
    )


def test_cli_plan_flags_are_checked(capsys, tmp_path):
    target = tmp_path / "model.py"
    target.write_text(_TARGET)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1, "base": "mixed_f9"}')
    status, _, err = _cli(capsys, ["inspect", f"{target}:loss", "--plan", str(bad)])
    assert status == 2 and "--plan" in err and "unknown policy 'mixed_f9'" in err
    status, _, err = _cli(capsys, ["plan", f"{target}:loss", "--platform", "tpu9"])
    assert status == 2 and "--platform" in err and "h100" in err
    status, _, err = _cli(
        capsys, ["plan", f"{target}:loss", "--candidates", "mixed_f9"]
    )
    assert status == 2 and "--candidates" in err


@pytest.mark.long  # minutes on two cores: mixprec.plan over a 13-site LM
def test_example_plan_float8_keeps_the_massive_head_out_of_float8(capsys):
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parent.parent / "examples/plan_float8.py"
    module = runpy.run_path(str(path))
    with jax.numpy_rank_promotion("allow"):
        assert module["main"]([]) == 0
    assert "head: mixed_bfloat16" in capsys.readouterr().out
