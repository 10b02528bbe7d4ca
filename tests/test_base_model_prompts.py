"""Base models (a tokenizer without a chat template) in the evaluation runner.

Such a model is prompted with the raw prompt (cut in the middle to the max length) followed by
the suite's answer prefix, never a made-up template: `dge_jax.checkpoints.tokenizer.prompt_format`
picks the format once, and the runner, its context protocols, RULER's row generation and
KVzip's reconstruction prompt all take it from there. The model here is a tiny random Gemma 3
text model (the family of the embedded Gemma 3 270M base model) with the byte-level BPE
tokenizer of tests/tiny_model.py, its chat template removed. A model with a chat template is
prompted exactly as before.
"""

from __future__ import annotations

import json
import pathlib

import pytest
from conftest import shared_data_dir
from test_runner_faults import read_lines, run_inprocess  # noqa: F401 (a fixture)
from tiny_model import EOS_TOKEN, MAX_POSITIONS, build_tiny_llama, write_tokenizer

import dge_jax
from dge_jax.checkpoints.tokenizer import (
    CHAT_TEMPLATE,
    RAW_PROMPT,
    TokenizerError,
    prompt_format,
    prompt_renderer,
)
from dge_jax.rules.kvzip import template_parts
from experiments import context_protocols, lengths, protocol, runner, suites
from experiments.report_header import prompt_format_line
from experiments.suites.base import RowSettings
from experiments.suites.synthetic import TASKS

MAX_LENGTH = 512
RAW_LINE = ("- prompt format: raw prompt + the suite's answer prefix (the model has no chat "
            "template)")


def build_base_gemma3(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A seeded random tiny Gemma 3 text model whose tokenizer has no chat template."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    vocab = write_tokenizer(folder)
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    del tcfg["chat_template"]
    tcfg_path.write_text(json.dumps(tcfg, indent=2))
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(EOS_TOKEN)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.1, bos_token_id=None,
        eos_token_id=eos, pad_token_id=eos)  # fmt: skip
    transformers.Gemma3ForCausalLM(config).eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> pathlib.Path:
    return build_base_gemma3(tmp_path_factory.mktemp("base_gemma3"))


@pytest.fixture(scope="module")
def base_model(base_dir):
    return dge_jax.load(base_dir)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return dge_jax.load(build_tiny_llama(tmp_path_factory.mktemp("chat_llama")))


def suite_rows(model, suite: str, datasets: list[str], n: int, **settings) -> dict:
    """The rows the runner reads for `model` (its `suite_rows`, the model's prompt format)."""
    return runner.suite_rows(model, suites.get(suite), RowSettings(**settings), datasets, n)


def three_suites(model) -> dict[str, list[dict]]:
    """A synthetic row, two RULER rows of the shared file and two LongBench rows (hotpotqa:
    a task the chat template would wrap; its prompts are cut to MAX_LENGTH)."""
    return {
        **suite_rows(model, "synthetic", ["passkey"], 1, synthetic_length=256),
        **suite_rows(model, "ruler", ["ruler_niah_multikey_3"], 2,
                     data_dir=str(shared_data_dir("DGE_RULER_DIR")), ruler_length=4096),
        **suite_rows(model, "longbench", ["hotpotqa"], 2,
                     data_dir=str(shared_data_dir("DGE_LONGBENCH_DIR"))),
    }  # fmt: skip


def test_a_base_model_is_prompted_with_the_raw_prompt_and_the_answer_prefix(base_model):
    tok = base_model.tokenizer
    assert tok.chat_template is None and prompt_format(tok) == RAW_PROMPT
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template("x")  # what the runner called before: no made-up template
    rows = three_suites(base_model)
    assert protocol.answer_prefix("passkey") == TASKS["passkey"].answer_prefix
    ruler = "ruler_niah_multikey_3"
    assert all(protocol.answer_prefix(ruler, r) for r in rows[ruler])
    cut = 0
    for dataset, items in rows.items():
        assert protocol.uses_chat_template(dataset)  # the suite would wrap a chat model's
        for row in items:
            raw = protocol.build_prompt(row, dataset)
            kept, _, truncated = protocol.truncate_prompt(raw, tok, MAX_LENGTH)
            sample = protocol.model_sample(row, dataset, tok, MAX_LENGTH)
            assert sample.text == kept + protocol.answer_prefix(dataset, row), (dataset, row["_id"])
            assert sample.truncated == truncated and (truncated or kept == raw)
            cut += truncated
            without = protocol.model_sample(row, dataset, tok, MAX_LENGTH, False)
            assert without.text == kept
    assert cut >= 2  # the RULER and LongBench rows are longer than MAX_LENGTH: cut in the middle


def test_base_model_rows_and_reconstruction_prompts_use_no_template(base_model):
    """Generated RULER rows fit their length counted on the raw prompt (RULER's model
    template is the model's format); a shared context splits at the raw question; KVzip's
    reconstruction turn is kvpress's for a model without a template (no prefix, a newline)."""
    tok = base_model.tokenizer
    task = "ruler_niah_single_1"
    for row in suite_rows(base_model, "ruler", [task], 2, ruler_length=MAX_LENGTH)[task]:
        text = protocol.model_sample(row, task, tok, MAX_LENGTH).text
        assert text == row["input"] + row["answer_prefix"]
        assert len(tok.encode(text)) + protocol.max_new_tokens(task) <= MAX_LENGTH
    shared = suite_rows(base_model, "synthetic", ["multikey_shared"], 4, synthetic_length=256)
    context_protocols.check_rows(shared, tok, MAX_LENGTH, True, "shared_context")
    row = shared["multikey_shared"][0]
    context, question = context_protocols.split(
        protocol.model_sample(row, "multikey_shared", tok, MAX_LENGTH).text,
        context_protocols.question_text(row, "multikey_shared"), "row")
    assert context + question == (protocol.build_prompt(row, "multikey_shared")
                                  + protocol.answer_prefix("multikey_shared"))
    assert template_parts(tok) == ([], tok.encode("\n", add_special_tokens=False))


def test_a_rows_needs_count_what_the_prompt_format_adds(base_model, chat_model):
    """The default max length leaves room for the answer, the answer prefix and what the
    format adds around the prompt: nothing for this base model (its tokenizer adds no special
    tokens), the template's turn for a chat model."""
    for model in (base_model, chat_model):
        tok = model.tokenizer
        rows = suite_rows(model, "synthetic", ["passkey"], 1, synthetic_length=256)
        prefix = len(tok.encode(TASKS["passkey"].answer_prefix))
        wrap = 0 if model is base_model else len(tok.encode(tok.apply_chat_template("")))
        assert model is base_model or wrap > 0
        ((_, need),) = lengths.answer_needs(model, rows).items()
        assert need == protocol.max_new_tokens("passkey") + prefix + wrap
        assert lengths.default_max_length(model, rows) == MAX_POSITIONS - need


def test_a_run_on_a_base_model_completes_and_says_raw_prompt(base_dir, base_model, tmp_path,
                                                             run_inprocess):  # noqa: F811
    out = tmp_path / "run"
    code, stdout, err = run_inprocess(
        "--model", str(base_dir), "--suite", "synthetic", "--datasets", "passkey",
        "--num_samples", "1", "--synthetic_length", "256", "--rules", "full,snapkv,kvzip",
        "--timings", "prefill", "--budgets", "16", "--window", "4", "--batch_size", "1",
        "--out_dir", str(out))  # fmt: skip
    assert code == 0, err[-3000:]
    results = (out / "results.md").read_text()
    assert RAW_LINE in results.splitlines() and RAW_LINE in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["identity"]["prompt_format"] == RAW_PROMPT
    assert config["history"][-1]["prompt_format"] == RAW_PROMPT
    lines = read_lines(out)
    assert sorted(r["cell"] for r in lines) == ["full", "kvzip/prefill/b16", "snapkv/prefill/b16"]
    tok = base_model.tokenizer
    (row,) = suite_rows(base_model, "synthetic", ["passkey"], 1, synthetic_length=256)["passkey"]
    fed = tok.encode(protocol.build_prompt(row, "passkey") + TASKS["passkey"].answer_prefix)
    assert {r["prompt_tokens"] for r in lines} == {len(fed)}
    # the same command resumes the folder: nothing is recomputed
    code, stdout, err = run_inprocess(
        "--model", str(base_dir), "--suite", "synthetic", "--datasets", "passkey",
        "--num_samples", "1", "--synthetic_length", "256", "--rules", "full,snapkv,kvzip",
        "--timings", "prefill", "--budgets", "16", "--window", "4", "--batch_size", "1",
        "--out_dir", str(out))  # fmt: skip
    assert code == 0 and "1 samples done" in stdout and len(read_lines(out)) == 3, err[-3000:]


def test_a_chat_model_is_prompted_as_before(chat_model):
    """A model with a chat template: the runner's samples are what it rendered before the
    format was picked in one place (`prepare_sample` with the template's user turn), and
    its rows are made the same way."""
    tok = chat_model.tokenizer
    assert prompt_format(tok) == CHAT_TEMPLATE
    assert prompt_renderer(tok) == tok.apply_chat_template
    rows = three_suites(chat_model)
    made = {"synthetic": (["passkey"], RowSettings(synthetic_length=256)),
            "ruler": (["ruler_niah_single_1"], RowSettings(ruler_length=MAX_LENGTH))}
    for suite, (datasets, settings) in made.items():  # rows made with the template's turn
        before = suites.get(suite).load(settings, tok, tok.apply_chat_template, datasets, 2)
        assert runner.suite_rows(chat_model, suites.get(suite), settings, datasets, 2) == before
    for dataset, items in rows.items():
        for row in items:
            for with_prefix in (True, False):
                old = protocol.prepare_sample(row, dataset, tok, MAX_LENGTH,
                                              tok.apply_chat_template, with_prefix)
                assert protocol.model_sample(row, dataset, tok, MAX_LENGTH, with_prefix) == old
                assert old.text.startswith("<|im_start|>user\n")


def test_results_md_names_the_prompt_format():
    raw = {"model": "m", "suite": "synthetic", "prompt_format": RAW_PROMPT}
    assert prompt_format_line(raw, [], ["passkey"]) == RAW_LINE
    chat = {"model": "m", "suite": "longbench"}
    note = "chat template from /m/chat_template.jinja"
    history = [{"command": "c1"}, {"command": "c2", "prompt_format": note}]
    assert prompt_format_line(chat, history, ["hotpotqa", "trec"]) == (
        f"- prompt format: {note} + the suite's answer prefix; trec: raw prompt (the suite's "
        "rule)")
    assert prompt_format_line(chat | {"answer_prefix": False}, history[:1], ["passkey"]) == (
        "- prompt format: the model's chat template, no answer prefix (--noanswer_prefix)")
    assert prompt_format_line({}, [], ["passkey"]) == "- prompt format: unknown"
