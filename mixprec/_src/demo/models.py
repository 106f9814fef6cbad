"""The demo's two models, written in plain ``jax.numpy`` with dict parameters.

1. :func:`mlp_apply` is the model of the Keras mixed-precision guide (seed 001):
   ``Dense(units, relu) -> Dense(units, relu) -> Dense(10) -> softmax in float32``.
   Like a Keras model under a dtype policy it takes an optional ``policy``: the
   dense layers cast their float32 kernels and their inputs to the policy's compute
   dtype, and the final softmax layer runs in float32 whatever the policy (the
   seed's ``Activation('softmax', dtype='float32')``). This is *hand-written*
   mixed precision. With ``policy=None`` it is an ordinary float32 model, which
   :func:`mixprec.autocast` can run in mixed precision instead.
2. :func:`lm_apply` is a small GPT-style character-level transformer written with
   no thought for precision at all; the demo runs it under ``mixprec.autocast``.

Both return float32 log-probabilities; losses are computed in float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp


Params = dict[str, Any]


# ----------------------------------------------------------------------------- MLP


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of the Keras-seed MLP.

    Attributes:
      units: width of the two hidden layers (4096 in the seed on a GPU, 64 on CPU).
      in_features: input size (784 pixels).
      classes: number of classes.
    """

    units: int = 512
    in_features: int = 784
    classes: int = 10


def _dense_init(key: jax.Array, fan_in: int, fan_out: int) -> Params:
    # Glorot-uniform kernel and zero bias, as Keras' Dense.
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    kernel = jax.random.uniform(
        key, (fan_in, fan_out), jnp.float32, minval=-limit, maxval=limit
    )
    return {"kernel": kernel, "bias": jnp.zeros((fan_out,), jnp.float32)}


def mlp_init(key: jax.Array, config: MLPConfig) -> Params:
    """Float32 parameters of the Keras-seed MLP.

    Examples:
      >>> p = mlp_init(jax.random.key(0), MLPConfig(units=8))
      >>> p["dense_1"]["kernel"].shape, p["dense_1"]["kernel"].dtype
      ((784, 8), dtype('float32'))
    """
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "dense_1": _dense_init(k1, config.in_features, config.units),
        "dense_2": _dense_init(k2, config.units, config.units),
        "dense_logits": _dense_init(k3, config.units, config.classes),
    }


def _lead(v: jax.Array, ndim: int) -> jax.Array:
    """``v`` with leading unit axes up to rank ``ndim`` (explicit broadcasting, so
    the models run under ``jax_numpy_rank_promotion="raise"``)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    return x if dtype is None else x.astype(dtype)


def _dense(params: Params, x: jax.Array, compute_dtype: Any) -> jax.Array:
    kernel = _cast(params["kernel"], compute_dtype)
    bias = _cast(params["bias"], compute_dtype)
    return _cast(x, compute_dtype) @ kernel + _lead(bias, x.ndim)


def mlp_apply(params: Params, x: jax.Array, *, policy: Any = None) -> jax.Array:
    """Log-probabilities of the Keras-seed MLP, always float32.

    Args:
      params: from :func:`mlp_init` (float32 master weights).
      x: ``[batch, 784]`` pixels.
      policy: a ``mixprec.Policy`` (or anything with a ``compute_dtype``) applied
        layer by layer the Keras way, or ``None`` for plain float32 code.

    Returns:
      ``float32[batch, classes]`` log-probabilities: the softmax layer runs in
      float32 (``dtype='float32'`` in the seed).

    Examples:
      >>> p = mlp_init(jax.random.key(0), MLPConfig(units=8))
      >>> jax.eval_shape(mlp_apply, p, jnp.zeros((2, 784))).dtype
      dtype('float32')
    """
    compute_dtype = None if policy is None else policy.compute_dtype
    h = jax.nn.relu(_dense(params["dense_1"], x, compute_dtype))
    h = jax.nn.relu(_dense(params["dense_2"], h, compute_dtype))
    logits = _dense(params["dense_logits"], h, compute_dtype)
    # The seed's `layers.Activation('softmax', dtype='float32')`.
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


# ----------------------------------------------------------------------------- LM


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Sizes of the character-level transformer.

    Attributes:
      vocab_size: number of characters.
      seq_len: context length.
      d_model: width of the residual stream.
      num_heads: attention heads (``d_model`` must divide evenly).
      num_layers: transformer blocks.
      mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
    """

    vocab_size: int = 81
    seq_len: int = 64
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"`LMConfig(d_model=...)` must be a multiple of `num_heads`, got "
                f"d_model={self.d_model} and num_heads={self.num_heads}."
            )

    @property
    def num_params(self) -> int:
        d, v = self.d_model, self.vocab_size
        block = (
            4 * d * d + 4 * d + 2 * self.mlp_ratio * d * d + (self.mlp_ratio + 5) * d
        )
        return v * d + self.seq_len * d + self.num_layers * block + 2 * d + d * v + v


def lm_init(key: jax.Array, config: LMConfig) -> Params:
    """Float32 parameters of the character-level transformer.

    Examples:
      >>> c = LMConfig(vocab_size=11, seq_len=8, d_model=16, num_heads=2)
      >>> p = jax.eval_shape(lambda k: lm_init(k, c), jax.random.key(0))
      >>> sum(x.size for x in jax.tree.leaves(p)) == c.num_params
      True
    """
    d, h = config.d_model, config.mlp_ratio * config.d_model
    keys = iter(jax.random.split(key, 3 + 4 * config.num_layers))

    def normal(shape: tuple[int, ...], std: float) -> jax.Array:
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    resid_std = 0.02 / math.sqrt(2 * config.num_layers)
    blocks = []
    for _ in range(config.num_layers):
        blocks.append(
            {
                "ln_1": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
                "qkv": {
                    "kernel": normal((d, 3 * d), 0.02),
                    "bias": jnp.zeros((3 * d,)),
                },
                "proj": {"kernel": normal((d, d), resid_std), "bias": jnp.zeros((d,))},
                "ln_2": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
                "fc": {"kernel": normal((d, h), 0.02), "bias": jnp.zeros((h,))},
                "fc_out": {
                    "kernel": normal((h, d), resid_std),
                    "bias": jnp.zeros((d,)),
                },
            }
        )
    return {
        "tok_emb": normal((config.vocab_size, d), 0.02),
        "pos_emb": normal((config.seq_len, d), 0.01),
        "blocks": blocks,
        "ln_f": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))},
        "head": {
            "kernel": normal((d, config.vocab_size), 0.02),
            "bias": jnp.zeros((config.vocab_size,)),
        },
    }


def _layer_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return y * _lead(p["scale"], x.ndim) + _lead(p["bias"], x.ndim)


def _linear(p: Params, x: jax.Array) -> jax.Array:
    return x @ p["kernel"] + _lead(p["bias"], x.ndim)


def _attention(p: Params, x: jax.Array, num_heads: int) -> jax.Array:
    b, t, d = x.shape
    hd = d // num_heads
    q, k, v = jnp.split(_linear(p["qkv"], x), 3, axis=-1)
    q, k, v = (a.reshape(b, t, num_heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((1, 1, t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    return _linear(p["proj"], out)


def lm_apply(params: Params, tokens: jax.Array, *, num_heads: int) -> jax.Array:
    """Next-character log-probabilities ``[batch, seq, vocab]``.

    Written plainly: no dtype handling anywhere. Its output dtype is that of its
    parameters (float32), or whatever ``mixprec.autocast`` decides.

    Examples:
      >>> c = LMConfig(vocab_size=11, seq_len=8, d_model=16, num_heads=2)
      >>> p = jax.eval_shape(lambda k: lm_init(k, c), jax.random.key(0))
      >>> tokens = jnp.zeros((3, 8), jnp.int32)
      >>> jax.eval_shape(lambda p: lm_apply(p, tokens, num_heads=2), p).shape
      (3, 8, 11)
    """
    t = tokens.shape[1]
    x = params["tok_emb"][tokens] + _lead(params["pos_emb"][:t], tokens.ndim + 1)
    for block in params["blocks"]:
        x = x + _attention(block, _layer_norm(block["ln_1"], x), num_heads)
        h = jax.nn.gelu(_linear(block["fc"], _layer_norm(block["ln_2"], x)))
        x = x + _linear(block["fc_out"], h)
    logits = _linear(params["head"], _layer_norm(params["ln_f"], x))
    return jax.nn.log_softmax(logits, axis=-1)


def cross_entropy(log_probs: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean negative log-likelihood, computed in float32.

    Examples:
      >>> lp = jnp.log(jnp.array([[0.25, 0.75]]))
      >>> round(float(cross_entropy(lp, jnp.array([1]))), 4)
      0.2877
    """
    log_probs = log_probs.astype(jnp.float32)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


# ----------------------------------------------------------------------------- CNN


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """Sizes of a ResNet-style CNN (basic residual blocks, no batch norm).

    Attributes:
      image_size: height = width of the input images.
      in_channels: input channels.
      widths: channels of each stage; every stage after the first halves the
        resolution.
      blocks_per_stage: residual blocks per stage.
      classes: number of classes.
    """

    image_size: int = 28
    in_channels: int = 1
    widths: tuple[int, ...] = (32, 64)
    blocks_per_stage: int = 1
    classes: int = 10


def _conv_init(key: jax.Array, k: int, cin: int, cout: int) -> jax.Array:
    std = math.sqrt(2.0 / (k * k * cin))  # He init for ReLU
    return std * jax.random.normal(key, (k, k, cin, cout), jnp.float32)


def cnn_init(key: jax.Array, config: CNNConfig) -> Params:
    """Float32 parameters of the ResNet-style CNN.

    Each residual branch ends in a learnable scalar gain initialised at zero
    (SkipInit), which makes deep stacks trainable without batch norm.

    Examples:
      >>> c = CNNConfig(widths=(8,))
      >>> p = jax.eval_shape(lambda k: cnn_init(k, c), jax.random.key(0))
      >>> p["stem"].shape
      (3, 3, 1, 8)
    """
    keys = iter(
        jax.random.split(key, 2 + 3 * len(config.widths) * config.blocks_per_stage)
    )
    params: Params = {
        "stem": _conv_init(next(keys), 3, config.in_channels, config.widths[0])
    }
    stages = []
    cin = config.widths[0]
    for stage, width in enumerate(config.widths):
        blocks = []
        for b in range(config.blocks_per_stage):
            block = {
                "conv_1": _conv_init(next(keys), 3, cin, width),
                "conv_2": _conv_init(next(keys), 3, width, width),
                "gain": jnp.zeros((), jnp.float32),
            }
            if b == 0 and (cin != width or stage > 0):  # projection shortcut
                block["shortcut"] = _conv_init(next(keys), 1, cin, width)
            blocks.append(block)
            cin = width
        stages.append(blocks)
    params["stages"] = stages
    params["head"] = _dense_init(next(keys), cin, config.classes)
    return params


def _conv(x: jax.Array, w: jax.Array, stride: int = 1) -> jax.Array:
    return jax.lax.conv_general_dilated(
        x,
        w,
        window_strides=(stride, stride),
        padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )


def cnn_apply(params: Params, images: jax.Array) -> jax.Array:
    """Class log-probabilities of the ResNet-style CNN for ``[N, H, W, C]`` images.

    Examples:
      >>> c = CNNConfig(widths=(8, 16))
      >>> p = jax.eval_shape(lambda k: cnn_init(k, c), jax.random.key(0))
      >>> jax.eval_shape(cnn_apply, p, jnp.zeros((2, 28, 28, 1))).shape
      (2, 10)
    """
    x = jax.nn.relu(_conv(images, params["stem"]))
    for s, blocks in enumerate(params["stages"]):
        for b, block in enumerate(blocks):
            stride = 2 if (s > 0 and b == 0) else 1
            h = jax.nn.relu(_conv(x, block["conv_1"], stride))
            h = _conv(h, block["conv_2"])
            shortcut = x
            if "shortcut" in block:
                shortcut = _conv(x, block["shortcut"], stride)
            x = jax.nn.relu(shortcut + block["gain"] * h)
    pooled = jnp.mean(x, axis=(1, 2))
    logits = pooled @ params["head"]["kernel"] + _lead(params["head"]["bias"], 2)
    return jax.nn.log_softmax(logits, axis=-1)
