"""Whole jitted train steps: gradient + optax update, as users write them.

Every step returns ``(new_state, loss, grads)``: the gradients its update used,
so that the test can check the update bit for bit against the float32
optimizer applied to the same gradients.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax import lax

from . import (
    Instance,
    attention,
    cnn,
    control,
    data,
    mlp,
    mnist,
    nlp,
    program,
    rnn,
    vae,
)


def _optax_step(loss, optimizer, *, has_aux=False):
    """step((params, opt_state), *batch) and its update alone."""

    def step(state, *batch):
        params, opt_state = state
        out, grads = jax.value_and_grad(loss, has_aux=has_aux)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        value = out[0] if has_aux else out
        return (optax.apply_updates(params, updates), opt_state), value, grads

    def update(state, grads, *batch):
        del batch
        params, opt_state = state
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, update


def _digit_batches(seed, n=64, image=False):
    x_train, y_train, _, _ = data.digits_or_synthetic()
    perm = np.random.default_rng(seed).permutation(len(y_train))
    n_batches = len(perm) // n

    def batches(i):
        idx = perm[(i % n_batches) * n : (i % n_batches + 1) * n]
        x = x_train[idx]
        return (x.reshape(-1, 8, 8, 1) if image else x), y_train[idx]

    return batches


def _digit_accuracy(predict, image=False):
    if image:
        return mnist.digit_accuracy(lambda s, x: predict(s, x.reshape(-1, 8, 8, 1)))
    return mnist.digit_accuracy(predict)


@program("step", "digits")
def step_sgd_mlp():
    """jnp MLP 64-64-32-10 + optax.sgd, whole step jitted."""
    params = mlp.init_mlp(140, [64, 64, 32, 10])
    optimizer = optax.sgd(0.1)
    step, update = _optax_step(mlp.mlp_loss, optimizer)
    batches = _digit_batches(141)
    return Instance(
        params,
        batches(0),
        mlp.mlp_loss,
        train_state=(params, jax.jit(optimizer.init)(params)),
        step=step,
        update=update,
        batches=batches,
        accuracy=_digit_accuracy(lambda s, x: mlp.mlp_apply(s[0], x)),
    )


class BNState(train_state.TrainState):
    batch_stats: Any = None


@program("step", "digits", "standard_promotion")
def step_momentum_cnn_batchnorm():
    """Flax TrainState (+ batch_stats) with optax.sgd(momentum=0.9, nesterov)."""
    model = cnn.FlaxCNN(classes=10)
    batches = _digit_batches(142, image=True)
    x, y = batches(0)
    variables = data.init(model.init, 143, x, train=False)
    state = BNState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=optax.sgd(0.1, momentum=0.9, nesterov=True),
    )
    loss = cnn.flax_cnn_loss(model)

    def step(state, x, y):
        def loss_fn(params):
            return loss(params, state.batch_stats, x, y)

        (value, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads).replace(batch_stats=stats)
        return state, value, grads

    def update(state, grads, x, y):
        del x, y
        return state.apply_gradients(grads=grads)

    def predict(state, x):
        return state.apply_fn(
            {"params": state.params, "batch_stats": state.batch_stats}, x, train=False
        )

    return Instance(
        variables["params"],
        (variables["batch_stats"], x, y),
        loss,
        has_aux=True,
        train_state=state,
        step=step,
        update=update,
        exact=lambda s: (s.step, s.params, s.opt_state),
        step_args=batches(0),
        batches=batches,
        accuracy=_digit_accuracy(predict, image=True),
    )


@program("step", "standard_promotion", "derived")
def step_adam_gpt():
    """A one-block GPT (tied embeddings) + optax.adam."""
    inst = nlp.gpt(layers=1)
    optimizer = optax.adam(3e-3)
    step, update = _optax_step(inst.loss, optimizer)
    inst.train_state = (inst.params, jax.jit(optimizer.init)(inst.params))
    inst.step, inst.update = step, update
    return inst


@program("step", "masked", "standard_promotion", "derived")
def step_adamw_clip_transformer():
    """Padded one-block transformer + optax.chain(clip_by_global_norm, adamw)."""
    inst = attention.transformer(blocks=1)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(2e-3, weight_decay=0.01)
    )
    step, update = _optax_step(inst.loss, optimizer)
    inst.train_state = (inst.params, jax.jit(optimizer.init)(inst.params))
    inst.step, inst.update = step, update
    return inst


@program("step", "standard_promotion", "derived")
def step_adamw_clip_vae():
    """Flax VAE ("mean"/"logvar" heads) + clip_by_global_norm + adamw, key per step."""
    inst = vae.vae_flax()
    optimizer = optax.chain(optax.clip_by_global_norm(5.0), optax.adamw(1e-3))
    step, update = _optax_step(inst.loss, optimizer)
    x, key = inst.args
    inst.train_state = (inst.params, jax.jit(optimizer.init)(inst.params))
    inst.step, inst.update = step, update
    inst.batches = lambda i: (x, jax.random.fold_in(key, i))
    return inst


@program("step", "standard_promotion")
def step_adam_equinox():
    """Equinox: eqx.filter_value_and_grad + optax.adam on the model itself."""
    model = data.eqx_init(
        lambda key: eqx.nn.MLP(
            16, 4, width_size=32, depth=2, activation=jax.nn.gelu, key=key
        ),
        146,
    )
    optimizer = optax.adam(1e-2)
    opt_state = jax.jit(optimizer.init)(eqx.filter(model, eqx.is_inexact_array))
    x, y = data.classification(147, 24, 16, 4)

    def loss(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(state, x, y):
        model, opt_state = state
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return (eqx.apply_updates(model, updates), opt_state), value, grads

    def update(state, grads, x, y):
        del x, y
        model, opt_state = state
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state

    params, static = eqx.partition(model, eqx.is_inexact_array)
    return Instance(
        params,
        (x, y),
        lambda p, x, y: loss(eqx.combine(p, static), x, y),
        train_state=(model, opt_state),
        step=step,
        update=update,
        jit=eqx.filter_jit,
    )


@program("step", "fn", "derived")
def step_dp_sgd():
    """DP-SGD: vmap per-example gradients, clipped, averaged, + optax.sgd momentum."""
    inst = control.per_example_grads()
    grads_fn = inst.loss
    optimizer = optax.sgd(0.1, momentum=0.9)

    def step(state, x, y):
        params, opt_state = state
        grads, norms = grads_fn(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jnp.mean(norms), grads

    def update(state, grads, x, y):
        del x, y
        params, opt_state = state
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    inst.train_state = (inst.params, jax.jit(optimizer.init)(inst.params))
    inst.step, inst.update = step, update
    inst.step_decreases = False  # its "loss" is the mean per-example grad norm
    return inst


@program("step", "standard_promotion")
def step_grad_accumulation():
    """Gradients accumulated over 4 micro-batches in lax.scan, then optax.adam.

    A gelu MLP: with relu, one unit changing sign under bfloat16 in an
    8-example micro-batch moves a bias gradient past bfloat16's tolerance.
    """
    params = mlp.init_mlp(148, [20, 32, 5])

    def loss(params, x, y):
        h = jax.nn.gelu(x @ params[0]["w"] + params[0]["b"])
        logits = h @ params[1]["w"] + params[1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    x, y = data.classification(149, 32, 20, 5)
    optimizer = optax.adam(1e-2)

    def accumulate(params, x, y):
        xs, ys = x.reshape(4, -1, x.shape[-1]), y.reshape(4, -1)

        def micro(acc, batch):
            value, grads = jax.value_and_grad(loss)(params, *batch)
            return jax.tree.map(jnp.add, acc, (value, grads)), None

        zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (value, grads), _ = lax.scan(micro, zeros, (xs, ys))
        return value / 4, jax.tree.map(lambda g: g / 4, grads)

    def step(state, x, y):
        params, opt_state = state
        value, grads = accumulate(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value, grads

    def update(state, grads, x, y):
        del x, y
        params, opt_state = state
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return Instance(
        params,
        (x, y),
        loss,
        train_state=(params, jax.jit(optimizer.init)(params)),
        step=step,
        update=update,
    )


@program("step", "standard_promotion", "derived")
def step_adafactor_lstm():
    """Flax LSTM classifier + optax.adafactor (factored second moments)."""
    inst = rnn.lstm_flax_rnn()
    optimizer = optax.adafactor(1e-2)
    step, update = _optax_step(inst.loss, optimizer)
    inst.train_state = (inst.params, jax.jit(optimizer.init)(inst.params))
    inst.step, inst.update = step, update
    return inst


@program("step", "digits", "standard_promotion")  # schedule-free mixes int and float
def step_schedule_free_compact_state_mlp():
    """jnp MLP + optax.contrib.schedule_free_adamw under int8 compact_state."""
    from mixprec.optax import compact_state, decode_compact_state

    params = mlp.init_mlp(146, [64, 64, 32, 10])
    # Schedule-free keeps `z`, a copy of the weights, beside its moments: the
    # compact state stores it at the weights' tier (float32 here), not as int8.
    optimizer = compact_state(
        optax.contrib.schedule_free_adamw(3e-3, warmup_steps=5),
        weights="float32",
        moments="int8",
    )
    step, update = _optax_step(mlp.mlp_loss, optimizer)
    batches = _digit_batches(147)

    def evaluated(state, x):
        params, opt_state = state
        eval_params = optax.contrib.schedule_free_eval_params(
            decode_compact_state(opt_state), params
        )
        return mlp.mlp_apply(eval_params, x)

    return Instance(
        params,
        batches(0),
        mlp.mlp_loss,
        train_state=(params, jax.jit(optimizer.init)(params)),
        step=step,
        update=update,
        batches=batches,
        accuracy=_digit_accuracy(evaluated),
    )
