"""The verdict rule of the claims card, and the types every row is made of: the thresholds (fixed in this module;
the card names the commit that last changed them), the verdicts and their colours, the four systems' names, `Published` (a figure as published), `Figure` (one
of ours, with its spread), `Verdict` and `Claim` (one row, whose verdict `decide` gives as it is made), and the rule
itself (`judge`, `decide`; `rule_text` says it in words). Nothing here reads a run."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# ---- the verdict rule: every threshold in one place ------------------------------------------------------------
TOLERANCE = 0.10          # ours within ±10% of the published figure: holds
APPROX_TOLERANCE = 0.20   # the same for a figure published as "~x" (the publication rounds it)
EFFECT_SHARE = 0.5        # ... but never more than this share of the effect the claim reports (its distance to
                          # the figure it contrasts with), so a band cannot reach what the claim sets itself against
PART_FACTOR = 2.0         # an absolute figure with nothing to contrast (tok/s, GB/s) within this factor: holds in part
NO_EFFECT = 1.0           # a ratio against a baseline: 1 means no effect (the contrast of every ratio)
MIN_EFFECT = 0.02         # ... and within ±2% of it is no effect either (below what two repeats can tell apart)
LINK_CHECK_TOLERANCE = 0.10   # predicted vs measured step time at every link rate, for the link term to count as checked
LINK_CHECK_RATES = 3
# the terms a cost-model figure for other hardware scales: each must be checked against a second real GPU before
# the model's figure stops being provisional
SCALED_TERMS = ("link", "compute", "bandwidth", "shape")

HOLDS, PART, FAILS = "holds", "holds in part", "does not hold"
CONSTRUCTION, OUT_OF_REGIME, UNTESTED = "by construction", "not tested in the published regime", "not tested"
VERDICTS = (HOLDS, PART, FAILS, CONSTRUCTION, OUT_OF_REGIME, UNTESTED)
COLOURS = {HOLDS: "#2ca02c", PART: "#ff9f1c", FAILS: "#d62728", CONSTRUCTION: "#1f77b4", OUT_OF_REGIME: "#9467bd",
           UNTESTED: "#8c8c8c"}
SYSTEMS = {"sparse": "Sparse offload of Qwen3.8-Flash-Next", "flash": "FlashOffloading", "pulse": "PulseInfer",
           "xfer": "Cross-model KV transfer"}


def rule_text() -> str:
    """The verdict rule in words, from the constants above: docs/claims.md renders it (block `claims-rule`)."""
    return (
        "Every row goes through one function, `labkit.docs.claims.decide`, in this order:\n\n"
        f"1. **{CONSTRUCTION}** — the figure follows from the model's shape (a byte count, a rate implied by two "
        "published figures): the shape's arithmetic is the row's figure. It agrees with the published figure within "
        f"the tolerance below: *{CONSTRUCTION}* (true of any implementation with that shape, so not a finding); "
        "otherwise the comparison below decides.\n"
        f"2. **{OUT_OF_REGIME}** — the lab has a figure, but its point lies outside the regime the published figure "
        "was measured in, read from the run itself (the lab's own model predicts no effect at that point, the limit "
        "the figure is defined by never binds, the setup the figure is about is absent). Such a point can neither "
        "refute nor confirm: it never makes a row *does not hold*, nor *holds*; the row names the run that would "
        "reach the regime.\n"
        "3. The deciding figure is the first of: ours in the published terms, the cost model's figure for the "
        "published hardware, a stand-in or proxy (another model, pair or corpus in place of the published one). A "
        "stand-in or proxy marks the verdict *provisional* whichever class it lands in (step 2's included); so does "
        "the cost model's, unless every term it scales (" + ", ".join(SCALED_TERMS) + ") was checked against a "
        "second real GPU. It is compared with the published figure:\n"
        f"   - **tolerance**: ±{TOLERANCE:.0%} of the published figure, ±{APPROX_TOLERANCE:.0%} for one published as "
        f"\"~x\"; either way at most {EFFECT_SHARE:.0%} of the effect the claim reports (the distance from the "
        "published figure to the one it contrasts with: no effect (1×) for a ratio, the other side for \"~80 → ~60\"), "
        "so the band never reaches what the claim sets itself against.\n"
        "   - **\"up to x\"** is read as a best case: our best unit (window, repeat) against the published best, with "
        "the median over units and its 95% interval printed beside it. One unit is not an effect: the row leaves "
        f"*does not hold* only where the median's interval (a figure with no median: its whole spread) clears no "
        f"effect ± {MIN_EFFECT:.0%} as well as the best unit, or the best unit clears the unit-to-unit noise measured "
        "by repeats of the same unit. Then it holds when our best reaches the published figure less the tolerance "
        "(or goes past it).\n"
        "   - a **latency statistic** (TPOT) is judged on the statistic the row fixes in its definition; the row shows "
        "the other one (mean beside p99) and the reason names both.\n"
        "   - any other figure **holds** when the published figure lies inside our spread or within the tolerance of "
        "our value, and our spread clears the contrast (a ratio's spread must not reach no effect ± "
        f"{MIN_EFFECT:.0%}).\n"
        "   - **holds in part**: not that, but the direction holds: our spread (for \"up to\", our best) lies on the "
        f"published side of the contrast, beyond ±{MIN_EFFECT:.0%} of it; for an absolute figure with no contrast, "
        f"within {PART_FACTOR:g}× either way.\n"
        "   - a figure published over a range (a context range, \"then flat\") is judged at every point of the range "
        "the run covers: *holds* at every point, *holds in part* at some, *does not hold* at none.\n"
        "   - a **crossover** (\"loses on short prompts, pays off on long ones\") is judged on both halves: *holds* "
        "only where both hold, *holds in part* where one does, *does not hold* where neither does.\n"
        "   - otherwise **does not hold**.\n"
        f"4. **{UNTESTED}** — no figure of ours measures it; the row says what would.")


@dataclass(frozen=True)
class Published:
    value: float
    text: str                 # the figure as published ("1.38× prefill throughput")
    setup: str
    kind: str = "ratio"       # "ratio": an effect against a baseline (NO_EFFECT = none); "absolute": a quantity
    approx: bool = False      # published as "~x"
    up_to: bool = False       # published as "up to x": a best case, compared with our best case
    unit: str = "×"
    contrast: float | None = None   # what the claim sets itself against (None: no effect for a ratio, else none)
    side: int = 0             # kind "direction": the claim is only that ours lies below (-1) or above (+1) the contrast


@dataclass(frozen=True)
class Figure:
    """One figure of ours: a value, the spread behind it (`lo`–`hi`, `how`), what was measured, the runs."""
    value: float
    lo: float
    hi: float
    how: str                  # "min–max across 3 processes", "95% interval over 16 sequences", "one measurement"
    what: str                 # the measurement in words
    runs: tuple[str, ...] = ()
    differs: str = ""         # what differs from the published setup
    unit: str = "×"
    points: tuple = ()        # a figure over a range: (label, value, lo, hi) per point, each judged by the rule
    median: tuple | None = None   # an "up to" figure: (median, lo, hi) over its units, the interval that must clear
    noise: float | None = None    # an "up to" figure: unit-to-unit noise measured by repeats (a fraction), if any

    def text(self) -> str:
        if self.points:
            vals = [p[1] for p in self.points]
            return (f"{value_range(min(vals), max(vals))} {self.unit} over {len(vals)} points "
                    f"({self.points[0][0]}–{self.points[-1][0]}), {self.how}").replace(" × over", "× over")
        v = _num(self.value, self.unit)
        if self.lo == self.hi == self.value or math.isnan(self.lo):
            return f"{v} ({self.how})"
        return f"{v} ({value_range(self.lo, self.hi)}, {self.how})"


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str
    basis: str                # which figure decided: "published terms", "cost model (checked)", "stand-in", ...
    provisional: bool

    def label(self) -> str:
        return self.verdict + (" (provisional)" if self.provisional else "")


@dataclass
class Claim:
    key: str
    system: str
    published: Published
    terms: Figure | None = None       # ours in the published terms
    strongest: Figure | None = None   # ours against our strongest baseline
    model: Figure | None = None       # the cost model's figure for the published hardware
    stand_in: Figure | None = None    # what decides while the published-terms run is missing
    model_checked: tuple = ()         # the scaled terms (SCALED_TERMS) checked on a second GPU (True: the link only)
    model_basis: str = ""             # what the cost model's figure rests on, when not the decode transfer term
    settle: str = ""                  # the run that would settle the row
    untestable: str = ""              # why no figure of ours can test it here
    construction: Figure | None = None   # the shape's arithmetic, for a figure that follows from the model's shape
    regime: str = ""                  # why our points lie outside the published regime (read from the runs), or ""
    caveat: str = ""                  # what the verdict holds only for, said beside it
    proxy: str = ""                   # what the published-terms figure stands in for (a proxy: provisional)
    other_half: tuple | None = None   # a crossover's other half: (words, Published, Figure | None)
    verdict: Verdict = field(init=False)

    def __post_init__(self):
        self.verdict = decide(self)

    def ratio(self) -> Figure | None:
        """The deciding figure over the published one (our / published), for the card's plot."""
        f = self.construction or self.terms or self.model or self.stand_in
        if f is None or not self.published.value or math.isnan(self.published.value):
            return None
        p = self.published.value
        return Figure(f.value / p, f.lo / p, f.hi / p, f.how, f.what, f.runs, f.differs)

    def runs(self) -> list[str]:
        out: list[str] = []
        for f in (self.construction, self.terms, self.strongest, self.model, self.stand_in):
            for r in (f.runs if f else ()):
                if r not in out:
                    out.append(r)
        return out


def _num(v: float, unit: str, with_unit: bool = True) -> str:
    if math.isnan(v):
        return "–"
    a = abs(v)
    s = f"{v:,.0f}" if a >= 100 or (a >= 10 and float(v).is_integer()) else f"{v:.1f}" if a >= 10 else f"{v:.2f}"
    if not with_unit:
        return s
    return f"{s}×" if unit == "×" else f"{s} {unit}" if unit else s


def value_range(lo: float, hi: float) -> str:
    """lo–hi with the digits of `_num`, one or two more where those would print the same small number twice (a
    count of hundreds or more equal to its last digit is shown as it is)."""
    a, b = _num(lo, "", False), _num(hi, "", False)
    if a == b and lo != hi and max(abs(lo), abs(hi)) < 100:
        a, b = f"{lo:.3f}", f"{hi:.3f}"
    return f"{a}–{b}"


# ---- the rule -----------------------------------------------------------------------------------------------
def contrast(pub: Published) -> float | None:
    """The figure the claim sets itself against: no effect for a ratio, else what the row declares (or none)."""
    if pub.contrast is not None:
        return pub.contrast
    return NO_EFFECT if pub.kind in ("ratio", "direction") else None


def tolerance(pub: Published) -> float:
    """±TOLERANCE (±APPROX_TOLERANCE for "~x"), never more than EFFECT_SHARE of the effect the claim reports."""
    base = APPROX_TOLERANCE if pub.approx else TOLERANCE
    c = contrast(pub)
    if c is None or c == 0 or pub.value == c:
        return base
    return min(base, abs(pub.value / c - 1) * EFFECT_SHARE)


def judge(pub: Published, ours: Figure) -> tuple[str, str]:
    """The comparison step of the rule (`decide`, step 3): one figure of ours against the published one, and its
    one-line reason. A figure with `points` is judged at each and the outcomes counted."""
    if ours.points:
        got = [(label, *judge(pub, Figure(v, lo, hi, ours.how, ours.what, unit=ours.unit)))
               for label, v, lo, hi in ours.points]
        held = [g[0] for g in got if g[1] == HOLDS]
        part = [g[0] for g in got if g[1] == PART]
        vals = value_range(min(p[1] for p in ours.points), max(p[1] for p in ours.points))
        where = f"over {len(got)} points ({got[0][0]}–{got[-1][0]}) ours ranges {vals} {pub.unit}".rstrip()
        if len(held) == len(got):
            return HOLDS, f"holds at every point: {where}"
        if held or part:
            return PART, (f"holds at {len(held)} of {len(got)} points" + (f" ({', '.join(held)})" if held else "")
                          + (f", in part at {', '.join(part)}" if part else "") + f": {where}")
        return FAILS, f"holds at none of the points: {where}"
    p, v, lo, hi = pub.value, ours.value, ours.lo, ours.hi
    tol, c = tolerance(pub), contrast(pub)
    P = _num(p, pub.unit)
    if pub.kind == "direction":          # a claim of direction only: ours below (side -1) or above (+1) the contrast
        edge = c * (1 + MIN_EFFECT) ** pub.side
        if all(pub.side * (x - edge) > 0 for x in (lo, hi)):
            return HOLDS, (f"ours {_num(v, ours.unit)} ({value_range(lo, hi)}) lies {'below' if pub.side < 0 else 'above'} "
                           f"{_num(c, ours.unit)} by more than {MIN_EFFECT:.0%}")
        return FAILS, f"ours {_num(v, ours.unit)} ({value_range(lo, hi)}) is not {'below' if pub.side < 0 else 'above'} {_num(c, ours.unit)}"
    if p == 0:                           # a count published as zero
        return (HOLDS, "ours is zero too") if lo == hi == 0 else (FAILS, f"ours is {_num(v, pub.unit)}, not zero")
    side = (1 if p > c else -1) if c is not None else 1
    clear = c is None or all(side * (x - c * (1 + MIN_EFFECT) ** side) > 0 for x in ((v,) if pub.up_to else (lo, hi)))
    if pub.up_to:
        units, words = _units_clear(ours, c, side)
        if clear and not units:
            return FAILS, (f"our best {_num(v, pub.unit)} clears {_num(c, pub.unit)} but one unit is not an effect: "
                           f"the {words} does not clear {_num(c, pub.unit)} ± {MIN_EFFECT:.0%}"
                           + ("" if ours.noise is None else f", nor does the best clear the repeats' noise "
                              f"(±{ours.noise:.0%})"))
        if clear and side * (v / p - 1) >= -tol:
            return HOLDS, (f"our best {_num(v, pub.unit)} reaches the published {P} (within {tol:.0%} or past it)"
                           + (f"; the {words} clears {_num(c, pub.unit)}" if c is not None else ""))
    elif clear:
        if lo == hi == p:
            return HOLDS, f"ours equals the published {P}"
        if lo <= p <= hi:
            return HOLDS, f"the published {P} lies inside ours ({value_range(lo, hi)})"
        if abs(v / p - 1) <= tol:
            return HOLDS, f"ours is within {tol:.0%} of the published {P} ({v / p - 1:+.0%})"
    if c is not None:
        if clear:
            return PART, (f"the direction holds, the size does not: ours {'(best) ' if pub.up_to else ''}"
                          f"{_num(v, pub.unit)} ({'larger' if side * (v - p) > 0 else 'smaller'}) against the "
                          f"published {P}, tolerance {tol:.0%}")
        return FAILS, (f"ours {_num(v, pub.unit)} does not clear {_num(c, pub.unit)} in the published direction "
                       f"({'best' if pub.up_to else 'spread'} {value_range(lo, hi) if not pub.up_to else _num(v, pub.unit)} "
                       f"against {_num(c, pub.unit)} ± {MIN_EFFECT:.0%})")
    if 1 / PART_FACTOR <= v / p <= PART_FACTOR:
        return PART, f"ours is {v / p - 1:+.0%} from the published {P}: same order, outside {tol:.0%}"
    return FAILS, f"ours is {v / p:.2g}× the published {P}: beyond a factor of {PART_FACTOR:g}"


def _units_clear(ours: Figure, c: float | None, side: int) -> tuple[bool, str]:
    """An "up to" figure: does the median's interval over its units (no median: its whole spread) clear the contrast
    ± MIN_EFFECT, or its best unit the unit-to-unit noise its repeats measured? And the interval in words."""
    if c is None:
        return True, ""
    m = ours.median or (ours.value, ours.lo, ours.hi)
    edge = m[1] if side > 0 else m[2]
    words = (f"median {_num(m[0], '', False)} [{value_range(m[1], m[2])}]" if ours.median
             else f"spread {value_range(m[1], m[2])}")
    interval = side * (edge - c * (1 + MIN_EFFECT) ** side) > 0
    noise = ours.noise is not None and side * (ours.value - c * (1 + ours.noise) ** side) > 0
    return interval or noise, words


def checked_terms(model_checked) -> tuple[str, ...]:
    """The scaled terms a cost-model figure had checked on a second GPU (`True`, as rows once said it: the link)."""
    if model_checked is True:
        return ("link",)
    return tuple(t for t in SCALED_TERMS if t in (model_checked or ()))


def _crossover(v: str, why: str, half: tuple) -> tuple[str, str]:
    """A crossover claim's verdict from both halves: holds where both hold, in part where one does."""
    words, pub, fig = half
    ov, owhy = judge(pub, fig) if fig is not None else (UNTESTED, "no figure of ours measures it")
    got = (v, ov)
    verdict = HOLDS if got == (HOLDS, HOLDS) else PART if HOLDS in got or PART in got else FAILS
    return verdict, f"one half: {why}; the other half ({words}): {owhy}"


def decide(c: Claim) -> Verdict:
    """The verdict rule (`rule_text`), the one function every row goes through."""
    if c.construction is not None:
        v, why = judge(c.published, c.construction)
        if v == HOLDS:
            return Verdict(CONSTRUCTION, f"{c.construction.what}: {why}", "the model's shape", False)
        return Verdict(v, f"{c.construction.what}: {why}", "the model's shape", False)
    unchecked = [t for t in SCALED_TERMS if t not in checked_terms(c.model_checked)]
    deciding = [(fig, basis, provisional) for fig, basis, provisional in (
        (c.terms, "published terms" + (f" (proxy: {c.proxy})" if c.proxy else ""), bool(c.proxy)),
        (c.model, "cost model" + (f" ({c.model_basis})" if c.model_basis else " (checked)" if not unchecked else
                                  f" (unchecked on a second GPU: {', '.join(unchecked)})"), bool(unchecked)),
        (c.stand_in, "stand-in", True)) if fig is not None]
    if c.regime:        # neither way: a point outside the regime can not refute, nor confirm
        basis, provisional = deciding[0][1:] if deciding else ("none", False)
        return Verdict(OUT_OF_REGIME, c.regime, basis, provisional)
    if deciding:
        fig, basis, provisional = deciding[0]
        v, why = judge(c.published, fig)
        if c.other_half is not None:
            v, why = _crossover(v, why, c.other_half)
        return Verdict(v, why + (f"; {c.caveat}" if c.caveat else ""), basis, provisional)
    return Verdict(UNTESTED, c.untestable or "no figure of ours measures it", "none", False)
