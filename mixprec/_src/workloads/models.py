"""The models of ``mixprec demo``, ``mixprec bench`` and ``benchmarks/``, written once.

In plain ``jax.numpy`` with dict parameters (float32):

1. :func:`mlp_apply`: the model of the Keras mixed-precision guide,
   ``Dense(units, relu) -> Dense(units, relu) -> Dense(classes) -> softmax`` with
   the softmax in float32. Like a Keras model under a dtype policy it takes an
   optional ``policy``: the dense layers cast their float32 kernels and inputs to
   the policy's compute dtype and the softmax stays float32 (the guide's
   ``Activation('softmax', dtype='float32')``): *hand-written* mixed precision.
   With ``policy=None`` it is an ordinary float32 model.
2. :func:`lm_apply`: a GPT-style character-level transformer (pre-LayerNorm
   blocks, causal attention, GELU MLP) with no dtype handling at all.
3. :func:`cnn_apply`: a ResNet-style CNN (basic residual blocks, no batch norm).

Every matmul of the MLP and the LM goes through a ``dot`` argument (default
``jax.lax.dot_general``), so a benchmark swaps in another formulation of the
dots (bf16 x bf16 -> f32 by hand, mixprec's backend dots) without a second copy
of the model. The attention contractions are ``dot_general`` with batch
dimensions, as Flax writes them (``"bthd,bshd->bhts"``), so the ``jax.numpy``
and Flax models lower to the same dots.

:func:`flax_mlp`, :func:`flax_lm` and :func:`flax_cnn` build the same three in
Flax linen from the same configs (``dtype=<compute dtype>``,
``param_dtype=float32``); Flax is imported when they are called.

The models return log-probabilities: in float32, except the ``jax.numpy`` LM,
which returns them in the dtype it computes in; :func:`cross_entropy` computes
the loss in float32.
"""

from __future__ import annotations

import dataclasses
import functools as ft
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


Params = dict[str, Any]
# `dot(lhs, rhs, dimension_numbers) -> out`, as `jax.lax.dot_general`.
Dot = Callable[[jax.Array, jax.Array, Any], jax.Array]


def _lax_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any) -> jax.Array:
    return jax.lax.dot_general(lhs, rhs, dimension_numbers)


def _lead(v: jax.Array, ndim: int) -> jax.Array:
    """``v`` with leading unit axes up to rank ``ndim`` (explicit broadcasting, so
    the models run under ``jax_numpy_rank_promotion="raise"``)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def dense(
    params: Params,
    x: jax.Array,
    *,
    dot: Dot | None = None,
    compute_dtype: Any = None,
) -> jax.Array:
    """``x @ kernel + bias`` over the last axis of ``x``.

    Args:
      params: ``{"kernel": [in, out], "bias": [out]}``.
      x: ``[..., in]``.
      dot: the matmul (default ``jax.lax.dot_general``).
      compute_dtype: cast ``x``, the kernel and the bias to it first (``None``:
        no cast).

    Examples:
      >>> p = {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}
      >>> dense(p, jnp.ones((4, 3)), compute_dtype=jnp.bfloat16).dtype
      dtype(bfloat16)
    """
    kernel, bias = params["kernel"], params["bias"]
    if compute_dtype is not None:
        x, kernel, bias = (a.astype(compute_dtype) for a in (x, kernel, bias))
    y = (dot or _lax_dot)(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    return y + _lead(bias, y.ndim)


def _glorot_dense(key: jax.Array, fan_in: int, fan_out: int) -> Params:
    # Glorot-uniform kernel and zero bias, as Keras' Dense.
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    kernel = jax.random.uniform(
        key, (fan_in, fan_out), jnp.float32, minval=-limit, maxval=limit
    )
    return {"kernel": kernel, "bias": jnp.zeros((fan_out,), jnp.float32)}


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


# ----------------------------------------------------------------------------- MLP


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of the Keras-guide MLP.

    Attributes:
      units: width of the two hidden layers (the guide's 4096 on a GPU).
      in_features: input size (784 pixels).
      classes: number of classes.
    """

    units: int = 512
    in_features: int = 784
    classes: int = 10

    @property
    def sizes(self) -> str:
        """``"784-512-512-10"``."""
        return f"{self.in_features}-{self.units}-{self.units}-{self.classes}"


def mlp_init(key: jax.Array, config: MLPConfig) -> Params:
    """Float32 parameters of the Keras-guide MLP.

    Examples:
      >>> p = mlp_init(jax.random.key(0), MLPConfig(units=8))
      >>> p["dense_1"]["kernel"].shape, p["dense_1"]["kernel"].dtype
      ((784, 8), dtype('float32'))
    """
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "dense_1": _glorot_dense(k1, config.in_features, config.units),
        "dense_2": _glorot_dense(k2, config.units, config.units),
        "dense_logits": _glorot_dense(k3, config.units, config.classes),
    }


def mlp_apply(
    params: Params, x: jax.Array, *, policy: Any = None, dot: Dot | None = None
) -> jax.Array:
    """Log-probabilities of the Keras-guide MLP, always float32.

    Args:
      params: from :func:`mlp_init` (float32 master weights).
      x: ``[batch, in_features]``.
      policy: a ``mixprec.Policy`` (or anything with a ``compute_dtype``) applied
        layer by layer the Keras way, or ``None`` for plain float32 code.
      dot: the matmul (default ``jax.lax.dot_general``).

    Returns:
      ``float32[batch, classes]`` log-probabilities: the softmax runs in float32.

    Examples:
      >>> p = mlp_init(jax.random.key(0), MLPConfig(units=8))
      >>> jax.eval_shape(mlp_apply, p, jnp.zeros((2, 784))).dtype
      dtype('float32')
    """
    cd = None if policy is None else policy.compute_dtype
    h = jax.nn.relu(dense(params["dense_1"], x, dot=dot, compute_dtype=cd))
    h = jax.nn.relu(dense(params["dense_2"], h, dot=dot, compute_dtype=cd))
    logits = dense(params["dense_logits"], h, dot=dot, compute_dtype=cd)
    # The guide's `layers.Activation('softmax', dtype='float32')`.
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
    """Float32 parameters of the character-level transformer (GPT-2's init).

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

    def linear(fan_in: int, fan_out: int, std: float) -> Params:
        return {
            "kernel": normal((fan_in, fan_out), std),
            "bias": jnp.zeros((fan_out,), jnp.float32),
        }

    def norm() -> Params:
        return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,))}

    resid_std = 0.02 / math.sqrt(2 * config.num_layers)
    blocks = [
        {
            "ln_1": norm(),
            "qkv": linear(d, 3 * d, 0.02),
            "proj": linear(d, d, resid_std),
            "ln_2": norm(),
            "fc": linear(d, h, 0.02),
            "fc_out": linear(h, d, resid_std),
        }
        for _ in range(config.num_layers)
    ]
    return {
        "tok_emb": normal((config.vocab_size, d), 0.02),
        "pos_emb": normal((config.seq_len, d), 0.01),
        "blocks": blocks,
        "ln_f": norm(),
        "head": linear(d, config.vocab_size, 0.02),
    }


def _layer_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return y * _lead(p["scale"], x.ndim) + _lead(p["bias"], x.ndim)


def _attention(p: Params, x: jax.Array, num_heads: int, dot: Dot) -> jax.Array:
    b, t, d = x.shape
    hd = d // num_heads
    qkv = dense(p["qkv"], x, dot=dot).reshape(b, t, 3, num_heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [b, t, heads, hd]
    q = q / math.sqrt(hd)
    scores = dot(q, k, (((3,), (3,)), ((0, 2), (0, 2))))  # [b, heads, t, s]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool)).reshape(1, 1, t, t)
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = dot(weights, v, (((3,), (1,)), ((0, 1), (0, 2))))  # [b, heads, t, hd]
    out = jnp.swapaxes(out, 1, 2).reshape(b, t, d)
    return dense(p["proj"], out, dot=dot)


def lm_apply(
    params: Params, tokens: jax.Array, *, num_heads: int, dot: Dot | None = None
) -> jax.Array:
    """Next-character log-probabilities ``[batch, seq, vocab]``.

    Written plainly: no dtype handling anywhere. Its output dtype is that of its
    parameters (float32), or whatever ``mixprec.autocast`` decides.

    Args:
      params: from :func:`lm_init`.
      tokens: ``int32[batch, seq]``, ``seq <= config.seq_len``.
      num_heads: attention heads (``config.num_heads``).
      dot: the matmul (default ``jax.lax.dot_general``).

    Examples:
      >>> c = LMConfig(vocab_size=11, seq_len=8, d_model=16, num_heads=2)
      >>> p = jax.eval_shape(lambda k: lm_init(k, c), jax.random.key(0))
      >>> tokens = jnp.zeros((3, 8), jnp.int32)
      >>> jax.eval_shape(lambda p: lm_apply(p, tokens, num_heads=2), p).shape
      (3, 8, 11)
    """
    dot = dot or _lax_dot
    t = tokens.shape[1]
    x = params["tok_emb"][tokens] + _lead(params["pos_emb"][:t], tokens.ndim + 1)
    for block in params["blocks"]:
        x = x + _attention(block, _layer_norm(block["ln_1"], x), num_heads, dot)
        h = jax.nn.gelu(dense(block["fc"], _layer_norm(block["ln_2"], x), dot=dot))
        x = x + dense(block["fc_out"], h, dot=dot)
    logits = dense(params["head"], _layer_norm(params["ln_f"], x), dot=dot)
    return jax.nn.log_softmax(logits, axis=-1)


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
    params["head"] = _glorot_dense(next(keys), cin, config.classes)
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
    return jax.nn.log_softmax(dense(params["head"], pooled), axis=-1)


# ----------------------------------------------------------------------------- Flax


@ft.cache
def _flax_classes() -> dict[str, Any]:
    """The Flax linen modules, defined once on first use (imports flax)."""
    import flax.linen as nn

    class MLP(nn.Module):
        units: int
        classes: int = 10
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x: Any) -> Any:
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            x = nn.relu(nn.Dense(self.units, **kw)(x))
            x = nn.relu(nn.Dense(self.units, **kw)(x))
            logits = nn.Dense(self.classes, **kw)(x)
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    class Block(nn.Module):
        d_model: int
        heads: int
        mlp_ratio: int = 4
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x: Any, mask: Any) -> Any:
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            h = nn.LayerNorm(**kw)(x)
            h = nn.MultiHeadDotProductAttention(num_heads=self.heads, **kw)(
                h, h, mask=mask
            )
            x = x + h
            h = nn.LayerNorm(**kw)(x)
            h = nn.gelu(nn.Dense(self.mlp_ratio * self.d_model, **kw)(h))
            return x + nn.Dense(self.d_model, **kw)(h)

    class LM(nn.Module):
        vocab: int
        seq_len: int
        d_model: int
        heads: int
        layers: int
        mlp_ratio: int = 4
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            x = nn.Embed(self.vocab, self.d_model, **kw)(tokens)
            pos = self.param(
                "pos_emb", nn.initializers.normal(0.01), (self.seq_len, self.d_model)
            )
            x = x + pos[None, : tokens.shape[1]].astype(x.dtype)
            mask = nn.make_causal_mask(tokens)
            for _ in range(self.layers):
                x = Block(self.d_model, self.heads, self.mlp_ratio, dtype=self.dtype)(
                    x, mask
                )
            x = nn.LayerNorm(**kw)(x)
            logits = nn.Dense(self.vocab, **kw)(x)
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    class CNN(nn.Module):
        widths: tuple[int, ...]
        blocks: int
        classes: int = 10
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x: Any) -> Any:
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32, use_bias=False)
            x = nn.relu(nn.Conv(self.widths[0], (3, 3), **kw)(x))
            cin = self.widths[0]
            for s, width in enumerate(self.widths):
                for b in range(self.blocks):
                    stride = 2 if (s > 0 and b == 0) else 1
                    h = nn.relu(nn.Conv(width, (3, 3), strides=stride, **kw)(x))
                    h = nn.Conv(width, (3, 3), **kw)(h)
                    gain = self.param(f"gain_{s}_{b}", nn.initializers.zeros, ())
                    short = x
                    if b == 0 and (cin != width or s > 0):
                        short = nn.Conv(width, (1, 1), strides=stride, **kw)(x)
                    x = nn.relu(short + gain.astype(h.dtype) * h)
                    cin = width
            x = jnp.mean(x, axis=(1, 2))
            logits = nn.Dense(self.classes, dtype=self.dtype, param_dtype=jnp.float32)(
                x
            )
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    return {"mlp": MLP, "lm": LM, "cnn": CNN}


def flax_mlp(config: MLPConfig, dtype: Any = jnp.float32) -> Any:
    """The Keras-guide MLP as a Flax linen module computing in ``dtype``.

    Examples:
      >>> m = flax_mlp(MLPConfig(units=8), jnp.bfloat16)
      >>> p = m.init(jax.random.key(0), jnp.zeros((1, 784)))
      >>> m.apply(p, jnp.zeros((2, 784))).dtype
      dtype('float32')
    """
    return _flax_classes()["mlp"](
        units=config.units, classes=config.classes, dtype=dtype
    )


def flax_lm(config: LMConfig, dtype: Any = jnp.float32) -> Any:
    """The character-level transformer as a Flax linen module computing in ``dtype``.

    Examples:
      >>> c = LMConfig(vocab_size=11, seq_len=8, d_model=16, num_heads=2)
      >>> m = flax_lm(c)
      >>> p = m.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
      >>> m.apply(p, jnp.zeros((2, 8), jnp.int32)).shape
      (2, 8, 11)
    """
    return _flax_classes()["lm"](
        vocab=config.vocab_size,
        seq_len=config.seq_len,
        d_model=config.d_model,
        heads=config.num_heads,
        layers=config.num_layers,
        mlp_ratio=config.mlp_ratio,
        dtype=dtype,
    )


def flax_cnn(config: CNNConfig, dtype: Any = jnp.float32) -> Any:
    """The ResNet-style CNN as a Flax linen module computing in ``dtype``.

    Examples:
      >>> m = flax_cnn(CNNConfig(widths=(4,)))
      >>> p = m.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))
      >>> m.apply(p, jnp.zeros((2, 8, 8, 1))).shape
      (2, 10)
    """
    return _flax_classes()["cnn"](
        widths=config.widths,
        blocks=config.blocks_per_stage,
        classes=config.classes,
        dtype=dtype,
    )
