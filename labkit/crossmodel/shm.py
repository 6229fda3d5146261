"""The /dev/shm layout that carries a mapped KV cache from the producer to the vLLM connector.

One file per prompt: `<root>/<key>.kv`, root `/dev/shm/labkit-xfer` by default (`$LABKIT_XFER_SHM`),
key = the first 32 hex digits of sha256 over the request's *whole* prompt token ids (int32 LE), so the
connector finds the file from the request alone. The file covers the first `num_tokens` of those
tokens (the producer leaves at least the last prompt token for the engine to compute).

    offset  size  field (little-endian)
    0       8     magic b"LKXFERKV"
    8       4     version (3)
    12      4     complete: 0 while writing; set to 1 *last*, after every data byte is written
    16      4     header_bytes (4096): data starts here
    20      4     dtype code (1 bfloat16, 2 float16, 3 float32)
    24      4     num_layers
    28      4     num_kv_heads
    32      4     head_dim
    36      4     producer pid
    40      8     num_tokens (covered)
    48      8     data_bytes = num_layers * 2 * num_tokens * num_kv_heads * head_dim * itemsize
    56      8     created (unix seconds, float64)
    64      32    token_hash: sha256 of the covered token ids (int32 LE)
    96      64    large model fingerprint (ASCII, NUL padded)
    160     64    large model name (ASCII, NUL padded; informative)
    224     4     payload_crc32: zlib CRC-32 of the data bytes (written before the complete flag)
    228     32    mac: HMAC-SHA256 under the user's KV key over the data bytes, then this header with the
                  mac field zero (see "Who may write a file" below)
    260     ...   zero up to header_bytes
    4096    ...   data: for layer 0..L-1: K [num_tokens, kv_heads, head_dim] then V (same); keys rotated
                  (RoPE applied at positions 0..num_tokens-1), as the engine's cache stores them

Writes go to a fresh private temporary name and are renamed into place after the complete flag is set,
so a crashed producer leaves either no `.kv` file or one the reader can still refuse. `read_header` /
`validate` check every header field (magic, version, completion, header size, dtype, shape, producer pid,
length, data size, creation time, token hash, model, the zero padding) against the file and the engine, and
give a one-line reason for refusing; `verify_payload` checks the data against the producer's CRC-32 (zlib's,
~3 GB/s here: 30 ms for a 4K-token prompt of a 135M model) and MAC, so corrupt numbers (NaN, 1e30) under a
valid header are refused before a byte reaches an engine's cache.

Who may write a file (the root sits in world-writable /dev/shm, and the fingerprint is public knowledge:
a sha256 of a model's config and weight file names and sizes):
- the root is created by this user with mode 0700 and opened without following a symlink; a root owned by
  someone else, or writable by group or others, is refused with one line (another user could have made it
  first and planted files), a root of ours that others may only read is tightened to 0700;
- every file is opened relative to that root with O_NOFOLLOW and must be a regular file owned by this
  user with no group or other permission bits (0600); the producer creates its temporary file with
  O_CREAT|O_EXCL|O_NOFOLLOW (it never follows, nor reuses, a name someone planted) and renames it in place;
- every file carries an HMAC-SHA256 keyed by a per-user secret (`$LABKIT_XFER_KEY`, default
  `~/.config/labkit/xfer.key`, 32 random bytes, 0600, made on first use), so a file written by anyone
  without that key is refused even in a folder the reader was pointed at;
- the reader snapshots the file: `KVFile` reads its bytes into private memory and checks the CRC-32 and MAC
  over exactly those bytes, which are the bytes `layer` hands out, so a byte changed in the file after the
  check cannot reach the loaded cache.
"""


from __future__ import annotations

import errno
import hashlib
import hmac
import math
import os
import secrets
import stat
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import envs

MAGIC = b"LKXFERKV"
VERSION = 3
HEADER_BYTES = 4096
_FMT = "<8s8IQQd32s64s64sI32s"
_FIXED = struct.calcsize(_FMT)
DTYPES = {1: torch.bfloat16, 2: torch.float16, 3: torch.float32}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
COMPLETE_OFFSET = 12
CRC_OFFSET = 224
MAC_OFFSET = 228
MAC_BYTES = 32
_CHUNK = 16 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class ShmError(ValueError):
    """A KV file that must not be used (or cannot be written); the message is one line."""


def default_root() -> Path:
    return Path(envs.get("LABKIT_XFER_SHM") or "/dev/shm/labkit-xfer")


def token_bytes(ids) -> bytes:
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    return np.asarray(list(ids), dtype="<i4").tobytes()


def token_hash(ids) -> bytes:
    return hashlib.sha256(token_bytes(ids)).digest()


def prompt_key(ids) -> str:
    return hashlib.sha256(token_bytes(ids)).hexdigest()[:32]


def path_for(ids, root: Path | None = None) -> Path:
    return (root or default_root()) / f"{prompt_key(ids)}.kv"


# ------------------------------------------------------------------------------- who may write a file
def _private(st: os.stat_result) -> str:
    """Why a file or folder is not this user's alone ('' when it is)."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o} lets group or others in (0600 expected)"
    return ""


def open_root(root: Path, create: bool = False) -> int:
    """A descriptor of the KV root, checked: a folder (not a symlink) owned by this user that nobody else may
    write. `create`: make it (mode 0700) if it is missing. ShmError with one line otherwise."""
    root = Path(root)
    if create:
        root.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(root, 0o700)
        except FileExistsError:
            pass
        except OSError as ex:
            raise ShmError(f"cannot make the KV folder {root}: {ex.strerror}") from None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        raise ShmError(f"no KV folder {root}") from None
    except OSError as ex:
        if ex.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ShmError(f"KV folder {root} is a symlink or not a folder: refused (set LABKIT_XFER_SHM to a "
                           f"folder of your own)") from None
        raise ShmError(f"cannot open the KV folder {root}: {ex.strerror}") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        why = (f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})" if st.st_uid != os.geteuid()
               else f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
        raise ShmError(f"KV folder {root} {why}: another user could plant KV files there; remove it or set "
                       f"LABKIT_XFER_SHM to a folder of your own")
    if st.st_mode & 0o077:           # ours, others may only look: made by an older labkit; make it private
        os.fchmod(fd, 0o700)
    return fd


def _open_kv(path: Path) -> tuple[int, os.stat_result]:
    """(descriptor, stat) of a KV file opened through its checked root with O_NOFOLLOW: a regular file of this
    user's with mode 0600. ShmError with one line otherwise (FileNotFoundError when it is simply absent)."""
    path = Path(path)
    root_fd = open_root(path.parent)
    try:
        try:       # O_NONBLOCK: a planted FIFO must not hang the reader
            fd = os.open(path.name, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, dir_fd=root_fd)
        except OSError as ex:
            if ex.errno == errno.ENOENT:
                raise ShmError(f"no KV file {path.name}") from None
            if ex.errno == errno.ELOOP:
                raise ShmError(f"{path.name}: a symlink, refused") from None
            raise ShmError(f"{path.name}: cannot open ({ex.strerror})") from None
    finally:
        os.close(root_fd)
    st = os.fstat(fd)
    why = "not a regular file" if not stat.S_ISREG(st.st_mode) else _private(st)
    if why:
        os.close(fd)
        raise ShmError(f"{path.name}: {why}; refused")
    return fd, st


def key_path() -> Path:
    if envs.get("LABKIT_XFER_KEY"):
        return Path(envs.get("LABKIT_XFER_KEY"))
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "labkit" / "xfer.key"


_KEYS: dict[tuple, bytes] = {}


def user_key(create: bool = False) -> bytes:
    """The per-user secret that authenticates KV files (see the module note). `create`: make it if missing
    (the producer); the reader never makes one (a missing key means no file of ours can exist)."""
    path = key_path()
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise ShmError(f"no KV key {path}: no file written by this user can be loaded") from None
        _make_key(path)
        return user_key()
    except OSError as ex:
        raise ShmError(f"KV key {path}: cannot open ({ex.strerror}); set LABKIT_XFER_KEY to a file of your own") from None
    try:
        st = os.fstat(fd)
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else _private(st)
        if why:
            raise ShmError(f"KV key {path}: {why}; refused")
        cached = _KEYS.get((str(path), st.st_ino, st.st_mtime_ns))
        if cached:
            return cached
        key = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(key) < 32:
        raise ShmError(f"KV key {path}: {len(key)} bytes, at least 32 expected")
    _KEYS[(str(path), st.st_ino, st.st_mtime_ns)] = key
    return key


def _make_key(path: Path) -> None:
    """32 random bytes, 0600, in a 0700 folder; two producers starting together end with one key."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)          # never replaces a key another process made meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    except OSError as ex:
        raise ShmError(f"cannot make the KV key {path}: {ex.strerror}; set LABKIT_XFER_KEY to a writable path") from None


# ------------------------------------------------------------------------------------------- header
@dataclass
class Header:
    version: int
    complete: int
    header_bytes: int
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    pid: int
    num_tokens: int
    data_bytes: int
    created: float
    token_hash: bytes
    fingerprint: str
    model: str
    payload_crc32: int = 0
    padding_clean: bool = True      # the bytes between the fields and header_bytes are zero (read side)
    mac: bytes = bytes(MAC_BYTES)
    file_version: tuple = ()        # (inode, size, mtime_ns) of the file `validate` read (read side)

    @property
    def block_elems(self) -> int:
        return self.num_tokens * self.num_kv_heads * self.head_dim

    def pack(self) -> bytes:
        raw = struct.pack(_FMT, MAGIC, self.version, self.complete, self.header_bytes, DTYPE_CODES[self.dtype],
                          self.num_layers, self.num_kv_heads, self.head_dim, self.pid, self.num_tokens,
                          self.data_bytes, self.created, self.token_hash, self.fingerprint.encode()[:64],
                          self.model.encode()[:64], self.payload_crc32, self.mac)
        return raw.ljust(self.header_bytes, b"\0")


def expected_bytes(num_layers: int, num_tokens: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16) -> int:
    return num_layers * 2 * num_tokens * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def unpack(buf: bytes) -> Header:
    if len(buf) < _FIXED:
        raise ShmError(f"truncated header ({len(buf)} bytes)")
    (magic, version, complete, hbytes, dcode, layers, heads, hdim, pid, ntok, dbytes, created, th, fp,
     model, crc, mac) = struct.unpack(_FMT, buf[:_FIXED])
    if magic != MAGIC:
        raise ShmError(f"bad magic {magic!r} (not a labkit KV file)")
    if version != VERSION:
        raise ShmError(f"layout version {version}, this reader knows {VERSION}")
    if dcode not in DTYPES:
        raise ShmError(f"unknown dtype code {dcode}")
    if hbytes != HEADER_BYTES:          # data offset: anything else would read header bytes as KV, or skip KV
        raise ShmError(f"header_bytes {hbytes}, the layout's is {HEADER_BYTES}")
    return Header(version, complete, hbytes, DTYPES[dcode], layers, heads, hdim, pid, ntok, dbytes, created, th,
                  fp.rstrip(b"\0").decode(errors="replace"), model.rstrip(b"\0").decode(errors="replace"), crc,
                  not any(buf[_FIXED:HEADER_BYTES]), mac)


def _mac_header(header: bytes) -> bytes:
    """The header as the MAC covers it: its first header_bytes with the mac field zero."""
    h = bytearray(header[:HEADER_BYTES])
    h[MAC_OFFSET:MAC_OFFSET + MAC_BYTES] = bytes(MAC_BYTES)
    return bytes(h)


def read_header(path: Path) -> Header:
    fd, _ = _open_kv(path)
    try:
        return unpack(os.pread(fd, HEADER_BYTES, 0))
    finally:
        os.close(fd)


def free_bytes(root: Path) -> int:
    p = root
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def check_space(root: Path, nbytes: int) -> None:
    """One line if `root`'s filesystem cannot hold `nbytes` more (checked before anything is written)."""
    free = free_bytes(root)
    if nbytes + HEADER_BYTES > free:
        raise ShmError(f"{root} has {free / 2**20:.0f} MiB free, the prompt's KV needs {nbytes / 2**20:.0f} MiB: "
                       f"shorten the prompt, free /dev/shm, or set LABKIT_XFER_SHM to a larger tmpfs")


def _write_all(fd: int, b) -> None:
    mv = memoryview(b).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def write(path: Path, kv: list[tuple[torch.Tensor, torch.Tensor]], covered_ids, fingerprint: str, model: str = "",
          dtype=torch.bfloat16, crash_after_layers: int | None = None) -> Header:
    """Write per-layer (K rotated, V), each [1 or none, kv_heads, T, head_dim], as the layout above.

    `crash_after_layers` (tests) stops after that many layers without completing, like a dead producer.
    """
    path = Path(path)
    k0 = kv[0][0]
    H, T, D = k0.shape[-3], k0.shape[-2], k0.shape[-1]
    if T != len(covered_ids):
        raise ShmError(f"KV holds {T} tokens but {len(covered_ids)} covered token ids were given")
    nbytes = expected_bytes(len(kv), T, H, D, dtype)
    key = user_key(create=True)
    root_fd = open_root(path.parent, create=True)
    try:
        check_space(path.parent, nbytes)
        hdr = Header(VERSION, 0, HEADER_BYTES, dtype, len(kv), H, D, os.getpid(), T, nbytes, time.time(),
                     token_hash(covered_ids), fingerprint, model)
        # a name nobody can have planted, created exclusively, never through a symlink
        tmp = f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=root_fd)
        try:
            crc, mac = 0, hmac.new(key, digestmod=hashlib.sha256)
            _write_all(fd, hdr.pack())
            for i, (k, v) in enumerate(kv):
                if crash_after_layers is not None and i >= crash_after_layers:
                    break
                for x in (k, v):  # [.., H, T, D] -> [T, H, D]
                    x = x.reshape(H, T, D).transpose(0, 1).contiguous().to(dtype)
                    b = x.view(torch.uint8).numpy() if dtype != torch.float32 else x.numpy()
                    crc = zlib.crc32(b, crc)
                    mac.update(b)
                    _write_all(fd, b)
            if crash_after_layers is None:       # complete: CRC, flag and MAC in one header write
                hdr.complete, hdr.payload_crc32 = 1, crc
                mac.update(_mac_header(hdr.pack()))
                hdr.mac = mac.digest()
                os.pwrite(fd, hdr.pack(), 0)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=root_fd)
            raise
        os.close(fd)
        os.replace(tmp, path.name, src_dir_fd=root_fd, dst_dir_fd=root_fd)   # a dead producer's partial file too
    finally:
        os.close(root_fd)
    return hdr


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 1 << 22         # Linux's upper limit


def check_header(name: str, hdr: Header, size: int, prompt_ids, fingerprint: str, num_layers: int, kv_heads: int,
                 head_dim: int, dtype=None) -> None:
    """Every header field against the file's size, the prompt and the engine; ShmError with one line."""
    if hdr.complete != 1:
        raise ShmError(f"{name}: incomplete (producer pid {hdr.pid} did not finish)" if hdr.complete == 0
                       else f"{name}: complete flag {hdr.complete} (0 or 1 expected)")
    if not hdr.padding_clean:
        raise ShmError(f"{name}: header padding is not zero (written by another layout)")
    if min(hdr.num_layers, hdr.num_kv_heads, hdr.head_dim, hdr.num_tokens) <= 0 or hdr.pid <= 0:
        raise ShmError(f"{name}: empty field in the header (layers {hdr.num_layers}, kv heads "
                       f"{hdr.num_kv_heads}, head_dim {hdr.head_dim}, tokens {hdr.num_tokens}, pid {hdr.pid})")
    if hdr.pid > _pid_max():
        raise ShmError(f"{name}: producer pid {hdr.pid} is above this system's pid_max ({_pid_max()})")
    if not (math.isfinite(hdr.created) and 0 < hdr.created <= time.time() + 60):
        raise ShmError(f"{name}: creation time {hdr.created} is not a time")
    if size != hdr.header_bytes + hdr.data_bytes or hdr.data_bytes != expected_bytes(
            hdr.num_layers, hdr.num_tokens, hdr.num_kv_heads, hdr.head_dim, hdr.dtype):
        raise ShmError(f"{name}: size {size} does not match the header ({hdr.header_bytes} + {hdr.data_bytes} bytes)")
    if hdr.fingerprint != fingerprint:
        raise ShmError(f"{name}: made for model {hdr.model or '?'} ({hdr.fingerprint}), not {fingerprint}")
    if (hdr.num_layers, hdr.num_kv_heads, hdr.head_dim) != (num_layers, kv_heads, head_dim):
        raise ShmError(f"{name}: shape {hdr.num_layers}x{hdr.num_kv_heads}x{hdr.head_dim}, engine has "
                       f"{num_layers}x{kv_heads}x{head_dim}")
    if dtype is not None and hdr.dtype != dtype:
        raise ShmError(f"{name}: dtype {hdr.dtype}, engine cache is {dtype}")
    n = len(prompt_ids)
    if not 0 < hdr.num_tokens < n:
        raise ShmError(f"{name}: covers {hdr.num_tokens} tokens, prompt has {n} (must be 1..{n - 1})")
    if hdr.token_hash != token_hash(list(prompt_ids)[: hdr.num_tokens]):
        raise ShmError(f"{name}: token hash differs from the prompt's first {hdr.num_tokens} tokens")


def payload_problem(name: str, header: bytes, data, hdr: Header) -> str:
    """Why `data` (the bytes that will be used) is not what this user's producer wrote under `header`:
    CRC-32 first (corruption), then the MAC (authorship); '' when both hold."""
    crc, mac, mv = 0, hmac.new(user_key(), digestmod=hashlib.sha256), memoryview(data).cast("B")
    for i in range(0, len(mv), _CHUNK):
        crc = zlib.crc32(mv[i: i + _CHUNK], crc)
        mac.update(mv[i: i + _CHUNK])
    if crc != hdr.payload_crc32:
        return (f"{name}: payload CRC-32 {crc:08x} differs from the producer's {hdr.payload_crc32:08x} "
                f"(data changed after writing)")
    mac.update(_mac_header(header))
    if not hmac.compare_digest(mac.digest(), hdr.mac):
        return f"{name}: MAC does not match this user's KV key (not written by this user's producer)"
    return ""


def _read_exact(fd: int, buf, offset: int) -> None:
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n == 0:
            raise ShmError(f"file shorter than its header says ({offset + done} bytes)")
        done += n


def validate(path: Path, prompt_ids, fingerprint: str, num_layers: int, kv_heads: int, head_dim: int,
             dtype=None, verify_payload: bool = False) -> Header:
    """The header if the file may be loaded for this prompt and model; else ShmError with one line.
    `verify_payload`: also the data's CRC-32 and MAC against the header's (reads the whole file)."""
    path = Path(path)
    fd, st = _open_kv(path)
    try:
        header = os.pread(fd, HEADER_BYTES, 0)
        try:
            hdr = unpack(header)
        except ShmError as ex:
            raise ShmError(f"{path.name}: {ex}") from None
        check_header(path.name, hdr, st.st_size, prompt_ids, fingerprint, num_layers, kv_heads, head_dim, dtype)
        if verify_payload:
            data = bytearray(hdr.data_bytes)
            _read_exact(fd, data, hdr.header_bytes)
            why = payload_problem(path.name, header, data, hdr)
            if why:
                raise ShmError(why)
        hdr.file_version = (st.st_ino, st.st_size, st.st_mtime_ns)
        return hdr
    finally:
        os.close(fd)


class KVFile:
    """A private snapshot of a validated file; `layer(i)` -> (K, V) views [T, H, D] of that snapshot.

    The whole file is read into this process's memory once, through the same checked descriptor path as
    `validate`; `payload_ok` checks the CRC-32 and MAC over the snapshot, which is what `layer` hands out, so
    a change to the file after the check cannot reach the engine. A snapshot whose header is not the one
    validated (the file was replaced in between) is refused."""

    def __init__(self, path: Path, hdr: Header):
        self.path, self.hdr = Path(path), hdr
        fd, st = _open_kv(self.path)
        try:
            if st.st_size != hdr.header_bytes + hdr.data_bytes:
                raise ShmError(f"{self.path.name}: size {st.st_size} changed since it was validated")
            self._buf = torch.empty(st.st_size, dtype=torch.uint8)
            _read_exact(fd, self._buf.numpy(), 0)
        finally:
            os.close(fd)
        self._header = self._buf[:HEADER_BYTES].numpy().tobytes()
        now = unpack(self._header)
        if (now.token_hash, now.num_tokens, now.data_bytes, now.dtype, now.payload_crc32, now.mac, now.complete) != (
                hdr.token_hash, hdr.num_tokens, hdr.data_bytes, hdr.dtype, hdr.payload_crc32, hdr.mac, hdr.complete):
            raise ShmError(f"{self.path.name}: the file changed since it was validated")
        self._data = self._buf[hdr.header_bytes: hdr.header_bytes + hdr.data_bytes]
        self._t = self._data.view(hdr.dtype).view(hdr.num_layers, 2, hdr.num_tokens, hdr.num_kv_heads, hdr.head_dim)

    def problem(self) -> str:
        """Why the snapshot must not be used ('' when its CRC-32 and MAC hold)."""
        try:
            return payload_problem(self.path.name, self._header, self._data.numpy(), self.hdr)
        except ShmError as ex:           # no key: nothing of ours can be in the file
            return str(ex)

    def payload_ok(self) -> bool:
        """The snapshot's data (the very bytes `layer` hands out) against the producer's CRC-32 and MAC."""
        return not self.problem()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._t[i, 0], self._t[i, 1]

    def close(self) -> None:
        self._t = self._data = self._buf = None
