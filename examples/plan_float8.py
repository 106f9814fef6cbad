"""A precision plan for float8: which matmuls of a model float8 may run.

A small transformer language model (mixprec's demo LM) whose layer ``head``
reads a residual stream with a few massive channels (1e5 times the rest, as
large language models grow them). Tensorwise float8 scales each operand by
its largest value, so in that one layer every other value flushes to zero;
everywhere else float8 is fine. ``mixprec.plan`` measures each matmul site
and keeps that layer out of float8::

    python examples/plan_float8.py            # plan, print, save, train a step
    mixprec plan examples/plan_float8.py:loss -o plan.json
    mixprec inspect examples/plan_float8.py:loss --plan plan.json

``loss_example_args()`` is the hook the command line calls for inputs.
"""

from __future__ import annotations

import os
import sys
import tempfile

import jax
import jax.numpy as jnp

import mixprec
from mixprec._src.workloads import models


CONFIG = models.LMConfig(vocab_size=256, seq_len=64, d_model=128, num_heads=4)
MASSIVE = 1e5  # the outliers' scale over the rest of the stream


def loss(params, tokens):
    """Next-token cross-entropy of :func:`lm_logits`."""
    logits = lm_logits(params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def lm_logits(params, tokens):
    """mixprec's demo LM (``workloads/models.py``) with a named scope per
    layer, and a few massive channels in the stream the head reads (a fixed
    gain; the head's weights for them are small, so the logits are of order
    one, as in a trained model)."""
    t = tokens.shape[1]
    x = params["tok_emb"][tokens] + params["pos_emb"][:t][None]
    for i, block in enumerate(params["blocks"]):
        with jax.named_scope(f"block_{i}/attn"):
            h = models._layer_norm(block["ln_1"], x)
            x = x + models._attention(block, h, CONFIG.num_heads, models._lax_dot)
        with jax.named_scope(f"block_{i}/mlp"):
            h = models._layer_norm(block["ln_2"], x)
            h = jax.nn.gelu(models.dense(block["fc"], h))
            x = x + models.dense(block["fc_out"], h)
    h = models._layer_norm(params["ln_f"], x)
    gain = jnp.ones(CONFIG.d_model).at[:4].set(MASSIVE)
    with jax.named_scope("head"):
        return models.dense(params["head"], h * gain[None, None, :])


def init(key):
    params = models.lm_init(key, CONFIG)
    head = params["head"]["kernel"] * 25  # logits of order one
    params["head"]["kernel"] = head.at[:4].multiply(1 / MASSIVE)
    return params


def loss_example_args():
    params = init(jax.random.key(0))
    shape = (8, CONFIG.seq_len + 1)
    tokens = jax.random.randint(jax.random.key(1), shape, 0, CONFIG.vocab_size)
    return params, tokens


def main(argv: list[str]) -> int:
    del argv
    params, tokens = loss_example_args()
    plan = mixprec.plan(loss, params, tokens)
    print(plan)
    path = os.path.join(tempfile.mkdtemp(), "plan.json")
    plan.save(path)
    plan = mixprec.Plan.load(path)
    grads = jax.jit(jax.grad(mixprec.autocast(loss, plan)))(params, tokens)
    ref = jax.grad(loss)(params, tokens)
    worst = max(
        float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True)
    )
    print(f"saved {path}; gradients under the plan vs float32: worst leaf {worst:.3f}")
    head = [s for s in plan.sites if s.layer == "head"]
    print("head:", head[0].policy if head else "(no site)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
