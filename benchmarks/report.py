"""The report: the Markdown of a suite's results, and the results written as JSON + Markdown.

`markdown` puts one section after another (machine, figures per scenario, utilisation,
headline, prefill profile, grid, agreement, scenario (b)'s eviction, targets), each the
`_md_*` function of that section.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import numpy as np

from benchmarks.peers.peer_client import SETUP_COMMAND
from benchmarks.work import MIB

FIGURE_HEADER = [
    "prompt",
    "batch",
    "system",
    "method",
    "prefill tok/s",
    "TTFT s",
    "evict ms",
    "decode tok/s",
    "end-to-end s",
    "peak mem MiB",
    "cache MiB",
    "compile s (#)",
]

SCENARIO_NOTES = {
    "a": "dge_jax: per method a cold `generate` call, the first at its shapes, whose "
    "compilation (as JAX reports it) is compile s (#), then a warm call that gives every "
    "other figure (the FullKV call compiles the prefill, the SnapKV prefill call compiles "
    "it again with the observation window, dge(2) reuses that). Peers: one run each after "
    "a warm-up; kvpress at batch 1 only, as its pipeline runs. Peak mem: process RSS "
    "(dge_jax: the benchmark process, model and JAX included; peers: the peer process).",
    "b": "Every step compiled ahead of time; decode is the best of several runs; the "
    "compacted row's evict ms is select + compact.",
    "gpu": "Every step compiled ahead of time; decode is the best of several runs. attention: "
    "prefill's attention backend (xla: the library's blocked online softmax; cudnn: cuDNN "
    "flash attention, GPU only); decode steps run the XLA path under both, so compile s (#) "
    "is what that backend's pass compiled: the first compiles every step, a later one its "
    "prefill alone (JAX's compile cache holds the others: same functions and shapes).",
}


def markdown(result: dict) -> str:
    """The report: machine, figures per scenario, utilisation, grid, agreement, targets."""
    lines = _md_preamble(result)
    lines += _md_scenarios(result)
    if result.get("headline"):
        lines += _md_headline(result)
    if result.get("prefill_profile"):
        lines += _md_prefill_profile(result)
    if result.get("grid"):
        lines += _md_grid(result)
    if result.get("agreement"):
        lines += _md_agreement(result)
    if result.get("b_extras") and result["suite"] == "cpu":
        lines += _md_b_extras(result)
    if result.get("targets"):
        lines += _md_targets(result)
    return "\n".join(lines)


def write_results(result: dict, text: str, out: pathlib.Path, stem: str) -> None:
    """`out/<stem>.json` (the results) and `out/<stem>.md` (`text`, their Markdown)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=_json_default))
    (out / f"{stem}.md").write_text(text + "\n")


def _json_default(x):
    if isinstance(x, np.integer | np.floating):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _f(x, fmt: str = ".2f", scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, fmt)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def _md_preamble(result: dict) -> list[str]:
    """The title and the run's facts: command, date, machine, limits, peers, model."""
    m, lim = result["machine"], result["limits"]
    lines = [f"# Benchmarks: `{result['suite']}` suite ({result['size']})", ""]
    lines += [
        f"- command: `{result['command']}`",
        f"- date: {result['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; "
        f"{m['platform']} / {m['device_kind']}; jax {m['jax']}",
        f"- load average at start / end: {result['load_start']} / {result['load_end']}",
        f"- measured limits: matmul {lim['gflops']:.1f} GFLOP/s ({lim['matmul']['dtype']}, "
        f"n = {lim['matmul']['n']}), read bandwidth {lim['gb_s']:.1f} GB/s "
        f"(reduce {lim['bandwidth']['reduce_gb_s']:.1f}, matrix-vector "
        f"{lim['bandwidth']['gemv_gb_s']:.1f})",
        f"- memory column: {result['memory_kind']}",
        f"- wall time of the whole run: {result['wall_s'] / 60:.1f} min",
    ]
    if "peaks" in result:
        p = result["peaks"]
        lines.append(
            f"- peaks for utilisation: {p['gflops'] / 1e3:.3g} TFLOP/s, "
            f"{p['gb_s'] / 1e3:.2f} TB/s ({p['source']})"
        )
    peers = result.get("peers", {})
    if peers.get("available"):
        v = peers["versions"]
        lines.append(
            f"- peers: torch {v['torch']} ({v['torch_threads']} threads), transformers "
            f"{v['transformers']}, kvpress {v['kvpress']} (`{SETUP_COMMAND}`)"
        )
    elif peers:
        lines.append(f"- peers: not run ({peers.get('reason')})")
    if "model" in result:
        lines.append(
            f"- scenario (a) model: {result['model']['name']} "
            f"({result['model']['param_bytes'] / MIB:.0f} MiB of parameters)"
        )
    lines.append("")
    return lines


def _md_scenarios(result: dict) -> list[str]:
    """Per scenario: the figure table (dge_jax and the peers), its note, the utilisation."""
    lines: list[str] = []
    for scenario, title in _scenario_titles(result["plan"]).items():
        rows = [r for r in result["rows"] if r["scenario"] == scenario]
        if not rows:
            continue
        rows.sort(key=lambda r: (r["prompt_tokens"], r["batch"], r["system"] != "dge_jax"))
        lines += [f"## {title}", ""]
        header, cells = FIGURE_HEADER, [_figure_cells(r) for r in rows]
        if scenario == "gpu":  # one row per prefill attention backend
            header, cells = _with_attention(header, cells, rows, 4)
        lines += _table(header, cells, align="rrll" + "l" * (scenario == "gpu") + "r" * 8)
        lines += ["", SCENARIO_NOTES[scenario], ""]
        lines += _md_utilisation(scenario, [r for r in rows if r["system"] == "dge_jax"])
    return lines


def _scenario_titles(plan: dict) -> dict[str, str]:
    """The heading of each scenario's figure table."""
    return {
        "a": f"Scenario (a): {plan['model']}, {plan['new_tokens']} new tokens, SnapKV budget "
        f"{plan['budget']}",
        "b": f"Scenario (b): KV-dominated random weights ({plan['b_layers']} layers, 32/8 heads "
        f"x 128, hidden {plan['b_hidden']}), {plan['b_new_tokens']} new tokens, budget "
        f"{plan['b_budget']}",
        "gpu": f"GPU suite: Llama-3-8B attention geometry, {plan['b_layers']} layers, hidden "
        f"{plan['b_hidden']}, {plan['b_dtype']}, budget {plan['b_budget']}",
    }


def _with_attention(
    header: list[str], cells: list[list[str]], rows: list[dict], at: int
) -> tuple[list[str], list[list[str]]]:
    """`header` and `cells` with the rows' attention backend as column `at`."""
    cells = [c[:at] + [r.get("attention", "–")] + c[at:] for c, r in zip(cells, rows, strict=True)]
    return header[:at] + ["attention"] + header[at:], cells


def _figure_cells(r: dict) -> list[str]:
    """One row of a figure table."""
    return [
        str(r["prompt_tokens"]),
        str(r["batch"]),
        r["system"],
        r["method"],
        _f(r["prefill_tok_s"], ".0f"),
        _f(r["ttft_s"]),
        _f(r["evict_s"], ".1f", 1e3),
        _f(r["decode_tok_s"], ".1f"),
        _f(r["e2e_s"]),
        _f(r["peak_mem"], ".0f", 1 / MIB),
        _f(r["cache_bytes"], ".1f", 1 / MIB),
        "–" if r["compile_s"] is None else f"{r['compile_s']:.1f} ({r['compilations']})",
    ]


def _md_utilisation(scenario: str, ours: list[dict]) -> list[str]:
    """dge_jax's rows against the measured limits (and the GPU's peaks in the GPU suite)."""
    util_header = [
        "prompt",
        "batch",
        "method",
        "prefill GFLOP/s",
        "% of matmul peak",
        "decode GB/s",
        "% of bandwidth",
    ]
    util = [
        [
            str(r["prompt_tokens"]),
            str(r["batch"]),
            r["method"],
            _f(r["prefill_gflops"], ".1f"),
            _f(r["prefill_peak_frac"], ".0f", 100),
            _f(r["decode_gb_s"], ".1f"),
            _f(r["decode_bw_frac"], ".0f", 100),
        ]
        for r in ours
    ]
    align = "rrl"
    if scenario == "gpu":
        util_header += ["MFU %", "bandwidth util %"]
        for u, r in zip(util, ours, strict=True):
            u += [_f(r["mfu"], ".1f", 100), _f(r["bw_util"], ".1f", 100)]
        util_header, util = _with_attention(util_header, util, ours, 3)
        align = "rrll"
    lines = [f"dge_jax against the measured limits ({scenario}):", ""]
    lines += _table(util_header, util, align=align + "r" * (len(util_header) - len(align)))
    lines.append("")
    return lines


def _md_headline(result: dict) -> list[str]:
    """The headline: end-to-end seconds and their ratios."""
    lines: list[str] = []
    h = result["headline"]
    lines += [
        f"## Headline: end-to-end at {h['prompt_tokens']} tokens, batch {h['batch']} (warm, "
        "compile excluded)",
        "",
    ]
    lines += _table(["run", "end-to-end s"], [[k, _f(v)] for k, v in h["e2e_s"].items()])
    lines += [""] + _table(["ratio", "value"], [[k, _f(v, ".3f")]
                                               for k, v in h["ratios"].items()])  # fmt: skip
    lines.append("")
    return lines


def _md_prefill_profile(result: dict) -> list[str]:
    """Where the headline prefill's time goes."""
    lines: list[str] = []
    p = result["prefill_profile"]
    head = next(
        (r for r in result["rows"] if r["scenario"] == "a" and r["system"] == "dge_jax"
         and r["method"] == "FullKV" and r["prompt_tokens"] == p["tokens"] and r["batch"] == 1),
        None,
    )  # fmt: skip
    total = head["prefill_s"] if head else None
    other = total - p["linear_s"] - p["attention_s"] if total else None
    lines += [f"## Where the {p['tokens']}-token prefill's time goes (batch 1)", ""]
    lines += _table(
        ["part", "seconds", "GFLOP/s", "note"],
        [
            ["whole prefill (FullKV row above)", _f(total), _f(head and head["prefill_gflops"],
             ".1f"), "model FLOPs: linear + causal attention + LM head"],
            ["linear layers alone", _f(p["linear_s"]), _f(p["linear_gflops"], ".1f"),
             f"chunks of {p['chunk']} tokens"],
            ["chunked attention alone", _f(p["attention_s"]), _f(p["attention_gflops_done"],
             ".1f"), f"chunk i over its {p['chunk']}-key blocks 0..i: "
             f"{p['attention_flops_done'] / p['attention_flops_causal']:.2f}x causal FLOPs"],
            ["the rest", _f(other), "–", "norms, RoPE, cache writes, LM head"
             + (" (below 0: the parts timed alone, in other runs, add up to more than "
                "the whole; machine noise)" if other is not None and other < 0 else "")],
        ],
        align="lrrl",
    )  # fmt: skip
    lines.append("")
    return lines


def _md_grid(result: dict) -> list[str]:
    """The research grid against kvpress's cells one by one."""
    plan = result["plan"]
    lines: list[str] = []
    g = result["grid"]
    lines += [
        f"## Research grid: {g['cells']} cells on one {g['prompt_tokens']}-token prompt",
        "",
    ]
    lines += _table(
        ["system", "wall s", "prefill s", "draft s", "evict s", "decode s", "compile s (#)"],
        [
            [
                "dge_jax generate_grid (warm)",
                _f(g["warm_wall_s"]),
                _f(g["prefill_s"]),
                _f(g["draft_s"]),
                _f(g["evict_s"]),
                _f(g["decode_s"]),
                f"{g['compile_s']:.1f} ({g['compilations']})",
            ],
            [
                f"kvpress, {g.get('kvpress_cells', 0)} cells ({g.get('kvpress_runs', 0)} "
                "distinct runs x 3 timings)",
                _f(g.get("kvpress_total_s")),
                "–",
                "–",
                "–",
                "–",
                "–",
            ],
        ],
    )
    lines += [
        "",
        f"3 rules (SnapKV and PyramidKV with kvpress's window 64 / kernel 5 / avg-pool, "
        f"StreamingLLM with 4 sinks) x 3 timings (prefill, dge(2), dge_w(2)) x budgets "
        f"{', '.join(map(str, plan['grid_budgets']))}, {g['new_tokens']} new tokens each. "
        "dge_jax: one `generate_grid` call: one prefill, one draft, one scoring per "
        "(scorer, timing: SnapKV and PyramidKV share theirs) and a selection per budget, "
        "compacted cells sized per layer (PyramidKV's layers keep different counts) and "
        f"cells of one cache shape decoded as one batch ({g['decode_groups']} decode "
        "call(s)); compile s (#) from the cold call. kvpress (SnapKVPress, PyramidKVPress, "
        "StreamingLLMPress at the same budgets) has no draft timing, so the three timings of "
        "a (rule, budget) cell are one and the same run: each distinct run is timed once "
        "and counted three times."
        + (
            f" The evicted cells' caches hold {g['evicted_cache_bytes'] / 2**20:,.1f} MiB in "
            f"all ({g['one_capacity_cache_bytes'] / 2**20:,.1f} MiB if every layer had its "
            "cache's largest layer capacity)."
            if g.get("evicted_cache_bytes")
            else ""
        ),
        "",
    ]
    return lines


def _md_agreement(result: dict) -> list[str]:
    """Tokens and kept sets against transformers and kvpress."""
    lines: list[str] = []
    a = result["agreement"]
    fk, kv = a["fullkv"], a["kvpress"]
    lines += ["## Agreement", ""]
    lines.append(
        f"- FullKV tokens identical to transformers: {fk['identical']}/{fk['prompts']} prompts"
    )
    for d in fk["diverged"]:
        lines.append(
            f"  - {d['prompt']}: first divergence at token {d['step']} (ours "
            f"{d['ours']}, transformers {d['transformers']}; transformers' top-1 - "
            f"top-2 logit margin there {_f(d['transformers_margin'], '.4f')})"
        )
    lines.append(
        f"- SnapKV (kvpress preset, prefill) kept sets identical to kvpress: "
        f"{kv['kept_identical_heads']}/{kv['heads']} heads, "
        f"{kv['kept_identical_prompts']}/{kv['prompts']} prompts; tokens identical "
        f"on {kv['tokens_identical_prompts']}/{kv['prompts']}"
    )
    for d in kv["details"]:
        if d["heads_differing"] or not d["tokens_identical"]:
            first = d["first_differing_head"]
            where = "none" if first is None else "layer {}, kv head {}".format(*first)
            tokens = ("tokens identical" if d["token_divergence"] is None
                      else f"tokens diverge at step {d['token_divergence']}")  # fmt: skip
            lines.append(
                f"  - {d['prompt']}: {d['heads_differing']} head(s) differ (first: "
                f"{where}); {tokens}"
            )
            for h in d.get("differing_heads", []):
                lines.append(
                    f"    - layer {h['layer']}, kv head {h['head']}: kept only by dge_jax "
                    f"{h['only_ours']}, only by kvpress {h['only_theirs']}; kvpress's "
                    f"relative score gap at the budget boundary {_f(h['boundary_gap'], '.2e')}"
                )
    lines.append("")
    return lines


def _md_b_extras(result: dict) -> list[str]:
    """Scenario (b)'s eviction at decode time."""
    lines = ["## Scenario (b): eviction at decode time", ""]
    lines += _table(
        [
            "prompt",
            "batch",
            "select ms",
            "compact ms",
            "slots kept / capacity",
            "compacted MiB",
            "theoretical MiB",
            "decode speed-up",
        ],
        [
            [
                str(e["prompt_tokens"]),
                str(e["batch"]),
                _f(e["select_s"], ".1f", 1e3),
                _f(e["compact_s"], ".1f", 1e3),
                f"{e['kept_max']} / {e['compacted_capacity']}",
                _f(e["compacted_bytes"], ".2f", 1 / MIB),
                _f(e["theoretical_bytes"], ".2f", 1 / MIB),
                _f(e["decode_speedup"], ".2f"),
            ]
            for e in result["b_extras"]
        ],
    )
    lines.append("")
    return lines


def _md_targets(result: dict) -> list[str]:
    """The targets, met or missed."""
    lines = ["## Targets", ""]
    lines += _table(
        ["target", "value", "goal", "met", "detail"],
        [
            [
                t["name"],
                _f(t["value"], ".3f"),
                t["target"],
                {True: "yes", False: "**no**", None: "not measured"}[t["met"]],
                t["detail"],
            ]
            for t in result["targets"]
        ],
        align="lrlll",
    )
    lines.append("")
    return lines
