"""Whether each cell's eviction keeps the needle: per cell, the share of the answer's tokens in
the prompt that a (global layer, kv head) holds right after eviction, over a suite's rows.

    python -m experiments.needle_kept --model gemma3-270m --suite ruler \
        --datasets niah_single_2 --ruler_length 4096 --num_samples 8 \
        --rules snapkv --timings prefill,dge,dge_d,lookahead --k 4 --budgets 128

Accuracy says which observation set wins; this says why, before any answer is read: a cell
whose kept sets lose the needle cannot answer from the cache. It takes the runner's flags
(the same rows, prompt format, prompt length and cells as `experiments.longbench`, query-
aware only), runs each batch's grid once, generating only past the largest k, and reads
`GenerationResult.kept`. The needle is every prompt token whose characters overlap an
occurrence of one of the row's answers (a needle suite's value; a row whose answer is not in
its prompt is counted apart). Sliding-window layers keep their window whatever the rule does,
so only global layers count. Nothing is written: it prints one table.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
from absl import app

from experiments import protocol
from experiments.lengths import prompt_length
from experiments.run_config import FLAGS, RunConfig, UsageError
from experiments.runner import (
    generation_lengths,
    grid_evictions,
    parse_flags,
    run_identity,
    suite_rows,
)


def needle_positions(text: str, offsets: Sequence[tuple[int, int]],
                     answers: Sequence[str]) -> list[int]:
    """Token indices whose character span [start, end) overlaps an occurrence of an answer in
    `text` (offsets: the tokenizer's, one per token; special tokens' (0, 0) never overlap)."""
    spans = []
    for answer in filter(None, answers):
        at = text.find(answer)
        while at >= 0:
            spans.append((at, at + len(answer)))
            at = text.find(answer, at + 1)
    return [j for j, (s, e) in enumerate(offsets)
            if e > s and any(s < b and e > a for a, b in spans)]


def kept_shares(kept: Sequence[Sequence[Sequence[int]]], needle: Sequence[int],
                layers: Sequence[int]) -> np.ndarray:
    """[len(layers), kv heads]: the share of `needle`'s positions each head of each listed
    layer kept (kept: one row's [layer][head] sorted positions)."""
    want = set(needle)
    return np.array([[len(want.intersection(kept[la][h])) / len(want)
                      for h in range(len(kept[la]))] for la in layers])


def summary(shares: dict[str, list[np.ndarray]], missing: int) -> str:
    """The printed table: per cell, rows, mean share kept, the heads keeping all of it and
    those keeping none (over rows, global layers and kv heads)."""
    lines = ["| cell | rows | needle tokens kept (mean %) | heads keeping all (%) | "
             "heads keeping none (%) |", "|---|---:|---:|---:|---:|"]
    for cell, per_row in shares.items():
        if not per_row:  # every row lacked its answer: nothing to average, not "nan"
            lines.append(f"| {cell} | 0 | - | - | - |")
            continue
        a = np.stack(per_row)
        lines.append(f"| {cell} | {len(per_row)} | {100 * a.mean():.1f} | "
                     f"{100 * (a == 1).mean():.1f} | {100 * (a == 0).mean():.1f} |")
    note = f"\n{missing} row(s) without their answer in the prompt left out." if missing else ""
    return "\n".join(lines) + note


def measure(config: RunConfig) -> str:
    """Loads the model and rows as the runner does, runs every batch's grid, and returns
    `summary`'s table."""
    import dge_jax
    from dge_jax.generation import generate_grid

    if config.protocol != "query_aware":
        raise UsageError("needle_kept reads query-aware runs only (drop --protocol)")
    model = dge_jax.load(config.model, dtype=config.dtype)
    tok = model.tokenizer
    suite = config.suite
    datasets = list(config.datasets or suite.default_datasets(config.rows))
    rows = suite_rows(model, suite, config.rows, datasets, config.num_samples)
    max_length, _ = prompt_length(config, model, rows)
    evictions = grid_evictions(config, run_identity(config, model, max_length),
                               generation_lengths(rows))
    # FullKV keeps everything; `decode` evicts only while decoding, after what this reads.
    cells = [c for c in config.cells
             if evictions[c] is not None and evictions[c].timing.kind != "decode"]
    if not cells:
        raise UsageError("no cell evicts before decoding: name a rule besides full (--rules) "
                         "and a timing besides decode (--timings)")
    new = 1 + max(evictions[c].timing.k for c in cells)
    layers = [la for la in range(model.config.num_layers) if not model.config.window(la)]
    shares: dict[str, list[np.ndarray]] = {c.id: [] for c in cells}
    missing = 0
    for dataset, drows in rows.items():
        for at in range(0, len(drows), config.batch_size):
            batch = drows[at:at + config.batch_size]
            samples = [protocol.model_sample(r, dataset, tok, max_length, config.answer_prefix)
                       for r in batch]
            encoded = [tok.backend.encode(s.text) for s in samples]
            results = generate_grid(model, [e.ids for e in encoded],
                                    [evictions[c] for c in cells], max_new_tokens=new,
                                    chunk=config.chunk, attention=config.attention,
                                    kv_quant=config.kv_quant, sliding_cache=config.sliding_cache)
            for i, (row, s, e) in enumerate(zip(batch, samples, encoded, strict=True)):
                needle = needle_positions(s.text, e.offsets, row["answers"])
                missing += not needle
                for c, res in zip(cells, results, strict=True):
                    if needle:
                        shares[c.id].append(kept_shares(res.kept[i], needle, layers))
            print(f"{dataset}: {min(at + len(batch), len(drows))} of {len(drows)} rows",
                  file=sys.stderr)
    return summary(shares, missing)


def run(argv) -> int:
    if len(argv) > 1:
        print(f"error: unexpected argument {argv[1]!r}; see --help", file=sys.stderr)
        return 2
    try:
        print(measure(RunConfig.from_flags(FLAGS)))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    app.run(run, flags_parser=parse_flags)
