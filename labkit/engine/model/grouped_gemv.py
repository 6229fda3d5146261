"""One kernel for the products whose weight a batch reads once however many of its tokens need it: the routed
experts (each distinct expert a step's tokens chose, its weight streamed once for all of them) and the W4A16
dense products (one group: every token, one weight).

    plan = Groups(...)                                   # which weight each group of rows takes (`routing.plan`)
    out  = grouped_gemv(x, w, plan, glu=True)            # [rows, N]: row r of the plan's order through its weight

`w` is a stack of K-major weights, bf16 `[E, N', K]` or W4A16 (`quant.QuantWeight`: packed `[E, N', K/2]`,
scales and zeros `[E, N', K/128]`); N' = 2N for a SwiGLU's gate and up (`glu`: gate rows first; the output is
silu(x @ gate) * (x @ up), fp32 products, one rounding). The plan lists the groups: group g takes weight
`wid[g]` for rows `[seg[g], seg[g+1])` of the plan's order, whose inputs are `x[tok[r]]` (`gather=True`) or
`x[r]`; `n_groups` (a device scalar) says how many groups there are, so the launch is the same at every step
(a CUDA graph) and programs past the count read nothing.

A program owns one group and `BN` outputs: it streams the weight's [BN, K] rows once in [BN, BK] tiles
(dequantised in registers for W4A16: one scale and zero a row and 128 values), and applies each tile to all
of the group's rows, `M_PAD` at a time: a broadcast sum where a group has one row (decode at one request),
tensor-core products for more. The bytes a step reads are the distinct weights, the formula
`ModelShape.step_weight_bytes` counts.

W4A16 at decode: a dense product of 2-16 rows takes the tensor-core kernel (`w4_decode`); one row a group (the
routed experts, a dense product at one request) and, with `W4_KERNEL = "rows"`, dense products of up to four rows
take `_w4_rows_kernel`, launched with programmatic dependent launch where the GPU has it (a dense product's first
tile read before the wait on the kernel before, whose output x is): the weight read as 32-bit words of eight nibbles, each nibble made a float by its bits under
an exponent (no conversion instruction) and multiplied by x, a scale and a zero applied once a group and tile;
the next tile loaded while one multiplies; K cut into splits until the launch has about four programs a
multiprocessor (`w4_split`; a 2,560-wide product is 40 output blocks, too few to keep HBM busy), the last split
of a block to arrive adding the fp32 partial sums in split order (the same result at every launch). A dense
W4A16 product of many rows (a prefill chunk) is a GEMM: the weight dequantised once (`dequantize_w4`), cuBLAS's
product.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import envs
from ...shapes import W4_GROUP
from . import arch
from .arch import HAVE_TRITON, interpret_mode, kernels_run
from . import w4_decode
from .quant import QuantWeight, dequantize

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _weight_tile(w_ptr, s_ptr, z_ptr, e, n, nm, k0, K, w_se, w_sn, s_se, s_sn, BN: tl.constexpr,
                     BK: tl.constexpr, QUANT: tl.constexpr):
        """Rows n of weight e, K values [k0, k0 + BK), as bf16 [BN, BK]; W4A16 dequantised (BK = 128: one
        group)."""
        if QUANT:
            kk = k0 // 2 + tl.arange(0, BK // 2)
            b = tl.load(w_ptr + e * w_se + n[:, None].to(tl.int64) * w_sn + kk[None, :], mask=nm[:, None], other=0)
            lo = (b & 0xF).to(tl.float32)
            hi = (b >> 4).to(tl.float32)
            v = tl.reshape(tl.join(lo, hi), [BN, BK])            # k = 2i (low nibble), 2i + 1 (high)
            g = k0 // BK
            sc = tl.load(s_ptr + e * s_se + n.to(tl.int64) * s_sn + g, mask=nm, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + e * s_se + n.to(tl.int64) * s_sn + g, mask=nm, other=0).to(tl.float32)
            return ((v - z[:, None]) * sc[:, None]).to(tl.bfloat16)
        else:
            k = k0 + tl.arange(0, BK)
            return tl.load(w_ptr + e * w_se + n[:, None].to(tl.int64) * w_sn + k[None, :],
                           mask=nm[:, None] & (k < K)[None, :], other=0.0)

    @triton.jit
    def _apply(acc, x, w, M_PAD: tl.constexpr, DOT_F32: tl.constexpr):
        """acc [M_PAD, BN] += x [M_PAD, BK] . w [BN, BK]^T."""
        if M_PAD == 1:
            return acc + tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        elif DOT_F32:
            return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            return acc + tl.dot(x, tl.trans(w))

    @triton.jit
    def _group_rows(tok_ptr, m0, s1, MP: tl.constexpr, GATHER: tl.constexpr):
        """Plan rows [m0, m0 + MP) of a group ending at s1: (their places, which are the group's, input rows)."""
        m = m0 + tl.arange(0, MP)
        mm = m < s1
        if GATHER:
            rows = tl.load(tok_ptr + m, mask=mm, other=0).to(tl.int64)
        else:
            rows = m.to(tl.int64)
        return m, mm, rows

    @triton.jit
    def _grouped_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, wid_ptr, tok_ptr, seg_ptr, ngrp_ptr, N, K,
                             x_st, out_st, w_se, w_sn, s_se, s_sn, M_PAD: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, QUANT: tl.constexpr, GLU: tl.constexpr, GATHER: tl.constexpr,
                             DOT_F32: tl.constexpr):
        g = tl.program_id(0)
        if g < tl.load(ngrp_ptr):
            e, s0, s1, n, nm, _ = w4_decode._block(wid_ptr, seg_ptr, g, N, 0, BN)
            for m0 in range(s0, s1, M_PAD):
                m, mm, rows = _group_rows(tok_ptr, m0, s1, M_PAD, GATHER)
                acc = tl.zeros([M_PAD, BN], dtype=tl.float32)
                acc_u = tl.zeros([M_PAD, BN], dtype=tl.float32)
                for k0 in range(0, K, BK):
                    k = k0 + tl.arange(0, BK)
                    x = tl.load(x_ptr + rows[:, None] * x_st + k[None, :], mask=mm[:, None] & (k < K)[None, :],
                                other=0.0)
                    w = _weight_tile(w_ptr, s_ptr, z_ptr, e, n, nm, k0, K, w_se, w_sn, s_se, s_sn, BN, BK, QUANT)
                    acc = _apply(acc, x, w, M_PAD, DOT_F32)
                    if GLU:
                        wu = _weight_tile(w_ptr, s_ptr, z_ptr, e, n + N, nm, k0, K, w_se, w_sn, s_se, s_sn, BN, BK,
                                          QUANT)
                        acc_u = _apply(acc_u, x, wu, M_PAD, DOT_F32)
                if GLU:
                    acc = acc / (1.0 + tl.exp(-acc)) * acc_u
                tl.store(out_ptr + m[:, None].to(tl.int64) * out_st + n[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=mm[:, None] & nm[None, :])


    @triton.jit
    def _w4_load(qw_ptr, s_ptr, z_ptr, e, n, nm, t, t_end, K, w_se, w_sn, s_se, s_sn, GT: tl.constexpr):
        """K tile t of the rows n of weight e: its words [BN, GT, 16] (eight nibbles a word: nibble j of word i
        is value 8i + j), scales and zeros [BN, GT]; nothing read at or past tile t_end."""
        g = t * GT + tl.arange(0, GT)
        gm = (g < K // 128) & (g < t_end * GT)
        wo = g[:, None] * 16 + tl.arange(0, 16)[None, :]
        b = tl.load(qw_ptr + e * w_se + n[:, None, None].to(tl.int64) * w_sn + wo[None, :, :],
                    mask=nm[:, None, None] & gm[None, :, None], other=0)
        so = e * s_se + n[:, None].to(tl.int64) * s_sn + g[None, :]
        sm = nm[:, None] & gm[None, :]
        return b, tl.load(s_ptr + so, mask=sm, other=0.0), tl.load(z_ptr + so, mask=sm, other=0)

    @triton.jit
    def _nib(b, SH: tl.constexpr, zq, magic):
        """(nibble - zero) for the nibble at bits [SH, SH + 4) of each word, exact and without a conversion
        instruction: under the exponent that puts the mantissa's unit at bit SH, the word's bits read as the
        float 2^(23 - SH) + nibble, and zq is 2^(23 - SH) + zero. `magic` is that exponent's bits (0x4B000000 at
        SH = 0) as a runtime value: with two immediates the mask and the OR are two instructions (ptxas takes one
        immediate a LOP3), with the exponent in a register one."""
        return ((b & (0xF << SH)) | (magic - (SH << 23))).to(tl.float32, bitcast=True) - zq

    @triton.jit
    def _w4_xtile(x_ptr, rows, x_st, t, K, MR: tl.constexpr, GT: tl.constexpr, PRE: tl.constexpr):
        """K tile t's x as four 32-bit pairs a word ([GT, 16] each at one row, else [MR, GT, 16]: pair jj of word i
        holds x[8i + 2jj] and x[8i + 2jj + 1]), loaded with the tile's weight (PRE) so its latency hides behind
        the tile before; (0, 0, 0, 0) without PRE."""
        if PRE:
            g = tl.minimum(t * GT + tl.arange(0, GT), K // 128 - 1)
            xo = g[:, None] * 64 + tl.arange(0, 16)[None, :] * 4
            if MR == 1:
                at = x_ptr + tl.sum(rows) * x_st + xo
            else:
                at = x_ptr + rows[:, None, None] * x_st + xo[None, :, :]
            return tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3)
        else:
            return 0, 0, 0, 0

    @triton.jit
    def _w4_mac(acc, b, sc, z, x_ptr, rows, x_st, t, K, magic, x0, x1, x2, x3, MR: tl.constexpr, GT: tl.constexpr,
                XP: tl.constexpr, PRE: tl.constexpr):
        """acc ([BN, GT, 16] at one row, else [MR, BN, GT, 16]) += sc * sum_j (nibble j - zero) * x[8i + j] over
        the tile's words i: the products kept apart per word and summed once at the end. Nibbles 0-4 are taken where
        they lie, 5-7 after one shift (a nibble at bit 20 or above would reach the exponent); int-to-float
        conversions run at a quarter of the FMA rate and would bound the stream below HBM's. x is read without a
        mask: a tile past K reads the last group's x again, against words, zeros and scales loaded as 0 (each
        product 0), which spares a predicate and a register clear a value. XP: x read as 32-bit pairs (x_ptr an
        int32 view, x_st in pairs), each pair made two floats by a shift and a mask: half the loads and the
        registers that hold a tile's x; PRE: those pairs given (x0-x3, `_w4_xtile`), loaded a tile ahead."""
        g = tl.minimum(t * GT + tl.arange(0, GT), K // 128 - 1)
        if XP:
            xo = g[:, None] * 64 + tl.arange(0, 16)[None, :] * 4                   # pair 4i of each word i
        else:
            xo = g[:, None] * 128 + tl.arange(0, 16)[None, :] * 8                  # x[8i] of each word i
        zf = z.to(tl.float32)[:, :, None]
        hi = b >> 20
        p = tl.zeros(acc.shape, dtype=tl.float32)
        for j in tl.static_range(8):
            if j < 5:
                f = _nib(b, 4 * j, zf + 8388608.0 / 16.0 ** j, magic)
            else:
                f = _nib(hi, 4 * (j - 5), zf + 8388608.0 / 16.0 ** (j - 5), magic)
            if XP or PRE:
                if j % 2 == 0:                      # pair j // 2: given a tile ahead, or loaded now
                    if PRE:
                        xw = x0 if j == 0 else x1 if j == 2 else x2 if j == 4 else x3
                    elif MR == 1:
                        xw = tl.load(x_ptr + tl.sum(rows) * x_st + xo + j // 2)
                    else:
                        xw = tl.load(x_ptr + rows[:, None, None] * x_st + xo[None, :, :] + j // 2)
                    xj = (xw << 16).to(tl.float32, bitcast=True)               # the pair's low bf16
                else:
                    xj = (xw & -65536).to(tl.float32, bitcast=True)            # its high bf16
            elif MR == 1:
                xj = tl.load(x_ptr + tl.sum(rows) * x_st + xo + j).to(tl.float32)
            else:
                xj = tl.load(x_ptr + rows[:, None, None] * x_st + xo[None, :, :] + j).to(tl.float32)
            if MR == 1:       # one row (always in the group): x [GT, 16] as the words' slice, where a 4-D
                # broadcast would cost layout shuffles through shared memory
                p += f * xj[None, :, :]
            else:
                p += f[None, :, :, :] * xj[:, None, :, :]
        if MR == 1:
            return acc + sc.to(tl.float32)[:, :, None] * p
        else:
            return acc + sc.to(tl.float32)[None, :, :, None] * p

    @triton.jit
    def _w4_sum(acc, MR: tl.constexpr):
        """[MR, BN] sums of an accumulator kept per word position."""
        if MR == 1:
            return tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
        else:
            return tl.sum(tl.sum(acc, axis=3), axis=2)

    @triton.jit
    def _w4_by_hand(acc, acc_u, qw_ptr, s_ptr, z_ptr, e, n, nm, t0, t_end, K, N, w_se, w_sn, s_se, s_sn, x_ptr, rows,
                    x_st, magic, MR: tl.constexpr, GT: tl.constexpr, XP: tl.constexpr, PRE: tl.constexpr,
                    GLU: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr):
        """The K loop two tiles a turn, each loaded while the other multiplies (a tile past t_end loads as 0 and
        adds 0; loop-carried tiles kept in place, where one tile a turn cost a register move a word); EARLY (with
        GDC): the first tiles read before the wait on the kernel before, whose output x is."""
        b, sc, z = _w4_load(qw_ptr, s_ptr, z_ptr, e, n, nm, t0, t_end, K, w_se, w_sn, s_se, s_sn, GT)
        bu, scu, zu = b, sc, z
        if GLU:
            bu, scu, zu = _w4_load(qw_ptr, s_ptr, z_ptr, e, n + N, nm, t0, t_end, K, w_se, w_sn, s_se, s_sn,
                                   GT)
        if GDC and EARLY:      # a fixed plan (a dense product): the first tiles read before the wait on the
            tl.extra.cuda.gdc_wait()          # kernel before, whose output x is
            tl.extra.cuda.gdc_launch_dependents()
        # x is the kernel before's output: its first tile read after the wait, never with the early weights
        xa0, xa1, xa2, xa3 = _w4_xtile(x_ptr, rows, x_st, t0, K, MR, GT, PRE)
        for t in range(t0, t_end, 2):
            b1, sc1, z1 = _w4_load(qw_ptr, s_ptr, z_ptr, e, n, nm, t + 1, t_end, K, w_se, w_sn, s_se, s_sn, GT)
            xb0, xb1, xb2, xb3 = _w4_xtile(x_ptr, rows, x_st, t + 1, K, MR, GT, PRE)
            if GLU:
                bu1, scu1, zu1 = _w4_load(qw_ptr, s_ptr, z_ptr, e, n + N, nm, t + 1, t_end, K, w_se, w_sn,
                                          s_se, s_sn, GT)
            acc = _w4_mac(acc, b, sc, z, x_ptr, rows, x_st, t, K, magic, xa0, xa1, xa2, xa3, MR, GT, XP, PRE)
            if GLU:
                acc_u = _w4_mac(acc_u, bu, scu, zu, x_ptr, rows, x_st, t, K, magic, xa0, xa1, xa2, xa3, MR,
                                 GT, XP, PRE)
            b, sc, z = _w4_load(qw_ptr, s_ptr, z_ptr, e, n, nm, t + 2, t_end, K, w_se, w_sn, s_se, s_sn, GT)
            xa0, xa1, xa2, xa3 = _w4_xtile(x_ptr, rows, x_st, t + 2, K, MR, GT, PRE)
            if GLU:
                bu, scu, zu = _w4_load(qw_ptr, s_ptr, z_ptr, e, n + N, nm, t + 2, t_end, K, w_se, w_sn, s_se,
                                       s_sn, GT)
            acc = _w4_mac(acc, b1, sc1, z1, x_ptr, rows, x_st, t + 1, K, magic, xb0, xb1, xb2, xb3, MR, GT, XP,
                          PRE)
            if GLU:
                acc_u = _w4_mac(acc_u, bu1, scu1, zu1, x_ptr, rows, x_st, t + 1, K, magic, xb0, xb1, xb2,
                                 xb3, MR, GT, XP, PRE)
        return acc, acc_u

    @triton.jit
    def _w4_pipelined(acc, acc_u, qw_ptr, s_ptr, z_ptr, e, n, nm, t0, t_end, K, N, w_se, w_sn, s_se, s_sn, x_ptr, rows,
                      x_st, magic, MR: tl.constexpr, GT: tl.constexpr, XP: tl.constexpr, PRE: tl.constexpr,
                      GLU: tl.constexpr, GDC: tl.constexpr, STAGES: tl.constexpr):
        """The K loop one tile a turn under Triton's software pipeliner, STAGES - 1 tiles in flight (its copies
        to shared memory hold them, not registers); the wait on the kernel before comes first."""
        if GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        for t in tl.range(t0, t_end, num_stages=STAGES):
            b, sc, z = _w4_load(qw_ptr, s_ptr, z_ptr, e, n, nm, t, t_end, K, w_se, w_sn, s_se, s_sn, GT)
            x0, x1, x2, x3 = _w4_xtile(x_ptr, rows, x_st, t, K, MR, GT, PRE)
            acc = _w4_mac(acc, b, sc, z, x_ptr, rows, x_st, t, K, magic, x0, x1, x2, x3, MR, GT, XP, PRE)
            if GLU:
                bu, scu, zu = _w4_load(qw_ptr, s_ptr, z_ptr, e, n + N, nm, t, t_end, K, w_se, w_sn, s_se, s_sn, GT)
                acc_u = _w4_mac(acc_u, bu, scu, zu, x_ptr, rows, x_st, t, K, magic, x0, x1, x2, x3, MR, GT, XP, PRE)
        return acc, acc_u

    @triton.jit
    def _w4_rows_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, part_ptr, cnt_ptr, wid_ptr, tok_ptr, seg_ptr, ngrp_ptr,
                        qsh_ptr, ssh_ptr, zsh_ptr, e_sh, back_ptr, p_ptr, gl_ptr, gl_st, T, R,
                        N, K, tiles, x_st, out_st, part_ss, part_sr, w_se, w_sn, s_se, s_sn, magic, MR: tl.constexpr,
                        BN: tl.constexpr, GT: tl.constexpr, PARTIAL: tl.constexpr, GLU: tl.constexpr,
                        GATHER: tl.constexpr, GDC: tl.constexpr, EARLY: tl.constexpr, SHARED: tl.constexpr,
                        COMBINE: tl.constexpr, TOPK: tl.constexpr, KP1: tl.constexpr, TB: tl.constexpr,
                        XP: tl.constexpr, PRE: tl.constexpr, ONE: tl.constexpr = False, PIPE: tl.constexpr = 0):
        """W4A16 at a few rows a group: program (g, j, sp) takes group g's rows MR at a time, outputs
        [j BN, (j + 1) BN) and the K tiles [sp tiles, (sp + 1) tiles) of GT groups. Each tile's words are loaded
        one tile ahead (`_w4_load` before the products of the one before, `_w4_mac`): a program has its next
        loads in flight while it multiplies. PARTIAL: fp32 sums to `part[sp]`; the last of a (group, block)'s
        splits to arrive adds them in split order (the same sum whoever arrives last), applies the GLU, writes the
        rows and zeroes the block's counter `cnt[g * blocks + j]` (no second kernel: at decode a launch's gap is
        as long as a small product), else the finished row. SHARED: the group whose weight id is `e_sh` takes the
        weight at `qsh`/`ssh`/`zsh` (a layer's shared expert, beside the routed stack); COMBINE (a decode step's
        experts' down product): every program stores its partials and the last of an output block to arrive
        writes each token's weighted sum (`w4_decode._combine_tail`)."""
        if GDC and not EARLY:          # programmatic dependent launch, the plan the kernel before's output
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        g = tl.program_id(0)
        if w4_decode._live(ngrp_ptr, g, ONE):
            e, s0, s1, n, nm, t0 = w4_decode._block(wid_ptr, seg_ptr, g, N, tiles, BN, R, ONE)
            if SHARED:
                if e == e_sh:                    # the shared expert: its own weight, addressed as expert 0
                    qw_ptr, s_ptr, z_ptr, e = qsh_ptr, ssh_ptr, zsh_ptr, e * 0
            for m0 in range(s0, s1, MR):          # (EARLY: one block of rows, so the wait below runs once)
                m, mm, rows = _group_rows(tok_ptr, m0, s1, MR, GATHER and not ONE)   # Groups.one: rows 0..R-1
                rows = tl.where(mm, rows, 0)     # x is read unmasked: a row past the group reads row 0
                if MR == 1:
                    acc = tl.zeros([BN, GT, 16], dtype=tl.float32)
                else:
                    acc = tl.zeros([MR, BN, GT, 16], dtype=tl.float32)
                acc_u = tl.zeros_like(acc)
                t_end = t0 + tiles
                if PIPE > 0:
                    acc, acc_u = _w4_pipelined(acc, acc_u, qw_ptr, s_ptr, z_ptr, e, n, nm, t0, t_end, K, N, w_se, w_sn,
                                               s_se, s_sn, x_ptr, rows, x_st, magic, MR, GT, XP, PRE, GLU, GDC, PIPE)
                else:
                    acc, acc_u = _w4_by_hand(acc, acc_u, qw_ptr, s_ptr, z_ptr, e, n, nm, t0, t_end, K, N, w_se, w_sn,
                                             s_se, s_sn, x_ptr, rows, x_st, magic, MR, GT, XP, PRE, GLU, GDC, EARLY)
                y = _w4_sum(acc, MR)                                                         # [MR, BN]
                om = mm[:, None] & nm[None, :]
                if PARTIAL or COMBINE:
                    at = part_ptr + tl.program_id(2) * part_ss + m[:, None].to(tl.int64) * part_sr + n[None, :]
                    tl.store(at, y, mask=om)
                    if GLU:
                        tl.store(at + N, _w4_sum(acc_u, MR), mask=om)
                else:
                    if GLU:
                        y = y / (1.0 + tl.exp(-y)) * _w4_sum(acc_u, MR)
                    tl.store(out_ptr + m[:, None].to(tl.int64) * out_st + n[None, :],
                             y.to(out_ptr.dtype.element_ty), mask=om)
            if PARTIAL and not COMBINE:
                w4_decode._sum_splits(part_ptr, out_ptr, cnt_ptr, g * tl.num_programs(1) + tl.program_id(1), s0, s1, n,
                                      nm, N, out_st, part_ss, part_sr, MR, BN, GLU)
        if COMBINE:                              # every program arrives, a group past the count too
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            w4_decode._combine_tail(part_ptr, out_ptr, cnt_ptr, back_ptr, p_ptr, gl_ptr, gl_st, T, R, n, n < N,
                                    out_st, part_ss, part_sr, TOPK, KP1, TB, BN)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, w_sn, s_sn, o_sn, BN: tl.constexpr, BK: tl.constexpr):
        """One W4A16 weight [N, K/2] as bf16 [N, K]: the values the dequantising kernel computes with."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nm = n < N
        k0 = tl.program_id(1) * BK
        w = _weight_tile(w_ptr, s_ptr, z_ptr, 0, n, nm, k0, K, 0, w_sn, 0, s_sn, BN, BK, True)
        k = k0 + tl.arange(0, BK)
        tl.store(out_ptr + n[:, None].to(tl.int64) * o_sn + k[None, :], w, mask=nm[:, None])


@dataclass
class Groups:
    """Rows grouped by the weight they take (see the module docstring). All on the device, fixed shapes."""
    tok: torch.Tensor          # [R] int64: the input row of each of the plan's rows
    wid: torch.Tensor          # [G_max] int64: weight of group g (valid for g < n_groups)
    seg: torch.Tensor          # [G_max + 1] int32: group g's rows are [seg[g], seg[g+1])
    n_groups: torch.Tensor     # [1] int32
    fixed: bool = False        # `one`'s plan: weight 0 for rows [0, R), which kernels may take without reading it

    @classmethod
    def one(cls, rows: int, device) -> "Groups":
        """Every row through weight 0 (a dense product). Kept per (rows, device) once made outside a CUDA graph's
        capture: made inside one it would be four small kernels before each dense W4A16 product of a step (at
        decode, about as long as the product itself)."""
        device = torch.device(device)
        key = (rows, device.type, device.index)
        if key in _ONE:
            return _ONE[key]
        g = cls(torch.arange(rows, device=device), torch.zeros(1, dtype=torch.int64, device=device),
                # [0, rows] made on the device: a host list would be a copy, which a CUDA graph's capture refuses
                torch.arange(2, dtype=torch.int32, device=device) * rows,
                torch.ones(1, dtype=torch.int32, device=device), fixed=True)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ONE[key] = g
        return g


_ONE: dict = {}


def operands(w):
    """(tensor, scales, zeros, quant) of a bf16 stack [E, N', K] or a QuantWeight."""
    if isinstance(w, QuantWeight):
        return w.q, w.scales, w.zeros, True
    return w, w, w, False


def weight_k(w) -> int:
    return w.K if isinstance(w, QuantWeight) else w.shape[2]


def weight_n(w) -> int:
    return w.N if isinstance(w, QuantWeight) else w.shape[1]


def grouped_gemv_reference(x: torch.Tensor, w, plan: Groups, glu: bool = False, gather: bool = True) -> torch.Tensor:
    """The definition, group by group in torch ops (fp32 products, one rounding to x's dtype)."""
    dense = w.dequantize() if isinstance(w, QuantWeight) else w.transpose(1, 2)        # [E, K, N']
    R = plan.tok.shape[0]
    N = weight_n(w) // 2 if glu else weight_n(w)
    out = torch.zeros((R, N), dtype=x.dtype, device=x.device)
    seg, wid = plan.seg.tolist(), plan.wid.tolist()
    for g in range(int(plan.n_groups.item())):
        rows = torch.arange(seg[g], seg[g + 1], device=x.device)
        xin = x[plan.tok[rows]] if gather else x[rows]
        y = xin.float() @ dense[wid[g]].float()
        if glu:
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        out[rows] = y.to(x.dtype)
    return out


# W4A16 at a few rows: the rows a program takes at once (a decode step's one row a group; a dense product's
# up to four requests), outputs a program, 128-value groups a K tile
W4_ROWS_MAX = 4
# which kernel takes W4A16 at decode: "auto" (one row and the routed experts `_w4_rows_kernel`, FMAs with PDL; a
# dense product of 2-16 rows `w4_decode`, lop3 unpacking and tensor-core products, whose time does not grow with
# the rows: the faster of the two at each, measured on an H100, results/20261207-weights-bench-h100), "dot"
# (`w4_decode` for all), "rows" (`_w4_rows_kernel` for all, as before), "dequant" (every product through the
# dequantising kernel)
W4_KERNEL = "auto"
W4_TILES = {1: (64, 1), 4: (64, 1)}        # MR: (BN, GT): the best of the bench's tiles on an H100
W4_PROGRAMS_PER_SM = 4                     # K split until the launch has about this many programs a multiprocessor
W4_WARPS = 4
W4_STAGES = 3                              # Triton's default software pipelining of the K loop
W4_ROWS_PDL = True                         # programmatic dependent launch where the GPU has it (w4_decode.pdl_ok)
# the K split by the waves it makes (`w4_split_cost`) rather than rounded up to fill the multiprocessors: off until
# timed on a GPU (the weight bench's `waves` variant, the step's `--ab w4_split_waves`)
W4_SPLIT_WAVES = envs.owner_value("LABKIT_W4_SPLIT_WAVES")
W4_PROGRAM_TILES = 2
# x read as 32-bit pairs (`_w4_mac`'s XP), and with them each tile's x loaded with its weight a tile ahead
# (`_w4_xtile`, the switch `w4_x_ahead`, on: the 64K step at one request 6.67 -> 6.39 ms on an H100 with `w4_one`,
# results/20261207-221140-reference-w4a16-h100)
W4_X_PAIRS = False
W4_X_AHEAD = envs.owner_value("LABKIT_W4_X_AHEAD")
# the K loop as one tile a turn under Triton's software pipeliner with this many stages (0: two tiles a turn loaded
# by hand, each while the other multiplies; the switch `w4_pipe`): off, 5-12% slower at one request on an H100
# (results/20261207-220700-reference-checks-h100/weights_bench.json)
W4_PIPE = envs.owner_value("LABKIT_W4_PIPE")
W4_MAXNREG = {}                # glu: registers a thread ptxas may use (none given: its choice; fewer, more programs)


def w4_split(programs: int, k_tiles: int, device: torch.device, split: int | None = None) -> tuple[int, int]:
    """(splits, tiles a split) for a W4A16 launch of `programs` (group, output block) programs over `k_tiles` K
    tiles: K cut until about W4_PROGRAMS_PER_SM programs a multiprocessor stream the weight (one program a
    multiprocessor with a few KiB in flight leaves HBM idle), no split empty. With W4_SPLIT_WAVES, the split up to
    that one whose launch ends soonest by `w4_split_cost` instead: fewer splits where they make fewer waves (at one
    request the dense products on an H100 1.56 -> 1.43 ms, the experts 1.33 -> 1.21: `xahead` against
    `xahead-waves` in results/20261207-220700-reference-checks-h100/weights_bench.json), never more than filling
    takes, a choice no bench has timed. Off: at four requests the experts ran 3.73 -> 4.28 ms with the switch, and
    again 3.75 -> 4.27 in a bench of the two variants alone (results/20261208-011000-reference-checks-h100), though
    by this function both rules split those launches alike (40 group slots x 20 blocks, past the places): a cause
    not found yet (`weights_bench.py --abba` times the two in turn)."""
    places = W4_PROGRAMS_PER_SM * arch.multiprocessors(device)
    fill = -(-places // max(programs, 1))
    if split is None and W4_SPLIT_WAVES:
        split = min(range(1, min(fill, k_tiles) + 1), key=lambda s: (w4_split_cost(programs, k_tiles, s, places), s))
    elif split is None:
        split = fill
    split = max(1, min(split, k_tiles))
    tiles = -(-k_tiles // split)
    return -(-k_tiles // tiles), tiles


def w4_split_cost(programs: int, k_tiles: int, split: int, places: int) -> int:
    """Tiles on a launch's critical path when K is cut `split` ways: the waves its programs take over `places`
    resident programs, times the tiles each streams plus W4_PROGRAM_TILES (a program's start, its first loads'
    latency and its partial sums' store and arrival, in tiles: a guess for the bench to check). Rounding the split
    up to fill the places (the default) gives the QSA input projection at one row 642 programs for 528 places on an
    H100: a second wave of 114, each program's 7 tiles twice on the path, where two splits are one wave of 10
    (Nsight Compute: results/20261207-162330-reference-checks-h100/ncu_w4_dense.csv)."""
    tiles = -(-k_tiles // split)
    splits = -(-k_tiles // tiles)
    return -(-programs * splits // places) * (tiles + W4_PROGRAM_TILES)


def group_slots(plan: Groups, t: torch.Tensor) -> int:
    """Programs along the groups: the plan's slots, but never more than the stack's weights (a prefill chunk's
    plan has a slot per (token, expert) pair, 81,920 at 8K tokens, of which at most the 512 experts are groups:
    the rest would be programs that only read the count and leave)."""
    return min(plan.wid.shape[0], t.shape[0])


def w4_rows(x, t, s, z, plan: Groups, N: int, K: int, glu: bool, gather: bool, rows: int, block_n, group_tile,
            split, shared=None, combine=None) -> torch.Tensor:
    """`_w4_rows_kernel`'s launch. `shared` (codes, scales, zeros of one expert of the stack's N' and K, and how
    many groups take it): the plan's groups of weight id E (the stack's count) take it. `combine` (back, p, gate_logit,
    k), a decode step's experts' down product: the output is each token's weighted sum [T, N]
    (`w4_decode._combine_tail`), not the rows."""
    R = plan.tok.shape[0]
    BN, GT = W4_TILES[rows]
    BN, GT = block_n or BN, group_tile or GT
    n_blocks = triton.cdiv(N, BN)
    if shared is not None:                # `group_slots`, the shared expert's groups beside the stack's
        *shared, shared_groups = shared
        G = min(plan.wid.shape[0] - shared_groups, t.shape[0]) + shared_groups
    else:
        G = group_slots(plan, t)
    # a launch of more (group, block) pairs than counters has programs enough without a split
    splits, tiles = w4_split(G * n_blocks, triton.cdiv(K, W4_GROUP * GT), x.device,
                             split if G * n_blocks <= arch.COUNTER_SLOTS else 1)
    partial = splits > 1 or combine is not None
    if combine is not None:
        back, p, gl, k = combine
        T = p.shape[0]
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    else:
        back = p = gl = plan.tok
        T, k = 0, 1
        out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, R, 2 * N if glu else N), dtype=torch.float32, device=x.device) if partial else out
    qw = t.view(torch.int32)                   # [E, N', K/8]: eight nibbles a word
    if shared is not None:
        qs, ss, zs = shared[0].view(torch.int32), shared[1], shared[2]
    else:
        qs, ss, zs = qw, s, z
    gdc = W4_ROWS_PDL and w4_decode.pdl_ok(x.device)
    early = gdc and plan.fixed and R <= rows       # Groups.one, one block of rows
    # x as 32-bit pairs of bf16: the pairs' two halves made floats by a shift and a mask, so bf16 only, aligned
    xp = ((W4_X_PAIRS or W4_X_AHEAD) and x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.stride(0) % 2 == 0
          and x.data_ptr() % 4 == 0)
    xk = x.view(torch.int32) if xp else x
    _w4_rows_kernel[(G, n_blocks, splits)](
        xk, qw, s, z, out, part, arch.arrival_counters(x.device), plan.wid, plan.tok, plan.seg, plan.n_groups,
        qs, ss, zs, t.shape[0], back, p, gl, gl.stride(0), T, R - T if combine is not None else R, N, K,
        tiles, xk.stride(0), out.stride(0), part.stride(0) if partial else 0, part.stride(1) if partial else 0,
        qw.stride(0), qw.stride(1), s.stride(0), s.stride(1), 0x4B000000, MR=rows, BN=BN, GT=GT, PARTIAL=partial,
        GLU=glu, GATHER=gather, GDC=gdc, EARLY=early, SHARED=shared is not None, COMBINE=combine is not None, TOPK=k,
        KP1=triton.next_power_of_2(k + 1), TB=min(triton.next_power_of_2(max(T, 1)), COMBINE_TOKENS), XP=xp,
        PRE=xp and W4_X_AHEAD, PIPE=W4_PIPE, ONE=plan.fixed and combine is None and w4_decode.W4_ONE,
        num_warps=W4_WARPS, num_stages=W4_STAGES, **({"launch_pdl": True} if gdc else {}),
        **({"maxnreg": W4_MAXNREG[glu]} if W4_MAXNREG.get(glu) else {}))
    return out


COMBINE_TOKENS = 4        # tokens the combine's last arrival sums at once ([tokens, k + 1, BN] fp32 in registers)




# a dense W4A16 product of more rows (a prefill chunk) is a GEMM, not a stream: its weight dequantised once
# (`dequantize_w4`, 2.5 bytes a value moved) and multiplied by cuBLAS, where the grouped kernel's one group
# would be a few dozen programs each walking every row block
W4_DEQUANT_ROWS = 256


def dequantize_w4(w: QuantWeight) -> torch.Tensor:
    """Expert 0 of a W4A16 weight as bf16 [N, K] (K-major): one kernel where kernels run, else `dequantize`."""
    if not kernels_run(w.q):
        return dequantize(w.q[:1], w.scales[:1], w.zeros[:1])[0].t()
    N, K = w.N, w.K
    out = torch.empty((N, K), dtype=torch.bfloat16, device=w.q.device)
    BN = 32
    _dequant_kernel[(triton.cdiv(N, BN), K // W4_GROUP)](w.q, w.scales, w.zeros, out, N, K, w.q.stride(1),
                                                         w.scales.stride(1), out.stride(0), BN=BN, BK=W4_GROUP,
                                                         num_warps=4)
    return out


def _dequant_gemm(x: torch.Tensor, w: QuantWeight, glu: bool) -> torch.Tensor:
    y = x @ dequantize_w4(w).t()                                     # [M, N'] bf16, fp32 accumulation
    if glu:
        gate, up = y.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up).to(x.dtype)
    return y


def grouped_gemv(x: torch.Tensor, w, plan: Groups, glu: bool = False, gather: bool = True,
                 m_pad: int | None = None, block_n: int | None = None, group_tile: int | None = None,
                 split: int | None = None) -> torch.Tensor:
    """[R, N] (module docstring); the Triton kernel where kernels run, else the reference. W4A16 at one row a
    group (or a dense product of at most W4_ROWS_MAX rows) takes `_w4_rows_kernel`: `block_n`, `group_tile` and
    `split` override its tiles and K split (the weight-stream bench sweeps them)."""
    K = weight_k(w)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"grouped_gemv: x {tuple(x.shape)} does not take a weight of K = {K}")
    if glu and weight_n(w) % 2:
        raise ValueError(f"grouped_gemv: a gate|up weight has an even number of rows, got {weight_n(w)}")
    if not kernels_run(x):
        return grouped_gemv_reference(x, w, plan, glu, gather)
    N = weight_n(w) // 2 if glu else weight_n(w)
    R = plan.tok.shape[0]
    t, s, z, quant = operands(w)
    if quant and K % W4_GROUP:
        raise ValueError(f"grouped_gemv: W4A16 needs K to be a multiple of {W4_GROUP}, got {K}")
    # rows a group takes at a time: a dense product's M rows (1, 16 or 64); a decode step's plan has a group
    # slot for each row (most groups hold one row: one at a time), a prefill chunk's many rows a group
    if m_pad:
        M = m_pad
    elif plan.wid.shape[0] == 1:
        M = 1 if R == 1 else 16 if R <= 16 else 64
    else:
        M = 1 if R <= plan.wid.shape[0] else 64
    if quant and not m_pad and plan.wid.shape[0] == 1 and R > W4_DEQUANT_ROWS:
        return _dequant_gemm(x, w, glu)        # one group slot of many rows: only a dense product's (Groups.one)
    dense_rows = plan.wid.shape[0] == 1 and R <= w4_decode.W4_MP          # a dense product at decode
    if quant and not m_pad and not group_tile and ((W4_KERNEL == "dot" and (M == 1 or dense_rows))
                                                   or (W4_KERNEL == "auto" and dense_rows and R > 1)):
        return w4_decode.w4_decode(x, t, s, z, plan, N, K, glu=glu, gather=gather, block_n=block_n, split=split)
    if quant and W4_KERNEL != "dequant" and not m_pad and (M == 1 or (plan.wid.shape[0] == 1 and R <= W4_ROWS_MAX)):
        return w4_rows(x.contiguous(), t, s, z, plan, N, K, glu, gather, 1 if M == 1 else W4_ROWS_MAX, block_n,
                        group_tile, split)
    BN = block_n or (32 if M == 1 else 64)
    BK = W4_GROUP if quant else 128
    x = x.contiguous()
    out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    grid = (group_slots(plan, t), triton.cdiv(N, BN))
    _grouped_gemv_kernel[grid](x, t, s, z, out, plan.wid, plan.tok, plan.seg, plan.n_groups, N, K,
                               x.stride(0), out.stride(0), t.stride(0), t.stride(1), s.stride(0), s.stride(1),
                               M_PAD=M, BN=BN, BK=BK, QUANT=quant, GLU=glu, GATHER=gather,
                               DOT_F32=interpret_mode(), num_warps=4)
    return out


# ------------------------------------------------------------------ the engine's entries (opaque to torch.compile)
@torch.library.custom_op("labkit::grouped_gemv", mutates_args=())
def _grouped_op(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, tok: torch.Tensor,
                wid: torch.Tensor, seg: torch.Tensor, n_groups: torch.Tensor, glu: bool, gather: bool,
                quant: bool) -> torch.Tensor:
    weight = QuantWeight(w, scales, zeros) if quant else w
    return grouped_gemv(x, weight, Groups(tok, wid, seg, n_groups), glu=glu, gather=gather)


@_grouped_op.register_fake
def _(x, w, scales, zeros, tok, wid, seg, n_groups, glu, gather, quant):
    n = w.shape[1] // 2 if glu else w.shape[1]
    return x.new_empty((tok.shape[0], n))


def grouped(x: torch.Tensor, w, plan: Groups, glu: bool = False, gather: bool = True) -> torch.Tensor:
    """`grouped_gemv` as the engine calls it (one custom op: a compiled block piece does not trace into it)."""
    t, s, z, quant = operands(w)
    return torch.ops.labkit.grouped_gemv(x, t, s, z, plan.tok, plan.wid, plan.seg, plan.n_groups, glu, gather, quant)


# ------------------------------------------------------------------ W4A16 dense products
@torch.library.custom_op("labkit::qgemv", mutates_args=())
def _qgemv_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, glu: bool) -> torch.Tensor:
    return grouped_gemv(x, QuantWeight(q, scales, zeros), Groups.one(x.shape[0], x.device), glu=glu)


@_qgemv_op.register_fake
def _(x, q, scales, zeros, glu):
    return x.new_empty((x.shape[0], q.shape[1] // 2 if glu else q.shape[1]))


def qmatmul(x: torch.Tensor, w: QuantWeight, glu: bool = False) -> torch.Tensor:
    """x [M, K] @ a W4A16 weight (silu(gate) * up with `glu`), M rows in one group."""
    return torch.ops.labkit.qgemv(x, w.q, w.scales, w.zeros, glu)


def dense_reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x @ the dequantised weight, fp32 products rounded once: what `qmatmul` computes."""
    return (x.float() @ dequantize(w.q, w.scales, w.zeros)[0].float()).to(x.dtype)
