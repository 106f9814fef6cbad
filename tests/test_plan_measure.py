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


def _alone_diagnosed(fn, args, key, candidate):
    """``diagnose``'s measurements of ``key`` with that site alone at
    ``candidate`` and the rest of the program in float32."""
    plan = Plan(get_policy("float32"), sites=(Site(*key, policy=candidate),))
    report = mixprec.diagnose(fn, *args, policy=plan, refine=False)
    found = [op for op in report.ops if op.site == key and not op.backward]
    assert found, (key, candidate)
    return {
        "op_error": max(op.local_rel_error for op in found),
        **{
            name: sum(int(getattr(op, name)) for op in found)
            for name in ("overflow", "underflow", "nonfinite", "flushed", "quantized")
        },
    }


@pytest.mark.parametrize(
    "candidates",
    [("mixed_float8", "mixed_bfloat16", "float32"), ("mixed_float16", "float32")],
)
def test_the_reference_run_measures_each_op_as_diagnose_does(candidates):
    """The one program's float32 run hands each site's float32 operands and
    every candidate's result to the host, which measures them with
    diagnose's own arithmetic: the numbers are diagnose's for that site alone
    at the candidate (the rest in float32), a `scan` body's summed over its
    iterations. The reader's float32 operand holds 1e5: it flushes values in
    tensorwise float8 and overflows float16."""
    args = _scan_args()
    keys = _keys(_scan_loss, *args)
    names = list(candidates)
    alone = planner._switched(_scan_loss, keys, names, "float32", 0, None, _MODE)
    *ref, ops = alone(["float32"] * len(keys), *args, record=True)
    assert set(ops) == {(k, c) for k in keys for c in names if c != "float32"}
    for (key, c), got in ops.items():
        want = _alone_diagnosed(_scan_loss, args, key, c)
        assert set(got) == set(want)
        what = f"{key} {c}"
        np.testing.assert_allclose(
            got["op_error"], want["op_error"], rtol=1e-5, err_msg=what
        )
        for name in ("overflow", "underflow", "nonfinite", "flushed", "quantized"):
            assert got[name] == want[name], (what, name, got, want)
    reader = ("reader", "dot_general", 0)
    if "mixed_float8" in names:
        assert ops[reader, "mixed_float8"]["flushed"] > 0
        assert ops[reader, "mixed_float8"]["quantized"] > 0
        # three iterations of a 128x256 by 256x256 product
        stack = ops[("stack", "dot_general", 0), "mixed_float8"]
        assert stack["quantized"] == 3 * (128 * 256 + 256 * 256)
        assert ops[reader, "mixed_bfloat16"]["quantized"] == 0
    else:
        assert ops[reader, "mixed_float16"]["overflow"] > 0
        assert ops[reader, "mixed_float16"]["op_error"] == np.inf
        assert ops[("head", "dot_general", 0), "mixed_float16"]["overflow"] == 0
    # a run that does not record hands nothing over and gives the same numbers
    loss, grads = alone(["float32"] * len(keys), *args)
    _assert_float32_equal((loss, grads), tuple(ref), "recording run")


def test_plan_runs_no_diagnose_on_the_one_program(monkeypatch):
    """`mixprec.plan` takes the op measurements from the measuring program:
    no `diagnose` run; the per-site programs (a loss that calls a `jax.jit`
    inside) still take them from `diagnose`, the same numbers."""
    from mixprec._src.numerics import diagnose as diagnose_mod

    calls = []
    real = diagnose_mod.diagnose

    def counted(*a, **k):
        calls.append(k.get("policy"))
        return real(*a, **k)

    monkeypatch.setattr(diagnose_mod, "diagnose", counted)
    args = _scan_args()
    names = ("mixed_float8", "mixed_bfloat16", "float32")
    plan = mixprec.plan(_scan_loss, *args, candidates=names)
    assert calls == []
    by_key = {s.key: s.measurements() for s in plan.sites}
    reader = by_key[("reader", "dot_general", 0)]
    assert reader["mixed_float8"]["flushed"] > 0
    assert reader["mixed_float8"]["op_error"] > reader["mixed_bfloat16"]["op_error"] > 0

    inner = jax.jit(lambda h, w: h @ w)

    def jitted(w, x, y):
        with jax.named_scope("inner"):
            h = jnp.tanh(inner(x, w["a"]))
        return _scan_loss(w, h, y)

    fallback = mixprec.plan(jitted, *args, candidates=names)
    assert len(calls) == 2  # one per candidate that does not run in float32
    got = {s.key: s.measurements() for s in fallback.sites}
    assert got[("inner", "dot_general", 0)]["mixed_float8"]["quantized"] > 0


def _remat_loss(w, x, y):
    @jax.checkpoint
    def layer(h):
        with jax.named_scope("inner"):
            return jnp.tanh(h @ w["a"])

    with jax.named_scope("head"):
        return jnp.mean((layer(x) @ w["c"] - y) ** 2)


def test_a_checkpointed_site_is_measured_once():
    """`jax.checkpoint` runs its forward again in the backward pass, handing
    the same operands and results over twice: they count once, as
    diagnose counts them."""
    w, x, y = _scan_args()
    args = ({"a": w["a"], "c": w["c"]}, x, y)
    keys = _keys(_remat_loss, *args)
    assert keys[0] == ("head/inner", "dot_general", 0)
    names = ["mixed_float8", "float32"]
    alone = planner._switched(_remat_loss, keys, names, "float32", 0, None, _MODE)
    *_, ops = alone(["float32"] * len(keys), *args, record=True)
    for key in keys:
        got = ops[key, "mixed_float8"]
        want = _alone_diagnosed(_remat_loss, args, key, "mixed_float8")
        assert got["quantized"] == want["quantized"] == 128 * 256 + 256 * 256
        np.testing.assert_allclose(got["op_error"], want["op_error"], rtol=1e-5)


def _small_head_loss(w, x, y):
    """A 10-way output layer: under the float8 recipe's `min_dim` it runs in
    bfloat16 under `mixed_float8`, as under `mixed_bfloat16`."""
    with jax.named_scope("hidden"):
        h = jnp.tanh(x @ w["a"])
    with jax.named_scope("head"):
        return jnp.mean((h @ w["head"] - y) ** 2)


def test_candidates_that_run_a_product_alike_share_its_branch(monkeypatch):
    """The head's float8 and bfloat16 candidates decide it alike, so the one
    program computes it once for both; selecting either gives the program
    compiled with the head alone at it (the gradient reaches the shared
    branch whichever selects it), and fewer products are computed."""
    k = jax.random.split(jax.random.key(3), 4)
    w = {
        "a": jax.random.normal(k[0], (256, 256)) / 16,
        "head": jax.random.normal(k[1], (256, 10)) / 16,
    }
    args = (w, jax.random.normal(k[2], (128, 256)), jax.random.normal(k[3], (128, 10)))
    keys = _keys(_small_head_loss, *args)
    assert [k[0] for k in keys] == ["hidden", "head"]
    names = ["mixed_float8", "mixed_bfloat16", "float32"]
    alone = planner._switched(_small_head_loss, keys, names, "float32", 0, None, _MODE)
    for c in names:
        for i, key in enumerate(keys):
            choice = ["float32"] * 2
            choice[i] = c
            plan = Plan(get_policy("float32"), sites=(Site(*key, policy=c),))
            fn = planner._value_and_grad(autocast(_small_head_loss, plan), 0, None)
            got = alone(choice, *args)
            _assert_float32_equal(got, fn(*args), f"{key} {c}")
    head = ["float32", "mixed_float8"]
    bf16 = ["float32", "mixed_bfloat16"]
    np.testing.assert_array_equal(alone(head, *args)[0], alone(bf16, *args)[0])
    *_, ops = alone(["float32"] * 2, *args, record=True)
    assert ops[keys[1], "mixed_float8"] == ops[keys[1], "mixed_bfloat16"]
    assert ops[keys[1], "mixed_float8"]["quantized"] == 0

    from mixprec._src.autocast import interpreter

    def branches(shares):
        """How many times the switch runs a product."""
        ran = []
        real = interpreter.run_eqn

        def spy(walk, eqn, *a):
            if eqn.primitive.name == "dot_general":
                ran.append(eqn)
            return real(walk, eqn, *a)

        order = sorted(names, key=lambda c: planner.policy_rank(get_policy(c)))
        switch = planner._Switch(keys, [get_policy(c) for c in order], 2)
        switch.shares = shares
        fn = autocast(
            _small_head_loss, planner._SwitchPlan(get_policy("float32"), switch)
        )

        def measure(sel, *a):
            switch.sel = sel
            try:
                return jax.value_and_grad(fn)(*a)
            finally:
                switch.sel = None

        with monkeypatch.context() as m:
            m.setattr(interpreter, "run_eqn", spy)
            jax.make_jaxpr(measure)(np.zeros(2, np.int32), *args)
        return len(ran)

    # hidden: 3 candidates, 3 branches; head: 3 candidates, 2 branches
    assert (branches(True), branches(False)) == (5, 6)
