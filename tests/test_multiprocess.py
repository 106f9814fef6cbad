"""Loss scaling across processes, on JAX's own multi-process runtime.

Two processes on this machine (coordinator on 127.0.0.1, CPU collectives over
gloo, 4 CPU devices each: 8 global devices) run `multiprocess_worker.py`; a
third, alone with 8 devices, restores their checkpoint. What each process saw
comes back as JSON (statistics, flags, digests of every shard it holds), and
the tests below compare processes and runs. Each run is bounded: a process that
fails or outlives `TIMEOUT_S` gets every process of its run killed.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close


# Five processes, each starting JAX and compiling: minutes on two cores. The
# default run checks the same loss scaling, skips and checkpoints on one
# process with eight devices (tests/test_multidevice.py, tests/test_orbax.py).
pytestmark = pytest.mark.long

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 240
N_DEVICES = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 25) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-n:])


def _run(phase: str, out: Path, num_processes: int, *, attempts: int = 2) -> list:
    """Runs one phase on ``num_processes`` processes; returns their records."""
    for attempt in range(attempts):
        port = _free_port()
        # The children's own device count, not the parent's eight.
        flags = f"--xla_force_host_platform_device_count={N_DEVICES // num_processes}"
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
        logs = [out / f"{phase}-{pid}.log" for pid in range(num_processes)]
        procs = []
        try:
            for pid, log in enumerate(logs):
                cmd = [sys.executable, str(WORKER), phase, str(out)]
                cmd += ["--process-id", str(pid), "--num-processes", str(num_processes)]
                cmd += ["--port", str(port)]
                with open(log, "w") as f:
                    procs.append(
                        subprocess.Popen(
                            cmd, env=env, stdout=f, stderr=subprocess.STDOUT
                        )
                    )
            deadline = time.monotonic() + TIMEOUT_S
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # one failed: the others would wait for it forever
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            for p in procs:  # our own children only
                if p.poll() is None:
                    p.kill()
                p.wait()
        codes = [p.returncode for p in procs]
        if all(c == 0 for c in codes):
            return [
                json.loads((out / f"{phase}-{pid}.json").read_text())
                for pid in range(num_processes)
            ]
        tails = [_tail(log) for log in logs]
        if attempt + 1 < attempts and any("Failed to add port" in t for t in tails):
            continue  # the free port was taken before the coordinator bound it
        report = "\n".join(
            f"--- process {pid} (exit code {c}; killed if negative) ---\n{t}"
            for pid, (c, t) in enumerate(zip(codes, tails, strict=True))
        )
        pytest.fail(
            f"phase {phase!r} on {num_processes} process(es) failed or ran past "
            f"{TIMEOUT_S} s:\n{report}"
        )
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    started = time.monotonic()
    result = {
        "out": out,
        "train": _run("train", out, 2),
        "single": _run("resume_single", out, 1)[0],
        "multi": _run("resume_multi", out, 2),
    }
    result["seconds"] = time.monotonic() - started
    return result


def _merge(*digests):
    """One {path: {shard index: digest}} from several processes' partial views.

    A shard held by both processes (a replicated value) must agree.
    """
    merged = {}
    for digest in digests:
        for path, shards in digest.items():
            into = merged.setdefault(path, {})
            for index, h in shards.items():
                assert h != "replicas differ", (path, index)
                assert into.setdefault(index, h) == h, f"{path}[{index}] differs"
    return merged


def test_two_processes_share_eight_devices(runs):
    for pid, rec in enumerate(runs["train"]):
        assert (rec["process_index"], rec["process_count"]) == (pid, 2)
        assert rec["local_devices"] == 4
        # Rows 32-63 of a batch and mesh positions 4-7 belong to process 1.
        assert rec["mesh_processes"] == [0] * 4 + [1] * 4
    single = runs["single"]
    assert (single["process_count"], single["local_devices"]) == (1, 8)


# ---- data parallel (jit over global arrays) ---------------------------------------


def test_data_parallel_inf_in_one_process_skips_on_every_device(runs):
    p0, p1 = (rec["dp"] for rec in runs["train"])
    for step, (a, b) in enumerate(zip(p0, p1, strict=True)):
        # Both processes saw the same verdict, scale, counters and parameters,
        # bit for bit (every local replica too: `_merge` checks).
        assert a["stats"] == b["stats"], step
        assert a["grads_finite"] == b["grads_finite"], step
        _merge(a["params"], b["params"])
        assert a["params"] == b["params"], step
    finite = [s["grads_finite"] for s in p0]
    assert finite == [True, True, True, False, True, True]
    assert [s["stats"]["last_finite"] for s in p0] == finite
    assert [s["stats"]["num_skipped"] for s in p0] == [0, 0, 0, 1, 1, 1]
    # period 2: grow after two finite steps, back off on the inf.
    scales = [s["stats"]["loss_scale"] for s in p0]
    assert scales == [2.0**12, 2.0**13, 2.0**13, 2.0**12, 2.0**12, 2.0**13]
    assert p0[3]["params"] == p0[2]["params"]  # the skipped step changed nothing
    assert p0[4]["params"] != p0[3]["params"]


def test_data_parallel_on_two_processes_matches_one_process(runs):
    two, one = runs["train"][0]["dp"], runs["single"]["dp"]
    assert [s["stats"] for s in two] == [s["stats"] for s in one]
    assert [s["grads_finite"] for s in two] == [s["grads_finite"] for s in one]
    # Not bit for bit: gloo's all-reduce adds the 8 partial gradients in another
    # order than the in-process one. float16 compute: float16's tolerance.
    for a, b in zip(two, one, strict=True):
        actual = {k: np.asarray(v, np.float32) for k, v in a["params_values"].items()}
        ref = {k: np.asarray(v, np.float32) for k, v in b["params_values"].items()}
        assert_trees_close(actual, ref, dtype=jnp.float16)


# ---- data parallel under autocast --------------------------------------------------

_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def test_autocast_reductions_and_skips_agree_across_processes(runs):
    a, b = (rec["autocast"] for rec in runs["train"])
    assert sorted(a) == sorted(b) and len(a) == 6
    for key in a:
        policy, where, formulation, reduce = key.split("/")
        del policy, where, formulation
        want = _SHORT[reduce.removeprefix("r=")]
        # The partitioned program, the same on both processes: the weight
        # matrices' gradients (16 x 32 + 32 x 16 elements) are all-reduced in
        # the policy's reduce dtype. Bias gradients (sums, not products) and the
        # loss-scale statistics stay float32: 48 + a few elements.
        assert a[key]["collectives"] == b[key]["collectives"], key
        reductions = a[key]["collectives"]["all-reduce"]
        weights = 16 * 32 + 32 * 16
        if want == "f32":
            assert set(reductions) == {"f32"}, (key, reductions)
            assert reductions["f32"] >= 4 * weights, (key, reductions)
        else:
            assert set(reductions) == {want, "f32"}, (key, reductions)
            assert reductions[want] == 2 * weights, (key, reductions)
            assert reductions["f32"] < 4 * 64, (key, reductions)
        for step, (sa, sb) in enumerate(
            zip(a[key]["steps"], b[key]["steps"], strict=True)
        ):
            # The same verdict, scale and parameters, bit for bit, in both.
            assert sa["stats"] == sb["stats"], (key, step)
            assert sa["grads_finite"] == sb["grads_finite"], (key, step)
            _merge(sa["params"], sb["params"])
            assert sa["params"] == sb["params"], (key, step)
            assert sa["dtypes"] == ["float32"], key
        steps = a[key]["steps"]
        # The inf in process 1's rows at step 2: both processes skip it.
        assert [s["grads_finite"] for s in steps] == [True, True, False, True], key
        assert [s["stats"]["num_skipped"] for s in steps] == [0, 0, 1, 1], key
        assert steps[2]["params"] == steps[1]["params"], key
        assert steps[3]["params"] != steps[2]["params"], key


# ---- fully sharded (shard_map, sharded parameters and optimizer state) -----------


def _sharded_steps(records):
    steps = {}
    for rec in records:
        for step, info in rec["fsdp"]["steps"].items():
            steps.setdefault(int(step), []).append(info)
    return steps


def test_sharded_gradients_skip_together_across_processes(runs):
    steps = _sharded_steps(runs["train"])
    assert sorted(steps) == list(range(8))
    for step, (a, b) in steps.items():
        assert a["stats"] == b["stats"], step
        assert a["loss"] == b["loss"] or (np.isinf(a["loss"]) and np.isinf(b["loss"]))
        flags = {**a["flags"], **b["flags"]}  # each process holds 4 positions
        assert len(flags) == N_DEVICES
        local = [flags[f"{i}:{i + 1},None:None"][0] for i in range(N_DEVICES)]
        agreed = [flags[f"{i}:{i + 1},None:None"][1] for i in range(N_DEVICES)]
        # The inf of step 2 is in process 1's rows but feature 5, whose gradient
        # shard is on device 2 (process 0); step 6's goes from process 0's
        # rows to device 6 (process 1). Only that device's shard is non-finite,
        # yet `loss_scaled(axis_name="data")` makes all eight skip.
        bad = {2: 2, 6: 6}.get(step)
        assert local == [i != bad for i in range(N_DEVICES)], step
        assert agreed == [bad is None] * N_DEVICES, step
        assert a["stats"]["last_finite"] == (bad is None)
    stats = [steps[i][0]["stats"] for i in range(8)]
    assert [s["num_skipped"] for s in stats] == [0, 0, 1, 1, 1, 1, 2, 2]
    assert [s["loss_scale"] for s in stats] == [4096.0] * 2 + [2048.0] * 3 + [
        4096.0,
        2048.0,
        2048.0,
    ]
    params = [_merge(*(s["state"] for s in steps[i])) for i in range(8)]
    for bad in (2, 6):
        before, after = params[bad - 1], params[bad]
        for path in ("['params']['w']", "['params']['v']"):
            assert after[path] == before[path]  # all 8 shards unchanged
    assert params[3]["['params']['w']"] != params[2]["['params']['w']"]


def test_checkpoint_written_by_two_processes_restores_in_one(runs):
    out = runs["out"]
    # Each process wrote its own shards.
    assert (out / "ckpt_train" / "ocdbt.process_0").is_dir()
    assert (out / "ckpt_train" / "ocdbt.process_1").is_dir()
    saved = _merge(*(s["state"] for s in _sharded_steps(runs["train"])[3]))
    restored = runs["single"]["fsdp"]["restored"]
    assert restored["params_sharded"] == [True, N_DEVICES]
    assert restored["state"] == saved  # every shard of every leaf, bit for bit
    # The loss scale mid-period: scale, counter and the static configuration.
    stats = restored["stats"]
    assert (stats["loss_scale"], stats["counter"], stats["num_skipped"]) == (
        2048.0,
        1,
        1,
    )
    assert stats["config"] == [3, 2.0, 16.0]


def test_resume_on_one_process_is_bit_exact(runs):
    two = _sharded_steps(runs["train"])
    one = runs["single"]["fsdp"]["steps"]
    assert sorted(int(s) for s in one) == [4, 5, 6, 7]
    for step, info in one.items():
        reference = two[int(step)]
        assert info["stats"] == reference[0]["stats"], step
        assert info["state"] == _merge(*(r["state"] for r in reference)), step


def test_one_process_checkpoint_resumes_on_two_bit_exact(runs):
    single_steps = runs["single"]["fsdp"]["steps"]
    restored = [rec["fsdp"]["restored"] for rec in runs["multi"]]
    assert _merge(*(r["state"] for r in restored)) == single_steps["5"]["state"]
    assert restored[0]["stats"] == restored[1]["stats"] == single_steps["5"]["stats"]
    two = _sharded_steps(runs["train"])
    resumed = _sharded_steps(runs["multi"])
    assert sorted(resumed) == [6, 7]
    for step, infos in resumed.items():
        assert infos[0]["stats"] == infos[1]["stats"] == two[step][0]["stats"]
        assert _merge(*(i["state"] for i in infos)) == _merge(
            *(r["state"] for r in two[step])
        )


def test_runs_fit_the_time_budget(runs):
    # Three runs, two of them with two processes; each is also bounded alone.
    assert runs["seconds"] < 3 * TIMEOUT_S
