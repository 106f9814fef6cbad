"""``examples/train_mnist_compact.py`` runs as users run it, on the shipped
MNIST digits, for a few steps: the compact state is the size it claims, trains
as well as float32 and survives a checkpoint round trip bit for bit."""

import importlib.util
import os
import sys

import pytest


# optax's AdamW raises a float to an int32 count: standard promotion, as users run.
pytestmark = pytest.mark.standard_promotion


def _example():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "examples", "train_mnist_compact.py")
    spec = importlib.util.spec_from_file_location("train_mnist_compact", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_mnist_compact"] = module
    spec.loader.exec_module(module)
    return module


def test_compact_mnist_example(capsys):
    results = _example().main(["--steps", "120"])
    out = capsys.readouterr().out
    assert "the same bits as without the break" in out
    # Progress as it trains, not silence until the table: five lines per run.
    for kind in ("float32", "naive bf16", "compact"):
        assert f"  {kind}: step 24/120, loss " in out
        assert f"  {kind}: step 120/120, loss " in out
    f32, naive, compact = results["float32"], results["naive bf16"], results["compact"]
    assert f32["bytes"] == pytest.approx(16.0, abs=0.01)
    assert naive["bytes"] == pytest.approx(8.0, abs=0.01)
    assert compact["bytes"] < 6.1
    assert compact["resumed_identical"] == 1.0
    # 120 steps reach about 0.90 test accuracy; the compact run within 2 points.
    assert f32["accuracy"] > 0.8
    assert abs(compact["accuracy"] - f32["accuracy"]) < 0.02
