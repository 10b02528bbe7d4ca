"""The stages of one SnapKV cell, compiled ahead of time for abstract devices.

`compile_cell` chains the jitted steps `generate_grid` runs for one cell, as it runs them.
A DGE cell (`Cell`): `decoding.prefill_prompt` -> `decoding.draft_tokens` ->
`decoding.rewind_state` -> `evict.select_for_budgets` (what `evict.keep_masks` calls) ->
`evict.compact` -> `decoding.decode_loop` over the compacted cache, and `decode_loop` over
prefill's full cache (what a FullKV cell decodes). A lookahead cell (`LookaheadCell`, LAQ):
prefill -> the first stage's selection and compaction of a copy -> `draft_tokens` on that
copy (the lookahead) -> the selection from the full cache observing it -> compaction ->
decode. A decode-at-interval-k cell (`DecodeCell`): prefill ->
`decode_compression.decode_compressed` over the full cache. `Setup.timing` picks the cell.
Each step is the library's own jitted function, lowered with the static arguments the
stages give it (`grid_plan.plan_grid`'s recording and room, the evict stage's
capacity rule, `lookahead.first_stage`, the decode loop's `CompressionLoop`) and donating
what it donates today; each stage's inputs are
the previous stages' outputs, with the shardings the compiler gave them. Parameters are bf16
and laid out by `dge_jax.distribution.sharding` (its rules, `param_shardings`, `rows_spec`;
the cache's `runtime.cache_layout.cache_shardings`), under `jax.set_mesh` as `generate_grid`
runs (`on_model_mesh`). The small eager glue between steps (`start_state`,
`observation.for_rule`, `selection.apply_keep`, `lookahead.start`, `lookahead.observed_steps`)
is traced with `jax.eval_shape`, and its outputs keep the layout of the arrays they come from.

The platform's choices are the TPU's, as `generate_grid` makes them under a mesh of TPU
devices (`dge_jax.runtime.platform.Backend`): prefill steps of its `chunk_for` the batch,
prompts padded to its `prompt_bucket`, its attention ("auto": the Pallas flash kernel), the
decode loop's layer grouping ("scan"). `Setup.chunk`, `attention` and `layer_loop` override
them (e.g. ``--chunk 512 --attention xla`` gives the program of 512-token prefill steps and
XLA attention, the TPU's before it took long chunks and the Pallas kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import work
from dge_jax import stages
from dge_jax.checkpoints.hf import parse_config
from dge_jax.distribution import sharding
from dge_jax.eviction import decode_compression, evict, grid_plan, observation
from dge_jax.eviction import lookahead as laq
from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Timing, dge, lookahead
from dge_jax.kernels.flash_tiles import _tile
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import cache_layout, decoding, platform, selection
from dge_jax.runtime.cache import init_cache
from dge_jax.runtime.platform import Backend
from dge_jax.runtime.quantized import parse_kv_quant
from dge_jax.text.prompts import Request, bucket_length


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one cell is compiled for: model, mesh, batch, prompt length and the cell's knobs."""

    family: Any
    cfg: Any
    eos_ids: tuple[int, ...]
    mesh: Any
    batch: int
    seq: int
    max_new_tokens: int = 64
    budget: int = 1024
    k: int = 2
    chunk: int | None = None  # None: the backend's chunk for the batch (and its bucket)
    attention: str = "auto"
    layer_loop: str | None = None  # None: the backend's
    timing: str = "dge"  # which cell (`TIMINGS`): DGE(k), LAQ's lookahead, decode at interval k
    lookahead: int = 8  # the lookahead cell's L (its first stage: `Lookahead`'s defaults)
    kv_quant: str = "none"  # the cache's storage (`runtime.quantized.parse_kv_quant`)

    @property
    def backend(self) -> Backend:
        """The choices generate_grid makes on the mesh's platform (module docstring)."""
        return Backend.of(self.mesh.devices.flat[0].platform, self.attention)

    @property
    def prefill_chunk(self) -> int:
        """--chunk, or the chunk generate_grid picks for a device's rows on this mesh."""
        with jax.set_mesh(self.mesh):
            rows = platform.rows_per_device(self.batch)
        return self.chunk or self.backend.chunk_for(rows)

    @property
    def decode_layer_loop(self) -> str:
        return self.layer_loop or self.backend.layer_loop

    @property
    def eviction(self) -> Eviction:
        """The cell's SnapKV eviction at `budget`: DGE(k), lookahead(L), or decode-time
        compression at interval k back to the same budget."""
        if self.timing == "lookahead":
            return Eviction(SnapKV(), budget=self.budget, timing=lookahead(self.lookahead))
        if self.timing == "decode":
            return Eviction(SnapKV(), budget=self.budget, timing=Timing("decode", 1),
                            decode=DecodeCompression(self.budget, self.k))  # fmt: skip
        return Eviction(SnapKV(), budget=self.budget, timing=dge(self.k))

    @property
    def devices(self) -> int:
        return self.mesh.devices.size

    def request(self) -> Request:
        """A request of `batch` prompts of `seq` tokens, as `prompts.prepare` pads it (only its
        shapes are read)."""
        chunk = self.prefill_chunk
        granule = None if self.chunk else self.backend.prompt_bucket
        t = bucket_length(self.seq, chunk, granule)
        tokens = np.zeros((self.batch, t), np.int32)
        return Request(
            prompt_ids=[], tokens=tokens, lengths=np.full(self.batch, self.seq, np.int32),
            max_new_tokens=self.max_new_tokens, min_new_tokens=0,
            buffer=bucket_length(self.max_new_tokens, chunk), chunk=chunk,
            eos_ids=self.eos_ids, kv_quant=self.kv_quant,
        )  # fmt: skip


def load_config(path: str | pathlib.Path) -> tuple[Any, Any, tuple[int, ...]]:
    """(family, ModelConfig, EOS ids) of a Hugging Face config.json, parsed as `load` does."""
    raw = json.loads(pathlib.Path(path).read_text())
    family, cfg = parse_config(raw)
    eos = raw.get("eos_token_id")
    eos = () if eos is None else tuple(sorted({eos} if isinstance(eos, int) else set(eos)))
    return family, cfg, eos


@dataclasses.dataclass
class StageRun:
    """One compiled stage: the compiled program (None if it failed), its error, its outputs
    (abstract, with shardings), what to assume for run-time loop counts, and ideal figures."""

    name: str
    compiled: Any = None
    error: str | None = None
    outputs: Any = None
    unknown_trips: Callable[[int, str], float | None] | None = None
    ideal_hbm_bytes: float = 0.0
    ideal_flops: float = 0.0
    slots: tuple[int, ...] = ()
    compile_s: float = 0.0
    held: bool = True  # generate_grid keeps this stage's outputs until the cell is done
    note: str = ""
    kernel_fraction: float = 1.0  # of its kernels' declared work, what a causal prompt needs


def causal_tile_fraction(prompt_len: int, chunks: int, capacity: int, block: int = 512) -> float:
    """Of the (query tile, key tile) pairs the prefill flash kernel declares (every key tile
    of the capacity for every query tile of every step: `flash.py`'s dense CostEstimate), the
    share a causal prompt without padding needs, which is what its skip tables leave it to
    load and compute: query tile i of step c ends at position c * step + (i + 1) * bq - 1 and
    needs the key tiles up to it. Tiles as the kernel cuts them (`flash_tiles._tile`). A
    model of the kernel, not a count of the program."""
    step = prompt_len // chunks
    (bq, q_pad), (bk, k_pad) = _tile(step, block, "block_q"), _tile(capacity, block, "block_k")
    nq, nk = q_pad // bq, k_pad // bk
    needed = sum(
        min(nk, (c * step + min((i + 1) * bq, step) - 1) // bk + 1)
        for c in range(chunks)
        for i in range(nq)
    )
    return needed / (chunks * nq * nk)


def _replicated(mesh, tree):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())), tree
    )


def _like(mesh, abstract, source):
    """`abstract` (eval_shape output) with the sharding of the `source` leaf at the same path
    and shape, replicated otherwise."""
    known = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(source)
    }

    def one(path, leaf):
        src = known.get(jax.tree_util.keystr(path))
        same = src is not None and src.shape == leaf.shape and src.sharding is not None
        sh = src.sharding if same else NamedSharding(mesh, P())
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh)

    return jax.tree_util.tree_map_with_path(one, abstract)


def abstract_params(setup: Setup, dtype=jnp.bfloat16):
    """The parameter pytree as ShapeDtypeStructs, laid out by the library's sharding rules."""
    shapes = jax.eval_shape(
        lambda: setup.family.init_params(setup.cfg, jax.random.PRNGKey(0), dtype)
    )
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    names = [sharding.field_name(path) for path, _ in leaves]
    shardings = sharding.param_shardings(setup.cfg, names, setup.mesh)
    structs = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[n])
        for n, (_, x) in zip(names, leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(tree, structs)


def per_device_bytes(tree) -> float:
    """Bytes one device holds of an abstract pytree (the largest shard of each leaf)."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += float(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
    return total


def _rows(setup: Setup, shape, dtype):
    spec = sharding.rows_spec(setup.cfg, setup.batch, len(shape), setup.mesh.shape)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(setup.mesh, spec))


def _compile(run: StageRun, fn, *args, **kwargs) -> StageRun:
    """Lowers and compiles `fn` (a jitted step) for these abstract arguments."""
    start = time.perf_counter()
    try:
        lowered = fn.lower(*args, **kwargs)
        run.compiled = lowered.compile()
        run.outputs = jax.tree.map(
            lambda info, sh: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sh),
            lowered.out_info,
            run.compiled.output_shardings,
        )
    except Exception as e:  # a failed compile is a result (out of memory on the chip, ...)
        first = (str(e).strip().splitlines() or [""])[0]
        run.error = f"{type(e).__name__}: {first[:400]}"
    run.compile_s = time.perf_counter() - start
    return run


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Per-device bytes and per-token FLOPs the ideal figures are made of."""

    weights: float  # the parameters a token reads (the embedding table only as LM head)
    kv_slot: float  # keys + values of one slot of every layer, head and row
    pos_slot: float  # the int32 position of one slot of every layer, head and row
    token_flops: float  # linear layers + LM head of one token, per device
    slot_flops: float  # attention (q·k and p·v) of one token over one slot, per device


def sizes_of(setup: Setup, params) -> Sizes:
    cfg, b = setup.cfg, setup.batch
    shardings = cache_layout.cache_shardings(cfg, b, setup.mesh)
    group = shardings.groups[0]
    k_shape = group.k.shard_shape((cfg.num_layers, b, cfg.num_kv_heads, 1, cfg.head_dim))
    # bytes per key (or value) element: bf16; int8 plus one bf16 scale per D elements; int4
    # (half a byte) plus a bf16 scale and zero per group of G (the residual block, R slots
    # of bf16 per layer and head whatever the capacity, left out)
    quant = parse_kv_quant(setup.kv_quant)
    per_element = {"none": 2.0, "int8": 1.0 + 2.0 / cfg.head_dim,
                   "int4": 0.5 + 4.0 / quant.group}[quant.kind]  # fmt: skip
    pos_shape = group.pos.shard_shape((cfg.num_layers, b, cfg.num_kv_heads, 1))
    n = setup.devices
    # A lookup reads B rows of the embedding table, not the table (unless it is the LM head).
    embed = getattr(params, "embed", None)
    lookup_only = 0.0 if embed is None or cfg.tie_word_embeddings else per_device_bytes(embed)
    return Sizes(
        weights=per_device_bytes(params) - lookup_only,
        kv_slot=2 * float(np.prod(k_shape)) * per_element,  # k and v
        pos_slot=float(np.prod(pos_shape)) * 4,
        token_flops=(2 * work.linear_params(cfg) + 2 * cfg.hidden_size * cfg.vocab_size) / n,
        slot_flops=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim / n,
    )


class Cell:
    """The stages of one DGE-SnapKV cell, compiled in order; each keeps its abstract outputs
    for the next (module docstring)."""

    # The cell's stages in the order generate_grid's hook sees them, with the hook's name.
    HOOKS = {"prefill": "prefill", "draft": "draft", "rewind": "rewind", "select": "keep_masks",
             "compact": "apply_eviction", "decode": "decode"}  # fmt: skip
    # stage -> the stages whose outputs it reads (decode_full: beside the cell, not in it)
    ORDER = {
        "prefill": (), "draft": ("prefill",), "rewind": ("draft",),
        "select": ("prefill", "rewind"), "compact": ("rewind", "select"),
        "decode": ("rewind", "compact"), "decode_full": ("prefill",),
    }  # fmt: skip

    def __init__(self, setup: Setup):
        self.setup = setup
        self.params = abstract_params(setup)
        self.request = setup.request()
        # planned as generate_grid plans it (`plan_grid`: checked, fitted to the model's
        # windows), sliding layers at prompt length as the cells' caches below hold them
        windows = setup.cfg.layer_windows
        plan = grid_plan.plan_grid([setup.eviction], self.request, windows, "full")
        self.ev, self.recording = plan.cells[0], plan.recording
        self.prompt_len = self.request.tokens.shape[1]  # seq padded as generate pads it
        self.capacity = self.prompt_len + plan.room
        full = grid_plan.plan_grid([None], self.request, windows, "full")
        self.full_capacity = self.prompt_len + full.room
        self.sizes = sizes_of(setup, self.params)
        kept = min(setup.budget, setup.seq + self.recording.draft_steps)
        self.kept = kept
        self.compact_capacity = evict.capacity_for(
            np.full((1,), kept), evict.round_up_slots(setup.max_new_tokens)
        )
        self.draft_steps = self.recording.draft_steps
        self.runs: dict[str, StageRun] = {}

    @property
    def mesh(self):
        return self.setup.mesh

    @property
    def label(self) -> str:
        """The cell's timing as a short name: dge(k), lookahead(L), decode(i<interval>)."""
        t = self.ev.timing
        return f"decode(i{self.ev.decode.interval})" if t.kind == "decode" else f"{t.kind}({t.k})"

    @property
    def forward_steps(self) -> tuple[int, int]:
        """(one-token forward steps on the full cache, on a compressed cache) after prefill,
        for a row that generates max_new_tokens (the first from prefill's logits), read from
        the timing: its draft steps, or a decode interval, on the full cache; a lookahead's
        steps on its compressed copy, and the rest of the answer on the compacted cache."""
        t, new = self.ev.timing, self.setup.max_new_tokens - 1
        full = t.draft_steps if t.before_decoding else min(self.ev.decode.interval, new)
        ahead = t.k if t.kind == "lookahead" else 0
        return full, new - full + ahead

    def made(self) -> dict[str, int]:
        """Stage -> slots per head of the cache its outputs hold (what a held cache made, or
        last updated in place, by that stage weighs)."""
        full, out = self.capacity, self.compact_capacity
        return {"prefill": full, "draft": full, "rewind": full, "compact": out, "decode": out}

    def _statics(self):
        return self.setup.family.forward, self.setup.cfg, self.params

    def _decode_cost(self, steps: int, slots: float) -> tuple[float, float]:
        """(ideal HBM bytes, ideal FLOPs) of `steps` decode steps over `slots` valid slots on
        average: the weights and the cache read once per step."""
        s, b = self.sizes, self.setup.batch
        per_step_bytes = s.weights + s.kv_slot * slots
        per_step_flops = b * (s.token_flops + s.slot_flops * slots)
        return steps * per_step_bytes, steps * per_step_flops

    def prefill_key(self) -> tuple:
        """What prefill's program depends on beyond the run's model, mesh and topology: cells
        with equal keys compile one prefill (`compile_cell`'s `shared`)."""
        setup = self.setup
        return ("prefill", setup.batch, self.prompt_len, self.capacity, setup.prefill_chunk,
                self.recording.needs.recording, setup.attention, setup.kv_quant)  # fmt: skip

    def prefill(self) -> StageRun:
        setup, needs, t = self.setup, self.recording.needs, self.prompt_len
        chunks = -(-t // setup.prefill_chunk)  # equal steps of at most the chunk
        step = t // chunks
        run = StageRun(
            "prefill",
            # The attention loop of chunk i reads the i + 1 key blocks written so far: on
            # average (n + 1) / 2 for n chunks (attention.written_slot_attention).
            unknown_trips=lambda depth, name: (chunks + 1) / 2,
            ideal_hbm_bytes=self.sizes.weights + self.sizes.kv_slot * t * 1.0,
            ideal_flops=work.prefill_flops(setup.cfg, t, setup.batch) / setup.devices,
            slots=(self.capacity, step),
            kernel_fraction=causal_tile_fraction(t, chunks, self.capacity),
        )
        tokens = _rows(setup, (setup.batch, t), jnp.int32)
        lengths = _rows(setup, (setup.batch,), jnp.int32)
        spec = decoding.PrefillSpec(self.capacity, setup.prefill_chunk, needs.recording,
                                    attention=setup.attention, kv_quant=setup.kv_quant)
        return _compile(run, decoding.prefill_prompt, *self._statics(), tokens, lengths, spec)

    def start_state(self, cache):
        """`decoding.start_state` after prefill, abstract: the cache keeps its layout."""
        setup, b = self.setup, self.setup.batch
        first = jax.ShapeDtypeStruct((b,), jnp.int32)
        lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
        key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
        make = functools.partial(
            decoding.start_state, max_new_tokens=setup.max_new_tokens, eos_ids=setup.eos_ids,
            buffer=self.request.buffer,
        )  # fmt: skip
        state = jax.eval_shape(make, cache, first, lengths, key=key)
        return _like(self.mesh, state, dataclasses.replace(state, cache=cache))

    def _draft(self, name: str, state, steps: int, slots: float, capacity: int) -> StageRun:
        """`draft_tokens` of `steps` steps from `state`, recording what each step records."""
        setup, needs = self.setup, self.recording.needs
        bytes_, flops = self._decode_cost(steps, slots)
        run = StageRun(name, ideal_hbm_bytes=bytes_, ideal_flops=flops, slots=(capacity,))
        spec = decoding.StepSpec(stages.GREEDY, setup.eos_ids, 0, needs.recording.steps)
        return _compile(run, decoding.draft_tokens, *self._statics(), state, spec,
                        num_steps=steps)  # fmt: skip

    def draft(self) -> StageRun:
        k = self.draft_steps
        state = self.start_state(self.runs["prefill"].outputs.cache)
        return self._draft("draft", state, k, self.setup.seq + k / 2, self.capacity)

    def rewind(self) -> StageRun:
        setup, b = self.setup, self.setup.batch
        state, record = self.runs["draft"].outputs
        rows = _replicated(self.mesh, jax.ShapeDtypeStruct((b,), jnp.int32))
        # Rewinding only masks positions: ideally the positions are read and written once.
        run = StageRun(
            "rewind", ideal_hbm_bytes=2 * self.sizes.pos_slot * self.capacity,
            slots=(self.capacity,),
        )  # fmt: skip
        return _compile(run, decoding.rewind_state, state, record, rows, rows,
                        eos_ids=setup.eos_ids)  # fmt: skip

    def _select(self, name: str, cache, ev: Eviction, record, observed: int) -> StageRun:
        """`evict.select_for_budgets` of `ev` over `cache`, with the arguments
        `evict.keep_masks` gives it (prefill's observation and `record` cut to the rule);
        `observed`: the queries it scores with."""
        cap, b = cache.capacity, self.setup.batch
        pre = self.runs["prefill"].outputs
        cut = jax.eval_shape(lambda o, d: observation.for_rule(ev.rule, o, d), pre.obs, record)
        obs, drafts = _like(self.mesh, cut, (pre.obs, record))
        scalars = _replicated(self.mesh, (
            (jax.ShapeDtypeStruct(np.shape(ev.budget), jnp.int32),),
            evict.SelectionInputs(
                jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((), jnp.float32)
            ),
        ))  # fmt: skip
        spec = evict.SelectionSpec.for_eviction(ev, windows=self.setup.cfg.layer_windows)
        s = self.sizes
        run = StageRun(
            name,
            # Ideally: the keys and positions read once, the keep mask (1 byte a slot) written.
            ideal_hbm_bytes=(s.kv_slot / 2 + s.pos_slot + s.pos_slot / 4) * cap,
            ideal_flops=s.slot_flops / 2 * observed * b * cap,
            slots=(cap,),
        )
        return _compile(run, evict.select_for_budgets, cache, obs, drafts, *scalars, spec=spec)

    def select(self) -> StageRun:
        """`evict.select_for_budgets` with the arguments `evict.keep_masks` gives it."""
        state, record = self.runs["rewind"].outputs
        observed = self.recording.needs.window + self.draft_steps
        return self._select("select", state.cache, self.ev, record, observed)

    def _compact(self, name: str, cache, keep, out: int, kept: int) -> StageRun:
        """`evict.compact` of `cache` masked by `keep` (`selection.apply_keep`, run eagerly
        before) to `out` slots, `kept` of them filled."""
        masked = _like(self.mesh, jax.eval_shape(selection.apply_keep, cache, keep), cache)
        s, cap = self.sizes, cache.capacity
        run = StageRun(
            name,
            # Ideally: positions read, the kept entries read, the compacted cache written.
            ideal_hbm_bytes=s.pos_slot * cap + s.kv_slot * kept + (s.kv_slot + s.pos_slot)
            * out,
            slots=(cap, out),
        )  # fmt: skip
        return _compile(run, evict.compact, masked, capacity=out)

    def compact(self) -> StageRun:
        """`evict.compact` of the masked cache (`selection.apply_keep`, run eagerly before)."""
        cache = self.runs["rewind"].outputs[0].cache
        (keep,) = self.runs["select"].outputs
        return self._compact("compact", cache, keep, self.compact_capacity, self.kept)

    def _decode(self, name: str, state, steps: int, slots: float, capacity: int) -> StageRun:
        setup = self.setup
        bytes_, flops = self._decode_cost(steps, slots)
        run = StageRun(
            name,
            # The decode loop runs until every row is done: `steps` when no row stops early.
            unknown_trips=lambda depth, op: steps if depth == 0 else None,
            ideal_hbm_bytes=bytes_, ideal_flops=flops, slots=(capacity,),
        )  # fmt: skip
        spec = decoding.StepSpec(stages.GREEDY, setup.eos_ids)
        return _compile(run, decoding.decode_loop, *self._statics(), state, spec,
                        layer_loop=setup.decode_layer_loop)  # fmt: skip

    def decode(self) -> StageRun:
        """`decode_loop` over the compacted cache, from the rewound state (as `evict` builds
        it); the loop donates it."""
        state = self.runs["rewind"].outputs[0]
        state = dataclasses.replace(state, cache=self.runs["compact"].outputs)
        steps = self.forward_steps[1]
        return self._decode("decode", state, steps, self.kept + steps / 2, self.compact_capacity)

    def decode_full(self) -> StageRun:
        """`decode_loop` over prefill's full cache: what a FullKV cell decodes (its prefill's
        cache has room for every new token: `grid_plan.GridPlan.room`)."""
        cfg, b, cap = self.setup.cfg, self.setup.batch, self.full_capacity
        cache = self.runs["prefill"].outputs.cache
        if cap != self.capacity:
            shape = jax.eval_shape(
                lambda: init_cache(cfg.num_layers, b, cfg.num_kv_heads, cap, cfg.head_dim,
                                   jnp.bfloat16, self.setup.kv_quant))  # fmt: skip
            shardings = cache_layout.cache_shardings(cfg, b, self.mesh,
                                                     kv_quant=self.setup.kv_quant)  # fmt: skip
            cache = _like(self.mesh, shape, shardings)
        steps = self.setup.max_new_tokens - 1
        run = self._decode("decode_full", self.start_state(cache), steps,
                           self.setup.seq + steps / 2, cap)  # fmt: skip
        run.held, run.note = False, "a FullKV cell's decode: not part of the DGE cell"
        return run


class LookaheadCell(Cell):
    """A lookahead cell (LAQ, `stages.lookahead`): the first stage's selection and
    compaction of a copy of prefill's cache, L steps on the copy, then the cell's own
    selection from the full cache observing them, compaction and decode."""

    HOOKS = {"prefill": "prefill", "first_select": "keep_masks",
             "first_compact": "apply_eviction", "lookahead": "lookahead",
             "select": "keep_masks", "compact": "apply_eviction", "decode": "decode"}  # fmt: skip
    ORDER = {
        "prefill": (), "first_select": ("prefill",), "first_compact": ("prefill", "first_select"),
        "lookahead": ("prefill", "first_compact"), "select": ("prefill", "lookahead"),
        "compact": ("prefill", "select"), "decode": ("prefill", "compact"),
    }  # fmt: skip

    def __init__(self, setup: Setup):
        super().__init__(setup)
        self.first = laq.first_stage(self.ev)
        self.ahead = self.ev.timing.k
        self.first_kept = min(self.first.budget, setup.seq)
        # `apply_eviction` with no capacity: what it keeps, rounded up, + the L steps
        self.copy_capacity = evict.capacity_for(np.full((1,), self.first_kept), self.ahead)

    def made(self) -> dict[str, int]:
        copy = self.copy_capacity
        return super().made() | {"first_compact": copy, "lookahead": copy}

    def first_select(self) -> StageRun:
        cache = self.runs["prefill"].outputs.cache
        window = self.first.rule.needs.window
        return self._select("first_select", cache, self.first, None, window)

    def first_compact(self) -> StageRun:
        cache = self.runs["prefill"].outputs.cache
        (keep,) = self.runs["first_select"].outputs
        return self._compact("first_compact", cache, keep, self.copy_capacity, self.first_kept)

    def lookahead(self) -> StageRun:
        """`draft_tokens` of L steps over the compacted copy, from the lookahead's own state
        (`lookahead.start`, abstract)."""
        setup, copy = self.setup, self.runs["first_compact"].outputs
        start = self.start_state(self.runs["prefill"].outputs.cache)
        made = jax.eval_shape(lambda s, c: laq.start(s, c, self.ahead, setup.eos_ids), start, copy)
        state = _like(self.mesh, made, dataclasses.replace(start, cache=copy))
        slots = self.first_kept + self.ahead / 2
        return self._draft("lookahead", state, self.ahead, slots, self.copy_capacity)

    def _record(self):
        """The lookahead's record as `stages.lookahead` hands it on (abstract): each row's
        steps after its EOS unobserved, its attention moved onto the full cache's slots."""
        state, record = self.runs["lookahead"].outputs
        full = self.runs["prefill"].outputs.cache
        before = jax.ShapeDtypeStruct(state.step.shape, state.step.dtype)  # its step counters

        def observed(record, before, state, full):
            record = laq.observed_steps(record, before, state.step)
            if record.probs is None:
                return record
            probs = laq.onto_slots(record.probs, state.cache.padded_pos(), full.padded_pos())
            return record._replace(probs=probs)

        made = jax.eval_shape(observed, record, before, state, full)
        return _like(self.mesh, made, record)

    def select(self) -> StageRun:
        cache = self.runs["prefill"].outputs.cache
        observed = self.recording.needs.window + self.ahead
        return self._select("select", cache, self.ev, self._record(), observed)

    def compact(self) -> StageRun:
        cache = self.runs["prefill"].outputs.cache
        (keep,) = self.runs["select"].outputs
        return self._compact("compact", cache, keep, self.compact_capacity, self.kept)

    def decode(self) -> StageRun:
        """`decode_loop` over the compacted cache from prefill's state: the answer goes on
        from the first token, the lookahead's tokens thrown away."""
        state = self.start_state(self.runs["prefill"].outputs.cache)
        state = dataclasses.replace(state, cache=self.runs["compact"].outputs)
        steps = self.setup.max_new_tokens - 1
        return self._decode("decode", state, steps, self.kept + steps / 2, self.compact_capacity)


class FirstBlockThenLoop:
    """`hlo_cost`'s trips for decode_compressed's run-time loops, when no row stops early:
    a block's steps (the interval) inside the loop over blocks (`blocks` trips). XLA names
    the two loops of the entry computation alike (the first block, on the cache as it came,
    and the loop over blocks), and a program is walked in order: the first block comes
    first, as it must run first. Each walk of the program asks for those two in turn."""

    def __init__(self, interval: int, blocks: int):
        self.interval, self.blocks, self.asked = interval, blocks, 0

    def __call__(self, depth: int, op: str) -> int:
        if depth > 0:
            return self.interval
        self.asked += 1
        return self.interval if self.asked % 2 else self.blocks


class DecodeCell(Cell):
    """A decode-at-interval-k cell (kvpress's DecodingPress): prefill, then the compressing
    decode loop over the full cache (`stages._decode_compressed`): k steps on it, then a
    compression to the budget every k steps in the loop's own cache."""

    HOOKS = {"prefill": "prefill", "decode_compressed": "decode_compressed"}
    ORDER = {"prefill": (), "decode_compressed": ("prefill",)}

    def __init__(self, setup: Setup):
        super().__init__(setup)
        self.spread = evict.spreads_budget(self.ev)
        self.compact_capacity = self.ev.decode.capacity(self.spread)

    def made(self) -> dict[str, int]:
        return {"prefill": self.capacity, "decode_compressed": self.compact_capacity}

    def decode_compressed(self) -> StageRun:
        """`decode_compression.decode_compressed` from prefill's state, its loop built as
        `stages._decode_compressed` builds it; the state (the full cache) donated."""
        setup, ev = self.setup, self.ev
        spec = ev.decode
        select = evict.SelectionSpec.for_eviction(
            ev, head_cap=spec.head_cap(self.spread), windows=setup.cfg.layer_windows
        )
        loop = decode_compression.CompressionLoop(
            setup.family.forward, setup.cfg, stages.GREEDY, setup.eos_ids, select,
            spec.interval, self.compact_capacity, min_new_tokens=0,
            layer_loop=setup.decode_layer_loop, attention=setup.attention, history=0,
        )  # fmt: skip
        state = self.start_state(self.runs["prefill"].outputs.cache)
        budget = _replicated(self.mesh, jax.ShapeDtypeStruct((), jnp.int32))
        full, compressed = self.forward_steps
        on_full = self._decode_cost(full, setup.seq + full / 2)
        on_loop = self._decode_cost(compressed, spec.budget + spec.interval / 2)
        blocks = -(-compressed // spec.interval)
        run = StageRun(
            "decode_compressed",
            # Ideally: its decode steps (on the full cache, then on the loop's), the
            # compressions left out.
            unknown_trips=FirstBlockThenLoop(spec.interval, blocks),
            ideal_hbm_bytes=on_full[0] + on_loop[0], ideal_flops=on_full[1] + on_loop[1],
            slots=(self.capacity, self.compact_capacity),
        )  # fmt: skip
        return _compile(run, decode_compression.decode_compressed, loop, self.params, state,
                        budget, None, None)  # fmt: skip


TIMINGS = {"dge": Cell, "lookahead": LookaheadCell, "decode": DecodeCell}


def compile_cell(
    setup: Setup, log: Callable[[str], None] | None = None, shared: dict | None = None
) -> Cell:
    """Every stage of the cell (`setup.timing`'s) compiled in order; a stage whose inputs
    failed is not tried. shared: compiled prefills by `Cell.prefill_key`, reused by cells
    whose prefill is the same program (every cell of one setup at the same batch)."""
    cell = TIMINGS[setup.timing](setup)
    shared = {} if shared is None else shared
    with jax.set_mesh(setup.mesh):
        for name, needs in cell.ORDER.items():
            failed = [n for n in needs if cell.runs[n].compiled is None]
            if failed:
                cell.runs[name] = StageRun(name, error=f"not compiled: {failed[0]} failed")
            elif name == "prefill":
                cell.runs[name] = _shared_prefill(cell, shared, log)
                continue
            else:
                cell.runs[name] = getattr(cell, name)()
            if log:
                run = cell.runs[name]
                log(f"{name}: {'ok' if run.compiled else run.error} ({run.compile_s:.1f} s)")
    return cell


def _shared_prefill(cell: Cell, shared: dict, log) -> StageRun:
    """The cell's prefill: compiled, or an earlier cell's same program from `shared`."""
    key = cell.prefill_key()
    if key in shared:
        if log:
            log("prefill: the same program as an earlier cell's, compiled once")
        return shared[key]
    shared[key] = run = cell.prefill()
    if log:
        log(f"prefill: {'ok' if run.compiled else run.error} ({run.compile_s:.1f} s)")
    return run
