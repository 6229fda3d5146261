"""W4A16 products at decode on the tensor cores: a few rows (a step's requests) against a 4-bit weight streamed
once, each weight value made bf16 by bit operations and multiplied by the matrix units, so the unpacking costs
about one instruction for two values and the rows cost nothing more (the FMA form, `grouped_gemv._w4_rows_kernel`,
spends about fourteen instructions a weight byte and its time grows with the rows).

    out = w4_decode(x, q, scales, zeros, plan, N, K, glu=False, gather=True)    # [R, N], plan: grouped_gemv.Groups

Where it runs: the engine takes it for dense products of 2-16 rows (`grouped_gemv.W4_KERNEL = "auto"`), where it
beats the FMA kernel (on an H100 a step's dense products at four rows 2.72 against 3.63 ms); at one row it is
slower (2.69 against 1.78 ms): Triton gives the unpacked tile a register layout of its own, and making it the
matrix product's operand is a store to shared memory and an `ldmatrix` a group, two barriers included, where
Marlin shuffles the weights once, offline, so that the unpacked values land in the fragments
(docs/reference-model.md has the runs).

How (one program: group g's rows, BN outputs, a range of K):
- The weight is read as it is held (`quant.QuantWeight`: each output's K values packed two a byte, low nibble
  first), 32-bit words of eight nibbles, one 128-value group (16 words a row) a tile, the next tile loaded while
  one multiplies.
- A word becomes eight bf16 values 128 + nibble by `lop3` with the exponent of 128 (one instruction per two
  values, `_nibbles`), and one packed bf16 fma a pair takes off 128 + zero (nibble - zero, exact). Nibble j of
  word i is K value 8i + j: the eight [BN, 16] results are joined into one [BN, 128] operand (each thread's values
  get a new axis, nothing moves) and x is loaded in the same order (`_x_tile`), so a group is one tensor-core
  product with the rows padded to 16, fp32 sums; the scale applies once a group and row to that sum.
- K is cut into splits until the launch has about `W4_PROGRAMS_PER_SM` programs a multiprocessor; the last
  split of a block to arrive adds the fp32 partial sums in split order (the same bits at every launch) and
  applies the SwiGLU where the weight is [gate | up] (`_sum_splits`, the FMA kernel's end too).
- Programmatic dependent launch (sm_90): a dense product's first weight tile is loaded before the wait on the
  kernel before (its plan is fixed: `Groups.one`), so a chain of products overlaps each one's start with the
  last one's end; a routed product's plan is the kernel before's output, so it waits first.

Under the interpreter (CPU tests) the nibbles are unpacked by shifts and masks instead of `lop3`: the same
values, so the tests check the same arithmetic the GPU runs.
"""
from __future__ import annotations

import torch

from ... import envs
from ...shapes import W4_GROUP
from . import arch
from .arch import HAVE_TRITON, interpret_mode

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .norm_rows import bf16_round

    # nibbles (0, 4), (1, 5), (2, 6), (3, 7) of the word as two bf16 each, less the group's zero: lop3
    # (a & 0x000f000f) | 0x43004300 puts a nibble under the exponent of 128 in each half (bf16 128 + nibble, exact),
    # three shifts bring the other pairs down, and one fma.rn.bf16x2 (x * 1 - (128 + zero), sm_80's packed form of a
    # subtraction) leaves nibble - zero, exact in bf16
    _LOP3 = tl.constexpr("""{
    .reg .b32 t0, t1, t2, t3, s, one;
    mov.b32 one, 0x3f803f80;
    lop3.b32 t0, $8, 0x000f000f, 0x43004300, 0xea;
    shr.u32 s, $8, 4;
    lop3.b32 t1, s, 0x000f000f, 0x43004300, 0xea;
    shr.u32 s, $8, 8;
    lop3.b32 t2, s, 0x000f000f, 0x43004300, 0xea;
    shr.u32 s, $8, 12;
    lop3.b32 t3, s, 0x000f000f, 0x43004300, 0xea;
    fma.rn.bf16x2 t0, t0, one, $9;
    fma.rn.bf16x2 t1, t1, one, $9;
    fma.rn.bf16x2 t2, t2, one, $9;
    fma.rn.bf16x2 t3, t3, one, $9;
    mov.b32 {$0, $1}, t0;
    mov.b32 {$2, $3}, t1;
    mov.b32 {$4, $5}, t2;
    mov.b32 {$6, $7}, t3;
    }""")

    @triton.jit
    def _nib_ref(w, z, J: tl.constexpr):
        """Nibble J of each word less the zero, as bf16 (exact): the interpreter's form of `_LOP3`."""
        return (((w >> (4 * J)) & 0xF).to(tl.float32) - z).to(tl.bfloat16)

    @triton.jit
    def _nibbles(w, z, ASM: tl.constexpr):
        """The eight nibbles of each word of w [BN, 16] less its row's zero z [BN] (uint8), as bf16, in the order of
        K positions 0, 4, 1, 5, 2, 6, 3, 7."""
        if ASM:
            # -(128 + zero) as two bf16: its bits, an integer below 2^8 times the exponent's unit, in both halves
            nz = (-(z.to(tl.float32) + 128.0)).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            nz2 = (nz | (nz << 16))[:, None] + tl.zeros_like(w)
            a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                _LOP3, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, nz2], dtype=(tl.int16,) * 8, is_pure=True, pack=1)
            return (a0.to(tl.bfloat16, bitcast=True), a1.to(tl.bfloat16, bitcast=True),
                    a2.to(tl.bfloat16, bitcast=True), a3.to(tl.bfloat16, bitcast=True),
                    a4.to(tl.bfloat16, bitcast=True), a5.to(tl.bfloat16, bitcast=True),
                    a6.to(tl.bfloat16, bitcast=True), a7.to(tl.bfloat16, bitcast=True))
        else:
            zf = z.to(tl.float32)[:, None]
            return (_nib_ref(w, zf, 0), _nib_ref(w, zf, 4), _nib_ref(w, zf, 1), _nib_ref(w, zf, 5),
                    _nib_ref(w, zf, 2), _nib_ref(w, zf, 6), _nib_ref(w, zf, 3), _nib_ref(w, zf, 7))

    @triton.jit
    def _tile(qw_ptr, s_ptr, z_ptr, e, n, nm, t, t_end, w_se, w_sn, s_se, s_sn):
        """Group t of rows n of weight e: its words [BN, 16], scales and zeros [BN]; zeros where t >= t_end (no
        read)."""
        rm = nm & ((t + n * 0) < t_end)          # (a vector: the interpreter takes no scalar mask here)
        wo = tl.arange(0, 16)
        b = tl.load(qw_ptr + e * w_se + n[:, None].to(tl.int64) * w_sn + t * 16 + wo[None, :],
                    mask=rm[:, None], other=0)
        so = e * s_se + n.to(tl.int64) * s_sn + t
        return b, tl.load(s_ptr + so, mask=rm, other=0.0), tl.load(z_ptr + so, mask=rm, other=0)

    @triton.jit
    def _dot(h, xj, acc, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
        """acc += h [BN, 128] . xj [128, MP] (SWAP: acc^T [MP, BN] += xj^T . h^T, the rows the product's M side)."""
        if DOT_F32:      # the interpreter's bf16 dot is not exact; the same (exact) values as fp32
            if SWAP:
                acc = tl.dot(tl.trans(xj.to(tl.float32)), tl.trans(h.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(h.to(tl.float32), xj.to(tl.float32), acc, input_precision="ieee")
        else:
            if SWAP:
                acc = tl.dot(tl.trans(xj), tl.trans(h), acc)
            else:
                acc = tl.dot(h, xj, acc)
        return acc

    @triton.jit
    def _x_tile(x_ptr, rows, mm, x_st, t, t_end):
        """x of group t for the plan's rows, [128, MP], in the joined operand's K order (`_group`); zeros past
        t_end."""
        # p = 8 i + 4 a + 2 b + c holds operand a + 2 b + 4 c of word i, whose nibble is K offset 8 i + b + 2 c + 4 a
        p = tl.arange(0, 128)
        koff = (p >> 3) * 8 + ((p >> 1) & 1) + 2 * (p & 1) + 4 * ((p >> 2) & 1)
        live = (t + p * 0) < t_end
        return tl.load(x_ptr + rows[None, :] * x_st + t * 128 + koff[:, None], mask=mm[None, :] & live[:, None],
                       other=0.0)

    @triton.jit
    def _group(acc, b, sc, z, xt, ASM: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
        """acc += scale * sum over one group of (nibble - zero) * x, for the tile's rows and the group's MP rows
        (xt: `_x_tile`). The eight unpacked operands are joined into one [BN, 128] (no data moves: each thread's
        values get a new axis) in the order `_x_tile` loads x, so the group is one product."""
        h0, h1, h2, h3, h4, h5, h6, h7 = _nibbles(b, z, ASM)
        hw = tl.join(tl.join(tl.join(h0, h1), tl.join(h2, h3)), tl.join(tl.join(h4, h5), tl.join(h6, h7)))
        h = tl.reshape(hw, [hw.shape[0], 128])
        part = tl.zeros(acc.shape, dtype=tl.float32)
        part = _dot(h, xt, part, SWAP, DOT_F32)
        scf = sc.to(tl.float32)
        if SWAP:
            acc += scf[None, :] * part
        else:
            acc += scf[:, None] * part
        return acc

    @triton.jit
    def _block(wid_ptr, seg_ptr, g, N, tiles, BN: tl.constexpr, R=0, ONE: tl.constexpr = False):
        """A grouped launch's program (g, j, sp): group g's weight e and rows [s0, s1), its outputs n = [j BN,
        (j + 1) BN) with their mask, and its first K tile sp * tiles (the grouped kernels' common start). ONE: the
        plan is `Groups.one` (weight 0, rows [0, R)), known without reading it: a plan read is a round trip to
        memory before the program's first weight load can be addressed, at every program's start."""
        if ONE:
            e = g.to(tl.int64) * 0
            s0 = g * 0
            s1 = s0 + R
        else:
            e = tl.load(wid_ptr + g).to(tl.int64)
            s0 = tl.load(seg_ptr + g)
            s1 = tl.load(seg_ptr + g + 1)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        return e, s0, s1, n, n < N, tl.program_id(2) * tiles

    @triton.jit
    def _live(ngrp_ptr, g, ONE: tl.constexpr):
        """Whether program row g has a group: the plan's count read, or (ONE) the one group."""
        if ONE:
            return g == 0
        else:
            return g < tl.load(ngrp_ptr)

    @triton.jit
    def _w4_dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr, wid_ptr, tok_ptr, seg_ptr, ngrp_ptr,
                       N, K, tiles, x_st, out_st, part_ss, part_sr, w_se, w_sn, s_se, s_sn, MP: tl.constexpr,
                       BN: tl.constexpr, PARTIAL: tl.constexpr, GLU: tl.constexpr, GATHER: tl.constexpr,
                       ASM: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr, GDC: tl.constexpr,
                       EARLY: tl.constexpr, R=0, ONE: tl.constexpr = False):
        """Program (g, j, sp): group g's rows MP at a time (a decode step's groups fit one block), outputs
        [j BN, (j + 1) BN), groups of 128 K values [sp tiles, (sp + 1) tiles). EARLY (with GDC): the plan is
        fixed, so the first tile is read before the wait on the kernel before; else the wait comes first (the plan
        may be its output)."""
        if GDC and not EARLY:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        g = tl.program_id(0)
        if _live(ngrp_ptr, g, ONE):
            e, s0, s1, n, nm, t0 = _block(wid_ptr, seg_ptr, g, N, tiles, BN, R, ONE)
            t_end = tl.minimum(t0 + tiles, K // 128)
            b0, sc0, z0 = _tile(qw_ptr, s_ptr, z_ptr, e, n, nm, t0, t_end, w_se, w_sn, s_se, s_sn)
            bu0, scu0, zu0 = b0, sc0, z0
            if GLU:
                bu0, scu0, zu0 = _tile(qw_ptr, s_ptr, z_ptr, e, n + N, nm, t0, t_end, w_se, w_sn, s_se, s_sn)
            if GDC and EARLY:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            for m0 in range(s0, s1, MP):
                m = m0 + tl.arange(0, MP)
                mm = m < s1
                if GATHER and not ONE:           # Groups.one's rows are 0..R-1
                    rows = tl.load(tok_ptr + m, mask=mm, other=0).to(tl.int64)
                else:
                    rows = m.to(tl.int64)
                if SWAP:
                    acc = tl.zeros([MP, BN], dtype=tl.float32)
                else:
                    acc = tl.zeros([BN, MP], dtype=tl.float32)
                acc_u = tl.zeros_like(acc)
                b, sc, z = b0, sc0, z0
                bu, scu, zu = bu0, scu0, zu0
                xt = _x_tile(x_ptr, rows, mm, x_st, t0, t_end)
                for t in range(t0, t_end):     # the next tile and its x in flight while this one multiplies
                    b1, sc1, z1 = _tile(qw_ptr, s_ptr, z_ptr, e, n, nm, t + 1, t_end, w_se, w_sn, s_se, s_sn)
                    if GLU:
                        bu1, scu1, zu1 = _tile(qw_ptr, s_ptr, z_ptr, e, n + N, nm, t + 1, t_end, w_se, w_sn, s_se,
                                               s_sn)
                    xt1 = _x_tile(x_ptr, rows, mm, x_st, t + 1, t_end)
                    acc = _group(acc, b, sc, z, xt, ASM, SWAP, DOT_F32)
                    if GLU:
                        acc_u = _group(acc_u, bu, scu, zu, xt, ASM, SWAP, DOT_F32)
                        bu, scu, zu = bu1, scu1, zu1
                    b, sc, z, xt = b1, sc1, z1, xt1
                om, mo, no = _places(m, mm, n, nm, SWAP)
                if PARTIAL:
                    tl.store(part_ptr + tl.program_id(2) * part_ss + mo * part_sr + no, acc, mask=om)
                    if GLU:
                        tl.store(part_ptr + tl.program_id(2) * part_ss + mo * part_sr + no + N, acc_u, mask=om)
                else:
                    if GLU:
                        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
                    tl.store(out_ptr + mo * out_st + no, acc.to(out_ptr.dtype.element_ty), mask=om)
            if PARTIAL:
                _sum_splits(part_ptr, out_ptr, cnt_ptr, g * tl.num_programs(1) + tl.program_id(1), s0, s1, n, nm, N,
                            out_st, part_ss, part_sr, MP, BN, GLU)

    @triton.jit
    def _sum_splits(part_ptr, out_ptr, cnt_ptr, slot, s0, s1, n, nm, N, out_st, part_ss, part_sr, MP: tl.constexpr,
                    BN: tl.constexpr, GLU: tl.constexpr):
        """After a program has stored its fp32 partial sums of rows [s0, s1) and outputs n (`part[sp]`, the up
        half N columns on with GLU): it bumps its (group, block)'s arrival counter `cnt[slot]`, and the last of the
        block's splits to arrive adds every split's partials in split order (the same bits whoever arrives last),
        applies silu(gate) * up with GLU, writes the rows and zeroes the counter for the next product (graph replays
        too). No second kernel: at decode a launch's gap is as long as a small product. The W4A16 decode kernels'
        common end (this one's and `grouped_gemv._w4_rows_kernel`)."""
        tl.debug_barrier()                       # every thread's partials stored before the release
        if tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu") == tl.num_programs(2) - 1:
            for m0 in range(s0, s1, MP):
                m = m0 + tl.arange(0, MP)
                om = (m < s1)[:, None] & nm[None, :]
                at = m[:, None].to(tl.int64) * part_sr + n[None, :]
                tot = tl.zeros([MP, BN], dtype=tl.float32)
                tot_u = tl.zeros([MP, BN], dtype=tl.float32)
                for sp in range(0, tl.num_programs(2)):
                    tot += tl.load(part_ptr + sp * part_ss + at, mask=om, other=0.0, cache_modifier=".cg")
                    if GLU:
                        tot_u += tl.load(part_ptr + sp * part_ss + at + N, mask=om, other=0.0, cache_modifier=".cg")
                if GLU:
                    tot = tot / (1.0 + tl.exp(-tot)) * tot_u
                tl.store(out_ptr + m[:, None].to(tl.int64) * out_st + n[None, :], tot.to(out_ptr.dtype.element_ty),
                         mask=om)
            tl.atomic_xchg(cnt_ptr + slot, 0)

    @triton.jit
    def _combine_tail(part_ptr, out_ptr, cnt_ptr, back_ptr, p_ptr, gl_ptr, gl_st, T, R, n, nm, out_st, part_ss,
                      part_sr, TOPK: tl.constexpr, KP1: tl.constexpr, TB: tl.constexpr, BN: tl.constexpr):
        """A decode step's experts' down product, after a program has stored its fp32 partials (`part[sp]`, rows in
        the plan's order: a token's pairs where `back` puts them, the shared expert's rows R + t): every program of
        the launch bumps output block j's counter `cnt[j]` (programs of groups past the count too, so the count is
        the grid's), and the last to arrive writes the block's outputs of every token: each pair's row (its
        splits added in split order, rounded to bf16 as its own product would be) times the router's weight, plus
        the shared expert's row times sigmoid of its gate logit, summed in fp32 and rounded once. The same bits
        whoever arrives last; the counter zeroed for the next launch (graph replays too). What was a third
        kernel a layer (the weighted sum) and two launches of the shared expert's own."""
        tl.debug_barrier()                       # every thread's partials stored before the release
        slot = tl.program_id(1)
        if tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu") == \
                tl.num_programs(0) * tl.num_programs(2) - 1:
            jj = tl.arange(0, KP1)
            routed = jj[None, :] < TOPK                                         # [1, KP1]; column TOPK: shared
            for t0 in range(0, T, TB):
                t = t0 + tl.arange(0, TB)
                tm = t < T
                pair = t[:, None] * TOPK + jj[None, :]                          # [TB, KP1]
                live = tm[:, None] & (jj[None, :] <= TOPK)
                rows = tl.load(back_ptr + pair, mask=tm[:, None] & routed, other=0)
                rows = tl.where(routed, rows, R + t[:, None])
                at = rows.to(tl.int64)[:, :, None] * part_sr + n[None, None, :]
                msk = live[:, :, None] & nm[None, None, :]
                tot = tl.zeros([TB, KP1, BN], dtype=tl.float32)
                for sp in range(0, tl.num_programs(2)):
                    tot += tl.load(part_ptr + sp * part_ss + at, mask=msk, other=0.0, cache_modifier=".cg")
                tot = bf16_round(tot)
                wgt = tl.load(p_ptr + pair, mask=tm[:, None] & routed, other=0.0)
                gate = tl.load(gl_ptr + t * gl_st, mask=tm, other=0.0).to(tl.float32)
                wgt = tl.where(routed, wgt, (1.0 / (1.0 + tl.exp(-gate)))[:, None])
                y = tl.sum(tot * tl.where(live, wgt, 0.0)[:, :, None], axis=1)        # [TB, BN]
                tl.store(out_ptr + t[:, None].to(tl.int64) * out_st + n[None, :], y.to(out_ptr.dtype.element_ty),
                         mask=tm[:, None] & nm[None, :])
            tl.atomic_xchg(cnt_ptr + slot, 0)

    @triton.jit
    def _places(m, mm, n, nm, SWAP: tl.constexpr):
        """The accumulator's mask and (row, column) offsets: [MP, BN] swapped, else [BN, MP]."""
        if SWAP:
            om, mo, no = mm[:, None] & nm[None, :], m[:, None].to(tl.int64), n[None, :]
        else:
            om, mo, no = nm[:, None] & mm[None, :], m[None, :].to(tl.int64), n[:, None]
        return om, mo, no


# the rows a program takes at once: a tensor-core product's narrow side (decode: a group holds at most the step's
# requests)
W4_MP = 16
W4_BN = 64                      # outputs a program
W4_PROGRAMS_PER_SM = 4          # K split until the launch has about this many programs a multiprocessor
W4_WARPS = 4
W4_SWAP = False                 # True: the rows as the product's M side (mma.sync on every architecture); False:
                                # the weight tile is (Hopper's warpgroup MMA), faster on an H100 at 1 and 4 rows
W4_PDL = True                   # programmatic dependent launch where the GPU has it (`arch.native("pdl")`)
W4_ASM = True                   # lop3 unpacking (False: shifts and masks, the interpreter's form, for an A/B)
# Groups.one's plan taken as known (`_block`'s ONE), not read at each program's start (the switch `w4_one`, on: the
# dense products at four requests 2.76 -> 2.62 ms on an H100, at one within the noise; the weight bench's `one`)
W4_ONE = envs.owner_value("LABKIT_W4_ONE")
W4_MAXNREG = None               # registers a thread ptxas may use (None: its choice, 199 on sm_90: 2 programs an SM)


def pdl_ok(device: torch.device) -> bool:
    return W4_PDL and not interpret_mode() and arch.native("pdl", device)


def w4_decode(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, plan, N: int, K: int,
              glu: bool = False, gather: bool = True, block_n: int | None = None, split: int | None = None,
              programs_per_sm: int | None = None) -> torch.Tensor:
    """[R, N] = each plan row of x through its group's W4A16 weight (`grouped_gemv.grouped_gemv`'s definition);
    a group of more than W4_MP rows streams its weight once per W4_MP of them (decode: one block). `q` [E, N', K/2] uint8, `scales`/`zeros` [E, N', K/128]; N' = 2N with `glu`."""
    R = plan.tok.shape[0]
    BN = block_n or W4_BN
    n_blocks = triton.cdiv(N, BN)
    G = min(plan.wid.shape[0], q.shape[0])       # group slots, never more than the stack's weights (`group_slots`)
    k_tiles = K // W4_GROUP
    if split is None:
        per_sm = W4_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
        split = -(-per_sm * arch.multiprocessors(x.device) // max(G * n_blocks, 1))
    if G * n_blocks > arch.COUNTER_SLOTS:
        split = 1
    split = max(1, min(split, k_tiles))
    tiles = -(-k_tiles // split)
    splits = -(-k_tiles // tiles)
    out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, R, 2 * N if glu else N), dtype=torch.float32, device=x.device) if splits > 1 else out
    qw = q.view(torch.int32)                       # [E, N', K/8]: eight nibbles a word
    gdc = pdl_ok(x.device)
    dense = plan.fixed                             # Groups.one: a fixed plan, readable before the wait
    x = x.contiguous()
    _w4_dot_kernel[(G, n_blocks, splits)](
        x, qw, scales, zeros, out, part, arch.arrival_counters(x.device), plan.wid, plan.tok, plan.seg, plan.n_groups,
        N, K, tiles, x.stride(0), out.stride(0), part.stride(0) if splits > 1 else 0,
        part.stride(1) if splits > 1 else 0, qw.stride(0), qw.stride(1), scales.stride(0), scales.stride(1),
        MP=W4_MP, BN=BN, PARTIAL=splits > 1, GLU=glu, GATHER=gather, ASM=W4_ASM and not interpret_mode(),
        SWAP=W4_SWAP, DOT_F32=interpret_mode(), GDC=gdc, EARLY=gdc and dense, R=R, ONE=dense and W4_ONE,
        num_warps=W4_WARPS,
        **({"launch_pdl": True} if gdc else {}), **({"maxnreg": W4_MAXNREG} if W4_MAXNREG else {}))
    return out
