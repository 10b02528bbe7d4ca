"""`python -m experiments.reproduce` end to end on a tiny random checkpoint with
Llama-3.1-8B-Instruct's layer shape (4 query heads per kv head, head width 128 / hidden 4096
scaled down, llama3 RoPE scaling, untied embeddings), on real LongBench rows: the preset's
grid runs through the runner and the paper-style table has every task, both averages and
DGE - baseline for every rule and budget.
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import LLAMA3_ROPE
from test_runner import env, run_ok  # noqa: F401 (fixture)
from tiny_model import build_tiny_llama

from experiments import reproduce

DATASETS = ("trec", "samsum")


def test_the_preset_writes_the_paper_table(tmp_path, data_dir, env):  # noqa: F811
    model = build_tiny_llama(tmp_path / "llama31", num_attention_heads=8, num_key_value_heads=2,
                             hidden_size=64, rope_parameters={**LLAMA3_ROPE,
                                                              "rope_theta": 500000.0},
                             tie_word_embeddings=False)  # fmt: skip
    out = tmp_path / "out"
    run_ok([sys.executable, "-m", "experiments.reproduce", "--model", str(model),
            "--data_dir", str(data_dir), "--datasets", ",".join(DATASETS), "--budgets", "16",
            "--num_samples", "1", "--out_dir", str(out), "--",
            "--max_length", "256", "--window", "4"], env)  # fmt: skip
    scores = json.loads((out / "scores.json").read_text())
    cells = set(scores["averages"])
    want = {"full"} | {reproduce._cell(r, t, b) for r in reproduce.RULES[1:]
                       for t in reproduce.TIMINGS for b in (16,)}  # fmt: skip
    assert cells == want
    table = (out / reproduce.TABLE_FILE).read_text()
    assert "averages over the 2 of 16 tasks run" in table
    assert all(d in table.splitlines()[2] for d in DATASETS)  # one column per task
    body = [line for line in table.splitlines() if line.startswith("| ")]
    assert sum(line.startswith("| 16 |") for line in body) == 4 * 3 + 4  # scores, deltas
    for rule in reproduce.RULES[1:]:
        assert f"| 16 | {rule} | dge |" in table and f"| 16 | {rule} | dge_w |" in table
    # the table is the scores': full's mean is the mean of its three task scores
    full = [line for line in body if line.startswith("| - | full |")][0].split(" | ")
    per_task = [scores["datasets"][d]["full"] for d in reproduce.ENGLISH_TASKS if d in DATASETS]
    assert float(full[-2]) == round(sum(per_task) / 2, 2)
    again = reproduce.main(["--model", str(model), "--data_dir", str(data_dir),
                            "--budgets", "16", "--out_dir", str(out), "--table_only"])
    assert again == 0 and (out / reproduce.TABLE_FILE).read_text() == table


def test_the_table_takes_the_draft_family():
    """--timings prefill,dge,dge_w,dge_d,lookahead: every timing's row, each against prefill,
    and DGE - DGE-W, from made-up scores (the runner's cell ids)."""
    timings = ("prefill", "dge", "dge_w", "dge_d", "lookahead")
    cells = {"full": 50.0} | {reproduce._cell("snapkv", t, 128): 40.0 + i
                              for i, t in enumerate(timings)}  # fmt: skip
    assert "snapkv/lookahead/k2/b128" in cells and "snapkv/dge_d/k2/b128" in cells
    table = reproduce.paper_table({"datasets": {"trec": cells}}, (128,), timings)
    assert "| budget | rule | DGE(2) - prefill | DGE-W(2) - prefill | DGE-D(2) - prefill | " \
           "LAQ(2) - prefill | DGE - DGE-W |" in table
    assert "| 128 | snapkv | lookahead | 44.00 | 44.00 | 44.00 |" in table
    assert "| 128 | snapkv | 1.00 / 1.00 | 2.00 / 2.00 | 3.00 / 3.00 | 4.00 / 4.00 | " \
           "-1.00 / -1.00 |" in table
    with pytest.raises(SystemExit):
        reproduce.parse(["--model", "m", "--data_dir", "d", "--timings", "dge,decode"])
