"""GPT-2 for benchmarks: one architecture, written three ways, from one NumPy init.

The architecture is GPT-2's: learned token and position embeddings, pre-LayerNorm
blocks (fused ``qkv`` projection with bias, causal softmax attention, output
projection, GELU MLP of width ``4 d``), a final LayerNorm and an output layer
tied to the token embedding (no bias). LayerNorm epsilon is ``1e-5`` (PyTorch's
and GPT-2's), GELU is the tanh approximation (``jax.nn.gelu``'s default, PyTorch's
``approximate="tanh"``).

* :func:`init`: float32 parameters as a nested dict of **NumPy** arrays, drawn
  from NumPy's ``default_rng``, so every process, framework and device starts
  from bit-identical weights (:func:`digest` proves it). JAX code puts them on
  the device with ``jax.device_put``; PyTorch copies them with
  ``torch.from_numpy``. The layout is the one Flax linen gives the module of
  :func:`flax_model`, so ``{"params": init(...)}`` are its variables.
* :func:`loss` / :func:`apply`: the model in plain ``jax.numpy``. With
  ``compute_dtype=None`` it is float32 code with no dtype handling at all (what
  ``mixprec.autocast`` is meant to take); with ``compute_dtype=jnp.bfloat16``
  it is mixed precision written by hand: every matmul casts its operands to
  bfloat16, LayerNorm statistics and the softmax run in float32, the residual
  stream is bfloat16 and the loss is float32.
  ``attention`` picks the attention: ``"einsum"`` (written out: scores,
  causal mask, softmax, weighted sum) or ``jax.nn.dot_product_attention`` with
  ``implementation`` ``"xla"``, ``"cudnn"`` or ``None`` (``"auto"``: JAX picks).
* :func:`flax_model`: the same network as a Flax linen module computing in
  ``dtype`` with float32 parameters (``nn.Dense``, ``nn.LayerNorm``,
  ``nn.Embed`` with ``attend`` for the tied output layer, and
  ``nn.dot_product_attention``).
* :func:`batch`: a fixed batch of token ids with a Zipf-like unigram
  distribution, so that ten steps visibly lower the loss.

:class:`GPT2Config` also counts the FLOPs of a training step the usual way
(``6 N + 12 L T d`` per token, :meth:`GPT2Config.flops_per_token`).
"""

from __future__ import annotations

import dataclasses
import functools as ft
import hashlib
import math
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike


__all__ = [
    "ATTENTIONS",
    "SMALL",
    "TINY",
    "GPT2Config",
    "apply",
    "batch",
    "cross_entropy",
    "digest",
    "flax_model",
    "init",
    "loss",
]

Params = dict[str, Any]

#: The values of ``attention=``: written out, or `jax.nn.dot_product_attention`
#: with ``implementation="xla"``, ``"cudnn"`` or ``None`` (``"auto"``).
ATTENTIONS = ("einsum", "xla", "cudnn", "auto")


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """Sizes of a GPT-2 model.

    Attributes:
      vocab_size: vocabulary (GPT-2's 50257 padded to 50304, a multiple of 64).
      seq_len: context length ``T``.
      d_model: width of the residual stream ``d``.
      num_heads: attention heads (``d_model`` must divide evenly).
      num_layers: transformer blocks ``L``.
      mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
      ln_eps: LayerNorm epsilon.

    Examples:
      >>> SMALL.num_layers, SMALL.d_model, SMALL.head_dim
      (12, 768, 64)
      >>> GPT2Config(d_model=10, num_heads=3)
      Traceback (most recent call last):
      ...
      ValueError: `GPT2Config(d_model=...)` must be a multiple of `num_heads`, ...
    """

    vocab_size: int = 50304
    seq_len: int = 1024
    d_model: int = 768
    num_heads: int = 12
    num_layers: int = 12
    mlp_ratio: int = 4
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"`GPT2Config({name}=...)` must be a positive integer, got "
                    f"{value!r}."
                )
        if self.d_model % self.num_heads:
            raise ValueError(
                "`GPT2Config(d_model=...)` must be a multiple of `num_heads`, got "
                f"d_model={self.d_model} and num_heads={self.num_heads}."
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.num_heads

    @property
    def num_params(self) -> int:
        """All parameters (the output layer is tied to the token embedding).

        Examples:
          >>> SMALL.num_params  # GPT-2 small with a 50304-token vocabulary
          124475904
        """
        d, h = self.d_model, self.mlp_ratio * self.d_model
        block = (
            2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        )
        return self.vocab_size * d + self.seq_len * d + self.num_layers * block + 2 * d

    @property
    def matmul_params(self) -> int:
        """Weights that take part in a matmul: ``qkv``, ``proj``, ``fc`` and
        ``fc_out`` kernels of every block, and the (tied) output layer. The
        embedding lookups, biases and norms are not matmuls.

        Examples:
          >>> SMALL.matmul_params
          123568128
        """
        d = self.d_model
        per_block = 3 * d * d + d * d + 2 * self.mlp_ratio * d * d
        return self.num_layers * per_block + d * self.vocab_size

    def flops_per_token(self) -> int:
        """FLOPs of one training step per token: ``6 N + 12 L T d``.

        ``6 N`` is the forward (``2 N``) and backward (``4 N``) multiply-adds of
        the matmul weights ``N`` (:attr:`matmul_params`); ``12 L T d`` those of
        the attention scores and weighted sums (``2 * 2 * T * d`` forward per
        layer, three times that with the backward), counted for the full
        ``T x T`` square as PaLM's and nanoGPT's model-FLOPs utilization do.

        Examples:
          >>> SMALL.flops_per_token()
          854654976
        """
        d, t, n_layers = self.d_model, self.seq_len, self.num_layers
        return 6 * self.matmul_params + 12 * n_layers * t * d


#: GPT-2 small, as benchmarked on a GPU.
SMALL = GPT2Config()
#: A few-layer, narrow GPT-2 that trains a step in well under a second on a CPU.
TINY = GPT2Config(vocab_size=512, seq_len=64, d_model=128, num_heads=4, num_layers=2)


# ----------------------------------------------------------------------------- init


def init(config: GPT2Config, seed: int = 0) -> Params:
    """Float32 parameters as NumPy arrays, in the layout of :func:`flax_model`.

    GPT-2's initialization: normal(0.02) for the embeddings and the kernels,
    normal(0.02 / sqrt(2 L)) for the two projections that write into the
    residual stream, zero biases, unit LayerNorm scales. Drawn with
    ``numpy.random.default_rng(seed)`` in a fixed order, so the arrays are the
    same bits in every process and on every machine.

    Args:
      config: the sizes.
      seed: the seed of NumPy's generator.

    Returns:
      ``{"wte": {"embedding"}, "wpe": {"embedding"}, "block_<i>": {"ln_1",
      "attn": {"qkv", "proj"}, "ln_2", "mlp": {"fc", "proj"}}, "ln_f"}`` of
      float32 NumPy arrays (kernels are ``[in, out]``).

    Examples:
      >>> p = init(TINY)
      >>> p["block_0"]["attn"]["qkv"]["kernel"].shape, p["wte"]["embedding"].dtype
      ((128, 384), dtype('float32'))
      >>> sum(a.size for a in jax.tree.leaves(p)) == TINY.num_params
      True
    """
    rng = np.random.default_rng(seed)
    d, h = config.d_model, config.mlp_ratio * config.d_model
    resid_std = 0.02 / math.sqrt(2 * config.num_layers)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    def dense(fan_in: int, fan_out: int, std: float) -> Params:
        return {
            "kernel": normal((fan_in, fan_out), std),
            "bias": np.zeros((fan_out,), np.float32),
        }

    def norm() -> Params:
        return {"scale": np.ones((d,), np.float32), "bias": np.zeros((d,), np.float32)}

    params: Params = {
        "wte": {"embedding": normal((config.vocab_size, d), 0.02)},
        "wpe": {"embedding": normal((config.seq_len, d), 0.02)},
    }
    for i in range(config.num_layers):
        params[f"block_{i}"] = {
            "ln_1": norm(),
            "attn": {"qkv": dense(d, 3 * d, 0.02), "proj": dense(d, d, resid_std)},
            "ln_2": norm(),
            "mlp": {"fc": dense(d, h, 0.02), "proj": dense(h, d, resid_std)},
        }
    params["ln_f"] = norm()
    return params


def digest(params: Mapping[str, Any]) -> str:
    """A short hash of the names, shapes, dtypes and bytes of a parameter tree.

    Two processes (or frameworks) that report the same digest start from
    bit-identical weights.

    Examples:
      >>> digest(init(TINY)) == digest(init(TINY)), digest(init(TINY))[:4] != ""
      (True, True)
    """
    h = hashlib.blake2b(digest_size=8)
    leaves = jax.tree_util.tree_flatten_with_path(dict(params))[0]
    for path, leaf in leaves:
        arr = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}:{arr.dtype}:{arr.shape};".encode())
        h.update(arr.view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def batch(
    config: GPT2Config, batch_size: int, seed: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """A fixed batch of inputs and next-token targets, ``int32[batch, T]`` each.

    Tokens follow a Zipf-like unigram law (``p(k) ~ 1 / (k + 10)``, the ids
    shuffled), as words do, so the loss falls from ``log(vocab_size)`` within a
    few steps instead of staying flat as it does on uniform noise.

    Examples:
      >>> x, y = batch(TINY, 2)
      >>> x.shape, x.dtype, bool((x[:, 1:] == y[:, :-1]).all())
      ((2, 64), dtype('int32'), True)
    """
    if batch_size < 1:
        raise ValueError(f"`batch(batch_size=...)` must be >= 1, got {batch_size}.")
    rng = np.random.default_rng(seed)
    v = config.vocab_size
    p = 1.0 / (np.arange(v, dtype=np.float64) + 10.0)
    ids = rng.permutation(v)
    tokens = ids[rng.choice(v, size=(batch_size, config.seq_len + 1), p=p / p.sum())]
    tokens = tokens.astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------- jax.numpy


def _cast(x: jax.Array, dtype: DTypeLike | None) -> jax.Array:
    """``x`` in ``dtype``; ``None`` leaves it alone (and leaves no equation)."""
    return x if dtype is None else x.astype(dtype)


def _lead(v: jax.Array, ndim: int) -> jax.Array:
    """``v`` with leading unit axes up to rank ``ndim`` (explicit broadcasting, so
    the model runs under ``jax_numpy_rank_promotion="raise"``)."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def _dense(p: Params, x: jax.Array, cd: DTypeLike | None) -> jax.Array:
    y = _cast(x, cd) @ _cast(p["kernel"], cd)
    return y + _lead(_cast(p["bias"], cd), y.ndim)


def _layer_norm(p: Params, x: jax.Array, eps: float, cd: DTypeLike | None) -> jax.Array:
    # Statistics in float32 whatever the compute dtype; the output in it.
    xf = x if cd is None else x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    y = y * _lead(p["scale"], y.ndim) + _lead(p["bias"], y.ndim)
    return _cast(y, cd)


def _attention(
    p: Params,
    x: jax.Array,
    config: GPT2Config,
    cd: DTypeLike | None,
    attention: str,
) -> jax.Array:
    b, t, d = x.shape
    heads, hd = config.num_heads, config.head_dim
    qkv = _dense(p["qkv"], x, cd).reshape(b, t, 3, heads, hd)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [b, t, heads, hd]
    if attention == "einsum":
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
        if cd is not None:
            scores = scores.astype(jnp.float32)  # the softmax in float32
        causal = jnp.tril(jnp.ones((t, t), dtype=bool)).reshape(1, 1, t, t)
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = _cast(jax.nn.softmax(scores, axis=-1), cd)
        out = jnp.einsum("bhts,bshd->bthd", weights, v)
    else:
        impls: dict[str, Literal["xla", "cudnn"] | None] = {
            "xla": "xla",
            "cudnn": "cudnn",
            "auto": None,
        }
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=impls[attention]
        )
    return _dense(p["proj"], out.reshape(b, t, d), cd)


def apply(
    params: Params,
    tokens: jax.Array,
    *,
    config: GPT2Config,
    compute_dtype: DTypeLike | None = None,
    attention: str = "einsum",
) -> jax.Array:
    """Next-token logits ``[batch, T, vocab]`` of the ``jax.numpy`` GPT-2.

    Args:
      params: from :func:`init` (NumPy or JAX arrays; float32).
      tokens: ``int32[batch, t]`` with ``t <= config.seq_len``.
      config: the sizes.
      compute_dtype: ``None``: plain float32 code, no casts anywhere. A 16-bit
        dtype: mixed precision by hand (matmuls and the residual stream in it;
        LayerNorm statistics and the softmax of ``"einsum"`` attention in
        float32).
      attention: one of :data:`ATTENTIONS`.

    Returns:
      The logits, in ``compute_dtype`` (float32 when it is ``None``).

    Raises:
      ValueError: for an unknown ``attention``.

    Examples:
      >>> p = init(TINY)
      >>> x, _ = batch(TINY, 2)
      >>> jax.eval_shape(ft.partial(apply, config=TINY), p, x).dtype
      dtype('float32')
      >>> f = ft.partial(apply, config=TINY, compute_dtype=jnp.bfloat16)
      >>> jax.eval_shape(f, p, x)
      ShapeDtypeStruct(shape=(2, 64, 512), dtype=bfloat16)
    """
    if attention not in ATTENTIONS:
        raise ValueError(
            f"`gpt2.apply(..., attention=...)` must be one of {ATTENTIONS}, got "
            f"{attention!r}."
        )
    cd = None if compute_dtype is None else jnp.dtype(compute_dtype)
    t = tokens.shape[1]
    wte = params["wte"]["embedding"]
    x = wte[tokens] + _lead(params["wpe"]["embedding"][:t], tokens.ndim + 1)
    x = _cast(x, cd)
    for i in range(config.num_layers):
        blk = params[f"block_{i}"]
        h = _layer_norm(blk["ln_1"], x, config.ln_eps, cd)
        x = x + _attention(blk["attn"], h, config, cd, attention)
        h = _layer_norm(blk["ln_2"], x, config.ln_eps, cd)
        h = jax.nn.gelu(_dense(blk["mlp"]["fc"], h, cd))
        x = x + _dense(blk["mlp"]["proj"], h, cd)
    x = _layer_norm(params["ln_f"], x, config.ln_eps, cd)
    return x @ _cast(wte, cd).T


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token negative log-likelihood, computed in float32.

    Examples:
      >>> logits = jnp.log(jnp.array([[[0.25, 0.75]]]))
      >>> round(float(cross_entropy(logits, jnp.array([[1]]))), 4)
      0.2877
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def loss(
    params: Params,
    tokens: jax.Array,
    targets: jax.Array,
    *,
    config: GPT2Config,
    compute_dtype: DTypeLike | None = None,
    attention: str = "einsum",
) -> jax.Array:
    """The training loss of :func:`apply`: float32 cross-entropy of its logits.

    Examples:
      >>> x, y = batch(TINY, 2)
      >>> l = jax.jit(ft.partial(loss, config=TINY))(init(TINY), x, y)
      >>> l.dtype, bool(abs(l - np.log(TINY.vocab_size)) < 0.5)
      (dtype('float32'), True)
    """
    logits = apply(
        params, tokens, config=config, compute_dtype=compute_dtype, attention=attention
    )
    return cross_entropy(logits, targets)


# ----------------------------------------------------------------------------- Flax


@ft.cache
def _flax_class() -> Any:
    """The Flax linen GPT-2, defined on first use (imports flax)."""
    import flax.linen as nn

    class Attention(nn.Module):
        config: GPT2Config
        dtype: Any

        @nn.compact
        def __call__(self, x: Any, mask: Any) -> Any:
            b, t, d = x.shape
            c = self.config
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            qkv = nn.Dense(3 * d, name="qkv", **kw)(x)
            qkv = qkv.reshape(b, t, 3, c.num_heads, c.head_dim)
            out = nn.dot_product_attention(
                qkv[:, :, 0],
                qkv[:, :, 1],
                qkv[:, :, 2],
                mask=mask,
                deterministic=True,
                dtype=self.dtype,
            )
            return nn.Dense(d, name="proj", **kw)(out.reshape(b, t, d))

    class Block(nn.Module):
        config: GPT2Config
        dtype: Any

        @nn.compact
        def __call__(self, x: Any, mask: Any) -> Any:
            c = self.config
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            h = nn.LayerNorm(epsilon=c.ln_eps, name="ln_1", **kw)(x)
            x = x + Attention(c, self.dtype, name="attn")(h, mask)
            h = nn.LayerNorm(epsilon=c.ln_eps, name="ln_2", **kw)(x)
            h = MLP(c, self.dtype, name="mlp")(h)
            return x + h

    class MLP(nn.Module):
        config: GPT2Config
        dtype: Any

        @nn.compact
        def __call__(self, x: Any) -> Any:
            c = self.config
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            h = nn.gelu(nn.Dense(c.mlp_ratio * c.d_model, name="fc", **kw)(x))
            return nn.Dense(c.d_model, name="proj", **kw)(h)

    class GPT2(nn.Module):
        """GPT-2 in Flax linen; returns logits in ``dtype``."""

        config: GPT2Config
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, tokens: Any) -> Any:
            c = self.config
            kw = dict(dtype=self.dtype, param_dtype=jnp.float32)
            init = nn.initializers.normal(0.02)
            wte = nn.Embed(
                c.vocab_size, c.d_model, embedding_init=init, name="wte", **kw
            )
            wpe = nn.Embed(c.seq_len, c.d_model, embedding_init=init, name="wpe", **kw)
            t = tokens.shape[1]
            x = wte(tokens) + wpe(jnp.arange(t))[None]
            mask = nn.make_causal_mask(tokens)
            for i in range(c.num_layers):
                x = Block(c, self.dtype, name=f"block_{i}")(x, mask)
            x = nn.LayerNorm(epsilon=c.ln_eps, name="ln_f", **kw)(x)
            return wte.attend(x)

    return GPT2


def flax_model(config: GPT2Config, dtype: DTypeLike = jnp.float32) -> Any:
    """GPT-2 as a Flax linen module computing in ``dtype`` (float32 parameters).

    Its variables are ``{"params": init(config)}``: the same tree as
    :func:`init` gives. With ``dtype=jnp.float32`` it computes what
    :func:`apply` does (up to rounding: Flax's LayerNorm computes the variance
    as ``E[x^2] - E[x]^2``).

    Examples:
      >>> m = flax_model(TINY)
      >>> x, _ = batch(TINY, 2)
      >>> shapes = jax.eval_shape(m.init, jax.random.key(0), x)["params"]
      >>> jax.tree.structure(shapes) == jax.tree.structure(init(TINY))
      True
    """
    return _flax_class()(config=config, dtype=jnp.dtype(dtype))
