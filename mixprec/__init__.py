"""mixprec: mixed-precision training for JAX.

This module is the only public surface. Everything under ``mixprec._src`` is
private and may change without notice. Integrations with third-party libraries
live in their own public modules (``mixprec.optax``, ``mixprec.flax``,
``mixprec.equinox``, ``mixprec.haiku``, ``mixprec.orbax``) and are never imported
from here, so ``import mixprec`` needs only JAX and NumPy.

``import mixprec as jmp`` keeps code written against DeepMind's JMP working.
"""

import importlib.metadata

# --- core: policies, casting, loss scaling -----------------------------------
from ._src.casting import (
    cast_to_full as cast_to_full,
    cast_to_half as cast_to_half,
    cast_tree as cast_tree,
    half_dtype as half_dtype,
    is_floating_array as is_floating_array,
)
from ._src.loss_scale import (
    DynamicLossScale as DynamicLossScale,
    LossScale as LossScale,
    NoOpLossScale as NoOpLossScale,
    StaticLossScale as StaticLossScale,
    all_finite as all_finite,
    select_tree as select_tree,
)
from ._src.policy import (
    Policy as Policy,
    get_global_policy as get_global_policy,
    get_policy as get_policy,
    policy_scope as policy_scope,
    set_global_policy as set_global_policy,
)
from ._src import _config  # noqa: F401  (reads MIXPREC_POLICY once)

# --- autocast -----------------------------------------------------------------

# --- training: loss-scaled gradients ------------------------------------------
from ._src.training import (
    grad as grad,
    value_and_grad as value_and_grad,
)

# --- numerics: explain and diagnose -------------------------------------------


try:
    __version__ = importlib.metadata.version("mixprec")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"
