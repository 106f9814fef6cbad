"""autocast with Flax NNX objects as arguments: in-place updates survive.

NNX objects are updated in place (``optimizer.update``, batch-norm statistics,
``nnx.Rngs`` counters, metrics). autocast runs the function on their state and
writes the state back, as ``nnx.jit`` does; a plain pytree transformation
would update copies and drop every update without a word. The last section is
a corpus of NNX programs written as Flax's examples write them, wrapped whole
and run against ``nnx.jit`` in float32.
"""

from __future__ import annotations

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import BF16, F16, F32, assert_trees_close, tol

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


# --- NNX objects returned by the function: what nnx.jit gives back ------------
#
# The rule: returned NNX objects come back as nnx.jit returns them: the
# caller's own objects when the function returns them (the same Python
# objects), new objects otherwise, with every Variable shared as inside the
# function; their state keeps the dtypes the function gives it, whatever the
# policy's output dtype.


class _MLP(nnx.Module):
    """Flax's `10_fsdp_and_optimizer` model (without the sharding)."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (1, 32)))
        self.b1 = nnx.Param(jnp.zeros((32,)))
        self.w2 = nnx.Param(init(rngs.params(), (32, 1)))

    def __call__(self, x):
        return nnx.relu(x @ self.w1 + self.b1[None, :]) @ self.w2


class _SGDState(nnx.Variable):
    pass


class _SGD(nnx.Pytree):
    """The example's optimizer: it holds the model's Param Variables and
    updates them in place."""

    def __init__(self, params, lr, decay=0.9):
        self.lr = lr
        self.params = nnx.data(params)
        self.momentum = nnx.data(
            jax.tree.map(
                lambda v: _SGDState(jnp.zeros_like(v[...])),
                self.params,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )
        )
        self.decay = decay

    def update(self, grads):
        def update(p, m, g):
            m[...] = self.decay * m[...] + (1 - self.decay) * g[...]
            p[...] -= self.lr * m[...]

        jax.tree.map(
            update,
            self.params,
            self.momentum,
            grads,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )


def _create_model():
    model = _MLP(nnx.Rngs(0))
    return model, _SGD(nnx.variables(model, nnx.Param), 0.01)


def _sgd_step(model, optimizer, x, y):
    def loss_fn(model):
        return jnp.mean((y - model(x)) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(grads)
    return loss


_XS = jnp.linspace(-2.0, 2.0, 64)[:, None]
_YS = 0.8 * _XS**2 + 0.1


@pytest.mark.standard_promotion  # the example's `self.decay * momentum`
@pytest.mark.parametrize("outer", ["nnx.jit", "eager"])
def test_a_returned_model_and_optimizer_share_variables_and_train(outer):
    # Flax's example wrapped whole: `create_model` returns a model and an
    # optimizer that holds the model's Variables; the optimizer must update
    # the model's own Variables, as under nnx.jit.
    wrap = nnx.jit if outer == "nnx.jit" else (lambda f: f)
    ref_model, ref_opt = nnx.jit(_create_model)()
    model, opt = wrap(mixprec.autocast(_create_model, "mixed_bfloat16"))()
    assert ref_opt.params["w1"] is ref_model.w1  # what nnx.jit gives
    for name in ("w1", "b1", "w2"):
        assert opt.params[name] is getattr(model, name)
        assert getattr(model, name)[...].dtype == F32
    ref_step = nnx.jit(_sgd_step)
    step = nnx.jit(mixprec.autocast(_sgd_step, "mixed_bfloat16"))
    ref_losses = [float(ref_step(ref_model, ref_opt, _XS, _YS)) for _ in range(100)]
    losses = [float(step(model, opt, _XS, _YS)) for _ in range(100)]
    assert losses[-1] < 0.05 * losses[0]
    assert_trees_close(np.array(losses), np.array(ref_losses), dtype=BF16)
    assert_trees_close(nnx.state(model), nnx.state(ref_model), dtype=BF16)
    assert jax.tree.map(lambda v: v.dtype, nnx.state((model, opt))) == jax.tree.map(
        lambda v: v.dtype, nnx.state((ref_model, ref_opt))
    )


@pytest.mark.parametrize("outer", ["nnx.jit", "eager"])
def test_returned_input_objects_are_the_callers_objects(outer):
    wrap = nnx.jit if outer == "nnx.jit" else (lambda f: f)

    def f(model, x):
        y = model(x)
        return model, model.lin1, model.lin1.kernel, y

    for g in (nnx.jit(f), wrap(mixprec.autocast(f, "p=f32,c=bf16,o=bf16"))):
        model = _Net(nnx.Rngs(0, dropout=1))
        kernel = model.lin1.kernel
        out_model, lin1, out_kernel, y = g(model, _X)
        assert out_model is model and lin1 is model.lin1
        assert out_kernel is kernel and model.lin1.kernel is kernel
        assert kernel[...].dtype == F32 and model.bn.mean[...].dtype == F32
        assert np.any(np.asarray(model.bn.mean[...]) != 0)
    assert y.dtype == BF16  # the function's other outputs: the policy's


@pytest.mark.parametrize("outer", ["nnx.jit", "eager"])
def test_a_new_module_keeps_its_dtypes_under_a_16_bit_output_policy(outer):
    wrap = nnx.jit if outer == "nnx.jit" else (lambda f: f)

    def make(x):
        rngs = nnx.Rngs(0, dropout=1)
        model = _Net(rngs)
        model.rngs = rngs  # also returned on its own, below
        model.tied = model.lin1  # one submodule under two names
        return model, model(x), rngs

    want, want_y, want_rngs = nnx.jit(make)(_X)
    got, got_y, got_rngs = wrap(mixprec.autocast(make, "p=f32,c=bf16,o=bf16"))(_X)
    assert got_y.dtype == BF16 and want_y.dtype == F32
    assert_trees_close(got_y.astype(F32), want_y, dtype=BF16)
    want_state, got_state = _state(want), _state(got)
    assert jax.tree.map(lambda a: a.dtype, got_state) == jax.tree.map(
        lambda a: a.dtype, want_state
    )
    floats = lambda t: [a for a in jax.tree.leaves(t) if a.dtype == F32]  # noqa: E731
    assert_trees_close(floats(got_state), floats(want_state), dtype=BF16)

    # Sharing survives as under nnx.jit: a submodule held under two names is
    # one object, and the Rngs returned beside the module is the module's own.
    def sharing(model, rngs):
        return (model.tied is model.lin1, rngs is model.rngs)

    assert sharing(want, want_rngs) == (True, True)  # what nnx.jit gives
    assert sharing(got, got_rngs) == (True, True) and isinstance(got, _Net)


def test_a_variable_given_as_an_argument_is_updated_in_place():
    total = nnx.Variable(jnp.zeros((), F32))

    def f(v, x):
        v[...] = v[...] + jnp.sum(x @ x.T)
        return v

    out = mixprec.autocast(f, "mixed_bfloat16")(total, jnp.ones((2, 3)))
    assert out is total
    assert float(total[...]) == 12.0 and total[...].dtype == F32


# --- Structure changes: as nnx.jit handles them --------------------------------


class _KL(nnx.Variable):
    pass


class _Encoder(nnx.Module):
    """Flax's `05_vae` encoder: `__call__` stores a new Variable."""

    def __init__(self, rngs):
        self.mean = nnx.Linear(6, 4, rngs=rngs)
        self.std = nnx.Linear(6, 4, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        mean, std = self.mean(x), jnp.exp(self.std(x))
        self.kl_loss = _KL(
            jnp.mean(0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, -1))
        )
        return mean + std * jax.random.normal(self.rngs.noise(), mean.shape)


def _vae_train_step(model, optimizer, x):
    def loss_fn(model):
        z = model(x)
        kl = sum(jax.tree.leaves(nnx.pop(model, _KL)), 0.0)
        return jnp.mean(z**2) + 0.1 * kl

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _forward(model, x):
    return model(x)


def _vae_run(train_step, forward):
    model = _Encoder(nnx.Rngs(0, noise=1))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    seen = []
    # forward adds `kl_loss`; the train step's loss pops it: each call changes
    # the graph of the caller's model, the last two with cached traces.
    for call in (forward, train_step, forward, train_step):
        if call is forward:
            call(model, _X)
            seen.append((type(model.kl_loss), model.kl_loss[...].dtype))
        else:
            call(model, opt, _X)
            seen.append(hasattr(model, "kl_loss"))
    return model, opt, seen


@pytest.mark.standard_promotion  # optax.adam's bias correction
@pytest.mark.parametrize("outer", ["nnx.jit", "eager"])
def test_variables_created_and_removed_in_a_call_are_written_back(outer):
    wrap = nnx.jit if outer == "nnx.jit" else (lambda f: f)
    want_model, want_opt, want_seen = _vae_run(
        nnx.jit(_vae_train_step), nnx.jit(_forward)
    )
    policy = "p=f32,c=bf16,o=bf16"  # the new Variable stays float32 all the same
    model, opt, seen = _vae_run(
        wrap(mixprec.autocast(_vae_train_step, policy)),
        wrap(mixprec.autocast(_forward, policy)),
    )
    assert seen == want_seen == [(_KL, F32), False, (_KL, F32), False]
    want, got = _state(want_model, want_opt), _state(model, opt)
    assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: a.dtype, want)
    floats = lambda t: [a for a in jax.tree.leaves(t) if a.dtype == F32]  # noqa: E731
    assert_trees_close(floats(got), floats(want), dtype=BF16, grad=True)
    ints = lambda t: [a for a in jax.tree.leaves(t) if a.dtype.kind in "iu"]  # noqa: E731
    assert [a.tolist() for a in ints(got)] == [a.tolist() for a in ints(want)]


def test_structure_changes_retrace_once_per_structure():
    model = _Encoder(nnx.Rngs(0, noise=1))
    forward = mixprec.autocast(_forward, "mixed_bfloat16")
    forward(model, _X)  # adds kl_loss: the next call has another structure
    forward(model, _X)
    misses = api._cache.misses
    forward(model, _X)
    assert api._cache.misses == misses


def test_explain_and_diagnose_run_calls_that_create_variables():
    model = _Encoder(nnx.Rngs(0, noise=1))
    before = _state(model)
    for tool in (mixprec.explain, mixprec.diagnose):
        tool(_forward, model, _X, policy="mixed_bfloat16")
        tool(model, _X, policy="mixed_bfloat16")
    report = mixprec.explain(_forward, model, _X, policy="mixed_bfloat16")
    assert report.find("dot_general")
    assert not hasattr(model, "kl_loss")  # nothing written back
    assert jax.tree.all(jax.tree.map(np.array_equal, before, _state(model)))


# --- A corpus of NNX programs, written as Flax's examples write them ----------
#
# Each program is a `create_model()` and a `train_step(...)` in the style of
# Flax's NNX examples (the MNIST tutorial, `05_vae`, `10_fsdp_and_optimizer`),
# both wrapped whole with `mixprec.autocast` and run eagerly, against the same
# program under `nnx.jit` in float32. The tests/corpus/ harness takes pytrees
# (params in, loss out), so these live here: what is under test is what
# autocast does to NNX objects going in and coming out.


class _CNN(nnx.Module):
    """The MNIST tutorial's CNN (BatchNorm, Dropout, average pooling), on the
    8x8 digits."""

    def __init__(self, *, rngs):
        # No conv bias before a batch norm: its gradient is rounding noise,
        # which Adam turns into full-size steps that float32 does not take.
        conv = ft.partial(nnx.Conv, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.conv1 = conv(1, 16)
        self.batch_norm1 = nnx.BatchNorm(16, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.conv2 = conv(16, 32)
        self.batch_norm2 = nnx.BatchNorm(32, rngs=rngs)
        self.avg_pool = ft.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(32 * 2 * 2, 64, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.conv1(x))))
        x = self.dropout1(x)
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x)))
        return self.linear2(x)


def _cnn_create_model():
    model = _CNN(rngs=nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
    )
    return model, optimizer, metrics


def _cnn_loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


def _cnn_train_step(model, optimizer, metrics, batch):
    # Returns nothing: the model, optimizer and metrics are updated in place.
    grad_fn = nnx.value_and_grad(_cnn_loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def _cnn_train_step_functional(model, optimizer, metrics, batch):
    _cnn_train_step(model, optimizer, metrics, batch)
    return model, optimizer, metrics


def _mlp_bn_create_model():
    # nnx.ModelAndOptimizer holds the model (`optimizer.model`); its
    # `update(grads)` writes through it.
    model = _Net(nnx.Rngs(0, dropout=1))
    return model, nnx.ModelAndOptimizer(model, optax.sgd(0.05, momentum=0.9))


def _mlp_bn_train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    optimizer.update(grads)
    return loss


def _mlp_bn_train_step_functional(model, optimizer, x, y):
    loss = _mlp_bn_train_step(model, optimizer, x, y)
    return model, optimizer, loss


def _sgd_step_functional(model, optimizer, x, y):
    loss = _sgd_step(model, optimizer, x, y)
    return model, optimizer, loss


class _Loss(nnx.Variable):
    pass


class _VAEEncoder(nnx.Module):
    def __init__(self, din, dmid, dout, *, rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
        self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        x = jax.nn.relu(self.linear1(x.reshape((x.shape[0], -1))))
        mean = self.linear_mean(x)
        std = jnp.exp(self.linear_std(x))
        # A Variable created in every call, as in `05_vae`.
        self.kl_loss = _Loss(
            jnp.mean(0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, -1))
        )
        return mean + std * jax.random.normal(self.rngs.noise(), mean.shape)


class _VAE(nnx.Module):
    def __init__(self, din, hidden, latent, *, rngs):
        self.encoder = _VAEEncoder(din, hidden, latent, rngs=rngs)
        self.decoder = nnx.Sequential(
            nnx.Linear(latent, hidden, rngs=rngs),
            nnx.relu,
            nnx.Linear(hidden, din, rngs=rngs),
        )

    def __call__(self, x):
        return self.decoder(self.encoder(x))


def _vae_create_model():
    model = _VAE(64, 32, 8, rngs=nnx.Rngs(0, noise=1))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


def _vae_corpus_train_step(model, optimizer, x):
    def loss_fn(model):
        logits = model(x)
        kl_loss = sum(jax.tree.leaves(nnx.pop(model, _Loss)), 0.0)
        reconstruction = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x))
        return reconstruction + 0.1 * kl_loss

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _vae_sigmoid_forward(model, x):
    return jax.nn.sigmoid(model(x))


@ft.cache
def _digit_batches():
    from corpus.data import digits_or_synthetic

    x, y, _, _ = digits_or_synthetic()
    return x[:64], y[:64]


def _digits_batch(i):
    x, y = _digit_batches()
    x, y = jnp.roll(x, 16 * i, axis=0), jnp.roll(y, 16 * i, axis=0)
    return ({"image": x.reshape(-1, 8, 8, 1), "label": y},)


def _binary_digits(i):
    x, _ = _digit_batches()
    return ((jnp.roll(x, 16 * i, axis=0) > 0.25).astype(F32),)


@dataclasses.dataclass(frozen=True)
class _NNXProgram:
    """``create_model() -> objects``; ``train_step(*objects, *batches(i))``.

    Attributes:
        returns: the train step returns its objects (``model, optimizer, ...``,
            then the loss unless ``loss`` reads it elsewhere), as functional
            loops rebind them; they must be the caller's objects.
        loss: the training loss after a step, from the step's output and the
            objects (default: the output, or its last element).
        shared: pairs ``(a, b)`` of one program's objects that are one Python
            object (Variables an optimizer shares with the model).
        forward: a second function run (wrapped too) after training.
        steps: train steps run.
        state_dtype: the dtype whose gradient tolerance the trained state is
            held to, where not the policy's compute dtype (see the CNN's).
    """

    create_model: Callable[[], tuple]
    train_step: Callable[..., Any]
    batches: Callable[[int], tuple]
    returns: int = 0
    loss: Callable[[Any, tuple], Any] | None = None
    shared: Callable[[tuple], list[tuple[Any, Any]]] = lambda objects: []
    forward: Callable[..., Any] | None = None
    steps: int = 4
    standard_promotion: bool = True  # optax's adam and Flax's metrics
    state_dtype: Any = None


def _metrics_loss(out, objects):
    del out
    return objects[2].compute()["loss"]


def _fsdp_shared(objects):
    model, optimizer = objects
    return [(optimizer.params[k], getattr(model, k)) for k in ("w1", "b1", "w2")]


def _model_and_optimizer_shared(objects):
    model, optimizer = objects
    return [(optimizer.model, model), (optimizer.model.bn.mean, model.bn.mean)]


# The CNN's gradient is not float16-exact even with every array cast to float16
# by hand (no autocast): its first step's gradient then differs from float32's
# by 1.4% normwise (conv2's kernel), beyond float16's 1% gradient tolerance, and
# Adam's normalised steps carry that on. Scaling the loss by 2**10 changes
# nothing, so it is rounding, not underflow. Its state is held to bfloat16's
# tolerance under every policy; the other programs to their policy's own.
_CNN_STATE_DTYPE = BF16

_NNX_PROGRAMS = {
    "mnist_cnn": _NNXProgram(
        _cnn_create_model,
        _cnn_train_step,
        _digits_batch,
        loss=_metrics_loss,
        state_dtype=_CNN_STATE_DTYPE,
    ),
    "mnist_cnn_functional": _NNXProgram(
        _cnn_create_model,
        _cnn_train_step_functional,
        _digits_batch,
        returns=3,
        loss=_metrics_loss,
        state_dtype=_CNN_STATE_DTYPE,
    ),
    "model_and_optimizer": _NNXProgram(
        _mlp_bn_create_model,
        _mlp_bn_train_step,
        lambda i: (_X, _Y),
        shared=_model_and_optimizer_shared,
        standard_promotion=False,
    ),
    "model_and_optimizer_functional": _NNXProgram(
        _mlp_bn_create_model,
        _mlp_bn_train_step_functional,
        lambda i: (_X, _Y),
        returns=2,
        shared=_model_and_optimizer_shared,
        standard_promotion=False,
    ),
    "fsdp_sgd": _NNXProgram(
        _create_model, _sgd_step, lambda i: (_XS, _YS), shared=_fsdp_shared, steps=8
    ),
    "fsdp_sgd_functional": _NNXProgram(
        _create_model,
        _sgd_step_functional,
        lambda i: (_XS, _YS),
        returns=2,
        shared=_fsdp_shared,
        steps=8,
    ),
    "vae": _NNXProgram(
        _vae_create_model,
        _vae_corpus_train_step,
        _binary_digits,
        forward=_vae_sigmoid_forward,
    ),
}

# The mixed policies, and one whose outputs are 16-bit: the objects' state
# (parameters, batch statistics, optimizer state, metrics) must stay float32
# all the same.
_NNX_POLICIES = {
    "mixed_bfloat16": BF16,
    "mixed_float16": F16,
    "p=f32,c=bf16,o=bf16": BF16,
}


def _nnx_cases():
    cases = []
    for name, prog in _NNX_PROGRAMS.items():
        marks = [pytest.mark.standard_promotion] if prog.standard_promotion else []
        for policy in _NNX_POLICIES:
            cases.append(pytest.param(name, policy, marks=marks, id=f"{name}-{policy}"))
    return cases


def _graph_objects(objects):
    """The NNX objects and Variables in the graph of ``objects``, by path (the
    pytrees between them, such as an optax state, are rebuilt by nnx.jit too)."""
    return {
        path: x
        for path, x in nnx.graph.iter_graph(objects)
        if isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x)
    }


def _train(prog, wrap):
    """Runs ``prog`` with ``wrap`` around both of its functions: the objects,
    the losses, and the forward's output and the objects after it."""
    objects = wrap(prog.create_model)()
    for a, b in prog.shared(objects):
        assert a is b, "an object shared at creation came back as two"
    before = _graph_objects(objects)
    step = wrap(prog.train_step)
    losses = []
    for i in range(prog.steps):
        out = step(*objects, *prog.batches(i))
        if prog.returns:
            returned = out[: prog.returns]
            assert all(a is b for a, b in zip(returned, objects, strict=False)), (
                "the train step returned copies of the caller's objects"
            )
            objects = (*returned, *objects[prog.returns :])
        if prog.loss is not None:
            losses.append(prog.loss(out, objects))
        else:
            losses.append(out[-1] if prog.returns else out)
    for a, b in prog.shared(objects):
        assert a is b, "an object shared by the model and optimizer came apart"
    after = _graph_objects(objects)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before), (
        "the caller's Variables were replaced, not updated"
    )
    forward = None
    if prog.forward is not None:
        out = wrap(prog.forward)(objects[0], *prog.batches(prog.steps))
        kl = objects[0].encoder.kl_loss
        forward = out, type(kl), kl[...]
    return objects, losses, forward


def _assert_state_close(got, want, *, dtype):
    """Normwise per leaf, against the larger of its norm and 1% of the whole
    object's state: a bias whose true gradient is about zero (Adam's moments
    of it) is held to the object's scale, not to its own rounding noise.
    ``dtype``'s gradient tolerance (the state is what the gradients made)."""
    t = tol(dtype, grad=True)
    pairs = [
        (
            jax.tree_util.keystr(path),
            np.asarray(a, np.float64),
            np.asarray(b, np.float64),
        )
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
        )
        if b.dtype.kind == "f"
    ]
    total = np.sqrt(sum(np.sum(b**2) for _, _, b in pairs))
    for path, a, b in pairs:
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-2 * total, 1e-30)
        assert err <= t, f"state{path}: normwise error {err:.3g} > {t:g}"


@pytest.fixture
def _rank_promotion():
    # Flax's examples add biases by rank promotion (`x @ w1 + b1`).
    with jax.numpy_rank_promotion("allow"):
        yield


_nnx_reference = ft.cache(lambda name: _train(_NNX_PROGRAMS[name], nnx.jit))


@pytest.mark.usefixtures("_rank_promotion")
@pytest.mark.parametrize("name,policy", _nnx_cases())
def test_nnx_program_trains_like_float32(name, policy):
    prog = _NNX_PROGRAMS[name]
    low = _NNX_POLICIES[policy]
    out_dtype = mixprec.get_policy(policy).output_dtype
    want_objects, want_losses, want_forward = _nnx_reference(name)
    objects, losses, forward = _train(prog, lambda f: mixprec.autocast(f, policy))

    # Returned values other than objects take the policy's output dtype; the
    # objects' state keeps what float32 code gives it.
    if prog.loss is None:
        assert all(jnp.result_type(v) == out_dtype for v in losses)
    want, got = _state(*want_objects), _state(*objects)
    assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: a.dtype, want)
    floats = lambda t: [a for a in jax.tree.leaves(t) if a.dtype.kind == "f"]  # noqa: E731
    assert all(a.dtype == F32 for a in floats(got))
    # The same objects and Variables, shared alike (iter_graph visits a shared
    # one once, at its first path).
    kinds = lambda objs: {p: type(x) for p, x in _graph_objects(objs).items()}  # noqa: E731
    assert kinds(objects) == kinds(want_objects)

    # It trained as float32 did.
    losses = np.array([float(v) for v in losses])
    assert losses[-1] < losses[0]
    assert_trees_close(losses, np.array([float(v) for v in want_losses]), dtype=low)
    assert got.keys() == want.keys()
    for k in want:  # one object at a time
        _assert_state_close(got[k], want[k], dtype=prog.state_dtype or low)
    ints = lambda t: [a for a in jax.tree.leaves(t) if a.dtype.kind in "iu"]  # noqa: E731
    assert [a.tolist() for a in ints(got)] == [a.tolist() for a in ints(want)]

    if prog.forward is not None:
        # The forward pass stored a Variable on the caller's encoder.
        (y, kind, kl), (want_y, _, want_kl) = forward, want_forward
        assert y.dtype == out_dtype
        assert kind is _Loss and kl.dtype == F32
        # Of a model trained in low precision: the state's tolerance.
        assert_trees_close((y.astype(F32), kl), (want_y, want_kl), dtype=low, grad=True)
