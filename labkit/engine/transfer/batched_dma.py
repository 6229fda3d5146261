"""Batched DMA of scattered units: one driver call that queues a copy per unit on the copy engines
(`cuMemcpyBatchAsync`, CUDA 12.8+; the mechanism of vLLM's OffloadingConnector).

    dma = BatchedDMA()                               # resolves the driver entry point once (CUDA only)
    dma.copy(src, ids, dst, stream)                  # dst[j] = src[ids[j]], one batched call

No CPU gather and no SM work: the link moves the units straight from the pinned pool, so nothing
crosses host DRAM twice (the coalesced path's gather reads and writes every byte once more before the
DMA reads it). The shared probe measured 4.5 GB/s for 2 KiB rows, 17.4 GB/s for 8 KiB and 44.9 GB/s
(0.81 x contiguous) for 32 KiB blocks on the H200 host: per-copy cost dominates small units, so this is
for block-granular selections (PulseInfer's 8-128 KiB units), not for 2 KiB token rows.

The entry point is looked up with `cuGetProcAddress` for the driver's own CUDA version: the batch
API's signature changed between 12.8 (a `failIdx` argument) and 13.0, and the versioned lookup returns
the variant that matches the signature declared here (13.0's). `unit_pointers` and `run_pointers` (pure
arithmetic, tested on any machine) build the three arrays the call takes.

Two rules of the driver, both enforced here before the call: the legacy default stream is refused
(`CUDA_ERROR_INVALID_VALUE`, measured on the H200: torch's current stream is that stream unless one is
set, so such copies go through a private stream joined both ways), and the call has no graph-node
form, so it cannot be captured.

    dma.copy_runs(src, rows, dst, stream)            # dst[j] = src[rows[j]], one unit per run of consecutive rows

`copy_runs` is what a block-granular selection needs: 16 selected tokens of one aligned block are 16
consecutive pool rows (32 KiB for the reference shape), so the batch holds one copy per block.
"""
from __future__ import annotations

import ctypes

import torch

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1
API_VERSION = 13000              # the signature below (no failIdx)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


def unit_pointers(src: torch.Tensor, ids: torch.Tensor, dst: torch.Tensor, order: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dst pointers, src pointers, sizes) as int64 CPU tensors for dst[order[j]] = src[ids[j]] (dst[j]
    without `order`), rows of src and dst."""
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or ids.numel() != dst.shape[0]:
        raise ValueError(f"batched_dma: src {tuple(src.shape)}, ids {ids.numel()}, dst {tuple(dst.shape)} do not agree")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("batched_dma: src and dst must be contiguous")
    ids = ids.to("cpu", torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= src.shape[0]):
        raise IndexError(f"batched_dma: unit ids outside [0, {src.shape[0]})")
    row = src.shape[1] * src.element_size()
    j = torch.arange(ids.numel(), dtype=torch.int64) if order is None else order.to("cpu", torch.int64)
    if order is not None and not torch.equal(torch.sort(j).values, torch.arange(ids.numel())):
        raise ValueError("batched_dma: order must be a permutation of range(len(ids))")
    return dst.data_ptr() + j * row, src.data_ptr() + ids * row, torch.full_like(j, row)


def runs(rows: torch.Tensor, max_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Maximal runs of consecutive values in `rows` (1-D, kept in its order): (index j of each run's
    first element, its first row, its length), int64 CPU tensors. `max_rows` > 0 cuts every run into
    pieces of at most that many rows from its start (a unit per piece: how per-head selections move a
    block, one 8 KiB copy per head's K or V, where the whole block is one 32 KiB run)."""
    if max_rows < 0:
        raise ValueError(f"batched_dma: max_rows must be >= 0 (0: whole runs), got {max_rows}")
    rows = rows.to("cpu", torch.int64).flatten()
    n = rows.numel()
    if n == 0:
        e = torch.empty(0, dtype=torch.int64)
        return e, e, e
    start = torch.ones(n, dtype=torch.bool)
    start[1:] = rows[1:] != rows[:-1] + 1
    j = start.nonzero().flatten()
    first, length = rows[j], torch.diff(j, append=torch.tensor([n]))
    if not max_rows or int(length.max()) <= max_rows:
        return j, first, length
    k = (length + max_rows - 1) // max_rows                     # pieces per run
    run = torch.repeat_interleave(torch.arange(len(k)), k)
    off = (torch.arange(int(k.sum())) - torch.repeat_interleave(torch.cumsum(k, 0) - k, k)) * max_rows
    return j[run] + off, first[run] + off, torch.minimum(length[run] - off, torch.tensor(max_rows))


def run_pointers(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, max_rows: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dst pointers, src pointers, sizes) for dst[j] = src[rows[j]], one unit per run of consecutive
    rows (`runs`, cut at `max_rows`)."""
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or rows.numel() != dst.shape[0]:
        raise ValueError(f"batched_dma: src {tuple(src.shape)}, rows {rows.numel()}, dst {tuple(dst.shape)} do not agree")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("batched_dma: src and dst must be contiguous")
    j, first, n = runs(rows, max_rows)
    if first.numel() and (int(first.min()) < 0 or int((first + n).max()) > src.shape[0]):
        raise IndexError(f"batched_dma: rows outside [0, {src.shape[0]})")
    row = src.shape[1] * src.element_size()
    return dst.data_ptr() + j * row, src.data_ptr() + first * row, n * row


def call_slices(n: int, per_call: int) -> list[tuple[int, int]]:
    """[a, b) ranges of the n units, `per_call` each (0: one call), in order."""
    step = per_call or n
    return [(a, min(n, a + step)) for a in range(0, n, step)]


class BatchedDMA:
    """`cuMemcpyBatchAsync` through ctypes: host-to-device copies of scattered pinned units."""

    def __init__(self, prefer_overlap: bool = True, units_per_call: int = 0):
        """`prefer_overlap`: the CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE hint (the driver keeps the copies
        on the copy engines so they overlap kernels; without it the driver picks the mechanism). Both are
        measured by `labkit.experiments.pulse_blocks.measure` (`batched_dma`, `batched_dma_default`).
        `units_per_call` (0: all in one): a load split into several calls, so the copies of one call run
        while the driver takes in the next (one call of 1,536 units left ~0.5 us a unit exposed on the H200
        host; the shared probe's back-to-back calls hid it)."""
        if units_per_call < 0:
            raise ValueError(f"batched_dma: units_per_call must be >= 0, got {units_per_call}")
        self.flags = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap else 0
        self.units_per_call = units_per_call
        if not torch.cuda.is_available():
            raise RuntimeError("batched_dma needs CUDA")
        torch.cuda.init()
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        _check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        if version.value < API_VERSION:      # 12.8/12.9 have the call, with another signature
            raise RuntimeError(f"batched_dma: needs a CUDA 13 driver (this one: {version.value})")
        fn, status = ctypes.c_void_p(), ctypes.c_int()
        _check(lib.cuGetProcAddress_v2(b"cuMemcpyBatchAsync", ctypes.byref(fn), ctypes.c_int(API_VERSION),
                                       ctypes.c_uint64(0), ctypes.byref(status)), "cuGetProcAddress(cuMemcpyBatchAsync)")
        if not fn.value:
            raise RuntimeError(f"batched_dma: cuMemcpyBatchAsync not found (status {status.value})")
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                                 ctypes.c_void_p)
        self._call = proto(fn.value)
        self.driver_version = version.value
        self._keep: list = []            # the pointer arrays of calls whose copies may still be queued
        self._side: dict = {}            # device index -> private stream (for callers on the legacy stream)
        self.copies = 0                  # units queued so far (one copy each)

    def copy(self, src: torch.Tensor, ids: torch.Tensor, dst: torch.Tensor, order: torch.Tensor | None = None,
             stream: torch.cuda.Stream | None = None) -> int:
        """Queue dst[order[j]] = src[ids[j]] on `stream` (the current stream by default): the units land in
        the attention's order directly, no scatter. src: pinned host [N, W]; dst: device [M, W]. Returns
        the bytes queued."""
        self._check_places(src, dst)
        return self._submit(*unit_pointers(src, ids, dst, order), dst.device, stream)

    def copy_runs(self, src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor,
                  stream: torch.cuda.Stream | None = None, max_rows: int = 0) -> int:
        """Queue dst[j] = src[rows[j]] with one unit per run of consecutive rows (runs cut into units of at
        most `max_rows` rows, 0: whole). Returns the bytes queued."""
        self._check_places(src, dst)
        return self._submit(*run_pointers(src, rows, dst, max_rows), dst.device, stream)

    @staticmethod
    def _check_places(src, dst):
        if dst.device.type != "cuda" or not src.is_pinned():
            raise ValueError("batched_dma: src must be pinned host memory and dst on a CUDA device")

    def _submit(self, d, s, z, dev: torch.device, stream: torch.cuda.Stream | None) -> int:
        if not len(d):
            return 0
        self.copies += len(d)
        stream = stream or torch.cuda.current_stream(dev)
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("batched_dma: cuMemcpyBatchAsync cannot be captured in a CUDA graph")
        on = stream
        if stream.cuda_stream == 0:          # the legacy default stream: refused by the call
            on = self._side.get(dev.index)
            if on is None:
                on = self._side[dev.index] = torch.cuda.Stream(dev)
            on.wait_stream(stream)
        attr = _MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, _MemLocation(CU_MEM_LOCATION_TYPE_HOST, 0),
                                 _MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, dev.index or 0), self.flags)
        idx = ctypes.c_size_t(0)
        with torch.cuda.device(dev):
            for a, b in call_slices(len(d), self.units_per_call):
                _check(self._call(d[a:].data_ptr(), s[a:].data_ptr(), z[a:].data_ptr(), b - a, ctypes.byref(attr),
                                  ctypes.byref(idx), 1, ctypes.c_void_p(on.cuda_stream)), "cuMemcpyBatchAsync")
        if on is not stream:
            stream.wait_stream(on)
        # The driver reads the arrays during the call (source access order "stream" concerns the data, not the
        # arrays), but keep the last call's alive anyway: it costs nothing and survives a lazier driver.
        self._keep = [d, s, z]
        return int(z.sum())


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"batched_dma: {what} failed with CUresult {rc}")
