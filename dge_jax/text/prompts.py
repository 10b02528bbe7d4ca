"""Prompts in, padded token arrays out: the host-side checks and shapes of a request.

Prompts are tokenized (through the chat template when asked), checked (clear errors instead
of a failure deep inside XLA), and left-padded to a length bucket, so that nearby lengths
share one compilation. Generated ids come back cut at the first EOS.

What a request needs of a model is its tokenizer (`dge_jax.checkpoints.tokenizer.Tokenizer`,
or None for a folder without tokenizer.json) and its `ModelConfig`, passed as they are: the
`text/` sits below the checkpoints and the `Model` they load.
"""

from __future__ import annotations

import dataclasses
import numbers
import pathlib
from collections.abc import Iterable, Sequence

import numpy as np

from dge_jax.config import ModelConfig

DEFAULT_CHUNK = 512
MIN_BUCKET = 16
# What every prompt error ends with: what a prompt may be.
PROMPT_FORMS = "a prompt is a str, or a list / 1-D integer array of token ids in [0, vocab)"


def bucket_length(n: int, chunk: int = DEFAULT_CHUNK, granule: int | None = None) -> int:
    """Padded prompt length for n tokens: a power of two up to `chunk`, then a multiple of it.

    e.g. chunk 512: 10 -> 16, 300 -> 512, 513 -> 1024, 1500 -> 1536.

    granule (a divisor of chunk; None: the chunk): a long chunk with a finer padding. Up to
    the granule as above; past it, n takes steps = ceil(n / chunk) prefill steps and pads to
    a multiple of steps * granule, so `decoding.prefill_prompt` splits it into `steps` equal
    steps of at most `chunk`. e.g. chunk 8192, granule 512: 5000 -> 5120, 9000 -> 9216 (two
    steps of 4608). Without a granule, the steps are the chunk.
    """
    g = granule or chunk
    if n <= g:  # capped at the granule, so prefill's "multiple of the step" always holds
        return min(g, max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length()))
    unit = -(-n // chunk) * g
    return -(-n // unit) * unit


def _is_id(x: object) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def _kind(value: object) -> str:
    """`value`'s type and a short repr, for error messages."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _check_text(i: int, text: str) -> str:
    """`text` when it is valid Unicode; a str with lone surrogates (undecodable bytes read
    with errors="surrogateescape", e.g. sys.argv) cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"prompt {i} is not valid UTF-8 text: character {e.start} is "
            f"{text[e.start]!r}, a lone surrogate (undecodable bytes); decode the bytes with "
            "errors='replace', or pass valid text"
        ) from None
    return text


def _bytes_error(name: str, value: object, ids_form: str) -> TypeError:
    """Bytes are neither text nor token ids: say how to pass either."""
    return TypeError(
        f"{name} is {type(value).__name__}, neither text nor token ids: decode it to a str "
        f"(.decode('utf-8')), or pass token ids as {ids_form}; {PROMPT_FORMS}"
    )


def _one_prompt(i: int, prompt: object) -> str | list[int]:
    """Prompt `i` as text or a list of int ids; anything else raises, naming what it is."""
    if isinstance(prompt, str):
        return _check_text(i, prompt)
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise _bytes_error(f"prompt {i}", prompt, "[id, ...]")
    if hasattr(prompt, "__array__") and not isinstance(prompt, Sequence):  # numpy, jax
        array = np.asarray(prompt)
        if array.ndim != 1:
            raise TypeError(
                f"prompt {i} is a {array.ndim}-D array of shape {array.shape}; token ids are a "
                f"1-D integer array; {PROMPT_FORMS}"
            )
        if array.size and (array.dtype.kind not in "iu"):
            raise TypeError(
                f"prompt {i} is a {array.dtype} array; token ids are integers (cast whole "
                f"numbers with .astype(int)); {PROMPT_FORMS}"
            )
        return [int(t) for t in array.tolist()]
    if isinstance(prompt, Sequence):
        ids = []
        for j, t in enumerate(prompt):
            if not _is_id(t):
                hint = ""
                if isinstance(t, str):
                    hint = " (for text, pass the whole prompt as one str)"
                elif isinstance(t, numbers.Real) and not isinstance(t, bool | np.bool_):
                    hint = " (cast whole numbers with int())"
                raise TypeError(
                    f"prompt {i} has {_kind(t)} at position {j}; token ids are ints{hint}; "
                    f"{PROMPT_FORMS}"
                )
            ids.append(int(t))
        return ids
    raise TypeError(f"prompt {i} is {_kind(prompt)}; {PROMPT_FORMS}")


def as_prompts(prompts: object) -> list[str] | list[list[int]]:
    """The batch as all text or all token-id lists, checked: a clear error naming the prompt
    and what to pass instead for bytes, floats, digit strings, mixed batches and the like.

    Accepted: one str; a list (or other sequence / iterable) of prompts, each a str or a
    sequence / 1-D integer array of token ids; a 2-D integer array, one row per prompt.
    """
    if isinstance(prompts, str):
        return [_check_text(0, prompts)]
    if isinstance(prompts, bytes | bytearray | memoryview):
        raise _bytes_error("prompts", prompts, "[[id, ...]]")
    if hasattr(prompts, "__array__") and not isinstance(prompts, Sequence):  # numpy, jax
        array = np.asarray(prompts)
        if array.ndim == 2 and array.dtype.kind in "iu":  # equal-length rows of ids
            return [[int(t) for t in row] for row in array.tolist()]
        if array.ndim == 1 and array.dtype.kind == "U":  # an array of texts
            return [_check_text(i, str(p)) for i, p in enumerate(array.tolist())]
        if array.ndim == 1 and array.dtype.kind in "iu":
            raise TypeError(
                "prompts is a 1-D integer array: if it is one prompt's token ids, pass a batch "
                "of one ([ids], or ids[None] as a 2-D array)"
            )
        raise TypeError(
            f"prompts is a {array.ndim}-D {array.dtype} array of shape {array.shape}; pass a "
            "list of prompts, or a 2-D integer array of token ids (one row per prompt); "
            f"{PROMPT_FORMS}"
        )
    if isinstance(prompts, dict | set | frozenset) or not isinstance(prompts, Iterable):
        raise TypeError(
            f"prompts must be a list of prompts (or one str), got {_kind(prompts)}; "
            f"{PROMPT_FORMS}"
        )
    items = list(prompts)
    if items and all(_is_id(t) for t in items):
        ids = [int(t) for t in items[:4]]
        shown = repr(ids) if len(items) <= 4 else repr(ids[:3])[:-1] + ", ...]"
        raise TypeError(
            f"prompts is a flat list of ints: if they are one prompt's token ids, pass a "
            f"batch of one, [{shown}]; {PROMPT_FORMS}"
        )
    out = [_one_prompt(i, p) for i, p in enumerate(items)]
    texts = [i for i, p in enumerate(out) if isinstance(p, str)]
    if texts and len(texts) != len(out):
        ids = next(i for i, p in enumerate(out) if not isinstance(p, str))
        raise TypeError(
            f"prompt {ids} is token ids but prompt {texts[0]} is text: one batch is all text "
            "or all token ids (encode the text with model.tokenizer.encode first)"
        )
    return out


def encode_prompts(
    tokenizer, prompts: Sequence[str], chat: bool, path: pathlib.Path | None = None
) -> list[list[int]]:
    """Token ids per prompt (through the chat template when `chat`). tokenizer: the model's
    (`encode`, `encode_chat`), or None: an error naming the model's folder `path`."""
    if tokenizer is None:
        raise ValueError(f"{path} has no tokenizer.json; pass token ids instead of text")
    if chat:
        return [tokenizer.encode_chat(p) for p in prompts]
    return [tokenizer.encode(p) for p in prompts]


def check_request(
    config: ModelConfig,
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
    ctx = config.max_position_embeddings
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(
                f"prompt {i} is empty (no tokens): pass non-empty text or at least one token id"
            )
        if len(ids) + max_new_tokens > ctx:
            if max_new_tokens >= ctx:  # the request itself is too long, whatever the prompt
                raise ValueError(
                    f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the "
                    f"model's context of {ctx} positions (prompt and new tokens share it); "
                    f"lower max_new_tokens below {ctx}"
                )
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it "
                f"exceeds the model's context of {ctx} positions (truncate the prompt)"
            )
        bad = [t for t in ids if not 0 <= int(t) < config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside [0, {config.vocab_size}): {bad[:5]}; "
                f"token ids index the model's vocabulary of {config.vocab_size}"
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
    wanted); chunk: prefill tokens per step at most; eos_ids: the model's EOS ids and the
    extra ones, sorted; attention: the prefill attention (`platform.ATTENTION`); kv_quant:
    how prefill's cache stores keys and values (`runtime.quantized.parse_kv_quant`).
    """

    prompt_ids: list[list[int]]
    tokens: np.ndarray
    lengths: np.ndarray
    max_new_tokens: int
    min_new_tokens: int
    buffer: int
    chunk: int
    eos_ids: tuple[int, ...]
    attention: str = "auto"
    kv_quant: str = "none"


def prepare(
    tokenizer,
    config: ModelConfig,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    chat: bool = False,
    chunk: int = DEFAULT_CHUNK,
    extra_eos_ids: Sequence[int] = (),
    granule: int | None = None,
    attention: str = "auto",
    path: pathlib.Path | None = None,
    kv_quant: str = "none",
) -> Request:
    """Text (or token-id) prompts -> a checked `Request` padded to its length bucket.

    tokenizer, config: the model's (`Model.tokenizer`, `Model.config`); path: its folder
    (`Model.path`), which the error for text prompts without a tokenizer names.
    prompts: one str, a list of prompts (each a str or a list / 1-D integer array of token
    ids; one batch is all text or all ids), or a 2-D integer array (one row per prompt).
    chunk / granule: `bucket_length`'s; attention: the prefill attention
    (`platform.ATTENTION`); kv_quant: the cache's storage (`Request.kv_quant`)."""
    if isinstance(chunk, bool | np.bool_) or not isinstance(chunk, numbers.Integral):
        raise TypeError(f"chunk (the prefill chunk size) must be an int >= 1, got {_kind(chunk)}")
    if chunk < 1:
        raise ValueError(
            f"chunk (the prefill chunk size, tokens per prefill step) must be >= 1, got {chunk}; "
            f"the default is {DEFAULT_CHUNK}"
        )
    chunk = int(chunk)
    prompts = as_prompts(prompts)
    if prompts and isinstance(prompts[0], str):
        prompt_ids = encode_prompts(tokenizer, prompts, chat, path)
    else:
        if chat:
            raise ValueError(
                "chat=True applies the chat template to text prompts; these prompts are token "
                "ids, which are used as given: pass the text, or drop chat=True"
            )
        prompt_ids = prompts
    check_request(config, prompt_ids, max_new_tokens, min_new_tokens)
    eos_ids = tuple(
        sorted(set(tokenizer.eos_ids if tokenizer else ()) | set(extra_eos_ids))
    )
    t = bucket_length(max(map(len, prompt_ids)), chunk, granule)
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
        attention=attention,
        kv_quant=kv_quant,
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
