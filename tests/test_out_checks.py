"""`--out` and the probe's pool are checked before anything runs: one line, exit 2, nothing written."""
from __future__ import annotations

import time

import psutil
import pytest

from labkit.cli import main


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("labkit: "), err
    return err


def test_a_folder_of_other_files_is_refused_and_left_as_it_was(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["run", "probe", "--out", str(tmp_path)]) == 2
    assert "not a run folder" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "f").write_text("")
    assert main(["run", "probe", "--out", str(tmp_path / "f")]) == 2
    assert "not a folder" in _one_line(capsys)


@pytest.mark.parametrize("where", ["/proc/labkit-run", "/dev/null/run"])
def test_an_unwritable_place_is_one_line_at_once(where, capsys):
    t0 = time.time()
    assert main(["run", "probe", "--out", where]) == 2
    assert "cannot write there" in _one_line(capsys) and time.time() - t0 < 5


def test_bad_input_after_out_leaves_no_new_folder(tmp_path, capsys):
    out = tmp_path / "new" / "run"
    assert main(["run", "probe", "--out", str(out), "-p", "repeats=0"]) == 2
    assert "repeats" in _one_line(capsys)
    assert not (tmp_path / "new").exists()


def test_probe_pool_larger_than_ram_is_refused_up_front(tmp_path, capsys):
    too_big = 2 * psutil.virtual_memory().total / 2**30
    assert main(["run", "probe", "--out", str(tmp_path / "run"), "-p", f"pool_gib={too_big:.0f}"]) == 2
    err = _one_line(capsys)
    assert "does not fit" in err and "RAM" in err
    assert not (tmp_path / "run").exists()
