"""`kernels.flash_int4`: prefill attention that unpacks an int4 cache's stored bytes in VMEM
(Pallas interpret mode on CPU) equals the XLA path's attention over the dequantized layer,
and compiles through Mosaic for a v5e without one.

The layers are `test_flash_decode_int4`'s (KIVI's defaults, head dims 128 and 256, the
residual block inside the whole blocks or as the tail, evicted holes, left padding), read by
a chunk of queries: causal within it, a sliding window, unwritten slots past num_slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kv_quant_checks import assert_pallas_is_xla
from test_flash_decode_int4 import _v5e_devices, int4_layer

from dge_jax.kernels import flash_int4, flash_int4_sums, int4_tiles, layer_attention
from dge_jax.kernels.attention import (
    AttentionSpec,
    LayerCache,
    NewEntries,
    ScoreSpec,
    Tiles,
    written_slot_attention,
)
from dge_jax.kernels.flash_int4 import int4_flash_attention
from dge_jax.runtime.quantized import KVQuant, quantize_int4_entries

CASES = [  # (s, n, d, t, window, block_q, in_place)
    (300, 200, 128, 70, None, 512, False),  # residual [128, 256) inside, a tail of 44
    (300, 200, 128, 70, None, 512, True),  # the same, the stack read in place
    (300, 290, 128, 130, None, 128, False),  # the residual is the tail; two query tiles
    (1100, 1024, 128, 200, None, 128, True),  # three key blocks of 512, the last one partial
    (640, 400, 256, 40, None, 512, False),  # head dim 256: one slot a stored row
    (300, 200, 128, 70, 50, 512, True),  # a sliding window
]


@pytest.mark.parametrize("s,n,d,t,window,block_q,in_place", CASES)
def test_the_kernel_reads_what_the_xla_path_reads(s, n, d, t, window, block_q, in_place,
                                                  monkeypatch):  # fmt: skip
    """A chunk of t queries ending at slot n (num_slots n: the slots past it unread) against
    `written_slot_attention` over the dequantized layer; in_place: the stacked bytes read at
    the layer index (a large stack), else the layer sliced out first (`SLICED_BELOW`)."""
    monkeypatch.setattr(int4_tiles, "SLICED_BELOW", 0 if in_place else 2**62)
    layer, rng = int4_layer(s + n + d + t, s, n, d, window=None if window is None else
                            jnp.int32(window))  # fmt: skip
    q = jnp.asarray(rng.standard_normal((2, t, 4, d)), jnp.float32)
    query_pos = jnp.asarray(np.arange(n - t, n), jnp.int32)[None].repeat(2, axis=0)
    query_pos = query_pos.at[0, :3].set(-1)  # left padding among the queries
    scores = ScoreSpec(scale=0.7 / np.sqrt(d))
    tiles = Tiles(block_q=block_q, interpret=True)
    spec = AttentionSpec(scores=scores, record_attn=True)
    got, sums = jax.jit(int4_flash_attention, static_argnums=(4, 5))(q, query_pos, layer, n,
                                                                      spec, tiles)  # fmt: skip
    xla = AttentionSpec(128, attention="xla", scores=scores, record_attn=True)
    want, want_sums = written_slot_attention(q, query_pos, layer, n, xla)
    real = np.asarray(query_pos)[..., None, None] >= 0  # padding rows differ (flash: zeros)
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0),
                               rtol=2e-5, atol=2e-5)  # fmt: skip
    # H2O's prob sums: every slot's, packed, residual block and tail alike (padding rows
    # contribute nothing to either)
    np.testing.assert_allclose(sums, want_sums, rtol=2e-5, atol=2e-5)
    first = int(layer.k.start[1, 0, 0])  # the residual block's written slots are among them
    written = np.arange(first, min(first + layer.k.residual, n))
    assert written.size == 0 or np.asarray(sums)[..., written].max() > 0


@pytest.mark.parametrize("record", [False, True])
@pytest.mark.parametrize("slot,t", [(200, 56), (100, 190)])
def test_a_prefill_chunk_through_the_layer_attention(slot, t, record, monkeypatch):
    """`cache_layer_attention`'s prefill chunk, attention "pallas", on an int4 layer the
    kernel reads: the chunk's entries written first (slot 200 + 56 completes the residual
    block [128, 256); 100 + 190 completes [0, 128) and [128, 256) and leaves 290 in the
    tail), then read, as "xla" reads them, and the same cache written; record: H2O's prob
    sums too (`flash_int4_sums` beside the kernel, not the layer dequantized)."""
    layer, rng = int4_layer(slot + t, 300, slot, 128)
    k_new, v_new = (jnp.asarray(rng.standard_normal((2, 2, t, 128)), jnp.float32) for _ in "kv")
    pos_new = jnp.broadcast_to(jnp.arange(slot, slot + t, dtype=jnp.int32), (2, 2, t))
    layer = layer._replace(slot=slot)
    q = jnp.asarray(rng.standard_normal((2, t, 4, 128)), jnp.float32)
    traced = []
    monkeypatch.setattr(flash_int4, "bytes_probs_sums", lambda *a: (
        traced.append(1) or flash_int4_sums.bytes_probs_sums(*a)))  # fmt: skip
    assert_pallas_is_xla(q, NewEntries(k_new, v_new, pos_new), layer, 64, record, rtol=1e-5)
    assert bool(traced) == record


def test_a_soft_capped_bf16_layer():
    """bf16 entries and scales (the dtype they are stored in on TPU) and Gemma 2's soft cap."""
    layer, rng = int4_layer(5, 640, 600, 128, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, 100, 4, 128)), jnp.bfloat16)
    query_pos = jnp.asarray(np.arange(500, 600), jnp.int32)[None].repeat(2, axis=0)
    scores = ScoreSpec(softcap=5.0)
    got, _ = int4_flash_attention(q, query_pos, layer, 600, AttentionSpec(scores=scores),
                                  Tiles(block_q=128))  # fmt: skip
    xla = AttentionSpec(128, attention="xla", scores=scores)
    want, _ = written_slot_attention(q, query_pos, layer, 600, xla)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


@pytest.mark.parametrize("b,s,d,t,record,group", [
    (72, 1024, 128, 512, False, 32), (2, 300, 128, 300, False, 32), (2, 640, 256, 256, False, 32),
    (72, 1024, 128, 512, True, 32), (2, 640, 256, 256, True, 32), (24, 4096, 128, 512, True, 128),
])  # fmt: skip
def test_it_compiles_for_a_v5e(b, s, d, t, record, group):
    """Mosaic lowers the kernel (the nibbles, the lane matrices, the transposed value scales,
    the rolls) for a v5e chip at bf16 with its default tiles: Llama-8B's rows a device at 72
    rows on a v5e-8 (4 query heads on 1 kv head: query tiles of 512 rows overflowed the
    scoped VMEM there), key blocks of whole tiles whatever the capacity, head dims 128 and
    256; record: with H2O's prob sums, the keys-major kernel beside it; group: G = 128's
    2,048-slot key blocks, with shorter query tiles (at 256 rows they overflowed the VMEM)
    (libtpu needed: the tpu-aot extra)."""
    on = jax.sharding.SingleDeviceSharding(_v5e_devices()[0])
    quant = KVQuant("int4", group, 128)

    def entries(keys):
        x = jax.ShapeDtypeStruct((2, b, 1, s, d), jnp.bfloat16)
        return jax.eval_shape(lambda x: quantize_int4_entries(
            x, jnp.full((2, 1, 1), s * 2 // 3, jnp.int32), quant, keys), x)  # fmt: skip

    pos = jax.ShapeDtypeStruct((2, b, 1, s), jnp.int32)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on),
                            (entries(True), entries(False), pos))  # fmt: skip
    q = jax.ShapeDtypeStruct((b, t, 4, d), jnp.bfloat16, sharding=on)
    qpos = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=on)

    def chunk(q, qpos, k, v, pos):
        return int4_flash_attention(q, qpos, LayerCache(k, v, pos, 1, 0, None), s,
                                    AttentionSpec(record_attn=record))  # fmt: skip

    compiled = jax.jit(chunk).lower(q, qpos, *abstract).compile()
    # the int4 kernel and flash's over the residual block; with prob sums, both sums kernels
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 2 + 2 * record


@pytest.mark.parametrize("record", [False, True])
def test_it_compiles_for_a_v5e_under_a_mesh(record):
    """A prefill chunk of an int4 layer on a 1 x 2 v5e mesh (deviceless), through
    `cache_layer_attention`: the shard_map takes the int4 entries' leaves and the Mosaic
    kernels (the int4 one, and the flash kernel over the residual block; record: both sums
    kernels too, the sums split as the rows and heads) compile."""
    import dge_jax

    devices = _v5e_devices()
    mesh = dge_jax.distribution.sharding.make_mesh(1, 2, devices=devices[:2])
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    layer, _ = int4_layer(0, 1024, 500, 128, jnp.bfloat16)
    layer = LayerCache(layer.k, layer.v, layer.pos, jnp.int32(1), jnp.int32(500), jnp.int32(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                            layer)  # fmt: skip
    new = NewEntries(*(jax.ShapeDtypeStruct(shape, dtype, sharding=where)
                       for shape, dtype in (((2, 2, 256, 128), jnp.bfloat16),
                                            ((2, 2, 256, 128), jnp.bfloat16),
                                            ((2, 2, 256), jnp.int32))))  # fmt: skip
    q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16, sharding=where)
    qpos = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=where)
    with jax.set_mesh(mesh):
        hlo = jax.jit(layer_attention.cache_layer_attention, static_argnums=4).lower(
            q, qpos, new, abstract, AttentionSpec(512, record_attn=record, attention="pallas"),
        ).compile().as_text()  # fmt: skip
    assert hlo.count('custom_call_target="tpu_custom_call"') == 2 + 2 * record


@pytest.mark.parametrize("first,n", [(128, 256), (256, 256)])
def test_the_residual_and_tail_sums_land_in_their_slots(first, n):
    """`_placed` on hand-made sums, S = 300, R = 128: the residual block's R sums go to
    [first, first + R) (as the tail, first = n: its slots past S dropped) and the tail's
    S - n to [n, S), added to the packed slots' (zero there)."""
    from dge_jax.kernels.flash_int4 import _placed

    s_len, r = 300, 128
    packed = np.arange(s_len, dtype=np.float32)[None, None] + 1000
    packed[..., first : first + r] = 0
    packed[..., n:] = 0
    rest = np.concatenate([np.full(r, 7.0), np.full(s_len - n, 3.0)]).astype(np.float32)
    got = np.asarray(_placed(jnp.asarray(packed), jnp.asarray(rest[None, None]),
                             jnp.int32(first), n, r))[0, 0]  # fmt: skip
    want = packed[0, 0].copy()
    want[first : min(first + r, s_len)] += 7
    want[n:] += 3
    np.testing.assert_array_equal(got, want)
