"""The scale-out benchmark (``benchmarks/bench_scaleout.py``) at its tiny size.

Nothing here is timed: the script runs four variants for one step on 8 CPU
devices in its own process, and the test reads what the JSON says: the
environment, the collectives after SPMD partitioning by kind and dtype, and the
losses against float32's.
"""

import json
import os
import subprocess
import sys

import pytest


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "benchmarks", "bench_scaleout.py")


# One process, eight XLA compiles of small programs: minutes on two cores. The
# default run uses the script's HLO reader (tests/test_multidevice.py).
@pytest.mark.slow
@pytest.mark.long
def test_tiny_run_writes_json_and_follows_the_reduce_dtype(tmp_path):
    out = tmp_path / "scaleout.json"
    env = dict(
        os.environ,
        PYTHONPATH=_ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
    )
    variants = "float32,hand_bf16,whole_step_rf32,whole_step_rbf16"
    proc = subprocess.run(
        [sys.executable, _SCRIPT, "--size", "tiny", "--steps", "1"]
        + ["--variants", variants, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    env_rec = data["environment"]
    assert env_rec["jax"] and env_rec["date"] and len(env_rec["devices"]) == 8
    assert "cpu_flags" in env_rec and env_rec["cpu_bf16"] == "native"
    assert (tmp_path / "scaleout.md").read_text().startswith("| workload |")
    for workload in ("fsdp", "tp_mlp"):
        rows = {r["variant"]: r for r in data["results"][workload]}
        assert list(rows) == variants.split(",")
        ref = rows["float32"]["losses"][0]
        for name, row in rows.items():
            assert row["params_float32"], (workload, name)
            assert row["temp_bytes"] is not None and row["temp_bytes"] >= 0
            # The first loss: the same float32 weights, bfloat16's tolerance.
            assert abs(row["losses"][0] - ref) <= 1e-2 * abs(ref), (workload, name)
        # float32 moves only float32; the whole step under autocast reduces
        # its weight gradients in the chosen dtype: with bfloat16, fewer
        # float32 reduction bytes than with float32 and some bfloat16 ones.
        f32 = rows["float32"]["collectives"]
        assert all(set(v) <= {"f32", "s32"} for v in f32.values()), f32
        r32 = rows["whole_step_rf32"]["collectives"]["all-reduce"]
        r16 = rows["whole_step_rbf16"]["collectives"]["all-reduce"]
        assert "bf16" not in r32, r32
        assert r16.get("bf16", 0) > 0 and r16.get("f32", 0) < r32["f32"], (r16, r32)
