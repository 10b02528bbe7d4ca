"""Smoke test of `python -m benchmarks.run` at tiny sizes, without the peers' venv.

The CPU suite runs its pure-JAX parts (scenario (a) on the tiny random Llama of
`tests/tiny_model.py`, the research grid, scenario (b)) with `--tiny --no-peers`; the GPU
suite's code path runs on CPU in bf16. Both check the JSON schema and the Markdown. The
helpers that turn measurements into figures (FLOP counts, stage attribution, agreement, the
kvpress compression ratio, the GPU table, the Hugging Face folder writer) are checked on
hand-made inputs.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from tiny_model import build_tiny_llama

import dge_jax
from benchmarks import (
    cpu_kernels,
    gpu_suite,
    harness,
    machine,
    plans,
    report,
    run,
    scenario_a,
    scenario_b,
    selection,
    suites,
    work,
)
from benchmarks.cost import cpu_programs
from benchmarks.peers import agreement
from benchmarks.peers.peers import ratio_for
from dge_jax.config import ModelConfig


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    folder = build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    out = tmp_path_factory.mktemp("results")
    argv = ["--suite", "cpu", "--tiny", "--model", str(folder), "--no-peers", "--out", str(out)]
    result = run.main(argv)
    return result, out


@pytest.mark.slow
def test_cpu_suite_json_schema(cpu_run):
    result, out = cpu_run
    saved = json.loads((out / "cpu-tiny.json").read_text())
    assert saved["suite"] == "cpu" and saved["size"] == "tiny"
    assert saved["command"].startswith("python -m benchmarks.run --suite cpu --tiny")
    for key in (
        "machine",
        "limits",
        "rows",
        "grid",
        "headline",
        "prefill_profile",
        "agreement",
        "b_extras",
        "targets",
        "peers",
        "load_start",
        "load_end",
        "date",
        "wall_s",
    ):
        assert key in saved, key
    assert _finite_positive(saved["limits"]["gflops"]) and _finite_positive(saved["limits"]["gb_s"])
    assert saved["peers"] == {"available": False, "reason": "--no-peers"}

    rows = saved["rows"]
    for row in rows:
        assert set(plans.ROW_FIELDS) <= set(row), set(plans.ROW_FIELDS) - set(row)
        assert row["system"] == "dge_jax"  # no peers
        for field in (
            "prefill_tok_s",
            "ttft_s",
            "decode_tok_s",
            "e2e_s",
            "peak_mem",
            "cache_bytes",
            "compile_s",
            "compilations",
        ):
            assert _finite_positive(row[field]), (field, row)
    a = [r for r in rows if r["scenario"] == "a"]
    assert {(r["prompt_tokens"], r["batch"], r["method"]) for r in a} == {
        (256, 1, m) for m in plans.A_METHODS
    }
    for r in a:
        assert r["decode_steps"] == (4 if r["method"] == "SnapKV dge(2)" else 5)  # 6 new tokens
        evicts = r["method"] != "FullKV"
        assert (r["evict_s"] is not None) == evicts
        assert (r["cache_bytes"] < r["cache_bytes_full"]) == evicts
    b = [r for r in rows if r["scenario"] == "b"]
    assert {r["method"] for r in b} == {"FullKV", "SnapKV dge(2) compacted"}
    (extras,) = saved["b_extras"]
    assert extras["kept_max"] <= 48 and extras["compacted_capacity"] >= 48 + 4

    grid = saved["grid"]
    assert grid["cells"] == 27 and grid["warm_compilations"] == 0
    assert all(r["warm_compilations"] == 0 for r in a)  # the warm call compiled nothing
    assert set(saved["headline"]["e2e_s"]) >= {f"dge_jax {m}" for m in plans.A_METHODS}
    assert saved["agreement"]["fullkv"]["prompts"] == 0  # needs the peers
    names = [t["name"] for t in saved["targets"]]
    assert len(names) == 9
    measured = {t["name"]: t["met"] for t in saved["targets"] if t["met"] is not None}
    assert any(n.startswith("(b) compacted / full decode") for n in measured)

    md = (out / "cpu-tiny.md").read_text()
    for heading in (
        "# Benchmarks: `cpu` suite (tiny)",
        "## Scenario (a)",
        "## Scenario (b)",
        "## Research grid: 27 cells",
        "## Agreement",
        "## Targets",
    ):
        assert heading in md, heading
    assert "peers: not run (--no-peers)" in md


@pytest.mark.long
def test_gpu_suite_code_path_on_cpu(tmp_path):
    """`python -m benchmarks.gpu_suite --tiny` on CPU: the tiny plan's batches 1, 8 and 32 and
    its long prompt, full and compacted rows each, under xla attention only (cuDNN runs on
    GPUs only)."""
    plan = plans.make_plan("gpu", "tiny")
    assert sorted({b for _, b in plan.b_configs}) == [1, 8, 32]
    result = gpu_suite.main(["--tiny", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu-tiny.json").read_text())
    assert saved == json.loads(json.dumps(result, default=report._json_default))
    assert saved["peaks"]["source"] == "measured"  # a CPU is in no GPU table
    assert suites.gpu_attention() == ("xla",)
    rows = saved["rows"]
    methods = ["FullKV", "SnapKV dge(2) compacted"]
    expected = [(t, b, "xla", m) for t, b in plan.b_configs for m in methods]
    assert [(r["prompt_tokens"], r["batch"], r["attention"], r["method"]) for r in rows] == (
        expected
    )
    for r in rows:
        assert r["scenario"] == "gpu" and r["dtype"] == "bfloat16"
        assert _finite_positive(r["mfu"]) and _finite_positive(r["bw_util"])
        assert _finite_positive(r["prefill_tok_s"]) and _finite_positive(r["decode_tok_s"])
        assert r["compilations"] > 0
    assert [e["attention"] for e in saved["b_extras"]] == ["xla"] * len(plan.b_configs)
    md = (tmp_path / "gpu-tiny.md").read_text()
    assert "MFU %" in md and "| attention |" in md and "| xla |" in md


@pytest.mark.slow
def test_kv_config_repeated_compiles_nothing():
    """What makes the GPU suite's compile counts per backend: every step of a configuration
    comes from JAX's compile cache the second time (the compact step included), so a second
    backend's pass compiles only what differs, its prefill. On CPU both passes run xla."""
    plan = plans.make_plan("gpu", "tiny")
    compiles, memory = harness.CompileLog.get(), harness.Memory()
    limits = {"gflops": 1.0, "gb_s": 1.0}
    first, _ = scenario_b.run_kv_config(plan, 64, 2, compiles, memory, limits, "xla")
    second, _ = scenario_b.run_kv_config(plan, 64, 2, compiles, memory, limits, "xla")
    assert first[0]["compilations"] > 0 and second[0]["compilations"] == 0
    assert [r["decode_steps"] for r in second] == [r["decode_steps"] for r in first]


def test_selection_benchmark_quick(capsys):
    """`python -m benchmarks.selection --quick`: checks its replacements agree (it raises
    otherwise) and prints one table row per part."""
    figures = selection.main(["--quick", "--runs", "1"])
    assert all(_finite_positive(v) for v in figures.values()), figures
    table = capsys.readouterr().out
    assert "| select (bisection) |" in table and "| compact (partition) |" in table


def test_cpu_kernels_benchmark_quick(capsys):
    """`python -m benchmarks.cpu_kernels --quick`: a figure per row count and per attention
    variant, and the table that says so."""
    figures = cpu_kernels.main(["--quick", "--runs", "1"])
    assert [r["rows"] for r in figures["projections"]] == list(cpu_kernels.ROWS)
    for r in figures["projections"]:
        assert _finite_positive(r["ynnpack_ms"]) and _finite_positive(r["eigen_ms"]), r
    assert all(_finite_positive(v) for v in figures["attention"].values())
    out = capsys.readouterr().out
    assert "| 4 |" in out and "| written_slot_attention (the library) |" in out


def test_eigen_dots_option_moves_the_dots_off_ynnpack():
    """The benchmark's Eigen column is what it says: with the option, the projections compile
    without YNNPACK fusions, and they compute the same numbers."""
    layers = cpu_kernels.layer_weights(cpu_kernels.QUICK, jax.random.PRNGKey(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (4, cpu_kernels.QUICK[1]))
    default = jax.jit(cpu_kernels.projections).lower(layers, x).compile()
    eigen = jax.jit(cpu_kernels.projections, compiler_options=cpu_kernels.EIGEN_DOTS)
    eigen = eigen.lower(layers, x).compile()
    assert "__ynn_fusion" in default.as_text() and "__ynn_fusion" not in eigen.as_text()
    np.testing.assert_allclose(eigen(layers, x), default(layers, x), rtol=1e-5, atol=1e-6)


def test_prefill_flops_by_hand():
    cfg = ModelConfig(
        "llama",
        vocab_size=10,
        hidden_size=4,
        intermediate_size=6,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
    )
    # per layer: q 4x4, k 4x2, v 4x2, o 4x4, gate/up/down 3 x 4x6 = 16+8+8+16+72 = 120
    assert work.linear_params(cfg) == 2 * 120
    t = 3
    linear = 2 * 240 * t
    attention = 2 * 2 * 2 * 2 * 2 * (1 + 2 + 3)  # q.k and p.v over 1, 2, 3 visible keys
    assert work.prefill_flops(cfg, t, rows=2) == 2 * (linear + attention + 2 * 4 * 10)


def _rec(stage, wall=1.0, compile_s=0.0, **extra):
    return {"stage": stage, "wall_s": wall, "compile_s": compile_s, "compilations": 0,
            "peak_mem": 1, **extra}  # fmt: skip


def test_call_row_nets_out_compilation():
    # A cold dge(2) call: it began at t = 8; its prefill compiled for 1 s and ended at t = 12.
    records = [
        _rec("prefill", 3.0, compile_s=1.0, t_end=12.0, compile_at_end=1.5, cache_bytes=100),
        _rec("draft", 0.5),
        _rec("rewind", 0.1),
        _rec("keep_masks", 0.7, compile_s=0.5),
        _rec("apply_eviction", 0.2, cache_bytes=10),
        _rec("stack_states", 0.05),
        _rec("decode", 3.5, compile_s=0.5, cache_bytes=10, steps=62),
    ]
    call = harness.Call(wall_s=9.0, compile_s=2.5, compilations=7, records=records, t0=8.0,
                    peak_mem=123)  # fmt: skip
    cfg = ModelConfig("llama", vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=2)  # fmt: skip
    limits = {"gflops": 1.0, "gb_s": 1.0}
    row = scenario_a.call_row(call, cfg, rows=2, tokens=3, param_bytes=50, limits=limits)
    assert row["prefill_s"] == pytest.approx(2.0)
    assert row["ttft_s"] == pytest.approx(12.0 - 8.0 - 1.5)
    assert row["draft_s"] == pytest.approx(0.5)
    assert row["evict_s"] == pytest.approx(0.1 + 0.2 + 0.2)
    assert row["decode_s"] == pytest.approx(3.0)
    assert row["decode_tok_s"] == pytest.approx(2 * 62 / 3.0)
    assert row["decode_gb_s"] == pytest.approx((50 + 10) * 62 / 3.0 / 1e9)
    assert row["e2e_s"] == pytest.approx(9.0 - 2.5)
    assert (row["compile_s"], row["compilations"], row["peak_mem"]) == (2.5, 7, 123)
    assert (row["cache_bytes"], row["cache_bytes_full"]) == (10, 100)
    assert row["prefill_gflops"] == pytest.approx(work.prefill_flops(cfg, 3, 2) / 2.0 / 1e9)


def test_agreement_helpers():
    assert agreement.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert agreement.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    full = agreement.fullkv_agreement(
        [
            {"label": "p0", "ours": [1, 2], "theirs": [1, 2], "margins": [1.0, 1.0]},
            {"label": "p1", "ours": [1, 2], "theirs": [1, 3], "margins": [1.0, 0.01]},
        ]
    )
    assert full["identical"] == 1 and full["fraction"] == 0.5
    assert full["diverged"] == [
        {"prompt": "p1", "step": 1, "ours": 2, "transformers": 3, "transformers_margin": 0.01}
    ]
    kept = agreement.kept_agreement(
        [
            {
                "label": "p0",
                "ours": [1],
                "theirs": [1],
                "ours_kept": [[[0, 5, 3]], [[1, 2]]],
                "theirs_kept": [[[3, 5, 0]], [[1, 4]]],
                "theirs_gap": [[0.5], [3e-7]],
            },
        ]
    )
    assert (kept["heads"], kept["kept_identical_heads"], kept["kept_identical_prompts"]) == (
        2,
        1,
        0,
    )
    assert kept["details"][0]["first_differing_head"] == (1, 0)
    assert kept["details"][0]["differing_heads"] == [
        {"layer": 1, "head": 0, "boundary_gap": 3e-7, "only_ours": [2], "only_theirs": [4]}
    ]


def test_kvpress_ratio_keeps_exactly_the_budget():
    for k_len in (129, 512, 2048, 4096, 8128, 16384):
        for budget in (64, 96, 128, 256, 512):
            if budget < k_len:
                assert int(k_len * (1 - ratio_for(k_len, budget))) == budget


def test_gpu_table_and_flags():
    assert machine.known_gpu("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert machine.known_gpu("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert machine.known_gpu("NVIDIA H200").name == "H200 SXM"
    assert machine.known_gpu("cpu") is None
    measured = {"gflops": 100.0, "gb_s": 10.0}
    h200 = machine.peaks_for("NVIDIA H200", measured)
    assert (h200["gflops"], h200["gb_s"]) == (989e3, 4.8e3)
    assert machine.peaks_for("cpu", measured)["source"] == "measured"
    flags = machine.peaks_for("cpu", measured, tflops=2.0, tb_s=0.5)
    assert (flags["gflops"], flags["gb_s"], flags["source"]) == (2e3, 500.0, "flags")


def test_hf_folder_round_trip(tmp_path):
    plan = plans.make_plan("cpu", "tiny")
    _, cfg = scenario_b.kv_config(plan, 256, 1)
    from models.llama_like import init_params

    params = init_params(cfg, jax.random.PRNGKey(1))
    scenario_b.write_hf_folder(cfg, params, tmp_path)
    model = dge_jax.load(tmp_path)
    assert model.config == cfg
    for ours, loaded in zip(jax.tree.leaves(params), jax.tree.leaves(model.params), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(loaded))


@pytest.mark.long
def test_decode_memory_benchmark_quick(capsys):
    """`python -m benchmarks.decode_memory --quick`: decode-time compression's cache stays at
    its capacity for both answer lengths, FullKV's grows, and the table prints."""
    from benchmarks import decode_memory

    rows = decode_memory.main(["--quick", "--models", "kv", "--no-peers"])
    cache = {(r["cell"], r["new_tokens"]): r["cache_bytes"] for r in rows}
    assert cache[("StreamingLLM", 32)] == cache[("StreamingLLM", 64)]
    assert cache[("SnapKV w8", 64)] == cache[("StreamingLLM", 64)] < cache[("FullKV", 64)]
    assert cache[("FullKV", 32)] < cache[("FullKV", 64)]
    assert "| kv-dominated | 64 | dge_jax | SnapKV w8 |" in capsys.readouterr().out


def test_timing_costs_count_steps_and_bytes(checkpoint, capsys):
    """`benchmarks.timing_costs` on a tiny checkpoint: each timing's steps on the full and on
    a compressed cache, FullKV's cache the largest at the end, and the table prints."""
    from benchmarks import timing_costs

    rows = timing_costs.main(["--model", str(checkpoint("llama")), "--length", "96",
                              "--batch", "2", "--new", "10", "--budget", "16", "--k", "3",
                              "--lookahead", "4", "--runs", "1", "--cells",
                              "full,dge_d(3),lookahead(4),decode(i3),dge(8a)"])
    steps = {r["cell"]: (r["steps_full"], r["steps_compressed"]) for r in rows}
    assert steps["full"] == (9, 0) and steps["dge_d(3)"] == (2, 7)
    assert steps["lookahead(4)"] == (0, 13) and steps["decode(i3)"] == (3, 6)
    assert steps["dge(8a)"][0] == 7  # the draft runs to k_max - 1 for every row
    assert all(r["peak_cache_bytes"] > 0 and r["seconds_per_sample"] > 0 for r in rows)
    assert "| lookahead(4) | 0 | 13 |" in capsys.readouterr().out


def test_cpu_program_hashes_ignore_source_locations_only():
    """Two jits of one computation written on different lines hash the same; another
    computation (one constant changed) hashes differently."""

    def one(scale):
        def f(x):
            return jax.numpy.tanh(x) * scale

        return f

    def other_lines():
        def f(x):  # the same program, from other source lines

            return jax.numpy.tanh(x) * 2.0

        return f

    x = jax.numpy.ones((4, 4))
    compiled = [jax.jit(fn).lower(x).compile() for fn in (one(2.0), other_lines(), one(3.0))]
    same, other, changed = (cpu_programs.digest(c) for c in compiled)
    assert same == other != changed
    text = cpu_programs.program_text(compiled[0])
    assert "tanh" in text and "metadata" not in text and "FileNames" not in text


def test_long_prompts_splits_one_call_by_stage():
    """benchmarks.long_prompts splits each call's time by the stages the hook saw inside that
    same call (so the parts add up to the call, never a difference of two runs)."""
    import time as clock

    from benchmarks.long_prompts import split, timed

    def call(hook):
        def step(seconds):
            clock.sleep(seconds)
            return seconds
        if hook is None:
            return step(0.0)
        hook("prefill", step, 0.03)
        hook("decode", step, 0.02)
        hook("decode", step, 0.02)
        clock.sleep(0.01)

    seconds = timed(call, runs=3)
    assert seconds["prefill"] >= 0.03 and seconds["decode"] >= 0.04
    parts = seconds["prefill"] + seconds["decode"] + seconds["other"]
    assert abs(parts - seconds["total"]) < 5e-3 and seconds["other"] >= 0.01  # medians of parts
    text = split({"prefill": 7.06, "decode": 18.04, "draft": 0.01, "other": 0.2, "total": 25.3})
    assert text == "decode 18.0 s, prefill 7.1 s, other 0.2 s"
