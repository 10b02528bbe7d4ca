"""A `tokenizers.Tokenizer` and transformers' tokenizer files rebuilt from GGUF metadata.

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary, merges, scores and token
types as `tokenizer.ggml.*` metadata. Two kinds are rebuilt, as transformers' GGUF loader
builds them (`integrations/gguf/gguf_tokenizer_mapping.py`), from `tokenizers`' own parts:

- `gpt2`: byte-level BPE with the file's merges (SmolLM2 and other Llama-architecture files);
- `llama` in a `gemma3` file: Gemma's SentencePiece BPE with byte fallback. The file lists no
  merges, so they are recovered from the vocabulary the way transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

Meta = Mapping[str, Any]

# tokenizer.ggml.pre values whose pre-tokenizer we rebuild: every number code point split off
# alone (llama.cpp's `\p{N}` pass), then GPT-2's byte-level regex. "gpt-2" has no digit pass.
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_PLAIN_PRE = frozenset({"gpt-2", "gpt2"})

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp token types
_SPACE = "\u2581"  # SentencePiece's visible space


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` value."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        # Digits splits every Unicode number (Rust char::is_numeric == \p{N}) into its own piece.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _PLAIN_PRE:
        return byte_level
    supported = sorted(_DIGIT_SPLIT_PRE | _PLAIN_PRE)
    raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: {supported}")


def _ends(tokens: list[str], meta: Meta) -> dict[str, tuple[str, int]]:
    """{"bos"/"eos": (token, id)} for the ends the file's add_*_token flags ask to add."""
    ends = {}
    for which in ("bos", "eos"):
        if meta.get(f"tokenizer.ggml.add_{which}_token", False):
            index = meta[f"tokenizer.ggml.{which}_token_id"]
            ends[which] = (tokens[index], index)
    return ends


def _template(ends: dict[str, tuple[str, int]]) -> processors.TemplateProcessing:
    """BOS / EOS around one sequence (and around each of a pair, as transformers writes it)."""
    bos = [ends["bos"][0]] if "bos" in ends else []
    eos = [ends["eos"][0]] if "eos" in ends else []
    single = [*bos, "$A", *eos]
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(ends.values())
    )


def _add_typed_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens as special added tokens, user-defined ones (already in the vocabulary) as
    plain added tokens, so `<start_of_turn>` in text stays one token, as in llama.cpp. Adding a
    token the model already has keeps its id."""
    vocab = tok.get_vocab()
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _TOKEN_CONTROL]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in kinds
            if k == _TOKEN_USER_DEFINED and t in vocab
        ]
    )


def byte_level_tokenizer(meta: Meta, tokens: list[str]) -> Tokenizer:
    """Byte-level BPE (`tokenizer.ggml.model` = gpt2) with the file's merges."""
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF tokenizer.ggml.merges entry is not two space-separated tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    ends = _ends(tokens, meta)
    byte_level = processors.ByteLevel(trim_offsets=False)
    tok.post_processor = processors.Sequence([byte_level, _template(ends)]) if ends else byte_level
    return tok


def merges_from_vocabulary(tokens: list[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece BPE vocabulary implies, best first.

    Every way to cut a token into two tokens of the vocabulary is a merge. They are ranked by
    the token they make, earlier in the file first (Gemma's file order is its merge order; its
    scores are not), then by a longer left part, then a longer right part; cuts of one token
    with equal lengths keep the order of their parts' ids. transformers'
    `generate_merges(vocab, vocab_scores={token: -index})` ranks them the same way."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[int, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        cuts = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        cuts.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((index, -len(left), -len(right), left, right) for left, right in cuts)
    # A stable sort on (token index, -len(left), -len(right)): the parts' id order of one
    # token's cuts survives ties, as in transformers' stable reverse sort.
    ranked.sort(key=lambda r: r[:3])
    return [(left, right) for _, _, _, left, right in ranked]


def gemma_tokenizer(meta: Meta, tokens: list[str]) -> Tokenizer:
    """Gemma's SentencePiece BPE: spaces become "▁" before the model, unknown characters fall
    back to byte tokens, and decoding turns both back.

    A token of two or more spaces is stored as real spaces; Gemma's model looks it up as
    "▁▁", so such tokens are respelled before merges are derived (as transformers does)."""
    spelled = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        raise ValueError("GGUF gemma3 tokenizer has no tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab={token: index for index, token in enumerate(spelled)},
            merges=merges_from_vocabulary(spelled),
            fuse_unk=True,
            unk_token=spelled[unk],
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    ends = _ends(spelled, meta)
    if ends:
        tok.post_processor = _template(ends)
    return tok


def build_tokenizer(meta: Meta, vocab_size: int) -> Tokenizer:
    """The tokenizer a file's `tokenizer.ggml.*` metadata describes, with its control and
    user-defined tokens added whole."""
    kind, arch = meta.get("tokenizer.ggml.model"), meta.get("general.architecture")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if len(tokens) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokens)} tokens, more than {vocab_size} embeddings")
    if len(set(tokens)) != len(tokens):
        raise ValueError("GGUF tokenizer.ggml.tokens holds duplicate tokens")
    if kind == "gpt2":
        tok = byte_level_tokenizer(meta, tokens)
    elif kind == "llama" and arch == "gemma3":
        tok = gemma_tokenizer(meta, tokens)
    else:
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r} in a {arch!r} file is not supported; "
            "supported: 'gpt2' (byte-level BPE), and 'llama' (SentencePiece) in gemma3 files"
        )
    _add_typed_tokens(tok, tokens, meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    return tok


def _token(meta: Meta, key: str) -> str | None:
    """The token text for the id stored under tokenizer.ggml.<key>, or None when absent."""
    index = meta.get(f"tokenizer.ggml.{key}")
    return None if index is None else meta["tokenizer.ggml.tokens"][index]


def tokenizer_config(meta: Meta, context_length: int) -> dict[str, Any]:
    """transformers `tokenizer_config.json` content: special tokens and the chat template.

    The tokenizer class is the generic fast one, so tokenizer.json is used exactly as written."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _token(meta, "bos_token_id"),
        "eos_token": _token(meta, "eos_token_id"),
        "unk_token": _token(meta, "unknown_token_id"),
        "pad_token": _token(meta, "padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def generation_config(meta: Meta) -> dict[str, Any]:
    """transformers `generation_config.json` content: the special token ids, nothing sampled."""
    ids = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return {k: v for k, v in ids.items() if v is not None}
