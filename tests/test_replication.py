"""`experiments.replication` and `python -m experiments.report DIR DIR ...`: which claims hold
on two independent suites, on hand-made run folders."""

import json

import pytest

from experiments import replication, report
from experiments.predictions import PREDICTIONS_FILE
from experiments.run_folder import open_run
from experiments.stats import format_p, mcnemar_exact

BASE, DGE = "snapkv/prefill/b16", "snapkv/dge/k2/b16"
CLAIM = f"{DGE} vs {BASE}"


def make_folder(path, suite, dge_right, base_right, n=14, window=8, **identity):
    """A run folder of `suite` where DGE is right on the first `dge_right` samples and the
    baseline on the first `base_right` (so the wins/losses are their difference)."""
    extent = {"datasets": ["passkey"], "cells": [BASE, DGE], "num_samples": n}
    identity = {"suite": suite, "policy_options": {"window": window, "kernel": 7},
                "ties": "later", **identity}
    open_run(path, identity, {"passkey": "sha"}, extent, "test")
    lines = []
    for i in range(n):
        for cell, right in ((BASE, i < base_right), (DGE, i < dge_right)):
            lines.append({"key": f"{cell}|{i}", "config_hash": cell, "dataset": "passkey",
                          "sample_id": f"s{i}", "cell": cell, "pred": "1" if right else "x",
                          "answers": ["1"], "all_classes": None})
    (path / PREDICTIONS_FILE).write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def verdict_of(tmp_path, *folders):
    entries = replication.replication(report.folder_comparisons(f) for f in folders)
    (text,) = {e["verdict"] for e in entries if e["claim"] == CLAIM}
    return text, [e for e in entries if e["claim"] == CLAIM]


def test_significant_on_two_suites_replicates(tmp_path):
    a = make_folder(tmp_path / "a", "synthetic", dge_right=12, base_right=0)
    b = make_folder(tmp_path / "b", "ruler", dge_right=11, base_right=0)
    text, entries = verdict_of(tmp_path, a, b)
    assert text == "replicates: better on 2 suites"
    by_suite = {e["suite"]: e for e in entries}
    assert (by_suite["synthetic"]["wins"], by_suite["synthetic"]["losses"]) == (12, 0)
    assert by_suite["ruler"]["n"] == 14 and by_suite["ruler"]["effect"] == pytest.approx(
        100 * 11 / 14, abs=0.01)
    # One comparison per folder here, so Holm leaves p as it is.
    assert by_suite["ruler"]["p_holm"] == mcnemar_exact(11, 0)


def test_one_suite_is_a_hypothesis_and_variants_of_it_are_not_independent(tmp_path):
    a = make_folder(tmp_path / "a", "synthetic", dge_right=12, base_right=0)
    b = make_folder(tmp_path / "b", "synthetic", dge_right=12, base_right=0)
    c = make_folder(tmp_path / "c", "longbench", dge_right=2, base_right=1)
    assert verdict_of(tmp_path, a, b)[0] == (
        "not replicated: significant on synthetic only (1 suite tested)")
    assert verdict_of(tmp_path, a, c)[0] == (
        "not replicated: significant on synthetic only (2 suites tested)")
    assert verdict_of(tmp_path, c)[0] == "not significant on any suite"


def test_opposite_significant_signs_contradict(tmp_path):
    a = make_folder(tmp_path / "a", "synthetic", dge_right=12, base_right=0)
    b = make_folder(tmp_path / "b", "ruler", dge_right=0, base_right=12)
    assert verdict_of(tmp_path, a, b)[0] == "contradicted (significant with opposite signs)"


def test_report_cli_prints_the_table_for_several_folders(tmp_path, capsys):
    a = make_folder(tmp_path / "a", "synthetic", dge_right=12, base_right=0)
    b = make_folder(tmp_path / "b", "ruler", dge_right=11, base_right=0)
    assert report.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("| claim | suite | run | n | wins / losses |")
    assert f"| {CLAIM} | ruler | b | 14 | 11 / 0 | +78.57 |" in out
    assert "1 replicate: " + CLAIM in out
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / PREDICTIONS_FILE).write_text("")
    assert report.main([str(a), str(tmp_path / "bare")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no config.json" in err and err.count("\n") == 1
    assert report.main(["--help"]) == 2


def test_folders_of_another_setting_hold_other_claims(tmp_path):
    """Window 8 on one suite and window 32 on another are two one-suite claims, never one
    replicated claim; suite-side differences (an answer prefix, lengths) are no setting."""
    a = make_folder(tmp_path / "a", "synthetic", dge_right=12, base_right=0, window=8)
    b = make_folder(tmp_path / "b", "ruler", dge_right=12, base_right=0, window=32)
    c = make_folder(tmp_path / "c", "ruler", dge_right=12, base_right=0, window=8,
                    answer_prefix=False, ruler_length=4096)
    entries = replication.replication(report.folder_comparisons(f) for f in (a, b))
    verdicts = {e["claim"]: e["verdict"] for e in entries}
    assert verdicts == {
        f"{CLAIM} [window=8]": "not replicated: significant on synthetic only (1 suite tested)",
        f"{CLAIM} [window=32]": "not replicated: significant on ruler only (1 suite tested)"}
    entries = replication.replication(report.folder_comparisons(f) for f in (a, c))
    assert {e["claim"]: e["verdict"] for e in entries} == {
        CLAIM: "replicates: better on 2 suites"}
    assert replication.setting_labels([
        {"policy_options": {"window": 8}, "ties": "later"},
        {"policy_options": {"window": 8}, "ties": "earlier"}]) == ["ties=later", "ties=earlier"]


def test_report_out_writes_the_claim_matrix(tmp_path, capsys):
    a = make_folder(tmp_path / "a", "synthetic", dge_right=12, base_right=0)
    b = make_folder(tmp_path / "b", "ruler", dge_right=11, base_right=1)
    out = tmp_path / "rep"
    assert report.main([str(a), str(b), "--out", str(out)]) == 0
    text = (out / "results.md").read_text()
    assert capsys.readouterr().out == text
    assert f"--out {out}`" in text.splitlines()[2]
    assert "| claim | synthetic: a | ruler: b | verdict |" in text
    p_a, p_b = (format_p(mcnemar_exact(*wl)) for wl in ((12, 0), (10, 0)))
    assert f"| {CLAIM} | 12 / 0, {p_a} | 10 / 0, {p_b} | replicates: better on 2 suites |" in text
    saved = json.loads((out / "replication.json").read_text())
    assert saved["folders"] == [str(a), str(b)] and len(saved["entries"]) == 2
    assert report.main([str(a), "--out", str(out)]) == 2
    assert "two or more run folders" in capsys.readouterr().err
    assert report.main([str(a), str(b), "--out"]) == 2


def test_two_models_are_judged_each_then_together(tmp_path):
    def folders(model, tag, dge_right):
        return [make_folder(tmp_path / f"{tag}-{suite}", suite, dge_right=dge_right,
                            base_right=0, model=model) for suite in ("synthetic", "ruler")]

    smol, gemma = folders("smollm2", "s", 12), folders("gemma3", "g", 12)
    assert verdict_of(tmp_path, *smol, *gemma)[0] == "replicates on both models: better"
    flat = folders("gemma3", "g0", 0)
    text = verdict_of(tmp_path, *smol, *flat)[0]
    assert text.startswith("on one model (") and "smollm2: replicates: better" in text
    assert "gemma3: not significant on any suite" in text
    # one suite of each model never adds up to a replication
    mixed = [smol[0], gemma[1]]
    assert verdict_of(tmp_path, *mixed)[0].startswith("does not replicate (")
    worse = folders("gemma3", "gw", 0)
    for f in worse:  # the baseline right where DGE is wrong: significant the other way
        make_folder(f, f.name.split("-")[1], dge_right=0, base_right=12, model="gemma3")
    assert verdict_of(tmp_path, *smol, *worse)[0].startswith("contradicted across models")
