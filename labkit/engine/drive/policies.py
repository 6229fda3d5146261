"""The placement policies a trace replay names, built for one scheduler: the engine's (`threshold:N`,
`adaptive`, `resident`, `offload`), `noswitch:N` (threshold placement, batches in turn) and
`adaptive:MIN:HIDE` (`FittedAdaptive`: the engine's adaptive rule with its two constants as values, so that
a window replay can fit them on calibration windows instead of taking the ones written into the rule)."""
from __future__ import annotations

import math

from ...params import BadInput
from .scheduler import Adaptive, Costs, parse_policy


def parse_fitted(policy: str) -> tuple[int, float] | None:
    """`adaptive:MIN:HIDE` -> (MIN, HIDE): the adaptive placement with its two constants given (the engine's
    `adaptive` uses the indexer budget and 1); anything else -> None. A malformed one is one BadInput line."""
    if not policy.startswith("adaptive:"):
        return None
    parts = policy.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        m, h = int(parts[1]), float(parts[2])
    except ValueError:
        raise BadInput(f"policy {policy!r}: adaptive with constants is adaptive:MIN_TOKENS:HIDE, e.g. adaptive:8192:1") from None
    if m < 0 or not h > 0 or math.isinf(h):
        raise BadInput(f"policy {policy!r}: MIN_TOKENS must be >= 0 and HIDE a number > 0")
    return m, h


def fitted_name(min_tokens: int, hide: float) -> str:
    return f"adaptive:{int(min_tokens)}:{float(hide):g}"


class FittedAdaptive(Adaptive):
    """`scheduler.Adaptive` with its constants given:

    - `min_tokens`: a request within its share of the device pool is offloaded (when its transfer hides)
      from this prompt length on; the engine's rule uses the indexer budget;
    - `hide`: a transfer counts as hidden when transfer(B_o + 1) <= hide x compute(B_n); the engine's rule
      uses 1.

    With (budget, 1) it places exactly as the engine's rule (a test holds the two together)."""

    def __init__(self, costs: Costs, min_tokens: int, hide: float):
        super().__init__(costs)
        self.min_tokens, self.hide = int(min_tokens), float(hide)

    def offload_from(self, res) -> int:
        return self.min_tokens


def needs_costs(policy: str) -> bool:
    """The adaptive policies place by measured costs (`scheduler.calibrate` before the replay)."""
    return policy == "adaptive" or policy.startswith("adaptive:")


def make_policy(policy: str, costs: Costs | None):
    """The placement object for a policy name; `noswitch:N` places as `threshold:N` (the scheduler is told
    not to switch)."""
    fitted = parse_fitted(policy)
    if fitted is not None:
        if costs is None:
            raise ValueError(f"{policy} needs measured costs (scheduler.calibrate)")
        return FittedAdaptive(costs, *fitted)
    return parse_policy(policy.replace("noswitch:", "threshold:"), costs)


def check_policy(policy: str) -> None:
    """One BadInput line for a policy name no replay can build (nothing is measured or allocated)."""
    if parse_fitted(policy) is None:
        parse_policy(policy.replace("noswitch:", "threshold:"), Costs(0, 0, 0))
