"""A run writes only inside what it owns: its files go through one handle on a folder it made, nothing above it is
read or written but its results root's own index and assets (a root of this user's alone, never found by walking
up), external rows come only from folders `labkit import` made under that root, a manifest is read only as a
regular file under a size cap, and one malformed run never stops another's figures, index or listing.

Each test is an attack with real files, links and FIFOs in tmp_path; the ones that need a second user (a folder or
link another user owns) give it to a uid that is nobody's, and run only as root (`os.lchown`)."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import types
from pathlib import Path

import pandas as pd
import pytest

from labkit import results
from labkit.exchange import importer
from labkit.exchange.beside import decode_figure, external_points
from labkit.outdir import foreign_folder_problem, make_fresh_folder
from labkit.params import BadInput
from labkit.report import assets
from labkit.report.index import collect, rebuild_index
from labkit.results import Run, list_runs, read_manifest

OTHER = 54321          # a uid no account has: "another user"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def _manifest(run_id: str, **more) -> dict:
    return {"run_id": run_id, "experiment": "decode", "created": "2026-01-01T00:00:00+00:00", "status": "ok", **more}


def _run(folder: Path, rows: list[dict] | None = None, **more) -> Path:
    """A finished run folder written as labkit writes one (through `Run`)."""
    folder.mkdir(parents=True)
    run = Run(folder, _manifest(folder.name, **more))
    for r in rows or []:
        run.add(r)
    run.update_manifest()
    run.close()
    return folder


def _shared(path: Path) -> Path:
    """A folder like /tmp: everyone may write, sticky."""
    path.mkdir()
    path.chmod(0o1777)
    return path


@pytest.fixture
def quick_create(monkeypatch):
    """`Run.create` without probing the machine (torch, NVML, git): the folder and the manifest are what is tested."""
    monkeypatch.setattr(results, "machine_info", lambda: {})
    monkeypatch.setattr(results, "run_gpus", lambda params: [])
    monkeypatch.setattr(results, "describe_gpus", lambda gpus: {"none": "test"})
    monkeypatch.setattr(results, "git_sha", lambda: "test")
    monkeypatch.setattr(results, "machine_load", lambda: {})


GOOD = dict(experiment="decode", status="ok", strategy="resident", context_len=1024, concurrency=1, tok_s=100.0,
            step_ms_min=9.0, step_ms_max=11.0, step_ms_median=10.0)


# ------------------------------------------------------------------------------------------- the run folder
def test_a_link_swapped_in_the_path_mid_run_redirects_no_file(tmp_path, quick_create):
    """`--out base/link/run` with `link` -> mine; swapped to `elsewhere` while the run writes: every later file
    (rows, manifest, CSV, summary) still lands in the folder the run opened, none in `elsewhere`."""
    mine, elsewhere = tmp_path / "mine", tmp_path / "elsewhere"
    mine.mkdir(), elsewhere.mkdir()
    (tmp_path / "base").mkdir()
    link = tmp_path / "base" / "link"
    link.symlink_to(mine)
    run = Run.create(link / "run", "decode", {})
    (elsewhere / "run").mkdir()
    link.unlink()
    link.symlink_to(elsewhere)                      # the swap
    run.add(GOOD)
    run.write_csv("metrics", run.metrics())
    run.write_file("summary.md", "# summary\n")
    run.finish("ok")
    run.close()
    assert list((elsewhere / "run").iterdir()) == []
    assert {"manifest.json", "metrics.parquet", "metrics.csv", "summary.md"} <= {p.name for p in (mine / "run").iterdir()}
    assert json.loads((mine / "run" / "manifest.json").read_text())["status"] == "ok"


@as_root
def test_a_link_another_user_made_in_the_path_is_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    shared = _shared(tmp_path / "shared")
    link = shared / "link"
    link.symlink_to(mine)
    os.lchown(link, OTHER, OTHER)
    assert "symlink made by uid 54321" in foreign_folder_problem(link / "run")
    with pytest.raises(BadInput, match="symlink made by"):
        results.make_own_folder(link / "run", "--out")
    assert not (mine / "run").exists()


def test_two_runs_started_in_the_same_second_get_two_ids_and_keep_every_row(tmp_path, quick_create, monkeypatch):
    monkeypatch.setattr(results, "new_run_id", lambda experiment: f"20260101-000000-{experiment}")
    a = Run.create(None, "decode", {}, root=tmp_path)
    b = Run.create(None, "decode", {}, root=tmp_path)
    a.add({**GOOD, "context_len": 1})
    b.add({**GOOD, "context_len": 2})
    a.finish("ok"), b.finish("ok")
    a.close(), b.close()
    assert (a.path.name, b.path.name) == ("20260101-000000-decode", "20260101-000000-decode-2")
    assert a.run_id != b.run_id
    assert list(pd.read_parquet(a.path / "metrics.parquet")["context_len"]) == [1]
    assert list(pd.read_parquet(b.path / "metrics.parquet")["context_len"]) == [2]


def test_labkit_run_makes_its_folder_exclusively(tmp_path):
    """What `labkit run` does without `--out`: a folder made by this call, never one that exists (a link planted
    at the predictable id included)."""
    (tmp_path / "victim").mkdir()
    (tmp_path / "id").symlink_to(tmp_path / "victim")
    first = make_fresh_folder(tmp_path, "id", "--root")
    second = make_fresh_folder(tmp_path, "id", "--root")
    assert (first.name, second.name) == ("id-2", "id-3")
    assert not first.is_symlink() and list((tmp_path / "victim").iterdir()) == []


# ------------------------------------------------------------------------------------------- shared assets
def _page_script(page: Path) -> str:
    page.parent.mkdir(parents=True, exist_ok=True)
    return assets.plotly_script(page)


def test_an_assets_link_planted_in_a_shared_folder_above_a_run_is_never_written(tmp_path):
    """`--out /tmp/x`: a `_assets` link planted in /tmp makes no run replace files where it points."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / assets.PLOTLY_JS).write_text("keep")
    shared = _shared(tmp_path / "shared")
    (shared / assets.ASSETS).symlink_to(victim)
    tag = _page_script(shared / "x" / "report.html")
    assert "src=" not in tag[:100] and len(tag) > assets.BUNDLE_BYTES        # the page carries its own copy
    assert (victim / assets.PLOTLY_JS).read_text() == "keep" and sorted(p.name for p in victim.iterdir()) == [assets.PLOTLY_JS]


def test_assets_are_never_found_by_walking_up(tmp_path):
    top = tmp_path / "results"
    (top / assets.ASSETS).mkdir(parents=True)
    assert assets.results_root_of(top / "a" / "b" / "c" / "report.html") is None
    assert assets.results_root_of(top / "run" / "report.html") == top
    assert assets.results_root_of(top / "nightly-x" / "entry" / "report.html") == top


def test_an_assets_link_in_our_own_results_folder_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "results"
    root.mkdir()
    (root / assets.ASSETS).symlink_to(victim)
    assert len(_page_script(root / "run" / "report.html")) > assets.BUNDLE_BYTES
    with pytest.raises((BadInput, OSError)):
        assets.ensure_shared(root)
    assert list(victim.iterdir()) == []


def test_an_assets_folder_others_may_write_serves_no_script(tmp_path):
    root = tmp_path / "results"
    (root / assets.ASSETS).mkdir(parents=True)
    (root / assets.ASSETS).chmod(0o777)
    (root / assets.ASSETS / assets.PLOTLY_JS).write_text("alert('theirs')")
    tag = _page_script(root / "run" / "report.html")
    assert "alert('theirs')" not in tag and "src=" not in tag[:100]


@as_root
def test_another_users_assets_folder_serves_no_script(tmp_path):
    root = tmp_path / "results"
    (root / assets.ASSETS).mkdir(parents=True)
    (root / assets.ASSETS / assets.PLOTLY_JS).write_text("alert('theirs')")
    os.chown(root / assets.ASSETS, OTHER, OTHER)
    tag = _page_script(root / "run" / "report.html")
    assert "src=" not in tag[:100] and len(tag) > assets.BUNDLE_BYTES
    assert (root / assets.ASSETS / assets.PLOTLY_JS).read_text() == "alert('theirs')"


# ------------------------------------------------------------------------------------------- external rows
def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROW = {"model": "m", "engine": "vllm", "concurrency": 1, "context_len": 1024, "output_tok_s": 10.0, "decode_tok_s": 11.0}


def test_figures_beside_a_run_in_a_shared_folder_read_no_external_rows(tmp_path):
    """`--out /tmp/x`: its figures scan nothing under /tmp, and a JSON list there stops nothing."""
    shared = _shared(tmp_path / "shared")
    (shared / "theirs").mkdir()
    (shared / "theirs" / "manifest.json").write_text("[1, 2]")
    (shared / "external-x-0123abcd").mkdir()
    (shared / "external-x-0123abcd" / "manifest.json").write_text(json.dumps(_manifest("x", experiment="external")))
    assert external_points(shared).empty


def test_external_rows_come_only_from_folders_labkit_import_made(tmp_path):
    root = tmp_path / "results"
    folder, n, _, _ = importer.import_file(_jsonl(tmp_path / "a.jsonl", [ROW]), root)
    (root / "list").mkdir()
    (root / "list" / "manifest.json").write_text("[1, 2]")                  # a malformed run beside
    (root / "external-bad-0123abcd").mkdir()
    (root / "external-bad-0123abcd" / "manifest.json").write_text('["external"]')
    _run(root / "not-imported", [{**GOOD, "shape": "m"}], experiment="external")     # says external, not made by import
    pts = external_points(root)
    assert list(pts["run_id"].unique()) == [folder.name] and len(pts) == n == 1


def test_string_typed_external_rates_never_stop_a_figure(tmp_path):
    root = tmp_path / "results"
    importer.import_file(_jsonl(tmp_path / "a.jsonl", [{**ROW, "decode_tok_s": "fast"}]), root)
    pts = external_points(root)
    assert pts["decode_tok_s"].isna().all() and pts["concurrency"].dtype.kind in "if"
    lab = pd.DataFrame([{**dict.fromkeys(results.METRIC_COLUMNS), **GOOD, "run_id": "r", "shape": "m", "repeats": 1, "budget": 2048}])
    assert decode_figure(lab, pts, {"m"}) is not None


# ------------------------------------------------------------------------------------------- labkit import
def test_import_refuses_a_world_writable_root(tmp_path):
    root = tmp_path / "open"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(BadInput, match="mode 0777"):
        importer.import_file(_jsonl(tmp_path / "a.jsonl", [ROW]), root)
    assert list(root.iterdir()) == []


@as_root
def test_import_refuses_another_users_folder(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir()
    os.chown(root, OTHER, OTHER)
    with pytest.raises(BadInput, match="belongs to uid 54321"):
        importer.import_file(_jsonl(tmp_path / "a.jsonl", [ROW]), root)
    assert list(root.iterdir()) == []


def test_import_never_writes_through_a_link_planted_at_its_folder_name(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", [ROW])
    root, victim = tmp_path / "results", tmp_path / "victim"
    root.mkdir(), victim.mkdir()
    name = f"external-a-{hashlib.sha256(src.read_bytes()).hexdigest()[:8]}"
    (root / name).symlink_to(victim)
    with pytest.raises(BadInput, match="not an import labkit made"):
        importer.import_file(src, root)
    assert list(victim.iterdir()) == []


def test_the_same_file_imported_again_is_the_same_folder(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", [ROW])
    first = importer.import_file(src, tmp_path / "results")
    again = importer.import_file(src, tmp_path / "results")
    assert (again[0], again[3]) == (first[0], True)


# ------------------------------------------------------------------------------------------- manifests
def _in_thread(fn, *args):
    """`fn(*args)` with a deadline: (finished, result or exception)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(_call(fn, *args)), daemon=True)
    t.start()
    t.join(5)
    return (not t.is_alive()), (out[0] if out else None)


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception as ex:
        return ex


def _release(fifo: Path) -> None:
    """Give a reader stuck on the FIFO (the old code) its end of file."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_a_fifo_as_manifest_neither_hangs_the_listing_nor_hides_the_others(tmp_path):
    _run(tmp_path / "good")
    (tmp_path / "fifo").mkdir()
    fifo = tmp_path / "fifo" / "manifest.json"
    os.mkfifo(fifo)
    try:
        done, df = _in_thread(list_runs, tmp_path)
    finally:
        _release(fifo)
    assert done, "labkit runs waited on a FIFO"
    rows = df.set_index("run_id")
    assert rows.loc["good", "status"] == "ok"
    assert rows.loc["fifo", "status"] == results.UNREADABLE and "not a regular file" in rows.loc["fifo", "error"]


def test_dev_zero_as_manifest_is_refused_without_reading(tmp_path):
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "manifest.json").symlink_to("/dev/zero")
    done, got = _in_thread(read_manifest, tmp_path / "zero")
    assert done and isinstance(got, results.BadManifest) and "symlink" in str(got)


@as_root
def test_a_device_as_manifest_is_refused_without_reading(tmp_path):
    (tmp_path / "dev").mkdir()
    os.mknod(tmp_path / "dev" / "manifest.json", stat.S_IFCHR | 0o600, os.makedev(1, 5))     # /dev/zero's
    done, got = _in_thread(read_manifest, tmp_path / "dev")
    assert done and isinstance(got, results.BadManifest) and "not a regular file" in str(got)


def test_a_manifest_over_the_cap_is_refused_unread(tmp_path):
    (tmp_path / "big").mkdir()
    with open(tmp_path / "big" / "manifest.json", "wb") as f:
        f.truncate(results.MANIFEST_CAP + 1)            # sparse: no disk, no time
    with pytest.raises(results.BadManifest, match="over the"):
        read_manifest(tmp_path / "big")


def test_a_fifo_as_a_nightly_record_does_not_hang_the_index(tmp_path):
    _run(tmp_path / "good")
    (tmp_path / "nightly-2026-01-01").mkdir()
    fifo = tmp_path / "nightly-2026-01-01" / "nightly.json"
    os.mkfifo(fifo)
    try:
        done, got = _in_thread(rebuild_index, tmp_path)
    finally:
        _release(fifo)
    assert done and isinstance(got, Path) and got.is_file()


# ------------------------------------------------------------------------------------------- the index
def test_one_run_with_string_typed_columns_never_stops_the_index(tmp_path):
    root = tmp_path / "results"
    _run(root / "good", [GOOD])
    _run(root / "bad", [{k: str(v) for k, v in GOOD.items()}])
    (root / "list").mkdir()
    (root / "list" / "manifest.json").write_text("[1]")
    runs, heads, problems = collect(root)
    assert set(runs["run_id"]) == {"good", "bad", "list"} and set(heads["run_id"]) == {"good"}
    assert any("bad" in p for p in problems)
    assert (rebuild_index(root)).is_file()


def test_no_index_is_written_in_a_shared_folder(tmp_path):
    """`--out /tmp/x` rebuilds no /tmp/index.html (and reads no run beside it)."""
    shared = _shared(tmp_path / "shared")
    _run(shared / "x")
    with pytest.raises(BadInput, match="mode 1777"):
        rebuild_index(shared)
    assert not (shared / "index.html").exists()


def test_the_estimate_from_earlier_runs_passes_over_a_fifo_and_a_list(tmp_path, monkeypatch):
    """`labkit run`'s estimate reads every earlier run's manifest under the results folder: a FIFO there neither
    hangs it nor a JSON list stops it."""
    from labkit import sweep
    here = {"gpu_name": None, "cpu_model": "cpu", "cpu_count": 2}
    monkeypatch.setattr(results, "machine_info", lambda: here)
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "manifest.json").write_text(json.dumps(
        _manifest("good", parameters={"a": 1}, wall_s=30.0, **here)))
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "manifest.json").write_text("[1]")
    (tmp_path / "fifo").mkdir()
    fifo = tmp_path / "fifo" / "manifest.json"
    os.mkfifo(fifo)
    try:
        done, got = _in_thread(sweep.from_history, "decode", {"a": 1}, [str(tmp_path)])
    finally:
        _release(fifo)
    assert done and not isinstance(got, Exception) and got is not None and got.seconds == 30.0


def test_resume_auto_passes_over_a_fifo_and_a_list(tmp_path, monkeypatch):
    from labkit.experiments import trace_replay
    monkeypatch.setattr(results, "REPO", tmp_path)
    root = tmp_path / "results"
    (root / "list").mkdir(parents=True)
    (root / "list" / "manifest.json").write_text("[1]")
    (root / "fifo").mkdir()
    fifo = root / "fifo" / "manifest.json"
    os.mkfifo(fifo)
    try:
        plan = types.SimpleNamespace(resume="auto", params={"resume": "auto"})    # the fields find_resume reads
        done, got = _in_thread(trace_replay.find_resume, plan, "trace_replay")
    finally:
        _release(fifo)
    assert done and got == ""
