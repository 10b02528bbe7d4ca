"""`benchmarks.peers.quantized_agreement`'s figures from hand-made cells, without the peers'
venv or a model: EOS cuts, kept-set counts, paired wins / losses with exact McNemar, the
comparisons the issue asks for (Holm over all of them) and the tables."""

from __future__ import annotations

import json

import pytest

from benchmarks.peers import quantized_agreement as qa
from experiments.stats import holm, mcnemar_exact


def row(score: float, tokens: list[int], kept: list | None = None) -> dict:
    return {"score": score, "tokens": tokens, "kept": kept}


def test_cut_at_eos_keeps_the_first_eos():
    assert qa.cut_at_eos([5, 6, 2, 7, 2], [2]) == [5, 6, 2]
    assert qa.cut_at_eos([5, 6], [2]) == [5, 6]


def test_kept_identical_counts_heads_as_sets():
    ours = [[[0, 1, 2], [3, 4]], [[1, 2], [5, 6]]]
    theirs = [[[2, 1, 0], [3, 5]], [[1, 2], [5, 6]]]
    assert qa.kept_identical(ours, theirs) == (3, 4)
    assert qa.kept_identical(ours, None) is None


def test_paired_counts_wins_losses_and_agreement():
    a = {"r0": row(1.0, [1, 2]), "r1": row(0.0, [3]), "r2": row(1.0, [4]), "r3": row(0.4, [5])}
    b = {"r0": row(1.0, [1, 2]), "r1": row(1.0, [3, 9]), "r2": row(0.0, [4, 8]),
         "r3": row(0.0, [5]), "only_b": row(1.0, [])}  # fmt: skip
    c = qa.paired(a, b)
    assert c["rows"] == 4  # the rows both have
    assert (c["wins"], c["losses"]) == (1, 1)  # r2 only a, r1 only b; 0.4 is not correct
    assert c["p"] == mcnemar_exact(1, 1)
    assert c["same_tokens"] == 2 and c["same_correct"] == 2
    assert c["accuracy"] == 50.0 and c["baseline_accuracy"] == 50.0
    assert c["kept_heads"] is None


def cells_for(dge_quants, peer_quants) -> dict:
    kept = [[[0, 1]]]
    cells = {}
    for lib, caches in (("dge_jax", ("none", *dge_quants)), ("kvpress", ("none", *peer_quants))):
        for cache in caches:
            for m in qa.METHODS:
                cells[qa.cell_id(lib, cache, m)] = {
                    f"r{i}": row(float(i % 2), [i], kept if m == "SnapKV" else None)
                    for i in range(3)
                }
    return cells


def test_comparisons_cover_the_issue_and_are_holm_corrected():
    cells = cells_for(["int8", "int4"], ["quanto-int4"])
    del cells["dge_jax/int4/FullKV"]  # a missing cell drops its comparisons
    comps = qa.comparisons(cells, ["int8", "int4"], ["quanto-int4"])
    pairs = [(c["kind"], c["cell"], c["baseline"]) for c in comps]
    assert ("quantized vs plain", "dge_jax/int8/FullKV", "dge_jax/none/FullKV") in pairs
    assert ("quantized vs plain", "kvpress/quanto-int4/SnapKV", "kvpress/none/SnapKV") in pairs
    assert ("dge_jax vs kvpress", "dge_jax/none/SnapKV", "kvpress/none/SnapKV") in pairs
    assert ("dge_jax vs kvpress", "dge_jax/int4/SnapKV", "kvpress/quanto-int4/SnapKV") in pairs
    assert not any("dge_jax/int4/FullKV" in p for p in pairs)
    # per method: 2 + 1 quantized vs plain, 1 plain pair, 2 quantized pairs; FullKV loses 2
    assert len(comps) == 2 * 6 - 2
    assert [c["p_holm"] for c in comps] == holm([c["p"] for c in comps])
    snap = next(c for c in comps if c["cell"] == "dge_jax/none/SnapKV")
    assert snap["kept_heads"] == [3, 3] and snap["same_tokens"] == 3


def test_table_lists_every_cell_and_comparison():
    cells = cells_for(["int8"], ["quanto-int4"])
    comps = qa.comparisons(cells, ["int8"], ["quanto-int4"])
    text = qa.table(cells, comps)
    assert "| dge_jax/int8/SnapKV | 3 | 1 | 33.3 | 33.3 |" in text
    assert text.count("| quantized vs plain |") == 4
    assert "| 3 / 3 | 3 / 3 | 3 / 3 |" in text  # tokens, correctness, kept heads


@pytest.mark.parametrize("bad", [["--kv_quant", "none,int8"]])
def test_parse_args_refuses_none_among_the_quantized(bad, tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(SystemExit):
        qa.parse_args(["--peer-python", str(python), *bad])


def test_merged_joins_parts_and_refuses_a_row_twice(tmp_path):
    cells = cells_for(["int8"], ["quanto-int4"])
    parts = [{c: {k: r for k, r in rows.items() if k in keys} for c, rows in cells.items()}
             for keys in (("r0", "r1"), ("r2",))]  # fmt: skip
    args = {"kv_quant": ["int8"], "nbits": [4]}
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps({"args": args, "versions": {}, "cells": part}))
    merged, comps, _ = qa.merged(paths)
    assert merged == cells
    assert comps == qa.comparisons(cells, ["int8"], ["quanto-int4"])
    with pytest.raises(ValueError, match="in two files"):
        qa.merged([paths[0], paths[0]])


def test_peer_from_reuses_kvpress_cells_of_the_same_setting_only(tmp_path):
    python = tmp_path / "python"  # never run: --peer_from replaces the peer
    args = qa.parse_args(["--peer-python", str(python), "--kv_quant", "int8,int4",
                          "--num_samples", "1", "--peer_from", str(tmp_path / "old.json")])
    samples = [{"key": "r0", "ids": [1, 2, 3]}, {"key": "r1", "ids": [4, 5]}]
    cells = cells_for(["int8"], ["quanto-int4"])
    saved_args = {k: v for k, v in vars(args).items() if k in qa.PEER_SETTING}
    saved = {"args": saved_args | {"kv_quant": ["int8"]}, "versions": {"kvpress": "0.5.5"},
             "rows": {"r0": {"prompt_tokens": 3}, "r1": {"prompt_tokens": 2}},
             "cells": {c: {k: r for k, r in rows.items() if k in ("r0", "r1")}
                       for c, rows in cells.items()}}  # fmt: skip
    old = tmp_path / "old.json"
    old.write_text(json.dumps(saved))
    theirs, versions = qa.peer_from(old, args, samples)
    assert set(theirs) == {c for c in cells if c.startswith("kvpress/")}  # dge_jax's rerun
    assert theirs["kvpress/none/FullKV"]["r0"]["tokens"] == cells["kvpress/none/FullKV"]["r0"][
        "tokens"]
    assert versions == {"kvpress": "0.5.5"}
    for change, match in (({"budget": 64}, "budget 64 vs 128"),
                          ({"skip": 3}, "skip 3 vs 0")):  # fmt: skip
        old.write_text(json.dumps(saved | {"args": saved_args | change}))
        with pytest.raises(SystemExit, match=match):
            qa.peer_from(old, args, samples)
    old.write_text(json.dumps(saved | {"rows": {"r0": {"prompt_tokens": 4}}}))
    with pytest.raises(SystemExit, match="rows' keys or prompt lengths"):
        qa.peer_from(old, args, samples)
