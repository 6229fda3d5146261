"""`labkit import FILE [--source NAME] [--hardware TEXT] [--root results]`: rows of a benchmark archive (the
public 4x RTX 3090 archive's JSONL, or what `labkit export` wrote: JSONL, or SQLite's `runs` table) into the index
as one external run, which `labkit export` writes out again as the same rows.

The run folder `<root>/external-<source>-<first 8 hex of the file's sha256>/` holds:
- `manifest.json`: experiment `external`, status ok, and `external`: the source, the file's name and checksum, the
  rows taken and left out, the hardware as the source states it, when it was imported. Nothing of this machine
  is recorded as the measuring one (`host` says external);
- `metrics.parquet`: one row per imported measurement, every field of the row under its own name (nested ones as
  JSON text), plus the lab's columns the figures read: `shape` (the model), `context_len` (the depth measured:
  `prompt_tokens` where the row has it, else its `context_len`, kept as `context_limit`), `concurrency`, `strategy`
  (engine and quantization), `tok_s` (the row's `output_tok_s`), `source` (the import's name; the archive's own
  `source` field is kept as `campaign`), and `archive_row`: the row as it came, JSON text (what `labkit export`
  of this run writes back);
- `report.html`: the rows as a table, so the run index links something readable.

The root must be this user's alone (another user's folder, or one others may write, is refused in one line), and
the run folder is made by the import itself (`mkdir` that fails where the name exists): a link or folder planted
at the predictable name is refused, never written through. The same file imported again is the same folder: it
says so and writes nothing. A line that is not a JSON object is
one BadInput line naming it; a record that is not a measurement, or has no model, is left out and counted.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import html
import json
import os
import re
import sqlite3
import stat
from pathlib import Path

import pandas as pd

from ..outdir import FOLDER_MODE, make_own_folder, open_own_folder
from ..params import BadInput
from ..report.index import rebuild_index
from ..results import Run, read_manifest
from .archive import NESTED, typed

EXPERIMENT = "external"
SQLITE_MAGIC = b"SQLite format 3\x00"
RATES = ("output_tok_s", "decode_tok_s", "prefill_tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms")


def read_rows(path: Path) -> tuple[list[dict], int]:
    """(the measurements of a JSONL or SQLite file, how many records were left out)."""
    if not path.is_file():
        raise BadInput(f"{path} does not exist")
    with open(path, "rb") as f:
        sqlite = f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    rows, skipped = [], 0
    for r in (sqlite_records(path) if sqlite else _jsonl_records(path)):
        usable = r.get("record_kind", "measurement") == "measurement" and r.get("model") \
            and any(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for k in RATES)
        if usable:
            rows.append(r)
        else:
            skipped += 1
    if not rows:
        raise BadInput(f"{path}: no measurement rows (each needs a model and one of {', '.join(RATES)})")
    return rows, skipped


def _jsonl_records(path: Path):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError as ex:
                raise BadInput(f"{path}:{n}: not JSON ({ex.msg})") from None
            if not isinstance(r, dict):
                raise BadInput(f"{path}:{n}: not a JSON object")
            yield r


def sqlite_records(path: Path) -> list[dict]:
    """The rows of a SQLite file's `runs` table (what `labkit export --format sqlite` writes), read-only, each
    field as its JSON row held it (lists and objects parsed back from their JSON text, 0/1 flags as booleans)."""
    try:
        con = sqlite3.connect(f"file:{path.resolve().as_uri()[len('file://'):]}?mode=ro", uri=True)
    except sqlite3.Error as ex:
        raise BadInput(f"{path}: not a readable SQLite file ({ex})") from None
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        if "runs" not in tables:
            raise BadInput(f"{path}: a SQLite file without a `runs` table (tables: {', '.join(tables) or 'none'}); "
                           f"labkit reads the table `labkit export --format sqlite` writes")
        cur = con.execute("SELECT * FROM runs ORDER BY rowid")
        names = [d[0] for d in cur.description]
        return [{k: typed(k, v) for k, v in zip(names, row)} for row in cur]
    except sqlite3.Error as ex:
        raise BadInput(f"{path}: not a readable SQLite file ({ex})") from None
    finally:
        con.close()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "rows"


def lab_frame(rows: list[dict], folder: str, source: str, hardware: str) -> pd.DataFrame:
    """The rows as a lab metrics table (see the module docstring)."""
    out = []
    for r in rows:
        row = {k: (json.dumps(v, ensure_ascii=False) if (k in NESTED or isinstance(v, (list, dict))) and v is not None
                   else v) for k, v in r.items()}
        row["campaign"], row["external_run_id"] = row.pop("source", None), row.pop("run_id", None)
        depth = r.get("prompt_tokens") if isinstance(r.get("prompt_tokens"), (int, float)) else r.get("context_len")
        c = r.get("concurrency") if isinstance(r.get("concurrency"), (int, float)) else 1
        out.append({"run_id": folder, "experiment": EXPERIMENT, "status": "ok", "error": None, "device": "external",
                    "gpu_name": hardware, "shape": r["model"], "strategy": " ".join(str(x) for x in (r.get("engine"), r.get("quant")) if x),
                    **row, "context_limit": r.get("context_len"), "context_len": depth, "concurrency": c,
                    "tok_s": r.get("output_tok_s"), "source": source, "archive_row": json.dumps(r, ensure_ascii=False)})
    return pd.DataFrame(out)


def import_file(path: str | Path, root: str | Path = "results", source: str = "", hardware: str = "") -> tuple[Path, int, int, bool]:
    """(the run folder, rows imported, records left out, whether it was there already)."""
    path, root = Path(path), Path(root)
    rows, skipped = read_rows(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    source = source or path.stem
    folder, was = _claim(root, f"external-{slug(source)}-{digest[:8]}")
    if was:
        return folder, len(rows), skipped, True
    hw = hardware or "hardware not stated"
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    manifest = {"run_id": folder.name, "experiment": EXPERIMENT, "created": now, "host": "external",
                "gpu_name": hardware or None, "parameters": {"file": path.name, "source": source},
                "external": {"source": source, "file": path.name, "sha256": digest, "rows": len(rows),
                             "left_out": skipped, "hardware": hw, "imported": now},
                "status": "ok", "wall_s": 0.0}
    run = Run(folder, manifest)       # every file below through one handle on the folder made above
    try:
        run.write_table("metrics", lab_frame(rows, folder.name, source, hw))
        run.write_file("report.html", _page(manifest, rows))
        run.update_manifest()         # the manifest last: a folder without one is no run (an import cut short)
    finally:
        run.close()
    return folder, len(rows), skipped, False


def _claim(root: Path, name: str) -> tuple[Path, bool]:
    """(`root/name`, made by this call: False; or an earlier import of the same file: True). The root must be this
    user's alone (not another user's, not writable by others); the folder is made with a `mkdir` that fails when
    the name exists, so a link or folder planted at the predictable name is refused, never written through."""
    make_own_folder(root, "--root")
    folder = root / name
    fd = open_own_folder(root, "--root")
    try:
        os.mkdir(name, FOLDER_MODE, dir_fd=fd)
        return folder, False
    except FileExistsError:
        pass
    finally:
        os.close(fd)
    if imported_here(folder) and not os.path.lexists(folder / "manifest.json"):
        return folder, False                   # ours, cut short before its manifest: written again
    try:
        read_manifest(folder)                  # read without following a link, checked as any run's
        if not imported_here(folder):
            raise BadInput("")
    except (BadInput, OSError):
        raise BadInput(f"{folder} exists and is not an import labkit made (a link, another user's folder or one "
                       f"cut short); remove it and import again") from None
    return folder, True


def imported_here(folder: Path) -> bool:
    """Is `folder` a real folder (not a link) of this user's alone: what `_claim` made."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _page(mf: dict, rows: list[dict]) -> str:
    """A plain page of the imported rows (no script): what the run index links for this run."""
    cols = ["model", "quant", "engine", "engine_version", "tp", "pp", "power_limit_w", "kv_cache_dtype", "context_len",
            "prompt_tokens", "gen_tokens", "concurrency", "output_tps_kind", "output_tok_s", "ttft_p50_ms",
            "tpot_p50_ms", "prefill_tok_s", "decode_tok_s", "run_id"]
    df = pd.DataFrame([{c: r.get(c) for c in cols} for r in rows])
    ext = mf["external"]
    return (f"<!doctype html><meta charset='utf-8'><title>{html.escape(mf['run_id'])}</title>"
            f"<h1>External rows: {html.escape(ext['source'])}</h1>"
            f"<p>{ext['rows']} rows from <code>{html.escape(ext['file'])}</code> (sha256 {ext['sha256'][:16]}...), "
            f"{ext['left_out']} records left out; hardware: {html.escape(ext['hardware'])}; imported {ext['imported']}. "
            f"Measured elsewhere, not by this lab: the decode, prefill and serving figures draw them beside the lab's "
            f"points, labelled external.</p>" + df.to_html(index=False, na_rep="", float_format=lambda v: f"{v:.4g}"))


def cmd_import(a) -> int:
    root = Path(a.root)
    if root.exists() and not root.is_dir():
        raise BadInput(f"--root {root} is not a folder")
    folder, n, skipped, was = import_file(a.file, root, a.source or "", a.hardware or "")
    if was:
        print(f"labkit: {a.file} was imported already: {folder}")
        return 0
    try:
        rebuild_index(root)
    except Exception as ex:       # the rows are in; say why the page did not follow
        print(f"labkit: run index not rebuilt: {ex}")
    print(f"{n} rows imported, {skipped} left out: {folder}")
    return 0
