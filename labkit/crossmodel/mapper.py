"""Per-layer ridge regression from small-model features to the large model's K and V, in closed form.

Fitting is streamed: for every group of target layers that read the same features, XᵀX [d, d] is
accumulated, and per target layer XᵀY [d, 2·kv_heads·head_dim], Σy² and Σy (per output column), in
float64, over calibration sequences — the design matrix never exists in memory. Two accumulators are
kept: `fit` and `val` (held-out calibration chunks). For every λ of a grid (relative to the mean
diagonal of XᵀX; the bias is not penalized) W = (XᵀX + λI)⁻¹ XᵀY is solved on `fit`, and its held-out
squared error is computed from `val`'s sums alone (SSE = Σy² − 2·diag(WᵀXᵀY) + diag(WᵀXᵀXW)); λ is
chosen per target layer and separately for K and V, then W is refitted on fit + val.

Reduced rank (`rank=r`, `Fitter.reduced`): the mapping's cost is d x out multiply-adds per token and
mapped layer (d = 2,305 features, out = 384 at first:8: ~5.5 large layers' projections). All mapped layers
that read the same features share one projection A [d, r] of the features, then each has its own
B_l [r, out]: cost d·r + layers·r·out. A and the B_l are the best rank-r factorization of the ridge
solution W = [W_l ...] *in the sense of its predictions on the calibration text*: with G = XᵀX = L Lᵀ
(fit + val) and Γ scaling each layer's K block and V block by 1/√SST (their total variance),
W_r = A B minimizes ‖X (W − W_r) Γ‖² = Σ_blocks ‖X W_b − X W_r,b‖² / SST_b over rank-r matrices
(Eckart–Young on Z = Lᵀ W Γ: A = L⁻ᵀ U_r, B = U_rᵀ Lᵀ W with U_r Z's top-r left singular vectors). For
least squares (λ → 0) that term is exactly the R² each block loses to the rank constraint — the
classical reduced-rank regression; for ridge it is the distance to the full mapper's predictions. The
weighting keeps small-variance blocks (deep layers' V) from being sacrificed to large ones. r ≥ rank(Z)
gives W back.

The result, `Mapper`, holds one W per mapped layer, the layer table, the feature spec, λs, held-out
R², and the identity of both models and of the calibration text (a reduced-rank one: B_l per layer,
A per feature group, the rank and each block's calibration R² gap); `save`/`load` use safetensors with
that metadata (JSON under the key `labkit_xfer`), and `load(..., expect=pair)` refuses a file made
for other models with one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from labkit.crossmodel.features import FeatureSpec, feature_dim
from labkit.crossmodel.pair import LayerTable, PairError, PairSpec
from labkit.atomic import replacing

LAMBDA_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)  # 3 and 10 were never chosen (first:8 fits)
FORMAT = "labkit-xfer-mapper/1"


class MapperMismatch(PairError):
    """A mapper file made for other models, layers or shapes (one line)."""


@dataclass
class Sums:
    """Streamed sufficient statistics of one split."""

    xtx: dict = field(default_factory=dict)   # group key -> [d, d] float64
    xty: dict = field(default_factory=dict)   # layer -> [d, out] float64
    yy: dict = field(default_factory=dict)    # layer -> [out] Σy²
    ys: dict = field(default_factory=dict)    # layer -> [out] Σy
    n: dict = field(default_factory=dict)     # group key -> rows

    def add(self, gkey, X: torch.Tensor, layers_Y: dict[int, torch.Tensor]) -> None:
        # XᵀX in float64 (its conditioning decides the solve); XᵀY per chunk in float32 (the big product,
        # sums of one chunk's rows), accumulated across chunks in float64.
        Xd = X.double()
        self.xtx[gkey] = self.xtx.get(gkey, 0) + Xd.T @ Xd
        self.n[gkey] = self.n.get(gkey, 0) + X.shape[0]
        Xt = X.float().T.contiguous()
        for layer, Y in layers_Y.items():
            Y = Y.float()
            self.xty[layer] = self.xty.get(layer, 0) + (Xt @ Y).double()
            Yd = Y.double()
            self.yy[layer] = self.yy.get(layer, 0) + (Yd * Yd).sum(0)
            self.ys[layer] = self.ys.get(layer, 0) + Yd.sum(0)

    def merged(self, other: "Sums") -> "Sums":
        out = Sums()
        for name in ("xtx", "xty", "yy", "ys", "n"):
            a, b = getattr(self, name), getattr(other, name)
            setattr(out, name, {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)})
        return out


def factor(xtx: torch.Tensor, lam_rel: float):
    """A solver for (XᵀX + λI) W = B in float64; λ = lam_rel · mean(diag XᵀX), bias (last feature)
    unpenalized. Factored once, applied to any right-hand sides (λ choice and refits reuse it)."""
    d = xtx.shape[0]
    scale = float(torch.diagonal(xtx)[:-1].mean()) if d > 1 else 1.0
    pen = torch.full((d,), lam_rel * scale, dtype=xtx.dtype, device=xtx.device)
    pen[-1] = 0.0
    A = xtx + torch.diag(pen)
    try:
        L = torch.linalg.cholesky(A)
        return lambda b: torch.cholesky_solve(b, L)
    except RuntimeError:  # singular without penalty (e.g. lam 0 on a rank-deficient X)
        return lambda b: torch.linalg.lstsq(A, b).solution


def solve(xtx: torch.Tensor, xty: torch.Tensor, lam_rel: float) -> torch.Tensor:
    """Ridge solution in float64; λ = lam_rel · mean(diag XᵀX), bias (last feature) unpenalized."""
    return factor(xtx, lam_rel)(xty)


def column_sse(W: torch.Tensor, xtx: torch.Tensor, xty: torch.Tensor, yy: torch.Tensor) -> torch.Tensor:
    """Σ (y - xW)² per output column, from sums only."""
    return yy - 2 * (W * xty).sum(0) + (W * (xtx @ W)).sum(0)


def column_sst(yy: torch.Tensor, ys: torch.Tensor, n: int) -> torch.Tensor:
    return yy - ys * ys / max(n, 1)


@dataclass
class Mapper:
    large: dict
    small: dict
    table: LayerTable
    features: FeatureSpec
    kv_width: int              # kv_heads * head_dim of the large model
    weights: dict[int, torch.Tensor]          # layer -> [d, 2 * kv_width] float32
    # layer -> relative λs, K blocks then V blocks: (λ_K, λ_V), or one per KV head of K then of V
    lambdas: dict[int, tuple[float, ...]] = field(default_factory=dict)
    r2_val: dict[int, tuple[float, float]] = field(default_factory=dict)
    corpus: dict = field(default_factory=dict)  # hashes, token counts
    rope: str = "pre"          # 'pre': keys mapped before rotation; 'post': rotated keys mapped directly
    # reduced rank (rank > 0): weights[l] is B_l [r, 2 * kv_width]; proj[g] is A [d, r] of feature group g
    # (the layers reading the same features), groups[l] = g
    rank: int = 0
    proj: dict[int, torch.Tensor] = field(default_factory=dict)
    groups: dict[int, int] = field(default_factory=dict)
    rank_gap: dict[int, tuple[float, float]] = field(default_factory=dict)  # layer -> (K, V) ‖X(W-W_r)‖²/SST

    def lambda_kv(self, layer: int) -> tuple[float, float]:
        """(λ_K, λ_V) of a layer; with per-head λ the geometric mean over heads."""
        lam = self.lambdas[layer]
        h = len(lam) // 2
        gm = lambda xs: float(torch.tensor(xs, dtype=torch.float64).log().mean().exp())  # noqa: E731
        return gm(lam[:h]), gm(lam[h:])

    def keys(self, layer: int):
        return self.features.keys(layer, self.table, int(self.small["layers"]))

    def project(self, X: torch.Tensor, layer: int) -> torch.Tensor:
        """The per-layer maps' input for features X [T, d]: X itself, or X A [T, r] for a reduced-rank mapper
        (shared by every layer of the group: callers compute it once per feature group)."""
        if not self.rank:
            return X
        A = self.proj[self.groups[layer]]
        return X.to(A.dtype) @ A

    def input_dim(self, layer: int) -> int:
        """d: the width of the features the mapper reads for `layer`."""
        return (self.proj[self.groups[layer]] if self.rank else self.weights[layer]).shape[0]

    def macs_per_token(self) -> int:
        """Multiply-adds per prompt token of the whole mapping (projections once per group)."""
        return sum(w.shape[0] * w.shape[1] for w in self.weights.values()) + \
            sum(a.shape[0] * a.shape[1] for a in self.proj.values())

    def predict(self, X: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K before RoPE, V), each [T, kv_width], for `project(features, layer)`."""
        W = self.weights[layer]
        Y = X.to(W.dtype) @ W
        return Y[:, : self.kv_width], Y[:, self.kv_width:]

    # ---- persistence ------------------------------------------------------------------------------
    def metadata(self) -> dict:
        return {"format": FORMAT, "large": self.large, "small": self.small, "layer_table": self.table.to_list(),
                "features": str(self.features), "kv_width": self.kv_width, "rope": self.rope,
                "lambdas": {str(k): v for k, v in self.lambdas.items()},
                "r2_val": {str(k): v for k, v in self.r2_val.items()}, "corpus": self.corpus, "rank": self.rank,
                "groups": {str(k): v for k, v in self.groups.items()},
                "rank_gap": {str(k): v for k, v in self.rank_gap.items()}}

    def save(self, path: str | Path) -> Path:
        # safetensors comes with the optional `quality` extra (transformers)
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"layer.{k}.W": v.contiguous().float() for k, v in self.weights.items()}
        tensors.update({f"proj.{g}.A": a.contiguous().float() for g, a in self.proj.items()})
        with replacing(path) as tmp:          # a fresh temporary name: never through a planted link
            save_file(tensors, str(tmp), metadata={"labkit_xfer": json.dumps(self.metadata())})
        return path

    @classmethod
    def load(cls, path: str | Path, expect: PairSpec | None = None, features: str | None = None) -> "Mapper":
        # safetensors comes with the optional `quality` extra (transformers)
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise MapperMismatch(f"mapper file {path} does not exist")
        meta = read_metadata(path)
        if expect is not None:
            check_compatible(meta, expect, path)
        if features is not None and str(FeatureSpec.parse(features)) != meta["features"]:
            raise MapperMismatch(f"mapper {path} reads features {meta['features']}, not {features}")
        with safe_open(str(path), framework="pt") as f:
            weights = {int(k.split(".")[1]): f.get_tensor(k) for k in f.keys() if k.startswith("layer.")}
            proj = {int(k.split(".")[1]): f.get_tensor(k) for k in f.keys() if k.startswith("proj.")}
        return cls(large=meta["large"], small=meta["small"], table=LayerTable.from_list(meta["layer_table"]),
                   features=FeatureSpec.parse(meta["features"]), kv_width=int(meta["kv_width"]), weights=weights,
                   lambdas={int(k): tuple(v) for k, v in meta["lambdas"].items()},
                   r2_val={int(k): tuple(v) for k, v in meta["r2_val"].items()}, corpus=meta["corpus"],
                   rope=meta.get("rope", "pre"), rank=int(meta.get("rank", 0)), proj=proj,
                   groups={int(k): int(v) for k, v in meta.get("groups", {}).items()},
                   rank_gap={int(k): tuple(v) for k, v in meta.get("rank_gap", {}).items()})


def read_metadata(path: str | Path) -> dict:
    # safetensors comes with the optional `quality` extra (transformers)
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("labkit_xfer")
    except Exception as ex:
        raise MapperMismatch(f"{path} is not a safetensors file ({type(ex).__name__})") from None
    if not raw:
        raise MapperMismatch(f"{path} holds no labkit mapper metadata")
    meta = json.loads(raw)
    if meta.get("format") != FORMAT:
        raise MapperMismatch(f"{path}: mapper format {meta.get('format')!r}, expected {FORMAT}")
    return meta


def check_compatible(meta: dict, pair: PairSpec, path="mapper") -> None:
    """One line if the mapper was made for other models or another layer table."""
    for role, info in (("large", pair.large), ("small", pair.small)):
        m = meta[role]
        if m["fingerprint"] != info.fingerprint or m["layers"] != info.layers:
            raise MapperMismatch(f"{path} was fitted for {role} model {m['name']} ({m['layers']} layers, "
                                 f"fingerprint {m['fingerprint']}), not {info.name} ({info.layers} layers, "
                                 f"fingerprint {info.fingerprint})")
    if meta["layer_table"] != pair.table.to_list():
        raise MapperMismatch(f"{path} was fitted with another layer table than the one asked for")


# ---- fitting ------------------------------------------------------------------------------------

class Fitter:
    """Streams calibration sequences into fit/val sums; `mapper()` chooses λ and solves."""

    def __init__(self, pair: PairSpec, features: FeatureSpec, rope: str = "pre"):
        if rope not in ("pre", "post"):
            raise PairError(f"rope must be 'pre' or 'post', got {rope!r}")
        self.pair, self.features, self.rope = pair, features, rope
        Ls = pair.small.layers
        self.groups: dict[tuple, list[int]] = {}
        for layer in pair.table.mapped_layers:
            self.groups.setdefault(features.keys(layer, pair.table, Ls), []).append(layer)
        self.kv_width = pair.large.kv_heads * pair.large.head_dim
        self.sums = {"fit": Sums(), "val": Sums()}
        self.tokens = {"fit": 0, "val": 0}

    @property
    def hidden_needed(self) -> set[int]:
        return {i for keys in self.groups for k, i, _ in keys if k == "h"}

    def add(self, split: str, small_pass, targets: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One sequence: the small model's pass and the large model's (K, V) per mapped layer, [T, w] each."""
        for keys, layers in self.groups.items():
            X = small_pass.features(keys)
            self.sums[split].add(keys, X, {l_: torch.cat(targets[l_], dim=1) for l_ in layers})
        self.tokens[split] += next(iter(targets.values()))[0].shape[0] if targets else 0

    def mapper(self, grid=LAMBDA_GRID, corpus: dict | None = None, log=None, lambda_per: str = "layer",
               sweep_dtype=torch.float64, rank: int = 0) -> Mapper:
        """Choose λ on `val` and refit on fit + val. `lambda_per`: 'layer' (one λ for a layer's K, one for
        its V) or 'head' (one per KV head of K and of V). Ridge columns are independent given X, so
        per-head *targets* differ from joint ones only through this choice of λ. `sweep_dtype=torch.float32`
        runs the λ sweep (factorizations and held-out errors) in float32, ~2x faster on CPU, to choose λ
        only; the refit is float64 either way."""
        if lambda_per not in ("layer", "head"):
            raise PairError(f"lambda_per must be 'layer' or 'head', got {lambda_per!r}")
        fit, val = self.sums["fit"], self.sums["val"]
        both = fit.merged(val)
        w = self.kv_width
        nb = 2 * (self.pair.large.kv_heads if lambda_per == "head" else 1)   # λ blocks per layer (K..., V...)
        bw = 2 * w // nb
        weights, lambdas, r2 = {}, {}, {}
        for keys, layers in self.groups.items():
            sse = {l_: [] for l_ in layers}
            dt = sweep_dtype
            rhs = torch.cat([fit.xty[l_] for l_ in layers], dim=1).to(dt)
            vxtx = val.xtx[keys].to(dt)
            for lam in grid:
                Ws = factor(fit.xtx[keys].to(dt), lam)(rhs)
                for j, l_ in enumerate(layers):
                    W = Ws[:, j * 2 * w:(j + 1) * 2 * w]
                    sse[l_].append(column_sse(W, vxtx, val.xty[l_].to(dt), val.yy[l_].to(dt)).double())
            pick = {}
            for l_ in layers:
                errs = torch.stack(sse[l_])                                   # [grid, 2w]
                idx = errs.view(len(grid), nb, bw).sum(2).argmin(0)           # [nb]
                chosen = errs.view(len(grid), nb, bw)[idx, torch.arange(nb)].reshape(2 * w)
                sst = column_sst(val.yy[l_], val.ys[l_], val.n[keys])
                r2[l_] = (float(1 - chosen[:w].sum() / sst[:w].sum()), float(1 - chosen[w:].sum() / sst[w:].sum()))
                lambdas[l_] = tuple(float(grid[int(i)]) for i in idx)
                pick[l_] = idx
            # refit on fit + val: one factorization per distinct λ of the group
            out = {l_: torch.empty(both.xty[l_].shape, dtype=torch.float64) for l_ in layers}
            for gi in sorted({int(i) for idx in pick.values() for i in idx}):
                sel = [(l_, b) for l_ in layers for b in range(nb) if int(pick[l_][b]) == gi]
                rhs = torch.cat([both.xty[l_][:, b * bw:(b + 1) * bw] for l_, b in sel], dim=1)
                Wg = factor(both.xtx[keys], grid[gi])(rhs)
                for j, (l_, b) in enumerate(sel):
                    out[l_][:, b * bw:(b + 1) * bw] = Wg[:, j * bw:(j + 1) * bw]
            for l_ in layers:
                weights[l_] = out[l_].float()
                if log:
                    lk, lv = lambdas[l_][: nb // 2], lambdas[l_][nb // 2:]
                    log(f"layer {l_}: lambda K {','.join(f'{x:g}' for x in lk)} V {','.join(f'{x:g}' for x in lv)}, "
                        f"held-out R2 K {r2[l_][0]:.4f} V {r2[l_][1]:.4f}")
        mp = Mapper(large=self.pair.large.to_dict(), small=self.pair.small.to_dict(), table=self.pair.table,
                    features=self.features, kv_width=w, weights=weights, lambdas=lambdas, r2_val=r2,
                    corpus=dict(corpus or {}, fit_tokens=self.tokens["fit"], val_tokens=self.tokens["val"],
                                lambda_per=lambda_per),
                    rope=self.rope)
        return self.reduced(mp, rank) if rank else mp

    def reduced(self, mp: Mapper, rank: int) -> Mapper:
        """The rank-`rank` mapper of a full one fitted from these sums (module docstring): per feature group
        A [d, r] shared by its layers and B_l [r, 2w] per layer, W_r = A B the best rank-r approximation of
        W in ‖X (W − W_r) Γ‖ over the calibration text (fit + val). `r2_val` stays the full mapper's held-out
        R²; `rank_gap` is what the rank costs on the calibration text, per layer (K, V)."""
        if rank < 1:
            raise PairError(f"rank must be >= 1, got {rank}")
        if mp.rank:
            raise PairError("reduced() takes a full-rank mapper")
        both = self.sums["fit"].merged(self.sums["val"])
        w = self.kv_width
        weights, proj, groups, gap = {}, {}, {}, {}
        for keys, layers in self.groups.items():
            g = min(layers)
            G = both.xtx[keys].double()
            G = G + torch.eye(G.shape[0], dtype=G.dtype) * 1e-12 * float(torch.diagonal(G).mean())
            Lc = torch.linalg.cholesky(G)                                   # G = L Lᵀ, ‖X M‖² = ‖Lᵀ M‖²
            W = torch.cat([mp.weights[l_].double() for l_ in layers], dim=1)   # [d, layers·2w]
            sst = torch.cat([torch.stack([column_sst(both.yy[l_], both.ys[l_], both.n[keys])[:w].sum(),
                                          column_sst(both.yy[l_], both.ys[l_], both.n[keys])[w:].sum()])
                             .repeat_interleave(w) for l_ in layers])      # per column: its block's SST
            LtW = Lc.T @ W
            Z = LtW / sst.clamp_min(1e-30).sqrt()
            evals, evecs = torch.linalg.eigh(Z @ Z.T)                     # Z's left singular vectors
            r = min(rank, Z.shape[0])
            Ur = evecs[:, -r:].flip(1)                                      # top r
            A = torch.linalg.solve_triangular(Lc.T, Ur, upper=True)        # L⁻ᵀ U_r   [d, r]
            B = Ur.T @ LtW                                                  # U_rᵀ Lᵀ W [r, layers·2w]
            D = LtW - Lc.T @ (A @ B)                                        # Lᵀ (W − W_r)
            err = (D * D).sum(0) / sst.clamp_min(1e-30)
            proj[g] = A.float()
            for j, l_ in enumerate(layers):
                weights[l_] = B[:, j * 2 * w:(j + 1) * 2 * w].float().contiguous()
                groups[l_] = g
                e = err[j * 2 * w:(j + 1) * 2 * w]
                gap[l_] = (float(e[:w].sum()), float(e[w:].sum()))
        return Mapper(large=mp.large, small=mp.small, table=mp.table, features=mp.features, kv_width=w,
                      weights=weights, lambdas=mp.lambdas, r2_val=mp.r2_val, corpus=dict(mp.corpus, rank=rank),
                      rope=mp.rope, rank=rank, proj=proj, groups=groups, rank_gap=gap)


def feature_width(pair: PairSpec, features: FeatureSpec, layer: int) -> int:
    keys = features.keys(layer, pair.table, pair.small.layers)
    return feature_dim(keys, pair.small.hidden, pair.small.kv_heads * pair.small.head_dim)


def _columns(keys, hidden: int, kv_width: int) -> dict:
    """Column range of each feature key in X (keys in order, bias last)."""
    out, at = {}, 0
    for k in keys:
        w = hidden if k[0] == "h" else 2 * kv_width
        out[k] = (at, at + w)
        at += w
    out["bias"] = (at, at + 1)
    return out


def restrict(fitter: Fitter, features: FeatureSpec) -> Fitter:
    """A Fitter for a *subset* of `fitter`'s features, its sums cut out of the superset's (no new passes):
    one calibration run serves a feature-selection sweep."""
    sub = Fitter(fitter.pair, features, fitter.rope)
    p = fitter.pair
    hidden, kvw = p.small.hidden, p.small.kv_heads * p.small.head_dim
    for skeys, layers in sub.groups.items():
        sup = next((k for k, ls in fitter.groups.items() if set(layers) <= set(ls) and set(skeys) <= set(k)), None)
        if sup is None:
            raise PairError(f"features {features} are not a subset of {fitter.features} for layers {layers}")
        cols = _columns(sup, hidden, kvw)
        idx = torch.cat([torch.arange(*cols[k]) for k in skeys] + [torch.arange(*cols["bias"])])
        for split in ("fit", "val"):
            src, dst = fitter.sums[split], sub.sums[split]
            dst.xtx[skeys] = src.xtx[sup][idx][:, idx]
            dst.n[skeys] = src.n[sup]
            for l_ in layers:
                dst.xty[l_] = src.xty[l_][idx]
                dst.yy[l_], dst.ys[l_] = src.yy[l_], src.ys[l_]
    sub.tokens = dict(fitter.tokens)
    return sub
