""""Measure now" on a GPU: the explorer's button, pressed, over the committed H200 runs. The point it
measures (zero_copy, 64K context, budget 2048, concurrency 1, reference shape) is one the committed sweep
measured with today's engine (the resident step's speed moves every zero_copy figure, so the stored run
must be one of the same engine), so the live value is checked against it. Set LABKIT_LIVE_OUT=DIR to keep the live run folder
(the lead commits it under results/)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from browser_util import REPO

RUN = "20261203-060711-decode-64k-h200"


@pytest.mark.gpu
def test_measure_now_button_on_the_gpu():
    from labkit.explore import Explorer
    ex = Explorer(REPO / "results", RUN)
    assert not ex.measure.disabled, ex.why.value
    assert ex.w_run.value.startswith(RUN)
    ex.w_strat.value = ("zero_copy",)
    ex.w_ctx.value, ex.w_budget.value, ex.w_conc.value = 64 << 10, 2048, 1
    stored = ex.selected_point()
    assert len(stored) == 1
    ex.w_repeats.value, ex.w_steps.value = 3, 20
    ex.measure.click()                                    # the button's own handler
    assert ex.bar.description == "done", ex.status.value
    live = ex.live_rows[-1]
    ratio = live["tok_s"] / float(stored["tok_s"].iloc[0])
    summary = {"stored_run": RUN, "stored_tok_s": float(stored["tok_s"].iloc[0]), "live": live, "live_over_stored": ratio,
               "pcie_points_plotted": len(ex.fig_pcie.data[0].x), "status": ex.status.value}
    print(json.dumps(summary, default=str))
    out = os.environ.get("LABKIT_LIVE_OUT")
    if out:
        run_dir = Path(ex.status.value.split("<code>")[1].split("</code>")[0])
        shutil.copytree(run_dir, out, dirs_exist_ok=True)
        (Path(out) / "explore_live.json").write_text(json.dumps(summary, indent=1, default=str))
    assert live["h2d_bytes_per_step"] == 12 * 2048 * 2048            # 12 QSA layers x 2048 rows x 2 KiB
    assert live["nvml_rx_bytes_per_step"] and 0.9 < live["nvml_rx_bytes_per_step"] / live["h2d_bytes_per_step"] < 1.5
    assert 0.7 < ratio < 1.3, summary                               # same machine, same point as the committed sweep
    assert len(ex.fig_pcie.data[0].x) > 0                           # the live PCIe plot drew while it ran
