"""The int4 KV cache (`kv_quant="int4..."`, KIVI's scheme: `dge_jax.runtime.quantized`):

- the scheme against a NumPy reference (keys per channel over G slots, values per token over
  G channels, packing, the residual blocks) and its round-trip bound;
- writes: prefill chunks and single steps of the same tokens leave the reference's state,
  blocks complete at the right step, a capacity not divisible by R keeps its tail residual;
- a decode step reads what a prefill step of its token reads (its block completed or not),
  and the Pallas kernels (interpret mode) read an int4 cache as the XLA path does;
- slot moves: compaction and the sliding moves requantize what they move, room is exact;
- generation: decode equals a forward that replays the same steps, a budget at the prompt
  gives int4 FullKV's tokens under every timing, every head keeps exactly its budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from kv_quant_checks import assert_pallas_is_xla, prefill_caches
from tiny_model import jax_config, jax_model

from dge_jax.eviction.decode_spec import DecodeCompression
from dge_jax.eviction.evict import Eviction
from dge_jax.eviction.timing import Lookahead, Timing
from dge_jax.generation import generate, generate_grid
from dge_jax.kernels.attention import AttentionSpec, LayerCache, NewEntries
from dge_jax.kernels.layer_attention import cache_layer_attention
from dge_jax.rules.h2o import H2O
from dge_jax.rules.knorm import KeyNorm
from dge_jax.rules.pyramidkv import PyramidKV
from dge_jax.rules.snapkv import SnapKV
from dge_jax.runtime import decoding
from dge_jax.runtime.cache import KVCache, LayerGroup, init_cache
from dge_jax.runtime.cache_layout import cache_specs
from dge_jax.runtime.compaction import compact, compact_heads
from dge_jax.runtime.extend import with_room
from dge_jax.runtime.quantized import (
    Int4Entries,
    KVQuant,
    dequantize,
    empty_entries,
    movable,
    parse_kv_quant,
    quantize_int4,
    quantize_int4_entries,
    read_slots,
    settle,
    write_int4,
)
from dge_jax.runtime.window_cache import make_room

G, R = 4, 16
QUANT = KVQuant("int4", G, R)
KV_QUANT = "int4-g4-r16"


def reference_groups(x: np.ndarray, keys: bool, g: int, dtype):
    """KIVI's groups in NumPy: x [..., n, D] -> (q [..., n, D] uint8 unpacked, scale, zero of
    `dtype`; keys [..., n / G, D], values [..., n, D / G]). scale = (max - min) * (1 / 15)
    and zero = min per group, rounded to the dtype; q = round-half-even((x - zero) / scale)
    clipped to [0, 15]; a constant group gets scale 0 and q 0."""
    x = x.astype(np.float32)
    *lead, n, d = x.shape
    xg, axis = ((x.reshape(*lead, n // g, g, d), -2) if keys
                else (x.reshape(*lead, n, d // g, g), -1))  # fmt: skip
    lo, hi = xg.min(axis, keepdims=True), xg.max(axis, keepdims=True)
    scale = ((hi - lo) * np.float32(1 / 15)).astype(dtype)
    zero = lo.astype(dtype)
    safe = np.where(scale == 0, 1, scale).astype(np.float32)
    q = np.clip(np.round((xg - zero.astype(np.float32)) / safe), 0, 15).astype(np.uint8)
    return q.reshape(x.shape), scale.squeeze(axis), zero.squeeze(axis)


def reference_pack(q: np.ndarray) -> np.ndarray:
    """Channel 2j in the low nibble of byte j, channel 2j + 1 in the high one."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def reference_dequant(q, scale, zero, keys: bool, g: int) -> np.ndarray:
    """q * scale + zero per element, in f32 (callers compare with a tolerance)."""
    if keys:
        s, z = np.repeat(scale, g, axis=-2), np.repeat(zero, g, axis=-2)
    else:
        s, z = np.repeat(scale, g, axis=-1), np.repeat(zero, g, axis=-1)
    return q.astype(np.float32) * s.astype(np.float32) + z.astype(np.float32)


def reference_view(x: np.ndarray, n: int, keys: bool) -> np.ndarray:
    """What a layer that wrote x's slots [0, n) reads (x [..., S, D] f32): the whole blocks
    of R slots below slot n quantized, the rest (the residual block, the tail) as written,
    slots from n on empty."""
    out = x.astype(np.float32).copy()
    done = min(n // R, x.shape[-2] // R) * R
    q, scale, zero = reference_groups(x[..., :done, :], keys, G, np.float32)
    out[..., :done, :] = reference_dequant(q, scale, zero, keys, G)
    out[..., n:, :] = 0
    return out


def random_entries(rng, shape, dtype=np.float32) -> np.ndarray:
    """Normal values with a spread of channel and token scales (outlier channels, as KIVI's
    keys have)."""
    *lead, s, d = shape
    x = rng.standard_normal(shape) * rng.uniform(0.1, 8, (*lead, 1, d))
    return (x * rng.uniform(0.5, 2, (*lead, s, 1))).astype(dtype)


@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_int4_matches_the_numpy_reference_and_its_bound(keys, dtype):
    rng = np.random.default_rng(0)
    x = random_entries(rng, (2, 3, 16, 8), dtype)
    x[0, 0, :4] = 1.5  # constant groups: scale 0, q 0, read back exactly
    x[0, 1, 2] = 0
    packed, scale, zero = quantize_int4(jnp.asarray(x), keys, G)
    q, want_scale, want_zero = reference_groups(x, keys, G, dtype)
    # XLA:CPU's f32 division is not correctly rounded (0.66015625 / 0.1015625 gives
    # 6.5000005): where the exact quotient is a tie, q may round either way.
    got = np.asarray(packed)
    got = np.stack([got & 15, got >> 4], -1).reshape(x.shape)
    z = np.repeat(want_zero, G, axis=-2 if keys else -1).astype(np.float32)
    s = np.repeat(want_scale, G, axis=-2 if keys else -1).astype(np.float32)
    quotient = (x.astype(np.float32) - z) / np.where(s == 0, 1, s)
    tie = np.abs(quotient % 1 - 0.5) < 1e-4
    np.testing.assert_array_equal(np.where(tie, 0, got), np.where(tie, 0, q))
    assert np.all(np.abs(got.astype(int) - q) <= 1) and tie.sum() < 0.05 * x.size
    q = got  # the tie-broken levels, for what is read back below
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    np.testing.assert_array_equal(np.asarray(zero), want_zero)
    assert packed.dtype == jnp.uint8 and packed.shape == (2, 3, 16, 4)
    assert scale.dtype == x.dtype and scale.shape == ((2, 3, 4, 8) if keys else (2, 3, 16, 2))
    entries = quantize_int4_entries(jnp.asarray(x), 16, QUANT, keys)
    back = np.asarray(dequantize(entries), np.float32)
    # |x - x'| <= scale / 2, plus the dtype's rounding of zero, of q * scale and of the sum
    eps, x32 = np.finfo(dtype).eps, x.astype(np.float32)
    bound = s / 2 + 2 * eps * (np.abs(x32) + np.abs(z) + 15 * s) + 1e-30
    assert np.all(np.abs(back - x32) <= bound)
    np.testing.assert_array_equal(back[0, 0, :4], 1.5)
    # every group spans its 16 levels: its min maps to 0, its max to 15
    assert q.min() == 0 and q.max() == 15
    # q * scale + zero, each op rounded to the dtype: within its rounding of the f32 sum
    ref = reference_dequant(q, want_scale, want_zero, keys, G)
    assert np.all(np.abs(back - ref) <= 2 * eps * (15 * s + np.abs(z)) + 1e-7)


def test_the_kv_quant_grammar():
    assert parse_kv_quant("int4") == KVQuant("int4", 32, 128)
    assert parse_kv_quant("int4-g64-r256") == KVQuant("int4", 64, 256)
    assert parse_kv_quant("int4-r64") == KVQuant("int4", 32, 64)
    assert parse_kv_quant("int4-g4-r16").name == "int4-g4-r16"
    assert parse_kv_quant("int4-g32-r128").name == "int4"
    assert parse_kv_quant("int8") == KVQuant("int8")
    for bad in ("int4-g3-r16", "int4-g32-r16", "int4-r16-g4", "int4-g0", "int5", "fp8"):
        with pytest.raises(ValueError, match=r"'int4\[-g<G>\]\[-r<R>\]'"):
            parse_kv_quant(bad)
    with pytest.raises(ValueError, match="multiple of 32.*got 16: pick a group dividing it"):
        init_cache(1, 1, 1, 8, 16, kv_quant="int4")
    assert init_cache(1, 1, 1, 8, 16, kv_quant="int4-g16").kv_quant == "int4-g16-r128"


@pytest.mark.parametrize("slots", [48, 45])
@pytest.mark.parametrize("keys", [True, False])
def test_chunk_and_step_writes_leave_the_reference_state(slots, keys):
    """Layer 1 of a two-layer stack written in prefill chunks of 8, or one slot at a time:
    after every write it reads as the reference, each write reads back its own entries as
    stored, whole blocks reach the packed store exactly when their last slot is written
    (never before), and both write orders end in the same leaves. 45 slots: the tail 32..44
    stays residual for good."""
    rng = np.random.default_rng(slots)
    x = random_entries(rng, (2, 2, slots, 8))
    stack = init_cache(2, 2, 2, slots, 8, jnp.float32, KV_QUANT).groups[0]
    stack = stack.k if keys else stack.v
    write = jax.jit(write_int4)

    def run(sizes):
        e, n = stack, 0
        for t in sizes:
            e, read = write(e, 1, n, jnp.asarray(x[..., n : n + t, :]))
            n += t
            view = np.asarray(dequantize(e))
            np.testing.assert_allclose(view[1], reference_view(x, n, keys), rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(view[0], 0)  # the other layer untouched
            np.testing.assert_array_equal(read, view[1][..., n - t : n, :])
            np.testing.assert_array_equal(e.start[1], n // R * R)
            done = min(n // R, slots // R) * R
            q, scale, _ = reference_groups(x[..., :done, :], keys, G, np.float32)
            np.testing.assert_array_equal(e.logical("q")[1, ..., :done, :], reference_pack(q))
            stored_q = e.logical("q")
            np.testing.assert_array_equal(stored_q[1, ..., done:, :], 0)  # nothing stored early
            groups = done // G if keys else done
            np.testing.assert_array_equal(e.logical("scale")[1, ..., :groups, :], scale)
        return e, view

    chunked, _ = run([8] * (slots // 8) + [1] * (slots % 8))
    stepped, view = run([1] * slots)
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(stepped), strict=True):
        np.testing.assert_array_equal(a, b)
    whole = slots // R * R
    np.testing.assert_array_equal(view[1][..., whole:, :], x[..., whole:, :])  # tail exact
    assert int(stepped.start[1, 0, 0]) == (whole if slots % R else slots)


def int4_layer(seed, n, s=48, window=None):
    """Layer 1 of a 3-layer int4 cache [3, 2, 2, s, 8] that wrote slots [0, n), its step's
    query q [2, T, 4, 8] and new entries at slot n (T tokens, set later)."""
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(random_entries(rng, (3, 2, 2, s, 8))) for _ in "kv")
    index = jnp.full((3,), n, jnp.int32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (3, 2, 2, s)).copy()
    pos[..., n:] = -1
    pos[:, 0, :, :3] = -1  # left padding of row 0
    ek = quantize_int4_entries(k, index[:, None, None], QUANT, True)
    ev = quantize_int4_entries(v, index[:, None, None], QUANT, False)
    return LayerCache(ek, ev, jnp.asarray(pos), 1, n, window), rng


@pytest.mark.parametrize("n,t", [(15, 1), (20, 1), (14, 3), (29, 4)])
def test_a_decode_step_reads_what_a_prefill_step_reads(n, t):
    """The read-before-write path (key_block 0) and the write-then-read one (a prefill chunk
    of the same T tokens) give the same output and write the same cache, whether the step
    completes a residual block (slot 15; 14..16; 29..32) or not (20)."""
    layer, rng = int4_layer(n, n)
    k_new, v_new = (jnp.asarray(random_entries(rng, (2, 2, t, 8))) for _ in "kv")
    pos_new = jnp.broadcast_to(jnp.arange(n, n + t, dtype=jnp.int32), (2, 2, t))
    q = jnp.asarray(rng.standard_normal((2, t, 4, 8)), jnp.float32)
    step = jax.jit(cache_layer_attention, static_argnums=4)
    new = NewEntries(k_new, v_new, pos_new)
    out = {kb: step(q, pos_new[:, 0], new, layer, AttentionSpec(key_block=kb, attention="xla"))
           for kb in (0, t)}  # fmt: skip
    np.testing.assert_allclose(out[0][0], out[t][0], rtol=1e-5, atol=2e-5)  # summation order
    for a, b in zip(jax.tree.leaves(out[0][2]), jax.tree.leaves(out[t][2]), strict=True):
        np.testing.assert_array_equal(a, b)
    written = out[0][2].k
    assert int(written.start[1, 0, 0]) == (n + t) // R * R
    # the new keys are stored: exact in the residual, within int4's bound once quantized
    got = np.asarray(dequantize(written))[1, ..., n : n + t, :]
    exact = (np.arange(n, n + t) >= (n + t) // R * R)[:, None]
    np.testing.assert_array_equal(np.where(exact, got, 0), np.where(exact, k_new, 0))
    np.testing.assert_allclose(got, k_new, atol=0.6 * float(np.abs(k_new).max()))


@pytest.mark.parametrize("s,n", [(32, 14), (150, 140), (150, 146)])
@pytest.mark.parametrize("key_block,record_attn", [(0, False), (4, False), (4, True)])
def test_pallas_reads_int4_as_xla_does(key_block, record_attn, s, n):
    """attention="pallas" on an int4 cache (interpret mode): a decode step, a prefill chunk
    with and without probs sums give "xla"'s output and sums and write the same cache. The
    kernels read the layer in pieces (`int4_pieces`; with probs sums, dequantized whole):
    at 32 slots two pieces of one 16-slot block; at 150, 9 blocks in five pieces of two, the
    last moved back over a block the fourth read, and a 6-slot tail that holds the residual
    (n = 146) or not (140)."""
    from dge_jax.runtime.quantized import piece_plan

    assert piece_plan(32, R) == (16, 2, 32) and piece_plan(150, R) == (32, 5, 144)
    layer, rng = int4_layer(3, n, s=s, window=jnp.int32(5 if key_block else 0))
    t = 4 if key_block else 1
    k_new, v_new = (jnp.asarray(random_entries(rng, (2, 2, t, 8))) for _ in "kv")
    pos_new = jnp.broadcast_to(jnp.arange(n, n + t, dtype=jnp.int32), (2, 2, t))
    q = jnp.asarray(rng.standard_normal((2, t, 4, 8)), jnp.float32)

    assert_pallas_is_xla(q, NewEntries(k_new, v_new, pos_new), layer, key_block, record_attn)


def test_over_pieces_reads_every_slot_once_unseen():
    """`over_pieces` at 150 slots (R = 16, 5 pieces): five pieces of 32 slots, the last
    moved back to end at 144 with the 16 slots the fourth read marked seen, then a tail at
    144; the unseen slots of the pieces are [0, 144) once each. At 32 slots, no tail."""
    from dge_jax.runtime.quantized import over_pieces

    def piece(start, size, seen, acc):
        counts, starts, p = acc
        idx = start + jnp.arange(size)
        return counts.at[idx].add((~seen).astype(jnp.int32)), starts.at[p].set(start), p + 1

    init = (jnp.zeros(150, jnp.int32), jnp.full(5, -1, jnp.int32), jnp.int32(0))
    counts, starts, count = over_pieces(
        150, R, 5, piece, lambda n, acc: (acc[0].at[n:].add(1), acc[1], acc[2] * 0 + n), init)
    np.testing.assert_array_equal(starts, [0, 32, 64, 96, 112])
    np.testing.assert_array_equal(counts, np.ones(150, np.int32))
    assert int(count) == 144  # the tail ran, at n = 144
    assert over_pieces(32, R, 8, lambda s, z, seen, c: c + 1, lambda n, c: c + 100, 0) == 2


def test_pieces_join_as_one_softmax():
    """`int4_pieces.join` of two halves' (out, lse) is the softmax over all slots; a row
    that saw nothing in one half takes the other's, in both it stays 0."""
    from dge_jax.kernels.int4_pieces import join

    rng = np.random.default_rng(0)
    s, v = rng.standard_normal((3, 10)), rng.standard_normal((10, 4))
    s[1, :5] = -np.inf  # row 1 sees nothing in the first half; row 2 nothing at all
    s[2] = -np.inf

    def part(cols):
        x = s[:, cols]
        seen = np.isfinite(x).any(axis=1)
        m = np.where(seen, np.max(np.where(np.isfinite(x), x, -1e30), axis=1), -1e30)
        w = np.where(np.isfinite(x), np.exp(x - m[:, None]), 0)
        norm = w.sum(axis=1)
        out = np.where(seen[:, None], w @ v[cols] / np.where(seen, norm, 1)[:, None], 0)
        return (jnp.asarray(out, jnp.float32),
                jnp.asarray(np.where(seen, m + np.log(np.where(seen, norm, 1)), -1e30),
                            jnp.float32))  # fmt: skip

    out, lse = join(part(slice(0, 5)), part(slice(5, 10)))
    whole_out, whole_lse = part(slice(0, 10))
    np.testing.assert_allclose(out, whole_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[:2], whole_lse[:2], rtol=1e-6)
    assert float(lse[2]) <= -1e30 and not np.any(out[2])


def int4_cache(seed=0, s=40, n=36):
    """A 3-layer int4 cache [3, 2, 2, s, 8] that wrote slots [0, n) (row 0 left-padded)."""
    layer, _ = int4_layer(seed, n, s)
    return KVCache((LayerGroup(layer.k, layer.v, layer.pos, jnp.full((3,), n, jnp.int32)),))


def requantized(cache: KVCache) -> KVCache:
    """The cache's dequantized entries requantized at its own write index: what a slot
    move makes of the entries it moves (`quantized.map_slots`)."""
    groups = []
    for g in cache.groups:
        at = g.index[:, None, None]
        k = quantize_int4_entries(dequantize(g.k), at, QUANT, True)
        v = quantize_int4_entries(dequantize(g.v), at, QUANT, False)
        groups.append(LayerGroup(k, v, g.pos, g.index))
    return KVCache(tuple(groups))


def assert_reads(got: KVCache, want: KVCache, atol=0.0):
    assert got.capacities == want.capacities and got.kv_quant == KV_QUANT
    for a, b in zip(got.groups, want.groups, strict=True):
        assert isinstance(a.k, Int4Entries) and a.k.q.dtype == jnp.uint8
        np.testing.assert_array_equal(a.pos, b.pos)
        np.testing.assert_array_equal(a.index, b.index)
        for x, y in ((a.k, b.k), (a.v, b.v)):
            np.testing.assert_allclose(dequantize(x), dequantize(y), rtol=0, atol=atol)


def test_compaction_requantizes_what_it_moves_and_room_is_exact():
    """Compaction of an int4 cache reads as the compaction of its dequantized twin
    requantized at the new write index (the kept entries within int4's error of what they
    were); appending room changes nothing any entry reads; the sliding moves requantize."""
    quant = int4_cache()
    twin = KVCache.stacked(quant.k, quant.v, quant.pos, quant.index)  # plain, same reads
    rng = np.random.default_rng(1)
    keep = jnp.asarray(rng.random(quant.pos.shape) < 0.5) & (quant.pos >= 0)
    masked_q, masked_p = (c.with_pos(jnp.where(keep, c.pos, -1)) for c in (quant, twin))
    for capacity in (24, (24, 24, 40)):
        got, plain = compact(masked_q, capacity), compact(masked_p, capacity)
        assert_reads(got, requantized(plain), atol=1e-6)
        for a, b in zip(got.groups, plain.groups, strict=True):  # near what they were
            np.testing.assert_allclose(dequantize(a.k), b.k, atol=0.2 * float(np.abs(b.k).max()))
    roomy = with_room(quant, 30)
    assert roomy.capacity > quant.capacity and roomy.kv_quant == KV_QUANT
    np.testing.assert_array_equal(roomy.k[..., : quant.capacity, :], quant.k)
    np.testing.assert_array_equal(roomy.v[..., quant.capacity :, :], 0)
    moved = make_room(quant.groups[0], 6, 8)  # 36 + 8 > 40: the last 5 slots to the front
    moved_plain = make_room(twin.groups[0], 6, 8)
    assert_reads(KVCache((moved,)), requantized(KVCache((moved_plain,))), atol=1e-6)



@pytest.mark.parametrize("capacity", [24, 48, (24, 24, 40)])
def test_compaction_layer_by_layer_equals_the_whole_group(capacity):
    """int4 compaction runs one layer at a time (`compact_int4_layers`: a layer's dense
    copy, not the group's); its stored entries equal, leaf for leaf and to the bit, the
    whole group's gather of the dequantized entries requantized after (`movable`,
    `compact_heads`, `settle`: what compaction ran before), shrinking, growing and per-layer
    capacities alike."""
    quant = int4_cache()
    keep = jnp.asarray(np.random.default_rng(2).random(quant.pos.shape) < 0.5) & (quant.pos >= 0)
    cache = quant.with_pos(jnp.where(keep, quant.pos, -1))
    group = cache.groups[0]
    caps = (capacity,) * 3 if isinstance(capacity, int) else capacity
    k, v, pos, count = compact_heads(movable(group.k), movable(group.v), group.pos, max(caps))
    counts = jnp.max(count, axis=(1, 2))
    index = counts if not isinstance(capacity, int) else jnp.full((3,), jnp.max(counts))
    index = jnp.minimum(index, jnp.asarray(caps)).astype(jnp.int32)
    got = compact(cache, capacity)
    layer = 0
    for g in got.groups:
        cap, n = g.capacity, g.num_layers
        part = slice(layer, layer + n)
        np.testing.assert_array_equal(g.pos, pos[part, ..., :cap])
        np.testing.assert_array_equal(g.index, index[part])
        for x, like, stored in ((k, group.k, g.k), (v, group.v, g.v)):
            want = settle(x[part, ..., :cap, :], like, index[part])
            for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(a, b)
        layer += n
    assert layer == 3


@pytest.mark.parametrize("n_b", [20, 40])
def test_row_stacking_layer_by_layer_equals_the_whole_group(n_b):
    """stack_states interleaves int4 rows one layer at a time (`stacking._interleave_int4`).
    Residual blocks that start apart (36 and 20 slots written, R = 16): its stored entries
    equal, to the bit, the whole group's interleave of the dequantized entries requantized at
    the larger next write slot. Residual blocks that start together (36 and 40): the stored
    leaves interleaved as they are, never requantized (a stacked row reads what it read)."""
    from dge_jax.runtime.stacking import _interleave, _interleave_int4

    a, b = int4_cache(seed=0, n=36).groups[0], int4_cache(seed=1, n=n_b).groups[0]
    index = jnp.maximum(a.index, b.index)
    for parts in ((a.k, b.k), (a.v, b.v)):
        if n_b // R == 36 // R:
            want = jax.tree.map(lambda *xs: _interleave(list(xs), axis=1), *parts)
        else:
            whole = jax.tree.map(lambda *xs: _interleave(list(xs), axis=1),
                                 *map(movable, parts))  # fmt: skip
            want = settle(whole, parts[0], index)
        got = _interleave_int4(list(parts), index)
        assert got.q.shape == want.q.shape and got.q.shape[1] == 2 * a.k.q.shape[1]
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize("slots", [32, 40, 45])
def test_empty_entries_are_the_quantized_zeros(keys, slots):
    """An empty int4 cache is built as zeros (no dense temporary under jit): leaf for leaf,
    shape, dtype and value, what quantizing zeros at index 0 gives."""
    shape = (3, 2, 2, slots - slots % G, 8)
    got = empty_entries(shape, jnp.bfloat16, KV_QUANT, keys=keys)
    want = quantize_int4_entries(jnp.zeros(shape, jnp.bfloat16), 0, QUANT, keys, jnp.bfloat16)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_stored_rows_fill_128_lanes():
    """Llama's head dim 128 with KIVI's G 32, R 128: the packed values (64 bytes a slot) and
    the values' scales (4 a slot) are stored 128 wide, 2 and 32 slots a row, so TPU pads
    no lanes (benchmarks/RESULTS.md, "An int4 cache (KIVI) compiled for TPU"); the keys'
    scales are 128 wide already. A count the factor does not divide merges fewer rows."""
    for slots, q_rows, v_rows in ((32832, 16416, 1026), (1088, 544, 34), (1090, 545, 545)):
        k = empty_entries((1, 1, 1, slots, 128), jnp.bfloat16, "int4", keys=True)
        v = empty_entries((1, 1, 1, slots, 128), jnp.bfloat16, "int4", keys=False)
        assert k.shape == v.shape == (1, 1, 1, slots, 128)
        assert k.q.shape[-2:] == (q_rows, 128) and k.scale.shape[-1] == 128
        assert v.scale.shape[-2] == v_rows and v.zero.shape == v.scale.shape
        assert v.logical("scale").shape[-2:] == (slots, 4)

def test_specs_follow_the_int4_structure():
    from dge_jax.config import ModelConfig

    cfg = ModelConfig(family="llama", vocab_size=16, hidden_size=16, intermediate_size=32,
                      num_layers=3, num_heads=2, num_kv_heads=2, head_dim=8)  # fmt: skip
    specs = cache_specs(cfg, 2, {"data": 1, "model": 1}, kv_quant=KV_QUANT)
    assert jax.tree.structure(specs) == jax.tree.structure(int4_cache())


# Generation on the tiny random Llama of the eviction tests (head dim 16: groups of 4, R 16).
WINDOW, NEW, CAP, CHUNK = 8, 10, 64, 8
LENGTH = 40  # both prompts, 5 chunks (no padding); draft and decode complete block 2 (48)
PROMPTS = [np.random.default_rng(n).integers(0, 128, LENGTH).tolist() for n in (1, 2)]
INT4 = dict(max_new_tokens=NEW, kv_quant=KV_QUANT)


@pytest.fixture(scope="module")
def model():
    return jax_model()


@pytest.fixture(scope="module")
def full_int4(model):
    return generate(model, PROMPTS, chunk=CHUNK, **INT4)


def test_decode_on_int4_equals_a_forward_replaying_its_steps(model, full_int4):
    """Greedy decode on an int4 cache picks the argmax of a forward that replays its write
    sequence: prefill's chunks of 8, then one prefill step per answer token (the write-
    then-read path). Only that replay is the reference: the residual makes what a query
    reads depend on where steps end (a token read full precision in its step is quantized
    once its block completes), so one teacher-forced forward over the whole sequence
    differs, and does here."""
    cfg, params, forward = model.config, model.params, model.forward
    tokens, lengths = jnp.asarray(PROMPTS), jnp.full((2,), LENGTH, jnp.int32)
    spec = decoding.PrefillSpec(capacity=CAP, chunk=CHUNK, kv_quant=KV_QUANT)
    out = decoding.prefill_prompt(forward, cfg, params, tokens, lengths, spec)
    step = jax.jit(forward, static_argnums=(0,), static_argnames=("key_block",))
    cache, logits = out.cache, [out.logits]
    answers = np.asarray(full_int4.tokens)
    for j in range(NEW - 1):
        pos = jnp.full((2, 1), LENGTH + j, jnp.int32)
        tok = jnp.asarray(answers[:, j : j + 1])
        replay = step(cfg, params, tok, pos, cache, key_block=1)
        decoded = step(cfg, params, tok, pos, cache, key_block=0)  # read before write
        np.testing.assert_allclose(decoded.logits, replay.logits, rtol=1e-5, atol=1e-5)
        # layer 0 writes the same entries either way (later layers' inputs differ by the
        # attention's summation order)
        first = jax.tree.map(lambda x: x[:1], (decoded.cache, replay.cache))
        for a, b in zip(*map(jax.tree.leaves, first), strict=True):
            np.testing.assert_array_equal(a, b)
        cache = replay.cache
        logits.append(replay.logits)
    assert int(cache.groups[0].k.start[0, 0, 0]) == 48  # block 2 completed while decoding
    np.testing.assert_array_equal(np.stack(logits, 1).argmax(-1), answers)
    seqs = np.concatenate([tokens, answers[:, :-1]], axis=1)
    whole = decoding.teacher_forced_logits(forward, cfg, params, jnp.asarray(seqs),
                                           jnp.full((2,), seqs.shape[1]), kv_quant=KV_QUANT)
    gap = np.abs(np.asarray(whole)[:, LENGTH - 1 :] - np.stack(logits, 1)).max()
    assert gap > 1e-4, gap


STAGE = Lookahead(budget=20, window=12)
TIMINGS = (Timing("prefill"), Timing("dge", 3), Timing("dge_w", 3), Timing("dge_d", 3),
           Timing("lookahead", 3, lookahead=STAGE))  # fmt: skip
RULES = (SnapKV(window=WINDOW), PyramidKV(window=WINDOW), H2O(window=WINDOW), KeyNorm())


def test_a_budget_at_the_prompt_is_int4_fullkv_under_every_timing(model, full_int4):
    """Every timing keeps everything at a budget of the prompt, and compaction then moves no
    entry: requantizing what it gathers gives back the numbers FullKV reads. The prompts
    have one length: compaction moves a left-padded row's entries to other slots, hence to
    other key groups and out of the residual block, which changes what they read (an int4
    cache is laid out by slot). The draft (slots 40..42) ends inside block 2, so rewinding
    it leaves the blocks FullKV holds."""
    cells = [Eviction(r, LENGTH, t, capacity=CAP) for r in RULES for t in TIMINGS]
    cells += [Eviction(SnapKV(window=WINDOW), LENGTH, t, capacity=CAP, head_budget="adakv")
              for t in TIMINGS[:3]]  # fmt: skip
    cells += [Eviction(H2O(window=WINDOW), LENGTH, t, compact=False) for t in TIMINGS[:3]]
    big = LENGTH + NEW
    cells += [Eviction(SnapKV(window=4), big, Timing("decode"),
                       decode=DecodeCompression(budget=big, interval=4)),
              Eviction(H2O(window=4), big, Timing("dge", 2),
                       decode=DecodeCompression(budget=big, interval=4))]  # fmt: skip
    for ev, res in zip(cells, generate_grid(model, PROMPTS, cells, chunk=CHUNK, **INT4),
                       strict=True):  # fmt: skip
        assert res.tokens == full_int4.tokens, ev


def test_every_head_keeps_exactly_its_budget_on_int4(model, full_int4):
    budget = 12
    cells = [Eviction(r, budget, t, capacity=CAP) for r in RULES[:3:2] for t in TIMINGS[:3]]
    quant = generate_grid(model, PROMPTS, cells, chunk=CHUNK, **INT4)
    for ev, q in zip(cells, quant, strict=True):
        sizes = {len(h) for row in q.kept for layer in row for h in layer}
        assert sizes == {budget}, (ev, sizes)
    plain = generate(model, PROMPTS, max_new_tokens=NEW, chunk=CHUNK)
    assert plain.tokens != full_int4.tokens  # 4 bits really moved the answers here


def test_the_int4_cache_holds_int4(model):
    (quant,) = prefill_caches(model, PROMPTS, chunk=CHUNK, **INT4)
    k = quant.groups[0].k
    assert isinstance(k, Int4Entries) and k.q.dtype == jnp.uint8 and k.dtype == jnp.float32
    # per layer and kv head: D / 2 bytes per slot for k and v, their f32 scales and zeros
    # (k per group of 4 slots, v per group of 4 channels), an int32 position per slot, the
    # residual's R slots of D f32 for each and their two int32 starts
    layers, b, h, s, d = quant.num_layers, 2, 2, quant.capacity, model.config.head_dim
    packed, scales = 2 * s * (d // 2), 2 * 4 * ((s // G) * d + s * (d // G))
    per_head = packed + scales + 4 * s + 2 * (R * d * 4 + 4)
    assert quant.nbytes() == layers * b * h * per_head


def test_the_bounded_sliding_layout_holds_int4():
    """A sliding layer (window 16) of the bounded layout holds window + chunk slots of int4
    and moves its last 15 entries to the front before a step that would overflow (prefill's
    chunks and decode, `window_cache.make_room`): the move requantizes them in their new
    groups, so they read as the full layout's entries at the same positions within int4's
    error."""
    sliding = jax_model(jax_config(layer_windows=(16, 0)), seed=4)
    prompts = [np.random.default_rng(n).integers(0, 128, 64).tolist() for n in (1, 2)]
    caches = {}
    for layout in ("bounded", "full"):
        def hook(stage, fn, *args, layout=layout, **kwargs):
            out = fn(*args, **kwargs)
            if stage == "prefill":
                caches[layout] = jax.tree.map(jnp.copy, out.cache)  # decode donates it
            return out

        generate(sliding, prompts, chunk=16, sliding_cache=layout, hook=hook, **INT4)
    small, big = caches["bounded"], caches["full"]
    assert small.capacities[0] == 32 and small.kv_quant == KV_QUANT
    pos = np.asarray(small.groups[0].pos[0])
    assert pos.max() == 63 and pos[pos >= 0].min() >= 64 - 32
    k_small = np.asarray(dequantize(small.groups[0].k))[0]
    k_big = np.asarray(dequantize(big.groups[0].k))[0]
    # each valid slot of the bounded layer against the full layer's slot of its position
    big_pos = np.asarray(big.groups[0].pos[0])
    at = np.argmax(big_pos[..., None, :] == pos[..., :, None], axis=-1)  # [B, Hkv, 32]
    same = np.take_along_axis(k_big, at[..., None], axis=-2)
    valid = (pos >= 0)[..., None]
    scale = float(np.abs(k_big).max())
    np.testing.assert_allclose(np.where(valid, k_small, 0), np.where(valid, same, 0),
                               atol=0.2 * scale)  # fmt: skip
    assert np.abs(np.where(valid, k_small - same, 0)).max() > 0  # requantized: not exact


@pytest.mark.parametrize("s,n", [(32, 14), (150, 146)])
def test_window_attention_reads_int4_in_pieces_as_dequantized(s, n):
    """The rules' window attention on int4 keys read in 8 pieces (TPU's and GPU's
    `Backend.int4_pieces`; two passes, `ops._int4_window_sum`) equals it on the same keys
    dequantized whole (CPU's): 150 slots are five pieces of two 16-slot blocks, the last
    moved back over one the fourth read, and a 6-slot tail."""
    from dge_jax.rules.ops import window_attention_sum

    layer, rng = int4_layer(5, n, s=s)
    k = jax.tree.map(lambda x: x[1], layer.k)
    q = jnp.asarray(rng.standard_normal((2, 4, 3, 8)), jnp.float32)
    q_pos = jnp.asarray([[n - 3, n - 2, n - 1], [-1, n - 2, n - 1]], jnp.int32)
    weight = jnp.ones((2, 3), jnp.float32)
    run = jax.jit(window_attention_sum, static_argnums=5)
    got = run(k, layer.pos[1], q, q_pos, weight, 8)
    want = run(k, layer.pos[1], q, q_pos, weight, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # summation order only
    np.testing.assert_array_equal(want, run(jax.jit(dequantize)(k), layer.pos[1], q, q_pos,
                                            weight, 1))  # fmt: skip


@pytest.mark.parametrize("s,n", [(32, 14), (150, 146)])
def test_read_slots_in_pieces_reads_what_dequantize_reads(s, n):
    """Compaction's gather (`read_slots`) of int4 entries in 8 pieces picks, to the bit, what
    the whole dequantized layer holds at those slots: slots in every piece, the shared
    block of the moved-back last piece, the tail and the residual."""
    layer, rng = int4_layer(7, n, s=s)
    k = jax.tree.map(lambda x: x[1], layer.k)
    slots = jnp.asarray(rng.integers(0, s, (2, 2, 40)), jnp.int32)
    slots = slots.at[..., :3].set(jnp.asarray([0, s - 1, n - 1], jnp.int32))
    got = jax.jit(read_slots, static_argnums=2)(k, slots, 8)
    whole = jax.jit(dequantize)(k)
    np.testing.assert_array_equal(got, jnp.take_along_axis(whole, slots[..., None], axis=-2))
    np.testing.assert_array_equal(got, jax.jit(read_slots, static_argnums=2)(k, slots, 1))
