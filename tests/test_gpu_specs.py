"""`labkit/data/gpus.toml`, the figures the cost model scales by: every table names its vendor document and the
row of each value, and the tensor rates agree with the chips' arithmetic (the RTX 3090's is its dense bf16
tensor rate with FP32 accumulation, not its FP32 rate)."""
from __future__ import annotations

import re
import tomllib
from importlib import resources

import pytest

from labkit.costmodel import gpus

TEXT = resources.files("labkit").joinpath("data/gpus.toml").read_text()
DATA = tomllib.loads(TEXT)
DESCRIPTIVE = {"name", "arch", "note"}


def _blocks() -> dict[str, str]:
    """Each table's own lines (its comments included), from its header to the next."""
    parts = re.split(r"^\[([a-z0-9_]+)\]\s*$", TEXT, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_table_names_its_vendor_document_and_the_row_of_each_value():
    blocks = _blocks()
    assert set(blocks) == set(DATA) and len(DATA) >= 5
    for key, block in blocks.items():
        comments = "\n".join(ln for ln in block.splitlines() if ln.lstrip().startswith("#"))
        assert re.search(r"# Source: NVIDIA .*(whitepaper|datasheet)", comments), f"[{key}] names no vendor document"
        for field in set(DATA[key]) - DESCRIPTIVE:
            assert re.search(rf"\b{field}\b", comments), f"[{key}] {field} has no source line"


def test_the_rtx3090_rate_is_its_tensor_rate_with_fp32_accumulation():
    g = gpus()["rtx3090"]
    fp16_acc = g.sms * 4 * 128 * 2 * g.boost_mhz * 1e6 / 1e12        # 4 tensor cores per SM, 128 FMA each per clock
    assert g.bf16_tflops == pytest.approx(fp16_acc / 2, rel=0.01)    # GeForce Ampere: FP32 accumulation at half rate
    assert g.bf16_tflops > 2 * 35.6 * 0.99                             # not the FP32 (non-tensor) rate
    assert "half" in g.note and g.arch == "ampere" and g.tdp_w == 350


def test_the_a100_rate_agrees_with_its_clock_at_full_rate():
    g = gpus()["a100"]
    assert g.bf16_tflops == pytest.approx(g.sms * 4 * 256 * 2 * g.boost_mhz * 1e6 / 1e12, rel=0.01)


def test_every_gpu_has_its_default_power_limit_and_loads_into_the_cost_model():
    table = gpus()
    for key, g in table.items():
        assert g.tdp_w > 0 and g.bf16_tflops > 0 and g.arch in ("ampere", "ada", "hopper"), key
        assert g.hbm_gbps > 0 and g.link_gbps > 0
