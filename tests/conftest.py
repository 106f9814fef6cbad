"""Test configuration shared by every test module (the root conftest.py gives
eight CPU devices).

Strict dtype promotion turns silent ``bfloat16 + float32 -> float32`` upcasts into
errors, which is exactly the class of bug mixed precision code hides. Tests that
exercise third-party code relying on implicit promotion opt out with
``@pytest.mark.standard_promotion``.
"""

import jax
import pytest


jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    mode = (
        "standard"
        if request.node.get_closest_marker("standard_promotion")
        else "strict"
    )
    with jax.numpy_dtype_promotion(mode):
        yield


def pytest_collection_modifyitems(config, items):
    del config
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
