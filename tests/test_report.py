"""`experiments.report`: scores and averages of hand-made prediction rows, table, plots, CLI.

Expected numbers are worked out by hand from the official metric definitions (see comments).
"""

import json

import pytest

from experiments import plots, report
from experiments.predictions import PREDICTIONS_FILE
from experiments.run_folder import RunFolderError
from experiments.stats import bootstrap_mean_ci, clopper_pearson, mcnemar_exact
from experiments.suites.longbench_config import ENGLISH_TASKS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TREC_CLASSES = ["Food", "Date", "Individual", "Location"]
SNAP = "snapkv/prefill/b16"


def line(dataset, cell, sample, pred, answers, all_classes=None):
    return {"key": f"{cell}|{dataset}|{sample}", "config_hash": "h", "dataset": dataset,
            "sample_id": sample, "cell": cell, "pred": pred, "answers": answers,
            "all_classes": all_classes}


def longbench_rows() -> list[dict]:
    t = TREC_CLASSES
    return [
        # trec (classification; first line only). full: s1 "Individual" -> 1; s2: an earlier
        # line said "Location" (1) but the later line "Date" (0) wins -> 50.00.
        line("trec", "full", "s1", "Individual\nFood", ["Individual"], t),
        line("trec", "full", "s2", "Location", ["Location"], t),
        line("trec", "full", "s2", "Date", ["Location"], t),
        # snapkv: s1 finds Food and Individual -> 1/2; s2 -> 1: 75.00.
        line("trec", SNAP, "s1", "Food or Individual", ["Individual"], t),
        line("trec", SNAP, "s2", "Location", ["Location"], t),
        # passage_count (share of numbers equal to the answer). full: 1/2, 1 -> 75.00;
        # snapkv: 0, 1 -> 50.00.
        line("passage_count", "full", "s1", "3 or 4", ["3"]),
        line("passage_count", "full", "s2", "7", ["7"]),
        line("passage_count", SNAP, "s1", "none", ["3"]),
        line("passage_count", SNAP, "s2", "7 7", ["7"]),
        # hotpotqa (qa_f1). full: exact after normalization -> 100.00; snapkv: "city of paris"
        # vs "paris": precision 1/3, recall 1, F1 1/2 -> 50.00. Max over the two answers.
        line("hotpotqa", "full", "s1", "Paris", ["paris", "London"]),
        line("hotpotqa", SNAP, "s1", "the city of Paris", ["Paris", "Rome"]),
        # passage_retrieval_en. full: 100.00; snapkv: numbers 2 and 3, one right -> 50.00.
        line("passage_retrieval_en", "full", "s1", "Paragraph 3", ["Paragraph 3"]),
        line("passage_retrieval_en", SNAP, "s1", "Paragraph 2 and 3", ["Paragraph 3"]),
        # passage_retrieval_zh (Chinese: in "mean", not in the English averages). full: 100.
        line("passage_retrieval_zh", "full", "s1", "段落2", ["段落2"]),
    ]


def test_score_rows_longbench_by_hand():
    scores = report.score_rows(longbench_rows())
    assert scores["datasets"] == {
        "hotpotqa": {"full": 100.0, SNAP: 50.0},
        "passage_count": {"full": 75.0, SNAP: 50.0},
        "passage_retrieval_en": {"full": 100.0, SNAP: 50.0},
        "passage_retrieval_zh": {"full": 100.0},
        "trec": {"full": 50.0, SNAP: 75.0},
    }
    assert scores["counts"]["trec"] == {"full": 2, SNAP: 2}
    # full: mean over all five = 425/5; snapkv: 225/4 = 56.25 (no zh row). Only 4 of the 16
    # English tasks ran, so neither official average is stated (it would not be one).
    assert scores["averages"] == {
        "full": {"mean": 85.0, "tasks": 5, "n": 7},
        SNAP: {"mean": 56.25, "tasks": 4, "n": 6},
    }
    assert list(scores["averages"]) == ["full", SNAP]


def test_score_rows_synthetic_has_only_the_mean():
    rows = [
        # passkey (match_any, whole words): 1, 0 -> 50.00
        line("passkey", "full", "a", "The pass key is 12345.", ["12345"]),
        line("passkey", "full", "b", "The pass key is 123456.", ["12345"]),
        # niah_multivalue (match_fraction): 2 of 4 -> 50.00 ... and 4 of 4 -> 100: 75.00
        line("niah_multivalue", "full", "a", "11, 22 and 99", ["11", "22", "33", "44"]),
        line("niah_multivalue", "full", "b", "44 33 22 11", ["11", "22", "33", "44"]),
    ]
    scores = report.score_rows(rows)
    assert scores["datasets"] == {"passkey": {"full": 50.0}, "niah_multivalue": {"full": 75.0}}
    assert scores["averages"] == {"full": {"mean": 62.5, "tasks": 2, "n": 4}}
    table = report.markdown_table(scores)
    assert table.splitlines()[0] == (
        "| rule | timing | k | budget | n | niah_multivalue | passkey | mean (2 tasks) |")
    assert "mean_en16" not in table


def test_latest_rows_last_line_wins_per_sample():
    rows = [line("passkey", "full", "a", "old", ["1"]), line("passkey", "full", "b", "b", ["1"]),
            line("passkey", "full", "a", "new", ["1"])]
    grouped = report.latest_rows(rows)
    assert {r["pred"] for r in grouped[("passkey", "full")]} == {"new", "b"}


def test_markdown_table_by_hand():
    table = report.markdown_table(report.score_rows(longbench_rows()))
    assert table == (
        "| rule | timing | k | budget | n | hotpotqa | passage_count | passage_retrieval_en | "
        "passage_retrieval_zh | trec | mean (5 tasks) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
        "| full | - | - | - | 7 | 100.00 | 75.00 | 100.00 | 100.00 | 50.00 | 85.00 |\n"
        "| snapkv | prefill | - | 16 | 6 | 50.00 | 50.00 | 50.00 | - | 75.00 | 56.25 |\n"
    )


def test_official_averages_only_when_all_16_english_tasks_ran():
    """mean_en16 was printed as a 16-task mean when 7 tasks ran; now it needs all 16."""
    rows = [line(d, "full", "a", "x", ["Paragraph 1"], ["Paragraph 1"]) for d in ENGLISH_TASKS]
    scores = report.score_rows(rows)
    assert set(scores["averages"]["full"]) == {"mean", "tasks", "n", "mean_en16",
                                               "category_mean"}
    assert scores["averages"]["full"]["tasks"] == 16
    assert "mean_en16" in report.markdown_table(scores).splitlines()[0]
    fewer = report.score_rows(rows[:7])
    assert "mean_en16" not in fewer["averages"]["full"]
    assert "mean (7 tasks)" in report.markdown_table(fewer)


def test_cell_order_in_table():
    cells = ["snapkv/dge_w/k2/b64", "snapkv/dge/k2/b64", "snapkv/prefill/b64",
             "snapkv/prefill/b16", "h2o/prefill/b16", "full", "snapkv/dge/k1/b64"]
    rows = [line("passkey", c, "a", "1", ["1"]) for c in cells]
    assert list(report.score_rows(rows)["averages"]) == [
        "full", "h2o/prefill/b16", "snapkv/prefill/b16", "snapkv/prefill/b64",
        "snapkv/dge/k1/b64", "snapkv/dge/k2/b64", "snapkv/dge_w/k2/b64"]


def write_predictions(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / PREDICTIONS_FILE).open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def test_write_report_and_cli(tmp_path, capsys):
    rows = []
    for cell, preds in {"full": ["1", "1"], "snapkv/prefill/b16": ["1", "x"],
                        "snapkv/prefill/b64": ["1", "1"], "snapkv/dge/k2/b16": ["x", "x"],
                        "snapkv/dge_w/k2/b16": ["1", "x"]}.items():
        rows += [line("passkey", cell, s, p, ["1"]) for s, p in zip("ab", preds, strict=True)]
    write_predictions(tmp_path, rows)
    scores = report.write_report(tmp_path)
    wrote = (f"wrote {tmp_path / 'results.md'}, scores.json, score_vs_budget.png, "
             "dge_delta.png\n")
    assert capsys.readouterr().err == wrote  # one line saying what it wrote
    assert json.loads((tmp_path / "scores.json").read_text()) == scores
    assert scores["averages"]["snapkv/dge/k2/b16"] == {"mean": 0.0, "tasks": 1, "n": 2}
    results = (tmp_path / "results.md").read_text()
    head, table = results.split("\n| rule", 1)  # the header, then the tables
    assert head.startswith("# Results") and "\n|" not in head
    assert ("| rule" + table).startswith(report.markdown_table(scores))
    # Paired section: dge k2 b16 (0/2 right) vs prefill b16 (1/2): 0 wins, 1 loss, p = 1.
    assert scores["paired"] == report.paired_comparisons(rows)
    assert "McNemar" in results and report.paired_table(scores["paired"]) in results
    assert results.endswith(report.summary(scores, scores["paired"], None))
    assert "none differs significantly" in results
    assert ("No comparison against a baseline other than full is significant after "
            "correction" in results)
    for name in ("score_vs_budget.png", "dge_delta.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC, name
    first = {p: (tmp_path / p).read_bytes() for p in ("scores.json", "results.md")}
    assert report.main([str(tmp_path)]) == 0
    assert capsys.readouterr() == (first["results.md"].decode(), wrote)
    assert {p: (tmp_path / p).read_bytes() for p in first} == first


def test_results_open_with_the_runs_header(tmp_path):
    """results.md started with a table: which model, suite, run, date, version and command
    it showed was written nowhere in it. The header says so, from config.json's history."""
    import dge_jax

    rows = [{**line(d, c, s, "1", ["1"]), "run_id": "abc123"} for d in ("passkey", "essay_qa")
            for c in ("full", SNAP, "snapkv/dge/k2/b16") for s in "ab"]
    write_predictions(tmp_path, rows)
    old = "/somewhere/experiments/longbench.py --methods full,snapkv"  # argv of older runners
    new = "python -m experiments.longbench --rules full,snapkv --extend"
    (tmp_path / "config.json").write_text(json.dumps({
        "format": 2, "run_id": "abc123",
        "identity": {"model": "smollm2-135m-instruct", "suite": "synthetic", "dge_jax": "9.9"},
        "history": [{"command": old, "at": "2025-01-02T03:04:05+00:00"},
                    {"command": new, "at": "2025-01-03T00:00:00+00:00"}]}))
    report.write_report(tmp_path)
    results = (tmp_path / "results.md").read_text()
    head = results[:results.index("\n| rule")]
    assert head.splitlines()[0] == "# Results: smollm2-135m-instruct on the synthetic suite"
    for expected in (
            "- model: `smollm2-135m-instruct`",
            "- suite: synthetic; datasets: essay_qa, passkey",
            "- n: 2 samples per dataset", "- run id: `abc123`",
            "- run dates: 2025-01-02, 2025-01-03 (UTC)",
            f"- dge_jax: 9.9 (this report written by {dge_jax.__version__})",
            "- commands (config.json history):",
            "  - `python -m experiments.longbench --methods full,snapkv` "
            "(2025-01-02T03:04:05+00:00)",
            f"  - `{new}` (2025-01-03T00:00:00+00:00)",
            "- plots beside this file: `score_vs_budget.png`, `dge_delta.png`"):
        assert expected in head.splitlines(), (expected, head)
    assert "unknown" not in head


def test_plot_without_dge_cells_writes_only_score_vs_budget(tmp_path):
    rows = [line("passkey", c, "a", "1", ["1"]) for c in ("full", "snapkv/prefill/b16")]
    scores, per_sample = report.score_rows(rows), report.sample_scores(rows)
    assert plots.score_vs_budget(scores, per_sample, "t", tmp_path).name == "score_vs_budget.png"
    assert plots.dge_delta(report.paired_comparisons([]), "t", tmp_path) is None
    only_full = [line("passkey", "full", "a", "1", ["1"])]
    assert plots.score_vs_budget(report.score_rows(only_full), report.sample_scores(only_full),
                                 "t", tmp_path) is None


def test_report_refuses_lines_of_several_configurations(tmp_path, capsys):
    """Two configurations of one cell in one file were averaged as if they were one."""
    rows = [line("passkey", "full", "a", "1", ["1"]),
            {**line("passkey", "full", "b", "1", ["1"]), "config_hash": "other"}]
    write_predictions(tmp_path, rows)
    with pytest.raises(RunFolderError, match="several configurations"):
        report.write_report(tmp_path)
    tagged = [{**line("passkey", "full", s, "1", ["1"]), "run_id": r} for s, r in
              (("a", "r1"), ("b", "r2"))]
    write_predictions(tmp_path, tagged)
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "2 run configurations" in err and err.count("\n") == 1


def test_summary_names_the_significant_differences():
    rows = []
    for i in range(12):  # DGE right on all 12, prefill on none: 12 wins, p = 2/4096
        rows += [line("passkey", "snapkv/prefill/b16", f"s{i}", "x", ["1"]),
                 line("passkey", "snapkv/dge/k2/b16", f"s{i}", "1", ["1"]),
                 line("passkey", "snapkv/dge_w/k2/b16", f"s{i}", "x", ["1"])]
    scores, pairs = report.score_rows(rows), report.paired_comparisons(rows)
    text = report.summary(scores, pairs, {"identity": {"model": "m", "suite": "synthetic"}})
    assert "3 cells of m on the synthetic suite, 12 samples each over 1 task" in text
    assert "2 differ significantly" in text
    assert "snapkv/dge/k2/b16 vs snapkv/prefill/b16: 100.0% vs 0.0% (12 wins / 0 losses" in text
    # Holm over 3 comparisons: the two 12/0 ones (equal p) both get 3 * p (monotone: the
    # second's 2 * p is raised to the first's), the 0/0 one stays 1.
    assert [c["p_holm"] for c in pairs] == pytest.approx([3 * mcnemar_exact(12, 0), 1.0,
                                                          3 * mcnemar_exact(12, 0)])


def test_summary_names_no_largest_gap_when_every_comparison_ties():
    """Every cell right on the same samples: the summary named a 0 / 0, p = 1 comparison
    "the largest gap"; it now says that no comparison differs."""
    rows = [line("passkey", c, s, p, ["1"]) for s, p in zip("abc", "1x1", strict=True)
            for c in ("full", SNAP, "snapkv/dge/k2/b16", "snapkv/dge_w/k2/b16")]
    scores, pairs = report.score_rows(rows), report.paired_comparisons(rows)
    assert all((c["wins"], c["losses"], c["p"]) == (0, 0, 1.0) for c in pairs)
    text = report.summary(scores, pairs, None)
    assert "largest gap" not in text
    assert (f"No comparison differs: each of the {len(pairs)} has 0 wins and 0 losses (p = 1)"
            in text)
    # Only the comparisons against a baseline other than full tie: none of them is named.
    rows = [r for r in rows if r["cell"] != "full"] + [
        line("passkey", "full", s, "1", ["1"]) for s in "abc"]
    scores, pairs = report.score_rows(rows), report.paired_comparisons(rows)
    text = report.summary(scores, pairs, None)
    assert "largest gap" not in text and "none of them differs (0 wins and 0 losses" in text


def test_plots_carry_intervals_and_notes(tmp_path):
    """Coinciding series get a note; the delta plot draws every paired comparison."""
    rows = []
    for i, (b, d) in enumerate(zip("1x1x1x", "111x11", strict=True)):
        rows += [line("passkey", "full", f"s{i}", "1", ["1"]),
                 line("passkey", "snapkv/prefill/b16", f"s{i}", b, ["1"]),
                 line("passkey", "snapkv/dge/k2/b16", f"s{i}", d, ["1"]),
                 line("passkey", "snapkv/dge_w/k2/b16", f"s{i}", b, ["1"])]
    scores, per_sample = report.score_rows(rows), report.sample_scores(rows)
    assert plots._coincide_note(scores, sorted(
        (k, c) for k, c in plots._series(scores).items())) == (
        "snapkv/dge_w/k2 = snapkv/prefill at every budget")
    comparisons = report.paired_comparisons(rows)
    assert len(plots.win_rate_points(comparisons)) == len(comparisons)
    assert plots.score_vs_budget(scores, per_sample, "m on s, n = 6",
                                 tmp_path).read_bytes()[:8] == PNG_MAGIC
    assert plots.dge_delta(comparisons, "m on s, n = 6",
                           tmp_path).read_bytes()[:8] == PNG_MAGIC


def test_delta_plot_shows_the_paired_tests_verdict():
    """The delta plot drew a bootstrap interval of the score difference that excluded 0 while
    the table's McNemar test (Holm-corrected) said not significant. It now draws the win rate
    with an exact interval at the Bonferroni level of the Holm family: 5 wins / 0 losses out
    of 20 samples is not significant, so the interval holds 0.5 and the marker is hollow."""
    rows = []
    for i in range(20):  # prefill right on 0-9, DGE on 0-14: 5 wins, 0 losses
        rows += [line("passkey", "full", f"s{i}", "1", ["1"]),
                 line("passkey", SNAP, f"s{i}", "1" if i < 10 else "x", ["1"]),
                 line("passkey", "snapkv/dge/k2/b16", f"s{i}", "1" if i < 15 else "x", ["1"])]
    per_sample = report.sample_scores(rows)
    diffs = [per_sample["snapkv/dge/k2/b16"][s] - per_sample[SNAP][s] for s in per_sample[SNAP]]
    _, low, _ = bootstrap_mean_ci({"passkey": diffs})
    assert low > 0  # what the old plot drew: an interval of the difference excluding 0
    comparisons = report.paired_comparisons(rows)
    by_pair = {(c["cell"], c["baseline"]): c for c in comparisons}
    dge = by_pair[("snapkv/dge/k2/b16", SNAP)]
    assert (dge["wins"], dge["losses"]) == (5, 0) and dge["p_holm"] > 0.05
    points = {(p["cell"], p["baseline"]): p for p in plots.win_rate_points(comparisons)}
    point = points[("snapkv/dge/k2/b16", SNAP)]
    assert point["name"] == "snapkv/dge/k2 vs snapkv/prefill"
    assert point["rate"] == 1.0 and point["low"] < 0.5 < point["high"] == 1.0
    assert not point["filled"]
    # prefill vs full: 0 wins / 10 losses, Holm p = 2 * 2/1024 < 0.05: filled, below 0.5
    full = points[(SNAP, "full")]
    assert full["filled"] and full["rate"] == 0.0 and full["high"] < 0.5
    # The interval's level is 1 - 0.05/m over the m = 2 comparisons Holm runs over.
    assert (point["low"], point["high"]) == clopper_pearson(5, 0, 1 - 0.05 / 2)


def test_delta_plot_draws_no_interval_for_a_tie():
    rows = [line("passkey", c, "a", "1", ["1"]) for c in (SNAP, "snapkv/dge/k2/b16")]
    (point,) = plots.win_rate_points(report.paired_comparisons(rows))
    assert (point["wins"], point["losses"]) == (0, 0)
    assert point["rate"] is point["low"] is point["high"] is None and not point["filled"]


def test_one_naming_of_cells_in_tables_legends_and_summary(tmp_path, monkeypatch):
    """Legends said `dge (k=2)`, `prefill (baseline)`, `DGE - prefill`, `FullKV`; the summary
    `snapkv under dge (k=2)`: names the tables never use. Now every name is a cell id, a cell
    id without its budget, or two of them joined by `vs`; `k` is `-` where nothing drafts."""
    legends = {}

    def record(plt, fig, path):  # what each figure's legends say, instead of pixels
        legends[path.name] = {t.get_text() for ax in fig.axes if ax.get_legend()
                              for t in ax.get_legend().get_texts()}
        plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", record)
    cells = ["full", SNAP, "snapkv/dge/k2/b16", "snapkv/dge_w/k2/b16", "snapkv/dge/k3/b16",
             "snapkv/dge_w/k3/b16"]
    rows = [line("passkey", c, s, p, ["1"]) for s in "abcd" for c, p in
            zip(cells, "1x1x11" if s in "ab" else "11x1xx", strict=True)]
    write_predictions(tmp_path, rows)
    report.write_report(tmp_path)
    assert legends["score_vs_budget.png"] == {
        "full (band: 95 % interval)", "snapkv/prefill", "snapkv/dge/k2", "snapkv/dge_w/k2",
        "snapkv/dge/k3", "snapkv/dge_w/k3"}
    assert legends["dge_delta.png"] == {
        "snapkv/prefill vs full", "snapkv/dge/k2 vs snapkv/prefill",
        "snapkv/dge_w/k2 vs snapkv/prefill", "snapkv/dge/k3 vs snapkv/prefill",
        "snapkv/dge_w/k3 vs snapkv/prefill", "snapkv/dge/k2 vs snapkv/dge_w/k2",
        "snapkv/dge/k3 vs snapkv/dge_w/k3"}
    assert legends["accuracy_vs_k.png"] == {
        "snapkv/dge/k*/b16 (k = 1: snapkv/prefill/b16)",
        "snapkv/dge_w/k*/b16 (k = 1: snapkv/prefill/b16)"}
    results = (tmp_path / "results.md").read_text()
    for other in ("(k=", "DGE - prefill", "DGE-W", "DGE-SnapKV", "FullKV", "(baseline)"):
        assert other not in results, other
    assert ("full and snapkv/prefill, snapkv/dge/k2, snapkv/dge/k3, snapkv/dge_w/k2, "
            "snapkv/dge_w/k3 at budget 16 entries" in results)
    table = {row.split(" | ")[0][2:]: row.split(" | ")[1:4] for row in results.splitlines()
             if row.startswith("| full |") or row.startswith("| snapkv |")}
    assert table["full"] == ["-", "-", "-"]
    rows_k = [row.split(" | ")[1:4] for row in results.splitlines()
              if row.startswith("| snapkv |")]
    assert ["prefill", "-", "16"] in rows_k and ["dge", "2", "16"] in rows_k


def test_cli_errors(tmp_path, capsys):
    assert report.main([]) == 2
    assert "usage" in capsys.readouterr().err
    assert report.main([str(tmp_path)]) == 2
    assert "no predictions" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        report.write_report(tmp_path)


def test_mcnemar_exact_by_hand():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 0) == 0.25  # 2 * C(3,0) / 2^3
    assert mcnemar_exact(1, 5) == pytest.approx(2 * 7 / 64)  # 2 * (1 + 6) / 2^6
    assert mcnemar_exact(2, 2) == 1.0  # 2 * 11/16 capped at 1
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 1024)


def test_paired_comparisons_by_hand():
    base, dge, dge_w = "snapkv/prefill/b16", "snapkv/dge/k2/b16", "snapkv/dge_w/k2/b64"
    rows = []
    for sample, b, d, k in zip("abcd", "xxx1", "1111", (2, 2, 3, 1), strict=True):
        rows.append(line("passkey", base, sample, b, ["1"]))
        rows.append({**line("passkey", dge, sample, d, ["1"]), "k": k})
        rows.append(line("passkey", "full", sample, "1", ["1"]))
    rows.append(line("passkey", dge_w, "a", "1", ["1"]))  # no prefill cell at b64: skipped
    # The prefill cell against FullKV (0 wins, 3 losses), then DGE against prefill (3 / 0);
    # Holm over the two equal p = 0.25: both 0.5.
    assert report.paired_comparisons(rows) == [{
        "cell": base, "baseline": "full", "samples": 4, "accuracy": 25.0,
        "baseline_accuracy": 100.0, "wins": 0, "losses": 3, "p": 0.25, "mean_k": None,
        "p_holm": 0.5, "higher": 0, "lower": 3, "p_scores": 0.25, "p_scores_holm": 0.5,
    }, {
        "cell": dge, "baseline": base, "samples": 4, "accuracy": 100.0,
        "baseline_accuracy": 25.0, "wins": 3, "losses": 0, "p": 0.25, "mean_k": 2.0,
        "p_holm": 0.5, "higher": 3, "lower": 0, "p_scores": 0.25, "p_scores_holm": 0.5,
    }]


def test_dge_is_also_paired_with_dge_w_at_the_same_k_and_budget():
    """DGE vs DGE-W isolates the drafted queries: same eviction time, same kept drafts."""
    base, dge, dge_w = "snapkv/prefill/b16", "snapkv/dge/k3/b16", "snapkv/dge_w/k3/b16"
    rows = []
    # samples: a b c d e; prefill right on a; DGE right on a b c d; DGE-W right on a e.
    for sample, b, d, w in zip("abcde", "1xxxx", "1111x", "1xxx1", strict=True):
        rows += [line("passkey", base, sample, b, ["1"]), line("passkey", dge, sample, d, ["1"]),
                 line("passkey", dge_w, sample, w, ["1"])]
    pairs = {(p["cell"], p["baseline"]): p for p in report.paired_comparisons(rows)}
    assert set(pairs) == {(dge, base), (dge_w, base), (dge, dge_w)}
    vs_w = pairs[(dge, dge_w)]
    assert (vs_w["accuracy"], vs_w["baseline_accuracy"]) == (80.0, 40.0)
    assert (vs_w["wins"], vs_w["losses"]) == (3, 1)  # b c d vs e
    assert vs_w["p"] == mcnemar_exact(3, 1) == 0.625  # 2 * (1 + 4) / 16


def test_dge_and_dge_w_are_paired_with_the_decode_timing_at_interval_k():
    """DGE(k) against kvpress's DecodingPress at compression_interval = k (timing decode, the
    same budget): after k decode steps with the full cache, one evicts once with the prompt
    window and the drafts, the other every k steps with the decode queries."""
    base, dge2, dge_w2 = "snapkv/prefill/b16", "snapkv/dge/k2/b16", "snapkv/dge_w/k2/b16"
    dge4, dec2, dec4 = "snapkv/dge/k4/b16", "snapkv/decode/b16/d16/i2", "snapkv/decode/b16/d16/i4"
    rows = []
    # DGE k2 right on a b c; DGE-W k2 on a; DGE k4 on a b; decode i2 on a d; decode i4 on d
    answers = {base: "1xxx", dge2: "111x", dge_w2: "1xxx", dge4: "11xx", dec2: "1xx1",
               dec4: "xxx1", "full": "1111"}
    for cell, preds in answers.items():
        rows += [line("passkey", cell, s, p, ["1"]) for s, p in zip("abcd", preds, strict=True)]
    pairs = {(p["cell"], p["baseline"]): p for p in report.paired_comparisons(rows)}
    assert {(dge2, dec2), (dge_w2, dec2), (dge4, dec4)} <= set(pairs)
    assert not any(b == dec4 and c in (dge2, dge_w2) for c, b in pairs)  # k must match
    assert (pairs[(dge2, dec2)]["wins"], pairs[(dge2, dec2)]["losses"]) == (2, 1)  # b c / d
    assert (pairs[(dge4, dec4)]["wins"], pairs[(dge4, dec4)]["losses"]) == (2, 1)  # a b / d
    assert (pairs[(dge_w2, dec2)]["wins"], pairs[(dge_w2, dec2)]["losses"]) == (0, 1)
    # every comparison is in one Holm family
    assert all("p_holm" in p for p in pairs.values())


ADAPTIVE_PAIR = ("snapkv/dge/k8/b16", "snapkv/dge/k8a/b16")


def test_markdown_table_tells_adaptive_cells_apart():
    """A fixed k=8 cell and an adaptive k_max=8 cell are different rows of the table."""
    rows = [line("passkey", ADAPTIVE_PAIR[0], "a", "1", ["1"]),
            line("passkey", ADAPTIVE_PAIR[1], "a", "x", ["1"])]
    body = report.markdown_table(report.score_rows(rows)).splitlines()[2:]
    labels = [row.split(" | ")[:4] for row in body]  # rule, timing, k, budget
    assert len(labels) == 2 and labels[0] != labels[1], body


def test_cell_order_is_total_for_adaptive_cells():
    """Order must not depend on input (set / dict) order, or reports differ between runs."""
    averages = {ADAPTIVE_PAIR[0]: {"mean": 100.0, "tasks": 1, "n": 1},
                ADAPTIVE_PAIR[1]: {"mean": 0.0, "tasks": 1, "n": 1}}
    datasets = {"passkey": {c: a["mean"] for c, a in averages.items()}}
    scores = {"datasets": datasets, "averages": averages}
    flipped = {"datasets": datasets, "averages": dict(reversed(averages.items()))}
    assert report.markdown_table(scores) == report.markdown_table(flipped)


def test_graded_scores_get_a_sign_test_beside_mcnemar():
    """Row scores below the 0.5 threshold on both sides: McNemar sees no discordant pair, the
    sign test sees the cell above the baseline on every sample."""
    base = "snapkv/prefill/b16"
    rows = []
    for sample in "abcdef":  # match_fraction-like: 1 of 4 values vs none
        rows.append(line("list_values", base, sample, "nothing", ["1111111", "2", "3", "4"]))
        rows.append(line("list_values", "full", sample, "1111111", ["1111111", "2", "3", "4"]))
    (pair,) = report.paired_comparisons(rows)
    assert (pair["wins"], pair["losses"], pair["p"]) == (0, 0, 1.0)
    assert (pair["higher"], pair["lower"]) == (0, 6)
    assert pair["p_scores"] == pytest.approx(mcnemar_exact(0, 6)) and pair["p_scores"] < 0.05
    assert "| 0 / 6 |" in report.paired_table([pair])
