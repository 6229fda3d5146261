"""A run's folder (`--out`), checked before anything runs. Imports nothing heavy: `labkit run` calls it
while it is still parsing its command line."""
from __future__ import annotations

from pathlib import Path

from .params import BadInput


def prepare_out_dir(out: Path, others_ok: bool = False) -> Path:
    """Make the run folder, or say in one line why it cannot be one, before anything runs: a folder that
    already holds a run, or holds other files (a run would be mixed into them; `others_ok` for a caller that
    put them there, as the nightly runner puts its log), or cannot be written."""
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: a file, not a folder")
    if (out / "metrics.parquet").exists():
        raise BadInput(f"--out {out} already holds a run; choose another --out")
    if not others_ok and out.is_dir() and not (out / "manifest.json").exists() and any(out.iterdir()):
        raise BadInput(f"--out {out} holds other files and is not a run folder; choose a new or empty folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".labkit-write-check"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as ex:
        raise BadInput(f"--out {out}: cannot write there ({ex.strerror or type(ex).__name__})") from None
    return out
