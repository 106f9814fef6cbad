"""mixprec: mixed-precision training for JAX.

This module is the only public surface. Everything under ``mixprec._src`` is
private and may change without notice. Integrations with third-party libraries
live in their own public modules (``mixprec.optax``, ``mixprec.flax``,
``mixprec.equinox``, ``mixprec.haiku``, ``mixprec.orbax``) and are never imported
from here, so ``import mixprec`` needs only JAX and NumPy.

``import mixprec as jmp`` keeps code written against DeepMind's JMP working.

Names by concern: policies and casting (``Policy``, ``get_policy``,
``policy_scope``, ``cast_tree``, ...), loss scaling (``DynamicLossScale``,
``all_finite``, ...), autocast (``autocast``, ``float32_scope``,
``modify_mixlist``, ``register_rule``, ``Float8Recipe``, ...), training
(``value_and_grad``, ``grad``), and numerics (``explain``, ``diagnose``, ``plan``,
``Plan``).
"""

from importlib import metadata as _metadata

from ._src import _config  # noqa: F401  (reads MIXPREC_POLICY once)
from ._src._compat import warn_if_untested_jax as _warn_if_untested_jax
from ._src.autocast.api import autocast as autocast
from ._src.autocast.mixlist import modify_mixlist as modify_mixlist
from ._src.autocast.ops import (
    OpLists as OpLists,
    default_op_lists as default_op_lists,
    register_rule as register_rule,
)
from ._src.autocast.regions import (
    float32_scope as float32_scope,
    precision_scope as precision_scope,
)
from ._src.casting import (
    cast_to_full as cast_to_full,
    cast_to_half as cast_to_half,
    cast_tree as cast_tree,
    half_dtype as half_dtype,
    is_floating_array as is_floating_array,
)
from ._src.float8 import Float8Recipe as Float8Recipe
from ._src.loss_scale import (
    DynamicLossScale as DynamicLossScale,
    LossScale as LossScale,
    NoOpLossScale as NoOpLossScale,
    StaticLossScale as StaticLossScale,
    all_finite as all_finite,
    select_tree as select_tree,
)
from ._src.numerics.diagnose import (
    DiagnosisReport as DiagnosisReport,
    diagnose as diagnose,
)
from ._src.numerics.explain import (
    PrecisionReport as PrecisionReport,
    explain as explain,
)
from ._src.numerics.plan import plan as plan
from ._src.plan import Plan as Plan
from ._src.policy import (
    Policy as Policy,
    dtype_to_names as dtype_to_names,
    get_global_policy as get_global_policy,
    get_policy as get_policy,
    policy_scope as policy_scope,
    set_global_policy as set_global_policy,
)
from ._src.training import (
    grad as grad,
    value_and_grad as value_and_grad,
)


try:
    __version__ = _metadata.version("mixprec")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+unknown"

_warn_if_untested_jax()  # once, on a JAX newer than any tested release
