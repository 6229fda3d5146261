"""The hybrid decoder: chunked prefill into an offloaded KV cache, and a batched decode step.

    model  = HybridModel(shape, device, seed)                 # random seeded weights
    cache  = OffloadCache.allocate(model, "host", n_slots, capacity)
    engine = Engine(model, cache, get_strategy("zero_copy"), budget=2048)
    engine.prefill(slot, tokens)                              # writes K/V rows to the pool, index keys to the device
    runner = engine.decoder(batch=4)                          # static buffers; CUDA graphs where they fit
    runner.step()                                             # one token for each of the 4 requests

A decode step is written once, as a generator that yields at every QSA layer where it needs the
selected rows (`LoadRequest`). Strategies that only do device work run the whole step in one CUDA
graph; host strategies replay one graph per segment and load the rows between them (piecewise
graphs, as vLLM does around host-side ops). Requests in one batch may have different lengths.
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ..shapes import ModelShape
from .attention import dense_prefill_attention, sparse_decode_attention, split_rows
from .indexer import index_scores, select_topk
from .kv import WORD, IndexKeyCache, KVPool, PageTable, quantize_index_keys
from .layers import FFN, DeltaNetLayer, QSALayer, RMSNorm, dn_state_shapes
from .transfer import TransferStrategy


class Block(nn.Module):
    def __init__(self, kind: str, s: ModelShape, gen, dtype, device):
        super().__init__()
        self.kind = kind
        self.norm1, self.norm2 = RMSNorm(s.hidden, dtype, device), RMSNorm(s.hidden, dtype, device)
        self.mixer = QSALayer(s, gen, dtype, device) if kind == "qsa" else DeltaNetLayer(s, gen, dtype, device)
        self.ffn = FFN(s, gen, dtype, device)


class HybridModel(nn.Module):
    def __init__(self, shape: ModelShape, device: torch.device | str = "cpu", seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        device = torch.device(device)
        self.shape, self.device, self.dtype = shape, device, dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        attn = set(shape.attn_layer_ids)
        self.embed = nn.Parameter((torch.randn(shape.vocab, shape.hidden, generator=gen, device=device)).to(dtype),
                                  requires_grad=False)
        self.blocks = nn.ModuleList(Block("qsa" if i in attn else "dn", shape, gen, dtype, device)
                                    for i in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, dtype, device)
        self.lm_head = nn.Parameter((torch.randn(shape.hidden, shape.vocab, generator=gen, device=device)
                                     / shape.hidden ** 0.5).to(dtype), requires_grad=False)
        # index of each block among its kind: QSA i -> KV pool layer, DeltaNet j -> state slot
        self.kind_index = [sum(1 for b in self.blocks[:i] if b.kind == blk.kind) for i, blk in enumerate(self.blocks)]

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @property
    def n_attn(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "qsa")

    @property
    def n_dn(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "dn")


@dataclass
class OffloadCache:
    """Per-request state of a batch of slots: the paged KV pool (host or device), index keys, DeltaNet states."""
    pool: KVPool
    pages: PageTable
    index: IndexKeyCache
    dn_state: torch.Tensor      # [n_dn, S, H, dk, dv] fp32
    dn_conv: torch.Tensor       # [n_dn, S, C, K-1]
    lens: torch.Tensor          # [S] int64 on the device: tokens written per slot

    @classmethod
    def allocate(cls, model: HybridModel, medium: str, n_slots: int, capacity: int, page_size: int = 256):
        s, dev = model.shape, model.device
        pages_per_slot = -(-capacity // page_size)
        pool = KVPool(medium, model.n_attn, n_slots * pages_per_slot, page_size, s.row_bytes, dev)
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

    def device_bytes(self) -> dict:
        on_dev = self.pool.medium == "device"
        return {"device_kv_bytes": self.pool.nbytes if on_dev else 0,
                "device_index_bytes": self.index.nbytes,
                "device_state_bytes": self.dn_state.numel() * 4 + self.dn_conv.numel() * self.dn_conv.element_size(),
                "host_kv_bytes": 0 if on_dev else self.pool.nbytes}

    def fill_random_(self, context_lens: list[int], seed: int = 0) -> None:
        """Stand in for a prefill of `context_lens[i]` tokens in slot i: seeded random rows, index keys
        and DeltaNet states (decode time does not depend on the values)."""
        for slot, n in enumerate(context_lens):
            self.pages.reserve(slot, self.capacity)
        self.pool.fill_random_(seed)
        self.index.fill_random_(seed + 1)
        g = torch.Generator(device=self.dn_state.device).manual_seed(seed + 2)
        self.dn_state.normal_(0, 0.02, generator=g)
        self.dn_conv.normal_(0, 1.0, generator=g)
        self.lens.copy_(torch.tensor(context_lens, dtype=torch.int64))


# ---------------------------------------------------------------------------- decode block compute
# A decode step of the reference shape is ~3,700 small kernels when run op by op: even replayed from a
# CUDA graph that costs ~9 ms, three times the 3.1 ms its 7 GB of weights take to read. torch.compile
# fuses each block's elementwise chains into a few Triton kernels; written as functions of the block
# (not methods), one compiled graph serves every layer of a kind (parameters are lifted as inputs).
def _dn_block(blk, x, S, conv):
    x = x + blk.mixer.step(blk.norm1(x), S, conv)
    return x + blk.ffn(blk.norm2(x))


def _qsa_pre(blk, x, pos):
    q, gate, kv_row, iq, iw, ik = blk.mixer.project(blk.norm1(x), pos)
    k8, sc = quantize_index_keys(ik)
    return x, q, gate, kv_row.contiguous(), k8, sc, iq, iw


def _qsa_post(blk, x, q, rows, valid, gate):
    att = sparse_decode_attention(q, rows, valid, blk.mixer.s.n_kv_heads)
    x = x + blk.mixer.output(att, gate)
    return x + blk.ffn(blk.norm2(x))


@dataclass(frozen=True)
class BlockFns:
    dn_block: object
    qsa_pre: object
    qsa_post: object
    compiled: bool


_FNS: dict[bool, BlockFns] = {}


def block_fns(compiled: bool) -> BlockFns:
    compiled = compiled and os.environ.get("LABKIT_COMPILE", "1") != "0"
    if compiled not in _FNS:
        if compiled:
            import torch._dynamo
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            c = lambda fn: torch.compile(fn, dynamic=False)
            _FNS[True] = BlockFns(c(_dn_block), c(_qsa_pre), c(_qsa_post), True)
        else:
            _FNS[False] = BlockFns(_dn_block, _qsa_pre, _qsa_post, False)
    return _FNS[compiled]


@dataclass
class LoadRequest:
    layer: int                 # QSA layer (pool layer)
    rows: torch.Tensor         # [B*k] physical rows to load
    out: torch.Tensor          # [B*k, W] int64 staging on the compute device


class Engine:
    def __init__(self, model: HybridModel, cache: OffloadCache, strategy: TransferStrategy, budget: int,
                 prefill_chunk: int = 8192, compile: bool | None = None):
        if budget <= 0:
            raise ValueError(f"budget must be > 0, got {budget}")
        if (cache.pool.medium == "device") != (strategy.medium == "device"):
            raise ValueError(f"strategy {strategy.name} needs a {strategy.medium} pool, cache has {cache.pool.medium}")
        self.model, self.cache, self.strategy, self.budget = model, cache, strategy, budget
        self.prefill_chunk = prefill_chunk
        self.fns = block_fns(model.device.type == "cuda" if compile is None else compile)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, slot: int, tokens: torch.Tensor | None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run a prompt through the model in chunks; K/V rows go to the pool, index keys to the device.
        Returns the last token's logits; a pipeline stage without the head returns the hidden states
        of all tokens instead, and one without the embedding takes them as `hidden` [T, hidden]."""
        m, s, c = self.model, self.model.shape, self.cache
        T = tokens.numel() if hidden is None else hidden.shape[0]
        outs = []
        if T > c.capacity:
            raise ValueError(f"prompt of {T} tokens exceeds the cache capacity {c.capacity}")
        c.pages.reserve(slot, T)
        W = s.row_bytes // WORD
        prefix = torch.empty((T, W), dtype=torch.int64, device=m.device)     # one layer's K/V so far, on device
        x_last = None
        for a in range(0, T, self.prefill_chunk):
            e = min(T, a + self.prefill_chunk)
            pos = torch.arange(a, e, device=m.device)
            x = m.embed[tokens[a:e]] if m.embed is not None else hidden[a:e]
            for blk, ki in zip(m.blocks, m.kind_index):
                h = blk.norm1(x)
                if blk.kind == "dn":
                    h = blk.mixer.forward_seq(h, c.dn_state[ki, slot], c.dn_conv[ki, slot])
                else:
                    q, gate, kv_row, _, _, ik = blk.mixer.project(h, pos)
                    words = kv_row.contiguous().view(torch.int64)
                    for p, r, n in c.pages.runs(slot, a, e):                  # K/V rows -> pool pages
                        c.pool.data[ki, r:r + n].copy_(words[p - a:p - a + n], non_blocking=True)
                    k8, sc = quantize_index_keys(ik)
                    c.index.keys[ki, slot, a:e] = k8
                    c.index.scales[ki, slot, a:e] = sc
                    for p, r, n in c.pages.runs(slot, 0, e):                  # whole prefix back for dense attention
                        prefix[p:p + n].copy_(c.pool.data[ki, r:r + n], non_blocking=True)
                    k, v = split_rows(prefix[:e].view(torch.bfloat16), s.n_kv_heads, s.head_dim)
                    with _fast_sdpa(m.device):
                        att = dense_prefill_attention(q, k, v)
                    h = blk.mixer.output(att, gate)
                x = x + h
                x = x + blk.ffn(blk.norm2(x))
            x_last = x[-1:]
            if m.lm_head is None:
                outs.append(x)
        c.lens[slot] = T
        return m.norm(x_last) @ m.lm_head if m.lm_head is not None else torch.cat(outs)

    # ------------------------------------------------------------------ decode
    def decode_segments(self, st: "DecodeState"):
        """One decode step for slots [0, B): yields a LoadRequest at each QSA layer."""
        m, s, c = self.model, self.model.shape, self.cache
        B, k = st.batch, st.k
        pos = c.lens[:B].clone()
        x = m.embed[st.tokens] if m.embed is not None else st.x_in
        f = self.fns
        for blk, ki in zip(m.blocks, m.kind_index):
            if st.marks is not None:
                st.marks.append(_mark(m.device))
            if blk.kind == "dn":
                x = f.dn_block(blk, x, c.dn_state[ki, :B], c.dn_conv[ki, :B])
                continue
            x, q, gate, kv_row, k8, sc, iq, iw = f.qsa_pre(blk, x, pos)
            new_rows = c.pages.rows(st.slots, pos[:, None]).view(-1)
            self.strategy.store(c.pool, ki, new_rows, kv_row.view(torch.int64))
            flat = st.slots * c.capacity + pos
            c.index.keys[ki].view(torch.uint8).view(-1, s.index_dim).index_copy_(0, flat, k8.view(torch.uint8))
            c.index.scales[ki].view(-1).index_copy_(0, flat, sc)
            W = st.window
            scores = index_scores(iq, iw, c.index.keys[ki, :B, :W], c.index.scales[ki, :B, :W], pos + 1)
            sel, valid = select_topk(scores, k)
            if st.trace is not None:   # replay recorded selections (scaled to this context)
                # index_select with the step as a 1-element device tensor: plain indexing would .item() (a sync)
                step_sel = torch.index_select(st.trace, 0, st.trace_step.view(1))[0, ki]
                sel = torch.minimum(step_sel.expand(B, k), pos[:, None])
                valid = torch.ones_like(valid)
            st.rows_buf[ki].copy_(c.pages.rows(st.slots, sel).view(-1))
            yield LoadRequest(ki, st.rows_buf[ki], st.staging)
            rows = st.staging.view(torch.bfloat16).view(B, k, -1)
            x = f.qsa_post(blk, x, q, rows, valid, gate)
            st.last_sel[ki].copy_(sel)
        if st.marks is not None:
            st.marks.append(_mark(m.device))
        if m.lm_head is None:          # a pipeline stage: hand the activations to the next one
            st.x_out.copy_(x)
        else:
            logits = m.norm(x) @ m.lm_head
            st.logits.copy_(logits)
            st.tokens.copy_(logits.argmax(-1))
        c.lens[:B] += 1
        if st.trace is not None:
            st.trace_step.copy_((st.trace_step + 1) % st.trace.shape[0])

    def decoder(self, batch: int, graphs: bool | None = None, trace: torch.Tensor | None = None,
                max_steps: int = 1024) -> "DecodeRunner":
        """A runner for slots [0, batch) as they are now; it may take up to `max_steps` steps."""
        return DecodeRunner(self, batch, graphs, trace, max_steps)


class DecodeState:
    """Static buffers of one decode batch (fixed addresses so CUDA graphs can replay them)."""

    def __init__(self, engine: Engine, batch: int, trace: torch.Tensor | None, max_steps: int = 1024):
        c, s, dev = engine.cache, engine.model.shape, engine.model.device
        if batch > c.n_slots:
            raise ValueError(f"batch {batch} exceeds the cache's {c.n_slots} slots")
        self.batch = batch
        # The indexer scores positions [0, window): the batch's longest request now plus the steps this
        # runner may take, not the whole cache capacity (a 1M-token cache would cost every step a
        # 1M-position scan even at 8K of context). Read once here: no sync inside a step.
        longest = int(c.lens[:batch].max())
        self.window = min(c.capacity, longest + max_steps)
        self.k = min(engine.budget, self.window)
        self.slots = torch.arange(batch, device=dev)
        self.tokens = torch.randint(0, s.vocab, (batch,), generator=torch.Generator().manual_seed(batch)).to(dev)
        self.staging = torch.empty((batch * self.k, s.row_bytes // WORD), dtype=torch.int64, device=dev)
        n_attn = engine.model.n_attn
        self.rows_buf = torch.zeros((n_attn, batch * self.k), dtype=torch.int64, device=dev)
        self.last_sel = torch.zeros((n_attn, batch, self.k), dtype=torch.int64, device=dev)
        self.x_in = torch.zeros((batch, s.hidden), dtype=engine.model.dtype, device=dev)
        self.x_out = torch.zeros((batch, s.hidden), dtype=engine.model.dtype, device=dev)
        self.marks: list | None = None       # per-block timing marks when profiling (eager only)
        self.logits = torch.empty((batch, s.vocab), dtype=engine.model.dtype, device=dev)
        self.trace = None if trace is None else trace[..., :self.k].to(dev)
        self.trace_step = torch.zeros((), dtype=torch.int64, device=dev)


class DecodeRunner:
    """Runs decode steps for one batch: eager on CPU, one CUDA graph for device-only strategies,
    one graph per segment (loads in between) for host strategies."""

    def __init__(self, engine: Engine, batch: int, graphs: bool | None, trace, max_steps: int = 1024):
        self.engine, self.state = engine, DecodeState(engine, batch, trace, max_steps)
        self.cuda = engine.model.device.type == "cuda"
        self.graphs = self.cuda if graphs is None else (graphs and self.cuda)
        self._full: torch.cuda.CUDAGraph | None = None
        self._pieces: list[tuple[torch.cuda.CUDAGraph, LoadRequest | None]] = []
        self.rows_per_step = batch * self.state.k * engine.model.n_attn

    @property
    def h2d_bytes_per_step(self) -> int:
        return self.engine.strategy.h2d_bytes(self.rows_per_step, self.engine.model.shape.row_bytes)

    @torch.inference_mode()
    def _eager(self) -> None:
        for req in self.engine.decode_segments(self.state):
            self.engine.strategy.load(self.engine.cache.pool, req.layer, req.rows, req.out)

    @torch.inference_mode()
    def prepare(self, warmup: int = 2) -> None:
        """Warm up (compiles kernels, sizes workspaces), then capture graphs. Each call advances lens."""
        if self.cuda:
            warmup = max(warmup, 1)       # compiles kernels outside any graph capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self._eager()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
        else:
            for _ in range(warmup):
                self._eager()
        if not self.graphs:
            return
        if self.engine.strategy.graphable:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._eager()
            self._full = g
        else:
            pool = torch.cuda.graph_pool_handle()
            gen = self.engine.decode_segments(self.state)
            done = False
            while not done:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    try:
                        req = next(gen)
                    except StopIteration:
                        req, done = None, True
                self._pieces.append((g, req))
        torch.cuda.synchronize()

    @torch.inference_mode()
    def step(self) -> None:
        if self._full is not None:
            self._full.replay()
        elif self._pieces:
            strat, pool = self.engine.strategy, self.engine.cache.pool
            for g, req in self._pieces:
                g.replay()
                if req is not None:
                    strat.load(pool, req.layer, req.rows, req.out)
        else:
            self._eager()


def _mark(device: torch.device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def block_times_ms(marks: list) -> list[float]:
    """Per-block durations from consecutive marks of one profiled step."""
    if marks and not isinstance(marks[0], float):
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


def _fast_sdpa(device: torch.device):
    """On CUDA forbid SDPA's math fallback: at 248K tokens it would materialise a T x S score matrix."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
