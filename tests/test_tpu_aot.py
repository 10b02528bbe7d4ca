"""benchmarks.cost.tpu_aot: the tiny model's stages compiled for a TPU topology without a TPU, and
the loop-aware counting of benchmarks.cost.hlo_cost checked on hand-made loops.

Needs libtpu (``pip install "jax[tpu]==<jax's version>"``, the ``tpu-aot`` extra); without it
the tests that compile skip and say so (fail under CI=true: .ci/run installs it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.cost import hlo_cost, tpu_aot, tpu_stages
from benchmarks.cost.hlo_text import Array
from dge_jax.eviction.decode_spec import DecodeCompression

TOPOLOGY = "v5e:2x4"
TINY = {  # a tiny Llama: 8 query heads over 4 kv heads (GQA), as config.json says it
    "model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
    "max_position_embeddings": 4096, "eos_token_id": 1,
}  # fmt: skip
KEYS = {"name", "compiles", "peak_bytes_per_device", "flops", "hbm_bytes", "ideal_hbm_bytes",
        "pallas_kernel", "kv_collectives"}  # fmt: skip


@pytest.fixture(scope="module")
def devices():
    """The abstract devices of a v5e:2x4 slice (libtpu compiles for them; no TPU needed)."""
    try:
        return tpu_aot.topology_devices(TOPOLOGY)
    except Exception as e:  # NoLibtpu (saying how to install it), or a topology it refuses
        reason = f"{type(e).__name__}: {str(e)[:300]}"
        if os.environ.get("CI") == "true":  # .ci/run installs it: there, a skip hides a fault
            pytest.fail(reason)
        pytest.skip(reason)


def _mesh(devices):
    return jax.sharding.Mesh(np.array(devices).reshape(1, len(devices)), ("data", "model"))


def _compile(devices, fn, *shapes):
    mesh = _mesh(devices)
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes]
    return jax.jit(fn).lower(*args).compile()


def test_loop_bodies_count_once_per_trip(devices):
    """A fori_loop of 7 trips over a matmul: counted FLOPs = 7 x one matmul's, where XLA's
    cost_analysis counts the body once."""
    n = 256
    shapes = [((n, n), jnp.float32)] * 2
    one = _compile(devices, lambda x, w: jnp.tanh(x @ w), *shapes)
    looped = _compile(
        devices, lambda x, w: jax.lax.fori_loop(0, 7, lambda i, c: jnp.tanh(c @ w), x), *shapes
    )
    body = hlo_cost.analyze(one.as_text()).cost.flops
    counted = hlo_cost.analyze(looped.as_text())
    assert body >= 2 * n**3
    assert [(loop.trips, loop.source) for loop in counted.loops] == [(7, "static")]
    assert counted.cost.flops == pytest.approx(7 * body, rel=1e-3)
    assert looped.cost_analysis()["flops"] == pytest.approx(body, rel=1e-2)


def test_run_time_trip_counts_are_assumed_or_counted_once(devices):
    n = 128
    compiled = _compile(
        devices,
        lambda x, w, k: jax.lax.fori_loop(0, k, lambda i, c: c @ w, x),
        ((n, n), jnp.float32), ((n, n), jnp.float32), ((), jnp.int32),
    )  # fmt: skip
    once = hlo_cost.analyze(compiled.as_text())
    five = hlo_cost.analyze(compiled.as_text(), unknown_trips=5)
    assert [loop.source for loop in once.loops] == ["unknown (counted once)"]
    assert [(loop.trips, loop.source) for loop in five.loops] == [(5, "assumed")]
    # four more trips of a body that is one n x n matmul (2 n^3 FLOPs) and a counter add
    assert five.cost.flops - once.cost.flops == pytest.approx(4 * 2 * n**3, rel=1e-3)


# A hand-written program (TPU layouts: S(1) is on-chip VMEM): a matmul whose weight reaches
# the convolution through a nested bitcast fusion, a batched matmul in TPU XLA's dilated-window
# form (the batch a spatial dimension, one real tap per output position), and a 5-trip loop
# that reads one row of a stack (dynamic-slice) and writes one row in place
# (dynamic-update-slice).
HAND_WRITTEN = pathlib.Path(__file__).with_name("hand_written_tpu.hlo")


def test_counting_rules_on_a_hand_written_program():
    counted = hlo_cost.analyze(HAND_WRITTEN.read_text())
    assert [(loop.trips, loop.source) for loop in counted.loops] == [(5, "static")]
    matmul, batched = 2 * 8 * 32 * 64, 2 * 16 * 4 * 8 * 9  # 9 batch entries, 1 tap each
    assert counted.cost.flops == pytest.approx(matmul + batched, abs=16)  # + the loop counter
    reads = 8 * 64 * 2 + 64 * 32 * 2  # x and all of w; the result stays in VMEM
    reads += (9 * 16 * 8 + 9 * 4 * 8) * 2 + 9 * 16 * 4 * 4  # the batched matmul's in and out
    rows = 5 * 4 * 128 * 4  # per trip: a row read and written, a row updated in place
    assert counted.cost.hbm_bytes == pytest.approx(reads + rows, abs=200)  # + scalars


def test_bytes_by_source_add_up_to_the_total():
    """The ledger of where the bytes go: each source's bytes times its loop's trips, summing
    to the program's total; the loop's row read and its in-place row write count 5 trips."""
    counted = hlo_cost.analyze(HAND_WRITTEN.read_text())
    ledger = counted.hbm_by_source
    assert sum(ledger.values()) == pytest.approx(counted.cost.hbm_bytes_declared, rel=1e-9)
    top = counted.top_sources(3)
    assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] > 0
    # per trip: a row of 128 f32 read (or the update read) and one written, and the index
    row = 2 * 128 * 4 + 4
    assert ledger["fusion -> f32[1,128]"] == ledger["fusion -> f32[16,128]"] == 5 * row, ledger


def test_causal_tile_fraction_by_hand():
    """Query tile i of step c needs the key tiles up to its last position; the kernel declares
    every key tile of the capacity for every query tile."""
    f = tpu_stages.causal_tile_fraction
    assert f(512, 1, 2048) == 1 / 4  # one query tile, the first of 4 key tiles
    assert f(1024, 1, 1088) == (1 + 2) / (2 * 3)  # 2 query tiles of 512, 3 key tiles
    assert f(1024, 2, 1088) == (1 + 2) / (2 * 1 * 3)  # the same tiles in 2 steps
    assert f(300, 1, 700, block=128) == (1 + 2 + 3) / (3 * 6)  # the last query tile partial


def test_keys_and_values_are_told_from_activations():
    """A collective moving [.., S, D] slots of the cache's dtype moves keys or values; one
    moving activations [B, T, H, D] does not."""
    kv = hlo_cost.Collective("all-gather", [Array("bf16", (2, 1, 4, 1088, 16), True)], [], "")
    flat = hlo_cost.Collective("all-to-all", [Array("bf16", (1088 * 16,), True)], [], "")
    act = hlo_cost.Collective("all-reduce", [Array("bf16", (1, 512, 8, 16), True)], [], "")
    pos = hlo_cost.Collective("all-gather", [Array("s32", (1, 4, 1088, 16), True)], [], "")
    slots = (1088, 512)
    assert tpu_aot.moves_kv(kv, slots, 16, "bf16") and tpu_aot.moves_kv(flat, slots, 16, "bf16")
    assert not tpu_aot.moves_kv(act, slots, 16, "bf16")
    assert not tpu_aot.moves_kv(pos, slots, 16, "bf16")


def test_largest_batch_search():
    probed = []

    def fits(b):
        probed.append(b)
        return b <= 11

    assert tpu_aot.largest(fits, step=1) == 11
    assert tpu_aot.largest(lambda b: b <= 11, step=2) == 10
    assert tpu_aot.largest(lambda b: b <= 11, step=1, start=16) == 11
    assert tpu_aot.largest(lambda b: False, step=1) == 0
    assert len(probed) <= 8


def test_an_int4_cache_is_searched_in_8_rows_a_device(tmp_path):
    """`batch_step`: the mesh's row multiple, times 8 rows a device for an int4 cache, whose
    memory is not monotone in the rows between multiples of 8 (module docstring)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = tpu_stages.load_config(tmp_path / "config.json")[1]
    mesh = types.SimpleNamespace(shape={"data": 2, "model": 4})
    setup = types.SimpleNamespace(cfg=cfg, mesh=mesh, kv_quant="none")
    plain = tpu_aot.batch_step(setup)
    assert plain == 2  # the tiny model's 4 kv heads split over model 4: rows over data 2
    for quant in ("int4", "int4-g16-r64"):
        assert tpu_aot.batch_step(types.SimpleNamespace(**{**vars(setup), "kv_quant": quant})) == 16
    assert tpu_aot.batch_step(types.SimpleNamespace(**{**vars(setup), "kv_quant": "int8"})) == 2


@pytest.fixture(scope="module")
def tiny_report(devices, tmp_path_factory) -> str:
    """What `python -m benchmarks.cost.tpu_aot ... --json` prints for the tiny model on v5e:2x4
    (data 2 x model 4), every cell (DGE, lookahead, decode) at budget 128, 16 new tokens."""
    config = tmp_path_factory.mktemp("tiny") / "config.json"
    config.write_text(json.dumps(TINY))
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        tpu_aot.main([
            "--topology", TOPOLOGY, "--config", str(config), "--seq", "1024", "--batch", "2",
            "--mesh", "data=2,model=4", "--budget", "128", "--max_new_tokens", "16", "--json",
            "--chunk", "512",  # two prefill steps (the TPU's chunk would take the prompt in one)
        ])  # fmt: skip
    return printed.getvalue()


def test_tiny_model_stages_compile_for_v5e(tiny_report):
    """Every stage of a DGE-SnapKV cell compiles for v5e:2x4 on a data 2 x model 4 mesh; the
    JSON object has the documented keys and positive figures."""
    out = json.loads(tiny_report)  # stdout is one JSON object, nothing else
    assert {"topology", "seq", "batch", "hbm_bytes_per_device", "stages"} <= set(out)
    assert (out["topology"], out["seq"], out["batch"]) == (TOPOLOGY, 1024, 2)
    # what XLA:TPU lets a program use on a v5e device: its 16 GiB less the runtime's share
    assert 15 * 2**30 < out["hbm_bytes_per_device"] <= 16 * 2**30
    names = [s["name"] for s in out["stages"]]
    assert names == ["prefill", "draft", "rewind", "select", "compact", "decode", "decode_full"]
    for stage in out["stages"]:
        assert KEYS <= set(stage), stage["name"]
        assert stage["compiles"], (stage["name"], stage["error"])
        for key in ("peak_bytes_per_device", "flops", "hbm_bytes", "ideal_hbm_bytes"):
            assert stage[key] > 0, (stage["name"], key)
        # attention="auto" on TPU: prefill attends with the Pallas flash kernel, the draft and
        # decode steps with the decode kernel (flash_decode.py); selection and compaction: XLA
        attends = stage["name"] in ("prefill", "draft", "decode", "decode_full")
        assert stage["pallas_kernel"] is attends, stage["name"]
        assert stage["kv_collectives"] == [], (stage["name"], stage["kv_collectives"])
    prefill = out["stages"][0]
    # 2 chunks, 2 layers; the attention's key blocks are the kernel's grid, not an XLA loop
    assert [(loop["trips"], loop["source"]) for loop in prefill["loops"]] == [
        (2, "static"), (2, "static")]  # fmt: skip
    assert prefill["flops"] > prefill["xla_cost_analysis"]["flops"]
    # the flash kernel declares its cost: counted in place of its operands and results
    assert prefill["kernel_declared_bytes"] > 0 and prefill["kernel_boundary_bytes"] > 0
    assert (out["prefill_chunk"], out["attention"], out["layer_loop"]) == (512, "pallas", "scan")
    cell = out["cell"]
    assert cell["complete"] and cell["peak_bytes_per_device"] > 0
    # one live full cache: held from prefill to compaction (the draft and rewind update it in
    # place), none while the compacted cache decodes (what a real grid holds, traced)
    assert cell["full_caches_held_at_most"] == 1
    assert cell["full_caches_alive_during_decode"] == 0
    held = {s["name"]: s.get("cell_caches_held") for s in out["stages"]}
    assert held["draft"] == held["compact"] == {"full": 1, "compacted": 0}
    assert held["decode"] == {"full": 0, "compacted": 1}


LOOKAHEAD = ["prefill", "first_select", "first_compact", "lookahead", "select", "compact",
             "decode"]  # fmt: skip


def test_lookahead_and_decode_cells_compile_for_v5e(tiny_report):
    """The lookahead (LAQ, L 8) and decode-at-k (interval 2) cells beside the DGE one compile
    stage by stage; the lookahead cell holds one full cache until its own compaction and the
    compacted copy while it looks ahead; the decode cell holds the full cache through its
    loop, whose cache is `DecodeCompression.capacity`'s (as the compiled program returns it)."""
    out = json.loads(tiny_report)
    la, dec = out["timings"]["lookahead"], out["timings"]["decode"]
    for part, names in ((la, LOOKAHEAD), (dec, ["prefill", "decode_compressed"])):
        assert [s["name"] for s in part["stages"]] == part["cell"]["stages"] == names
        for stage in part["stages"]:
            assert stage["compiles"], (stage["name"], stage["error"])
            assert stage["peak_bytes_per_device"] > 0 and stage["kv_collectives"] == []
        assert part["cell"]["complete"] and part["cell"]["peak_bytes_per_device"] > 0
    none, full = {"full": 0, "compacted": 0}, {"full": 1, "compacted": 0}
    both, compacted = {"full": 1, "compacted": 1}, {"full": 0, "compacted": 1}
    held = {s["name"]: s["cell_caches_held"] for s in la["stages"]}
    assert held == {"prefill": none, "first_select": full, "first_compact": full,
                    "lookahead": both, "select": full, "compact": full,
                    "decode": compacted}  # fmt: skip
    cell = la["cell"]
    assert cell["first_stage"] == {"budget": 512, "window": 32}
    assert cell["lookahead_capacity"] == 512 + 8  # LAQ's 512 entries + room for its 8 steps
    # while it looks ahead: one full cache and the copy, each weighed at its compiled slots
    step = dict(zip(LOOKAHEAD, la["stages"], strict=True))["lookahead"]
    caches = (step["cell_live_bytes_per_device"] - out["params_bytes_per_device"]
              - step["output_bytes"] + step["alias_bytes"] - step["temp_bytes"])  # fmt: skip
    one = cell["full_cache_bytes_per_device"]
    assert caches == pytest.approx(one * (1 + cell["lookahead_capacity"] / cell["capacity"]))
    held = {s["name"]: s["cell_caches_held"] for s in dec["stages"]}
    assert held == {"prefill": none, "decode_compressed": full}
    assert dec["cell"]["full_caches_alive_during_decode"] == 1
    assert dec["cell"]["loop_capacity"] == DecodeCompression(128, interval=2).capacity() == 130


def test_the_cells_side_by_side(tiny_report, capsys):
    """The comparison: one-token steps on the full and on a compressed cache after prefill
    (16 new tokens, the first from prefill), the full caches alive at each cell's peak, and
    the table printing it."""
    out = json.loads(tiny_report)
    rows = {r["cell"]: r for r in out["comparison"]}
    steps = {name: (r["steps_full"], r["steps_compressed"]) for name, r in rows.items()}
    assert steps == {"dge(2)": (1, 14), "lookahead(8)": (0, 8 + 15), "decode(i2)": (2, 13)}
    for row in rows.values():
        cell = (out["cell"] if row["timing"] == "dge" else out["timings"][row["timing"]]["cell"])
        assert row["peak_bytes_per_device"] == cell["peak_bytes_per_device"]
        assert row["fits"] and row["full_caches_alive_at_peak"] == 1
        assert row["failed_stage"] is None and row["peak_in_full_caches"] > 1
        assert row["largest_batch"] is None  # no --max_batch
    tpu_aot.print_table(out)
    printed = capsys.readouterr().out
    assert "\nlookahead(8) | prefill + 0 | 23 | 1 | " in printed
    assert "\ndecode(i2) | prefill + 2 | 13 | 1 | " in printed


def test_a_kernel_counts_the_cost_it_declares():
    """A Pallas kernel's FLOPs and bytes are the ones its CostEstimate declares (carried in
    the custom call's backend config); its operands and results stay in hbm_bytes, and
    hbm_bytes_declared puts the declared bytes in their place."""
    text = (
        "HloModule m, entry_computation_layout={(bf16[8,128]{1,0})->bf16[8,128]{1,0}}\n\n"
        "ENTRY %main (p: bf16[8,128]) -> bf16[8,128] {\n"
        "  %p = bf16[8,128]{1,0} parameter(0)\n"
        "  ROOT %k = bf16[8,128]{1,0} custom-call(%p), custom_call_target=\"tpu_custom_call\", "
        'backend_config={"custom_call_config":{"body":"x","cost_estimate":{"flops":"1000",'
        '"transcendentals":"10","bytes_accessed":"50000","remote_bytes_transferred":"0"}}}\n'
        "}\n"
    )
    counted = hlo_cost.analyze(text)
    assert counted.pallas
    cost = counted.cost
    assert (cost.flops, cost.transcendentals) == (1000, 10)
    boundary = 2 * 8 * 128 * 2  # read once, written once
    assert cost.kernel_boundary_bytes == cost.hbm_bytes == boundary
    assert cost.kernel_declared_bytes == 50000
    assert cost.hbm_bytes_declared == 50000


# --- the command's errors: one line each, before anything compiles, with or without libtpu ----

# What jax 0.10 raises from get_topology_desc when libtpu is not installed.
NO_LIBTPU = ("JAX TPU support not installed; cannot generate TPU topology. See "
             "https://github.com/jax-ml/jax#installation")  # fmt: skip


@pytest.fixture
def command(tmp_path, monkeypatch, capsys):
    """command(*flags, topology=...) -> (exit status, stderr) of tpu_aot.main on the tiny
    config; compiling fails the test (every error here comes first), and libtpu is simulated
    (`topologies.get_topology_desc` replaced by the `libtpu` fixture's answer), so these
    tests run alike with libtpu installed (CI) or not."""
    from jax.experimental import topologies

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    answer: dict = {"result": RuntimeError(NO_LIBTPU)}

    def get_topology_desc(platform, topology_name):
        assert platform == "tpu"
        answer["asked"] = topology_name
        if isinstance(answer["result"], Exception):
            raise answer["result"]
        return answer["result"]

    def no_compile(*args, **kwargs):
        pytest.fail("compiled before the error")

    monkeypatch.setattr(topologies, "get_topology_desc", get_topology_desc)
    monkeypatch.setattr(tpu_stages, "compile_cell", no_compile)

    def run(*flags: str, topology: str = TOPOLOGY, config_path=config) -> tuple[int, str]:
        with pytest.raises(SystemExit) as exit_:
            tpu_aot.main(["--topology", topology, "--config", str(config_path), "--seq", "1024",
                          *flags])  # fmt: skip
        out, err = capsys.readouterr()
        assert out == "", out
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return exit_.value.code, err.strip()

    run.answer = answer
    run.config = config
    return run


def test_missing_libtpu_is_one_line_naming_the_extra(command):
    status, err = command()
    assert status == 1  # the environment's fault, as `python -m dge_jax` counts it
    assert "needs libtpu, which is not installed (JAX TPU support not installed)" in err
    assert 'pip install -e ".[tpu-aot]"' in err
    assert f'pip install "jax[tpu]=={jax.__version__}"' in err


def test_verbose_keeps_the_traceback(command):
    with pytest.raises(tpu_aot.NoLibtpu, match="needs libtpu"):
        tpu_aot.main(["--topology", TOPOLOGY, "--config", str(command.config), "--seq", "8",
                      "--verbose"])  # fmt: skip


@pytest.mark.parametrize("topology", ["v9z:2x4", "v5e", "v5e:2x", "v5e:0x4", "tpu-v5e-8"])
def test_a_topology_name_of_another_form_is_refused_before_libtpu_loads(command, topology):
    status, err = command(topology=topology)
    assert status == 2 and "asked" not in command.answer
    assert err == (f"error: --topology {topology!r} is not a TPU topology: write CHIP:AxB[xC] "
                   "with CHIP one of v4, v5e, v5p, v6e, e.g. v5e:2x4")  # fmt: skip


def test_a_topology_libtpu_cannot_lay_out_is_named(command):
    """libtpu's own refusal (its wording differs by release: any error but the missing
    library) is quoted, with shapes it does lay out."""
    command.answer["result"] = RuntimeError("INVALID_ARGUMENT: no v5e slice of shape 3x3")
    status, err = command(topology="v5e:3x3")
    assert status == 2 and command.answer["asked"] == "v5e:3x3"
    assert err.startswith("error: --topology 'v5e:3x3': libtpu cannot lay out this topology "
                          "(INVALID_ARGUMENT: no v5e slice of shape 3x3); give a slice shape")
    assert "e.g. v5e:2x4" in err


@pytest.mark.parametrize(
    "write, message",
    [
        (None, r"--config \S+: no such file; pass a Hugging Face config\.json, e\.g\. "
               r"benchmarks/configs/llama3_1_8b\.json"),
        ("{not json", r"--config \S+ is not a JSON file \(Expecting property name .*\); pass a "
                      r"Hugging Face config\.json"),
        (json.dumps(TINY | {"model_type": "gpt2"}),
         r"--config \S+: unknown model_type 'gpt2' in config.json; supported: .*llama"),
        (json.dumps(TINY | {"rms_norm_eps": None}),
         r"--config \S+: config.json field rms_norm_eps is null, but it must be a positive "
         r"number; set it"),
        ("[1, 2]", r"--config \S+: config\.json holds an array, not an object of model "
                   r"settings; use the checkpoint's own config\.json"),
    ],
    ids=["missing", "not_json", "unknown_family", "null_field", "not_an_object"],
)  # fmt: skip
def test_a_config_that_cannot_be_read_is_refused_before_libtpu_loads(
    command, tmp_path, write, message
):
    path = tmp_path / "model" / "config.json"
    if write is not None:
        path.parent.mkdir()
        path.write_text(write)
    status, err = command(config_path=path)
    assert status == 2 and "asked" not in command.answer
    assert re.match("error: " + message, err), err


def test_a_config_folder_is_refused_naming_its_config_json(command, tmp_path):
    status, err = command(config_path=command.config.parent)
    assert status == 2
    assert err == (f"error: --config {command.config.parent} is a folder; pass a config.json "
                   f"file, e.g. {command.config}")  # fmt: skip


@pytest.mark.parametrize(
    "mesh, problem",
    [
        ("data=2,model=8", "a mesh of data=2 x model=8 needs 16 devices, but only 8 are "
                           "available"),
        ("data=3", "a mesh of data=3 x model=1 = 3 devices does not divide the 8 available "
                   "devices; choose axis sizes whose product divides 8"),
        ("data=2,pipe=4", "bad mesh spec 'data=2,pipe=4'"),
    ],
)  # fmt: skip
def test_a_mesh_that_does_not_fit_the_topology_is_refused_before_compiling(
    command, mesh, problem
):
    """The topology's device count (8 abstract devices of v5e:2x4) against --mesh."""
    command.answer["result"] = types.SimpleNamespace(devices=[object()] * 8)
    status, err = command("--mesh", mesh)
    assert status == 2
    assert err.startswith(f"error: --mesh {mesh}: {problem}")
    assert err.endswith(f"; {TOPOLOGY} has 8 devices: give data=D,model=M with D x M dividing 8")


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--budget", "-1"), ("--chunk", "0"),
                                         ("--lookahead", "0")])  # fmt: skip
def test_sizes_below_one_are_usage_errors(command, flag, value):
    status, err = command(flag, value)
    assert status == 2
    assert err == (f"error: {flag} must be >= 1, got {value}; see python -m "
                   "benchmarks.cost.tpu_aot --help")  # fmt: skip


@pytest.mark.parametrize("cells", ["dge,laq", "dge,dge", ""])
def test_cells_are_named_among_the_three(command, cells):
    status, err = command("--cells", cells)
    assert status == 2
    assert err == (f"error: --cells takes distinct names among dge, lookahead, decode, got "
                   f"{cells!r}; see python -m benchmarks.cost.tpu_aot --help")  # fmt: skip
