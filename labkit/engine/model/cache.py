"""OffloadCache: the per-request state of a batch of slots, and its one write path.

    cache = OffloadCache.allocate(model, "host", n_slots, capacity)
    cache.write(layer, cache.locate(slots, positions), kv_rows, index_keys, index_scales, strategy)

Holds the paged KV pool (host or device, `kv.KVPool`), its page table, the device index keys, and the
DeltaNet states. Every K/V row and index key the engine produces (a prompt chunk's thousands of
tokens or a decode step's one per request) enters through `write`, which translates positions to
pool rows on the device and lets the transfer strategy store the rows (so a strategy that mirrors rows
elsewhere, a hot cache say, sees every write).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .kv import WORD, IndexKeyCache, KVPool, PageTable, quantize_index_keys
from .layers import dn_state_shapes

PAGE_SIZE = 256      # KV page (positions) unless a caller picks another


@dataclass
class OffloadCache:
    pool: KVPool
    pages: PageTable
    index: IndexKeyCache
    dn_state: torch.Tensor      # [n_dn, S, H, dk, dv] fp32
    dn_conv: torch.Tensor       # [n_dn, S, C, K-1]
    lens: torch.Tensor          # [S] int64 on the device: tokens written per slot

    @classmethod
    def allocate(cls, model, medium: str, n_slots: int, capacity: int, page_size: int = PAGE_SIZE,
                 pool_tokens: int | None = None) -> "OffloadCache":
        """`pool_tokens`: KV pool size when smaller than n_slots x capacity (slots then share it)."""
        s, dev = model.shape, model.device
        pages_per_slot = -(-capacity // page_size)
        n_pages = n_slots * pages_per_slot if pool_tokens is None else -(-pool_tokens // page_size)
        pool = KVPool(medium, model.n_attn, n_pages, page_size, s.row_bytes, dev)
        pages = PageTable(pool.n_pages, page_size, n_slots, pages_per_slot, dev)
        index = IndexKeyCache.allocate(model.n_attn, n_slots, pages_per_slot * page_size, s.index_dim, dev)
        st, cv = dn_state_shapes(s)
        n_dn = model.n_dn
        return cls(pool, pages, index, torch.zeros((n_dn, n_slots) + st, dtype=torch.float32, device=dev),
                   torch.zeros((n_dn, n_slots) + cv, dtype=model.dtype, device=dev),
                   torch.zeros(n_slots, dtype=torch.int64, device=dev))

    @property
    def n_slots(self) -> int:
        return self.lens.shape[0]

    @property
    def capacity(self) -> int:
        return self.index.capacity

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool rows and index-key slots of request `slots` [N] at `positions` [N] (device, no sync).
        The same for every QSA layer: a decode step computes them once."""
        return self.pages.rows(slots, positions), slots * self.capacity + positions

    def write(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], kv_rows: torch.Tensor,
              keys: torch.Tensor, scales: torch.Tensor, strategy) -> None:
        """Store N tokens' K/V rows [N, row] (bf16) and index keys [N, D] fp8 + scales [N] of QSA
        `layer` at `where = locate(slots, positions)`, through the transfer strategy (which may mirror
        rows elsewhere). Device tensors only: a decode step's write stays inside its CUDA graph."""
        rows, _ = where
        strategy.store(self.pool, layer, rows, kv_rows.reshape(rows.shape[0], -1).view(torch.int64))
        self.write_index(layer, where, keys, scales)

    def write_index(self, layer: int, where: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                    scales: torch.Tensor) -> None:
        """The index-key half of `write` (the rotating-buffer prefill stores the K/V rows itself, on its
        write-back stream, and the keys here on the compute stream)."""
        flat = where[1]
        self.index.keys[layer].view(torch.uint8).view(-1, keys.shape[-1]).index_copy_(0, flat, keys.view(torch.uint8))
        self.index.scales[layer].view(-1).index_copy_(0, flat, scales)

    def read_prefix(self, layer: int, slot: int, n: int, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Positions [start, n) of a slot's K/V rows into `out[start:n]` (`out [>= n, W]` on the compute
        device), one copy per contiguous run of pages (the whole prefix a dense prefill chunk attends to).
        Returns `out[:n]`."""
        for p, r, m in self.pages.runs(slot, start, n):
            out[p:p + m].copy_(self.pool.data[layer, r:r + m], non_blocking=True)
        return out[:n]

    def write_back(self, layer: int, slot: int, start: int, end: int, src: torch.Tensor) -> None:
        """`src[start:end]` (device rows of positions [start, end)) into the pool, one copy per
        contiguous run of pages: DMA on the current stream, the reverse of `read_prefix`."""
        for p, r, m in self.pages.runs(slot, start, end):
            self.pool.data[layer, r:r + m].copy_(src[p:p + m], non_blocking=True)

    def row_words(self) -> int:
        return self.pool.row_bytes // WORD

    def device_bytes(self) -> dict:
        on_dev = self.pool.medium == "device"
        return {"device_kv_bytes": self.pool.nbytes if on_dev else 0,
                "device_index_bytes": self.index.nbytes,
                "device_state_bytes": self.dn_state.numel() * 4 + self.dn_conv.numel() * self.dn_conv.element_size(),
                "host_kv_bytes": 0 if on_dev else self.pool.nbytes}

    def set_lengths(self, context_len: int, slots: slice = slice(None)) -> None:
        """Place `slots` at `context_len` tokens of context without writing them: a measurement whose rows were
        filled at random (`fill_random_`, `aliased`) and whose decode time depends on the length alone."""
        self.lens[slots] = context_len

    def free_slot(self, slot: int) -> None:
        """Make `slot` empty for a new prompt: its pages go back to the pool, its DeltaNet state starts from
        zero, its length is 0. The caller orders this after whatever still reads the slot."""
        self.pages.release(slot)
        self.dn_state[:, slot].zero_()
        self.dn_conv[:, slot].zero_()
        self.lens[slot] = 0

    @classmethod
    def aliased(cls, model, pool: KVPool, n_slots: int, context: int, capacity: int, page_size: int,
                seed: int) -> "OffloadCache":
        """`n_slots` requests at `context` tokens whose page tables all map to the pages of `pool` (one
        request's worth of rows): distinct index keys and DeltaNet states per slot, shared K/V rows. Many
        requests' decode without many requests' host memory (the concurrency scaling of a switched batch)."""
        c = cls.allocate(model, pool.medium, n_slots, capacity, page_size=page_size, pool_tokens=page_size)
        per_slot = -(-capacity // page_size)
        if pool.n_pages < per_slot:
            raise ValueError(f"pool of {pool.n_pages} pages < {per_slot} a slot maps")
        c.pool = pool
        c.pages.map_all_slots(pool.n_pages, per_slot)
        c.index.fill_random_(seed + 1)
        c.random_states_(seed)
        c.set_lengths(context)
        return c

    def random_states_(self, seed: int) -> None:
        """The DeltaNet states and conv windows at seeded random values (every decode step changes them: a
        measurement that compares its points' outputs starts each from these)."""
        g = torch.Generator(device=self.dn_state.device).manual_seed(seed + 2)
        self.dn_state.normal_(0, 0.02, generator=g)
        self.dn_conv.normal_(0, 1.0, generator=g)

    def fill_random_(self, context_lens: list[int], seed: int = 0) -> None:
        """Stand in for a prefill of `context_lens[i]` tokens in slot i: seeded random rows, index keys
        and DeltaNet states (decode time does not depend on the values)."""
        for slot, n in enumerate(context_lens):
            self.pages.reserve(slot, self.capacity)
        self.pool.fill_random_(seed)
        self.index.fill_random_(seed + 1)
        self.random_states_(seed)
        self.lens.copy_(torch.tensor(context_lens, dtype=torch.int64))


    def fill_slot_random_(self, slot: int, n: int, seed: int, chunk: int = 8192) -> None:
        """Stand in for a prompt of `n` tokens prefilled elsewhere and handed over into `slot`, whose pages are
        reserved: seeded random K/V rows (written through the slot's page table, so into whichever pool, device
        or host, the slot's pages are in), index keys, DeltaNet states, length `n`. The contents depend on `seed`
        and the position alone, not on the pool or the rows the pages landed on, so a request handed over to any
        lane decodes the same tokens. Rows are made on the model's device `chunk` positions at a time."""
        dev = self.index.keys.device
        g = torch.Generator(device=dev).manual_seed(seed)
        half = self.pool.row_bytes // 2                      # bf16 values a row
        for layer in range(self.pool.attn_layers):
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                rows = torch.randn((b - a, half), generator=g, device=dev).to(torch.bfloat16).view(torch.int64)
                for p, r, m in self.pages.runs(slot, a, b):
                    self.pool.data[layer, r:r + m].copy_(rows[p - a:p - a + m])
            k = torch.randn((n, self.index.keys.shape[-1]), generator=g, device=dev)
            self.index.keys[layer, slot, :n].copy_(quantize_index_keys(k)[0])
            self.index.scales[layer, slot, :n].uniform_(0.5, 1.5, generator=g)
        self.dn_state[:, slot].normal_(0, 0.02, generator=g)
        self.dn_conv[:, slot].normal_(0, 1.0, generator=g)
        self.lens[slot] = n


def build_on_devices(fn, items: list, device_of=lambda item: item.device) -> list:
    """`fn(item)` for each item (a pipeline stage, say), each in a thread bound to the item's device
    (`torch.cuda.set_device`), so what it allocates and page-locks is first touched from there and
    its pinned pages sit near that GPU's driver thread. One item: called inline, same binding."""
    def bound(item):
        d = torch.device(device_of(item))
        if d.type == "cuda" and d.index is not None:   # "cuda" alone: the current one
            torch.cuda.set_device(d)
        return fn(item)

    if len(items) == 1:
        return [bound(items[0])]
    with ThreadPoolExecutor(len(items)) as ex:
        return list(ex.map(bound, items))
