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
from dge_jax.eviction.evict import Eviction, SelectionSpec
from dge_jax.eviction.timing import Timing
from dge_jax.rules.snapkv import SnapKV

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
    with pytest.raises(TypeError, match=r"prompts is bytes, neither text nor token ids: decode it"):
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
    from dge_jax.text.sampling import Greedy

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
                                        r"'dge': use dge_jax\.eviction\.timing\.dge\(2\)"):
        Eviction(SnapKV(), timing="dge")
    with pytest.raises(
        TypeError, match=r"not the string 'prefill': use dge_jax\.eviction\.timing\.prefill"
    ):
        Eviction(SnapKV(), timing="prefill")


def test_rule_given_as_a_string_says_how_to_make_one():
    with pytest.raises(TypeError, match=r"Eviction\.rule must be a rule object, not the "
                                        r"string 'snapkv': use "
                                        r"dge_jax\.rules\.registry\.make_rule"):
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
                                        r"evict\.Eviction or None"):
        _gen(chat_model, ["the cat"], eviction="snapkv")


def test_model_given_as_a_name_says_to_load_it():
    with pytest.raises(TypeError, match=r"model must be a loaded dge_jax\.Model, got str "
                                        r"'smollm2-135m-instruct': load one with dge_jax\.load"):
        dge_jax.generate("smollm2-135m-instruct", ["hi"])


# ---------------------------------------------------------------------------------------------
# 2, 3. The command line: conflicting options, and one line per error


def _cli(capsys, *argv: str) -> tuple[int, list[str], str]:
    """(exit status, stderr lines, stdout) of `python -m dge_jax ARGV` run in-process; a
    usage error from argparse exits through SystemExit."""
    from dge_jax import cli

    capsys.readouterr()
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


GEN = ("generate", "--model", "/no/such/model", "--prompt", "hi", "--rule", "snapkv")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--window", "8", "--rule_option", "window=4"],
         "error: --window 8 and --rule_option window=4 both set the field window; give it once"),
        (["--rule_option", "window=8", "--rule_option", "window=4"],
         "error: --rule_option window=8 and --rule_option window=4 both set the field "
         "window; give it once"),
        (["--gqa_before_pool", "--rule_option", "gqa_before_pool=false"],
         "error: --gqa_before_pool and --rule_option gqa_before_pool=false both set"),
        (["--rule_option", "budget=4"],
         "error: --rule_option budget=4 sets budget, which is not a field of the rule; "
         "use --budget 4"),
        (["--window", "8", "--window", "4"],
         "error: --window 8 and --window 4 both set window; give it once; see python -m "
         "dge_jax generate --help"),
    ],
    ids=["flag-and-option", "option-twice", "bool-flag-and-option", "eviction-field", "flag-twice"],
)
def test_cli_a_field_set_twice_is_refused_naming_both(capsys, flags, message):
    """`--window 8 --rule_option window=4` used to run window 4, the last one, silently."""
    code, err, out = _cli(capsys, *GEN, *flags)
    assert code == 2 and out == "" and len(err) == 1 and err[0].startswith(message), err


def test_cli_usage_errors_are_one_line_and_help_exits_0(capsys):
    """argparse printed its usage block above the error; now one line with the fix."""
    code, err, _ = _cli(capsys, "generate", "--model", "x")
    assert code == 2 and err == [
        "error: the following arguments are required: --prompt; see python -m dge_jax "
        "generate --help"
    ]
    code, err, _ = _cli(capsys, *GEN[:5], "--rule", "snapkv2")
    assert code == 2 and len(err) == 1 and "invalid choice: 'snapkv2'" in err[0], err
    code, err, out = _cli(capsys, "generate", "--help")
    assert code == 0 and err == [] and "--verbose" in out


def _break_template(folder, kind: str):
    """A llama_chat copy whose chat template does not parse, or refuses every prompt."""
    import json

    if kind == "syntax":
        (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
        return folder / "chat_template.jinja", "does not parse: line 1: Unexpected end of template"
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = "{{ raise_exception('System role not supported') }}"
    path.write_text(json.dumps(cfg))
    return path, "refused the prompt: System role not supported"


@pytest.mark.parametrize("kind", ["syntax", "raise_exception"])
def test_cli_broken_chat_template_is_one_line_naming_the_file(checkpoint_copy, capsys, kind):
    folder = checkpoint_copy("llama_chat")
    path, message = _break_template(folder, kind)
    code, err, out = _cli(capsys, "generate", "--model", str(folder), "--prompt", "hi", "--chat")
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("error: chat template in ") and str(path) in err[0]
    assert message in err[0] and err[0].endswith("(no --chat / chat=False)")


def test_chat_template_errors_are_a_tokenizer_error(checkpoint_copy):
    from dge_jax.checkpoints.tokenizer import ChatTemplateError, TokenizerError

    folder = checkpoint_copy("llama_chat")
    _break_template(folder, "raise_exception")
    model = dge_jax.load(folder)
    with pytest.raises(ChatTemplateError, match="System role not supported") as info:
        _gen(model, ["hi"], chat=True)
    assert isinstance(info.value, TokenizerError)


def test_cli_verbose_keeps_the_traceback(capsys):
    """--verbose re-raises the error the one-line message reports."""
    with pytest.raises(ValueError, match="/no/such/model"):
        _cli(capsys, *GEN[:5], "--verbose")
    code, err, _ = _cli(capsys, *GEN[:5])
    assert code == 2 and len(err) == 1 and "/no/such/model" in err[0]


def test_cli_unexpected_error_is_one_line_that_points_to_verbose(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("XLA went away\nsecond line")

    monkeypatch.setattr(dge_jax, "load", broken)
    code, err, out = _cli(capsys, *GEN[:5])
    assert code == 1 and out == "" and err == [
        "error: unexpected RuntimeError: XLA went away second line; rerun with --verbose for "
        "the traceback and report it"
    ]


def test_cli_unknown_model_name_suggests_the_embedded_one(capsys):
    code, err, _ = _cli(capsys, "generate", "--model", "smollm2-135m", "--prompt", "hi")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: 'smollm2-135m' is neither a checkpoint folder")
    assert "did you mean 'smollm2-135m-instruct'?" in err[0]


def test_cli_prompt_that_is_not_utf8_names_the_byte(capsys):
    """Bytes that are not UTF-8 reach sys.argv as lone surrogates (surrogateescape)."""
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    code, err, _ = _cli(capsys, *GEN[:4], prompt)
    assert code == 2 and err == [
        "error: --prompt is not valid UTF-8 (byte 0xe9 at character 3); pass UTF-8 text, "
        "e.g. convert it with iconv -t UTF-8"
    ]


# ---------------------------------------------------------------------------------------------
# 3, 4, 5. The model cache: faults, temp folders of killed conversions, progress lines


@pytest.fixture
def tiny_gguf(tmp_path):
    """A tiny llama GGUF (tests/test_gguf.py's) and an empty cache for it."""
    from test_gguf import tiny_hf_tensors, write_tiny_gguf

    return write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_tensors(True))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("DGE_JAX_CACHE", str(path))
    return path


def _target(cache, gguf_file):
    from dge_jax.checkpoints import embedded

    return cache / f"tiny-{embedded.cache_key(gguf_file)}"


def _cache_fault(case, cache, gguf_file, monkeypatch):
    """Breaks the cache as `case` says; returns what the error must say."""
    from dge_jax.checkpoints import embedded, gguf

    if case == "file":
        cache.write_text("not a folder")
        return f"the model cache {cache} is a file, not a folder; remove it"
    if case == "read-only":
        cache.mkdir()
        if os.geteuid() == 0:  # root writes anywhere: make the check see a read-only folder
            monkeypatch.setattr(embedded.os, "access", lambda path, mode: False)
        else:
            cache.chmod(0o555)
        return f"the model cache {cache} is not writable, so tiny cannot be converted"
    if case == "full":
        def full(tensors, path, metadata=None):
            import errno

            raise OSError(errno.ENOSPC, "No space left on device", path)

        monkeypatch.setattr(gguf, "save_file", full)
        return f"cannot write the conversion of tiny into the model cache {cache} (No space"
    target = _target(cache, gguf_file)  # "incomplete": renamed whole, then files lost
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    return (f"{target} is an incomplete conversion of tiny (missing model.safetensors, "
            f"tokenizer.json, tokenizer_config.json, generation_config.json); delete it (rm -r ")


CACHE_FAULTS = ["file", "read-only", "full", "incomplete"]


@pytest.mark.parametrize("case", CACHE_FAULTS)
def test_model_cache_faults_raise_model_cache_error(tiny_gguf, cache, monkeypatch, case):
    from dge_jax.checkpoints.embedded import ModelCacheError, resolve_model_dir

    message = _cache_fault(case, cache, tiny_gguf, monkeypatch)
    with pytest.raises(ModelCacheError) as info:
        resolve_model_dir(tiny_gguf)
    assert isinstance(info.value, OSError)
    assert str(info.value).startswith(message) and "or set DGE_JAX_CACHE to another folder" in str(
        info.value
    )
    if cache.is_dir():  # nothing half-written is left behind
        assert not [p for p in cache.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("case", CACHE_FAULTS)
def test_cli_model_cache_faults_exit_1_with_one_line(tiny_gguf, cache, monkeypatch, capsys, case):
    message = _cache_fault(case, cache, tiny_gguf, monkeypatch)
    code, err, out = _cli(capsys, "generate", "--model", str(tiny_gguf), "--prompt", "hi")
    err = [line for line in err if not line.startswith("convert")]  # the progress line
    assert code == 1 and out == "" and len(err) == 1, err
    assert err[0].startswith(f"error: {message}")


KILLED_CONVERSION = """
import pathlib, sys, time
from dge_jax.checkpoints import embedded, gguf

real = gguf.save_file
def save_then_hang(tensors, path, metadata=None):
    real(tensors, path, metadata=metadata)
    pathlib.Path(sys.argv[2]).write_text("written")
    time.sleep(600)

gguf.save_file = save_then_hang
embedded.resolve_model_dir(sys.argv[1])
"""


def test_a_killed_conversion_leaves_no_temp_folder(tiny_gguf, cache, tmp_path):
    """SIGKILL a real conversion once its temp folder holds the weights; the next conversion
    deletes that folder (its pid is dead on this host) and converts."""
    import signal
    import subprocess
    import sys
    import time

    from dge_jax.checkpoints.embedded import resolve_model_dir

    marker = tmp_path / "written"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONVERSION, str(tiny_gguf), str(marker)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no conversion started"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = [p for p in cache.iterdir() if ".tmp-" in p.name]
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file()
    assert f"-{proc.pid}-" in left[0].name  # the temp folder names its owner
    folder = resolve_model_dir(tiny_gguf)
    assert (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]


def test_only_temp_folders_of_dead_processes_on_this_host_are_removed(tiny_gguf, cache):
    import subprocess
    import sys
    import time

    from dge_jax.checkpoints import temp_folders
    from dge_jax.checkpoints.embedded import resolve_model_dir

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    host = temp_folders._host()
    names = {
        "dead": f".tiny-x.tmp-{host}-{dead.pid}-0123abcd",
        "alive": f".tiny-x.tmp-{host}-{os.getpid()}-0123abcd",
        "other host": f".tiny-x.tmp-{host}x-{dead.pid}-0123abcd",
        "old legacy": ".tiny-x.tmp-a1b2c3d4",
        "new legacy": ".tiny-x.tmp-e5f6g7h8",
        "not ours": "notes.tmp-1-2",
    }
    cache.mkdir()
    for name in names.values():
        (cache / name).mkdir()
        (cache / name / "model.safetensors").write_bytes(b"x" * 100)
    two_days_ago = time.time() - 2 * 86400
    os.utime(cache / names["old legacy"], (two_days_ago, two_days_ago))
    folder = resolve_model_dir(tiny_gguf)
    kept = {p.name for p in cache.iterdir()} - {folder.name}
    assert kept == {names[k] for k in ("alive", "other host", "new legacy", "not ours")}


def test_conversion_says_so_on_stderr_before_and_after(tiny_gguf, cache, capfd):
    """The embedded model's first load converts for tens of seconds; it used to say nothing."""
    import re

    from dge_jax.checkpoints.embedded import resolve_model_dir

    capfd.readouterr()
    folder = resolve_model_dir(tiny_gguf)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0] == f"converting tiny into {folder} (once) ..."
    assert re.fullmatch(r"converted tiny in \d+ s", err[1]), err
    assert resolve_model_dir(tiny_gguf) == folder
    assert capfd.readouterr().err == ""  # cached: silent


def test_generation_config_and_options_are_one_setting(chat_model):
    """`config=GenerationConfig(...)` and options by name are the same call; options win over
    the config's fields; an unknown option names the known ones."""
    base = dge_jax.GenerationConfig(max_new_tokens=3, min_new_tokens=3)
    by_config = dge_jax.generate(chat_model, ["Hello there"], config=base)
    by_name = dge_jax.generate(chat_model, ["Hello there"], max_new_tokens=3, min_new_tokens=3)
    assert by_config.tokens == by_name.tokens and len(by_name.tokens[0]) == 3
    longer = dge_jax.generate(chat_model, ["Hello there"], config=base, max_new_tokens=5)
    assert len(longer.tokens[0]) == 5
    with pytest.raises(TypeError, match=r"unknown config field\(s\) \['max_tokens'\]; known: "):
        dge_jax.generate(chat_model, ["Hello there"], max_tokens=3)
    with pytest.raises(TypeError, match="config must be a GenerationConfig, got dict"):
        dge_jax.generate(chat_model, ["Hello there"], config={"max_new_tokens": 3})
    with pytest.raises(TypeError, match=r"unknown spec field\(s\) \['polcy'\]; known: rule"):
        SelectionSpec.of(None, {"polcy": SnapKV()})
