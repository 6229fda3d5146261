"""A run's folder (`--out`, `--root`), checked before anything runs. Imports nothing heavy: `labkit run` calls
it while it is still parsing its command line.

A run folder must be this user's alone: another local user who can write into it (or who owns it, and so can
make it writable) could plant a symlink where the run writes its files, or swap the folder for another. So a
folder is refused, in one line, when it belongs to someone else or when group or others may write it; and
when a folder above it lets another user rename or replace entries (it is theirs, not root's or yours, or
group/other-writable without the sticky bit that `/tmp` has), or when a link on the way to it could be changed by
another user. Folders labkit makes itself are made 0755 (less under the umask), never wider.

A run opens its folder once (`open_own_folder`: the check is made on the open handle) and writes through that
handle; a folder it names itself is made by `make_fresh_folder`, whose `mkdir` fails where the name exists. The
results folder above runs holds the index and shared assets only when it is this user's alone
(`results_root_problem`).
"""
from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from .atomic import check_writable, open_dir
from .params import BadInput

FOLDER_MODE = 0o755


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:         # a uid with no name here
        return f"uid {uid}"


def _link_problem(given: Path) -> str:
    """Why a link on the way to `given` could be changed by another user ("" when none can): a link they made
    (they may swap it while a run writes), or one in a folder they may write without the sticky bit."""
    me = os.geteuid()
    for p in [*reversed(given.parents), given][1:]:
        try:
            lst = os.lstat(p)
        except OSError:          # not there yet (made below), or cannot be: the walk below says so
            return ""
        if not stat.S_ISLNK(lst.st_mode):
            continue
        if lst.st_uid not in (me, 0):
            return f"goes through {p}, a symlink made by {_owner(lst.st_uid)}: they could point it elsewhere mid-run"
        try:
            up = os.stat(p.parent)
        except OSError as ex:
            return f"cannot be checked ({ex.strerror or type(ex).__name__}: {p.parent})"
        if up.st_uid not in (me, 0) or (up.st_mode & 0o022 and not up.st_mode & stat.S_ISVTX):
            return f"goes through the symlink {p}, in a folder other users may change; give the folder it points to"
    return ""


def foreign_folder_problem(folder: Path) -> str:
    """Why `folder` (existing or not) is not safe to write a run into, or "" when it is."""
    given = Path(folder).absolute()
    me = os.geteuid()
    why = _link_problem(given)
    if why:
        return why
    real = Path(os.path.realpath(given))
    for p in [real, *real.parents]:
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):      # not there yet: made below, or cannot be
            continue
        except OSError as ex:
            return f"cannot be checked ({ex.strerror or type(ex).__name__}: {p})"
        if not stat.S_ISDIR(st.st_mode):      # a file where a folder should be: mkdir says so
            continue
        mode = stat.S_IMODE(st.st_mode)
        if p == real:
            if st.st_uid != me:
                return f"belongs to {_owner(st.st_uid)}, not to you: another user could change what a run writes there"
            if mode & 0o022:
                return (f"has mode {mode:04o}: other users may write into it and plant links where a run writes; "
                        f"`chmod go-w` it or choose another folder")
        elif st.st_uid not in (me, 0):
            return (f"is inside {p}, which belongs to {_owner(st.st_uid)}: they may rename or replace folders "
                    f"in it; choose a folder under one of yours")
        elif mode & 0o022 and not mode & stat.S_ISVTX:
            return (f"is inside {p} (mode {mode:04o}), where other users may rename or replace folders; "
                    f"choose a folder under one only you can write")
    return ""


def make_own_folder(folder: Path, what: str) -> Path:
    """Make `folder` and its missing parents (0755 under the umask) and prove it is this user's alone (see the
    module note); BadInput in one line otherwise. Returns `folder`."""
    folder = Path(folder)
    why = foreign_folder_problem(folder)            # before making anything in a place that is not safe
    if why:
        raise BadInput(f"{what} {folder} {why}")
    missing = [p for p in [*reversed(folder.absolute().parents), folder.absolute()] if not p.exists()]
    for p in missing:
        try:
            p.mkdir(mode=FOLDER_MODE)
        except FileExistsError:                     # someone made it meanwhile: the check below decides
            pass
        except OSError as ex:
            raise BadInput(f"{what} {folder}: cannot write there ({ex.strerror or type(ex).__name__})") from None
    why = foreign_folder_problem(folder)            # made by us, or by someone else between the two checks
    if why:
        raise BadInput(f"{what} {folder} {why}")
    return folder


def own_handle_problem(fd: int) -> str:
    """`foreign_folder_problem`'s rule for the folder itself, applied to an open handle (what is written into)."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return f"belongs to {_owner(st.st_uid)}, not to you"
    if st.st_mode & 0o022:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: other users may write into it"
    return ""


def open_own_folder(folder: Path, what: str) -> int:
    """A handle on `folder`, this user's alone (checked on the handle itself, so a folder swapped after the
    path was checked is refused, not written into); BadInput in one line otherwise."""
    try:
        fd = open_dir(folder)
    except OSError as ex:
        raise BadInput(f"{what} {folder}: cannot be opened ({ex.strerror or type(ex).__name__})") from None
    why = own_handle_problem(fd)
    if why:
        os.close(fd)
        raise BadInput(f"{what} {folder} {why}")
    return fd


def make_fresh_folder(parent: Path, name: str, what: str) -> Path:
    """A new folder `parent/name` (else `name-2`, `name-3`, ...) made by this call: `mkdir` fails where a name
    exists, so two runs started in the same second never share one folder. `parent` must be this user's alone."""
    make_own_folder(parent, what)
    fd = open_own_folder(parent, what)
    try:
        for n in range(1, 10_000):
            fresh = name if n == 1 else f"{name}-{n}"
            try:
                os.mkdir(fresh, FOLDER_MODE, dir_fd=fd)
                return Path(parent) / fresh
            except FileExistsError:
                continue
            except OSError as ex:
                raise BadInput(f"{what} {parent}: cannot write there ({ex.strerror or type(ex).__name__})") from None
    finally:
        os.close(fd)
    raise BadInput(f"{what} {parent}: every name {name}-N is taken")


def results_root_problem(root: Path) -> str:
    """Why `root` cannot hold a results index and shared assets ("" when it can): it must be this user's alone
    (`foreign_folder_problem`: `/tmp`, another user's folder are not), and so must its `_assets/` be where there is
    one (a real folder, not a link). A run writes nothing above its own folder except into such a root."""
    why = foreign_folder_problem(root)
    if why:
        return why
    try:
        st = os.lstat(Path(root) / "_assets")
    except FileNotFoundError:
        return ""
    except OSError as ex:
        return f"cannot be checked ({ex.strerror or type(ex).__name__})"
    if not stat.S_ISDIR(st.st_mode):
        return "holds an _assets that is not a folder (a link or a file)"
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return f"holds an _assets folder other users may change (owner {_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def prepare_out_dir(out: Path, others_ok: bool = False) -> Path:
    """Make the run folder, or say in one line why it cannot be one, before anything runs: a folder another
    user owns or may write, a folder that already holds a run, or holds other files (a run would be mixed
    into them; `others_ok` for a caller that put them there, as the nightly runner puts its log), or cannot
    be written."""
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out {out}: a file, not a folder")
    make_own_folder(out, "--out")
    if (out / "metrics.parquet").exists():
        raise BadInput(f"--out {out} already holds a run; choose another --out")
    if not others_ok and not (out / "manifest.json").exists() and any(out.iterdir()):
        raise BadInput(f"--out {out} holds other files and is not a run folder; choose a new or empty folder")
    check_writable(out, "--out")         # a fresh random name, created exclusively: never a planted link
    return out
