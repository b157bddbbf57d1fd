"""The flash attention bench on CPU: which tiles and variants it times, the rows it prints (errors,
traces, energy), the optional packages' calls, and the blocks each mask leaves."""

import dataclasses
import json
import os
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from benchmarks import flash_attention
from jaxllmq.kernels import flash_attention as fa


def each_call_takes_1ms(monkeypatch) -> None:
    """The flash bench's timing replaced: every variant's call takes 1 ms."""
    monkeypatch.setattr(
        flash_attention.bench,
        "time_calls_in_turn",
        lambda calls_by_name, calls: {name: 1e-3 for name in calls_by_name},
    )


def measured_rows(settings: list[str], capsys) -> list[dict]:
    """The flash bench's JSON rows at one small shape (1 x 256, head dim 64) under `settings`."""
    flash_attention.FLAGS(["flash_attention", *settings])
    try:
        flash_attention.measure(1, 256, 64)
    finally:
        flash_attention.FLAGS.unparse_flags()
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_flash_bench_times_the_tiles_the_model_runs():
    """--blocks specs change the head dim's default tiles (what the model runs), so the bench's
    default row at head dim 64 is the model's fused backward, not FlashBlocks' field defaults."""
    assert flash_attention.parse_blocks("", 64) == fa.default_blocks(64) != fa.FlashBlocks()
    assert fa.default_blocks(64).dq_in_dkv
    want = dataclasses.replace(fa.default_blocks(128), stages=3)
    assert flash_attention.parse_blocks("stages=3", 128) == want != fa.FlashBlocks(stages=3)
    assert flash_attention.parse_blocks("dkv_section=none", 128).dkv_section is None
    with pytest.raises(ValueError, match="dkv_section only"):
        flash_attention.parse_blocks("stages=none", 128)


def test_the_flash_bench_reports_the_largest_and_the_whole_tensors_error():
    """The errors of o, dq, dk and dv against the reference: the largest element's and the
    relative L2 of the whole tensor, here of an attention whose output is 1% off everywhere."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (1, 16, 2, 8)) for key in keys)

    def reference(q, k, v):
        return fa.reference_attention(q, k, v, 8**-0.5, None)

    largest, l2 = flash_attention._errors(lambda *a: 1.01 * reference(*a), reference, q, k, v, do)
    assert set(largest) == set(l2) == {"o", "dq", "dk", "dv"}
    for name in largest:
        assert l2[name] == pytest.approx(0.01, rel=1e-3), name
        assert 0 < largest[name] < 1, name
    assert flash_attention._errors(reference, reference, q, k, v, do) == (
        dict.fromkeys(largest, 0.0),
        dict.fromkeys(largest, 0.0),
    )


def test_the_flash_bench_times_each_tile_setting_over_documents_and_windows_too(
    monkeypatch, capsys
):
    """Every --blocks setting gets a row over documents and within each window, its tiles those
    of bounded attention with the setting's fields changed."""
    tiles = []

    def attention(q, k, v, *, scale, segment_ids_BxT=None, window=None, blocks=None):
        tiles.append((segment_ids_BxT is not None, window, blocks))
        return fa.reference_attention(q, k, v, scale)  # the tiles are what is checked

    monkeypatch.setattr(fa, "flash_attention", attention)
    each_call_takes_1ms(monkeypatch)
    settings = ["--blocks=", "--blocks=per_warpgroup_code=1", "--windows=64", "--nocudnn"]
    rows = [row["variant"] for row in measured_rows([*settings, "--noerrors"], capsys)]
    changed = dataclasses.replace(fa.default_blocks(64), per_warpgroup_code=True)
    assert rows == [
        "mosaic default",
        "mosaic per_warpgroup_code=1",
        "mosaic documents",
        "mosaic documents per_warpgroup_code=1",
        "mosaic window 64",
        "mosaic window 64 per_warpgroup_code=1",
    ]
    assert (True, None, changed) in tiles and (False, 64, changed) in tiles
    assert (True, None, fa.default_blocks(64)) in tiles


def test_the_flash_bench_times_the_settings_that_run_in_turn_and_reports_the_rest(
    monkeypatch, capsys
):
    """A setting the kernels refuse gets a row with its error; the others are timed together,
    their batches in turn, forward and forward + backward."""

    def attention(q, k, v, *, scale, segment_ids_BxT=None, window=None, blocks=None):
        if blocks.per_warpgroup_code:
            raise ValueError("Mosaic GPU kernel exceeds available shared memory")
        return fa.reference_attention(q, k, v, scale)

    timed = []

    def in_turn(calls_by_name, calls):
        timed.append(list(calls_by_name))
        return {name: 1e-3 * (1 + len(timed)) for name in calls_by_name}

    monkeypatch.setattr(fa, "flash_attention", attention)
    monkeypatch.setattr(flash_attention.bench, "time_calls_in_turn", in_turn)
    settings = ["--blocks=", "--blocks=per_warpgroup_code=1", "--windows=", "--nodocuments"]
    rows = measured_rows([*settings, "--nocudnn", "--noerrors"], capsys)
    assert rows[0]["variant"] == "mosaic per_warpgroup_code=1"
    assert "exceeds available shared memory" in rows[0]["error"]
    assert timed == [["mosaic default"], ["mosaic default"]]
    assert rows[1] == {
        "batch": 1, "seq_len": 256, "head_dim": 64, "heads": 32, "kv_heads": 8,
        "variant": "mosaic default", "fwd_ms": 2.0, "fwd_bwd_ms": 3.0,
    }  # fmt: skip


def test_the_flash_bench_traces_each_variants_calls_where_asked(monkeypatch, capsys):
    """--profile_calls: after the timed rows, a row per variant with each kernel's ms per call,
    their sum and the ms no kernel runs, from a trace of that many forward + backward calls."""
    traced = []

    def breakdown(trace_dir, steps, top):
        traced.append((os.path.isdir(trace_dir), steps))
        kernels = [("flash_attention_dkv_dq_mosaic_gpu_kernel", 0.74441, 1)]
        return {"kernels": kernels, "device_ms_per_step": 1.29221, "idle_ms_per_step": 0.00294}

    def attention(q, k, v, *, scale, blocks=None, **bounds):
        return fa.reference_attention(q, k, v, scale)

    monkeypatch.setattr(fa, "flash_attention", attention)
    each_call_takes_1ms(monkeypatch)
    monkeypatch.setattr(flash_attention.profile, "breakdown", breakdown)
    settings = ["--windows=", "--nodocuments", "--nocudnn", "--noerrors", "--profile_calls=3"]
    rows = measured_rows(settings, capsys)
    assert [row["variant"] for row in rows] == ["mosaic default"] * 2
    assert rows[1]["profile"] == {
        "kernel_ms": {"flash_attention_dkv_dq_mosaic_gpu_kernel": 0.7444},
        "device_ms": 1.2922,
        "idle_ms": 0.0029,
    }
    assert traced == [(True, 3)]


def test_the_flash_bench_meters_each_variants_energy_where_asked(monkeypatch, capsys):
    """--energy_seconds: each variant's forward + backward metered after the timing, for that
    many seconds a round, from its timed ms; the fields join its row."""
    metered = []

    def energy_in_turn(calls_by_name, seconds_per_call, seconds):
        metered.append((list(calls_by_name), seconds_per_call, seconds))
        return {name: {"joules_per_call": 2.5, "sustained_ms": 1.1} for name in calls_by_name}

    monkeypatch.setattr(
        fa,
        "flash_attention",
        lambda q, k, v, *, scale, blocks: fa.reference_attention(q, k, v, scale),
    )
    each_call_takes_1ms(monkeypatch)
    monkeypatch.setattr(flash_attention.bench, "energy_in_turn", energy_in_turn)
    settings = ["--windows=", "--nodocuments", "--nocudnn", "--noerrors", "--energy_seconds=2"]
    (row,) = measured_rows(settings, capsys)
    assert metered == [(["mosaic default"], {"mosaic default": 1e-3}, 2.0)]
    assert row["fwd_bwd_ms"] == 1.0 and row["joules_per_call"] == 2.5 and row["sustained_ms"] == 1.1


def test_run_once_runs_each_variants_forward_and_backward_once_and_times_nothing(
    monkeypatch, capsys
):
    """--run_once: for a profiler, each variant's forward + backward compiled, then run a single
    time (the forward inside it, not apart), and no timing; a setting the kernels refuse gets a
    row with its error."""
    ran = []

    def attention(q, k, v, *, scale, blocks=None, **bounds):
        if blocks.per_warpgroup_code:
            raise ValueError("Mosaic GPU kernel exceeds available shared memory")
        jax.debug.callback(lambda: ran.append(blocks.dkv_stages))
        return fa.reference_attention(q, k, v, scale)

    def no_timing(calls_by_name, calls):
        raise AssertionError("--run_once timed a call")

    monkeypatch.setattr(fa, "flash_attention", attention)
    monkeypatch.setattr(flash_attention.bench, "time_calls_in_turn", no_timing)
    settings = ["--run_once", "--blocks=", "--blocks=per_warpgroup_code=1", "--blocks=dkv_stages=3"]
    rows = measured_rows([*settings, "--windows=", "--nodocuments", "--nocudnn"], capsys)
    assert [row["variant"] for row in rows] == [
        "mosaic default",
        "mosaic per_warpgroup_code=1",
        "mosaic dkv_stages=3",
    ]
    assert rows[0]["ran_once"] and rows[2]["ran_once"]
    assert "exceeds available shared memory" in rows[1]["error"]  # and the sweep went on
    assert ran == [fa.default_blocks(64).dkv_stages, 3]


def test_jax_linear_attention_is_a_one_line_exit_where_it_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "jla", None)  # import jla raises ImportError
    with pytest.raises(SystemExit, match="--jax_linear_attention: the package is not installed"):
        flash_attention.jax_linear_attention_kernel("fused", 0.125)


# Each other package the bench times: its flag, the module and function the bench calls, the
# keyword that takes the window, its bound for plain causal attention, and the keywords every
# call passes.
OTHER_PACKAGES = [
    (
        "flash_attn3",
        "dew_flash_attn",
        "flash_mha",
        "window_size",
        (-1, -1),
        {"is_causal": True, "softmax_scale": 0.125},
    ),
    ("flash_attn4", "fa4_jax", "flash_attn", "window_size", None, {"causal": True, "scale": 0.125}),
    (
        "tokamax",
        "tokamax",
        "dot_product_attention",
        "local_window_size",
        None,
        {"is_causal": True, "scale": 0.125, "implementation": "mosaic"},
    ),
]


@pytest.mark.parametrize("flag, module, function, window_key, causal_bound, fixed", OTHER_PACKAGES)
def test_each_other_package_takes_the_window_as_its_keys_before_the_query(
    monkeypatch, flag, module, function, window_key, causal_bound, fixed
):
    (kernel,) = [kernel for f, _, kernel in flash_attention.OTHER_KERNELS if f == flag]
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(SystemExit, match=f"--{flag}: the package is not installed"):
        kernel(0.125)
    calls = []
    fake = {function: lambda q, k, v, **kw: calls.append(kw)}
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**fake))
    kernel(0.125)(None, None, None)
    kernel(0.125, 512)(None, None, None)
    assert [c[window_key] for c in calls] == [causal_bound, (511, 0)]
    assert all(c[key] == value for c in calls for key, value in fixed.items())


def test_each_other_package_gets_a_causal_and_a_windowed_row(monkeypatch, capsys):
    """--flash_attn3, --flash_attn4 and --tokamax each add their package's rows, causal and per
    window, beside ours (the packages faked: each returns its queries)."""
    for _, module, function, *_ in OTHER_PACKAGES:
        fake = {function: lambda q, k, v, **kw: q}
        monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**fake))
    flags = [f"--{flag}" for flag, *_ in OTHER_PACKAGES]
    settings = [*flags, "--windows=128", "--nodocuments", "--nocudnn", "--noerrors"]
    timed = {row["variant"] for row in measured_rows(settings, capsys) if "fwd_ms" in row}
    others = {name for _, name, _ in flash_attention.OTHER_KERNELS}
    assert others == {"flash-attn3", "flash-attn4", "tokamax"}
    assert timed >= others | {f"{name} window 128" for name in others}


def test_visible_blocks_counts_the_tiles_a_window_or_documents_leave():
    """Four 128-row query blocks: causal sees 1 + 2 + 3 + 4 key blocks. A 128-token window
    leaves each block its diagonal and the block before (7). Two documents of 256 tokens
    leave each its own triangle (3 + 3), one starting mid-block keeps the earlier document's
    blocks for that query block."""
    t = 512
    causal = jnp.zeros((1, t), jnp.int32)
    assert flash_attention.visible_blocks(causal) == 10
    window, _ = fa.key_bounds(t, None, 128, 1)
    assert flash_attention.visible_blocks(window) == 7
    halves, _ = fa.key_bounds(t, jnp.repeat(jnp.arange(2), 256)[None], None, 1)
    assert flash_attention.visible_blocks(halves) == 6
    late = jnp.where(jnp.arange(t) < 320, 0, 1)[None]  # the second document from row 320
    first_key, _ = fa.key_bounds(t, late, None, 1)
    assert flash_attention.visible_blocks(first_key) == 1 + 2 + 3 + 2
    assert flash_attention.visible_blocks(jnp.concatenate([causal, window])) == 17
