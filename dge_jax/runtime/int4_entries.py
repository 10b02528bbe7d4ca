"""KIVI's int4 cache entries (`quantized` module docstring): the stored form, quantizing
and dequantizing groups, the one write, and an empty cache's zeros. `quantized` dispatches
between this form, int8 and plain arrays; nothing else imports this module directly."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dge_jax.runtime.kv_quant import KVQuant

INT4_MAX = 15


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Entries:
    """Keys or values stored as KIVI's int4 (module docstring), for S slots of D channels:
    q [..., S, D // 2] uint8 (packed pairs; slots of the residual block and of the tail
    unused), scale and zero (keys [..., S // G, D], values [..., S, D // G]) in the
    activation dtype, resid [..., R, D] (the residual block, activation dtype) and start
    [...] int32 (its first slot, the same for every row and head of a layer; all leading
    axes kept so rows and heads split alike). keys, group (G), residual (R): static.
    q, scale and zero are stored with m rows merged into one of up to 128 lanes (`_merge`:
    [..., n / m, m * width], the same bytes); `logical` reads them one row a slot."""

    q: jax.Array
    scale: jax.Array
    zero: jax.Array
    resid: jax.Array
    start: jax.Array
    keys: bool = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))
    residual: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The entries' shape [..., S, D] (what a plain array of them would have)."""
        d = self.resid.shape[-1]
        return (*self.q.shape[:-2], self.q.shape[-2] * (self.q.shape[-1] // (d // 2)), d)

    def logical(self, name: str) -> jax.Array:
        """Leaf `name` ("q", "scale", "zero") with one row per slot (per key group for keys'
        scales and zeros), as `quantize_int4` makes it, whatever rows storage merged."""
        d = self.resid.shape[-1]
        width = {"q": d // 2, "scale": d if self.keys else d // self.group}
        return _unmerge(getattr(self, name), width.get(name, width["scale"]))

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype the entries are read in (the activation dtype)."""
        return self.resid.dtype

    @property
    def kv_quant(self) -> str:
        """The kv_quant string these entries were made by."""
        return KVQuant("int4", self.group, self.residual).name


def _grouped(x: jax.Array, keys: bool, group: int) -> jax.Array:
    """x [..., n, D] with its groups on their own axis: keys [..., n / G, G, D] (G slots per
    group), values [..., n, D / G, G] (G channels per group)."""
    *lead, n, d = x.shape
    if keys:
        return x.reshape(*lead, n // group, group, d)
    return x.reshape(*lead, n, d // group, group)


def _group_axis(keys: bool) -> int:
    return -2 if keys else -1


def quantize_int4(
    x: jax.Array, keys: bool, group: int, dtype: jnp.dtype | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., n, D] (n a multiple of G for keys) -> (q [..., n, D // 2] uint8 packed, scale,
    zero of `dtype`: keys [..., n / G, D], values [..., n, D / G]): KIVI's asymmetric 4 bits
    (module docstring). Scale and zero are rounded to their dtype before dividing, as
    `quantize_int8` does; a constant group gets scale 0 and q 0."""
    dtype = jnp.dtype(dtype or x.dtype)
    axis = _group_axis(keys)
    xg = _grouped(x.astype(jnp.float32), keys, group)
    lo, hi = jnp.min(xg, axis=axis, keepdims=True), jnp.max(xg, axis=axis, keepdims=True)
    scale = ((hi - lo) * jnp.float32(1 / INT4_MAX)).astype(dtype)
    zero = lo.astype(dtype)
    safe = jnp.where(scale == 0, 1, scale).astype(jnp.float32)
    q = jnp.clip(jnp.round((xg - zero.astype(jnp.float32)) / safe), 0, INT4_MAX)
    q = q.astype(jnp.uint8).reshape(x.shape)
    pairs = q.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed, jnp.squeeze(scale, axis), jnp.squeeze(zero, axis)


def dequantize_int4(
    q: jax.Array, scale: jax.Array, zero: jax.Array, keys: bool, group: int
) -> jax.Array:
    """`quantize_int4`'s packed q [..., n, D // 2] and its scale, zero -> x' [..., n, D] =
    q * scale + zero in the scale's dtype."""
    unpacked = jnp.stack([q & 0xF, q >> 4], axis=-1).reshape(*q.shape[:-1], 2 * q.shape[-1])
    axis = _group_axis(keys)
    s, z = jnp.expand_dims(scale, axis), jnp.expand_dims(zero, axis)
    x = _grouped(unpacked.astype(scale.dtype), keys, group) * s + z
    return x.reshape(unpacked.shape)


# TPU tiles an array's last dim in 128 lanes: int4's packed values (D / 2 bytes a slot) and
# values' scales (D / G a slot) would be padded there, and XLA lays a layer loop's carry out
# otherwise than the program's arguments, so the whole cache was copied padded (benchmarks/
# RESULTS.md, "An int4 cache (KIVI) compiled for TPU"). Stored leaves therefore merge m rows
# into one of m * width (a reshape of the same bytes, row-major): m the largest count of rows
# up to 128 lanes that divides the rows and the rows of a residual block (so a block's write
# covers whole stored rows). The stored last dim says m (`_unmerge`).
_LANES = 128


def _merge_factor(width: int, rows: int, unit: int) -> int:
    """Rows merged into one stored row: the largest m <= 128 // width dividing rows and unit."""
    return max(m for m in range(1, max(1, _LANES // width) + 1) if rows % m == 0 and unit % m == 0)


def _merge(x: jax.Array, unit: int) -> jax.Array:
    """x [..., n, W] (one row a slot, or a key group) stored as [..., n / m, m * W]."""
    *lead, n, w = x.shape
    m = _merge_factor(w, n, unit)
    return x.reshape(*lead, n // m, m * w)


def _unmerge(x: jax.Array, width: int) -> jax.Array:
    """A stored leaf [..., n / m, m * width] as [..., n, width] (`_merge` undone)."""
    *lead, rows, mw = x.shape
    return x.reshape(*lead, rows * (mw // width), width)


def _units(keys: bool, group: int, residual: int) -> tuple[int, int]:
    """Rows of a residual block in the packed values and in the scales and zeros."""
    return residual, (residual // group if keys else residual)


def quantize_int4_entries(
    x: jax.Array, index: jax.Array | int, like: KVQuant, keys: bool, dtype=None
) -> Int4Entries:
    """x [..., S, D] as `Int4Entries` whose layer has written slots [0, index): every whole
    block quantized, block index // R (or the tail) as the residual. index: an int or an
    array broadcasting to x's leading axes (one per layer: [Lg, 1, 1])."""
    dtype = jnp.dtype(dtype or x.dtype)
    g, r = like.group, like.residual
    *lead, slots, d = x.shape
    _check_int4(d, g)
    n = slots // r * r
    q, scale, zero = quantize_int4(x[..., :n, :], keys, g, dtype)
    # the store covers all S slots (the tail's and the residual's packed bytes unused)
    q = jnp.pad(q, ((0, 0),) * len(lead) + ((0, slots - n), (0, 0)))
    extra = (slots // g - n // g) if keys else slots - n
    scale, zero = (jnp.pad(a, ((0, 0),) * len(lead) + ((0, extra), (0, 0))) for a in (scale, zero))
    start = jnp.broadcast_to(jnp.asarray(index, jnp.int32) // r * r, lead)
    # The residual: block start // R of x padded to whole blocks (the tail, or empty slots)
    nb = n // r + 1
    padded = jnp.pad(x, ((0, 0),) * len(lead) + ((0, nb * r - slots), (0, 0))).astype(dtype)
    which = jnp.minimum(start // r, nb - 1)
    resid = jnp.take_along_axis(padded.reshape(*lead, nb, r, d),
                                which[..., None, None, None], axis=-3)[..., 0, :, :]  # fmt: skip
    uq, us = _units(keys, g, r)
    return Int4Entries(_merge(q, uq), _merge(scale, us), _merge(zero, us), resid, start,
                       keys=keys, group=g, residual=r)  # fmt: skip


def _check_int4(head_dim: int, group: int) -> None:
    """int4 packs channel pairs and groups values' channels by G: D even and a multiple of G."""
    if head_dim % 2 or head_dim % group:
        raise ValueError(
            f"kv_quant int4 with groups of {group} needs a head dim that is even and a multiple "
            f"of {group} (values are quantized per token in groups of {group} channels), got "
            f"{head_dim}: pick a group dividing it, e.g. 'int4-g{_divisor(head_dim, group)}'"
        )


def _divisor(d: int, below: int) -> int:
    """The largest even divisor of d not above `below` (2 if none), for the error above."""
    return max((g for g in range(2, below + 1, 2) if d % g == 0), default=2)


def write_int4(
    entries: Int4Entries, layer: jax.Array | int, slot: jax.Array | int, new: jax.Array
) -> tuple[Int4Entries, jax.Array]:
    """Layer `layer` of stacked entries [Lg, B, Hkv, S, D] with new [B, Hkv, T, D] written at
    slots [slot, slot + T); returns (the entries, new as read back once stored [B, Hkv, T,
    D] in new's dtype: full precision in the residual block, quantized in a block the write
    completes).

    The layer's next write slot is `slot` (its residual block starts at slot // R * R). The
    residual block and the T new entries form a window of 1 + ceil(T / R) whole blocks;
    each is quantized, and the complete ones (ending at or before slot + T and inside the
    store's whole blocks) are written into the packed store block by block; an incomplete
    block's slice (its start clamped into the store) writes back what the store holds, so
    a clamped start misplaces nothing. The new residual is the window's block of slot + T. Worked
    example, R = 4, slot 6, T = 3: the window is blocks 1, 2 (slots 4 .. 11, the residual's
    4, 5 then the new 6, 7, 8); block 1 ends at 8 <= 9: stored; block 2 holds slot 9, the
    next write: the new residual, start 8. Cost O((R + T) * D) per layer, whatever S."""
    e = entries
    g, r, keys = e.group, e.residual, e.keys
    slots, dtype = e.shape[-2], e.dtype
    b, h, t, d = new.shape
    nw = 1 + -(-t // r)  # blocks in the window
    start = slot // r * r
    window = jnp.concatenate([e.resid[layer], jnp.zeros((b, h, (nw - 1) * r, d), dtype)], axis=2)
    window = jax.lax.dynamic_update_slice_in_dim(window, new.astype(dtype), slot - start, axis=2)
    q, scale, zero = quantize_int4(window, keys, g, dtype)
    end = slot + t
    block = start // r + jnp.arange(nw)  # the window's block ids
    complete = ((block + 1) * r <= end) & (block < slots // r)

    def put(store, part, unit):
        # store [Lg, B, Hkv, X / m, m * Y] (rows merged, `_merge`); part [B, Hkv, nw * unit, Y]
        # (unit rows a block): each complete block written whole at layer by a
        # dynamic_update_slice, an incomplete one writes back what is there. Not a scatter:
        # its update window (rows, heads, lanes) made XLA lay a layer loop's carry out with
        # the rows second-minor, unlike the program's arguments, hence a copy of the store.
        m = store.shape[-1] // part.shape[-1]
        per = unit // m  # stored rows a block
        if slots // r == 0:  # no whole block: nothing is ever stored
            return store
        part = part.reshape(b, h, nw, per, store.shape[-1])
        for j in range(nw):
            at = jnp.minimum(block[j], slots // r - 1) * per  # in range; used if complete
            old = jax.lax.dynamic_slice(store, (layer, 0, 0, at, 0),
                                        (1, b, h, per, store.shape[-1]))  # fmt: skip
            new_rows = jnp.where(complete[j], part[None, :, :, j].astype(store.dtype), old)
            store = jax.lax.dynamic_update_slice(store, new_rows, (layer, 0, 0, at, 0))
        return store

    uq, us = _units(keys, g, r)
    new_start = end // r * r
    kept = jax.lax.dynamic_slice_in_dim(window, new_start - start, r, axis=2)
    stored = Int4Entries(
        q=put(e.q, q, uq), scale=put(e.scale, scale, us),
        zero=put(e.zero, zero, us), resid=e.resid.at[layer].set(kept),
        start=e.start.at[layer].set(new_start), keys=keys, group=g, residual=r,
    )  # fmt: skip
    # What the window reads back: complete blocks dequantized, the others as written
    read = dequantize_int4(q, scale, zero, keys, g).reshape(b, h, nw, r, d)
    read = jnp.where(complete[:, None, None], read, window.reshape(b, h, nw, r, d))
    read = jax.lax.dynamic_slice_in_dim(read.reshape(b, h, nw * r, d), slot - start, t, axis=2)
    return stored, read.astype(new.dtype)


def _per_layer(index, ndim: int) -> jax.Array:
    """index [Lg] (one per layer) as [Lg, 1, 1, ...] against [Lg, B, Hkv, ...] entries of
    `ndim` dims (the leading axes less S, D); an int or a scalar as it is."""
    index = jnp.asarray(index, jnp.int32)
    return index.reshape(index.shape + (1,) * (ndim - 2 - index.ndim)) if index.ndim else index


def _empty_int4(shape: tuple[int, ...], dtype, quant: KVQuant, keys: bool) -> Int4Entries:
    """Int4 zeros of `shape` [..., S, D] that wrote nothing: every leaf zeros, equal to
    `quantize_int4_entries` of zeros at index 0 (scale 0, zero 0, q 0, start 0) without its
    dense temporaries (a whole cache of them in prefill, which builds the cache under jit)."""
    *lead, slots, d = shape
    g, r = quant.group, quant.residual
    _check_int4(d, g)
    uq, us = _units(keys, g, r)
    n, w = (slots // g, d) if keys else (slots, d // g)  # scales' rows and width

    def zeros(rows, width, unit, dt):  # stored with rows merged (`_merge`)
        m = _merge_factor(width, rows, unit)
        return jnp.zeros((*lead, rows // m, m * width), dt)

    return Int4Entries(
        q=zeros(slots, d // 2, uq, jnp.uint8), scale=zeros(n, w, us, dtype),
        zero=zeros(n, w, us, dtype), resid=jnp.zeros((*lead, r, d), dtype),
        start=jnp.zeros(lead, jnp.int32), keys=keys, group=g, residual=r,
    )  # fmt: skip
