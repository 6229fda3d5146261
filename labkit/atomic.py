"""Whole-or-absent file writes: a reader (or a crash, or a full disk) never leaves half a file behind,
and no write follows a link.

`replacing(path)` hands out a private temporary name in the same folder (created exclusively, never a
symlink someone planted), and on success flushes it to disk and renames it over `path` in one step; on
any failure the temporary file is removed, so neither a truncated file nor a stray `.tmp` stays. The
folder is synced after the rename so the new name survives a power cut too. A symlink (or hard link)
planted at `path` is replaced by the rename, never written through. `open_replacing` is the same with a
file object on the exclusively created temporary file (for writers that take a stream: CSV, text).

The folder is looked up once per write: the temporary name, the flush, the rename and the folder's sync all go
through one handle on it (`dir_fd`), so a link swapped into the path meanwhile cannot split them between two
folders. The `*_at` forms take that handle from the caller: a run opens its folder once (`results.Run.fd`) and
creates every file of the run through it, whatever happens to the path later. `read_regular_at` reads a file
only if it is a regular one under a size cap, without following a link or waiting on a FIFO.

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


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_dir(folder: str | Path, follow: bool = True) -> int:
    """A handle on `folder` (a file descriptor): every name created, synced and renamed through it lands in
    that one folder, whatever happens to the path meanwhile. `follow=False` refuses a link at the last name."""
    return os.open(folder, DIR_FLAGS | (0 if follow else NOFOLLOW))


@contextlib.contextmanager
def _parent_of(path: Path):
    # the folder is looked up once: the temporary name, its rename and the folder's sync all go through this handle
    fd = open_dir(path.parent)
    try:
        yield fd
    finally:
        os.close(fd)


def _fsync_dir_fd(dfd: int) -> None:
    try:
        os.fsync(dfd)
    except OSError:        # some file systems cannot sync a folder; the rename itself is still atomic
        pass


def _temp_name(name: str) -> str:
    """A new private name beside `name`. Named before it is made, so the `try` that removes it on any failure can
    already hold its creation: a Ctrl-C landing between the file's creation and a later `try` left it behind."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _create(dfd: int, tmp: str) -> int:
    """`tmp` created exclusively in the folder `dfd` (never an existing file or a planted link)."""
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dfd)


def _through(dfd: int, name: str, folder: Path) -> Path:
    """A path to `name` that goes through the handle `dfd` (Linux's /proc/self/fd), for writers that only take a
    path (pyarrow, papermill); `folder/name` where there is no /proc."""
    via = Path(f"/proc/self/fd/{dfd}")
    return via / name if via.is_dir() else folder / name


def _drop(dfd: int, tmp: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(tmp, dir_fd=dfd)


@contextlib.contextmanager
def replacing_at(dfd: int, name: str, folder: Path = Path(".")):
    """`replacing` for `name` in the folder held by `dfd`; `folder` is only the fallback path without /proc."""
    tmp = _temp_name(name)
    try:
        os.close(_create(dfd, tmp))
        yield _through(dfd, tmp, folder)
        fd = os.open(tmp, os.O_RDONLY | NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException as ex:
        if not isinstance(ex, FileExistsError):     # the name was taken: that file is not ours to remove
            _drop(dfd, tmp)
        raise
    _fsync_dir_fd(dfd)


@contextlib.contextmanager
def replacing(path: str | Path):
    """`with replacing(p) as tmp: write tmp` -> `p` is the whole new file, or unchanged if anything failed."""
    path = Path(path)
    with _parent_of(path) as dfd, replacing_at(dfd, path.name, path.parent) as tmp:
        yield tmp


@contextlib.contextmanager
def open_replacing_at(dfd: int, name: str, mode: str = "w", encoding: str = "utf-8", sync: bool = True):
    """`open_replacing` for `name` in the folder held by `dfd`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"open_replacing: mode {mode!r} (w or wb)")
    tmp = _temp_name(name)
    try:
        with os.fdopen(_create(dfd, tmp), mode, **({} if "b" in mode else {"encoding": encoding, "newline": ""})) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException as ex:
        if not isinstance(ex, FileExistsError):     # the name was taken: that file is not ours to remove
            _drop(dfd, tmp)
        raise
    if sync:
        _fsync_dir_fd(dfd)


@contextlib.contextmanager
def open_replacing(path: str | Path, mode: str = "w", encoding: str = "utf-8", sync: bool = True):
    """`with open_replacing(p) as f: f.write(...)` -> `p` is the whole new file, or unchanged if anything
    failed. `f` is the exclusively created temporary file itself (no second open by name); mode "w" or "wb".
    `sync=False` skips the flush to disk (a counters snapshot rewritten several times a second: a power
    cut may lose the last one; it is still whole and never written through a link)."""
    path = Path(path)
    with _parent_of(path) as dfd, open_replacing_at(dfd, path.name, mode, encoding, sync) as f:
        yield f


def open_append_at(dfd: int | None, name: str | Path, mode: str = "a", encoding: str = "utf-8"):
    """`open_append` for `name` in the folder held by `dfd` (None: `name` is a path)."""
    if mode not in ("a", "ab"):
        raise ValueError(f"open_append: mode {mode!r} (a or ab)")
    fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                 dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else f"{st.st_nlink} names for one file")
            raise OSError(errno.EPERM, f"refused to append ({why})", str(name))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding}))
    except BaseException:
        os.close(fd)
        raise


def open_append(path: str | Path, mode: str = "a", encoding: str = "utf-8"):
    """A stream appending to `path` (made 0644 if absent; mode "a" text or "ab" bytes), opened without
    following a link, without blocking on a FIFO, and only if it is a regular file of this user's with no
    other name; else OSError."""
    return open_append_at(None, Path(path), mode, encoding)


def read_regular_at(dfd: int | None, name: str | Path, cap: int) -> bytes:
    """The bytes of `name` (in the folder `dfd`, or a path), read only if it is a regular file (no link
    followed, a FIFO or a device never waited on) of at most `cap` bytes; OSError saying why otherwise."""
    fd = os.open(name, os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(name))
        if st.st_size > cap:
            raise OSError(errno.EFBIG, f"{st.st_size:,} bytes, over the {cap:,} read", str(name))
        data = os.read(fd, cap + 1)
        while len(data) <= cap and (more := os.read(fd, cap + 1 - len(data))):
            data += more
        if len(data) > cap:        # grew while read
            raise OSError(errno.EFBIG, f"over the {cap:,} bytes read", str(name))
        return data
    finally:
        os.close(fd)


def write_bytes_at(dfd: int, name: str, data: bytes, sync: bool = True) -> None:
    with open_replacing_at(dfd, name, "wb", sync=sync) as f:
        f.write(data)


def write_bytes(path: str | Path, data: bytes, sync: bool = True) -> Path:
    with open_replacing(path, "wb", sync=sync) as f:
        f.write(data)
    return Path(path)


def write_text(path: str | Path, text: str, encoding: str = "utf-8", sync: bool = True) -> Path:
    return write_bytes(path, text.encode(encoding), sync=sync)


def rewrite_in_place_at(dfd: int | None, name: str | Path, data: bytes) -> None:
    """Overwrite an existing file's content without creating a new one (see the module note): used only
    when `write_bytes` failed for lack of space. Raises OSError when even that cannot be done."""
    fd = os.open(name, os.O_WRONLY | NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        held = os.fstat(fd).st_blocks * 512
        if len(data) > held:         # it would need new blocks: refuse rather than leave half a file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))
        n = os.write(fd, data)
        if n != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def rewrite_in_place(path: str | Path, data: bytes) -> None:
    rewrite_in_place_at(None, path, data)


def no_space(ex: BaseException) -> bool:
    return isinstance(ex, OSError) and ex.errno in (errno.ENOSPC, errno.EDQUOT)


def _is_file_at(dfd: int | None, name: str | Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def write_text_or_in_place_at(dfd: int, name: str, text: str) -> str:
    """`write_text_or_in_place` for `name` in the folder held by `dfd`."""
    data = text.encode("utf-8")
    try:
        write_bytes_at(dfd, name, data)
        return "replaced"
    except OSError as ex:
        if not (no_space(ex) and _is_file_at(dfd, name)):
            raise
        rewrite_in_place_at(dfd, name, data)
        return "in place"


def write_text_or_in_place(path: str | Path, text: str) -> str:
    """`write_text`, falling back to `rewrite_in_place` on a full disk for a file that exists. Returns
    how it was written ("replaced" or "in place")."""
    path = Path(path)
    with _parent_of(path) as dfd:
        return write_text_or_in_place_at(dfd, path.name, text)


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
        dfd = open_dir(folder)
        try:
            probe = f".labkit-write-check.{os.getpid()}.{secrets.token_hex(4)}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=dfd))
            os.unlink(probe, dir_fd=dfd)
        finally:
            os.close(dfd)
    except OSError as ex:
        raise BadInput(f"{what} {folder}: cannot write there ({ex.strerror or type(ex).__name__})") from None
    return folder
