"""`experiments.decided_early`: which rows FullKV's first k tokens already answer, from
hand-made rows and a one-character-a-token tokenizer."""

from __future__ import annotations

import json

from experiments import decided_early


class Chars:
    """A tokenizer of one token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))


def row(pred: str, answer: str, new_tokens: int | None = None) -> dict:
    return {"dataset": "passkey", "cell": "full", "sample_id": pred, "pred": pred,
            "answers": [answer], "all_classes": None, "new_tokens": new_tokens}


def test_drafted_ks_reads_the_drafting_cells_only():
    cells = ["full", "snapkv/prefill/b128", "snapkv/dge/k4/b128", "snapkv/dge_w/k2/b64",
             "snapkv/dge_d/k8/b128", "snapkv/dge/k8a/b128", "snapkv/lookahead/k16/b128",
             "snapkv/decode/b128/d128/i4"]  # fmt: skip
    assert decided_early.drafted_ks(cells) == [2, 4, 8]


def test_a_row_is_decided_once_its_first_k_tokens_hold_the_answer():
    rows = [row("123", "123", new_tokens=4),  # answered by its 3rd token (EOS not counted)
            row("ab 42", "42", new_tokens=5),  # by its 5th
            row("no", "42", new_tokens=9)]  # wrong: never counted; re-encoded apart
    counts = decided_early.decided(rows, [2, 3, 5], Chars())["passkey"]
    assert counts == {"rows": 3, "correct": 2, "re_encoded_apart": 0, 2: 0, 3: 1, 5: 2}
    apart = decided_early.decided([row("123", "123", new_tokens=9)], [3], Chars())
    assert apart["passkey"]["re_encoded_apart"] == 1
    text = decided_early.table(decided_early.decided(rows, [3], Chars()), [3])
    assert "| passkey | 3 | 2 | 1 | 0 |" in text and "| all | 3 | 2 | 1 | 0 |" in text


def test_a_folder_without_fullkv_is_refused(tmp_path, capsys):
    line = row("123", "123") | {"cell": "snapkv/dge/k4/b128", "key": "a", "config_hash": "b"}
    (tmp_path / "predictions.jsonl").write_text(json.dumps(line) + "\n")
    assert decided_early.main([str(tmp_path)]) == 2
    assert "no FullKV cell" in capsys.readouterr().err
