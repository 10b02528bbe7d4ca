"""The platform's choices (`dge_jax.runtime.platform`) and the attention switch behind them.

- `Backend.of` per platform, built without its devices; `auto` is xla on this CPU; bad values
  and cudnn off a GPU are one clear ValueError each.
- Long prefill chunks pad prompts to the granule and run in equal steps (the TPU / GPU
  default), with the logits of one step.
- Same tokens: greedy tokens and kept sets with attention="pallas" (the flash kernel for
  prefill and the decode kernel for decode and draft steps, in Pallas interpret mode) equal
  "xla" on the tiny model (FullKV, DGE(2)-SnapKV, DGE(2)-H2O, which records the kernel's
  probs sums, and DGE(2)-SnapKV compressed every 4 decode steps, whose compacted heads are
  ragged; two rows of different lengths, so padding rows run)
  and, through the CLI, on the embedded SmolLM2 (FullKV and DGE(2)-SnapKV).
- cudnn's code path: its regrouping and mask, run through XLA, equal written_slot_attention.
- The run identity: default and xla runs keep the identity earlier folders recorded (so they
  resume); pallas is another configuration.
- Compiled for a TPU without one (deviceless, through libtpu): prefill under "auto" holds the
  Pallas kernel, reading the stacked cache in place (no one-layer slice of the capacity),
  and the decode loop holds the decode kernel and keeps its cache in place without the CPU
  write trick (no cache copy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loose_attention import cudnn as cudnn_attention
from loose_attention import written as written_slot_attention

import dge_jax
from dge_jax import cli
from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge
from dge_jax.rules.full import is_full
from dge_jax.rules.h2o import H2O
from dge_jax.rules.registry import RULES, make_rule, rule_fields
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding, platform
from dge_jax.runtime.platform import Backend
from dge_jax.runtime.recorders import NOTHING, AttentionSums, Recording
from dge_jax.text.prompts import bucket_length, pad_left


@pytest.fixture(scope="module")
def model(checkpoint):
    return dge_jax.load(checkpoint("llama"))


def prompt_ids(lengths, seed=0, vocab=128):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------
# The choices


def test_the_choices_per_platform():
    """CPU keeps today's program; TPU and GPU get none of its XLA:CPU choices."""
    cpu, tpu, gpu = (Backend.of(p) for p in ("cpu", "tpu", "gpu"))
    assert cpu == Backend("cpu", "xla", "unrolled", 512, 0, 512, 0, 16, True, 1)
    assert tpu == Backend("tpu", "pallas", "scan", 8192, 8192, 512, 512, 0, False, 8)
    assert gpu == Backend("gpu", "xla", "unrolled", 8192, 8192, 512, 512, 0, False, 8)
    assert Backend.of("cuda") == gpu and Backend.of("gpu", "cudnn").attention == "cudnn"
    assert Backend.of("tpu", "xla").attention == "xla"
    assert Backend.of("cpu", "pallas") == dataclasses.replace(cpu, attention="pallas")
    assert hash(Backend.of("tpu")) == hash(tpu)  # a static argument under jit


def test_a_prefill_step_holds_a_bounded_number_of_tokens():
    """On TPU and GPU a device's rows share about 8192 tokens per prefill step (the chunk in
    whole 512-token buckets, at least one); CPU keeps 512 at every batch. rows_per_device
    splits the rows over the mesh's data axis."""
    tpu, cpu = Backend.of("tpu"), Backend.of("cpu")
    assert [tpu.chunk_for(b) for b in (1, 2, 3, 4, 16, 24, 64)] == [
        8192, 4096, 2560, 2048, 512, 512, 512]  # fmt: skip
    assert [cpu.chunk_for(b) for b in (1, 24)] == [512, 512]
    assert platform.rows_per_device(24) == 24  # no mesh: every row on the one device
    mesh = dge_jax.distribution.sharding.make_mesh(1, 1)
    with jax.set_mesh(mesh):
        assert platform.rows_per_device(5) == 5


def test_auto_is_xla_on_this_cpu():
    assert platform.current_platform() == "cpu"
    assert platform.current() == Backend.of("cpu")
    assert platform.current().attention == "xla"
    assert decoding.decode_groups(dge_jax.runtime.cache.init_cache(3, 1, 1, 8, 4)) == (1, 1, 1)


def test_bad_values_are_one_clear_error(model):
    named = "attention must be one of 'auto', 'xla', 'pallas', 'cudnn', got 'flash'"
    with pytest.raises(ValueError, match=named):
        dge_jax.GenerationConfig(attention="flash")
    with pytest.raises(ValueError, match=named):
        dge_jax.generate(model, [[5, 6, 7]], attention="flash")
    gpu_only = "attention='cudnn' .* runs on GPU only, and this computation runs on cpu"
    with pytest.raises(ValueError, match=gpu_only):
        dge_jax.generate(model, [[5, 6, 7]], attention="cudnn")
    with pytest.raises(ValueError, match=gpu_only):
        Backend.of("cpu", "cudnn")
    with pytest.raises(ValueError, match="attention='cudnn' .* this computation runs on tpu"):
        Backend.of("tpu", "cudnn")
    with pytest.raises(ValueError, match="unknown platform 'ipu'; known: cpu, gpu, tpu"):
        Backend.of("ipu")


def test_the_cli_refuses_cudnn_on_cpu_in_one_line(capsys):
    args = ["generate", "--prompt", "hello", "--attention", "cudnn", "--model", "nowhere"]
    assert cli.main(args) == 2  # refused before the (missing) model is looked for
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: attention='cudnn'"), lines


# ---------------------------------------------------------------------------------------------
# Long chunks: padding to the granule, equal steps


def test_a_long_chunk_pads_to_the_granule_in_equal_steps():
    got = [bucket_length(n, 8192, 512) for n in (10, 300, 5000, 8192, 8193, 9000, 16385)]
    assert got == [16, 512, 5120, 8192, 9216, 9216, 16896]
    for n in range(1, 40_000, 97):
        t = bucket_length(n, 8192, 512)
        steps = -(-t // 8192)
        assert n <= t < n + steps * 512 and t % steps == 0, (n, t)
        assert t <= 512 or (t // steps) % 512 == 0, (n, t)
    # the granule equal to the chunk (CPU) is the bucket without one
    assert all(bucket_length(n, 512, 512) == bucket_length(n, 512) for n in range(1, 3000))


def test_prefill_runs_equal_steps_of_at_most_the_chunk(model):
    """A 48-token bucket with chunk 32 runs two steps of 24: the logits of one 48-token step
    (a multiple of the chunk runs as before; 49 tokens do not split and are refused)."""
    cfg = model.config
    tokens, lengths = (jnp.asarray(a) for a in pad_left(prompt_ids([40, 29]), 48))

    def logits(chunk, toks=tokens):
        return decoding.prefill_prompt(model.forward, cfg, model.params, toks, lengths,
                                       decoding.PrefillSpec(64, chunk)).logits  # fmt: skip

    np.testing.assert_allclose(np.asarray(logits(32)), np.asarray(logits(48)), atol=1e-5)
    with pytest.raises(ValueError, match="prompt length 49 does not split into steps of at"):
        logits(32, jnp.zeros((2, 49), jnp.int32))


# ---------------------------------------------------------------------------------------------
# Same tokens


def test_pallas_gives_the_xla_tokens_and_kept_sets(model):
    prompts = prompt_ids([37, 21], seed=3)  # bucket 64: 27 and 43 padding positions
    cells = [
        None,
        Eviction(SnapKV(window=4, kernel=3), budget=8, timing=dge(2)),
        Eviction(H2O(window=4), budget=8, timing=dge(2)),  # probs sums: the second kernel
        # compressed every 4 decode steps: ragged compacted heads under the decode kernel
        Eviction(SnapKV(window=4), budget=8, timing=dge(2), decode=DecodeCompression(8, 4)),
    ]
    xla, pallas = (dge_jax.generate_grid(model, prompts, cells, max_new_tokens=8, attention=a)
                   for a in ("xla", "pallas"))  # fmt: skip
    for cell, want, got in zip(cells, xla, pallas, strict=True):
        assert got.tokens == want.tokens, cell
        assert got.kept == want.kept, cell
    # the evicting cells really evicted: 8 of 21 or 37 prompt entries (+ the draft) per head
    assert all(len(head) <= 8 for row in xla[1].kept for layer in row for head in layer)


@pytest.mark.slow
def test_every_rule_keeps_the_same_entries_under_pallas(checkpoint):
    """Each registered rule (a window of 4 where it has one), evicting under dge(2) in one
    grid: the kept sets and tokens with the Pallas kernels (prefill, its probs sums, decode)
    equal the XLA path's. Float ties could in principle split them; none do here. (A
    checkpoint with a tokenizer: KVzip encodes its repeat instruction.)"""
    model = dge_jax.load(checkpoint("llama_chat"))
    names = sorted(n for n in RULES if not is_full(make_rule(n)))
    rules = [make_rule(n, **({"window": 4} if "window" in rule_fields(n) else {}))
             for n in names]  # fmt: skip
    cells = [Eviction(rule, budget=12, timing=dge(2)) for rule in rules]
    prompts = prompt_ids([37, 21], seed=5, vocab=model.config.vocab_size)
    xla, pallas = (dge_jax.generate_grid(model, prompts, cells, max_new_tokens=6, attention=a)
                   for a in ("xla", "pallas"))  # fmt: skip
    for name, want, got in zip(names, xla, pallas, strict=True):
        assert got.kept == want.kept, name
        assert got.tokens == want.tokens, name
    assert len(names) >= 13


def test_pallas_gives_the_xla_tokens_on_the_embedded_model():
    """FullKV and DGE(2)-SnapKV on the embedded SmolLM2-135M, a short prompt: greedy tokens
    and kept positions equal under both attentions. Both cells decode at one capacity, so
    the (long, unrolled on CPU) decode loop compiles once for all four runs."""
    model = dge_jax.load("smollm2-135m-instruct")
    prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of"
    capacity = 32 + 16  # FullKV's: the prompt's bucket + the token buffer of 4 new tokens
    snapkv = Eviction(SnapKV(window=4, kernel=3), budget=8, timing=dge(2), capacity=capacity)
    cells = [None, snapkv]
    xla, pallas = (dge_jax.generate_grid(model, [prompt], cells, max_new_tokens=4, attention=a)
                   for a in ("xla", "pallas"))  # fmt: skip
    for cell, want, got in zip(cells, xla, pallas, strict=True):
        assert got.tokens == want.tokens, cell
        assert got.kept == want.kept, cell
    assert len(xla[0].prompt_tokens[0]) > 8 and len(xla[0].tokens[0]) == 4
    assert all(len(head) <= 8 for layer in xla[1].kept[0] for head in layer)  # evicted


def test_the_cli_takes_attention(checkpoint, capsys):
    """`python -m dge_jax generate --attention pallas` (in-process): the tokens and kept
    positions of --attention xla, for FullKV and DGE(2)-SnapKV."""
    base = ["generate", "--model", str(checkpoint("llama_chat")), "--prompt",
            "the cat sat on the mat what is the capital of france", "--max_new_tokens", "5",
            "--json"]  # fmt: skip
    snapkv = ["--rule", "snapkv", "--budget", "6", "--window", "2", "--kernel", "3",
              "--timing", "dge", "--k", "2"]  # fmt: skip
    for rule in ([], snapkv):
        out = {}
        for attention in ("xla", "pallas"):
            assert cli.main([*base, *rule, "--attention", attention]) == 0
            out[attention] = json.loads(capsys.readouterr().out)
        assert out["pallas"]["tokens"] == out["xla"]["tokens"], rule
        assert out["pallas"].get("kept") == out["xla"].get("kept"), rule
    assert all(len(head) <= 6 for layer in out["xla"]["kept"] for head in layer)


def test_cudnn_regrouping_and_mask_equal_the_xla_path():
    """`cudnn_attention`'s multi-query regrouping and slot-position mask, run through XLA
    (the cuDNN kernel needs a GPU): written_slot_attention's outputs on real query rows, with
    left padding, an evicted slot and unwritten slots past num_slots; f32 is refused by
    cuDNN with a clear error."""
    rng = np.random.default_rng(0)
    b, t, hq, hkv, s, d = 2, 12, 6, 2, 20, 8
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((b, t, hq, d), (b, hkv, s, d), (b, hkv, s, d)))  # fmt: skip
    qpos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    qpos[1] = np.arange(t) - 5
    qpos[1, :5] = -1
    pos = np.full((b, hkv, s), -1, np.int32)
    pos[:, :, :t] = qpos[:, None, :]
    pos[0, 1, 3] = -1  # evicted from one head only
    args = (q, k, v, jnp.asarray(pos), jnp.asarray(qpos), jnp.int32(t))
    got = cudnn_attention(*args, implementation="xla")
    want, _ = written_slot_attention(*args, block=8)
    real = (qpos >= 0)[:, :, None, None]
    np.testing.assert_allclose(np.asarray(got) * real, np.asarray(want) * real, atol=2e-6)
    with pytest.raises(ValueError, match="attention='cudnn' needs bfloat16 or float16"):
        cudnn_attention(*args)


# ---------------------------------------------------------------------------------------------
# The run identity


def test_the_run_identity_keeps_earlier_folders(tmp_path):
    """auto (xla on CPU) and xla give the identity earlier runners wrote (chunk 512, no
    attention key: the keys below), so a folder written before --attention existed resumes;
    pallas is another configuration and is refused there."""
    from tiny_model import build_tiny_llama

    from experiments import runner
    from experiments.run_config import FLAGS, RunConfig
    from experiments.run_folder import RunFolderError, open_run

    model = dge_jax.load(build_tiny_llama(tmp_path / "model"))

    def identity(*flags):
        FLAGS.unparse_flags()  # another test in this process may have left flags parsed
        FLAGS(["longbench", "--model", str(model.path), *flags])
        try:
            return runner.run_identity(RunConfig.from_flags(FLAGS), model, 512)
        finally:
            FLAGS.unparse_flags()

    auto, xla = identity(), identity("--attention", "xla")
    pallas = identity("--attention", "pallas")
    earlier_keys = {"model", "model_files", "dtype", "suite", "protocol", "dge_jax", "max_length",
                    "chunk", "batch_size", "synthetic_length", "seed", "policy_options",
                    "draft_weight", "ties", "adaptive"}  # fmt: skip
    assert set(auto) == earlier_keys and auto["chunk"] == 512 and auto == xla
    assert pallas == {**auto, "attention": "pallas"}
    # --sliding evict (sliding-window models) is another configuration; the default is not
    assert identity("--sliding", "evict") == {**auto, "sliding": "evict"}
    assert identity("--sliding", "window") == auto
    extent = {"datasets": ["passkey"], "cells": ["full"], "num_samples": 1}
    folder = tmp_path / "run"
    open_run(folder, auto, {}, extent, "before --attention")
    open_run(folder, xla, {}, extent, "--attention xla")  # resumes
    with pytest.raises(RunFolderError, match="attention: '\\(absent\\)' -> 'pallas'|attention"):
        open_run(folder, pallas, {}, extent, "--attention pallas")


# ---------------------------------------------------------------------------------------------
# Compiled for a TPU, without one


@pytest.fixture(scope="module")
def tpu_mesh():
    """A 1 x 2 (data, model) mesh of v5e devices from libtpu's deviceless topology."""
    # libtpu takes a machine-wide lock file by default; deviceless compiling shares no chip.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    except Exception as error:  # no libtpu, or a jax without deviceless TPU topologies
        pytest.skip(f"no deviceless TPU compilation here (pip install 'jax[tpu]'): {error}")
    return dge_jax.distribution.sharding.make_mesh(1, 2, devices=devices[:2])


def _on(mesh, tree):
    """tree's arrays as abstract values replicated on `mesh` (what lowering needs)."""
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree)


PREFILL_ROWS, PREFILL_CAPACITY = 2, 80


@pytest.fixture(scope="module")
def tpu_prefills(model, tpu_mesh):
    """{kernels expected: compiled HLO text} of the tiny model's prefill (2 rows, capacity 80)
    for the v5e mesh under attention "auto", without and with recorded probs sums."""
    inputs = pad_left(prompt_ids([40, 29]), 64)
    inputs = _on(tpu_mesh, tuple(map(jnp.asarray, inputs)))
    params = _on(tpu_mesh, model.params)
    hlos = {}
    with jax.set_mesh(tpu_mesh):  # (no eager op in here: it would run on the absent TPU)
        assert platform.current() == Backend.of("tpu")
        for recording, kernels in ((NOTHING, 1), (Recording.of(AttentionSums()), 2)):
            hlos[kernels] = decoding.prefill_prompt.lower(
                model.forward, model.config, params, *inputs,
                decoding.PrefillSpec(PREFILL_CAPACITY, recording=recording),
            ).compile().as_text()  # fmt: skip
    return hlos


def test_prefill_compiled_for_tpu_runs_the_pallas_kernel(tpu_prefills):
    """attention="auto" under a mesh of TPU devices resolves to pallas: the compiled prefill
    holds Mosaic kernels (the flash forward, and its probs sums when recorded)."""
    for kernels, hlo in tpu_prefills.items():
        assert hlo.count('custom_call_target="tpu_custom_call"') == kernels


def test_prefill_compiled_for_tpu_reads_the_stacked_cache_in_place(model, tpu_prefills):
    """The flash kernel takes the layer group's stacked cache [Lg, B, Hkv, S, D] and the layer
    index, so no instruction of the compiled prefill makes one layer's slice of the whole
    capacity ([B, Hkv, S, D] or [1, B, Hkv, S, D], either minor order, any dtype), the
    largest HBM cost of an 8B prefill before (issue #29: passed k_all[i], the layer scan
    copied the layer's capacity for every chunk and layer before the kernel read it)."""
    cfg = model.config
    per_layer = (
        rf"\w+\[(?:1,)?{PREFILL_ROWS},\d+,"
        rf"(?:{PREFILL_CAPACITY},{cfg.head_dim}|{cfg.head_dim},{PREFILL_CAPACITY})\]\S* [\w-]+\("
    )
    for kernels, hlo in tpu_prefills.items():
        # The stacked buffers themselves are there (the pattern's shape, one axis more).
        assert re.search(rf"\[{cfg.num_layers},{PREFILL_ROWS},\d+,{PREFILL_CAPACITY},", hlo)
        assert re.findall(per_layer, hlo) == [], kernels


def test_decode_compiled_for_tpu_keeps_the_cache_in_place_without_the_cpu_trick(
    model, tpu_mesh
):
    """The decode loop for a v5e, with write_after_attention off (the TPU's choice), scanned
    layers (its layer loop) and attention "auto" (the Pallas decode kernel), holds the kernel
    and no copy of a cache-sized buffer. This model's head (16) is under the 128 lanes, so
    the TPU lays the cache out slots-minor and the kernel reads it so (``slots_minor``);
    read row-major, it was converted on entry and exit. tests/test_flash_decode.py checks a
    head-128 cache, the layout of an 8B model, read row-major."""
    cfg = model.config
    batch, slots = 2, 256
    cache = dge_jax.runtime.cache.init_cache(
        cfg.num_layers, batch, cfg.num_kv_heads, slots, cfg.head_dim
    )
    state = decoding.start_state(cache, jnp.ones((batch,), jnp.int32), jnp.full((batch,), 8), 4,
                                 (), jax.random.PRNGKey(0))  # fmt: skip
    with jax.set_mesh(tpu_mesh):
        assert not platform.current().write_after_attention
        assert decoding.decode_groups(cache) == (cfg.num_layers,)
        hlo = decoding.decode_loop.lower(
            model.forward, cfg, _on(tpu_mesh, model.params), _on(tpu_mesh, state),
            decoding.StepSpec(dge_jax.text.sampling.Greedy(), ()),
        ).compile().as_text()  # fmt: skip
    assert hlo.count('custom_call_target="tpu_custom_call"') >= 1
    buffer = rf"f32\[(?:\d+,)?{batch},\d+,{slots},{cfg.head_dim}\]"
    assert re.findall(rf"{buffer}\S* copy\(", hlo) == []
