"""Whole-or-absent file writes: a reader (or a crash, or a full disk) never leaves half a file behind,
and no write follows a link.

`replacing(path)` hands out a private temporary name in the same folder (created exclusively, never a
symlink someone planted), and on success flushes it to disk and renames it over `path` in one step; on
any failure the temporary file is removed, so neither a truncated file nor a stray `.tmp` stays. The
folder is synced after the rename so the new name survives a power cut too. A symlink (or hard link)
planted at `path` is replaced by the rename, never written through. `open_replacing` is the same with a
file object on the exclusively created temporary file (for writers that take a stream: CSV, text).

Every file in a run folder is written this way. The one exception is a stream that grows while a run goes
on (a kernel's log, a server's one line per request): `open_append` opens it without following a link
and only if it is a regular file of this user's with one name (a FIFO, a device, someone else's file or a
second name for another file is refused), so an append never lands outside the folder either.

When the disk is full even a small file cannot be created. `rewrite_in_place` is the last resort for a
file that already exists (the run manifest, whose final status must say what happened): it rewrites it
inside the blocks it already holds, which needs no new space while the new text is no longer than the
space the file occupies.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from .params import BadInput

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:        # some file systems cannot sync a folder; the rename itself is still atomic
        pass
    finally:
        os.close(fd)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fresh_temp(path: Path) -> tuple[Path, int]:
    """A new private name beside `path`, created exclusively (never an existing file or a planted link)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | os.O_CLOEXEC, 0o666)


@contextlib.contextmanager
def replacing(path: str | Path):
    """`with replacing(p) as tmp: write tmp` -> `p` is the whole new file, or unchanged if anything failed."""
    path = Path(path)
    tmp, fd = _fresh_temp(path)
    os.close(fd)
    try:
        yield tmp
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def open_replacing(path: str | Path, mode: str = "w", encoding: str = "utf-8", sync: bool = True):
    """`with open_replacing(p) as f: f.write(...)` -> `p` is the whole new file, or unchanged if anything
    failed. `f` is the exclusively created temporary file itself (no second open by name); mode "w" or "wb".
    `sync=False` skips the flush to disk (a counters snapshot rewritten several times a second: a power
    cut may lose the last one; it is still whole and never written through a link)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"open_replacing: mode {mode!r} (w or wb)")
    path = Path(path)
    tmp, fd = _fresh_temp(path)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding, "newline": ""})) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if sync:
        _fsync_dir(path.parent)


def open_append(path: str | Path, mode: str = "a", encoding: str = "utf-8"):
    """A stream appending to `path` (made 0644 if absent; mode "a" text or "ab" bytes), opened without
    following a link, without blocking on a FIFO, and only if it is a regular file of this user's with no
    other name; else OSError."""
    if mode not in ("a", "ab"):
        raise ValueError(f"open_append: mode {mode!r} (a or ab)")
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else f"{st.st_nlink} names for one file")
            raise OSError(errno.EPERM, f"refused to append ({why})", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding}))
    except BaseException:
        os.close(fd)
        raise


def write_bytes(path: str | Path, data: bytes, sync: bool = True) -> Path:
    with open_replacing(path, "wb", sync=sync) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str, encoding: str = "utf-8", sync: bool = True) -> Path:
    return write_bytes(path, text.encode(encoding), sync=sync)


def rewrite_in_place(path: str | Path, data: bytes) -> None:
    """Overwrite an existing file's content without creating a new one (see the module note): used only
    when `write_bytes` failed for lack of space. Raises OSError when even that cannot be done."""
    fd = os.open(path, os.O_WRONLY | NOFOLLOW | os.O_CLOEXEC)
    try:
        held = os.fstat(fd).st_blocks * 512
        if len(data) > held:         # it would need new blocks: refuse rather than leave half a file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        n = os.write(fd, data)
        if n != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def no_space(ex: BaseException) -> bool:
    return isinstance(ex, OSError) and ex.errno in (errno.ENOSPC, errno.EDQUOT)


def write_text_or_in_place(path: str | Path, text: str) -> str:
    """`write_text`, falling back to `rewrite_in_place` on a full disk for a file that exists. Returns
    how it was written ("replaced" or "in place")."""
    data = text.encode("utf-8")
    try:
        write_bytes(path, data)
        return "replaced"
    except OSError as ex:
        if not (no_space(ex) and Path(path).is_file()):
            raise
        rewrite_in_place(path, data)
        return "in place"


def describe_os_error(ex: OSError) -> str:
    """One line for a file-system error: what, where ("No space left on device: results/x/metrics.parquet")."""
    what = ex.strerror or str(ex) or type(ex).__name__
    where = ex.filename if ex.filename is not None else ""
    return f"{what}: {where}" if where else what


def check_writable(folder: str | Path, what: str) -> Path:
    """Make `folder` (and its parents) and prove a file can be created in it, before anything is measured;
    a read-only file system or a folder we may not write is one line (BadInput)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".labkit-write-check.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as ex:
        raise BadInput(f"{what} {folder}: cannot write there ({ex.strerror or type(ex).__name__})") from None
    return folder
