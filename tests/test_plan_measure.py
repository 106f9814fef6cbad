"""How `mixprec.plan` measures: one compiled program for every site and
candidate, equal to the per-site programs it replaces, and the check of the
chosen sites together."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixprec
from mixprec._src.autocast.api import autocast
from mixprec._src.numerics import plan as planner
from mixprec._src.plan import Plan, Site
from mixprec._src.policy import get_policy


_MODE = "allow_mix_precision"


def _scan_loss(w, x, y):
    """Named layers, a massive-channel product and a `lax.scan` body."""
    with jax.named_scope("embed"):
        h = jnp.tanh(x @ w["a"])
    h = h * jax.lax.stop_gradient(w["gain"])[None, :]
    with jax.named_scope("reader"):
        h = jnp.tanh(h @ w["b"])

    def body(h, wl):
        with jax.named_scope("stack"):
            return jnp.tanh(h @ wl) + h, None

    h, _ = jax.lax.scan(body, h, w["stack"])
    with jax.named_scope("head"):
        out = h @ w["c"]
    return jnp.mean((out - y) ** 2)


def _scan_args(d=256):
    k = jax.random.split(jax.random.key(1), 6)
    w = {
        "a": jax.random.normal(k[0], (d, d)) / 16,
        "b": (jax.random.normal(k[1], (d, d)) / 16).at[:2].multiply(1e-5),
        "c": jax.random.normal(k[2], (d, d)) / 16,
        "stack": jax.random.normal(k[3], (3, d, d)) / 32,
        "gain": jnp.ones(d).at[:2].set(1e5),
    }
    return w, jax.random.normal(k[4], (128, d)), jax.random.normal(k[5], (128, d))


def _keys(fn, *args):
    report = mixprec.explain(fn, *args, policy=Plan("float32"))
    return list(
        dict.fromkeys(
            (op.site[0], op.site[1], int(op.site[2]))
            for op in report.ops
            if op.site is not None and not op.backward and op.site[2] is not None
        )
    )


def _assert_float32_equal(got, want, what):
    """Bitwise with XLA's optimizing compile (JAX's default, the one
    `mixprec.plan` runs under). The suite compiles with LLVM's optimizer off
    (`conftest.py`), which orders some float32 sums differently in the two
    programs (measured: 3.9e-7 of a gradient leaf's largest value, the
    all-float32 choice against the plain float32 program), and a candidate
    that rounds such a value to 16 bits can turn it into one 16-bit ulp
    (measured: 5e-5)."""
    (loss, grads), (want_loss, want_grads) = got, want
    if not jax.config.read("jax_disable_most_optimizations"):
        np.testing.assert_array_equal(loss, want_loss, err_msg=what)
        for g, w in zip(grads, want_grads, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=what)
        return
    np.testing.assert_allclose(loss, want_loss, rtol=4 * 2**-23, err_msg=what)
    for g, w in zip(grads, want_grads, strict=True):
        scale = float(np.abs(w).max()) if np.isfinite(w).all() else 1.0
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-4 * scale, err_msg=what)


@pytest.mark.parametrize(
    "candidates",
    [("mixed_float8", "mixed_bfloat16", "float32"), ("mixed_float16", "float32")],
)
def test_one_program_measures_what_each_per_site_program_computes(candidates):
    """Each site alone at each candidate, selected by an argument of one
    compiled program, gives the loss and gradients of the program compiled
    with that site alone at that candidate: the same formulation (casts,
    float8 recipe, scales), so equal up to float32 rounding (XLA orders a
    float32 sum differently in the two programs: measured, 4e-7 of a
    gradient leaf's largest value with the scan body in it), and the effect
    `mixprec.plan` takes from it equal to 1e-5."""
    args = _scan_args()
    keys = _keys(_scan_loss, *args)
    assert [k[0] for k in keys] == ["embed", "reader", "stack", "head"]
    names = list(candidates)
    alone = planner._switched(_scan_loss, keys, names, "float32", 0, None, _MODE)
    for i, key in enumerate(keys):
        for c in names:
            choice = ["float32"] * len(keys)
            choice[i] = c
            loss, grads = alone(choice, *args)
            plan = Plan(get_policy("float32"), sites=(Site(*key, policy=c),))
            fn = planner._value_and_grad(autocast(_scan_loss, plan), 0, None)
            want_loss, want_grads = fn(*args)
            _assert_float32_equal((loss, grads), (want_loss, want_grads), f"{key} {c}")
            ref = alone(["float32"] * len(keys), *args)
            ref32 = planner._value_and_grad(_scan_loss, 0, None)(*args)
            got = planner._effects(ref, (loss, grads))
            want = planner._effects(ref32, (want_loss, want_grads))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    # and what it selects matters: the massive-channel site moves the
    # gradients in float8, the float32 choice is the float32 program
    f8 = ["float32", "mixed_float8", "float32", "float32"]
    ref = alone(["float32"] * 4, *args)
    if "mixed_float8" in names:
        assert planner._effects(ref, alone(f8, *args))[1] > 0.15
    else:  # float16 overflows at the massive channels, and only there
        f16 = [c.replace("mixed_float8", "mixed_float16") for c in f8]
        assert planner._effects(ref, alone(f16, *args))[1] == np.inf
        head = ["float32"] * 3 + ["mixed_float16"]
        assert planner._effects(ref, alone(head, *args))[1] < 0.01


def test_several_sites_selected_together_match_their_plan():
    """Any mix of choices, not only one site at a time: the chosen plan's
    sites together in the one program equal that plan compiled."""
    args = _scan_args()
    keys = _keys(_scan_loss, *args)
    names = ["mixed_float8", "mixed_bfloat16", "float32"]
    alone = planner._switched(_scan_loss, keys, names, "float32", 0, None, _MODE)
    choice = ["mixed_float8", "mixed_bfloat16", "mixed_float8", "mixed_bfloat16"]
    loss, grads = alone(choice, *args)
    sites = tuple(Site(*k, policy=c) for k, c in zip(keys, choice, strict=True))
    fn = planner._value_and_grad(
        autocast(_scan_loss, Plan(get_policy("float32"), sites=sites)), 0, None
    )
    _assert_float32_equal((loss, grads), fn(*args), str(choice))


def _chain_loss(w, x):
    """Four products in a chain: their float8 errors meet in every
    gradient."""
    h = x
    for i in range(4):
        with jax.named_scope(f"l{i}"):
            h = jnp.tanh(h @ w[i]) * 1.5
    return jnp.mean(h**2)


def _chain_args(d=256):
    k = jax.random.split(jax.random.key(2), 5)
    w = [jax.random.normal(k[i], (d, d)) / 16 for i in range(4)]
    return w, jax.random.normal(k[4], (128, d))


def test_the_chosen_sites_together_are_checked_and_raised_until_they_pass():
    """Each site alone within the tolerance, all of them together over it:
    the plan raises the sites with the largest own effect until the whole
    passes, and says so."""
    args = _chain_args()
    names = ("mixed_float8", "float32")
    loose = mixprec.plan(_chain_loss, *args, candidates=names, tolerance=10.0)
    combined = dict(loose.combined)
    assert combined["passed"] and combined["raised"] == ()
    own = {s.key: s.measurements()["mixed_float8"]["effect"] for s in loose.sites}
    # the construction: the sites' effects add up
    assert combined["effect"] > 1.2 * max(own.values())
    tolerance = (combined["effect"] + max(own.values())) / 2
    plan = mixprec.plan(_chain_loss, *args, candidates=names, tolerance=tolerance)
    result = dict(plan.combined)
    assert result["first_effect"] == combined["effect"]
    assert result["passed"] and result["effect"] <= tolerance
    raised = [tuple(r[:3]) for r in result["raised"]]
    assert raised, "each site passes alone: only the check together raises one"
    assert raised[0] == max(own, key=own.get)
    by_key = {s.key: s.policy for s in plan.sites}
    assert all(by_key[k] == "float32" for k in raised)
    assert all(by_key[k] == "mixed_float8" for k in own if k not in raised)
    text = str(plan)
    rows = [line for line in text.splitlines() if "(raised)" in line]
    assert [r.split()[0] for r in rows[:-1]] == [k[0] for k in raised]
    assert f"{len(raised)} site(s) were raised" in text
    # the check measured what the plan runs (its sites; the rest float32)
    ref = planner._value_and_grad(_chain_loss, 0, None)(*args)
    at32 = Plan(get_policy("float32"), sites=plan.sites)
    got = planner._value_and_grad(autocast(_chain_loss, at32), 0, None)(*args)
    assert max(planner._effects(ref, got)) == pytest.approx(result["effect"], rel=1e-5)


def test_the_combined_check_survives_the_file(tmp_path):
    args = _chain_args()
    plan = mixprec.plan(_chain_loss, *args, candidates=("mixed_float8", "float32"))
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = mixprec.Plan.load(path)
    assert loaded.combined == plan.combined
    assert loaded == plan
    assert "all sites together" in str(loaded)


def _attn_loss(q, k, v):
    with jax.named_scope("attn"):
        s = jnp.einsum("bthd,bshd->bhts", q, k) / 8.0
        o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
    return jnp.mean(o**2)


def test_one_program_measures_an_attention_as_the_per_site_programs_do():
    """The products autocast may fuse into one attention: each alone at a
    candidate, and both together, as the programs compiled so."""
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 16, 4, 64))
    keys = _keys(_attn_loss, q, k, v)
    assert len(keys) == 2
    names = ["mixed_bfloat16", "float32"]
    alone = planner._switched(
        _attn_loss, keys, names, "float32", (0, 1, 2), None, _MODE
    )
    for choice in (
        ["mixed_bfloat16", "float32"],
        ["float32", "mixed_bfloat16"],
        ["mixed_bfloat16"] * 2,
    ):
        sites = tuple(
            Site(*key, policy=c)
            for key, c in zip(keys, choice, strict=True)
            if c != "float32"
        )
        plan = Plan(get_policy("float32"), sites=sites)
        fn = planner._value_and_grad(autocast(_attn_loss, plan), (0, 1, 2), None)
        _assert_float32_equal(alone(choice, q, k, v), fn(q, k, v), str(choice))
