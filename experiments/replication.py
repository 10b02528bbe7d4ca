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

Folders of two or more models (`identity.model`) are judged model by model first (suites of
different models never add up), then across them: a claim "replicates on both models" (all
models given) in one direction, "on one model" (naming it), or "does not replicate".

Folders that differ in a cell setting (SnapKV's window, ties, draft weight, the adaptive
rule) hold different claims: `snapkv/dge/k3/b128 vs snapkv/prefill/b128 [window=32]` is
not evidence for the same comparison at window 8. The label names only the settings that
differ among the folders given, so a sweep at one setting keeps plain claim names.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from experiments.cells import cell_order
from experiments.run_folder import RULE_OPTIONS_KEY
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


# Identity keys that change what a cell *is* (its scoring or timing), as opposed to the suite
# it runs on (lengths, seed, answer prefix, data): folders differing here hold other claims.
# "context_protocol": a query-agnostic folder's claims are not a query-aware one's
SETTING_KEYS = (RULE_OPTIONS_KEY, "ties", "draft_weight", "adaptive", "context_protocol")


def model_verdict(entries: list[dict], alpha: float = SIGNIFICANT) -> str:
    """The verdict of one claim over folders of one or more models: `verdict` within each
    model, then whether it replicates on every model, on some, or on none."""
    by_model: dict[str, list[dict]] = defaultdict(list)
    for e in entries:
        by_model[e.get("model") or "?"].append(e)
    if len(by_model) == 1:
        return verdict(entries, alpha)
    per = {m: verdict(es, alpha) for m, es in by_model.items()}
    replicated = {m: v.split(" on ")[0].removeprefix("replicates: ")
                  for m, v in per.items() if v.startswith("replicates")}  # fmt: skip
    detail = "; ".join(f"{m}: {v}" for m, v in per.items())
    if len(set(replicated.values())) > 1:
        return f"contradicted across models ({detail})"
    if len(replicated) == len(per):
        return f"replicates on {'both' if len(per) == 2 else 'all'} models: " + next(
            iter(replicated.values())
        )
    if replicated:
        return f"on one model ({detail})" if len(replicated) == 1 else f"on some models ({detail})"
    return f"does not replicate ({detail})"


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One run folder's contribution: its suite, its identity and its paired comparisons
    (`experiments.report.paired_comparisons`, Holm-corrected within the folder)."""

    folder: str
    suite: str
    identity: dict[str, Any]
    comparisons: list[dict]


def settings(identity: dict[str, Any]) -> dict[str, Any]:
    """The identity's cell settings (scoring and timing), flattened: {"window": 8, "kernel":
    7, ..., "ties": ...}."""
    out: dict[str, Any] = {}
    for key in SETTING_KEYS:
        value = identity.get(key, "query_aware" if key == "context_protocol" else None)
        out.update(value if isinstance(value, dict) else {key: value})
    return out


def setting_labels(identities: Sequence[dict[str, Any]]) -> list[str]:
    """Per folder, the settings that differ among all the folders, e.g. "window=32" (empty
    where they agree), so claims of different settings are never pooled."""
    flat = [settings(i) for i in identities]
    keys = sorted({k for f in flat for k in f})
    differing = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    return [", ".join(f"{k}={f.get(k)}" for k in differing) for f in flat]


def replication(evidence: Iterable[Evidence]) -> list[dict]:
    """One entry per (claim, folder): claim, suite, folder, setting, n, wins, losses, effect,
    p, p_holm, and the claim's verdict over every folder that holds it."""
    evidence = list(evidence)
    by_claim: dict[str, list[dict]] = defaultdict(list)
    order: dict[str, tuple] = {}
    labels = setting_labels([e.identity for e in evidence])
    first_folder = {label: labels.index(label) for label in labels}  # settings in given order
    for ev, label in zip(evidence, labels, strict=True):
        for c in ev.comparisons:
            claim = f"{c['cell']} vs {c['baseline']}" + (f" [{label}]" if label else "")
            order[claim] = (first_folder[label], cell_order(c["cell"]),
                            cell_order(c["baseline"]))
            by_claim[claim].append({
                "claim": claim, "suite": ev.suite, "folder": str(ev.folder), "setting": label,
                "model": ev.identity.get("model"),
                "n": c["samples"], "wins": c["wins"], "losses": c["losses"],
                "effect": round(c["accuracy"] - c["baseline_accuracy"], 2),
                "p": c["p"], "p_holm": c["p_holm"],
            })
    out = []
    for claim in sorted(by_claim, key=order.__getitem__):
        entries = by_claim[claim]
        text = model_verdict(entries)
        out += [{**e, "verdict": text} for e in entries]
    return out


def replication_table(entries: list[dict]) -> str:
    """Markdown: claim | suite | run | n | wins/losses | effect | p (Holm) | verdict."""
    header = ["claim", "suite", "run", "n", "wins / losses", "effect (acc. points)",
              "p (Holm)", "verdict"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    models = {e.get("model") for e in entries}
    for e in entries:
        suite = e["suite"] + (f" ({e.get('model')})" if len(models) > 1 else "")
        lines.append("| " + " | ".join([
            e["claim"], suite, pathlib.Path(e["folder"]).name, str(e["n"]),
            f"{e['wins']} / {e['losses']}", f"{e['effect']:+.2f}", format_p(e["p_holm"]),
            e["verdict"]]) + " |")
    return "\n".join(lines) + "\n"


def replication_matrix(entries: list[dict]) -> str:
    """Markdown, one row per claim and one column per run folder (headed by its suite):
    "wins / losses, p (Holm)" in each, then the verdict: the form README quotes."""
    folders = list(dict.fromkeys(e["folder"] for e in entries))
    models = {e.get("model") for e in entries}
    suite_of = {e["folder"]: e["suite"] + (f" ({e.get('model')})" if len(models) > 1 else "")
                for e in entries}  # fmt: skip
    header = ["claim", *(f"{suite_of[f]}: {pathlib.Path(f).name}" for f in folders), "verdict"]
    by_claim: dict[str, dict[str, dict]] = defaultdict(dict)
    for e in entries:
        by_claim[e["claim"]][e["folder"]] = e
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for claim, per in by_claim.items():
        cells = [f"{per[f]['wins']} / {per[f]['losses']}, {format_p(per[f]['p_holm'])}"
                 if f in per else "-" for f in folders]
        verdict_text = next(iter(per.values()))["verdict"]
        lines.append("| " + " | ".join([claim, *cells, verdict_text]) + " |")
    return "\n".join(lines) + "\n"


def summary(entries: list[dict]) -> str:
    """One sentence per verdict kind: how many claims replicate, which."""
    verdicts = {e["claim"]: e["verdict"] for e in entries}
    replicated = sorted(c for c, v in verdicts.items() if v.startswith("replicates"))
    suites = sorted({e["suite"] for e in entries})
    models = sorted({str(e.get("model")) for e in entries})
    text = (f"**Replication.** {len(verdicts)} claims over {len(suites)} suite"
            f"{'s' if len(suites) > 1 else ''} ({', '.join(suites)}); a claim replicates when "
            f"it is significant after Holm's correction, with one sign, on at least "
            f"{REPLICATE_SUITES} suites. ")
    if len(models) > 1:
        both = sorted(c for c, v in verdicts.items() if v.startswith("replicates on"))
        one = sorted(c for c, v in verdicts.items() if v.startswith("on one model"))
        return text + (f"Judged on each of {len(models)} models ({', '.join(models)}): "
                       f"{len(both)} replicate on every model"
                       f"{': ' + '; '.join(both) if both else ''}; {len(one)} on one model only"
                       f"{': ' + '; '.join(one) if one else ''}; the rest do not.\n")
    if replicated:
        text += f"{len(replicated)} replicate: {'; '.join(replicated)}."
    else:
        text += "None replicates."
    return text + "\n"
