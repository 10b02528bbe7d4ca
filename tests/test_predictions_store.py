"""`experiments.predictions`: durable appends, torn-line repair, keys and configuration hashes."""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from experiments.predictions import (
    PREDICTIONS_FILE,
    QUARANTINE_FILE,
    PredictionStore,
    config_hash,
    prediction_key,
    read_predictions,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


def row(key: str, pred: str = "p", **extra) -> dict:
    return {"key": key, "config_hash": "h", "dataset": "trec", "sample_id": key, "cell": "full",
            "pred": pred, "answers": ["a"], **extra}


def file_lines(out_dir) -> list[bytes]:
    data = (out_dir / PREDICTIONS_FILE).read_bytes()
    assert data.endswith(b"\n")
    return data.split(b"\n")[:-1]


def test_append_persists_and_reopens(tmp_path):
    store = PredictionStore(tmp_path)
    assert store.rows == [] and store.done == set()
    store.append([row("a"), row("b")])
    store.append([row("c")])
    again = PredictionStore(tmp_path)
    assert [r["key"] for r in again] == ["a", "b", "c"]
    assert again.done == {"a", "b", "c"}
    assert [json.loads(line)["key"] for line in file_lines(tmp_path)] == ["a", "b", "c"]


def test_torn_last_line_is_cut_before_appending(tmp_path):
    store = PredictionStore(tmp_path)
    store.append([row("a"), row("b")])
    path = tmp_path / PREDICTIONS_FILE
    whole = path.read_bytes()
    torn = json.dumps(row("c", pred="half written")).encode()[:25]
    path.write_bytes(whole + torn)  # a kill in the middle of writing line "c"
    assert [r["key"] for r in read_predictions(path)] == ["a", "b"]  # reading never repairs
    assert path.read_bytes() == whole + torn

    store = PredictionStore(tmp_path)
    assert path.read_bytes() == whole  # cut on opening
    assert store.done == {"a", "b"}
    store.append([row("c")])
    assert [json.loads(line)["key"] for line in file_lines(tmp_path)] == ["a", "b", "c"]


def test_whole_object_without_newline_counts_as_torn(tmp_path):
    """Killed between the JSON text and its newline: the line is dropped and redone."""
    path = tmp_path / PREDICTIONS_FILE
    first = json.dumps(row("a")) + "\n"
    path.write_text(first + json.dumps(row("b")))
    store = PredictionStore(tmp_path)
    assert store.done == {"a"}
    assert path.read_text() == first
    store.append([row("b")])
    assert [json.loads(line)["key"] for line in file_lines(tmp_path)] == ["a", "b"]


def test_unicode_line_separators_round_trip(tmp_path):
    """U+2028 and friends are line breaks for str.splitlines but not for the file format."""
    tricky = "a\u2028b\u2029c\x85d\x0be\x0cf\x1cg\rh\ni \u00e9\u4e2d\U0001f600"
    store = PredictionStore(tmp_path)
    store.append([row("a", pred=tricky), row("b", pred="plain")])
    assert "\u2028" in (tmp_path / PREDICTIONS_FILE).read_text(encoding="utf-8")  # left raw
    again = PredictionStore(tmp_path)
    assert [r["pred"] for r in again] == [tricky, "plain"]
    assert len(file_lines(tmp_path)) == 2
    again.append([row("c")])  # the repair pass must not cut at U+2028 either
    assert [r["pred"] for r in PredictionStore(tmp_path)] == [tricky, "plain", "p"]


def test_appending_an_existing_key_is_a_no_op(tmp_path):
    store = PredictionStore(tmp_path)
    store.append([row("a", pred="first")])
    before = (tmp_path / PREDICTIONS_FILE).read_bytes()
    store.append([row("a", pred="second")])
    assert (tmp_path / PREDICTIONS_FILE).read_bytes() == before
    reopened = PredictionStore(tmp_path)
    reopened.append([row("a", pred="third"), row("b")])
    assert [(r["key"], r["pred"]) for r in PredictionStore(tmp_path)] == [
        ("a", "first"), ("b", "p")]
    assert [r["key"] for r in reopened] == ["a", "b"]


def test_duplicate_keys_within_one_append_are_written_once(tmp_path):
    store = PredictionStore(tmp_path)
    store.append([row("a", pred="first"), row("a", pred="second")])
    assert [r["pred"] for r in PredictionStore(tmp_path)] == ["first"]
    assert [r["pred"] for r in store] == ["first"]


def test_config_hash_is_stable_and_order_free():
    a = {"model": "m", "max_length": 512, "policy_options": {"window": 8, "kernel": 7}}
    b = {"policy_options": {"kernel": 7, "window": 8}, "max_length": 512, "model": "m"}
    assert config_hash(a) == config_hash(b)
    assert len(config_hash(a)) == 16 and int(config_hash(a), 16) >= 0
    assert config_hash(a) != config_hash({**a, "max_length": 256})
    assert config_hash(a) != config_hash({**a, "policy_options": {"window": 4, "kernel": 7}})
    # A known value: hashes written to old prediction files must keep matching.
    assert config_hash({}) == "44136fa355b3678a"


def test_prediction_key_depends_on_every_part():
    key = prediction_key("h1", "trec", "id1")
    assert len(key) == 24
    assert key == prediction_key("h1", "trec", "id1")
    assert len({key, prediction_key("h2", "trec", "id1"), prediction_key("h1", "samsum", "id1"),
                prediction_key("h1", "trec", "id2")}) == 4


def quarantined(out_dir) -> list[dict]:
    path = out_dir / QUARANTINE_FILE
    return [json.loads(line) for line in path.read_bytes().split(b"\n")[:-1]]


def test_a_corrupt_line_in_the_middle_loses_nothing_else(tmp_path):
    """The old repair cut the file at the first bad line, dropping every line after it."""
    store = PredictionStore(tmp_path)
    store.append([row(f"k{i}") for i in range(75)])
    path = tmp_path / PREDICTIONS_FILE
    lines = path.read_bytes().split(b"\n")[:-1]
    damaged = lines[27][: len(lines[27]) // 2] + b"\xff garbage"
    path.write_bytes(b"".join(line + b"\n" for line in [*lines[:27], damaged, *lines[28:]]))
    warnings: list[str] = []

    store = PredictionStore(tmp_path, warn=warnings.append)

    assert [r["key"] for r in store] == [f"k{i}" for i in range(75) if i != 27]
    assert path.read_bytes() == b"".join(line + b"\n" for i, line in enumerate(lines) if i != 27)
    (record,) = quarantined(tmp_path)
    assert record["line"] == 28 and "not JSON" in record["reason"]
    assert record["raw"].encode("utf-8", "surrogateescape") == damaged  # byte for byte
    assert len(warnings) == 1 and "line 28" in warnings[0] and QUARANTINE_FILE in warnings[0]
    store.append([row("k27")])  # the run recomputes only what is missing
    assert {r["key"] for r in PredictionStore(tmp_path)} == {f"k{i}" for i in range(75)}


def test_lines_that_parse_but_are_not_predictions_are_quarantined(tmp_path):
    path = tmp_path / PREDICTIONS_FILE
    good = json.dumps(row("a")) + "\n"
    path.write_text(good + "[1, 2]\n" + json.dumps({"key": "x"}) + "\n\n" + json.dumps(row("b"))
                    + "\n")
    warnings: list[str] = []
    store = PredictionStore(tmp_path, warn=warnings.append)
    assert [r["key"] for r in store] == ["a", "b"]
    reasons = {r["line"]: r["reason"] for r in quarantined(tmp_path)}
    assert set(reasons) == {2, 3}
    assert "not an object" in reasons[2] and "lacks the field(s)" in reasons[3]
    assert len(warnings) == 2
    assert read_predictions(path) == [row("a"), row("b")]


def test_reading_warns_but_never_changes_the_file(tmp_path):
    path = tmp_path / PREDICTIONS_FILE
    data = (json.dumps(row("a")) + "\nnot json\n" + json.dumps(row("b")) + "\n").encode()
    path.write_bytes(data)
    warnings: list[str] = []
    assert [r["key"] for r in read_predictions(path, warn=warnings.append)] == ["a", "b"]
    assert path.read_bytes() == data and not (tmp_path / QUARANTINE_FILE).exists()
    assert len(warnings) == 1 and "line 2" in warnings[0]


WRITER = """
import sys
from experiments.predictions import PredictionStore
store = PredictionStore(sys.argv[1], warn=lambda m: None)
print(len(store.rows), flush=True)
i = 0
while True:
    store.append([{"key": f"{sys.argv[2]}-{i}-{j}", "config_hash": "h", "dataset": "d",
                   "sample_id": str(i), "cell": "c", "pred": "x" * 2000, "answers": ["a"]}
                  for j in range(3)])
    i += 1
"""


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_killed_writers_never_shrink_the_set_of_lines(tmp_path, seed):
    """SIGKILL a writer at random moments, again and again: every line that was whole in the
    file before a kill is still there (or in quarantine, for a torn tail) afterwards."""
    rng = random.Random(seed)
    path = tmp_path / PREDICTIONS_FILE
    env = dict(os.environ, PYTHONPATH=str(REPO))
    before: set[str] = set()
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(attempt)],
                                cwd=REPO, env=env, stdout=subprocess.PIPE)
        proc.stdout.readline()  # the store is open (and repaired): now let it write a while
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        after = {r["key"] for r in PredictionStore(tmp_path, warn=lambda m: None)}
        assert before <= after, f"attempt {attempt}: lines lost: {sorted(before - after)[:5]}"
        assert path.read_bytes().endswith(b"\n") or not path.read_bytes()
        before = after
    assert before, "no writer got to write a line"
