"""`python -m dge_jax generate`: JSON output, and one-line errors with exit status 2.

Two runs go through a real subprocess (the acceptance criterion is about what a shell user
sees); the other error paths call `dge_jax.cli.main` in-process, which is the same code
without the interpreter start-up.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import dge_jax
from dge_jax import cli

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "dge_jax", "generate", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )


def test_json_output(checkpoint):
    folder = checkpoint("llama_chat")
    proc = run_cli(
        "--model", str(folder), "--prompt", "hello world", "--max_new_tokens", "6", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"prompt_tokens", "tokens", "text"}
    assert 1 <= len(out["tokens"][0]) <= 6
    # the same as the library call, greedy by default
    model = dge_jax.load(folder)
    want = dge_jax.generate(model, ["hello world"], max_new_tokens=6)
    assert out["prompt_tokens"] == want.prompt_tokens == [model.tokenizer.encode("hello world")]
    assert out["tokens"] == want.tokens
    assert out["text"] == want.texts


def test_missing_model_folder_exits_2_with_one_line(tmp_path):
    missing = tmp_path / "no_such_model"
    proc = run_cli("--model", str(missing), "--prompt", "hello", "--json")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and str(missing) in lines[0]
    assert proc.stdout == ""


def main_json(capsys, *args: str) -> dict:
    assert cli.main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_chat_and_sampling_flags(checkpoint, capsys):
    folder = str(checkpoint("llama_chat"))
    model = dge_jax.load(folder)
    args = ["--model", folder, "--prompt", "the cat", "--max_new_tokens", "6"]
    chat = main_json(capsys, *args, "--chat")
    assert chat["prompt_tokens"] == [model.tokenizer.encode_chat("the cat")]
    assert 1 <= len(chat["tokens"][0]) <= 6
    sampled = ["--temperature", "1.5", "--top_k", "10", "--seed", "3"]
    a = main_json(capsys, *args, *sampled)
    b = main_json(capsys, *args, *sampled)
    assert a == b  # an explicit seed reproduces
    assert cli.main(["generate", *args]) == 0
    assert capsys.readouterr().out.strip() == main_json(capsys, *args)["text"][0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "--temperature must be >= 0 (0 = greedy), got -1.0"),
        (["--temperature", "nan"], "--temperature must be >= 0 (0 = greedy), got nan"),
        (["--temperature", "1", "--top_k", "-1"], "--top_k must be >= 0 (0 = no top-k cut)"),
        (["--temperature", "1", "--top_p", "0"], "--top_p must be in (0, 1] (1 = no nucleus"),
        (["--temperature", "1", "--top_p", "1.5"], "--top_p must be in (0, 1]"),
        (["--top_k", "5"], "--top_k only apply when sampling (--temperature > 0); --temp"),
        (["--top_k", "5", "--top_p", "0.9"], "--top_k, --top_p only apply when sampling"),
    ],
)
def test_sampling_flag_errors_speak_in_flags(capsys, flags, message):
    """A CLI user is told about --temperature, not the API's Greedy(); checked before loading."""
    code = cli.main(["generate", "--model", "/no/such/model", "--prompt", "hi", *flags])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "" and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {message}") and "Greedy()" not in lines[0]


def test_sampling_api_error_still_names_greedy():
    from dge_jax.text.sampling import Sampling

    with pytest.raises(ValueError, match=r"temperature must be > 0 \(got -1\); use Greedy\(\)"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="use Greedy"):
        Sampling(temperature=float("nan"))


def _broken_checkpoint(checkpoint_copy):
    folder = checkpoint_copy("llama")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    return folder


@pytest.mark.parametrize(
    "case, message",
    [
        ("truncated", "truncated"),
        ("no_tokenizer", "no tokenizer.json"),
        ("zero_tokens", "max_new_tokens must be >= 1"),
        ("yarn", "rope type 'yarn'"),
    ],
)
def test_errors_exit_2_with_one_line(checkpoint, checkpoint_copy, capsys, case, message):
    folder = checkpoint("llama_chat")
    extra = []
    if case == "truncated":
        folder = _broken_checkpoint(checkpoint_copy)
    elif case == "no_tokenizer":
        folder = checkpoint("llama")
    elif case == "zero_tokens":
        extra = ["--max_new_tokens", "0"]
    elif case == "yarn":
        folder = checkpoint_copy("llama")
        raw = json.loads((folder / "config.json").read_text())
        raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
        (folder / "config.json").write_text(json.dumps(raw))
    capsys.readouterr()  # drop whatever building the checkpoint printed
    code = cli.main(["generate", "--model", str(folder), "--prompt", "hello", *extra])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_decode_budget_json_lists_what_each_compression_kept(checkpoint, capsys):
    """--timing decode --decode_budget 12 --interval 4: the answer comes with kept_over_time,
    one entry per compression (the step, and per layer and kv head the kept positions), the
    same as the library's record."""
    folder = checkpoint("llama_chat")
    prompt = " ".join(f"w{i % 50}" for i in range(30))
    flags = ["--rule", "snapkv", "--window", "4", "--timing", "decode", "--decode_budget",
             "12", "--interval", "4", "--max_new_tokens", "14"]  # fmt: skip
    out = main_json(capsys, "--model", str(folder), "--prompt", prompt, *flags)
    from dge_jax.eviction.decode_spec import DecodeCompression
    from dge_jax.eviction.evict import Eviction
    from dge_jax.eviction.timing import Timing
    from dge_jax.rules.snapkv import SnapKV

    model = dge_jax.load(folder)
    ev = Eviction(SnapKV(window=4), 12, Timing("decode"), decode=DecodeCompression(12, 4))
    want = dge_jax.generate(model, [prompt], max_new_tokens=14, eviction=ev,
                            record_compressions=True)  # fmt: skip
    assert out["tokens"] == want.tokens
    assert out["kept_over_time"] == want.compressions[0]
    events = out["kept_over_time"]
    assert events and all(len(h) <= 12 for e in events for layer in e["kept"] for h in layer)
    steps = [e["step"] for e in events]
    assert steps == sorted(steps) and steps[0] <= 5  # every 4 decode steps, or at the EOS


def test_the_flags_old_names_are_gone(capsys):
    """--policy and --policy_option (the flags' names before the scoring rules were called
    rules) are unknown flags in 0.1: argparse refuses them before anything loads."""
    for old in (["--policy", "snapkv"], ["--policy_option", "window=4"]):
        with pytest.raises(SystemExit) as refused:
            cli.main(["generate", "--prompt", "x", *old])
        assert refused.value.code == 2
        assert f"unrecognized arguments: {' '.join(old)}" in capsys.readouterr().err


# --- --mesh: 8 simulated CPU devices, in a subprocess -----------------------------------------

MESH_RUNS = """
import contextlib, io, json, sys
import jax
import dge_jax
from dge_jax import cli
loaded = []  # the mesh each load laid the parameters on (its axis sizes), None for none
def load(*args, _load=dge_jax.load, **kwargs):
    model = _load(*args, **kwargs)
    mesh = getattr(jax.tree.leaves(model.params)[0].sharding, "mesh", None)
    loaded.append(None if mesh is None else dict(mesh.shape))
    return model
dge_jax.load = load
outs = {"devices": jax.device_count()}
for name, argv in json.loads(sys.argv[1]).items():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["generate", *argv, "--json"])
    outs[name] = {"code": code, "mesh": loaded[-1] if loaded else None,
                  "out": json.loads(buf.getvalue()) if code == 0 else None}
print(json.dumps(outs))
"""


def test_mesh_gives_the_same_tokens_and_kept_positions(checkpoint):
    """`generate --mesh` loads the model sharded over a (data, model) mesh, as `convert --mesh`
    and the runner's `--mesh` do: on 8 simulated CPU devices (a subprocess, so they exist
    before JAX starts) the tokens and kept positions are the unsharded run's, with the kv
    heads split over the model axis (data=1,model=2) and with more model devices than kv
    heads plus a data axis the one row cannot fill (data=2,model=4)."""
    folder = str(checkpoint("llama_chat"))
    prompt = " ".join(f"w{i % 50}" for i in range(30))
    flags = ["--model", folder, "--prompt", prompt, "--max_new_tokens", "5", "--rule",
             "snapkv", "--window", "4", "--budget", "8", "--timing", "dge", "--k", "2"]  # fmt: skip
    runs = {"none": flags}
    for mesh in ("data=1,model=2", "data=2,model=4"):
        runs[mesh] = [*flags, "--mesh", mesh]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # LLVM optimisation off, as tests/test_sharding.py: less compile time, same HLO passes
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                        "--xla_backend_optimization_level=0")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", MESH_RUNS, json.dumps(runs)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outs["devices"] == 8
    base = outs["none"]
    assert base["code"] == 0 and base["mesh"] is None
    assert base["out"]["tokens"][0] and base["out"]["kept"]
    for mesh, shape in (("data=1,model=2", {"data": 1, "model": 2}),
                        ("data=2,model=4", {"data": 2, "model": 4})):  # fmt: skip
        assert outs[mesh]["code"] == 0, (mesh, proc.stderr[-3000:])
        assert outs[mesh]["mesh"] == shape  # the parameters were laid on that mesh
        assert outs[mesh]["out"] == base["out"], mesh  # tokens, text and kept positions


@pytest.mark.parametrize(
    "command, mesh, message",
    [
        ("generate", "data=x", "--mesh data=x: bad mesh spec 'data=x': write data=D,model=M"),
        ("generate", "rows=2", "--mesh rows=2: bad mesh spec 'rows=2'"),
        ("generate", "", "--mesh : empty mesh spec ''"),
        ("generate", "data=1,model=16", "--mesh data=1,model=16: a mesh of data=1 x model=16 "
         "needs 16 devices, but only 1 are available"),
        ("convert", "model=0", "--mesh model=0: mesh axis model must be a positive integer"),
    ],
)  # fmt: skip
def test_a_bad_mesh_is_one_error_line_before_loading(capsys, tmp_path, command, mesh, message):
    """A --mesh that does not parse or does not fit the devices is refused in one line (exit
    2) before the model is read: the folder named here does not exist."""
    argv = [command, "--model", str(tmp_path / "no_such_model"), "--mesh", mesh]
    argv += ["--prompt", "hi"] if command == "generate" else ["--out", str(tmp_path / "out")]
    code = cli.main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "" and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {message}"), lines[0]
