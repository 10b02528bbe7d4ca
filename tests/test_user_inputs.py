"""Hostile inputs to the API and the `python -m dge_jax` CLI (issue #28): each mistake ends in
one clear error naming what is wrong and what to pass instead, never garbage or a traceback
from deep inside the tokenizer, numpy or XLA.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

import dge_jax
from dge_jax.eviction import Eviction
from dge_jax.policies import SnapKV
from dge_jax.timing import Timing

FORMS = r"a prompt is a str, or a list / 1-D integer array of token ids in \[0, vocab\)"


@pytest.fixture(scope="module")
def chat_model(checkpoint):
    """The tiny Llama with a word-level tokenizer and a chat template (vocab 128)."""
    return dge_jax.load(checkpoint("llama_chat"))


def _gen(model, prompts, **kwargs):
    return dge_jax.generate(model, prompts, max_new_tokens=2, **kwargs)


# ---------------------------------------------------------------------------------------------
# 1. Prompts: what a prompt may be


def test_bytes_prompt_is_refused_not_read_as_token_ids(chat_model):
    """b"Hello there" used to become the ids of its bytes (104, 101, ...): garbage."""
    with pytest.raises(TypeError, match=rf"prompt 0 is bytes, .*decode it to a str.*{FORMS}"):
        _gen(chat_model, [b"hello there"])
    with pytest.raises(TypeError, match=r"prompts is bytes, not text: decode it"):
        _gen(chat_model, b"hello there")


def test_float_token_ids_are_refused_not_truncated(chat_model):
    with pytest.raises(TypeError, match=rf"prompt 1 has float 2\.7 at position 1; token ids are "
                                        rf"ints \(cast whole numbers with int\(\)\); {FORMS}"):
        _gen(chat_model, [[1, 2], [1, 2.7]])
    with pytest.raises(TypeError, match=r"prompt 0 is a float64 array; token ids are integers"):
        _gen(chat_model, [np.array([1.0, 2.0])])


def test_digit_strings_are_not_converted_to_token_ids(chat_model):
    with pytest.raises(TypeError, match=r"prompt 0 has str '123' at position 0; token ids are "
                                        r"ints \(for text, pass the whole prompt as one str\)"):
        _gen(chat_model, [["123", "4"]])


def test_two_d_arrays(chat_model):
    """A 2-D integer array is a batch of equal-length rows of ids; any other array is refused
    with what to pass."""
    rows = np.array([[5, 6, 7], [8, 9, 10]], np.int32)
    assert _gen(chat_model, rows).tokens == _gen(chat_model, rows.tolist()).tokens
    with pytest.raises(TypeError, match=r"prompts is a 2-D float32 array of shape \(2, 3\); "
                                        r"pass a list of prompts, or a 2-D integer array"):
        _gen(chat_model, rows.astype(np.float32))
    with pytest.raises(TypeError, match=r"prompt 0 is a 2-D array of shape \(1, 3\)"):
        _gen(chat_model, [rows[:1]])
    with pytest.raises(TypeError, match=r"prompts is a 1-D integer array: .*\[ids\]"):
        _gen(chat_model, rows[0])
    with pytest.raises(TypeError, match=r"prompts is a flat list of ints: .*\[\[5, 6, 7\]\]"):
        _gen(chat_model, [5, 6, 7])


def test_mixed_text_and_token_id_batch_is_refused(chat_model):
    with pytest.raises(TypeError, match=r"prompt 1 is token ids but prompt 0 is text: one "
                                        r"batch is all text or all token ids"):
        _gen(chat_model, ["hello", [1, 2, 3]])


def test_other_objects_name_what_a_prompt_is(chat_model):
    with pytest.raises(TypeError, match=rf"prompt 1 is NoneType None; {FORMS}"):
        _gen(chat_model, ["hello", None])
    with pytest.raises(TypeError, match=r"prompts must be a list of prompts .*, got int 7"):
        _gen(chat_model, 7)


def test_empty_prompts_say_what_to_pass(chat_model):
    for prompts in (["the cat", ""], [[1, 2], []], [[1], np.array([], np.int64)]):
        with pytest.raises(ValueError, match=r"prompt 1 is empty \(no tokens\): pass non-empty "
                                             r"text or at least one token id"):
            _gen(chat_model, prompts)


def test_token_ids_outside_the_vocabulary_say_what_they_index(chat_model):
    with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 128\): "
                                         r"\[128, -1\]; token ids index the model's vocabulary"):
        _gen(chat_model, [[1, 128, 2, -1]])


def test_text_with_lone_surrogates_names_the_character(chat_model):
    """Undecodable bytes read with surrogateescape gave "TextInputSequence must be str"."""
    with pytest.raises(ValueError, match=r"prompt 1 is not valid UTF-8 text: character 3 is "
                                         r"'\\udcff', a lone surrogate"):
        _gen(chat_model, ["ok", "hi \udcff"])


# ---------------------------------------------------------------------------------------------
# 6. Arguments of generate and Eviction


def test_sampler_given_as_a_string_names_the_sampler_classes(chat_model):
    from dge_jax.sampling import Greedy

    with pytest.raises(TypeError, match=r"sampler must be a sampler object, not the string "
                                        r"'greedy': use Greedy\(\) or Sampling\("):
        _gen(chat_model, ["the cat"], sampler="greedy")
    with pytest.raises(TypeError, match=r"not the class Greedy: use Greedy\(\)"):
        _gen(chat_model, ["the cat"], sampler=Greedy)


@pytest.mark.parametrize("chunk, error", [(0, ValueError), (-4, ValueError), (8.0, TypeError)])
def test_prefill_chunk_below_one_or_not_an_int(chat_model, chunk, error):
    with pytest.raises(error, match=r"chunk \(the prefill chunk size.*\) must be"):
        _gen(chat_model, ["the cat"], chunk=chunk)


def test_timing_given_as_a_string_says_which_timing_to_use():
    with pytest.raises(TypeError, match=r"Eviction\.timing must be a Timing, not the string "
                                        r"'dge': use dge_jax\.timing\.dge\(2\)"):
        Eviction(SnapKV(), timing="dge")
    with pytest.raises(TypeError, match=r"not the string 'prefill': use dge_jax\.timing\.prefill"):
        Eviction(SnapKV(), timing="prefill")


def test_policy_given_as_a_string_says_how_to_make_one():
    with pytest.raises(TypeError, match=r"Eviction\.policy must be a policy object, not the "
                                        r"string 'snapkv': use dge_jax\.registry\.make_policy"):
        Eviction("snapkv")


@pytest.mark.parametrize(
    "budget, error, message",
    [
        (0, ValueError, r"Eviction\.budget must be >= 1 entry per head, got 0"),
        (-3, ValueError, r"Eviction\.budget must be >= 1 entry per head, got -3"),
        (np.array([4, 0]), ValueError, r"Eviction\.budget must be >= 1 entry per head, got 0"),
        (64.5, TypeError, r"Eviction\.budget \(entries kept per kv head\) must be an int, .*"
                          r"got the float 64\.5"),
        (float("inf"), TypeError, r"Eviction\.budget .* got the float inf"),
        ("128", TypeError, r"Eviction\.budget .* must be an int"),
        (True, TypeError, r"Eviction\.budget .* must be an int"),
        ([4.0, 8.0], TypeError, r"Eviction\.budget .* integer array"),
    ],
)
def test_bad_budgets_fail_at_construction_naming_the_field(budget, error, message):
    with pytest.raises(error, match=message):
        Eviction(SnapKV(), budget=budget, timing=Timing("prefill", 1))
    assert Eviction(SnapKV(), budget=np.int64(64)).budget == 64


def test_eviction_given_as_a_string_is_refused(chat_model):
    with pytest.raises(TypeError, match=r"eviction \(cell 0\) must be a dge_jax\.eviction\."
                                        r"Eviction or None"):
        _gen(chat_model, ["the cat"], eviction="snapkv")


def test_model_given_as_a_name_says_to_load_it():
    with pytest.raises(TypeError, match=r"model must be a loaded dge_jax\.Model, got str "
                                        r"'smollm2-135m-instruct': load one with dge_jax\.load"):
        dge_jax.generate("smollm2-135m-instruct", ["hi"])
