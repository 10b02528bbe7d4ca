"""Which paired comparisons replicate across independent suites.

    python -m experiments.report RUN_DIR RUN_DIR [...]

A *claim* is one comparison of two cells on the same samples (e.g. `snapkv/dge/k2/b128 vs
snapkv/prefill/b128`). Each run folder gives, for each claim it holds, n, wins / losses, the
accuracy difference and an exact McNemar p, Holm-corrected over all comparisons of that folder
(`report.paired_comparisons`). A claim *replicates* when it is significant after correction,
with the same sign, on at least two different suites (`identity.suite` of the folders:
synthetic, ruler, longbench); several folders of one suite (say, with and without an answer
prefix) are variants, not independent evidence. Everything else is stated as what it is: a
hypothesis (one suite), not significant, or contradicted (significant with opposite signs).
"""

from __future__ import annotations

import pathlib
from collections import defaultdict
from collections.abc import Iterable

from experiments.stats import format_p

REPLICATE_SUITES = 2  # significant, same sign, on this many different suites
SIGNIFICANT = 0.05  # family-wise level (Holm-corrected p), as in the report's summary


def verdict(entries: list[dict], alpha: float = SIGNIFICANT) -> str:
    """What the evidence of one claim across folders says, in words."""
    significant = [e for e in entries if e["p_holm"] < alpha and e["effect"] != 0]
    signs = {e["effect"] > 0 for e in significant}
    if len(signs) > 1:
        return "contradicted (significant with opposite signs)"
    suites = {e["suite"] for e in significant}
    if len(suites) >= REPLICATE_SUITES:
        direction = "better" if signs == {True} else "worse"
        return f"replicates: {direction} on {len(suites)} suites"
    if suites:
        tested = len({e["suite"] for e in entries})
        return (f"not replicated: significant on {next(iter(suites))} only "
                f"({tested} suite{'s' if tested > 1 else ''} tested)")
    return "not significant on any suite"


def replication(folders: Iterable[tuple[str, str, list[dict]]]) -> list[dict]:
    """One entry per (claim, folder) from (folder, suite, its paired comparisons) triples:
    claim, suite, folder, n, wins, losses, effect, p, p_holm, and the claim's verdict."""
    by_claim: dict[str, list[dict]] = defaultdict(list)
    for folder, suite, comparisons in folders:
        for c in comparisons:
            claim = f"{c['cell']} vs {c['baseline']}"
            by_claim[claim].append({
                "claim": claim, "suite": suite, "folder": str(folder), "n": c["samples"],
                "wins": c["wins"], "losses": c["losses"],
                "effect": round(c["accuracy"] - c["baseline_accuracy"], 2),
                "p": c["p"], "p_holm": c["p_holm"],
            })
    out = []
    for claim in sorted(by_claim):
        entries = by_claim[claim]
        text = verdict(entries)
        out += [{**e, "verdict": text} for e in entries]
    return out


def replication_table(entries: list[dict]) -> str:
    """Markdown: claim | suite | run | n | wins/losses | effect | p (Holm) | verdict."""
    header = ["claim", "suite", "run", "n", "wins / losses", "effect (acc. points)",
              "p (Holm)", "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for e in entries:
        lines.append("| " + " | ".join([
            e["claim"], e["suite"], pathlib.Path(e["folder"]).name, str(e["n"]),
            f"{e['wins']} / {e['losses']}", f"{e['effect']:+.2f}", format_p(e["p_holm"]),
            e["verdict"]]) + " |")
    return "\n".join(lines) + "\n"


def summary(entries: list[dict]) -> str:
    """One sentence per verdict kind: how many claims replicate, which."""
    verdicts = {e["claim"]: e["verdict"] for e in entries}
    replicated = sorted(c for c, v in verdicts.items() if v.startswith("replicates"))
    suites = sorted({e["suite"] for e in entries})
    text = (f"**Replication.** {len(verdicts)} claims over {len(suites)} suite"
            f"{'s' if len(suites) > 1 else ''} ({', '.join(suites)}); a claim replicates when "
            f"it is significant after Holm's correction, with one sign, on at least "
            f"{REPLICATE_SUITES} suites. ")
    if replicated:
        text += f"{len(replicated)} replicate: {'; '.join(replicated)}."
    else:
        text += "None replicates."
    return text + "\n"
