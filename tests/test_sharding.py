"""Scale-out: logical axis rules, meshes, and generation on 8 simulated CPU devices.

The rules and mesh errors are tested here, in pytest's process (one CPU device). Everything
that needs 8 devices runs once in a subprocess (`tests/mesh_checks.py`), started with
XLA_FLAGS=--xla_force_host_platform_device_count=8 so the devices exist before JAX starts
there, while this process and the other test files keep their single device. The subprocess
also asks XLA to dump every compiled step, so the checks read the partitioned HLO of exactly
the programs `generate_grid` ran.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import pytest

from dge_jax.config import ModelConfig
from dge_jax.distribution import constraints
from dge_jax.distribution import sharding as sh
from dge_jax.runtime import cache_layout

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESHES = ("8x1", "2x4", "1x8")
CELLS = ("fullkv", "snapkv_dge2", "adakv_dge2", "snapkv_dge2_decode")
# The grid's compiled steps (it reads the decoded tokens back on the host, no state split).
STEPS = ("prefill_prompt", "draft_tokens", "select_for_budgets", "compact", "stack_states",
         "decode_loop", "decode_compressed")


def config(heads=8, kv_heads=4, **overrides) -> ModelConfig:
    fields = dict(
        family="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
    )
    return ModelConfig(**(fields | overrides))


# --- Rules, in this process ------------------------------------------------------------------


def test_default_rules_map_logical_axes_to_mesh_axes():
    rules = sh.DEFAULT_RULES
    assert rules.spec(("layers", "batch", "kv_heads", "seq", "head_dim")) == jax.P(
        None, "data", "model", None, None
    )
    assert rules.spec(("vocab", "embed")) == jax.P("model", None)
    assert rules.spec(("layers", "mlp", "embed")) == jax.P(None, "model", None)


def test_colliding_logical_axes_are_an_error():
    rules = sh.AxisRules(batch="model")
    with pytest.raises(ValueError, match="mesh axis 'model' would split two dimensions"):
        rules.spec(("batch", "kv_heads"))
    with pytest.raises(ValueError, match="unknown logical axis 'rows'"):
        sh.DEFAULT_RULES.spec(("rows",))
    with pytest.raises(ValueError, match="use None, one of"):
        sh.AxisRules(batch="pipeline")


def test_fit_splits_heads_or_raises():
    fitted = sh.DEFAULT_RULES.fit(config(), {"data": 2, "model": 4}, batch_size=8)
    assert (fitted.batch, fitted.heads, fitted.kv_heads) == ("data", "model", "model")
    with pytest.raises(sh.MeshError, match="more than the 8 query heads"):
        sh.DEFAULT_RULES.fit(config(), {"data": 1, "model": 16})
    with pytest.raises(sh.MeshError, match="8 query heads do not split evenly .* of 3"):
        sh.DEFAULT_RULES.fit(config(), {"data": 1, "model": 3})


def test_fewer_kv_heads_than_model_axis_shards_the_batch_else_replicates():
    # 4 kv heads on an 8-way model axis: attention goes data-parallel, the cache's rows take
    # over the model axis, and the MLP stays split over model ...
    fitted = sh.DEFAULT_RULES.fit(config(kv_heads=4), {"data": 1, "model": 8}, batch_size=8)
    assert fitted.kv_heads is None and fitted.heads is None
    assert fitted.batch == ("data", "model") and fitted.mlp == "model"
    specs = cache_layout.cache_specs(config(kv_heads=4), 8, {"data": 1, "model": 8})
    assert specs.groups[0].k == jax.P(None, ("data", "model"), None, None, None)
    # ... unless the batch does not divide data x model: then kv heads are replicated.
    fitted = sh.DEFAULT_RULES.fit(config(kv_heads=4), {"data": 2, "model": 8}, batch_size=6)
    assert fitted.kv_heads is None and fitted.batch == "data"
    assert sh.row_multiple(config(kv_heads=4), {"data": 2, "model": 8}) == 16
    assert sh.row_multiple(config(kv_heads=4), {"data": 2, "model": 4}) == 2
    # Sizes that do not divide are replicated; query heads are not affected.
    fitted = sh.DEFAULT_RULES.fit(config(vocab_size=130), {"data": 1, "model": 4})
    assert fitted.vocab is None and fitted.heads == "model"


def test_param_axes_cover_every_field_with_matching_ranks():
    from models.llama_like import param_shapes

    cfg = config(qkv_bias=True, o_bias=True, qk_norm=True, mlp_bias=True)
    shapes = param_shapes(cfg)
    axes = sh.param_axes(cfg)
    assert set(shapes) <= set(axes)
    for name, shape in shapes.items():
        assert len(axes[name]) == len(shape), name
    specs = sh.param_specs(cfg, list(shapes), {"data": 2, "model": 4})
    assert specs["layers.wq"] == jax.P(None, None, "model")
    assert specs["layers.wo"] == jax.P(None, "model", None)


def test_bad_meshes_on_one_device():
    with pytest.raises(sh.MeshError, match="needs 2 devices, but only 1"):
        sh.make_mesh(data=2)
    with pytest.raises(sh.MeshError, match="positive integer"):
        sh.make_mesh(data=0)
    for spec in ("data=2,modle=4", "data=x", "", "data=1,data=1"):
        with pytest.raises(sh.MeshError, match="mesh spec"):
            sh.parse_mesh(spec)
    mesh = sh.parse_mesh("data=1,model=1")
    assert dict(mesh.shape) == {"data": 1, "model": 1}
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    explicit = jax.make_mesh((1, 1), ("data", "model"))  # Explicit axes by default
    with pytest.raises(sh.MeshError, match="must be Auto"):
        sh.param_shardings(config(), ["embed"], explicit)
    with pytest.raises(sh.MeshError, match="must be"):
        sh.param_shardings(config(), ["embed"], jax.make_mesh((1,), ("x",)))


def test_cache_placement_and_no_op_constraints_without_a_mesh():
    from dge_jax.runtime.cache import init_cache

    cache = init_cache(2, 8, 4, 16, 16)
    assert cache_layout.constrain_cache(cache, config()) is cache
    assert sh.mesh_of(cache) is None
    mesh = sh.make_mesh()
    placed = cache_layout.shard_cache(cache, config(), mesh)
    assert sh.mesh_of(placed) is mesh and placed.k.sharding.spec == jax.P(
        None, "data", "model", None, None
    )
    fresh = cache_layout.init_sharded_cache(config(), 8, 16, mesh)
    assert fresh.pos.sharding == placed.pos.sharding and int(fresh.pos.max()) == -1


def test_the_residual_stream_is_left_whole_where_it_cannot_split():
    """residual_spec splits a prefill chunk's tokens over model (rows over data), gathers
    them whole for split=False, and leaves the stream alone for one token a row, a token
    count the axis does not divide, a one-device axis and rows already over model;
    constrain_residual is the identity without a mesh (the 8-device split itself:
    test_no_step_gathers_the_cache)."""
    import jax.numpy as jnp

    cfg, mesh4 = config(), {"data": 1, "model": 4}
    assert constraints.residual_spec(cfg, (2, 16, 64), mesh4) == jax.P("data", "model", None)
    assert constraints.residual_spec(cfg, (2, 16, 64), mesh4, split=False) == jax.P(
        "data", None, None
    )
    assert constraints.residual_spec(cfg, (2, 1, 64), mesh4) is None  # a decode step
    assert constraints.residual_spec(cfg, (2, 6, 64), mesh4) is None  # 6 tokens on 4
    assert constraints.residual_spec(cfg, (2, 16, 64), {"data": 2, "model": 1}) is None
    # 4 kv heads on a model axis of 8: 8 rows take data x model, so the tokens cannot
    assert constraints.residual_spec(cfg, (8, 16, 64), {"data": 1, "model": 8}) is None
    assert constraints.residual_spec(cfg, (2, 16), mesh4) is None  # not a [B, T, D] stream
    x = jnp.ones((2, 16, 64))
    assert constraints.constrain_residual(cfg, x) is x
    with jax.set_mesh(sh.make_mesh()):  # data 1 x model 1 on this process's one device
        assert constraints.constrain_residual(cfg, x) is x


# --- 8 simulated devices, in a subprocess ----------------------------------------------------


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    """The JSON facts of `tests/mesh_checks.py` run on 8 simulated CPU devices."""
    tmp = tmp_path_factory.mktemp("mesh")
    dump, out = tmp / "hlo", tmp / "facts.json"
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=8 "
        # LLVM optimisation off: a third less compile time; the HLO passes (SPMD partitioning
        # included) still run, and the reference and the meshes share the setting.
        "--xla_backend_optimization_level=0 "
        f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "mesh_checks.py"), str(out), str(dump)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    shutil.rmtree(dump, ignore_errors=True)  # XLA also dumps LLVM IR: tens of MB
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_subprocess_has_eight_devices(facts):
    assert facts["devices"] == 8


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("cell", CELLS)
def test_meshes_give_the_same_tokens_and_kept_positions(facts, mesh, cell):
    got, want = facts["meshes"][mesh]["results"][cell], facts["reference"][cell]
    assert got["tokens"] == want["tokens"]
    assert got["kept"] == want["kept"]
    if cell == "snapkv_dge2":  # every row was really evicted: 8 of up to 17 entries per head
        assert all(len(head) <= 8 for row in got["kept"] for layer in row for head in layer)
    if cell == "adakv_dge2":  # a layer's 4 heads share 4 x 8 entries, split unevenly
        sizes = [[len(head) for head in layer] for row in got["kept"] for layer in row]
        assert all(sum(layer) <= 32 for layer in sizes)
        assert any(max(layer) > 8 for layer in sizes)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("cell", CELLS[:2])
def test_the_pallas_prefill_under_a_mesh_gives_the_same_tokens(facts, mesh, cell):
    """attention="pallas": the flash kernel runs per device in a shard_map over rows and kv
    heads (the cache's layout), and gives the one-device xla tokens and kept positions."""
    got, want = facts["meshes"][mesh]["pallas"][cell], facts["reference"][cell]
    assert got == want


# Per-device blocks: [L, B, Hkv, S, D] = [2, 8, 4, S, 16] split by the mesh.
CACHE_BLOCKS = {"8x1": [2, 1, 4, 32, 16], "2x4": [2, 4, 1, 32, 16], "1x8": [2, 1, 4, 32, 16]}


@pytest.mark.parametrize("mesh", MESHES)
def test_params_and_cache_are_sharded(facts, mesh):
    data, model = map(int, mesh.split("x"))
    entry = facts["meshes"][mesh]
    params = entry["params"]
    assert all(p["devices"] == 8 for p in params.values())
    assert params["layers.w_up"]["shard"] == [2, 64, 96 // model]
    assert params["layers.w_down"]["shard"] == [2, 96 // model, 64]
    assert params["embed"]["shard"] == [128 // model, 64]
    assert params["lm_head"]["shard"] == [64, 128 // model]
    # Attention is head-parallel where the 4 kv heads divide the model axis; on 1x8 it is
    # data-parallel, its weights replicated over model.
    heads = model if 4 % model == 0 else 1
    assert params["layers.wq"]["shard"] == [2, 64, 128 // heads]
    assert params["layers.wo"]["shard"] == [2, 128 // heads, 64]
    assert params["layers.wk"]["shard"] == [2, 64, 64 // heads]
    assert entry["cache"]["k"]["shard"] == CACHE_BLOCKS[mesh]
    assert entry["cache"]["pos"]["shard"] == CACHE_BLOCKS[mesh][:-1]
    assert entry["cache"]["k"]["devices"] == 8


def test_per_layer_capacities_on_a_mesh(facts):
    """On the 2x4 mesh, a cache compacted to per-layer capacities (16, 12) decodes to the
    tokens one capacity gives, and no step compiled for it moves keys or values."""
    ragged = facts["ragged"]
    assert ragged["capacities"] == {"ragged": [16, 12], "one_capacity": [16, 16]}
    assert ragged["tokens"]["ragged"] == ragged["tokens"]["one_capacity"]
    assert {"compact", "decode_loop"} <= set(ragged["modules"]), ragged["modules"]
    assert ragged["kv_moves"] == []
    assert ragged["decode_layer1_keys"] == {"whole": False, "block": True}


@pytest.mark.parametrize("mesh", MESHES)
def test_no_step_gathers_the_cache(facts, mesh):
    """Every compiled step takes and returns caches as per-device blocks, and no module that
    `generate_grid` compiled (eager ops included) has a collective carrying keys or values or
    an array of a whole cache's shape (which would put a whole cache on one device)."""
    steps = facts["meshes"][mesh]["steps"]
    assert set(STEPS) <= set(steps), sorted(steps)
    for name, modules in steps.items():
        for module in modules:
            assert module["kv_moves"] == [], f"{name}: {module['kv_moves']}"
            assert module["whole_cache"] == [], f"{name}: {module['whole_cache']}"
            if name in STEPS:
                assert module["cache_slots"], f"{name}: no sharded cache in {module['caches']}"
    if mesh == "2x4":
        # Head-parallel attention with sequence parallelism: only activations of the model's
        # width (hidden 64) cross devices, among them the all-gather of a block's normed
        # input [B, T, D] from its token shards; no weight is gathered.
        for module in steps["prefill_prompt"]:  # the xla and the pallas (shard_map) prefill
            found = module["collectives"]
            assert all(c.endswith(", 64]") for c in found), found
            assert any(re.fullmatch(r"all-gather f32\[\d+, 16, 64\]", c) for c in found), found


def test_orbax_round_trip_restores_sharded_with_identical_logits(facts):
    orbax = facts["orbax"]
    assert {"config.json", "tokenizer.json", "dge_jax.json", "params"} <= set(orbax["files"])
    assert orbax["equal_to_hf_on_same_mesh"]  # bit-identical to loading the HF folder on 2x4
    assert orbax["single_device_equal"]  # and to it on one device, restored unsharded
    assert orbax["max_abs_diff_to_one_device"] < 1e-5  # 2x4 vs 1 device: sum order only
    assert orbax["params"]["layers.wq"]["shard"] == [2, 64, 32]
    assert orbax["config_equal"] and orbax["tokenizer_equal"]
    for cell in CELLS:
        assert orbax["results"][cell] == facts["reference"][cell]
    assert "already exists" in orbax["exists_error"]


@pytest.mark.parametrize("mesh", ["2x4", "1x4"])
def test_sliding_layers_and_one_kv_head_on_a_mesh(facts, mesh):
    """A tiny Gemma 3 (sliding and global layers, 4 query heads over 1 kv head): the same
    tokens and kept positions on a mesh as on one device."""
    assert facts["gemma3"][mesh] == facts["gemma3"]["reference"]


def test_bad_meshes_get_clear_errors(facts):
    errors = facts["errors"]
    assert "does not divide the 8 available devices" in errors["not_dividing"]
    assert "needs 16 devices, but only 8" in errors["too_many"]
    assert "more than the 4 query heads it shards" in errors["model_over_heads"]
    assert "8 query heads do not split evenly" in errors["heads_not_divisible"]
    assert errors["parse_ok"] == {"data": 2, "model": 4}
