"""autocast with Flax NNX objects as arguments: in-place updates survive.

NNX objects are updated in place (``optimizer.update``, batch-norm statistics,
``nnx.Rngs`` counters, metrics). autocast runs the function on their state and
writes the state back, as ``nnx.jit`` does; a plain pytree transformation
would update copies and drop every update without a word.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import BF16, F16, F32, assert_trees_close

import mixprec
from mixprec._src.autocast import api


class _Net(nnx.Module):
    def __init__(self, rngs):
        # No bias before the batch norm: its gradient is zero up to rounding.
        self.lin1 = nnx.Linear(6, 16, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.lin2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.lin2(self.drop(jax.nn.relu(self.bn(self.lin1(x)))))


_X = jax.random.normal(jax.random.key(1), (32, 6)) * 3 + 1
_Y = jnp.arange(32) % 3


def _loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _setup():
    model = _Net(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    return model, opt


def _step(loss):
    def step(model, opt, x, y):
        value, grads = nnx.value_and_grad(loss)(model, x, y)
        opt.update(model, grads)
        return value

    return step


def _numpy(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _state(*objs):
    return jax.tree.map(_numpy, nnx.to_pure_dict(nnx.state(objs)))


def _run(step, steps=3):
    model, opt = _setup()
    before = _state(model, opt)
    values = [step(model, opt, _X, _Y) for _ in range(steps)]
    return before, _state(model, opt), values


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("wrap", ["step", "loss"])
def test_train_step_updates_params_batch_stats_rngs_and_optimizer(policy, wrap):
    low = BF16 if policy == "mixed_bfloat16" else F16
    plain = nnx.jit(_step(_loss))
    if wrap == "step":
        step = nnx.jit(mixprec.autocast(_step(_loss), policy))
    else:
        step = nnx.jit(_step(mixprec.autocast(_loss, policy)))
    before, want, want_values = _run(plain)
    _, got, got_values = _run(step)
    # Everything that moves under float32 moves under autocast, to about where.
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), before, want)
    assert moved == jax.tree.map(lambda a, b: bool(np.any(a != b)), before, got)
    assert moved[0]["lin1"]["kernel"]
    assert moved[0]["bn"]["mean"]
    # The dtypes of the state are what float32 code gives them.
    assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: a.dtype, want)
    floats = lambda t: [a for a in jax.tree.leaves(t) if a.dtype == F32]  # noqa: E731
    assert_trees_close(floats(got), floats(want), dtype=low, grad=True)
    assert_trees_close(got_values, want_values, dtype=low)
    # RNG counters advance exactly as without autocast (integer state).
    ints = lambda t: [a for a in jax.tree.leaves(t) if a.dtype.kind in "iu"]  # noqa: E731
    assert [np.asarray(a).tolist() for a in ints(got)] == [
        np.asarray(a).tolist() for a in ints(want)
    ]


def test_eager_calls_update_and_do_not_retrace():
    model, opt = _setup()
    step = mixprec.autocast(_step(_loss), "mixed_bfloat16")
    kernel = np.asarray(model.lin1.kernel[...])
    step(model, opt, _X, _Y)
    misses = api._cache.misses
    step(model, opt, _X, _Y)
    assert api._cache.misses == misses
    assert np.any(np.asarray(model.lin1.kernel[...]) != kernel)
    assert model.lin1.kernel[...].dtype == F32


class _Counter(nnx.Module):
    def __init__(self):
        self.total = nnx.Variable(jnp.zeros((), F32))


def test_objects_shared_between_arguments_stay_shared():
    counter = _Counter()
    holder = nnx.List([counter])

    def f(c, h, x):
        c.total[...] = c.total[...] + jnp.sum(x @ x.T)
        return h[0].total[...]  # the same object as `c`

    out = mixprec.autocast(f, "mixed_bfloat16")(counter, holder, jnp.ones((2, 3)))
    assert float(out) == 12.0
    assert float(counter.total[...]) == 12.0
    assert holder[0] is counter


def test_state_keeps_its_dtype_when_the_output_dtype_is_16_bit():
    # A p=f32,c=bf16,o=bf16 policy gives the function's result in bf16; the
    # state written back into the objects stays float32 and is not rounded.
    counter = _Counter()
    third = 1.0 / 3.0

    def f(c, x):
        c.total[...] = c.total[...] + third
        return x @ x.T

    out = mixprec.autocast(f, "p=f32,c=bf16,o=bf16")(counter, jnp.ones((2, 3)))
    assert out.dtype == BF16
    assert counter.total[...].dtype == F32
    assert float(counter.total[...]) == np.float32(third)


def test_structure_change_is_refused_with_a_clear_error():
    counter = _Counter()

    def f(c, x):
        c.extra = nnx.Variable(jnp.sum(x))
        return x

    with pytest.raises(ValueError, match="changed their structure"):
        mixprec.autocast(f, "mixed_bfloat16")(counter, jnp.ones(3))
    assert not hasattr(counter, "extra")


def test_calls_without_nnx_objects_are_unchanged():
    f = mixprec.autocast(lambda w, x: x @ w, "mixed_bfloat16")
    out = f(jnp.ones((3, 2)), jnp.ones((4, 3)))
    assert out.dtype == F32
    assert_trees_close(out, jnp.full((4, 2), 3.0), dtype=BF16)


@pytest.mark.parametrize("jit", [False, True])
def test_a_module_as_the_function_updates_its_own_state(jit):
    model = _Net(nnx.Rngs(0, dropout=1))
    ref = _Net(nnx.Rngs(0, dropout=1))

    def call(m, x):
        return mixprec.autocast(m, "mixed_bfloat16")(x)

    if jit:
        call = nnx.jit(call)
    want = ref(_X)
    got = call(model, _X)
    assert got.dtype == F32
    assert_trees_close(got, want, dtype=BF16)
    assert_trees_close(model.bn.mean[...], ref.bn.mean[...], dtype=BF16)
    assert np.any(np.asarray(model.bn.mean[...]) != 0)


def test_explain_and_diagnose_take_nnx_objects_and_leave_them_alone():
    model, opt = _setup()
    before = _state(model, opt)
    step = _step(_loss)
    report = mixprec.explain(step, model, opt, _X, _Y, policy="mixed_bfloat16")
    dots = report.find("dot_general")
    assert dots and all(op.decision == "low" for op in dots)
    mixprec.diagnose(step, model, opt, _X, _Y, policy="mixed_bfloat16")
    mixprec.explain(model, _X, policy="mixed_bfloat16")
    mixprec.diagnose(model, _X, policy="mixed_bfloat16")
    after = _state(model, opt)
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after))
