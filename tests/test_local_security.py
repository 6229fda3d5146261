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
import secrets
import shutil
import socket
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
