"""Plan sites across bodies: a product in a `cond` branch or a called
function's body is its own site, not the one of the same layer outside it;
a `scan` body stays one site for all its iterations; a backward product
follows its forward site across `scan`, `jit`, `cond` and `checkpoint`
boundaries."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_dtypes, assert_trees_close
from plan_models import hlo_dots

import mixprec
from mixprec._src.plan import Plan, Site


def _f(w, x, p):
    with jax.named_scope("mlp"):
        h = jnp.tanh(x @ w["a"])
        h = jax.lax.cond(p, lambda h: h @ w["b"], lambda h: jnp.tanh(h @ w["c"]), h)

        def body(h, _):
            return jnp.tanh(h @ w["d"]), None

        h, _ = jax.lax.scan(body, h, None, length=3)
        h = jax.jit(lambda h: h @ w["e"])(h)
    return jnp.mean(h**2)


def _args():
    k = jax.random.split(jax.random.key(0), 6)
    w = {n: jax.random.normal(k[i], (16, 16)) / 4 for i, n in enumerate("abcde")}
    return w, jax.random.normal(k[5], (8, 16)), jnp.bool_(True)


def _forward(report):
    return [(op.site, op.source.split(":")[-1]) for op in report.find("dot_general")]


def test_bodies_do_not_share_the_sites_of_their_layer():
    w, x, p = _args()
    report = mixprec.explain(_f, w, x, p, policy=Plan("mixed_bfloat16"))
    sites = [op.site for op in report.find("dot_general")]
    assert sites == [("mlp", "dot_general", i) for i in range(5)]
    # a plan that names one branch's product changes that product alone
    plan = Plan("mixed_bfloat16", sites=(Site("mlp", "dot_general", 2, "float32"),))
    report = mixprec.explain(_f, w, x, p, policy=plan)
    dtypes = [op.in_dtypes[0] for op in report.find("dot_general")]
    assert dtypes == ["bfloat16", "bfloat16", "float32", "bfloat16", "bfloat16"]
    got = mixprec.autocast(_f, plan)(w, x, p)
    assert got.dtype == jnp.float32


def test_a_whole_step_keeps_the_forward_names_and_its_backward_follows():
    """Under `autocast(jax.grad(f))` the forward products keep the names
    they have in `f`, and each backward product follows its forward site
    across the body it was transposed in: a `cond` branch (the branch its
    forward ran), the `scan` body, the `jit` body."""
    w, x, p = _args()
    plan = Plan("mixed_bfloat16", sites=(Site("mlp", "dot_general", 2, "float32"),))
    report = mixprec.explain(jax.grad(_f), w, x, p, policy=plan)
    rows = report.find("dot_general")
    fwd = [op.site for op in rows if not op.backward]
    assert fwd == [("mlp", "dot_general", i) for i in range(5)]
    bwd = [op for op in rows if op.backward]
    # two gradient products per site; one for `x @ w["a"]` (no gradient of x)
    assert collections.Counter(op.site[2] for op in bwd) == {
        0: 1,
        1: 2,
        2: 2,
        3: 2,
        4: 2,
    }
    for op in bwd:
        want = "float32" if op.site[2] == 2 else "bfloat16"
        assert op.in_dtypes == (want, want), (op.site, op.source)


def test_a_cond_on_a_constant_index_keeps_its_sites_in_a_whole_step():
    """`lax.cond(True, ...)` keeps a `cond` whose index is a literal, not a
    variable: its branches are still matched across the transpose."""

    def f(w, x):
        with jax.named_scope("mlp"):
            h = jnp.tanh(x @ w["a"])
            h = jax.lax.cond(
                True, lambda h: jnp.tanh(h @ w["b"]), lambda h: h @ w["c"], h
            )
        return jnp.mean(h**2)

    w, x, _ = _args()
    plan = Plan("mixed_bfloat16", sites=(Site("mlp", "dot_general", 1, "float32"),))
    rows = mixprec.explain(jax.grad(f), w, x, policy=plan).find("dot_general")
    assert [op.site for op in rows if not op.backward][:2] == [
        ("mlp", "dot_general", 0),
        ("mlp", "dot_general", 1),
    ]
    for op in rows:
        want = "float32" if op.site[2] == 1 else "bfloat16"
        assert op.in_dtypes == (want, want), (op.site, op.backward, op.source)
    g = jax.jit(mixprec.autocast(jax.grad(f), plan))(w, x)
    assert_tree_dtypes(g, jnp.float32)
    assert_trees_close(g, jax.grad(f)(w, x), dtype="bfloat16", grad=True)


def test_a_scan_body_and_a_function_called_twice_are_one_site():
    def f(w, x):
        g = jax.jit(lambda h, m: jnp.tanh(h @ m))
        with jax.named_scope("blk"):
            h = g(x, w["a"])
            h = g(h, w["a"])

            def body(h, m):
                return jnp.tanh(h @ m), None

            h, _ = jax.lax.scan(body, h, jnp.stack([w["b"]] * 4))
        return jnp.sum(h)

    w, x, _ = _args()
    report = mixprec.explain(f, w, x, policy=Plan("mixed_bfloat16"))
    sites = [op.site for op in report.find("dot_general")]
    assert sites == [("blk", "dot_general", 0)] * 2 + [("blk", "dot_general", 1)]
    plan = mixprec.plan(f, w, x, candidates=("mixed_bfloat16", "float32"))
    assert [s.key for s in plan.sites] == [
        ("blk", "dot_general", 0),
        ("blk", "dot_general", 1),
    ]
    np.testing.assert_allclose(
        plan.sites[1].flops, 4 * 2 * 8 * 16 * 16, rtol=0
    )  # counted over the iterations


# ------------------------------------------- backward products across bodies

L, D, B = 2, 128, 128  # float8 needs every dimension >= 128


def _block(h, w):
    with jax.named_scope("mlp"):
        u = jnp.tanh(h @ w["up"])
        return h + u @ w["down"]


def _scan_loss(w, x, y):
    h, _ = jax.lax.scan(lambda h, wl: (_block(h, wl), None), x, w)
    return jnp.mean((h - y) ** 2)


def _remat_scan_loss(w, x, y):
    body = jax.checkpoint(lambda h, wl: (_block(h, wl), None))
    h, _ = jax.lax.scan(body, x, w)
    return jnp.mean((h - y) ** 2)


def _one_line_block(h, w):
    with jax.named_scope("mlp"):
        return h + jnp.tanh(h @ w["up"]) @ w["down"]


def _remat_one_line_loss(w, x, y):
    # the recomputed tanh(h @ up) that down's weight gradient reads is on the
    # line of both products: it is told apart as the same value computed again
    body = jax.checkpoint(lambda h, wl: (_one_line_block(h, wl), None))
    h, _ = jax.lax.scan(body, x, w)
    return jnp.mean((h - y) ** 2)


@jax.custom_vjp
def _vjp_block(h, w):
    return _block(h, w)


def _vjp_block_fwd(h, w):
    return _block(h, w), (h, w)


def _vjp_block_bwd(res, g):
    # recomputes the forward: its products are traced by this rule's caller
    return jax.vjp(_block, *res)[1](g)


_vjp_block.defvjp(_vjp_block_fwd, _vjp_block_bwd)


def _custom_vjp_loss(w, x, y):
    h, _ = jax.lax.scan(lambda h, wl: (_vjp_block(h, wl), None), x, w)
    return jnp.mean((h - y) ** 2)


_jit_block = jax.jit(_block)


def _jit_loss(w, x, y):
    h = x
    for i in range(L):
        h = _jit_block(h, {k: v[i] for k, v in w.items()})
    return jnp.mean((h - y) ** 2)


def _stack():
    k = jax.random.split(jax.random.key(1), 4)
    w = {
        "up": jax.random.normal(k[0], (L, D, D)) / D**0.5,
        "down": jax.random.normal(k[1], (L, D, D)) / D**0.5,
    }
    return w, jax.random.normal(k[2], (B, D)), jax.random.normal(k[3], (B, D))


def _two_sites(low, layer="mlp", base="mixed_bfloat16"):
    return Plan(
        base,
        sites=(
            Site(layer, "dot_general", 0, "float32"),
            Site(layer, "dot_general", 1, low),
        ),
    )


def _assert_backward_follows(fn, args, plan):
    """Every backward product of ``fn`` has the site of a forward product of
    its source line and runs as that one does (the same decision; float32
    operands exactly where the forward has them), and each forward site has
    its gradient products. Returns ``(site index, decision)`` of the forward
    products."""
    rows = mixprec.explain(fn, *args, policy=plan).find("dot_general")
    fwd = {op.site: op for op in rows if not op.backward}
    bwd = [op for op in rows if op.backward]
    for op in bwd:
        f = fwd.get(op.site)
        assert f is not None and f.source == op.source, (op.source, op.site)
        assert op.decision == f.decision, (op.site, op.decision, f.decision)
        f32 = f.in_dtypes == ("float32", "float32")
        assert (op.in_dtypes == ("float32", "float32")) == f32, (op.site, op.in_dtypes)
    # two gradient products (one where no gradient is needed), and a
    # checkpoint's recomputation of the forward where it is needed; a jitted
    # layer called twice: both calls'
    count = collections.Counter(op.site for op in bwd)
    assert all(count[site] in (1, 2, 3, 4) for site in fwd), count
    return [(op.site[2], op.decision) for op in fwd.values()]


_DECISION = {"mixed_float8": "float8", "mixed_bfloat16": "low", "mixed_float16": "low"}


@pytest.mark.parametrize("low", ["mixed_float8", "mixed_bfloat16"])
@pytest.mark.parametrize(
    "loss",
    [_scan_loss, _remat_scan_loss, _remat_one_line_loss, _custom_vjp_loss, _jit_loss],
    ids=["scan", "remat_scan", "remat_one_line", "custom_vjp", "jit"],
)
def test_a_whole_step_runs_each_backward_product_at_its_forward_sites_policy(loss, low):
    """A whole step over scanned layers (also checkpointed), or calling a
    jitted layer: the residuals cross the body (the forward scan's stacked
    outputs are the transposed scan's xs), and each gradient product still
    follows its forward site: the float32 site's two in float32, the other
    site's two at its policy (not the widest of the layer's sites)."""
    w, x, y = _stack()
    fwd = _assert_backward_follows(jax.grad(loss), (w, x, y), _two_sites(low))
    # (the jitted layer's second call has the sites of its first, as in the
    # loss: JAX traces the calls' forward bodies apart in the gradient)
    assert fwd == [(0, "float32"), (1, _DECISION[low])]


def test_flax_nn_scan_backward_products_follow_their_forward_sites():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            init = nn.initializers.normal(D**-0.5)
            up = self.param("up", init, (D, D))
            down = self.param("down", init, (D, D))
            return h + jnp.tanh(h @ up) @ down, None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            blocks = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=L,
            )
            return blocks(name="blocks")(x, None)[0]

    _, x, y = _stack()
    net = Net()
    params = net.init(jax.random.key(0), x)

    def loss(p, x, y):
        return jnp.mean((net.apply(p, x) - y) ** 2)

    plan = _two_sites("mixed_float8", layer="Net/blocks")
    fwd = _assert_backward_follows(jax.grad(loss), (params, x, y), plan)
    assert fwd == [(0, "float32"), (1, "float8")]


@pytest.mark.parametrize("low", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("loss", [_scan_loss, _jit_loss], ids=["scan", "jit"])
def test_a_whole_step_with_two_policies_per_layer_matches_float32(loss, low):
    """Values and gradients of the whole step against float32, at the low
    dtype's tolerance (float16 with a loss scale), all float32 outside."""
    w, x, y = _stack()
    plan = _two_sites(low, base=low)
    if low == "mixed_float16":

        def step(w, x, y):
            vg = mixprec.value_and_grad(loss)
            value, grads, finite = vg(
                w, x, y, loss_scale=mixprec.StaticLossScale(2.0**10)
            )
            return value, grads, finite

    else:

        def step(w, x, y):
            value, grads = jax.value_and_grad(loss)(w, x, y)
            return value, grads, jnp.bool_(True)

    _assert_backward_follows(step, (w, x, y), plan)
    value, grads, finite = jax.jit(mixprec.autocast(step, plan))(w, x, y)
    ref, ref_grads = jax.jit(jax.value_and_grad(loss))(w, x, y)
    assert bool(finite)
    assert_tree_dtypes((value, grads), jnp.float32)
    dtype = "bfloat16" if low == "mixed_bfloat16" else "float16"
    assert_trees_close(value, ref, dtype=dtype)
    assert_trees_close(grads, ref_grads, dtype=dtype, grad=True)


@pytest.mark.parametrize("loss", [_scan_loss, _jit_loss], ids=["scan", "jit"])
def test_the_cuda_export_runs_float8_gemms_where_the_plan_says_in_the_backward(loss):
    """Exported for cuda, the whole step's float8 GEMMs are the float8 site's
    forward and its two gradient products (per body: the scan's bodies are
    one loop each), every float32 site's GEMM has float32 operands."""
    w, x, y = _stack()
    plan = _two_sites("mixed_float8")
    dots = hlo_dots(mixprec.autocast(jax.grad(loss), plan), w, x, y)
    f8 = [d for d in dots if all(t.startswith("f8") for t in d)]
    f32 = [d for d in dots if d == ("f32", "f32")]
    bf16 = [d for d in dots if d == ("bf16", "bf16")]
    # up (float32) and down (float8): each its forward and two gradients (the
    # scan's bodies are one loop each). Called jitted: the first call's up
    # has no input gradient (x is not differentiated), the second call's two
    # sites run as the first call's.
    if loss is _scan_loss:
        assert (len(f8), len(f32), len(dots)) == (3, 3, 6), dots
    else:
        assert (len(f8), len(f32), len(bf16), len(dots)) == (6, 5, 0, 11), dots


def test_a_jitted_layer_called_from_three_layers_follows_each_calls_sites():
    """JAX traces the second and third calls of one `jax.jit` layer to one
    forward and one transposed body: each visit is named in its own layer,
    and each call's backward products follow that call's sites."""
    layer = jax.jit(lambda h, w: h + jnp.tanh(h @ w["up"]) @ w["down"])

    def loss(ws, x, y):
        h = x
        for name, w in zip("abc", ws, strict=True):
            with jax.named_scope(name):
                h = layer(h, w)
        return jnp.mean((h - y) ** 2)

    w, x, y = _stack()
    ws = [{k: v[0] for k, v in w.items()} for _ in range(3)]
    plan = Plan(
        "mixed_bfloat16",
        sites=(
            Site("b", "dot_general", 0, "float32"),
            Site("c", "dot_general", 1, "float32"),
        ),
    )
    fwd = _assert_backward_follows(jax.grad(loss), (ws, x, y), plan)
    assert fwd == [
        (0, "low"),
        (1, "low"),
        (0, "float32"),
        (1, "low"),
        (0, "low"),
        (1, "float32"),
    ]


def test_products_reading_one_input_keep_their_own_sites_in_the_backward():
    """A gated MLP in a scanned whole step: `h @ gate` and `h @ up` read the
    same `h`, so each weight gradient reads a value two forward products
    read; it follows the one traced by its own source line."""

    def loss(w, x, y):
        def body(h, w):
            with jax.named_scope("mlp"):
                gate = h @ w["gate"]
                up = h @ w["up"]
                return h + (jax.nn.silu(gate) * up) @ w["down"], None

        h, _ = jax.lax.scan(body, x, w)
        return jnp.mean((h - y) ** 2)

    w, x, y = _stack()
    w["gate"] = w["up"][::-1]
    plan = Plan(
        "mixed_bfloat16",
        sites=(
            Site("mlp", "dot_general", 0, "float32"),
            Site("mlp", "dot_general", 1, "mixed_float8"),
        ),
    )
    fwd = _assert_backward_follows(jax.grad(loss), (w, x, y), plan)
    assert fwd == [(0, "float32"), (1, "float8"), (2, "low")]


# ------------------------------------------ a whole step names what the loss does


@jax.custom_jvp
def _jvp_block(h, w):
    return _block(h, w)


# The rule runs `jax.jvp` on the block: the zero tangent of an input that is
# not differentiated is a real zero there, and JAX leaves its product
# (`0 @ w["up"]`) in the whole step, used nowhere.
_jvp_block.defjvp(lambda primals, tangents: jax.jvp(_block, primals, tangents))


def _unrolled(layer, n=L):
    def loss(w, x, y):
        h = x
        for i in range(n):
            h = layer(h, {k: v[i] for k, v in w.items()})
        return jnp.mean((h - y) ** 2)

    return loss


def _scanned(layer):
    def loss(w, x, y):
        h, _ = jax.lax.scan(lambda h, wl: (layer(h, wl), None), x, w)
        return jnp.mean((h - y) ** 2)

    return loss


def _sum_loss(w, x, y):
    # the last product's result is read by the loss value alone, which
    # `jax.grad` drops: used nowhere in the whole step, it is still the site
    # its two gradient products follow
    del y
    with jax.named_scope("mlp"):
        return jnp.sum(jnp.tanh(x @ w["up"][0]) @ w["down"][0])


_SHAPES = {
    "plain": (_unrolled(_block), False),
    "unused_loss_value": (_sum_loss, False),
    "custom_jvp": (_unrolled(_jvp_block), False),
    "custom_vjp": (_unrolled(_vjp_block), False),
    "checkpoint": (_unrolled(jax.checkpoint(_block), 1), False),
    "checkpoint_custom_jvp": (_unrolled(jax.checkpoint(_jvp_block), 1), False),
    "scan_checkpoint_custom_jvp": (_scanned(jax.checkpoint(_jvp_block)), False),
    "scan": (_scanned(_block), False),
    "scan_custom_jvp": (_scanned(_jvp_block), False),
    "scan_custom_vjp": (_scanned(_vjp_block), False),
    "jit_layer": (_unrolled(_jit_block), False),
    "jit_custom_jvp": (_unrolled(_jvp_block), True),
    "jit_layer_custom_jvp": (_unrolled(jax.jit(_jvp_block)), True),
    "jit_scan_custom_jvp": (_scanned(jax.jit(_jvp_block)), True),
}

# a policy per site, in turn (the base policy is none of them: a product the
# plan's entries miss shows as float16)
_TURN = ("float32", "mixed_float8", "mixed_bfloat16")
_RUNS = {
    "float32": ("float32", "float32"),
    "mixed_float8": ("float8_e4m3fn", "float8_e4m3fn"),
    "mixed_bfloat16": ("bfloat16", "bfloat16"),
}
_MLIR = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "float8_e4m3fn": "f8E4M3FN",
    "float8_e5m2": "f8E5M2",
}


# The limit: a `jax.checkpoint` function called twice from one layer is one
# body in the loss (one site per product), but the gradient runs each call's
# forward outside any body, as if written out twice.
_SHAPES["checkpoint_called_twice"] = (_unrolled(jax.checkpoint(_block)), False)
_LIMITS = {"checkpoint_called_twice"}


def _scoped_checkpoint_loss(w, x, y):
    # (each call in its own scope: the calls are sites of their own in both)
    h = x
    for i in range(L):
        with jax.named_scope(f"layer{i}"):
            h = jax.checkpoint(_block)(h, {k: v[i] for k, v in w.items()})
    return jnp.mean((h - y) ** 2)


_SHAPES["checkpoint_called_twice_scoped"] = (_scoped_checkpoint_loss, False)


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(s, marks=pytest.mark.xfail(strict=True, reason="the limit"))
        if s in _LIMITS
        else s
        for s in _SHAPES
    ],
)
def test_a_whole_step_has_the_sites_of_its_loss(shape):
    """The forward sites of `autocast(jax.grad(loss))` are those of
    `jax.grad(autocast(loss))` (what `mixprec.plan` measures): a product whose
    result is used nowhere (the zero tangent's product a `custom_jvp` rule
    leaves) is no site and takes no index. A plan with an entry for each of
    the loss's sites runs each product of the whole step at its site's policy,
    forward and backward, in `explain` and in the cuda export alike."""
    loss, jitted = _SHAPES[shape]
    w, x, y = _stack()
    step = jax.jit(jax.grad(loss)) if jitted else jax.grad(loss)
    base = Plan("mixed_float16")
    alone = sorted(
        {
            op.site
            for op in mixprec.explain(loss, w, x, y, policy=base).find("dot_general")
        }
    )
    per_layer = collections.defaultdict(list)
    for layer, _, index in alone:
        per_layer[layer].append(index)
    assert all(v == list(range(len(v))) for v in per_layer.values()), alone
    rows = mixprec.explain(step, w, x, y, policy=base).find("dot_general")
    # (a forward product used nowhere is not listed: its gradients are)
    assert {op.site for op in rows if not op.backward} <= set(alone)
    assert sorted({op.site for op in rows}) == alone
    chosen = {key: _TURN[i % len(_TURN)] for i, key in enumerate(alone)}
    plan = Plan("mixed_float16", sites=tuple(Site(*k, p) for k, p in chosen.items()))
    rows = mixprec.explain(step, w, x, y, policy=plan).find("dot_general")
    assert all(op.site is not None for op in rows)
    for op in rows:
        want = _RUNS[chosen[op.site]]
        if op.backward and want[0].startswith("float8"):
            assert all(t.startswith("float8") for t in op.in_dtypes), op
        else:
            assert op.in_dtypes == want, (op.site, op.backward, op.in_dtypes)
    # explain lists what the compiled step runs: no product used nowhere
    want = collections.Counter(tuple(_MLIR[t] for t in op.in_dtypes) for op in rows)
    auto = mixprec.autocast(jax.grad(loss), plan)
    assert collections.Counter(hlo_dots(auto, w, x, y)) == want


@pytest.mark.parametrize("shape", ["custom_jvp", "unused_loss_value"])
def test_diagnose_does_not_report_a_product_used_nowhere(shape):
    """`diagnose` compares the products the step runs: those explain lists."""
    loss, _ = _SHAPES[shape]
    w, x, y = _stack()
    plan = Plan("mixed_bfloat16")
    ran = mixprec.explain(jax.grad(loss), w, x, y, policy=plan).find("dot_general")
    report = mixprec.diagnose(jax.grad(loss), w, x, y, policy=plan)
    got = report.find("dot_general")
    assert [(op.site, op.backward) for op in got] == [
        (op.site, op.backward) for op in ran
    ]
