"""Where KV bytes live: a paged KV pool (pinned host RAM or device memory) and the device index-key cache.

Primitives:
- `KVPool(medium, ...)`: one tensor `[attn_layers, n_pages * page_size, row_words]` of int64 words
  (a row is one token's K+V of one QSA layer, `row_bytes` long). `medium="host"` pins it (page-locked,
  mapped into the GPU's address space so kernels can read it directly); `medium="device"` puts it in
  device memory (the no-offload baseline).
- `PageTable`: hands pages of the pool to request slots and translates token positions to physical
  rows (`page * page_size + pos % page_size`), on the device so a decode step needs no host sync.
- `IndexKeyCache`: per slot and QSA layer, `index_dim` fp8 values + one fp16 scale per token, always
  on the compute device (66 B/token/layer for the reference shape).

Bytes are moved elsewhere (`transfer.py`); this module only decides where they are.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

WORD = 8  # pool rows are int64 words: every row_bytes in our shapes is a multiple of 8


def pin_available(device: torch.device) -> bool:
    return device.type == "cuda"


class KVPool:
    """Paged pool of K+V rows for all QSA layers of all requests."""

    def __init__(self, medium: str, attn_layers: int, n_pages: int, page_size: int, row_bytes: int,
                 device: torch.device):
        if medium not in ("host", "device"):
            raise ValueError(f"KV pool medium must be 'host' or 'device', not {medium!r}")
        if row_bytes % WORD:
            raise ValueError(f"row_bytes {row_bytes} must be a multiple of {WORD}")
        self.medium, self.page_size, self.row_bytes = medium, page_size, row_bytes
        self.attn_layers, self.n_pages = attn_layers, n_pages
        shape = (attn_layers, n_pages * page_size, row_bytes // WORD)
        self.pinned = False
        if medium == "device":
            self.data = torch.empty(shape, dtype=torch.int64, device=device)
        else:
            # Plain pages first, pinned after `fill_random_`/`pin_()` (see `pin_`): on CPU-only machines
            # host and "device" are the same memory and nothing is pinned.
            self.data = torch.empty(shape, dtype=torch.int64)
            if pin_available(device):
                self.data.zero_()   # fault the pages in with all threads; registering would do it on one
                self.pin_()

    @property
    def nbytes(self) -> int:
        return self.data.numel() * WORD

    def pin_(self) -> None:
        """Page-lock the pool with cudaHostRegister (mapped + portable), so DMA and zero-copy kernels reach it.

        Not `pin_memory=True`: torch's caching host allocator rounds a pinned block up to a power of
        two, so a 96 GiB pool would ask for 128 GiB of page-locked RAM. Registering the exact bytes of
        an ordinary allocation costs nothing extra; with unified addressing the device uses the host
        pointer itself."""
        if self.pinned:
            return
        if self.nbytes == 0:       # a pipeline stage without QSA layers
            return
        rt = torch.cuda.cudart()
        ptr, size = self.data.data_ptr(), self.nbytes
        err = rt.cudaHostRegister(ptr, size, 3)      # cudaHostRegisterPortable | cudaHostRegisterMapped
        if int(err) != 0:
            raise MemoryError(f"cudaHostRegister of {size / 2**30:.1f} GiB failed (error {int(err)}): not enough lockable RAM")
        self.pinned = True
        weakref.finalize(self, rt.cudaHostUnregister, ptr)

    def fill_random_(self, seed: int) -> None:
        """Seeded random rows of moderate magnitude (decode time does not depend on values; never zeros): one
        64 MiB random block from the CPU's generator tiled over the pool (randn over 96 GiB would take minutes;
        a memcpy-speed fill takes seconds), the same bytes whichever memory the pool is in, so a strategy that
        reads the KV from host RAM attends the very rows a resident one does and its outputs can be compared
        with the resident's bit for bit (the decode rows' `logits_sha`)."""
        flat = self.data.view(torch.bfloat16).view(-1)
        if flat.numel() == 0:      # a pipeline stage without QSA layers holds no KV
            return
        g = torch.Generator().manual_seed(seed)
        block = torch.randn(min(flat.numel(), 1 << 25), generator=g).to(torch.bfloat16).to(self.data.device)
        for s in range(0, flat.numel(), block.numel()):
            part = flat[s:s + block.numel()]
            part.copy_(block[:part.numel()])


class PageTable:
    """Pages of a `KVPool` per request slot; positions -> physical rows on the device."""

    def __init__(self, n_pages: int, page_size: int, n_slots: int, max_pages_per_slot: int, device: torch.device):
        self.page_size, self.n_pages = page_size, n_pages
        self.free = list(range(n_pages))
        self.pages: list[list[int]] = [[] for _ in range(n_slots)]
        self.table = torch.zeros((n_slots, max_pages_per_slot), dtype=torch.int64, device=device)

    def reserve(self, slot: int, n_tokens: int) -> None:
        need = math.ceil(n_tokens / self.page_size) - len(self.pages[slot])
        if need > len(self.free):
            raise MemoryError(f"KV pool has {len(self.free)} free pages, slot {slot} needs {need}")
        if need > 0:
            # Lowest free pages first: a request admitted into an empty pool gets one contiguous run.
            self.free.sort()
            new, self.free = self.free[:need], self.free[need:]
            self.pages[slot].extend(new)
            self.table[slot, :len(self.pages[slot])] = torch.tensor(self.pages[slot], dtype=torch.int64)

    def release(self, slot: int) -> int:
        """Give a finished request's pages back to the pool; returns how many. The slot's table row is
        zeroed (a stale row would alias pages another slot now owns)."""
        n = len(self.pages[slot])
        self.free.extend(self.pages[slot])
        self.pages[slot] = []
        self.table[slot].zero_()
        return n

    def map_all_slots(self, n_pages: int, per_slot: int) -> None:
        """Every slot maps the same first `per_slot` pages of a pool of `n_pages` (slots aliasing one request's
        rows); nothing is left to reserve."""
        self.n_pages, self.free = n_pages, []
        for s in range(self.table.shape[0]):
            self.pages[s] = list(range(per_slot))
        self.table.copy_(torch.arange(per_slot, device=self.table.device).expand(self.table.shape[0], per_slot))

    def move(self, src: int, dst: int) -> None:
        """Hand slot `src`'s pages to the empty slot `dst` (the rows stay where they are in the pool)."""
        if self.pages[dst]:
            raise ValueError(f"slot {dst} still holds {len(self.pages[dst])} pages")
        self.pages[dst], self.pages[src] = self.pages[src], []
        self.table[dst].copy_(self.table[src])
        self.table[src].zero_()

    @property
    def n_free(self) -> int:
        return len(self.free)

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Physical rows of `positions` [B, ...] for request `slots` [B] (device tensors, no sync)."""
        page = positions // self.page_size
        tab = self.table[slots]                                   # [B, max_pages]
        phys_page = torch.gather(tab, 1, page.reshape(page.shape[0], -1)).reshape(page.shape)
        return phys_page * self.page_size + positions % self.page_size

    def runs(self, slot: int, start: int, end: int) -> list[tuple[int, int, int]]:
        """Contiguous (first_pos, first_row, n) runs covering positions [start, end) of a slot."""
        out: list[tuple[int, int, int]] = []
        ps = self.page_size
        pos = start
        while pos < end:
            page, off = divmod(pos, ps)
            n = min(ps - off, end - pos)
            row = self.pages[slot][page] * ps + off
            if out and out[-1][1] + out[-1][2] == row:
                a, r, m = out[-1]
                out[-1] = (a, r, m + n)
            else:
                out.append((pos, row, n))
            pos += n
        return out


@dataclass
class IndexKeyCache:
    """fp8 index keys and their fp16 scales per slot, QSA layer and position: `[L, S, cap, D]`, `[L, S, cap]`."""
    keys: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def allocate(cls, attn_layers: int, n_slots: int, capacity: int, index_dim: int, device: torch.device):
        return cls(torch.zeros((attn_layers, n_slots, capacity, index_dim), dtype=torch.float8_e4m3fn, device=device),
                   torch.zeros((attn_layers, n_slots, capacity), dtype=torch.float16, device=device))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.scales.numel() * 2

    def fill_random_(self, seed: int) -> None:
        g = torch.Generator(device=self.keys.device).manual_seed(seed)
        for layer in range(self.keys.shape[0]):
            k = torch.randn(self.keys.shape[1:], generator=g, device=self.keys.device, dtype=torch.float32)
            self.keys[layer].copy_(quantize_index_keys(k)[0])
            self.scales[layer].uniform_(0.5, 1.5, generator=g)


FP8_MAX = 448.0            # largest finite float8_e4m3fn
SCALE_MIN = 2.0 ** -14     # smallest normal fp16: an all-zero key keeps a finite, exact scale


def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric fp8: `k ≈ q.float() * scale`, q [..., D] float8_e4m3fn, scale [...] fp16.

    The one quantiser of index keys (the engine's cache and the quality lab's real-model indexer). The
    scale is rounded to fp16 *before* dividing, so dequantising with the stored scale is consistent."""
    amax = k.abs().amax(dim=-1).float()
    scale = (amax / FP8_MAX).clamp_min(SCALE_MIN).to(torch.float16)
    q = (k.float() / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_index_keys(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float().unsqueeze(-1)
