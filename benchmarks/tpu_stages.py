"""The stages of one DGE-SnapKV cell, compiled ahead of time for abstract devices.

`compile_cell` chains the jitted steps `generate_grid` runs for one cell, as it runs them:
`decoding.prefill_prompt` -> `decoding.draft_tokens` -> `decoding.rewind_state` ->
`evict.select_for_budgets` (what `evict.keep_masks` calls) -> `evict.compact` ->
`decoding.decode_loop` over the compacted cache, and `decode_loop` over prefill's full cache
(what a FullKV cell decodes). Each step is the library's own jitted function, lowered with
the static arguments the stages give it (`grid_plan.GridRecording`, `grid_plan.cache_room`,
the evict stage's capacity rule) and donating what it donates today; each stage's inputs are
the previous stages' outputs, with the shardings the compiler gave them. Parameters are bf16
and laid out by `dge_jax.runtime.sharding` (its rules, `param_shardings`, `cache_shardings`,
`rows_spec`), under `jax.set_mesh` as `generate_grid` runs (`on_model_mesh`). The small eager
glue between steps (`start_state`, `observation.for_rule`, `selection.apply_keep`) is traced
with `jax.eval_shape`, and its outputs keep the layout of the arrays they come from.

The platform's choices are the TPU's, as `generate_grid` makes them under a mesh of TPU
devices (`dge_jax.runtime.platform.Backend`): prefill steps of its `chunk_for` the batch,
prompts padded to its `prompt_bucket`, its attention ("auto": the Pallas flash kernel), the
decode loop's layer grouping ("scan"). `Setup.chunk`, `attention` and `layer_loop` override
them (e.g. ``--chunk 512 --attention xla`` gives the program before issue 29's changes).
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
from dge_jax.eviction import evict, grid_plan, observation, selection
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import dge
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding, platform, sharding
from dge_jax.runtime.cache import init_cache
from dge_jax.runtime.flash_tiles import _tile
from dge_jax.runtime.platform import Backend
from dge_jax.runtime.prompts import Request, bucket_length


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
            eos_ids=self.eos_ids,
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
    shardings = sharding.cache_shardings(cfg, b, setup.mesh)
    group = shardings.groups[0]
    k_shape = group.k.shard_shape((cfg.num_layers, b, cfg.num_kv_heads, 1, cfg.head_dim))
    pos_shape = group.pos.shard_shape((cfg.num_layers, b, cfg.num_kv_heads, 1))
    n = setup.devices
    # A lookup reads B rows of the embedding table, not the table (unless it is the LM head).
    embed = getattr(params, "embed", None)
    lookup_only = 0.0 if embed is None or cfg.tie_word_embeddings else per_device_bytes(embed)
    return Sizes(
        weights=per_device_bytes(params) - lookup_only,
        kv_slot=2 * float(np.prod(k_shape)) * 2,  # k and v, bf16
        pos_slot=float(np.prod(pos_shape)) * 4,
        token_flops=(2 * work.linear_params(cfg) + 2 * cfg.hidden_size * cfg.vocab_size) / n,
        slot_flops=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim / n,
    )


class Cell:
    """The stages of one DGE-SnapKV cell, compiled in order; each keeps its abstract outputs
    for the next (module docstring)."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.params = abstract_params(setup)
        self.request = setup.request()
        self.ev = setup.eviction
        self.recording = grid_plan.GridRecording.of([self.ev])
        self.prompt_len = self.request.tokens.shape[1]  # seq padded as generate pads it
        self.capacity = self.prompt_len + grid_plan.cache_room(self.request, [self.ev])
        self.full_capacity = self.prompt_len + grid_plan.cache_room(self.request, [None])
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

    def _statics(self):
        return self.setup.family.forward, self.setup.cfg, self.params

    def _decode_cost(self, steps: int, slots: float) -> tuple[float, float]:
        """(ideal HBM bytes, ideal FLOPs) of `steps` decode steps over `slots` valid slots on
        average: the weights and the cache read once per step."""
        s, b = self.sizes, self.setup.batch
        per_step_bytes = s.weights + s.kv_slot * slots
        per_step_flops = b * (s.token_flops + s.slot_flops * slots)
        return steps * per_step_bytes, steps * per_step_flops

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
        return _compile(
            run, decoding.prefill_prompt, *self._statics(), tokens, lengths,
            capacity=self.capacity, chunk=setup.prefill_chunk, recording=needs.recording,
            attention=setup.attention,
        )  # fmt: skip

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

    def draft(self) -> StageRun:
        setup, needs, k = self.setup, self.recording.needs, self.draft_steps
        state = self.start_state(self.runs["prefill"].outputs.cache)
        bytes_, flops = self._decode_cost(k, setup.seq + k / 2)
        run = StageRun("draft", ideal_hbm_bytes=bytes_, ideal_flops=flops, slots=(self.capacity,))
        return _compile(
            run, decoding.draft_tokens, *self._statics(), state, sampler=stages.GREEDY,
            eos_ids=setup.eos_ids, num_steps=k, recording=needs.recording.steps,
            min_new_tokens=0,
        )  # fmt: skip

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

    def select(self) -> StageRun:
        """`evict.select_for_budgets` with the arguments `evict.keep_masks` gives it."""
        ev, cap, b = self.ev, self.capacity, self.setup.batch
        state, record = self.runs["rewind"].outputs
        pre = self.runs["prefill"].outputs
        cut = jax.eval_shape(lambda o, d: observation.for_rule(ev.rule, o, d), pre.obs, record)
        obs, drafts = _like(self.mesh, cut, (pre.obs, record))
        scalars = _replicated(self.mesh, (
            (jax.ShapeDtypeStruct(np.shape(ev.budget), jnp.int32),),
            jax.ShapeDtypeStruct((), jnp.bool_),
            jax.ShapeDtypeStruct((), jnp.float32),
        ))  # fmt: skip
        spec = evict.SelectionSpec.for_eviction(ev)
        s, w = self.sizes, self.recording.needs.window
        run = StageRun(
            "select",
            # Ideally: the keys and positions read once, the keep mask (1 byte a slot) written.
            ideal_hbm_bytes=(s.kv_slot / 2 + s.pos_slot + s.pos_slot / 4) * cap,
            ideal_flops=s.slot_flops / 2 * (w + self.draft_steps) * b * cap,
            slots=(cap,),
        )
        return _compile(run, evict.select_for_budgets, state.cache, obs, drafts, *scalars,
                        spec=spec)  # fmt: skip

    def compact(self) -> StageRun:
        """`evict.compact` of the masked cache (`selection.apply_keep`, run eagerly before)."""
        cache = self.runs["rewind"].outputs[0].cache
        (keep,) = self.runs["select"].outputs
        masked = _like(self.mesh, jax.eval_shape(selection.apply_keep, cache, keep), cache)
        s, cap, out = self.sizes, self.capacity, self.compact_capacity
        run = StageRun(
            "compact",
            # Ideally: positions read, the kept entries read, the compacted cache written.
            ideal_hbm_bytes=s.pos_slot * cap + s.kv_slot * self.kept + (s.kv_slot + s.pos_slot)
            * out,
            slots=(cap, out),
        )  # fmt: skip
        return _compile(run, evict.compact, masked, capacity=out)

    def _decode(self, name: str, state, steps: int, slots: float, capacity: int) -> StageRun:
        setup = self.setup
        bytes_, flops = self._decode_cost(steps, slots)
        run = StageRun(
            name,
            # The decode loop runs until every row is done: `steps` when no row stops early.
            unknown_trips=lambda depth, op: steps if depth == 0 else None,
            ideal_hbm_bytes=bytes_, ideal_flops=flops, slots=(capacity,),
        )  # fmt: skip
        return _compile(
            run, decoding.decode_loop, *self._statics(), state, sampler=stages.GREEDY,
            eos_ids=setup.eos_ids, min_new_tokens=0, layer_loop=setup.decode_layer_loop,
        )  # fmt: skip

    def decode(self) -> StageRun:
        """`decode_loop` over the compacted cache, from the rewound state (as `evict` builds
        it); the loop donates it."""
        state = self.runs["rewind"].outputs[0]
        state = dataclasses.replace(state, cache=self.runs["compact"].outputs)
        steps = self.setup.max_new_tokens - 1 - self.draft_steps
        return self._decode("decode", state, steps, self.kept + steps / 2, self.compact_capacity)

    def decode_full(self) -> StageRun:
        """`decode_loop` over prefill's full cache: what a FullKV cell decodes (its prefill's
        cache has room for every new token: `grid_plan.cache_room`)."""
        cfg, b, cap = self.setup.cfg, self.setup.batch, self.full_capacity
        cache = self.runs["prefill"].outputs.cache
        if cap != self.capacity:
            shape = jax.eval_shape(
                lambda: init_cache(cfg.num_layers, b, cfg.num_kv_heads, cap,
                                            cfg.head_dim, jnp.bfloat16))  # fmt: skip
            cache = _like(self.mesh, shape, sharding.cache_shardings(cfg, b, self.mesh))
        steps = self.setup.max_new_tokens - 1
        run = self._decode("decode_full", self.start_state(cache), steps,
                           self.setup.seq + steps / 2, cap)  # fmt: skip
        run.held, run.note = False, "a FullKV cell's decode: not part of the DGE cell"
        return run


# stage -> the stages whose outputs it reads
ORDER = {
    "prefill": (), "draft": ("prefill",), "rewind": ("draft",), "select": ("prefill", "rewind"),
    "compact": ("rewind", "select"), "decode": ("rewind", "compact"), "decode_full": ("prefill",),
}  # fmt: skip


def compile_cell(setup: Setup, log: Callable[[str], None] | None = None) -> Cell:
    """Every stage of the cell compiled in order; a stage whose inputs failed is not tried."""
    cell = Cell(setup)
    with jax.set_mesh(setup.mesh):
        for name, needs in ORDER.items():
            failed = [n for n in needs if cell.runs[n].compiled is None]
            if failed:
                cell.runs[name] = StageRun(name, error=f"not compiled: {failed[0]} failed")
            else:
                cell.runs[name] = getattr(cell, name)()
            if log:
                run = cell.runs[name]
                log(f"{name}: {'ok' if run.compiled else run.error} ({run.compile_s:.1f} s)")
    return cell
