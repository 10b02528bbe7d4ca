"""Agreement: FullKV tokens vs transformers, SnapKV-preset kept positions and tokens vs kvpress.

`agreement` pairs scenario (a)'s warm dge_jax results with the peers' results of the same
prompts; `fullkv_agreement` and `kept_agreement` compare the pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.plans import Plan


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def fullkv_agreement(pairs: list[dict]) -> dict:
    """pairs: {"label", "ours", "theirs", "margins"}; identical fraction and divergences."""
    diverged = []
    for p in pairs:
        i = first_divergence(p["ours"], p["theirs"])
        if i is not None:
            margin = p["margins"][i] if i < len(p["margins"]) else None
            diverged.append(
                {
                    "prompt": p["label"],
                    "step": i,
                    "ours": p["ours"][i],
                    "transformers": p["theirs"][i],
                    "transformers_margin": margin,
                }
            )
    n = len(pairs)
    return {
        "prompts": n,
        "identical": n - len(diverged),
        "fraction": (n - len(diverged)) / n if n else None,
        "diverged": diverged,
    }


def kept_agreement(pairs: list[dict]) -> dict:
    """pairs: {"label", "ours_kept" [L][H][pos], "theirs_kept", "ours", "theirs" (tokens),
    "theirs_gap" [L][H] or None: kvpress's relative score gap at the budget boundary}.

    A differing head whose gap is tiny (~1e-6, float rounding) is a near-tie that summation
    order can flip; the details list each differing head with its gap."""
    heads = same_heads = same_prompts = same_tokens = 0
    details = []
    for p in pairs:
        ours, theirs = p["ours_kept"], p["theirs_kept"]
        diff = [
            (layer, h)
            for layer, (a, b) in enumerate(zip(ours, theirs, strict=True))
            for h, (x, y) in enumerate(zip(a, b, strict=True))
            if sorted(x) != sorted(y)
        ]
        n_heads = sum(len(a) for a in ours)
        heads += n_heads
        same_heads += n_heads - len(diff)
        same_prompts += not diff
        tokens_equal = p["ours"] == p["theirs"]
        same_tokens += tokens_equal
        details.append(
            {
                "prompt": p["label"],
                "heads_differing": len(diff),
                "first_differing_head": diff[0] if diff else None,
                "differing_heads": [
                    {
                        "layer": layer,
                        "head": h,
                        "boundary_gap": p["theirs_gap"][layer][h] if p.get("theirs_gap") else None,
                        "only_ours": sorted(set(ours[layer][h]) - set(theirs[layer][h]))[:8],
                        "only_theirs": sorted(set(theirs[layer][h]) - set(ours[layer][h]))[:8],
                    }
                    for layer, h in diff[:8]
                ],  # fmt: skip
                "tokens_identical": tokens_equal,
                "token_divergence": first_divergence(p["ours"], p["theirs"]),
            }
        )
    n = len(pairs)
    return {
        "prompts": n,
        "kept_identical_prompts": same_prompts,
        "heads": heads,
        "kept_identical_heads": same_heads,
        "tokens_identical_prompts": same_tokens,
        "details": details,
    }


def agreement(plan: Plan, a_results: dict, res: dict) -> dict:
    """FullKV tokens vs transformers; SnapKV (kvpress preset, prefill) vs kvpress."""
    full_pairs, kept_pairs = [], []
    for (tokens, batch), results in a_results.items():
        r = res.get(f"a/{tokens}/{batch}/transformers")
        if r is not None:
            for row in range(batch):
                full_pairs.append(
                    {
                        "label": f"{tokens} tokens, batch {batch}, row {row}",
                        "ours": results["FullKV"].tokens[row],
                        "theirs": r["tokens"][row],
                        "margins": r["margins"][row],
                    }
                )
    widest = {}
    for tokens, batch in plan.a_configs:
        widest[tokens] = max(widest.get(tokens, 0), batch)
    for tokens, batch in widest.items():
        snap = a_results[(tokens, batch)]["SnapKV prefill"]
        for row in range(batch):
            r = res.get(f"a/{tokens}/p{row}/kvpress")
            if r is None or "kept" not in r:
                continue
            kept_pairs.append(
                {
                    "label": f"{tokens} tokens, prompt {row}",
                    "ours": snap.tokens[row],
                    "theirs": r["tokens"][0],
                    "ours_kept": snap.kept[row],
                    "theirs_kept": r["kept"][0],
                    "theirs_gap": (r.get("boundary_gap") or [None])[0],
                }
            )
    return {"fullkv": fullkv_agreement(full_pairs), "kvpress": kept_agreement(kept_pairs)}
