"""experiments.needle_kept: the needle's tokens found by character offsets, the shares each
head keeps on hand-made kept sets, and a run on the tiny random Llama where StreamingLLM's
kept sets (sinks and the most recent entries: a needle in the middle is lost) and a budget
over the prompt (everything kept) give known answers."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_model import build_tiny_llama

from experiments import needle_kept


def test_needle_positions_are_the_tokens_overlapping_each_occurrence():
    text = "key: 123456. again 123456"
    # tokens: "key" ":" " 12" "3456" "." " again" " 1234" "56" and a special token (0, 0)
    offsets = [(0, 3), (3, 4), (4, 7), (7, 11), (11, 12), (12, 18), (18, 23), (23, 25), (0, 0)]
    assert needle_kept.needle_positions(text, offsets, ["123456"]) == [2, 3, 6, 7]
    assert needle_kept.needle_positions(text, offsets, ["again"]) == [5]
    assert needle_kept.needle_positions(text, offsets, ["absent", ""]) == []


def test_kept_shares_per_layer_and_head():
    kept = [[[0, 1, 2], [5, 6]], [[], [1, 2, 3]], [[1, 2, 3, 4], [4]]]  # [layer][head]
    shares = needle_kept.kept_shares(kept, [1, 2, 4, 6], layers=[0, 2])
    np.testing.assert_allclose(shares, [[0.5, 0.25], [0.75, 0.25]])


def test_summary_counts_heads_keeping_all_and_none():
    table = needle_kept.summary({"c": [np.array([[1.0, 0.0]]), np.array([[0.5, 1.0]])]}, 2)
    assert "| c | 2 | 62.5 | 50.0 | 25.0 |" in table
    assert "2 row(s) without their answer in the prompt left out" in table


def test_summary_shows_a_dash_for_a_cell_without_rows():
    table = needle_kept.summary({"c": []}, 3)
    assert "| c | 0 | - | - | - |" in table and "nan" not in table


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def measured(*args: str) -> str:
    """measure() under the runner's flags, as `python -m experiments.needle_kept` runs it."""
    from absl import flags

    from experiments.run_config import FLAGS, RunConfig
    from experiments.runner import parse_flags

    flags.FLAGS.unparse_flags()
    try:
        parse_flags(["needle_kept", *args])
        return needle_kept.measure(RunConfig.from_flags(FLAGS))
    finally:  # the flags are process-wide: leave none parsed for the next test
        flags.FLAGS.unparse_flags()


def test_tiny_model_streamingllm_loses_a_middle_needle_and_a_large_budget_keeps_it(model_dir):
    from dge_jax.checkpoints.tokenizer import Tokenizer
    from experiments import protocol
    from experiments.runner import load_suite

    tok = Tokenizer.from_folder(model_dir)

    class Model:
        tokenizer = tok

    rows = load_suite(Model, "synthetic", ["passkey"], 2, None, 256, 42)["passkey"]
    for row in rows:  # the needle is the passkey's tokens, in the middle of the prompt
        text = protocol.model_sample(row, "passkey", tok, 4000).text
        enc = tok.backend.encode(text)
        needle = needle_kept.needle_positions(text, enc.offsets, row["answers"])
        assert row["answers"][0] in tok.decode([enc.ids[j] for j in needle])
        assert 24 < min(needle) and max(needle) < len(enc.ids) - 24
    table = measured("--model", str(model_dir), "--datasets", "passkey", "--num_samples", "2",
                     "--synthetic_length", "256", "--rules", "full,streamingllm,snapkv",
                     "--timings", "prefill,dge", "--k", "2", "--budgets", "16,1024",
                     "--window", "4", "--batch_size", "2")
    lines = {ln.split(" | ")[0].lstrip("| "): ln for ln in table.splitlines()}
    assert "full" not in lines  # FullKV evicts nothing
    assert lines["streamingllm/prefill/b16"].endswith("| 2 | 0.0 | 0.0 | 100.0 |")
    for cell in ("streamingllm/prefill/b1024", "snapkv/prefill/b1024", "snapkv/dge/k2/b1024"):
        assert lines[cell].endswith("| 2 | 100.0 | 100.0 | 0.0 |"), table


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--rules", "full"), "no cell evicts before decoding"),
        (("--protocol", "query_agnostic"), "query-aware runs only"),
    ],
)
def test_what_it_cannot_measure_is_one_line(model_dir, capsys, args, needle):
    from absl import flags

    from experiments.runner import parse_flags

    flags.FLAGS.unparse_flags()
    try:
        parse_flags(["needle_kept", "--model", str(model_dir), "--datasets", "passkey",
                     "--num_samples", "1", "--synthetic_length", "256", *args])
        assert needle_kept.run(["needle_kept"]) == 2
    finally:
        flags.FLAGS.unparse_flags()
    assert needle in capsys.readouterr().err
