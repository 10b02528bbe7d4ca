"""Converted (orbax) checkpoints and sharded safetensors loading, on one CPU device.

The round trip under a 2x4 mesh runs with 8 simulated devices in `tests/test_sharding.py`;
here: what a converted folder holds, that restoring it gives the very same parameters, its
error messages, the `convert` command, and that the slice-by-slice loader gives the same
parameters as the whole-tensor one (f32 and bf16 files).
"""

from __future__ import annotations

import json
import pathlib
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mesh_checks import CONFIG, write_checkpoint, write_tokenizer

import dge_jax
from dge_jax.checkpoints import hf, orbax_io
from dge_jax.checkpoints.hf import CheckpointError, load_hf_checkpoint, plan_tensors
from dge_jax.cli import main
from dge_jax.distribution import sharding as sh


def leaves(params) -> dict[str, np.ndarray]:
    return {name: np.asarray(x) for name, x in orbax_io.flat_params(params).items()}


def assert_same_params(a, b):
    la, lb = leaves(a), leaves(b)
    assert la.keys() == lb.keys()
    for name in la:
        assert la[name].dtype == lb[name].dtype, name
        np.testing.assert_array_equal(la[name], lb[name], err_msg=name)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> pathlib.Path:
    folder = write_checkpoint(tmp_path_factory.mktemp("orbax") / "hf", CONFIG)
    write_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    return folder


@pytest.fixture(scope="module")
def converted(hf_folder, tmp_path_factory) -> pathlib.Path:
    return orbax_io.convert(hf_folder, tmp_path_factory.mktemp("orbax") / "converted")


def test_converted_folder_holds_params_config_and_tokenizer(hf_folder, converted):
    names = {p.name for p in converted.iterdir()}
    assert {"params", "config.json", "tokenizer.json", "generation_config.json"} <= names
    assert (converted / "config.json").read_text() == (hf_folder / "config.json").read_text()
    marker = json.loads((converted / orbax_io.MARKER).read_text())
    assert marker["format"] == orbax_io.FORMAT and marker["dtype"] == "float32"
    assert marker["fields"]["layers.wq"] == [2, 64, 128]
    assert orbax_io.is_converted(converted) and not orbax_io.is_converted(hf_folder)


def test_restore_gives_the_same_model(hf_folder, converted):
    ref, got = dge_jax.load(hf_folder), dge_jax.load(converted)
    assert_same_params(ref.params, got.params)
    assert got.config == ref.config
    assert got.tokenizer.eos_ids == ref.tokenizer.eos_ids == (3,)
    assert got.tokenizer.encode("w1 w2 w9") == ref.tokenizer.encode("w1 w2 w9") == [1, 2, 9]


def test_restore_casts_and_lays_out_on_a_mesh(converted):
    _, _, params = orbax_io.restore(converted, dtype="bfloat16")
    assert params.layers.wq.dtype == jnp.bfloat16
    _, _, params = orbax_io.restore(converted, mesh=sh.make_mesh(1, 1))
    assert params.layers.wq.sharding.spec == jax.P(None, None, "model")


def test_restore_errors(hf_folder, converted, tmp_path):
    with pytest.raises(CheckpointError, match="not a converted dge_jax folder"):
        orbax_io.restore(hf_folder)
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        orbax_io.convert(hf_folder, converted)
    # A folder whose config no longer matches its saved parameters.
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", orbax_io.MARKER):
        (broken / name).write_text((converted / name).read_text())
    (broken / "params").symlink_to(converted / "params")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"intermediate_size": 128}))
    with pytest.raises(CheckpointError, match="do not match its config.json"):
        orbax_io.restore(broken)
    marker = json.loads((broken / orbax_io.MARKER).read_text())
    (broken / orbax_io.MARKER).write_text(json.dumps(marker | {"version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        orbax_io.restore(broken)


@pytest.mark.parametrize("target", ["largest params file", "params/_METADATA", "dge_jax.json"])
def test_damaged_converted_folder_says_how_to_convert_again(
    hf_folder, converted, tmp_path, capsys, target
):
    """A cut file in a `convert` output: one line naming the folder and the exact command
    (with the source `convert` recorded), also through the CLI (exit 2, no traceback)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    if target == "largest params file":
        files = [p for p in (broken / "params").rglob("*") if p.is_file()]
        path = max(files, key=lambda p: p.stat().st_size)
    else:
        path = broken / target
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as exc:
        orbax_io.restore(broken)
    source = "SOURCE" if target == "dge_jax.json" else str(hf_folder.absolute())
    advice = (
        f"Delete the converted folder and convert it again: rm -r {broken} && "
        f"python -m dge_jax convert --model {source} --out {broken}"
    )
    message = str(exc.value)
    assert message.startswith("cannot read ") and message.endswith(advice)
    assert "\n" not in message
    assert main(["generate", "--model", str(broken), "--prompt", "w1 w2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot read ")
    assert lines[0].endswith(advice)


def test_convert_records_its_source(hf_folder, converted):
    assert hf.source_of(converted) == str(hf_folder.absolute())
    assert hf.source_of(hf_folder) is None


def test_convert_command(hf_folder, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["convert", "--model", str(hf_folder), "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(out.absolute())}
    assert orbax_io.is_converted(out)
    assert main(["convert", "--model", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["convert", "--model", str(hf_folder), "--out", str(out)]) == 2  # exists
    assert main(["convert", "--model", str(hf_folder), "--out", "x", "--mesh", "d=1"]) == 2


# --- Sharded safetensors loading -------------------------------------------------------------


def test_sharded_loader_equals_whole_tensor_loader(hf_folder):
    _, _, ref = load_hf_checkpoint(hf_folder)
    _, _, got = load_hf_checkpoint(hf_folder, mesh=sh.make_mesh(1, 1))
    assert_same_params(ref, got)
    assert got.layers.wo.sharding.spec == jax.P(None, "model", None)


def write_bf16_copy(src: pathlib.Path, dst: pathlib.Path) -> None:
    """`src` with every tensor stored as bfloat16 (safetensors' numpy writer has no bf16, so
    the file is written by hand: 8-byte header size, JSON header, then the raw data)."""
    from safetensors import safe_open

    dst.mkdir()
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (dst / file.name).write_bytes(file.read_bytes())
            continue
        header, blobs, offset = {}, [], 0
        with safe_open(file, "numpy") as f:
            for name in sorted(f.keys()):
                data = f.get_tensor(name).astype(jnp.bfloat16).tobytes()
                header[name] = {
                    "dtype": "BF16",
                    "shape": list(f.get_slice(name).get_shape()),
                    "data_offsets": [offset, offset + len(data)],
                }
                blobs.append(data)
                offset += len(data)
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        (dst / file.name).write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_sharded_loader_reads_bfloat16_files(hf_folder, tmp_path):
    write_bf16_copy(hf_folder, tmp_path / "bf16")
    _, _, ref = load_hf_checkpoint(hf_folder, dtype="bfloat16")
    _, _, got = load_hf_checkpoint(tmp_path / "bf16", dtype="bfloat16", mesh=sh.make_mesh())
    assert_same_params(ref, got)  # f32 -> bf16 rounding equals storing bf16


def test_plan_checks_names_shapes_and_layers(hf_folder, tmp_path):
    from safetensors.numpy import save_file

    from dge_jax.checkpoints.hf import parse_config, read_config, safetensors_files

    family, cfg = parse_config(read_config(hf_folder))
    files = safetensors_files(hf_folder)
    plan = plan_tensors(files, family.key_map(cfg), cfg)
    stacked, sources = plan["layers.wq"]
    assert stacked and [s.name for s in sources] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
    ]
    assert sources[0].transpose and plan["embed"] == (False, plan["embed"][1])

    extra = tmp_path / "extra.safetensors"
    save_file({"model.layers.0.self_attn.rotary.inv_freq": np.zeros(8, np.float32)}, extra)
    with pytest.raises(CheckpointError, match="matches no parameter"):
        plan_tensors([*files, extra], family.key_map(cfg), cfg)
    wrong = tmp_path / "wrong.safetensors"
    save_file({"model.norm.weight": np.zeros(63, np.float32)}, wrong)
    with pytest.raises(CheckpointError, match=r"model.norm.weight.*\(63,\).*\(64,\)"):
        plan_tensors([files[0], wrong], family.key_map(cfg), cfg)
    with pytest.raises(CheckpointError, match="missing for layer|lacks tensors"):
        plan_tensors(files[:1], family.key_map(cfg), cfg)
