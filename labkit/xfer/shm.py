"""The /dev/shm layout that carries a mapped KV cache from the producer to the vLLM connector.

One file per prompt: `<root>/<key>.kv`, root `/dev/shm/labkit-xfer` by default (`$LABKIT_XFER_SHM`),
key = the first 32 hex digits of sha256 over the request's *whole* prompt token ids (int32 LE), so the
connector finds the file from the request alone. The file covers the first `num_tokens` of those
tokens (the producer leaves at least the last prompt token for the engine to compute).

    offset  size  field (little-endian)
    0       8     magic b"LKXFERKV"
    8       4     version (2)
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
    228     ...   zero up to header_bytes
    4096    ...   data: for layer 0..L-1: K [num_tokens, kv_heads, head_dim] then V (same); keys rotated
                  (RoPE applied at positions 0..num_tokens-1), as the engine's cache stores them

Writes go to `<key>.kv.tmp` and are renamed into place after the complete flag is set, so a crashed
producer leaves either no `.kv` file or one the reader can still refuse. `read_header` / `validate`
check every header field (magic, version, completion, header size, dtype, shape, producer pid, length,
data size, creation time, token hash, model, the zero padding) against the file and the engine, and give a
one-line reason for refusing; `verify_payload` checks the data against the producer's CRC-32 (zlib's,
~3 GB/s here: 30 ms for a 4K-token prompt of a 135M model), so corrupt numbers (NaN, 1e30) under a
valid header are refused before a byte reaches an engine's cache.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import envs

MAGIC = b"LKXFERKV"
VERSION = 2
HEADER_BYTES = 4096
_FMT = "<8s8IQQd32s64s64sI"
_FIXED = struct.calcsize(_FMT)
DTYPES = {1: torch.bfloat16, 2: torch.float16, 3: torch.float32}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
COMPLETE_OFFSET = 12
CRC_OFFSET = 224
_CRC_CHUNK = 16 << 20


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

    @property
    def block_elems(self) -> int:
        return self.num_tokens * self.num_kv_heads * self.head_dim

    def pack(self) -> bytes:
        raw = struct.pack(_FMT, MAGIC, self.version, self.complete, self.header_bytes, DTYPE_CODES[self.dtype],
                          self.num_layers, self.num_kv_heads, self.head_dim, self.pid, self.num_tokens,
                          self.data_bytes, self.created, self.token_hash, self.fingerprint.encode()[:64],
                          self.model.encode()[:64], self.payload_crc32)
        return raw.ljust(self.header_bytes, b"\0")


def expected_bytes(num_layers: int, num_tokens: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16) -> int:
    return num_layers * 2 * num_tokens * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def unpack(buf: bytes) -> Header:
    if len(buf) < _FIXED:
        raise ShmError(f"truncated header ({len(buf)} bytes)")
    (magic, version, complete, hbytes, dcode, layers, heads, hdim, pid, ntok, dbytes, created, th, fp,
     model, crc) = struct.unpack(_FMT, buf[:_FIXED])
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
                  not any(buf[_FIXED:HEADER_BYTES]))


def read_header(path: Path) -> Header:
    with open(path, "rb") as f:
        return unpack(f.read(HEADER_BYTES))


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
    path.parent.mkdir(parents=True, exist_ok=True)
    check_space(path.parent, nbytes)
    hdr = Header(VERSION, 0, HEADER_BYTES, dtype, len(kv), H, D, os.getpid(), T, nbytes, time.time(),
                 token_hash(covered_ids), fingerprint, model)
    tmp = path.with_name(path.name + ".tmp")
    crc = 0
    with open(tmp, "wb") as f:
        f.write(hdr.pack())
        for i, (k, v) in enumerate(kv):
            if crash_after_layers is not None and i >= crash_after_layers:
                break
            for x in (k, v):  # [.., H, T, D] -> [T, H, D]
                x = x.reshape(H, T, D).transpose(0, 1).contiguous().to(dtype)
                b = x.view(torch.uint8).numpy().tobytes() if dtype != torch.float32 else x.numpy().tobytes()
                crc = zlib.crc32(b, crc)
                f.write(b)
        if crash_after_layers is not None:
            os.replace(tmp, path)  # a dead producer whose partial file got the final name
            return hdr
        f.flush()
        f.seek(CRC_OFFSET)
        f.write(struct.pack("<I", crc))
        f.flush()
        f.seek(COMPLETE_OFFSET)
        f.write(struct.pack("<I", 1))
        f.flush()
    os.replace(tmp, path)
    hdr.complete, hdr.payload_crc32 = 1, crc
    return hdr


def payload_crc32(path: Path, hdr: Header) -> int:
    """zlib CRC-32 of the file's data bytes, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        f.seek(hdr.header_bytes)
        left = hdr.data_bytes
        while left > 0:
            b = f.read(min(_CRC_CHUNK, left))
            if not b:
                break
            crc = zlib.crc32(b, crc)
            left -= len(b)
    return crc


def validate(path: Path, prompt_ids, fingerprint: str, num_layers: int, kv_heads: int, head_dim: int,
             dtype=None, verify_payload: bool = False) -> Header:
    """The header if the file may be loaded for this prompt and model; else ShmError with one line.
    `verify_payload`: also the data's CRC-32 against the header's (reads the whole file)."""
    path = Path(path)
    if not path.is_file():
        raise ShmError(f"no KV file {path.name}")
    try:
        hdr = read_header(path)
    except ShmError as ex:
        raise ShmError(f"{path.name}: {ex}") from None
    if hdr.complete != 1:
        raise ShmError(f"{path.name}: incomplete (producer pid {hdr.pid} did not finish)" if hdr.complete == 0
                       else f"{path.name}: complete flag {hdr.complete} (0 or 1 expected)")
    if not hdr.padding_clean:
        raise ShmError(f"{path.name}: header padding is not zero (written by another layout)")
    if min(hdr.num_layers, hdr.num_kv_heads, hdr.head_dim, hdr.num_tokens) <= 0 or hdr.pid <= 0:
        raise ShmError(f"{path.name}: empty field in the header (layers {hdr.num_layers}, kv heads "
                       f"{hdr.num_kv_heads}, head_dim {hdr.head_dim}, tokens {hdr.num_tokens}, pid {hdr.pid})")
    if not (math.isfinite(hdr.created) and 0 < hdr.created <= time.time() + 60):
        raise ShmError(f"{path.name}: creation time {hdr.created} is not a time")
    size = path.stat().st_size
    if size != hdr.header_bytes + hdr.data_bytes or hdr.data_bytes != expected_bytes(
            hdr.num_layers, hdr.num_tokens, hdr.num_kv_heads, hdr.head_dim, hdr.dtype):
        raise ShmError(f"{path.name}: size {size} does not match the header ({hdr.header_bytes} + {hdr.data_bytes} bytes)")
    if hdr.fingerprint != fingerprint:
        raise ShmError(f"{path.name}: made for model {hdr.model or '?'} ({hdr.fingerprint}), not {fingerprint}")
    if (hdr.num_layers, hdr.num_kv_heads, hdr.head_dim) != (num_layers, kv_heads, head_dim):
        raise ShmError(f"{path.name}: shape {hdr.num_layers}x{hdr.num_kv_heads}x{hdr.head_dim}, engine has "
                       f"{num_layers}x{kv_heads}x{head_dim}")
    if dtype is not None and hdr.dtype != dtype:
        raise ShmError(f"{path.name}: dtype {hdr.dtype}, engine cache is {dtype}")
    n = len(prompt_ids)
    if not 0 < hdr.num_tokens < n:
        raise ShmError(f"{path.name}: covers {hdr.num_tokens} tokens, prompt has {n} (must be 1..{n - 1})")
    if hdr.token_hash != token_hash(list(prompt_ids)[: hdr.num_tokens]):
        raise ShmError(f"{path.name}: token hash differs from the prompt's first {hdr.num_tokens} tokens")
    if verify_payload:
        got = payload_crc32(path, hdr)
        if got != hdr.payload_crc32:
            raise ShmError(f"{path.name}: payload CRC-32 {got:08x} differs from the producer's {hdr.payload_crc32:08x} "
                           f"(data changed after writing)")
    return hdr


class KVFile:
    """Read-only mapping of a validated file; `layer(i)` -> (K, V) views [T, H, D] without copying."""

    def __init__(self, path: Path, hdr: Header):
        self.path, self.hdr = Path(path), hdr
        self._f = open(self.path, "rb")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable view, pages never copied unless written
        self._t = torch.frombuffer(memoryview(self._mm)[hdr.header_bytes: hdr.header_bytes + hdr.data_bytes],
                                   dtype=hdr.dtype).view(hdr.num_layers, 2, hdr.num_tokens, hdr.num_kv_heads,
                                                         hdr.head_dim)

    def payload_ok(self) -> bool:
        """The mapped data bytes (the very bytes `layer` hands out) against the producer's CRC-32."""
        crc, mv = 0, memoryview(self._mm)[self.hdr.header_bytes: self.hdr.header_bytes + self.hdr.data_bytes]
        try:
            for i in range(0, len(mv), _CRC_CHUNK):
                crc = zlib.crc32(mv[i: i + _CRC_CHUNK], crc)
        finally:
            mv.release()
        return crc == self.hdr.payload_crc32

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._t[i, 0], self._t[i, 1]

    def close(self) -> None:
        self._t = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        self._f.close()
