"""`labkit export RUN [RUN ...] --format jsonl|sqlite|markdown [--out FILE]`: a run's measured points as rows
(`archive.rows_of_run`; an imported run: the rows it took in), in the archive's own file formats, or as the Markdown table people paste into an issue.

- `jsonl`: one JSON object per line, the fields in `archive.FIELDS` order (stdout, or `--out`);
- `sqlite`: a `runs` table with the archive's column types, nested fields as JSON text, flags as 0/1, `run_id`
  unique; an existing file gains the rows (a point exported twice is replaced, not doubled), and a table an
  earlier labkit wrote gains the fields it lacked; `labkit import` reads the file back as the same rows;
- `markdown`: a table of the headline fields and, under it, each run's `labkit` command in a code block.
"""
from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from ..atomic import write_text
from ..params import BadInput
from .archive import BOOL, FIELD_NAMES, INTEGER, REAL, rows_of_run

FORMATS = ("jsonl", "sqlite", "markdown")
MARKDOWN = ["model", "quant", "engine", "engine_version", "hardware", "labkit_strategy", "prompt_tokens", "concurrency",
            "output_tps_kind", "output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "prefill_tok_s", "decode_tok_s"]


def collect(runs: list[str]) -> tuple[list[dict], list[str]]:
    """(every run's rows, one note per run with failed points left out)."""
    rows, notes = [], []
    for r in runs:
        got, skipped = rows_of_run(r)
        rows += got
        if skipped:
            notes.append(f"{r}: {skipped} failed point{'s' if skipped != 1 else ''} left out")
    if not rows:
        raise BadInput(f"{', '.join(runs)}: no measured point to export")
    return rows, notes


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def column_type(field: str) -> str:
    return "INTEGER" if field in INTEGER or field in BOOL else "REAL" if field in REAL else "TEXT"


def to_sqlite(rows: list[dict], path: Path) -> Path:
    """Rows into `path`'s `runs` table (made with the archive's columns where absent; a table an earlier labkit
    made, with fewer fields, gains the new columns)."""
    cols = ", ".join(f'"{f}" {column_type(f)}' for f in FIELD_NAMES)
    con = sqlite3.connect(path)
    try:
        with con:
            con.execute(f"CREATE TABLE IF NOT EXISTS runs ({cols})")
            con.execute("CREATE UNIQUE INDEX IF NOT EXISTS runs_run_id_uq ON runs(run_id)")
            have = {r[1] for r in con.execute("PRAGMA table_info(runs)")}
            missing = [f for f in FIELD_NAMES if f not in have]
            if missing and not {"run_id", "model", "output_tok_s", "launch_cmd"} <= have:
                raise BadInput(f"{path}: its runs table lacks {', '.join(missing[:5])}: not a table of these rows")
            for f in missing:
                con.execute(f'ALTER TABLE runs ADD COLUMN "{f}" {column_type(f)}')
            marks = ", ".join("?" for _ in FIELD_NAMES)
            names = ", ".join(f'"{f}"' for f in FIELD_NAMES)
            con.executemany(f"INSERT OR REPLACE INTO runs ({names}) VALUES ({marks})",
                            [[_cell(r[f]) for f in FIELD_NAMES] for r in rows])
    except sqlite3.DatabaseError as ex:
        raise BadInput(f"{path}: not a SQLite file ({ex})") from None
    finally:
        con.close()
    return path


def _cell(v):
    if isinstance(v, bool):
        return int(v)
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (list, dict)) else v


def markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table (numbers to 3 significant figures), then each run's command."""
    def fmt(v) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v).replace("|", "\\|")
    lines = ["| " + " | ".join(MARKDOWN) + " |", "|" + "---|" * len(MARKDOWN)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in MARKDOWN) + " |" for r in rows]
    seen = []
    for r in rows:
        if r["launch_cmd"] not in seen:
            seen.append(r["launch_cmd"])
    lines += ["", "Measured with labkit (`labkit export --format jsonl` gives every field):", ""]
    for cmd in seen:
        lines += ["```", cmd, "```"]
    return "\n".join(lines) + "\n"


def cmd_export(a) -> int:
    """The CLI's `export`: one line for bad input before anything is written."""
    if a.format not in FORMATS:
        raise BadInput(f"--format must be one of {', '.join(FORMATS)}, got {a.format!r}")
    out = Path(a.out) if a.out else None
    if a.format == "sqlite" and out is None:
        raise BadInput("--format sqlite writes a file: give --out FILE.sqlite")
    if out is not None and out.is_dir():
        raise BadInput(f"--out {out} is a folder: give a file")
    if out is not None and not out.parent.is_dir():
        raise BadInput(f"--out {out}: folder {out.parent} does not exist")
    rows, notes = collect(a.runs)
    for n in notes:
        print(f"labkit: {n}", file=sys.stderr)
    if a.format == "sqlite":
        print(to_sqlite(rows, out))
        return 0
    text = jsonl(rows) if a.format == "jsonl" else markdown(rows)
    if out is None:
        sys.stdout.write(text)
    else:
        write_text(out, text)
        print(out)
    return 0
