"""Prompts in, padded token arrays out: the host-side checks and shapes of a request.

Prompts are tokenized (through the chat template when asked), checked (clear errors instead
of a failure deep inside XLA), and left-padded to a length bucket, so that nearby lengths
share one compilation. Generated ids come back cut at the first EOS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dge_jax.model import Model

DEFAULT_CHUNK = 512
MIN_BUCKET = 16


def bucket_length(n: int, chunk: int = DEFAULT_CHUNK) -> int:
    """Padded prompt length for n tokens: a power of two up to `chunk`, then a multiple of it.

    e.g. chunk 512: 10 -> 16, 300 -> 512, 513 -> 1024, 1500 -> 1536.
    """
    if n <= chunk:  # capped at the chunk, so prefill's "multiple of the chunk" always holds
        return min(chunk, max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()))
    return -(-n // chunk) * chunk


def encode_prompts(model: Model, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids per prompt (through the chat template when `chat`)."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path} has no tokenizer.json; pass token ids instead of text")
    if chat:
        return [model.tokenizer.encode_chat(p) for p in prompts]
    return [model.tokenizer.encode(p) for p in prompts]


def check_request(
    model: Model,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    min_new_tokens: int = 0,
) -> None:
    """Clear errors for requests that would otherwise fail deep inside XLA or silently."""
    for name, value in (("max_new_tokens", max_new_tokens), ("min_new_tokens", min_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(
            f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got "
            f"{min_new_tokens} (EOS is banned until min_new_tokens tokens exist)"
        )
    if not prompt_ids:
        raise ValueError("no prompts given")
    ctx = model.config.max_position_embeddings
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        if len(ids) + max_new_tokens > ctx:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it "
                f"exceeds the model's context of {ctx} positions (truncate the prompt)"
            )
        bad = [t for t in ids if not 0 <= int(t) < model.config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {model.config.vocab_size}): {bad[:5]}"
            )


def pad_left(prompt_ids: Sequence[Sequence[int]], t: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, t] int32 left-padded with 0, lengths [B] int32."""
    tokens = np.zeros((len(prompt_ids), t), np.int32)
    for i, ids in enumerate(prompt_ids):
        tokens[i, t - len(ids) :] = ids
    return tokens, np.array([len(ids) for ids in prompt_ids], np.int32)


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked, padded batch: what every stage of `dge_jax.generation` reads.

    prompt_ids: the ids fed per row; tokens [B, T] int32 left-padded to the bucket T and
    lengths [B] int32 (`pad_left`); buffer: the decode token buffer (a bucket >= the tokens
    wanted); eos_ids: the model's EOS ids and the extra ones, sorted.
    """

    prompt_ids: list[list[int]]
    tokens: np.ndarray
    lengths: np.ndarray
    max_new_tokens: int
    min_new_tokens: int
    buffer: int
    chunk: int
    eos_ids: tuple[int, ...]


def prepare(
    model: Model,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    chat: bool = False,
    chunk: int = DEFAULT_CHUNK,
    extra_eos_ids: Sequence[int] = (),
) -> Request:
    """Text (or token-id) prompts -> a checked `Request` padded to its length bucket."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompts and isinstance(prompts[0], str):
        prompt_ids = encode_prompts(model, prompts, chat)
    else:
        if chat:
            raise ValueError(
                "chat=True applies the chat template to text prompts; these prompts are token "
                "ids, which are used as given: pass the text, or drop chat=True"
            )
        prompt_ids = [list(map(int, p)) for p in prompts]
    check_request(model, prompt_ids, max_new_tokens, min_new_tokens)
    eos_ids = tuple(
        sorted(set(model.tokenizer.eos_ids if model.tokenizer else ()) | set(extra_eos_ids))
    )
    t = bucket_length(max(map(len, prompt_ids)), chunk)
    tokens, lengths = pad_left(prompt_ids, t)
    return Request(
        prompt_ids=prompt_ids,
        tokens=tokens,
        lengths=lengths,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        buffer=bucket_length(max_new_tokens, chunk),  # the loop stops at the limit
        chunk=chunk,
        eos_ids=eos_ids,
    )


def cut_at_eos(tokens: np.ndarray, eos_ids: Sequence[int]) -> list[list[int]]:
    """Per row, the ids up to and including the first EOS (as transformers returns them).

    tokens: [B, N] int -> B lists of ints.
    """
    rows = []
    for row in tokens.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        rows.append(row[:end])
    return rows
