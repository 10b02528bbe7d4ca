"""Multi-device checks for `tests/test_sharding.py`, run in a subprocess with 8 CPU devices.

`python tests/mesh_checks.py OUT.json` must start with
XLA_FLAGS=--xla_force_host_platform_device_count=8 in its environment (the test sets it), so
the simulated devices exist before JAX starts; the main pytest process keeps one device.
It writes one JSON object of facts (tokens, kept positions, shardings, collectives, errors);
the test asserts on them, so a failure names the fact that broke.

The model: a random llama checkpoint written in Hugging Face layout (two safetensors shards +
index, q/k/v/o biases, untied head), 8 query heads and 4 kv heads, so that on the meshes
8x1 (data), 2x4 (kv heads split over model) and 1x8 (kv heads fewer than the model axis:
data-parallel attention, the cache's rows over data x model) every sharding rule is exercised.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

import dge_jax
from dge_jax.checkpoints import orbax_io
from dge_jax.distribution import sharding as sh
from dge_jax.eviction import evict as eviction
from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge, prefill
from dge_jax.generation import generate_grid
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import cache_layout
from dge_jax.runtime import decoding as gen
from dge_jax.text.prompts import pad_left
from dge_jax.text.sampling import Greedy

MESHES = ((8, 1), (2, 4), (1, 8))
CONFIG = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
MAX_NEW = 6
RULE = SnapKV(window=4, kernel=3)
# Compacted caches get the FullKV cache's 32 slots (prompt bucket 16 + token buffer 16), so all
# cells share one compiled decode: compile time is what this file spends. Only speed depends
# on the 32; any capacity that fits gives the same tokens.
CAPACITY = 32
CELLS = (
    None,  # FullKV
    Eviction(RULE, budget=8, timing=dge(2), capacity=CAPACITY),
    Eviction(RULE, budget=8, timing=dge(2), head_budget="adakv", capacity=CAPACITY),
    # compression while decoding too: 4 entries of the window + 2 of each interval, of 8
    Eviction(RULE, budget=8, timing=dge(2), decode=DecodeCompression(budget=8, interval=2)),
)
CELL_NAMES = ("fullkv", "snapkv_dge2", "adakv_dge2", "snapkv_dge2_decode")
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def write_checkpoint(folder: pathlib.Path, config: dict, seed: int = 0) -> pathlib.Path:
    """A random Hugging Face llama folder: config.json, two safetensors shards and an index."""
    rng = np.random.default_rng(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, hq, hkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def w(*shape, scale=0.15):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": w(v, d, scale=1.0),
        "model.norm.weight": 1 + w(d),
        "lm_head.weight": w(v, d),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + w(d),
            p + "post_attention_layernorm.weight": 1 + w(d),
            p + "self_attn.q_proj.weight": w(hq * hd, d),
            p + "self_attn.k_proj.weight": w(hkv * hd, d),
            p + "self_attn.v_proj.weight": w(hkv * hd, d),
            p + "self_attn.o_proj.weight": w(d, hq * hd),
            p + "self_attn.q_proj.bias": w(hq * hd),
            p + "self_attn.k_proj.bias": w(hkv * hd),
            p + "self_attn.v_proj.bias": w(hkv * hd),
            p + "self_attn.o_proj.bias": w(d),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        }
    folder.mkdir(parents=True)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_gemma3(folder: pathlib.Path) -> pathlib.Path:
    """A tiny random Gemma 3 text checkpoint saved by transformers: 4 query heads over 1 kv
    head (Gemma 3 1B's layout), layer 0 sliding over 8 keys, layer 1 global."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
        initializer_range=0.1,
    )  # fmt: skip
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(folder)
    return folder


def write_tokenizer(folder: pathlib.Path) -> None:
    """A word-level tokenizer.json (ids 0..vocab-1), so the tokenizer's travel can be checked."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def prompts() -> list[list[int]]:
    """8 rows of 9..16 tokens: longer than the budget (8), so every row is evicted."""
    rng = np.random.default_rng(1)
    return [
        rng.integers(1, CONFIG["vocab_size"], n).tolist() for n in (16, 9, 12, 16, 10, 13, 11, 15)
    ]


def compiled_modules(dump: pathlib.Path, seen: set[str]) -> list[tuple[str, str, str]]:
    """(name, HLO before partitioning, per-device HLO after it) of every module XLA compiled
    since the last call, from its dump folder."""
    out = []
    for path in sorted(dump.glob("*.cpu_after_optimizations.txt")):
        if path.name not in seen:
            seen.add(path.name)
            module, name = path.name.split(".")[:2]
            before = next(dump.glob(f"{module}.{name}.before_optimizations.txt"), None)
            text = before.read_text() if before else ""
            out.append((name.removeprefix("jit_"), text, path.read_text()))
    return out


def collectives(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(op, dtype, per-device shape) of every collective in a partitioned HLO module."""
    found = []
    for line in hlo.splitlines():
        for op in COLLECTIVES:
            m = re.search(rf"= (.*?) {op}(?:-start)?\(", line)
            if m:
                for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
                    found.append((op, dtype, tuple(int(x) for x in dims.split(",") if x)))
    return found


def axis_size(mesh_shape: dict, axes) -> int:
    """Devices along a PartitionSpec entry (None, a mesh axis, or a tuple of them)."""
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh_shape[a] for a in names)


def step_facts(before: str, after: str, cfg, mesh_shape: dict, batch: int) -> dict:
    """What one compiled module does with KV caches.

    caches: the global cache shapes [Lg, B, Hkv, S, D] in the module, as (B, S); cache_slots:
    those that enter or leave as per-device blocks of their expected sharding (the signature
    holds no global cache); kv_moves: collectives carrying keys/values (an array ending in
    [S, D]) or the positions of a whole layer group (s32 [Lg, ., ., S]); whole_cache: arrays
    of a whole layer group's global shape, or of one layer of it, in the per-device module,
    i.e. one device holding a whole cache. batch: the run's rows; only arrays of a multiple
    of that many rows (cells decoding stacked hold several) are caches: a kernel's shard_map
    body holds per-device blocks, e.g. [Lg, 1, Hkv, S, D] on the 8 x 1 mesh, which would
    otherwise read as a whole cache of one row (8 rows here: no block of fewer than 8
    stacked cells has a multiple of 8 rows on a mesh of 8 devices).
    """
    nl, hkv, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    flat = before.replace(" ", "")
    # A cache is a tuple of layer groups [Lg, B, Hkv, S, D] (decode on CPU runs one-layer
    # groups): (Lg, B, S) of every group-shaped array with 1 <= Lg <= L and S >= 16, the
    # fewest slots a cache has (prompt buckets and decode capacities): an array [Lg, B, H, 1,
    # D] is one step's queries, and the flash kernel's regrouped queries [B, T, Hkv, G, D]
    # (here [1, 16, 4, 2, 16] per device) match the pattern with S = G = 2.
    groups = sorted(
        {
            (int(lg), int(b), int(c))
            for lg, b, c in re.findall(rf"f32\[(\d+),(\d+),{hkv},(\d+),{hd}\]", flat)
            if 1 <= int(lg) <= nl and int(c) >= 16 and int(b) % batch == 0
        }
    )
    caches = sorted({(b, c) for _, b, c in groups})
    header = re.sub(r"\{[\d,]*\}", "", after.split("\n", 1)[0])  # drop layouts such as {1,0}
    m = re.search(r"entry_computation_layout=\{(.*?)\}", header)
    entry = m.group(1).replace(" ", "") if m else ""
    slots, whole = [], []
    text = after.replace(" ", "")
    for lg, batch, cap in groups:
        spec = cache_layout.cache_specs(cfg, batch, mesh_shape).groups[0].k
        rows = batch // axis_size(mesh_shape, spec[1])
        heads = hkv // axis_size(mesh_shape, spec[2])
        if f"f32[{lg},{rows},{heads},{cap},{hd}]" in entry and [batch, cap] not in slots:
            slots.append([batch, cap])
        for shape in (
            f"f32[{lg},{batch},{hkv},{cap},{hd}]",
            f"f32[{batch},{hkv},{cap},{hd}]",
            f"s32[{lg},{batch},{hkv},{cap}]",
            f"s32[{batch},{hkv},{cap}]",
        ):
            if shape in text and shape not in whole:
                whole.append(shape)
    capacities = {cap for _, cap in caches}
    layer_counts = {lg for lg, _, _ in groups}
    found = collectives(after)
    kv_moves = [
        f"{op} {dt}{list(s)}"
        for op, dt, s in found
        if (len(s) >= 2 and s[-1] == hd and s[-2] in capacities)
        or (dt == "s32" and len(s) == 4 and s[0] in layer_counts and s[-1] in capacities)
    ]
    return {
        "caches": [list(c) for c in caches],
        "cache_slots": slots,
        "collectives": sorted({f"{op} {dt}{list(s)}" for op, dt, s in found}),
        "kv_moves": kv_moves,
        "whole_cache": whole,
    }


def describe(x: jax.Array) -> dict:
    """Spec, per-device block shape and device count of an array."""
    return {
        "spec": str(getattr(x.sharding, "spec", "single")),
        "shard": list(x.addressable_shards[0].data.shape),
        "devices": len(x.sharding.device_set),
    }


def results(res, names=CELL_NAMES) -> dict:
    return {name: {"tokens": r.tokens, "kept": r.kept} for name, r in zip(names, res, strict=True)}


def error_of(fn) -> str | None:
    """The message of the exception `fn()` raises (type-prefixed), None if it returns."""
    try:
        fn()
    except Exception as e:  # the test checks which error and what it says
        return f"{type(e).__name__}: {e}"
    return None


# Per-layer budgets 8 and 4 keep 8 and 4 entries per head; the capacities (16, 12) hold
# them plus MAX_NEW tokens, so the compacted cache is ragged (one layer group per capacity,
# index [L]).
RAGGED_BUDGET = np.array([8, 4])
RAGGED_CAPACITIES = (16, 12)


def ragged_facts(model, ids, dump: pathlib.Path, seen: set[str]) -> dict:
    """Compaction to per-layer capacities on the model's mesh: the tokens decoded from the
    ragged cache and from one capacity (16) for both layers, and every collective of the
    modules compiled for it that carries keys or values ([.., S, D] with S a capacity)."""
    cfg = model.config
    tokens, lengths = (jnp.asarray(a) for a in pad_left(ids, 16))
    ev = Eviction(RULE, budget=RAGGED_BUDGET, timing=prefill(), capacity=None)
    out: dict = {"tokens": {}}
    with sh.mesh_context(model.params):
        pre = gen.prefill_prompt(model.forward, cfg, model.params, tokens, lengths,
                                 gen.PrefillSpec(CAPACITY, 16, RULE.needs.recording))
        key = jax.random.PRNGKey(0)
        state = gen.start_state(pre.cache, Greedy()(pre.logits, key), lengths, MAX_NEW, (), key)
        keep = eviction.keep_mask(state.cache, pre.obs, None, ev)
        for name, capacity in (("ragged", RAGGED_CAPACITIES), ("one_capacity", 16)):
            cache = eviction.apply_eviction(state.cache, keep, ev, capacity, MAX_NEW)
            out.setdefault("capacities", {})[name] = list(cache.capacities)
            fresh = jax.tree.map(jnp.copy, dataclasses.replace(state, cache=cache))
            done = gen.decode_loop(
                model.forward, cfg, model.params, fresh, gen.StepSpec(Greedy(), ())
            )
            out["tokens"][name] = np.asarray(done.tokens).tolist()
    slots = {*RAGGED_CAPACITIES, 16, CAPACITY}
    modules = compiled_modules(dump, seen)
    out["modules"] = sorted({name for name, _, _ in modules})
    out["kv_moves"] = [
        f"{name}: {op} {dt}{list(shape)}"
        for name, _, after in modules
        for op, dt, shape in collectives(after)
        if len(shape) >= 2 and shape[-1] == cfg.head_dim and shape[-2] in slots
    ]
    # Layer 1's keys, whole ([B, Hkv, 12, D], or its one-layer group [1, B, Hkv, 12, D]) or as
    # this mesh's per-device block (rows over data = 2, kv heads over model = 4), in the
    # per-device decode module.
    b, hkv, hd = len(ids), cfg.num_kv_heads, cfg.head_dim
    decode = " ".join(after.replace(" ", "") for name, _, after in modules if name == "decode_loop")

    def holds(rows: int, heads: int) -> bool:
        return re.search(rf"f32\[(?:1,)?{rows},{heads},12,{hd}\]", decode) is not None

    out["decode_layer1_keys"] = {"whole": holds(b, hkv), "block": holds(b // 2, hkv // 4)}
    return out


def main(out_path: str, dump_dir: str) -> None:
    facts: dict = {"devices": jax.device_count(), "meshes": {}, "seconds": {}}
    started = time.time()
    dump, seen = pathlib.Path(dump_dir), set()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="dge_mesh_"))
    folder = write_checkpoint(tmp / "hf", CONFIG)
    write_tokenizer(folder)
    ids = prompts()

    ref_model = dge_jax.load(folder)
    facts["reference"] = results(generate_grid(ref_model, ids, CELLS, max_new_tokens=MAX_NEW))
    compiled_modules(dump, seen)
    facts["seconds"]["reference"] = time.time() - started

    cfg = ref_model.config
    for data, model_axis in MESHES:
        t0 = time.time()
        mesh = sh.make_mesh(data, model_axis)
        model = dge_jax.load(folder, mesh=mesh)
        res = generate_grid(model, ids, CELLS, max_new_tokens=MAX_NEW)
        # The Pallas flash prefill (interpret mode here) inside its shard_map over rows and
        # kv heads; its compiled prefill joins the steps checked for moved keys and values.
        pallas = generate_grid(model, ids, CELLS[:2], max_new_tokens=MAX_NEW, attention="pallas")
        cache = cache_layout.init_sharded_cache(cfg, len(ids), CAPACITY, mesh)
        steps: dict[str, list] = {}
        for name, before, after in compiled_modules(dump, seen):
            facts_of = step_facts(before, after, cfg, dict(mesh.shape), len(ids))
            steps.setdefault(name, []).append(facts_of)
        facts["meshes"][f"{data}x{model_axis}"] = {
            "results": results(res),
            "pallas": results(pallas, CELL_NAMES[:2]),
            "params": {name: describe(x) for name, x in orbax_io.flat_params(model.params).items()},
            "cache": {"k": describe(cache.k), "pos": describe(cache.pos)},
            "steps": steps,
        }
        if (data, model_axis) == (2, 4):  # rows and kv heads both split
            facts["ragged"] = ragged_facts(model, ids, dump, seen)
        facts["seconds"][f"{data}x{model_axis}"] = time.time() - t0

    # Orbax round trip: convert (read sharded on a 1x8 mesh) -> restore under 2x4 -> logits.
    t0 = time.time()
    out = orbax_io.convert(folder, tmp / "converted", mesh=sh.make_mesh(1, 8))
    mesh = sh.make_mesh(2, 4)
    restored = dge_jax.load(out, mesh=mesh)
    from_hf = dge_jax.load(folder, mesh=mesh)
    tokens, lengths = (jnp.asarray(a) for a in pad_left(ids, 16))

    def logits(m):
        with sh.mesh_context(m.params):
            args = (m.forward, m.config, m.params, tokens, lengths)
            return np.asarray(gen.teacher_forced_logits(*args))

    want, got, single = logits(from_hf), logits(restored), logits(ref_model)
    facts["orbax"] = {
        "files": sorted(p.name for p in out.iterdir()),
        "equal_to_hf_on_same_mesh": bool(np.array_equal(want, got)),
        "max_abs_diff_to_one_device": float(np.max(np.abs(single - got))),
        "single_device_equal": bool(np.array_equal(single, logits(dge_jax.load(out)))),
        "params": {name: describe(x) for name, x in orbax_io.flat_params(restored.params).items()},
        "config_equal": restored.config == ref_model.config,
        "tokenizer_equal": restored.tokenizer is not None
        and restored.tokenizer.encode("w5 w7 w9") == ref_model.tokenizer.encode("w5 w7 w9"),
        "results": results(generate_grid(restored, ids, CELLS, max_new_tokens=MAX_NEW)),
        "exists_error": error_of(lambda: orbax_io.convert(folder, out)),
    }
    facts["seconds"]["orbax"] = time.time() - t0

    # A model with sliding layers and Gemma 3 1B's head layout (4 query heads over 1 kv head):
    # the kv heads cannot split, so attention is data-parallel; tokens and kept sets as on one
    # device.
    t0 = time.time()
    gemma_folder = write_gemma3(tmp / "gemma3")
    gemma_cells = CELLS[:2]
    gemma = dge_jax.load(gemma_folder)
    facts["gemma3"] = {"reference": results(generate_grid(gemma, ids, gemma_cells,
                                                          max_new_tokens=MAX_NEW), CELL_NAMES[:2])}
    for data, model_axis in ((2, 4), (1, 4)):
        sharded = dge_jax.load(gemma_folder, mesh=sh.make_mesh(data, model_axis))
        res = generate_grid(sharded, ids, gemma_cells, max_new_tokens=MAX_NEW)
        facts["gemma3"][f"{data}x{model_axis}"] = results(res, CELL_NAMES[:2])
    facts["seconds"]["gemma3"] = time.time() - t0

    # Bad meshes: clear errors before anything compiles.
    four_heads = write_checkpoint(tmp / "hf4", CONFIG | {"num_attention_heads": 4})
    facts["errors"] = {
        "not_dividing": error_of(lambda: sh.make_mesh(3, 1)),
        "too_many": error_of(lambda: sh.make_mesh(4, 4)),
        "model_over_heads": error_of(lambda: dge_jax.load(four_heads, mesh=sh.make_mesh(1, 8))),
        "heads_not_divisible": error_of(
            lambda: dge_jax.load(folder, mesh=sh.make_mesh(1, 3, devices=jax.devices()[:6]))
        ),
        "parse_ok": dict(sh.parse_mesh("data=2,model=4").shape),
    }
    facts["seconds"]["total"] = time.time() - started
    pathlib.Path(out_path).write_text(json.dumps(facts))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
