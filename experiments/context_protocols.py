"""The runner's --protocol: when the question is seen, and how many questions one context serves.

- `query_aware` (default, LongBench's): the prompt, question included, is prefilled and
  evicted as one (`dge_jax.generate_grid`).
- `query_agnostic` (kvpress's default): the context is compressed alone, then the question
  and answer prefix are fed to the compressed cache (`dge_jax.generate_for_contexts`). DGE
  and DGE-W prefill the question and draft before they compress the context: DGE's natural
  form here.
- `shared_context`: the same, one compressed cache per context and every question of it
  answered from that cache; the context's first row is the anchor DGE drafts on. Rows of a
  context are the rows whose prompts agree up to their question (a suite's shared tasks
  give several: the synthetic `multikey_shared`, RULER's `niah_multiquery_shared`); `--anchor
  N` drafts on each context's row N instead. Each prediction line records its
  `question_index`: 0 for the anchor, then the others in row order.

The split: the runner renders each sample as in query_aware (truncation, the model's prompt
format: chat template or raw prompt, answer prefix), then cuts the text where the row's
question starts (`question_text`); the two parts are tokenized apart (the context with the
tokenizer's special tokens), as kvpress tokenizes its context and question.
"""

from __future__ import annotations

from dge_jax.generation import generate_for_contexts
from dge_jax.stages import GenerationResult
from experiments import protocol, suites

PROTOCOLS = ("query_aware", "query_agnostic", "shared_context")


def question_text(row: dict, dataset: str) -> str:
    """The tail of the row's raw prompt that follows its context: the suite's own split
    (`Suite.question`), else the prompt after the row's `context` text."""
    suite = suites.for_dataset(dataset)
    if suite.question is not None:
        return suite.question(row, dataset)
    prompt = protocol.build_prompt(row, dataset)
    context = row.get("context")
    if not context or context not in prompt:
        raise ValueError(
            f"{dataset}: a row's prompt does not hold its context text, so it cannot be split "
            "for --protocol query_agnostic / shared_context; use --protocol query_aware"
        )
    return prompt[prompt.rindex(context) + len(context):]


def split(text: str, question: str, where: str) -> tuple[str, str]:
    """(context part, question part) of a rendered sample: cut where `question` last starts."""
    at = text.rfind(question)
    if not question.strip() or at < 0:
        raise ValueError(
            f"{where}: the question was not found in the rendered prompt (truncated away?); "
            "raise --max_length or use --protocol query_aware"
        )
    return text[:at], text[at:]


def check_rows(rows: dict[str, list[dict]], tok, max_length: int, with_answer_prefix: bool,
               protocol_name: str, anchor: int = 0) -> None:
    """Every row rendered and split as `generate` will (before the run folder is claimed, so a
    fix is not refused as another configuration): a ValueError for an empty question or one
    truncated away, and under shared_context for a context with no question `anchor` or one
    whose rows `max_length` cuts differently (they could not share one compressed cache)."""
    for dataset, items in rows.items():
        fed = []  # per row: (its context part as fed, its raw prompt's token count)
        for row in items:
            where = f"{dataset} row {row['_id']}"
            question = question_text(row, dataset)
            if not question.strip():
                raise ValueError(
                    f"{where}: its question is empty; --protocol {protocol_name} feeds the "
                    "question to the compressed context: give the row a question, or use "
                    "--protocol query_aware")
            sample = protocol.model_sample(row, dataset, tok, max_length, with_answer_prefix)
            fed.append((split(sample.text, question, where)[0], sample.num_prompt_tokens))
        if protocol_name != "shared_context":
            continue
        for group in context_groups(items, dataset):
            first = items[group[0]]["_id"]
            if anchor >= len(group):
                raise ValueError(f"{dataset}: --anchor {anchor}, but the context of row "
                                 f"{first} has only {len(group)} question(s): pass an "
                                 f"--anchor below {len(group)}")
            cut = [items[i]["_id"] for i in group if fed[i][0] != fed[group[0]][0]]
            if cut:
                longest = max(fed[i][1] for i in group)
                raise ValueError(
                    f"{dataset}: --max_length {max_length} cuts the prompts of rows "
                    f"{first} and {cut[0]} (one context) at different places, so they "
                    f"cannot share one compressed context: raise --max_length to {longest} "
                    "(their longest prompt), or use --protocol query_agnostic")


def context_groups(rows: list[dict], dataset: str) -> list[list[int]]:
    """The indices of `rows` grouped by context, each group and the groups in row order: rows
    whose raw prompts agree up to their question (`question_text`) share one context."""
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        prompt = protocol.build_prompt(row, dataset)
        groups.setdefault(prompt[: len(prompt) - len(question_text(row, dataset))], []).append(i)
    return list(groups.values())


def shared_batches(dataset: str, rows: list[dict], pending: list,
                   anchor: int = 0) -> list[tuple[int, list]]:
    """One batch per context that still lacks a prediction: every row of that context, the
    anchor (its row `anchor` in row order) first, then the others in row order, each with the
    cells it lacks (possibly none); a line's question_index is its place in that order. A
    batch's length is its longest answer's (each row is answered to its own: `generate`)."""
    missing = {row["_id"]: cells for row, cells in pending}
    out = []
    for group in ([rows[i] for i in indices] for indices in context_groups(rows, dataset)):
        if not any(r["_id"] in missing for r in group):
            continue
        if anchor >= len(group):
            raise ValueError(f"{dataset}: --anchor {anchor}, but a context has only "
                             f"{len(group)} questions (row {group[0]['_id']} and on)")
        group = [group[anchor], *group[:anchor], *group[anchor + 1:]]
        out.append((max(protocol.max_new_tokens(dataset, row) for row in group),
                    [(row, missing.get(row["_id"], ())) for row in group]))
    return out


def assign_contexts(rows: dict[str, list[dict]], pending: dict[str, list], share,
                    anchor: int = 0) -> dict[str, list[tuple[int, list]]]:
    """`distributed.assign` for shared contexts: each dataset's `shared_batches`, numbered
    across datasets in run order, the ones this process predicts (`share.owns`)."""
    work, number = {}, 0
    for dataset, items in rows.items():
        work[dataset] = []
        for batch in shared_batches(dataset, items, pending[dataset], anchor):
            if share.owns(number):
                work[dataset].append(batch)
            number += 1
    return work


def generate(model, tok, samples, batch, dataset: str, evictions, protocol_name: str,
             **options) -> tuple[list[GenerationResult], list[int]]:
    """(one result per eviction over the batch's rows, each row's question index) under
    `protocol_name`; samples: the batch's rendered samples (`protocol.prepare_sample`)."""
    parts = [split(s.text, question_text(row, dataset), f"{dataset} row {row['_id']}")
             for s, (row, _) in zip(samples, batch, strict=True)]
    contexts = [tok.encode(c) for c, _ in parts]
    questions = [tok.encode(q, add_special_tokens=False) for _, q in parts]
    if protocol_name == "query_agnostic":
        out = generate_for_contexts(model, contexts, [[q] for q in questions], evictions,
                                    **options)  # fmt: skip
        return [cell[0] for cell in out], [0] * len(batch)
    if len({tuple(c) for c in contexts}) != 1:
        raise ValueError(f"{dataset}: a shared_context batch must hold one context's rows")
    lengths = [protocol.max_new_tokens(dataset, row) for row, _ in batch]  # each row's own
    options = {**options, "max_new_tokens": max(lengths)}
    out = generate_for_contexts(model, contexts[:1], [questions], evictions,
                                answer_lengths=lengths, **options)
    merged = [GenerationResult(
        prompt_tokens=[r.prompt_tokens[0] for r in cell], tokens=[r.tokens[0] for r in cell],
        texts=[r.texts[0] for r in cell], kept=None,
        k=None if cell[0].k is None else [r.k[0] for r in cell],
    ) for cell in out]  # fmt: skip
    return merged, list(range(len(batch)))

