"""Models, batches and the lowered program's products shared by the plan
tests (``test_plan_programs``, ``test_plan_param_paths``)."""

import re

import jax
import jax.numpy as jnp
import pytest
from helpers import executed_lines


D = 128  # every product at or over the float8 recipe's min_dim
F8 = {"float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2"}


def batch(n=128):
    """``(x, y)``, ``n`` rows of ``D`` features each."""
    k1, k2 = jax.random.split(jax.random.key(1))
    return jax.random.normal(k1, (n, D)), jax.random.normal(k2, (n, D))


def equinox_mlp():
    """``(loss, model)``: three ``eqx.nn.Linear`` of ``D`` in a list (tanh
    between them), the loss over a batch by ``jax.vmap``; skips without
    Equinox."""
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        layers: list

        def __init__(self, key):
            keys = jax.random.split(key, 3)
            self.layers = [eqx.nn.Linear(D, D, key=k) for k in keys]

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = jnp.tanh(layer(x))
            return self.layers[-1](x)

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return loss, Model(jax.random.key(0))


def hlo_dots(fn, *args, platform="cuda"):
    """The operand element types of each ``dot_general`` the lowered program
    of ``fn`` for ``platform`` executes (a called function's once per call)."""
    text = jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
    dots = []
    for line in executed_lines(text):
        if "stablehlo.dot_general" in line:
            ins = line.rsplit(" : ", 1)[1].split(" -> ")[0]
            dots.append(tuple(re.findall(r"tensor<(?:[\d?]+x)*(\w+)>", ins)))
    return dots
