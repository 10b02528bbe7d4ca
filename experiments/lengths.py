"""The runner's prompt length: how many positions each row needs besides its prompt (its
answer, the prompt format around the prompt, the answer prefix), the default max length
that leaves every row room in the model's context, and the checks of --max_length against
them, made before the run folder is claimed.
"""

from __future__ import annotations

from dge_jax.checkpoints.tokenizer import RAW_PROMPT, prompt_format, prompt_renderer
from experiments import protocol
from experiments.run_config import RunConfig, UsageError


def default_max_length(model, suite: dict[str, list[dict]]) -> int:
    """The model's context minus, for the most demanding row, its generation length and
    what the prompt format and answer prefix add around the truncated prompt, so that every
    prompt the runner feeds, with its answer, fits the context."""
    needs = answer_needs(model, suite)
    return model.config.max_position_embeddings - max(needs.values(), default=0)


def answer_needs(model, suite: dict[str, list[dict]]) -> dict[tuple[str, str], int]:
    """(dataset, row id) -> the positions a row needs besides its truncated prompt: its
    generation length, what the model's prompt format adds around the prompt (its chat
    template; a model without one: its special tokens) and the answer prefix."""
    tok = model.tokenizer
    wrap = len(tok.encode(prompt_renderer(tok)("")))  # what the format adds around a prompt
    return {(d, row["_id"]): protocol.max_new_tokens(d, row) + wrap
            + len(tok.encode(protocol.answer_prefix(d, row)))
            for d, rows in suite.items() for row in rows}


def prompt_length(config: RunConfig, model, suite: dict[str, list[dict]]) -> tuple[int, str]:
    """(the prompts' max length, a line saying where it comes from), checked before the folder
    is claimed: a row whose answer alone overflows the model's context, or (with
    --max_length) one that does not fit beside a prompt of that length, is a UsageError naming
    it; the default is the model's context minus the most demanding row's needs (one length
    for every task, as LongBench's pred.py), and the line names that row."""
    ctx = model.config.max_position_embeddings
    needs = answer_needs(model, suite)
    if not needs:
        return config.max_length or ctx, f"max length {config.max_length or ctx} tokens"
    (dataset, row_id), need = max(needs.items(), key=lambda item: item[1])
    asked = protocol.max_new_tokens(dataset, next(r for r in suite[dataset]
                                                  if r["_id"] == row_id))
    where = f"{dataset} row {row_id}"
    around = ("answer prefix" if prompt_format(model.tokenizer) == RAW_PROMPT
              else "chat template and answer prefix")
    if need > ctx - 2:
        raise UsageError(
            f"{where} asks for {asked} new tokens, which with the {around} ({need - asked} "
            f"tokens) leaves no room in the model's context of {ctx} "
            f"positions for a prompt; lower that row's max_new_tokens (below "
            f"{ctx - 2 - need + asked})")
    if config.max_length is not None:
        if config.max_length + need > ctx:
            raise UsageError(
                f"--max_length {config.max_length} leaves {ctx - config.max_length} of the "
                f"model's {ctx} positions for the answer; {where} needs {need} ({asked} new "
                f"tokens, the {around}): lower --max_length to "
                f"{ctx - need} or less")
        return config.max_length, f"max length {config.max_length} tokens (--max_length)"
    others = [n for key, n in needs.items() if key[0] != dataset]
    outlier = (f"; without {dataset} it would be {ctx - max(others)}: run that task apart, or "
               "pass --max_length" if others and max(others) < need else "")
    return ctx - need, (
        f"max length {ctx - need} tokens (the default: the model's {ctx} positions less the "
        f"{need} that {where} needs for its {asked} new tokens, {around}; longer prompts "
        f"are cut in the middle{outlier})")
