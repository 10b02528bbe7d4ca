"""The real-data tests find ../shared/data beside the checkout, with no variable to export.

A new user runs the README's test command verbatim: the LongBench and RULER rows must be found
where the project keeps them, and a user without them must get skips that say why (a green run
of everything else), while CI, which has them, must fail rather than skip.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import conftest
import pytest

TESTS = pathlib.Path(__file__).resolve().parent


def test_data_folders_are_found_beside_the_checkout_without_variables():
    env = {k: v for k, v in os.environ.items() if k not in conftest.DATA_VARIABLES}
    code = ("import os, conftest; "
            "print(*(os.environ.get(v) for v in conftest.DATA_VARIABLES))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    expected = [str(conftest.SHARED_DATA / folder) if (conftest.SHARED_DATA / folder).is_dir()
                else "None" for folder in conftest.DATA_VARIABLES.values()]
    assert proc.stdout.split() == expected
    assert conftest.SHARED_DATA == TESTS.parents[1] / "shared" / "data"


def test_a_variable_naming_a_folder_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("DGE_RULER_DIR", str(tmp_path))
    assert conftest.shared_data_dir("DGE_RULER_DIR") == tmp_path


@pytest.mark.parametrize("ci", ["", "true"])
def test_missing_rows_skip_with_the_reason_or_fail_under_ci(monkeypatch, tmp_path, ci):
    monkeypatch.setattr(conftest, "SHARED_DATA", tmp_path / "absent")
    monkeypatch.delenv("DGE_LONGBENCH_DIR", raising=False)
    monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="DGE_LONGBENCH_DIR is unset .*put ../shared beside"):
        conftest.shared_data_dir("DGE_LONGBENCH_DIR")
    monkeypatch.setenv("DGE_LONGBENCH_DIR", str(tmp_path / "typo"))
    with pytest.raises(outcome, match="typo is not a folder"):
        conftest.shared_data_dir("DGE_LONGBENCH_DIR")
