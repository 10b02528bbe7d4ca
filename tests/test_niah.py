"""The needle-in-a-haystack grid (`--suite niah`) and its heatmaps (issue #31): rows walk the
depth x length grid with the needle where its depth says, the heatmap's numbers are the mean
row scores of each grid cell, and a run folder's report draws it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from tiny_model import build_tiny_llama, write_tokenizer

from dge_jax.checkpoints.tokenizer import Tokenizer
from experiments import heatmaps
from experiments.suites import niah

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder)
    return Tokenizer.from_folder(folder, {})


def test_rows_walk_the_grid_with_the_needle_at_its_depth(tokenizer):
    made = niah.make_rows(tokenizer, 46, 1024)
    cells = [niah.grid_cell(r["_id"]) for r in made]
    assert cells[:44] == [(n, d) for n in (256, 512, 768, 1024) for d in niah.DEPTHS]
    assert cells[44:] == cells[:2] and made[44]["_id"].endswith("-r1")  # the repeat
    assert made[44]["answers"] != made[0]["answers"]  # another key
    where: dict[int, list[float]] = {}
    for row, (length, depth) in zip(made[:44], cells[:44], strict=True):
        assert row["length"] <= length  # whole sentences, as many as fit
        needle = f"The pass key is {row['answers'][0]}. Remember it."
        at = row["context"].index(needle) / max(1, len(row["context"]) - len(needle))
        where.setdefault(length, []).append(at)
        if length == 1024:  # enough sentences to place it to a tenth
            assert abs(at - depth / 100) < 0.12, (row["_id"], at)
    longest = [r["length"] for r, (n, _) in zip(made, cells, strict=True) if n == 1024]
    assert np.mean(longest) > 0.8 * 1024  # (the tiny tokenizer spells essays nearly in bytes)
    for at in where.values():  # depth 0: the needle first; 100 %: last, at every length
        assert at[0] == 0.0 and at[-1] == 1.0
    again = niah.make_rows(tokenizer, 3, 1024)
    assert again == made[:3]  # a pure function of the grid cell, seed and repeat


def test_a_grid_too_short_for_the_prompt_is_one_clear_error(tokenizer):
    with pytest.raises(ValueError, match=r"--synthetic_length 256: the grid's shortest prompts "
                       r"\(64 tokens, a quarter\) are too short .*raise --synthetic_length"):
        niah.make_rows(tokenizer, 1, 256)


def test_grid_cell_reads_only_this_suites_ids():
    assert niah.grid_cell("niah-l1024-d050-r2") == (1024, 50)
    assert niah.grid_cell("3f2a9c") is None


def lines(cell: str, scores: dict[tuple[int, int], list[bool]]) -> list[dict]:
    out = []
    for (length, depth), found in scores.items():
        for rep, ok in enumerate(found):
            out.append({"dataset": "niah", "cell": cell, "answers": ["12345"],
                        "all_classes": None, "pred": " 12345." if ok else " 99999.",
                        "sample_id": f"niah-l{length}-d{depth:03d}-r{rep}"})
    return out


def test_heatmap_numbers_are_the_grid_cells_mean_scores(tmp_path):
    rows = (lines("full", {(256, 0): [True, True], (512, 0): [True, True],
                           (256, 50): [True, True], (512, 50): [True, False]})
            + lines("snapkv/prefill/b64", {(256, 0): [False, False], (512, 0): [True, False],
                                           (256, 50): [True, True], (512, 50): [False, False]})
            + lines("snapkv/dge/k2/b64", {(256, 0): [True, False], (512, 0): [True, True],
                                          (256, 50): [True, True], (512, 50): [False, False]}))
    rows.append({"dataset": "passkey", "cell": "full", "answers": ["1"], "all_classes": None,
                 "pred": "1", "sample_id": "abc"})  # another dataset: not drawn
    lengths, depths, cells = heatmaps.grids(rows)
    assert (lengths, depths) == ([256, 512], [0, 50])
    assert list(cells) == ["full", "snapkv/prefill/b64", "snapkv/dge/k2/b64"]
    np.testing.assert_array_equal(cells["full"], [[100, 100], [100, 50]])
    np.testing.assert_array_equal(cells["snapkv/prefill/b64"], [[0, 50], [100, 0]])
    diffs = heatmaps.differences(cells)
    assert list(diffs) == ["snapkv/dge/k2/b64"]
    base, diff = diffs["snapkv/dge/k2/b64"]
    assert base == "snapkv/prefill/b64"
    np.testing.assert_array_equal(diff, [[50, 50], [0, 0]])
    path = heatmaps.niah_heatmap(rows, "tiny", tmp_path)
    assert path == tmp_path / "niah_heatmap.png" and path.stat().st_size > 10_000
    assert heatmaps.niah_heatmap(rows[-1:], "tiny", tmp_path / "none") is None


def test_a_niah_run_writes_its_heatmap(tmp_path):
    model = build_tiny_llama(tmp_path / "model")
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", TQDM_DISABLE="1",
               MPLCONFIGDIR=str(tmp_path / "mpl"))
    done = subprocess.run(
        [sys.executable, "-m", "experiments.longbench", "--suite", "niah", "--model",
         str(model), "--synthetic_length", "512", "--num_samples", "8", "--rules",
         "full,snapkv", "--timings", "prefill,dge", "--budgets", "16", "--window", "4",
         "--out_dir", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "niah_heatmap.png").stat().st_size > 10_000
    assert "niah_heatmap.png" in (out / "results.md").read_text()
    ids = [json.loads(x)["sample_id"] for x in
           (out / "predictions.jsonl").read_text().splitlines()]
    assert {niah.grid_cell(i) for i in ids} == {(128, d) for d in range(0, 71, 10)}
    done = subprocess.run([sys.executable, "-m", "experiments.heatmaps", str(out), "--out",
                           str(tmp_path / "again.png")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and (tmp_path / "again.png").is_file(), done.stderr
