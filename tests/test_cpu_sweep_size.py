"""`make sweep` on a CPU fits about five minutes on 2 quiet cores: the decode experiment's own estimate
(`measure._seconds`, the model `labkit run` uses to warn of a long run) of the CPU default, at a cost per step
for 2 quiet cores. That cost is the estimate's timing of a CPU (ms a step costs a request, ms per context
token, ms per cache token filled), scaled so that the earlier default (5 repeats of 20 steps) comes out at the
6 min 51 s it measured on 2 quiet cores. Planning only, nothing measured (a few seconds)."""
from __future__ import annotations

from labkit import experiments
from labkit.experiments.decode import measure as M

QUIET_2_CORES = (56.26, 0.002259, 0.002284)
EARLIER_DEFAULT_S = 6 * 60 + 51


def test_the_cpu_default_sweep_is_sized_to_about_five_minutes():
    pl = M.derive(experiments.plan("decode", {"device": "cpu"}))
    earlier = M._seconds(pl, QUIET_2_CORES, repeats=5, steps=20)[0]
    assert abs(earlier - EARLIER_DEFAULT_S) < 10, earlier          # the cost still stands for those cores
    now = M._seconds(pl, QUIET_2_CORES)[0]
    assert 4 * 60 <= now <= 5.5 * 60, now
    # the same axes as before: every strategy, three contexts, concurrency 1 and 4, a budget axis, a prefill
    p = pl.plan
    assert len(p.context_lens) == 3 and p.concurrency == (1, 4) and len(p.budgets) > 1 and p.prefill_lens
