"""`hot_cache`: FlashOffloading's device hot cache. Its `load` moves only the misses.

Consecutive decode steps select mostly the same positions (a real model's mean step-to-step overlap is
0.74-0.89), so every request keeps, per QSA layer, `capacity` recently selected rows in device memory
(its *slots*), and a step reads over the link only the selected rows not already there.

Device state of one decode batch, allocated in `bind` (B requests, L QSA layers, C = capacity, S = B*C
slots per layer, R pool rows per layer; every tensor keeps one spare *trash* entry at its end so that
masked updates stay fixed-shape scatters, never a boolean compaction that would need a host sync):

| tensor     | shape                | meaning |
|------------|----------------------|---------|
| `data`     | `[L, S + 1, W]` int64 | the slots: request b owns slots `[b*C, (b+1)*C)` of each layer |
| `rev`      | `[L, R + 1]` int32    | the reverse index: pool row -> slot holding it, -1 when absent |
| `slot_row` | `[L, S + 1]` int64    | the pool row each slot holds, -1 when empty |
| `key`      | `[L, S + 1]` float64  | eviction priority, lowest goes first (per policy, below) |
| `clock`    | `[L]` float64         | steps seen by each layer |
| `step`     | `[L, 5]` int64        | this step's hits, misses, inserts, evictions, H2D bytes per layer |
| `total`    | `[5]` int64           | the same, summed over every step since `bind` |

The reverse index is keyed by *physical pool row*: `load` receives the selected rows after the page
table's translation, and a pool row belongs to exactly one request (its page), so `rev` over the pool
is the per-request, per-layer position -> slot map with the translation already applied, one int32
per token and layer (4 B against the index key's 66 B).

A step of one layer (`HotIndex.plan`: on CUDA one Triton kernel, `hot_plan.py`; elsewhere, and as
that kernel's reference, the torch ops of `plan_reference`; device work only, fixed shapes, nothing
read back, so the whole decode step stays one CUDA graph):
1. lookup `s = rev[rows]`; a row is a *hit* when `s >= 0`;
2. first occurrence of each row (a selection may repeat a row: masked entries all point at position
   0): only the first of a missing row is inserted; every missing entry is read from the host (that is
   what moves, and what is counted);
3. the policy's key of every hit slot is updated and the hit slots are protected for this step;
4. victims: with m = min(new misses, unprotected slots) of a request, its m slots lowest in
   (key, slot index) order (a stable sort; protected slots have key +inf); listed in slot order, the
   i-th of them takes the request's i-th new miss in selection order. When the misses outnumber the
   free and evictable slots (capacity < budget), the rest are loaded but not kept;
5. the victims' old rows leave the reverse index, the new rows enter it;
6. counters from the masks: hits, misses (rows read from host), inserts, evictions, bytes = misses x
   row bytes. `LoadResult.h2d_bytes` is this layer's 0-d counter on the device.

Policies (`policy`): `lru` key = step of last use; `lfu` key = uses x 2^32 + step of last use (ties to
the least recent); `lrfu` (Lee et al.'s LRFU, between the two) key = sum over past uses of
`LRFU_DECAY ** age`, i.e. every step multiplies all keys by the decay and a use adds 1. Empty slots
have key -1 and fill first.

Moving the bytes, two paths (`fused`):
- split (default): `hot_gather.gather_hot_rows` fills the staging rows, hits from the slots and misses
  from mapped pinned host memory, and writes each inserted miss into its victim slot on the way; the
  engine's attention then runs over the staging as for every other strategy;
- fused: `load` only plans (and counts); the attention itself is this strategy's `attend`
  (`fused_attention.hot_sparse_attention`): one kernel reads hits from the slots and misses from the
  host, writes the inserted misses into their slots, and attends. The engine calls a strategy's
  `attend` instead of its own attention when the strategy sets `attends` (the one hook this needs in
  `engine._DecodeIO.attend`); nothing lands in the staging buffer then.

Deferred bookkeeping (`defer`, on by default): what a step must *read* depends only on the reverse
index (`s = rev[rows]`), not on which slots the misses will take. So the read goes first, looking the
rows up itself (`hot_gather.gather_hot_rows(..., rev=)`, or the fused kernel with `rev=`, which also drops each
miss into its staging row), and the bookkeeping (`plan`: victims, keys, counters) and the inserts
(staging rows -> victim slots, `insert_rows`: only the kept rows move) follow on a side stream,
overlapping the layers after this one: they no longer sit between the indexer and the attention. The
next layer's read waits for that work (it reuses the staging buffer) and `end_step` joins it, so the
step is still one graph and the next step sees the index updated. Same slots, bytes and counters as
the in-line order (tests check both); on CPU the same order runs in line. On the H200 at 1M tokens
this took hot_cache from 0.88 to 0.96 x resident on real traces (README, "Hot cache decode speed").

`store` writes a decode step's new rows to the host pool as every strategy does, and refreshes the
cached copy of a row that is in a slot (so a cached row can never be stale).
"""
from __future__ import annotations


from ... import envs, lazy
from .base import LoadResult, Setting, TransferStrategy, register

POLICIES = ("lru", "lfu", "lrfu")
LRFU_DECAY = 0.8
MAX_KERNEL_ROWS = 16384     # budget and capacity the one-program-per-request plan kernel holds in registers
COUNTERS = ("hits", "misses", "inserts", "evictions", "h2d_bytes")
_LFU_UNIT = float(2 ** 32)
_INF = float("inf")

torch = lazy.module("torch")
gather = lazy.module("labkit.engine.model.gather")
hot_gather = lazy.module("labkit.engine.transfer.hot_gather")


def check_settings(capacity, policy) -> None:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
        raise ValueError(f"hot_cache: capacity must be a whole number of rows > 0, got {capacity!r}")
    if policy not in POLICIES:
        raise ValueError(f"hot_cache: unknown policy {policy!r}: choose from {', '.join(POLICIES)}")


# LABKIT_HOT_PLAN / the decode parameter hot_plan: "kernel" (one Triton kernel on CUDA) or "torch" (its reference)
PLAN = envs.owner_value("LABKIT_HOT_PLAN")

class HotIndex:
    """Where rows are in the slots, and which slot a new row takes: the bookkeeping of a hot cache,
    no bytes. Device-independent (the trace replay runs it on CPU to get hit rates)."""

    def __init__(self, layers: int, batch: int, capacity: int, n_rows: int, policy: str = "lru",
                 device: torch.device | str = "cpu", decay: float = LRFU_DECAY):
        check_settings(capacity, policy)
        self.layers, self.batch, self.capacity, self.n_rows, self.policy = layers, batch, capacity, n_rows, policy
        self.decay = decay
        dev = torch.device(device)
        S = batch * capacity
        self.rev = torch.full((layers, n_rows + 1), -1, dtype=torch.int32, device=dev)
        self.slot_row = torch.full((layers, S + 1), -1, dtype=torch.int64, device=dev)
        self.key = torch.full((layers, S + 1), -1.0, dtype=torch.float64, device=dev)
        self.clock = torch.zeros(layers, dtype=torch.float64, device=dev)
        self.step = torch.zeros((layers, len(COUNTERS)), dtype=torch.int64, device=dev)
        self.total = torch.zeros(len(COUNTERS), dtype=torch.int64, device=dev)
        self._owner = torch.full((n_rows + 1,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=dev)
        self._prot = torch.zeros(S + 1, dtype=torch.bool, device=dev)
        self._first_req = torch.arange(batch, device=dev) * capacity
        self._iota_c = torch.arange(capacity + 1, device=dev)
        self._prot8 = torch.zeros(S + 1, dtype=torch.int8, device=dev)       # the kernel's scratch (hot_plan.py)
        self._list = torch.zeros(S + 1, dtype=torch.int64, device=dev)
        self._cnt_b = torch.zeros((batch, len(COUNTERS)), dtype=torch.int64, device=dev)
        # one Triton kernel on CUDA (hot_plan.py), these torch ops elsewhere (and as its reference)
        self.kernel = dev.type == "cuda" and gather.HAVE_TRITON and PLAN == "kernel"

    @property
    def slots(self) -> int:
        return self.batch * self.capacity

    def plan(self, layer: int, rows: torch.Tensor, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of one layer for the selected pool rows [B*k] (each request's k in a row).
        Returns (slot [B*k]: the slot to read from, -1 for a miss; victim [B*k]: the slot a missing
        row is written into, -1 when it is not kept). Updates the index, keys and counters."""
        if self.kernel and max(rows.numel() // self.batch, self.capacity) <= MAX_KERNEL_ROWS:
            # Triton loads with the first planned step: the strategies register without it, and the command
            # line reads their settings
            from .hot_plan import hot_plan
            return hot_plan(self, layer, rows, row_bytes)
        return self.plan_reference(layer, rows, row_bytes)

    def plan_reference(self, layer: int, rows: torch.Tensor, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`plan` in torch ops (the CPU path, and what the kernel is checked against)."""
        B, C, S = self.batch, self.capacity, self.slots
        M = rows.numel()
        k = M // B
        rev, srow, key, prot = self.rev[layer], self.slot_row[layer], self.key[layer], self._prot
        clk = self.clock[layer:layer + 1]
        clk.add_(1)
        s = rev.index_select(0, rows).to(torch.int64)                      # 1. lookup
        iota = torch.arange(M, device=rows.device)
        own = self._owner                                                  # 2. first occurrences
        own.scatter_reduce_(0, rows, iota, "amin")
        first = own.index_select(0, rows) == iota
        own.index_fill_(0, rows, torch.iinfo(torch.int64).max)
        hit = s >= 0
        new = ~hit & first
        touched = torch.where(hit & first, s, S)                           # 3. hit slots (trash: S)
        if self.policy == "lru":
            key.index_put_((touched,), clk)
        elif self.policy == "lfu":
            kt = key.index_select(0, touched)
            key.index_put_((touched,), (torch.floor(kt / _LFU_UNIT) + 1) * _LFU_UNIT + clk)
        else:
            key.mul_(self.decay)
            key.index_put_((touched,), key.index_select(0, touched) + 1)
        prot.zero_()
        prot.index_fill_(0, touched, True)
        pri = key.masked_fill(prot, _INF)[:S].view(B, C)                   # 4. victims
        newb = new.view(B, k)
        m = torch.minimum(newb.sum(1), (pri < _INF).sum(1))                 # [B] slots to (re)fill
        order = torch.sort(pri, dim=1, stable=True).indices                 # by (key, slot index)
        chosen = torch.zeros((B, C), dtype=torch.bool, device=rows.device)
        chosen.scatter_(1, order, self._iota_c[None, :C] < m[:, None])     # the m lowest, in slot order
        at = torch.where(chosen, torch.cumsum(chosen.to(torch.int64), 1) - 1, C)
        listed = torch.full((B, C + 1), C, dtype=torch.int64, device=rows.device)
        listed.scatter_(1, at, self._iota_c[None, :C].expand(B, C))        # r-th chosen slot, slot order
        rank = torch.cumsum(newb.to(torch.int64), 1) - 1                   # i-th new miss of its request
        ok = newb & (rank < m[:, None])
        vloc = torch.gather(listed, 1, rank.clamp(0, C))
        victim = torch.where(ok, vloc + self._first_req[:, None], -1).view(M)
        vt = torch.where(victim >= 0, victim, S)                           # 5. evict, insert
        old = srow.index_select(0, vt)
        oc = old.clamp_min(0)
        evict = (victim >= 0) & (old >= 0) & (rev.index_select(0, oc).to(torch.int64) == victim)
        rev.index_fill_(0, torch.where(evict, oc, self.n_rows), -1)
        rev.index_put_((torch.where(victim >= 0, rows, self.n_rows),), victim.to(torch.int32))
        srow.index_put_((vt,), rows)
        if self.policy == "lru":
            ins = clk.expand(M)
        elif self.policy == "lfu":
            ins = clk.expand(M) + _LFU_UNIT
        else:
            ins = torch.ones(M, dtype=key.dtype, device=key.device)
        key.index_put_((vt,), ins)
        miss = (~hit).sum()                                                # 6. counters
        st = torch.stack([hit.sum(), miss, ok.sum(), evict.sum(), miss * row_bytes])
        self.step[layer].copy_(st)
        self.total.add_(st)
        return s, victim

    def counters(self) -> dict[str, int]:
        """Totals since allocation (reads the device: call outside timed regions)."""
        return dict(zip(COUNTERS, (int(x) for x in self.total.tolist())))

    def resident_rows(self, layer: int, request: int) -> set[int]:
        """The pool rows request `request` holds in `layer`'s slots (tests, inspection)."""
        C = self.capacity
        r = self.slot_row[layer, request * C:(request + 1) * C]
        return set(int(x) for x in r[r >= 0].tolist())


@register
class HotCache(TransferStrategy):
    """Device slots per request and layer; a step moves only the rows not in them (module docstring)."""
    name, medium, graphable, counts, mirrors = "hot_cache", "host", True, True, True
    mirrors_until_bind = True        # `bind` allocates empty slots and reverse index
    counter_prefix = "hot_"
    summary = "FlashOffloading: device slots per request, a reverse index finds rows already there; only misses cross"
    SETTINGS = (Setting("hot_capacity", "int", 4096, "device slots per request and QSA layer (rows)", "capacity"),
                Setting("hot_policy", "str", "lru", "eviction policy (lru, lfu, lrfu)", "policy"),
                Setting("hot_fused", "bool", False, "fused miss-load attention kernel instead of gather + attention",
                        "fused"),
                Setting("hot_defer", "bool", True,
                        "victims and inserts after the read, on a side stream (false: before it)", "defer"))

    def __init__(self, capacity: int = 4096, policy: str = "lru", fused: bool = False,
                 rows_per_prog: int = 4, num_warps: int = 4, defer: bool = True):
        check_settings(capacity, policy)
        self.capacity, self.policy, self.fused, self.defer = capacity, policy, bool(fused), bool(defer)
        self._side: torch.cuda.Stream | None = None      # where deferred bookkeeping runs (CUDA)
        self._pending = False                            # side-stream work not yet joined
        self.rows_per_prog, self.num_warps = rows_per_prog, num_warps
        self.index: HotIndex | None = None
        self.data: torch.Tensor | None = None
        self._plan: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def attends(self) -> bool:
        return self.fused

    @staticmethod
    def device_bytes(layers: int, batch: int, capacity: int, n_rows: int, row_bytes: int) -> int:
        """Device memory `bind` allocates: slots, reverse index, slot table, keys, scratch."""
        S = batch * capacity + 1
        return layers * (S * (row_bytes + 8 + 8) + (n_rows + 1) * 4) + (n_rows + 1) * 8 + S

    def bind(self, cache, batch: int, k: int) -> None:
        pool = cache.pool
        dev = cache.lens.device
        L, R, W = pool.attn_layers, pool.data.shape[1], pool.row_bytes // 8
        need = self.device_bytes(L, batch, self.capacity, R, pool.row_bytes)
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            if need > free:
                raise MemoryError(f"hot_cache: {self.capacity} rows x {batch} requests x {L} layers need "
                                  f"{need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB free")
        self.index = HotIndex(L, batch, self.capacity, R, self.policy, dev)
        self.data = torch.zeros((L, batch * self.capacity + 1, W), dtype=torch.int64, device=dev)
        self.row_bytes = pool.row_bytes
        self._plan.clear()
        self._side = torch.cuda.Stream(device=dev) if self.defer and dev.type == "cuda" else None
        self._pending = False

    def load(self, pool, layer, rows, out):
        if self.index is None:
            raise RuntimeError("hot_cache: load before bind")
        if self.defer:
            if self.fused:   # the read happens in `attend`, the bookkeeping after it
                self._plan[layer] = (rows, out)
            else:
                self._join()                 # the previous layer's inserts have read the staging rows
                hot_gather.gather_hot_rows(pool.data[layer], rows, self.data[layer], None, None, out,
                                rows_per_prog=self.rows_per_prog, num_warps=self.num_warps, rev=self.index.rev[layer])
                self._bookkeep(layer, rows, out)
            return LoadResult(rows.numel(), self.index.step[layer, 4])
        s, victim = self.index.plan(layer, rows, pool.row_bytes)
        if self.fused:       # the bytes move inside `attend`, in the attention kernel
            self._plan[layer] = (rows, s, victim)
        else:
            hot_gather.gather_hot_rows(pool.data[layer], rows, self.data[layer], s, victim, out,
                            rows_per_prog=self.rows_per_prog, num_warps=self.num_warps)
        return LoadResult(rows.numel(), self.index.step[layer, 4])

    def attend(self, pool, layer, q, valid, n_kv):
        from .hot_attention import hot_sparse_attention     # Triton, as for `plan`
        if self.defer:
            rows, stage = self._plan.pop(layer)
            self._join()
            att = hot_sparse_attention(q, pool.data[layer], self.data[layer], rows, None, None, valid, n_kv,
                                       rev=self.index.rev[layer], stage=stage)
            self._bookkeep(layer, rows, stage)
            return att
        rows, s, victim = self._plan.pop(layer)
        return hot_sparse_attention(q, pool.data[layer], self.data[layer], rows, s, victim, valid, n_kv)

    def _bookkeep(self, layer: int, rows: torch.Tensor, staged: torch.Tensor) -> None:
        """The deferred half of a step: choose victims (`plan`), then copy the kept misses from their
        staging rows into the victim slots. On the side stream when there is one."""
        if self._side is None:
            self._insert(layer, rows, staged)
            return
        self._side.wait_stream(torch.cuda.current_stream(self._side.device))
        with torch.cuda.stream(self._side):
            self._insert(layer, rows, staged)
        self._pending = True

    def _insert(self, layer, rows, staged):
        _, victim = self.index.plan(layer, rows, self.row_bytes)
        hot_gather.insert_rows(staged, victim, self.data[layer])

    def _join(self) -> None:
        if self._pending:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._pending = False

    def end_step(self) -> None:
        self._join()

    def store(self, pool, layer, rows, values):
        if self.index is None:
            gather.scatter_rows(values, rows, pool.data[layer])
        else:                            # and refresh a cached copy, in the same kernel
            gather.scatter_rows(values, rows, pool.data[layer], rev=self.index.rev[layer], slots=self.data[layer])

    def counters(self) -> dict[str, int]:
        return self.index.counters() if self.index is not None else {}
