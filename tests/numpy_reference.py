"""Plain-NumPy pieces shared by the rule tests' references (written from the definitions,
never calling the code under test)."""

import numpy as np


def pool(x: np.ndarray, kernel: int, how: str) -> np.ndarray:
    """Slow obvious same-length pooling along the last axis: neighbours outside the array are
    padding (0 in the divisor's count for avg, nothing for max)."""
    half, n = kernel // 2, x.shape[-1]
    out = np.empty_like(x)
    for i in range(n):
        seg = x[..., max(0, i - half) : min(n, i + half + 1)]
        out[..., i] = seg.sum(-1) / kernel if how == "avg" else seg.max(-1)
    return out


def ref_snapkv_keep(k, pos, q, q_pos, budget, rule, groups):
    """One layer and row. k [Hkv, S, D], pos [Hkv, S] (-1 empty), q [Hq, W, D], q_pos [W]
    (-1: no query) -> keep [Hkv, S] bool: the protected entries (at or after the first
    observed query) plus the best of the rest by pooled mean attention, later wins ties."""
    live = q_pos >= 0
    q, q_pos = q[:, live].astype(np.float64), q_pos[live]
    keep = np.zeros(pos.shape, bool)
    for h in range(pos.shape[0]):
        valid = np.flatnonzero(pos[h] >= 0)
        order = valid[np.argsort(pos[h][valid])]  # slots in position order
        kp = pos[h][order]
        if len(order) <= budget:
            keep[h, order] = True
            continue
        keys = k[h][order].astype(np.float64)
        attn = []
        for g in range(groups):
            logits = q[h * groups + g] @ keys.T / np.sqrt(keys.shape[-1])  # [W, n]
            logits = np.where(kp[None, :] <= q_pos[:, None], logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            attn.append((p / p.sum(-1, keepdims=True)).mean(0))
        prefix = kp < q_pos.min()
        pooled = pool(np.stack(attn)[:, prefix], rule.kernel, rule.pooling).mean(0)
        n_free = budget - int((~prefix).sum())
        ranked = np.lexsort((-kp[prefix], -pooled))[:n_free]  # later position wins ties
        keep[h, order[~prefix]] = True
        keep[h, order[prefix][ranked]] = True
    return keep


def ref_compact(k, v, pos, keep, capacity):
    """NumPy compaction: each head's kept slots first, in position order; next slot = the
    layer's largest kept count."""
    nl, b, h, _, d = k.shape
    nk, nv = np.zeros((nl, b, h, capacity, d), k.dtype), np.zeros((nl, b, h, capacity, d), v.dtype)
    npos = np.full((nl, b, h, capacity), -1, np.int32)
    for idx in np.ndindex(nl, b, h):
        slots = np.flatnonzero(keep[idx])
        slots = slots[np.argsort(pos[idx][slots])]
        nk[idx][: len(slots)], nv[idx][: len(slots)] = k[idx][slots], v[idx][slots]
        npos[idx][: len(slots)] = pos[idx][slots]
    index = (npos >= 0).sum(-1).max(axis=(1, 2)).astype(np.int32)
    return nk, nv, npos, index
