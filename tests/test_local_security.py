"""Local security on a shared machine: what another user on the same box can do to the lab.

The attacks are real: a throwaway second user is made with `useradd` and its steps run as that uid in a
subprocess (the victim is this test process). That needs root; without it the two-user tests are skipped
with that reason, and the single-user ones still run.

- KV files: another user who creates the KV root first (in world-writable /dev/shm or a folder the lab is
  pointed at) and plants a file with the right fingerprint, a symlink planted where the producer writes, a
  file that is a symlink / someone else's / mode 0666, a file written without this user's key, bytes
  changed after the reader's check.
- The lab's token: not in the server's argv (/proc/PID/cmdline is world-readable), not readable by the
  other user at all, while requests without it are still refused (403) and requests with it served.
"""
from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from labkit.crossmodel import shm

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _own_key(tmp_path, monkeypatch):
    """This test's own KV key (the user's real one is left alone)."""
    monkeypatch.setenv("LABKIT_XFER_KEY", str(tmp_path / "keys" / "xfer.key"))


@pytest.fixture(scope="module")
def other_user():
    """(uid, gid) of a throwaway second user, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("two-user attack: needs root to create a second user (useradd) and run as it")
    if not shutil.which("useradd"):
        pytest.skip("two-user attack: no useradd on this machine")
    name = f"lkatk{secrets.token_hex(3)}"
    r = subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"two-user attack: useradd failed ({r.stderr.strip()})")
    pw = pwd.getpwnam(name)
    try:
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def as_user(user, script: str) -> subprocess.CompletedProcess:
    """`sh -c script` as the other user (its own uid and gid, no supplementary groups)."""
    uid, gid = user
    return subprocess.run(["sh", "-c", script], user=uid, group=gid, extra_groups=[], capture_output=True,
                          text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "HOME": "/"})


@pytest.fixture
def shared():
    """A folder like /dev/shm or /tmp: world-writable with the sticky bit."""
    d = Path(tempfile.mkdtemp(prefix="labkit-shared-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _kv(L=3, H=2, T=10, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)) for _ in range(L)]


IDS = list(range(100, 111))


def forged_file(where: Path, monkeypatch) -> Path:
    """A complete, CRC-correct KV file for IDS with the right fingerprint (public knowledge), written with a
    key that is not this user's (what an attacker can make), as a world-readable file to copy from."""
    src = where / "forge"
    src.mkdir(mode=0o700)
    with monkeypatch.context() as m:
        m.setenv("LABKIT_XFER_KEY", str(where / "attacker.key"))
        path = shm.path_for(IDS, src)
        shm.write(path, _kv(seed=9), IDS[:10], "fp", "evil")
    out = where / "planted.kv"
    out.write_bytes(path.read_bytes())
    out.chmod(0o644)
    return out


# ------------------------------------------------------------------------------ KV files, two users
def test_a_root_another_user_made_first_is_refused_by_reader_and_producer(other_user, shared, monkeypatch):
    """The other user makes the KV root before us (world-writable, or merely theirs) and plants a file with the
    right fingerprint: the reader refuses it with one line and the producer writes nothing there."""
    planted = forged_file(shared, monkeypatch)
    key = shm.path_for(IDS).name
    for mode in ("0777", "0755"):
        root = shared / f"xfer-{mode}"
        r = as_user(other_user, f"mkdir -m {mode} {root} && cp {planted} {root}/{key} && chmod 0666 {root}/{key}")
        assert r.returncode == 0, r.stderr
        with pytest.raises(shm.ShmError, match=f"belongs to uid {other_user[0]}") as e:
            shm.validate(root / key, IDS, "fp", 3, 2, 4, verify_payload=True)
        assert "\n" not in str(e.value)
        with pytest.raises(shm.ShmError, match="another user could plant"):
            shm.write(root / key, _kv(), IDS[:10], "fp")
        assert sorted(p.name for p in root.iterdir()) == [key]        # nothing of ours written into it


def test_producer_never_follows_a_planted_tmp_symlink(other_user, shared):
    """The other user owns the folder the producer (root) is pointed at and plants `<key>.kv.tmp` -> a file
    of root's: the producer refuses the folder; the file keeps its bytes."""
    victim = shared / "victim"
    victim.write_text("precious")
    victim.chmod(0o644)
    root = shared / "theirs"
    key = shm.path_for(IDS).name
    r = as_user(other_user, f"mkdir -m 0777 {root} && ln -s {victim} {root}/{key}.tmp")
    assert r.returncode == 0, r.stderr
    with pytest.raises(shm.ShmError, match="another user could plant"):
        shm.write(root / key, _kv(), IDS[:10], "fp")
    assert victim.read_text() == "precious" and victim.stat().st_uid == 0


def test_files_that_are_not_ours_alone_are_refused(other_user, tmp_path):
    """In our own root: a file owned by another user, a file others may write, a symlink to a valid file."""
    root = tmp_path / "xfer"
    path = shm.path_for(IDS, root)
    shm.write(path, _kv(), IDS[:10], "fp")
    assert (root.stat().st_mode & 0o777, path.stat().st_mode & 0o777) == (0o700, 0o600)
    shm.validate(path, IDS, "fp", 3, 2, 4, verify_payload=True)          # as written: accepted
    os.chown(path, other_user[0], other_user[1])
    with pytest.raises(shm.ShmError, match=f"owned by uid {other_user[0]}"):
        shm.validate(path, IDS, "fp", 3, 2, 4)
    os.chown(path, 0, 0)
    path.chmod(0o666)
    with pytest.raises(shm.ShmError, match="mode 0666"):
        shm.validate(path, IDS, "fp", 3, 2, 4)
    path.chmod(0o600)
    real = path.rename(root / "elsewhere.kv")
    path.symlink_to(real)
    with pytest.raises(shm.ShmError, match="symlink"):
        shm.validate(path, IDS, "fp", 3, 2, 4)


# ------------------------------------------------------------------------------ KV files, one user
def test_a_forged_file_in_our_own_root_is_refused_by_its_mac(tmp_path, monkeypatch):
    """Even where every owner and mode check passes (the file copied into our root, ours, 0600), a file made
    without this user's key is refused: by the scheduler-side check and by the worker's snapshot."""
    shm.user_key(create=True)                                      # this user has a key (has produced before)
    planted = forged_file(tmp_path, monkeypatch)
    root = tmp_path / "xfer"
    os.close(shm.open_root(root, create=True))
    path = shm.path_for(IDS, root)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, planted.read_bytes())
    os.close(fd)
    hdr = shm.validate(path, IDS, "fp", 3, 2, 4)                  # its header is perfect
    with pytest.raises(shm.ShmError, match="MAC does not match"):
        shm.validate(path, IDS, "fp", 3, 2, 4, verify_payload=True)
    f = shm.KVFile(path, hdr)
    assert not f.payload_ok() and "MAC" in f.problem()
    f.close()


def test_a_root_of_ours_that_others_may_read_is_made_private(tmp_path):
    root = tmp_path / "xfer"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    shm.write(shm.path_for(IDS, root), _kv(), IDS[:10], "fp")
    assert root.stat().st_mode & 0o777 == 0o700


def test_bytes_changed_after_the_check_do_not_reach_the_loaded_kv(tmp_path):
    """The worker checks the file, then someone rewrites its data in place: what `layer` hands out is still
    what was checked (a snapshot, not a copy-on-write mapping of a file that keeps changing)."""
    path = shm.path_for(IDS, tmp_path / "xfer")
    kv = _kv()
    hdr = shm.write(path, kv, IDS[:10], "fp", dtype=torch.float32)
    f = shm.KVFile(path, hdr)
    assert f.payload_ok()
    with open(path, "r+b") as g:                   # every data byte overwritten after the check
        g.seek(hdr.header_bytes)
        g.write(torch.full((hdr.data_bytes // 4,), float("nan")).numpy().tobytes())
    for i in range(3):
        k, v = f.layer(i)
        assert torch.equal(k, kv[i][0][0].transpose(0, 1)) and torch.equal(v, kv[i][1][0].transpose(0, 1))
    assert f.payload_ok()
    f.close()
    with pytest.raises(shm.ShmError, match="CRC-32"):              # and the changed file itself is refused
        shm.validate(path, IDS, "fp", 3, 2, 4, verify_payload=True)


def test_the_producer_leaves_no_temporary_file_and_writes_0600(tmp_path):
    root = tmp_path / "xfer"
    stale = root / (shm.path_for(IDS).name + ".tmp")
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    stale.symlink_to(victim)                       # a planted (or stale) name of the old layout: never used
    path = shm.path_for(IDS, root)
    shm.write(path, _kv(), IDS[:10], "fp")
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in root.iterdir()) == sorted([path.name, stale.name])
    assert path.stat().st_mode & 0o777 == 0o600
    key = shm.key_path()
    assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700


# ------------------------------------------------------------------------------------- the lab token
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):        # not listening yet
        return 0


@pytest.mark.slow
def test_lab_token_is_not_in_argv_nor_readable_by_another_user(tmp_path, request):
    """`labkit lab` (what `make lab` runs) with the token from the environment: the server's
    /proc/PID/cmdline and environment do not hold it; the token file is 0600; a second user can read the
    cmdline but not the token (file or environ). Without the token: 403; with it: 200."""
    pytest.importorskip("jupyterlab")
    lab_root = tmp_path / "notebooks"
    lab_root.mkdir()
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "LABKIT_LAB_TOKEN": token, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws"),
           "JUPYTER_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(REPO)}
    env.pop("JUPYTER_TOKEN", None)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "lab", "--port", str(port), "--port-exact",
                             "--dir", str(lab_root)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            if _status(f"{base}/api/status?token={token}") == 200:
                break
            assert proc.poll() is None, (tmp_path / "lab.log").read_text()[-2000:]
            time.sleep(0.5)
        else:
            raise AssertionError("labkit lab did not start in 60 s")
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert b"jupyterlab" in cmdline and token.encode() not in cmdline
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert token.encode() not in environ
        files = list((tmp_path / "runtime").glob("labkit-lab-*.token"))
        assert len(files) == 1 and files[0].read_text() == token and files[0].stat().st_mode & 0o777 == 0o600
        assert _status(f"{base}/api/status") == 403 and _status(f"{base}/api/contents") == 403
        assert _status(f"{base}/api/status?token=wrong{token}") == 403
        assert _status(f"{base}/api/contents?token={token}") == 200
        if os.geteuid() == 0 and shutil.which("useradd"):
            user = request.getfixturevalue("other_user")
            tmp_path.chmod(0o755)              # let the other user reach the folder, not the 0700 runtime dir
            seen = as_user(user, f"cat /proc/{proc.pid}/cmdline; cat {files[0]}; cat /proc/{proc.pid}/environ")
            assert "jupyterlab" in seen.stdout and token not in seen.stdout, seen
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# ------------------------------------------------------------------------------ run folders, two users
# Every file `labkit run hot_replay --out DIR` writes into its folder, and the write-check probe's old name.
RUN_FILES = ["manifest.json", "hot_replay.parquet", "summary.md", "capacity.ipynb", "report.html",
             ".labkit-write-check"]
ONE_TRACE = ["-p", "traces=labkit/data/smollm2-135m-prose-indexer-b64.npz", "-p", "context_lens=131072", "-p", "capacity_x=1.0",
             "-p", "policies=lru"]


def _victims(where: Path, names) -> dict[str, Path]:
    """One file of ours per name, with content that must survive (what a planted link points at)."""
    out = {}
    for n in names:
        v = where / f"victim-{n.strip('.')}"
        v.write_text(f"precious {n}\n")
        v.chmod(0o644)
        out[n] = v
    return out


def _untouched(victims: dict[str, Path]) -> None:
    for n, v in victims.items():
        assert v.read_text() == f"precious {n}\n" and v.stat().st_uid == 0, f"{n}: written through the link"


def _plant(user, folder: Path, victims: dict[str, Path], mode: str = "0777") -> None:
    links = " && ".join(f"ln -s {v} {folder}/{n}" for n, v in victims.items())
    r = as_user(user, f"mkdir -m {mode} {folder} && chmod {mode} {folder} && {links}")
    assert r.returncode == 0, r.stderr


def _labkit(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


def _refused_here(monkeypatch, *args) -> subprocess.CompletedProcess:
    """A command line that must be refused before anything runs, run in this process from the repository (one
    import of labkit for all the cases, not one per case; the whole run below is a process of its own)."""
    import contextlib
    import io
    from labkit.cli import main
    monkeypatch.chdir(REPO)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("mode", ["0777", "0755"])
def test_a_run_folder_another_user_owns_is_refused_before_anything(other_user, shared, mode, monkeypatch):
    """Another user's folder (world-writable, or merely theirs) holding a manifest and links named like every
    file a run writes, passed as --out: one line naming the owner, exit 2, nothing written, no link followed."""
    victims = _victims(shared, RUN_FILES)
    out = shared / f"theirs-{mode}"
    _plant(other_user, out, victims, mode)
    r = _refused_here(monkeypatch, "run", "hot_replay", *ONE_TRACE, "--out", str(out))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and f"belongs to uid {other_user[0]}" in r.stderr, r.stderr
    _untouched(victims)
    assert sorted(p.name for p in out.iterdir()) == sorted(RUN_FILES)          # nothing of ours added


def test_a_folder_others_may_write_or_replace_is_refused(other_user, shared, tmp_path, monkeypatch):
    """Our own folder made world-writable; a folder of ours inside one everyone may write (no sticky bit) or
    inside one of the other user's (either could rename ours away and put theirs in its place); the other
    user's folder as the nightly's root: each refused in one line, before the plan is read, nothing made."""
    ours = tmp_path / "open"
    ours.mkdir()
    ours.chmod(0o777)
    r = _refused_here(monkeypatch, "run", "hot_replay", *ONE_TRACE, "--out", str(ours))
    assert r.returncode == 2 and "mode 0777" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    (shared / "open-parent").mkdir()
    (shared / "open-parent").chmod(0o777)
    assert as_user(other_user, f"mkdir -m 0755 {shared}/their-parent").returncode == 0
    os.chmod(shared / "their-parent", 0o755)
    for parent, says in (("open-parent", "(mode 0777), where other users may rename"),
                         ("their-parent", f"which belongs to uid {other_user[0]}")):
        inside = shared / parent / "mine"
        inside.mkdir()
        for args in (["run", "hot_replay", *ONE_TRACE, "--out", str(inside)], ["nightly", "--root", str(inside)]):
            r = _refused_here(monkeypatch, *args)
            assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert list(inside.iterdir()) == []
        r = _refused_here(monkeypatch, "run", "hot_replay", *ONE_TRACE, "--out", str(inside / "new"))     # not made either
        assert r.returncode == 2 and says in r.stderr and not (inside / "new").exists(), r.stderr
    theirs = shared / "night"
    assert as_user(other_user, f"mkdir -m 0755 {theirs}").returncode == 0
    r = _refused_here(monkeypatch, "nightly", "--root", str(theirs))
    assert r.returncode == 2 and f"belongs to uid {other_user[0]}" in r.stderr, r.stderr


@pytest.mark.slow
def test_links_planted_in_a_run_folder_are_replaced_never_followed(other_user, shared):
    """The other user planted a link at every name a run writes while the folder was open to them; it is ours
    and closed now (0755). A whole run into it: ok, every victim keeps its bytes, every name is now a regular
    file of ours (each file was written to a fresh name and renamed over the link)."""
    victims = _victims(shared, RUN_FILES)
    out = shared / "reopened"
    _plant(other_user, out, victims)
    os.chown(out, 0, 0)
    out.chmod(0o755)
    r = _labkit("run", "hot_replay", *ONE_TRACE, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    _untouched(victims)
    for n in RUN_FILES[:-1]:
        st = os.lstat(out / n)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_nlink == 1, n
    assert (out / ".labkit-write-check").is_symlink()         # the probe uses a fresh name, never this one
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def _vllm_python_or_skip() -> Path:
    from labkit.params import Missing
    from labkit.serving.lifecycle import vllm_python
    try:
        return vllm_python()
    except Missing as ex:
        pytest.skip(f"vLLM's connector writes inside vLLM's process: {ex}")


def test_every_run_folder_writer_replaces_a_planted_link(other_user, shared):
    """Each writer of run-folder files, one by one, at a name where the other user planted a link to a file of
    ours (the folder open to them, then closed): the CSV copies (metrics.csv, goodput.csv), a summary, a table,
    the nightly's tests.txt / error.txt, papermill's notebook saves, the counters of vLLM's connector. The link
    is replaced, the victim keeps its bytes. Streams appended during a run (the nightly's log.txt, the
    connector's requests.jsonl, a server log) refuse a link, a FIFO and a second name for someone's file."""
    import pandas as pd

    from labkit import atomic
    from labkit.execute import _WholeNotebookWrites
    from labkit.results import Run

    names = ["metrics.csv", "goodput.csv", "summary.md", "extra.parquet", "tests.txt", "error.txt", "nb.ipynb",
             "scheduler.json", "log.txt", "requests.jsonl", "server.log"]
    victims = _victims(shared, names)
    out = shared / "run"
    _plant(other_user, out, victims)
    os.chown(out, 0, 0)
    out.chmod(0o755)
    run = Run(out, {"run_id": "x"})
    df = pd.DataFrame({"a": [1, 2]})
    run.write_csv("metrics", df)
    run.write_csv("goodput", df)
    run.write_file("summary.md", "# summary\n")
    run.write_table("extra", df)
    atomic.write_text(out / "tests.txt", "1 passed\n")
    atomic.write_text(out / "error.txt", "failed\n")
    _WholeNotebookWrites().write('{"cells": []}', str(out / "nb.ipynb"))
    vllm_py = _vllm_python_or_skip()           # the connector runs inside vLLM's process
    r = subprocess.run([str(vllm_py), "-c", "import sys; from pathlib import Path; from labkit.serving.vllm_connector "
                        "import _write_json; _write_json(Path(sys.argv[1]), {'queries': 1})", str(out / "scheduler.json")],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for n in names[:8]:
        assert not (out / n).is_symlink() and (out / n).stat().st_uid == 0, n
    assert pd.read_csv(out / "metrics.csv")["a"].tolist() == [1, 2]
    for n, mode in (("log.txt", "a"), ("requests.jsonl", "a"), ("server.log", "ab")):
        with pytest.raises(OSError):
            atomic.open_append(out / n, mode)
        assert (out / n).is_symlink()
    os.mkfifo(out / "fifo.log")
    t0 = time.time()
    with pytest.raises(OSError):                 # not a wait for a reader that never comes
        atomic.open_append(out / "fifo.log")
    assert time.time() - t0 < 2
    os.link(victims["log.txt"], out / "second-name.log")
    with pytest.raises(OSError, match="2 names"):
        atomic.open_append(out / "second-name.log")
    _untouched(victims)
    with atomic.open_append(out / "fresh.log") as f:            # a fresh stream of ours: appended as usual
        f.write("one\n")
    with atomic.open_append(out / "fresh.log") as f:
        f.write("two\n")
    assert (out / "fresh.log").read_text() == "one\ntwo\n"


# Files labkit writes outside run folders, each with where it goes; every other write in labkit/ goes
# through labkit/atomic.py (a fresh exclusive name and a rename, or an append that refuses links).
NOT_RUN_FOLDERS = {
    "labkit/docs/readme_tables.py": "README.md and docs/ (the repository's own files)",
    "labkit/lab.py": "JupyterLab's settings folder of this lab",
    "labkit/explore.py": "the explorer notebook under notebooks/",
    "labkit/cluster/executor.py": "a node's work folder: fresh, in a scratch folder checked to be this user's alone",
    "labkit/crossmodel/pair.py": "a model folder being converted in a fresh temporary folder",
    "labkit/models/loader.py": "a model folder being converted in a fresh temporary folder",
    "labkit/experiments/crossmodel/ablation.py": "the mapper-fitting cache under .cache/",
    "labkit/quality/traces.py": "selection traces written by the trace tools, not by a run",
    "labkit/experiments/serve_sweep/measure.py": "the vLLM argument-check cache under .cache/",
}
PLAIN_WRITE = re.compile(r"(?<!atomic)\.write_(text|bytes)\(|\.to_csv\((?!f\b)|\.to_parquet\((?!tmp\b)|"
                         r"\bopen\([^)]*['\"][wax]b?['\"]|shutil\.copy|nbformat\.write\(|np\.savez|torch\.save\(")


def test_no_plain_write_is_left_in_the_library():
    """A guard for the run-folder rule: a new `Path.write_text`, `to_csv(path)`, `open(path, "w")` or copy in
    labkit/ fails here unless the file is one of the few that never write into a run folder (named above)."""
    found = []
    for f in sorted((REPO / "labkit").rglob("*.py")):
        rel = f.relative_to(REPO).as_posix()
        if rel == "labkit/atomic.py" or rel in NOT_RUN_FOLDERS:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if PLAIN_WRITE.search(code) and not code.lstrip().startswith(('"', "'", "-", "`")):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "plain writes (use labkit.atomic):\n" + "\n".join(found)


def test_the_security_page_names_the_real_key_path_and_tests(monkeypatch, tmp_path):
    """docs/security.md names the KV key where the code keeps it, and every test it cites for a defence
    exists (a renamed test cannot leave the page pointing at nothing)."""
    import ast
    page = (REPO / "docs" / "security.md").read_text()
    monkeypatch.delenv("LABKIT_XFER_KEY")
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    where = "~/" + shm.key_path().relative_to(tmp_path).as_posix()        # the default, as the page writes it
    assert where == "~/.config/labkit/xfer.key" and f"`{where}`" in page and "crossmodel.key" not in page
    cited = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`|`::(\w+)`", page)
    last, checked = None, 0
    for path, name, more in cited:
        last = path or last
        name = name or more
        tree = ast.parse((REPO / last).read_text())
        if name:
            assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{last}::{name}"
            checked += 1
    assert checked >= 12
