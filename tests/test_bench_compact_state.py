"""The compact-state benchmark's fine-tuning runs (``--pretrain``), at the tiny
LM size: nothing timed, only where the runs start and what they read."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_benchmark

from mixprec._src.workloads import train


bench = load_benchmark("bench_compact_state")
# The benchmark runs optax.adamw as users do, under standard promotion.
pytestmark = pytest.mark.standard_promotion


@pytest.fixture(scope="module")
def tiny():
    workload = train.lm_workload(size="tiny", n_eval_batches=2)
    return workload, bench.pretrain(workload, 0, 110)  # past the 100-step warmup


def _eval(workload, params):
    def eval_fn(p, batch):
        return bench.loss_fn(workload, p, batch), jnp.zeros([])

    return train.evaluate_params(eval_fn, params, workload.eval_batches)[0]


def test_pretraining_moves_the_params_off_their_initialisation(tiny):
    workload, pretrained = tiny
    init = workload.init(jax.random.key(0))
    moved = jax.tree.map(
        lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), init, pretrained
    )
    assert all(jax.tree.leaves(moved))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(pretrained))


@pytest.mark.parametrize(
    "variant, dtype",
    [
        ("float32", jnp.float32),
        ("bf16-rtn", jnp.bfloat16),
        ("bfloat16-sr/float32", jnp.bfloat16),
    ],
)
def test_every_variant_starts_from_the_pretrained_params(tiny, variant, dtype):
    # One step at a learning rate of 1e-12 moves no bfloat16 weight and a float32
    # one by about 1e-12: each run ends where it started, the pretrained params
    # in its own dtype (bfloat16 variants round them to nearest).
    workload, pretrained = tiny
    asked = []

    def initial(seed):
        asked.append(seed)
        return pretrained

    (row,) = bench.run(workload, variant, [0], 1, 0, 1e-12, initial)
    assert asked == [0]
    assert row["params_dtype"] == jnp.dtype(dtype).name
    start = jax.tree.map(lambda p: p.astype(dtype), pretrained)
    np.testing.assert_allclose(row["eval_loss"], _eval(workload, start), rtol=1e-6)


def test_fine_tuning_reads_batches_the_pretraining_did_not(tiny):
    workload, pretrained = tiny
    streams = []

    def spy(seed):
        streams.append(seed)
        return tiny[0].train_batches(seed)

    workload = dataclasses.replace(workload, train_batches=spy)
    bench.run(workload, "float32", [2], 1, 0, 1e-12, lambda seed: pretrained)
    bench.run(workload, "float32", [2], 1)
    assert streams == [1002, 2]


def test_compile_times_reports_each_variant():
    seconds = bench.compile_times("tiny", ["bf16-rtn", "bfloat16-sr/float32"])
    assert list(seconds) == ["bf16-rtn", "bfloat16-sr/float32"]
    leaves = len(
        jax.tree.leaves(train.lm_workload(size="tiny").init(jax.random.key(0)))
    )
    for row in seconds.values():
        assert row["leaves"] == leaves
        assert row["trace_s"] > 0 and row["compile_s"] > 0


def test_update_times_reports_each_variant_with_the_model_size():
    row = bench.sized_update_times("tiny", ["bf16-rtn", "bfloat16-sr/int8"], rounds=1)
    params = jax.tree.leaves(train.lm_workload(size="tiny").init(jax.random.key(0)))
    assert row["params"] == sum(x.size for x in params)
    assert row["leaves"] == len(params)
    assert list(row["update_seconds"]) == ["bf16-rtn", "bfloat16-sr/int8"]
    assert all(t > 0 for t in row["update_seconds"].values())
    # bfloat16 weights + gradients + 1-byte moments with block scales read and
    # written, against bfloat16 everything: less I/O than the naive update.
    io = row["update_io_bytes_per_param"]
    assert io["bfloat16-sr/int8"] < io["bf16-rtn"]


NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def test_kernel_profile_splits_the_update_by_stage():
    variants = ["bf16-rtn", "bfloat16-sr/int8"]
    rows = bench.kernel_profile("tiny", variants, calls=2)
    naive, compact = rows["bf16-rtn"], rows["bfloat16-sr/int8"]
    assert list(naive["by_stage_us"]) == ["update"]
    # Every stage of compact_state's per-leaf work shows up under its name:
    # the kernels' HLO metadata still names the jits they come from.
    assert {"block statistics", "encode moments", "round and land weights"} <= set(
        compact["by_stage_us"]
    )
    params32 = train.lm_workload(size="tiny").init(jax.random.key(0))
    for variant in variants:
        row = rows[variant]
        # Every kernel of the compiled update is seen (each instruction of its
        # entry computation that computes something runs once per call).
        upd, *args = bench.update_step(variant, params32)
        hlo = jax.jit(upd).lower(*args).compile().as_text()
        entry = hlo[hlo.index("\nENTRY") :]
        ops = re.findall(
            r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(", entry, re.M
        )
        kernels = [op for op in ops if op not in NOT_KERNELS]
        assert row["kernels"] == len(kernels), (variant, sorted(set(ops)))
        assert row["kernel_us"] > 0
        total = sum(row["by_stage_us"].values())
        assert abs(total - row["kernel_us"]) <= 0.1 * len(row["by_stage_us"])
    assert compact["kernels"] > naive["kernels"]


def test_the_measuring_modes_exclude_each_other(capsys, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(
            [
                "--update-times",
                "tiny",
                "--kernel-profile",
                "tiny",
                "--out",
                str(tmp_path),
            ]
        )
    assert "exclude each other" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_ablations_remove_their_stage_and_leave_the_plain_update_alone():
    params32 = train.lm_workload(size="tiny").init(jax.random.key(0))

    def compiled(variant):
        upd, *args = bench.update_step(variant, params32)
        lowered = jax.jit(upd).lower(*args)
        c = lowered.compile()
        # (The StableHLO without locations; the program's size in lines.)
        return lowered.as_text(), c.as_text().count("\n"), c(*args)

    program, size, out = compiled("bfloat16-sr/int8")
    sizes = {}
    for name in bench.ABLATIONS:
        sizes[name] = compiled(f"bfloat16-sr/int8@{name}")[1]
        assert sizes[name] < size, name
    all_size = compiled("bfloat16-sr/int8@" + "+".join(bench.ABLATIONS))[1]
    assert all_size < min(sizes.values())
    # The patches and the fresh per-leaf caches are gone after the block: the
    # plain update traces to the same program and computes the same state.
    again_program, _, again = compiled("bfloat16-sr/int8")
    assert again_program == program
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--update-times", "tiny", "--variants", "bfloat16-sr/int8@fast"], "fast"),
        (["--update-times", "tiny", "--variants", "bf16-rtn@fixed-scales"], "only"),
        (["--variants", "bfloat16-sr/int8@fixed-scales"], "--update-times"),
        (["--update-times", "huge"], "gpt2"),
        (["--step-times", "gpt2"], "full"),
        (
            ["--step-times", "tiny", "--variants", "bfloat16-sr/int8@fixed-scales"],
            "only",
        ),
        (["--batch-size", "4"], "--step-times"),
    ],
)
def test_bad_ablations_are_refused_by_name(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit):
        bench.main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert message in err
    assert not list(tmp_path.iterdir())


def test_timed_calls_donate_params_and_state_and_thread_them():
    params32 = train.lm_workload(size="tiny").init(jax.random.key(0))
    upd, params, state, grads = bench.update_step("bfloat16-sr/int8", params32)
    call = bench.donated_calls(upd, (params, state), grads)
    first = call()
    second = call()
    # The first call's outputs were the second's inputs, donated: deleted.
    assert all(x.is_deleted() for x in jax.tree.leaves(first))
    assert not any(x.is_deleted() for x in jax.tree.leaves(second))
    # The caller's arrays (shared by other variants) are copied, never donated.
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, state, grads)))
    assert int(second[1].step) == 2


def test_step_times_reports_each_variant_donated():
    row = bench.step_times("tiny", ["float32", "bfloat16-sr/int8"], 1, batch_size=2)
    assert list(row["step_seconds"]) == ["float32", "bfloat16-sr/int8"]
    assert all(t > 0 for t in row["step_seconds"].values())
    assert row["batch"][0] == 2
    params = jax.tree.leaves(train.lm_workload(size="tiny").init(jax.random.key(0)))
    assert row["params"] == sum(x.size for x in params)
    with pytest.raises(ValueError, match="tiny, small, full"):
        bench.step_times("gpt2", ["float32"], 1)


def test_step_times_mode_writes_its_table(capsys, tmp_path):
    argv = ["--step-times", "tiny", "--batch-size", "2", "--rounds", "1"]
    argv += ["--variants", "bfloat16-sr/int8", "--out", str(tmp_path), "--name", "s"]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "s.json").read_text())
    assert result["donated"] is True
    assert list(result["sizes"]["tiny"]["step_seconds"]) == [
        "float32",
        "bf16-rtn",
        "bfloat16-sr/int8",
    ]
    assert "loadavg" in result["environment"] and "loadavg_after" in result
    assert "donated" in capsys.readouterr().out
