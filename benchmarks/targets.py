"""The headline ratios and the targets (`plans.TARGETS`), met or missed, from a suite's results."""

from __future__ import annotations

from benchmarks.plans import A_METHODS, TARGETS, Plan
from benchmarks.work import MIB


def _find(rows, **match) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _target(name: str, value, goal: str, met, detail: str = "") -> dict:
    return {
        "name": name,
        "value": value,
        "target": goal,
        "met": None if value is None else bool(met),
        "detail": detail,
    }


def headline(plan: Plan, rows: list[dict]) -> dict:
    """End-to-end seconds (warm calls, compile excluded) at the headline configuration, one
    prompt, batch 1, and the ratios the targets read."""
    tokens, batch = plan.headline
    runs = [("dge_jax", m) for m in A_METHODS]
    runs += [("transformers", "FullKV"), ("kvpress", "SnapKVPress prefill")]
    e2e = {}
    for system, method in runs:
        r = _find(rows, scenario="a", system=system, method=method, prompt_tokens=tokens,
                  batch=batch)  # fmt: skip
        e2e[f"{system} {method}"] = r["e2e_s"] if r else None

    def ratio(a: str, b: str) -> float | None:
        return e2e[a] / e2e[b] if e2e[a] and e2e[b] else None

    return {
        "prompt_tokens": tokens,
        "batch": batch,
        "e2e_s": e2e,
        "ratios": {
            "dge(2) / kvpress SnapKV": ratio("dge_jax SnapKV dge(2)",
                                             "kvpress SnapKVPress prefill"),
            "dge(2) / transformers FullKV": ratio("dge_jax SnapKV dge(2)", "transformers FullKV"),
            "SnapKV prefill / kvpress SnapKV": ratio("dge_jax SnapKV prefill",
                                                     "kvpress SnapKVPress prefill"),
            "FullKV / transformers FullKV": ratio("dge_jax FullKV", "transformers FullKV"),
        },
    }  # fmt: skip


def targets(plan: Plan, out: dict, limits: dict) -> list[dict]:
    """Every target this plan can measure, met or missed (None: not measured)."""
    rows, t = out["rows"], []
    if plan.a_configs:
        t.append(_prefill_target(plan, rows, limits))
        t += _e2e_targets(plan, out)
        t.append(_grid_target(out))
        t.append(_batch_target(plan, rows))
        t += _agreement_targets(out)
    if plan.b_configs:
        t += _b_targets(plan, out)
    return t


def _prefill_target(plan: Plan, rows: list[dict], limits: dict) -> dict:
    """Scenario (a)'s FullKV prefill against the measured matmul peak."""
    head_t, head_b = plan.headline
    full = _find(
        rows,
        scenario="a",
        system="dge_jax",
        method="FullKV",
        prompt_tokens=head_t,
        batch=head_b,
    )
    frac = full["prefill_peak_frac"] if full else None
    return _target(
        f"prefill >= 70 % of matmul peak ({head_t} tokens)",
        frac,
        ">= 0.70",
        frac is not None and frac >= TARGETS["prefill_peak_frac"],
        f"{full['prefill_gflops']:.1f} of {limits['gflops']:.1f} GFLOP/s" if full else "",
    )


def _e2e_targets(plan: Plan, out: dict) -> list[dict]:
    """dge(2)'s end-to-end time against kvpress's and transformers' (the headline)."""
    t, (head_t, head_b) = [], plan.headline
    head = out.get("headline", {"e2e_s": {}, "ratios": {}})
    ours = head["e2e_s"].get("dge_jax SnapKV dge(2)")
    for peer, key, theirs_key in (
        ("kvpress", "e2e_vs_kvpress", "kvpress SnapKVPress prefill"),
        ("transformers", "e2e_vs_transformers", "transformers FullKV"),
    ):
        theirs = head["e2e_s"].get(theirs_key)
        ratio = ours / theirs if theirs and ours else None
        t.append(
            _target(
                f"end-to-end dge(2) / {peer} ({head_t} tokens, batch {head_b})",
                ratio,
                "<= 0.9",
                ratio is not None and ratio <= TARGETS[key],
                f"{ours:.2f} s vs {theirs:.2f} s" if ratio else "",
            )
        )
    return t


def _grid_target(out: dict) -> dict:
    """The research grid: kvpress's time over dge_jax's."""
    grid = out.get("grid", {})
    speed = grid["kvpress_total_s"] / grid["warm_wall_s"] if grid.get("kvpress_total_s") else None
    return _target(
        f"grid of {grid.get('cells')} cells: kvpress time / dge_jax time",
        speed,
        ">= 10",
        speed is not None and speed >= TARGETS["grid_speedup"],
        f"{grid.get('kvpress_total_s', 0):.1f} s vs {grid['warm_wall_s']:.1f} s" if speed else "",
    )


def _batch_target(plan: Plan, rows: list[dict]) -> dict:
    """dge(2)'s decode tokens/s at the widest batch against batch 1."""
    head_t, _ = plan.headline
    batches = sorted({b for t_, b in plan.a_configs if t_ == head_t})
    one = _find(
        rows,
        scenario="a",
        system="dge_jax",
        method="SnapKV dge(2)",
        prompt_tokens=head_t,
        batch=1,
    )
    many = _find(
        rows,
        scenario="a",
        system="dge_jax",
        method="SnapKV dge(2)",
        prompt_tokens=head_t,
        batch=batches[-1],
    )
    ratio = many["decode_tok_s"] / one["decode_tok_s"] if one and many and many is not one else None
    return _target(
        f"batch {batches[-1]} / batch 1 decode tokens/s (dge(2), {head_t})",
        ratio,
        ">= 3",
        ratio is not None and ratio >= TARGETS["batch_decode_ratio"],
    )


def _agreement_targets(out: dict) -> list[dict]:
    """FullKV tokens vs transformers, kvpress-preset kept sets vs kvpress."""
    t = []
    agree = out.get("agreement", {})
    fk = agree.get("fullkv", {})
    t.append(
        _target(
            "FullKV tokens identical to transformers",
            fk.get("fraction"),
            ">= 0.95",
            (fk.get("fraction") or 0) >= TARGETS["fullkv_agreement"],
            f"{fk.get('identical')}/{fk.get('prompts')} prompts",
        )
    )
    kv = agree.get("kvpress", {})
    n = kv.get("prompts")
    value = kv["kept_identical_heads"] / kv["heads"] if n else None
    t.append(
        _target(
            "kvpress-preset kept sets identical to kvpress",
            value,
            "= 1",
            value == 1.0,
            f"{kv.get('kept_identical_heads')}/{kv.get('heads')} "
            f"heads, {kv.get('kept_identical_prompts')}/{n} prompts; tokens "
            f"identical on {kv.get('tokens_identical_prompts')}/{n}"
            if n
            else "",
        )
    )
    return t


def _b_targets(plan: Plan, out: dict) -> list[dict]:
    """Scenario (b): compacted decode speed and compacted cache bytes."""
    t = []
    bt, bb = plan.b_target
    ex = next((e for e in out["b_extras"] if (e["prompt_tokens"], e["batch"]) == (bt, bb)), None)
    speed = ex["decode_speedup"] if ex else None
    t.append(
        _target(
            f"(b) compacted / full decode speed ({bt} tokens, batch {bb}, budget {plan.b_budget})",
            speed,
            ">= 3",
            speed is not None and speed >= TARGETS["b_decode_speedup"],
        )
    )
    over = ex["compacted_bytes"] / ex["theoretical_bytes"] - 1 if ex else None
    t.append(
        _target(
            "(b) compacted cache bytes over theoretical",
            over,
            "<= 10 %",
            over is not None and over <= TARGETS["b_cache_overhead"],
            f"{ex['compacted_bytes'] / MIB:.2f} MiB vs {ex['theoretical_bytes'] / MIB:.2f} MiB"
            if ex
            else "",
        )
    )
    return t
