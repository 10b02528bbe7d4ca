"""Tokenizer and chat template (dge_jax/checkpoints/tokenizer.py) against transformers' own
tokenizer.

The tokenizer is a word-level `tokenizers` model built in conftest (no download): 128 words,
special tokens <unk> <s> </s> <|im_start|> <|im_end|>, and a ChatML-like template that also
uses `bos_token`, so the special tokens of tokenizer_config.json must be in the template's scope.
"""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

import dge_jax
from dge_jax.checkpoints.tokenizer import Tokenizer, TokenizerError

MESSAGES = [
    {"role": "system", "content": "you are helpful"},
    {"role": "user", "content": "what is the capital of france"},
    {"role": "assistant", "content": "paris"},
    {"role": "user", "content": "and the capital of it"},
]


@pytest.fixture(scope="module")
def ours(tokenizer_dir):
    return Tokenizer.from_folder(tokenizer_dir, {})


@pytest.fixture(scope="module")
def theirs(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("n_messages", [1, 2, 4])
def test_chat_template_matches_transformers(ours, theirs, add_generation_prompt, n_messages):
    messages = MESSAGES[-n_messages:]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    want = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == want
    assert text.startswith("<s><|im_start|>")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    if add_generation_prompt:
        assert ours.encode_chat(messages) == theirs.encode(want, add_special_tokens=False)


def test_bare_string_is_one_user_message(ours):
    assert ours.apply_chat_template("hello world") == (
        "<s><|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = ours.encode_chat("hello world")
    specials = [ours.token_id(t) for t in ("<s>", "<|im_start|>", "<|im_end|>")]
    assert ids[:2] == specials[:2] and specials[2] in ids  # special tokens, not split text
    assert ids == ours.encode(ours.apply_chat_template("hello world"), add_special_tokens=False)


@pytest.mark.parametrize(
    "text", ["hello world", "the cat sat on the mat", "what is the capital of france"]
)
def test_encode_decode_round_trip(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=True)
    assert ours.token_id("<unk>") not in ids
    assert ours.decode(ids) == text == theirs.decode(ids)


def test_unknown_words_and_special_tokens(ours, theirs):
    assert ours.encode("hello zebra") == [ours.token_id("hello"), ours.token_id("<unk>")]
    ids = [ours.token_id("<s>"), ours.token_id("paris"), ours.token_id("</s>")]
    assert ours.decode(ids) == "paris" == theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    assert ours.vocab_size == 128


def test_chat_template_jinja_file_overrides_tokenizer_config(tokenizer_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    ours = Tokenizer.from_folder(folder, {})
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    text = ours.apply_chat_template(MESSAGES[:2])
    assert text == "system : you are helpful user : what is the capital of france assistant :"
    assert text == theirs.apply_chat_template(
        MESSAGES[:2], tokenize=False, add_generation_prompt=True
    )


# ---------------------------------------------------------------------------------------------
# EOS ids: generation_config.json, else config.json, else tokenizer_config's eos_token


def _folder_with(tokenizer_dir, tmp_path, config=None, generation_config=None):
    folder = tmp_path / "model"
    shutil.copytree(tokenizer_dir, folder)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_eos_ids_from_generation_config_win(tokenizer_dir, tmp_path):
    folder = _folder_with(
        tokenizer_dir, tmp_path, {"eos_token_id": 4}, {"eos_token_id": [4, 2], "bos_token_id": 1}
    )
    assert Tokenizer.from_folder(folder).eos_ids == (2, 4)
    gen = transformers.GenerationConfig.from_pretrained(folder)
    assert sorted(gen.eos_token_id) == [2, 4]


def test_eos_ids_from_config_without_generation_config(tokenizer_dir, tmp_path):
    folder = _folder_with(tokenizer_dir, tmp_path, {"eos_token_id": 4})
    assert Tokenizer.from_folder(folder).eos_ids == (4,)
    # an explicit config dict (what dge_jax.load passes) is used instead of config.json
    assert Tokenizer.from_folder(folder, {"eos_token_id": [3]}).eos_ids == (3,)


def test_eos_ids_from_eos_token_as_last_resort(tokenizer_dir, tmp_path):
    folder = _folder_with(tokenizer_dir, tmp_path, {"eos_token_id": None}, {"bos_token_id": 1})
    assert Tokenizer.from_folder(folder).eos_ids == (2,)  # "</s>"


def test_missing_tokenizer_json(tokenizer_dir, tmp_path):
    folder = _folder_with(tokenizer_dir, tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_folder(folder, {})


def test_no_chat_template(tokenizer_dir, tmp_path):
    folder = _folder_with(tokenizer_dir, tmp_path)
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    del tcfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg))
    tok = Tokenizer.from_folder(folder, {})
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template("hello")


# ---------------------------------------------------------------------------------------------
# Text through a model with a tokenizer


def test_text_prompts_through_generate(checkpoint):
    model = dge_jax.load(checkpoint("llama_chat"))
    tok = model.tokenizer
    assert tok is not None and tok.eos_ids == (2,)  # generation_config.json of save_pretrained
    prompts = ["what is the capital of france", "hello world"]
    plain = dge_jax.generate(model, prompts, max_new_tokens=8)
    chat = dge_jax.generate(model, prompts, max_new_tokens=8, chat=True)
    assert plain.prompt_tokens == [tok.encode(p) for p in prompts]
    assert chat.prompt_tokens == [tok.encode_chat(p) for p in prompts]
    for result in (plain, chat):
        for ids, text in zip(result.tokens, result.texts, strict=True):
            assert 1 <= len(ids) <= 8
            assert 2 not in ids[:-1]  # generation stops at the first EOS
            assert text == tok.decode(ids)
