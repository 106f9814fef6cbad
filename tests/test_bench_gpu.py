"""The GPU benchmark (``benchmarks/bench_gpu.py``) and its GPT-2 workload, on a CPU.

Nothing here is timed: the smoke test runs three variants at the tiny size for
a couple of steps and checks what the JSON says (structure, identical initial
weights, float32 and mixprec bfloat16 losses within bfloat16 tolerance).
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import load_benchmark

from mixprec._src.workloads import gpt2


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "benchmarks", "bench_gpu.py")
# The tolerance table of the suite (STYLE.md): bfloat16 1e-2, float32 1e-6.
_TOL = {"bfloat16": 1e-2, "float32": 1e-6}


bench = load_benchmark("bench_gpu")


# --- the script, end to end ------------------------------------------------------


@pytest.mark.slow  # three processes, two XLA compiles: ~15 s on two idle cores
def test_tiny_run_writes_json_and_losses_agree(tmp_path):
    out = tmp_path / "bench.json"
    # LLVM's optimization level 0: the steps run slower, XLA compiles ~40% faster.
    env = dict(
        os.environ,
        PYTHONPATH=_ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_backend_optimization_level=0",
    )
    variants = "jax_f32,mixprec_loss,torch_f32"
    proc = subprocess.run(
        [
            sys.executable,
            _SCRIPT,
            "--size",
            "tiny",
            "--workloads",
            "gpt2",
            "--variants",
            variants,
            "--steps",
            "1",
            "--rounds",
            "1",
            "--loss-steps",
            "2",
            "--warmup",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data) == {"environment", "config", "results"}
    env_info, cfg = data["environment"], data["config"]
    assert env_info["backend"] == "cpu" and env_info["device_kind"] == "cpu"
    assert env_info["versions"]["jax"] == jax.__version__
    assert {"date", "cpu_model", "cpu_flags"} <= set(env_info)
    assert cfg["size"] == "tiny" and cfg["loss_steps"] == 2 and cfg["steps"] == 1
    assert cfg["peak_tflops"] is None
    assert cfg["workloads"]["gpt2"]["model"]["d_model"] == gpt2.TINY.d_model

    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == variants.split(",")
    for name in ("jax_f32", "mixprec_loss"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["workload"] == "gpt2" and r["framework"] == "jax"
        assert r["ms_per_step"] > 0 and len(r["round_s"]) == 1
        assert r["compile_s"] > 0 and r["mfu"] is None
        assert len(r["losses"]) == 3 and all(np.isfinite(r["losses"]))
        assert r["peak_bytes"] > 0 and "memory_analysis" in r["memory_measure"]
        assert sum(r["hlo"]["dots"].values()) > 0
        expected = gpt2.TINY.flops_per_token() * 2 * gpt2.TINY.seq_len
        assert r["flops_per_step"] == expected
    f32, mixed = rows["jax_f32"], rows["mixprec_loss"]
    assert (
        f32["init_digest"] == mixed["init_digest"] == gpt2.digest(gpt2.init(gpt2.TINY))
    )
    assert f32["loss_diff_vs_f32"] == 0.0
    # Training lowers the loss, and bfloat16 follows float32 within its tolerance.
    assert f32["loss_after"] < f32["loss_first"]
    for key in ("loss_first", "loss_after"):
        np.testing.assert_allclose(mixed[key], f32[key], rtol=_TOL["bfloat16"])
    assert abs(mixed["loss_rel_diff_vs_f32"]) < _TOL["bfloat16"]

    torch_row = rows["torch_f32"]
    if importlib.util.find_spec("torch") is None:
        assert torch_row["status"] == "skipped"
        assert "torch is not installed" in torch_row["reason"]
    else:  # the same weights and data in PyTorch: float32 agrees closely
        assert torch_row["status"] == "ok", torch_row
        assert torch_row["init_digest"] == f32["init_digest"]
        np.testing.assert_allclose(torch_row["losses"], f32["losses"], rtol=1e-4)
    table = out.with_suffix(".md").read_text()
    assert "| jax_f32 |" in table and "| mixprec_loss |" in table
    assert "memory_analysis" in table


def test_cli_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "jax_f32,nope"])
    err = capsys.readouterr().err
    assert "`--variants`" in err and "unknown: nope" in err and "mixprec_loss" in err
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "float8", "--variants", "jax_f32"])
    assert "`--variants jax_f32` runs on the workloads gpt2, mlp" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "0"])
    assert "`--steps` must be an integer >= 1, got 0" in capsys.readouterr().err


def test_every_variant_applies_to_a_workload():
    for v in bench.VARIANTS.values():
        assert v.framework in ("jax", "torch")
        assert set(v.workloads) <= set(bench.WORKLOADS) and v.workloads


# --- what a GPU run reads ----------------------------------------------------------


def test_peak_table_and_override():
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3", None) == (989.0, "table: H100")
    assert bench.peak_tflops("NVIDIA H200", None)[0] == 989.0
    assert bench.peak_tflops("NVIDIA H100 PCIe", None)[0] == 756.0
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3", 700.0) == (700.0, "--peak-tflops")
    assert bench.peak_tflops("cpu", None)[0] is None


_GPU_HLO = """\
HloModule jit_step, entry_computation_layout={(bf16[64,32]{1,0}, f32[32,16]{1,0})->bf16[64,16]{1,0}}

%gemm_fusion_dot.1_computation (parameter_0: bf16[64,32], parameter_1: bf16[32,16]) -> bf16[64,16] {
  %parameter_0 = bf16[64,32]{1,0} parameter(0)
  %parameter_1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (a.1: bf16[64,32], b.2: f32[32,16], q.3: f8e4m3fn[64,32], r.4: f8e4m3fn[16,32]) -> bf16[64,16] {
  %a.1 = bf16[64,32]{1,0} parameter(0)
  %b.2 = f32[32,16]{1,0} parameter(1)
  %q.3 = f8e4m3fn[64,32]{1,0} parameter(2)
  %r.4 = f8e4m3fn[16,32]{1,0} parameter(3)
  %convert = bf16[32,16]{1,0} convert(%b.2)
  %cublas-gemm.1 = (bf16[64,16]{1,0}, s8[4194304]{0}) custom-call(%a.1, %convert), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1}}
  %cublas-gemm.2 = (bf16[64,16]{1,0}, s8[4194304]{0}) custom-call(bf16[64,32]{1,0} %a.1, bf16[32,16]{1,0} %convert), custom_call_target="__cublas$lt$matmul"
  %cublas-gemm.3 = (bf16[64,16]{1,0}, s8[4194304]{0}) custom-call(%q.3, %r.4), custom_call_target="__cublas$lt$matmul$f8"
  %fusion = bf16[64,16]{1,0} fusion(%a.1, %convert), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{}}}
  %fmha = (bf16[1,2,4,8]{3,2,1,0}, u8[0]{0}) custom-call(%a.1), custom_call_target="__cudnn$fmhaSoftmax"
  %other = f32[4]{0} custom-call(%b.2), custom_call_target="SomethingElse"
  ROOT %gte = bf16[64,16]{1,0} get-tuple-element(%cublas-gemm.1), index=0
}
"""  # noqa: E501


def test_hlo_summary_reads_gemm_targets_and_types():
    s = bench.hlo_summary(_GPU_HLO)
    assert s["calls"] == {
        "__cublas$gemm bf16,bf16->bf16": 1,
        "__cublas$lt$matmul bf16,bf16->bf16": 1,
        "__cublas$lt$matmul$f8 f8e4m3fn,f8e4m3fn->bf16": 1,
        "__cudnn$fmhaSoftmax bf16->bf16": 1,
    }
    assert s["fusions"] == {"__triton_gemm": 1}
    assert s["dots"] == {"bf16,bf16->bf16": 1}
    line = bench.gemm_text(s)
    assert "__cublas$lt$matmul$f8 f8e4m3fn,f8e4m3fn->bf16 x1" in line
    assert "SomethingElse" not in line


def test_hlo_summary_on_this_backend():
    a = jnp.ones((16, 8), jnp.float32)
    text = jax.jit(lambda x: x @ x.T).lower(a).compile().as_text()
    assert bench.hlo_summary(text)["dots"] == {"f32,f32->f32": 1}


# --- the GPT-2 workload ------------------------------------------------------------


def test_init_is_deterministic_numpy_and_counts_parameters():
    p, q = gpt2.init(gpt2.TINY), gpt2.init(gpt2.TINY)
    leaves = jax.tree.leaves(p)
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in leaves)
    assert sum(a.size for a in leaves) == gpt2.TINY.num_params
    assert gpt2.digest(p) == gpt2.digest(q) != gpt2.digest(gpt2.init(gpt2.TINY, 1))


def test_flops_count_gpt2_small():
    c = gpt2.SMALL
    assert c.matmul_params == 12 * 12 * 768**2 + 768 * 50304
    assert c.flops_per_token() == 6 * c.matmul_params + 12 * 12 * 1024 * 768


# jax.nn.dot_product_attention itself promotes bfloat16 with float32 implicitly.
_DPA = pytest.mark.standard_promotion


@pytest.mark.parametrize(
    "attention",
    ["einsum", pytest.param("xla", marks=_DPA), pytest.param("auto", marks=_DPA)],
)
def test_hand_bf16_follows_float32(attention):
    p = gpt2.init(gpt2.TINY)
    x, y = gpt2.batch(gpt2.TINY, 2)
    f32 = jax.jit(lambda p: gpt2.loss(p, x, y, config=gpt2.TINY))(p)
    bf16 = jax.jit(
        lambda p: gpt2.loss(
            p, x, y, config=gpt2.TINY, compute_dtype=jnp.bfloat16, attention=attention
        )
    )(p)
    assert f32.dtype == bf16.dtype == jnp.float32
    np.testing.assert_allclose(bf16, f32, rtol=_TOL["bfloat16"])
    logits = jax.eval_shape(
        lambda p: gpt2.apply(p, x, config=gpt2.TINY, compute_dtype=jnp.bfloat16), p
    )
    assert logits.dtype == jnp.bfloat16


def test_unknown_attention_is_refused():
    p = gpt2.init(gpt2.TINY)
    x, _ = gpt2.batch(gpt2.TINY, 1)
    with pytest.raises(ValueError, match="`gpt2.apply.*attention=.*'flash'"):
        gpt2.apply(p, x, config=gpt2.TINY, attention="flash")


@pytest.mark.standard_promotion
def test_flax_model_has_the_same_tree_and_function():
    p = gpt2.init(gpt2.TINY)
    x, _ = gpt2.batch(gpt2.TINY, 2)
    module = gpt2.flax_model(gpt2.TINY)
    shapes = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    assert jax.tree.structure(shapes) == jax.tree.structure(p)
    assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(np.shape, p)
    ours = jax.jit(lambda p: gpt2.apply(p, x, config=gpt2.TINY))(p)
    theirs = jax.jit(module.apply)({"params": p}, x)
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=1e-5)
    bf16 = gpt2.flax_model(gpt2.TINY, jnp.bfloat16)
    assert jax.eval_shape(bf16.apply, {"params": p}, x).dtype == jnp.bfloat16


def test_torch_model_gets_the_same_weights():
    torch = pytest.importorskip("torch")
    p = gpt2.init(gpt2.TINY)
    x, _ = gpt2.batch(gpt2.TINY, 2)
    cfg = bench.sizes("tiny")["gpt2"]
    model, mapping, _ = bench.torch_workload("gpt2", cfg)
    bench.torch_load(mapping, p)
    assert gpt2.digest(bench.torch_export(mapping)) == gpt2.digest(p)
    with torch.no_grad():
        theirs = model(torch.from_numpy(x).long()).numpy()
    np.testing.assert_allclose(theirs, gpt2.apply(p, x, config=gpt2.TINY), atol=1e-4)


# --- failures are rows, not crashes ---------------------------------------------


def test_a_failing_variant_is_reported_with_its_error_line(tmp_path, monkeypatch):
    def boom(spec, row):
        del spec, row
        raise RuntimeError("cuDNN is not detected\nmore detail")

    monkeypatch.setattr(bench, "run_jax", boom)
    path = tmp_path / "row.json"
    spec = dict(kind="variant", workload="gpt2", variant="hand_bf16_cudnn")
    assert bench.worker_main(json.dumps(dict(spec, result_path=str(path)))) == 0
    row = json.loads(path.read_text())
    assert row["status"] == "failed"
    assert row["reason"] == "RuntimeError: cuDNN is not detected"
    assert any("boom" in line for line in row["traceback"])


def test_error_line_finds_the_exception_in_a_crash_log():
    log = "[worker] compiling\nTraceback (most recent call last):\n  File x\n"
    log += "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory\n"
    log += "some trailing noise\n"
    assert bench.error_line(log).startswith("jaxlib.xla_extension.XlaRuntimeError: ")
    assert bench.error_line("") == "no output"


def test_gpu_rows_get_mfu_and_the_earlier_reference_column(tmp_path):
    # A synthetic GPU result (no GPU here): what the parent derives and prints.
    flops = gpt2.SMALL.flops_per_token() * 8 * 1024
    row = dict(workload="gpt2", framework="jax", status="ok", flops_per_step=flops)
    data = dict(
        environment=dict(backend="gpu", device_kind="NVIDIA H100 80GB HBM3"),
        config=dict(
            size="gpu",
            steps=10,
            rounds=3,
            loss_steps=10,
            warmup=2,
            peak_tflops=989.0,
            peak_source="table: H100",
            command="python benchmarks/bench_gpu.py",
            workloads={"gpt2": {"batch": 8}},
        ),
        results=[
            dict(row, variant="jax_f32", ms_per_step=40.0, losses=[10.9, 9.0]),
            dict(row, variant="mixprec_loss", ms_per_step=20.0, losses=[10.9, 9.1]),
            dict(row, variant="hand_bf16_cudnn", status="failed", reason="E: x"),
        ],
    )
    table = bench.write(data, str(tmp_path / "r.json"))
    f32, mixed, failed = data["results"]
    assert mixed["mfu"] == pytest.approx(flops / 0.020 / 989e12)
    assert 0.3 < mixed["mfu"] < 0.4 and f32["mfu"] == pytest.approx(mixed["mfu"] / 2)
    assert mixed["loss_diff_vs_f32"] == pytest.approx(0.1)
    assert "mfu" not in failed
    assert "earlier H100 ms (not this run)" in table
    assert "| mixprec_loss |" in table and "| 31.9 |" in table and "35.4%" in table
    assert "| hand_bf16_cudnn |" in table and "E: x" in table
    assert json.loads((tmp_path / "r.json").read_text())["results"][1]["mfu"] > 0
