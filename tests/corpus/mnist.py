"""JAX's classic MNIST examples: stax + optimizers.momentum, and SGD from scratch.

Written as in ``examples/mnist_classifier.py`` and
``examples/mnist_classifier_fromscratch.py`` of the JAX repository, on 8x8
digits (64 features): one-hot float targets, ``-mean(sum(preds * targets))``,
and a whole jitted ``update`` step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.example_libraries import optimizers, stax
from jax.scipy.special import logsumexp

from . import Instance, data, program


def _batch(seed, n=32):
    x_train, y_train, _, _ = data.digits_or_synthetic()
    idx = np.random.default_rng(seed).choice(len(y_train), n, replace=False)
    return x_train[idx], jax.nn.one_hot(y_train[idx], 10)


def digit_accuracy(predict):
    """``accuracy(state)`` on the held-out digits, ``predict(state, x)`` jitted."""
    _, _, x_test, y_test = data.digits_or_synthetic()
    predict = jax.jit(predict)
    return lambda state: float(
        jnp.mean(jnp.argmax(predict(state, x_test), -1) == y_test)
    )


def digit_batches(seed, n=64):
    """``batches(i) -> (i, (x, onehot))``: a fixed cycle of training batches."""
    x_train, y_train, _, _ = data.digits_or_synthetic()
    perm = np.random.default_rng(seed).permutation(len(y_train))
    n_batches = len(perm) // n

    def batches(i):
        idx = perm[(i % n_batches) * n : (i % n_batches + 1) * n]
        return jnp.asarray(i, jnp.int32), (
            x_train[idx],
            jax.nn.one_hot(y_train[idx], 10),
        )

    return batches


# ---------------------------------------------------------------- stax


@program("step", "standard_promotion", "digits")
def stax_momentum():
    """stax.serial(Dense, Relu, Dense, Relu, Dense, LogSoftmax) + momentum."""
    init_random_params, predict = stax.serial(
        stax.Dense(64),
        stax.Relu,
        stax.Dense(32),
        stax.Relu,
        stax.Dense(10),
        stax.LogSoftmax,
    )
    opt_init, opt_update, get_params = optimizers.momentum(0.05, mass=0.9)
    params = data.init(lambda key: init_random_params(key, (-1, 64))[1], 130)
    opt_state = opt_init(params)

    def loss(params, batch):
        inputs, targets = batch
        preds = predict(params, inputs)
        return -jnp.mean(jnp.sum(preds * targets, axis=1))

    def update(i, opt_state, batch):
        params = get_params(opt_state)
        value, grads = jax.value_and_grad(loss)(params, batch)
        return opt_update(i, grads, opt_state), value, grads

    def step(opt_state, i, batch):
        return update(i, opt_state, batch)

    def apply_update(opt_state, grads, i, batch):
        del batch
        return opt_update(i, grads, opt_state)

    batch = _batch(131)
    batches = digit_batches(132)
    return Instance(
        params,
        (batch,),
        loss,
        train_state=opt_state,
        step=step,
        update=apply_update,
        step_args=batches(0),
        batches=batches,
        accuracy=digit_accuracy(lambda state, x: predict(get_params(state), x)),
    )


# ---------------------------------------------------------------- from scratch


def init_random_params(scale, layer_sizes, rng):
    return [
        (
            scale * rng.randn(m, n).astype(np.float32),
            scale * rng.randn(n).astype(np.float32),
        )
        for m, n in zip(layer_sizes[:-1], layer_sizes[1:], strict=False)
    ]


def predict(params, inputs):
    activations = inputs
    for w, b in params[:-1]:
        outputs = jnp.dot(activations, w) + b
        activations = jnp.tanh(outputs)
    final_w, final_b = params[-1]
    logits = jnp.dot(activations, final_w) + final_b
    return logits - logsumexp(logits, axis=1, keepdims=True)


def scratch_loss(params, batch):
    inputs, targets = batch
    preds = predict(params, inputs)
    return -jnp.mean(jnp.sum(preds * targets, axis=1))


@program("step", "digits")
def scratch_sgd():
    """From-scratch MLP (tanh, logsumexp) and SGD written with jax.tree.map."""
    step_size = 0.1
    params = jax.tree.map(
        jnp.asarray,
        init_random_params(0.1, [64, 128, 64, 10], np.random.RandomState(1)),
    )

    def sgd(params, grads):
        return jax.tree.map(lambda p, g: p - step_size * g, params, grads)

    def update(params, i, batch):
        del i
        value, grads = jax.value_and_grad(scratch_loss)(params, batch)
        return sgd(params, grads), value, grads

    def apply_update(params, grads, i, batch):
        del i, batch
        return sgd(params, grads)

    batches = digit_batches(133)
    return Instance(
        params,
        (_batch(134),),
        scratch_loss,
        train_state=params,
        step=update,
        update=apply_update,
        step_args=batches(0),
        batches=batches,
        accuracy=digit_accuracy(predict),
    )
