"""Weights read into L2 on a side stream (marked `gpu`): the touch kernel reads every word on the GPU
(each program's XOR against torch's), a decode step captured in one CUDA graph with the prefetch branches
gives bit-identical logits to the step without them (nothing is computed from what the branch reads), and
the piecewise graphs of a host strategy capture with it too (every branch joined before a graph ends)."""
import dataclasses

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.drive.runner import DecodeRunner
from labkit.engine.model import l2_prefetch as P
from labkit.shapes import PRESETS

pytestmark = pytest.mark.gpu
MID = dataclasses.replace(PRESETS["qwen3.8-flash-next"], name="mid", layers=8, vocab=4096)


def test_touch_reads_every_word_on_cuda():
    w = torch.randn(2048, 4096 + 8, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for max_bytes in (None, 5_000_000):
        sink = torch.full((P.SINK_SLOTS,), -1, dtype=torch.int32, device="cuda")
        words = w.view(-1).view(torch.int32)
        n = words.numel() if max_bytes is None else max_bytes // 4
        progs = P.touch(w, sink, max_bytes, sms)
        _, per = P.programs_for(n, sms)
        pad = torch.zeros(progs * per, dtype=torch.int32, device="cuda")
        pad[:n] = words[:n]
        seg = pad.view(progs, per).cpu().numpy()
        import numpy as np
        exp = np.bitwise_xor.reduce(seg, axis=1)
        assert sink[:progs].cpu().numpy().tolist() == exp.tolist()
        assert bool((sink[progs:] == -1).all())


def _logits(strategy: str, prefetch: bool, medium: str):
    P.set_enabled(prefetch)
    try:
        model = HybridModel(MID, "cuda", seed=11)
        cache = OffloadCache.allocate(model, medium, 4, 4096)
        cache.fill_random_([3000, 1000, 2500, 700], seed=2)
        r = DecodeRunner(Engine(model, cache, get_strategy(strategy), 512), 4)
        assert r.engine.l2.on == prefetch
        r.prepare(warmup=1)
        steps = []
        for i in range(4):
            r.state.tokens.copy_(torch.tensor([11, 222, 3333, 44], device="cuda") + i)
            r.step()
            steps.append(r.state.logits.float().clone())
        torch.cuda.synchronize()
        return r.graph_mode, torch.stack(steps)
    finally:
        P.set_enabled(False)


@pytest.mark.parametrize("strategy,medium", [("resident", "device"), ("zero_copy", "host"), ("host_gather", "host")])
def test_step_with_prefetch_branches_equals_step_without(strategy, medium):
    mode_off, off = _logits(strategy, False, medium)
    mode_on, on = _logits(strategy, True, medium)
    assert mode_on == mode_off
    assert torch.equal(on, off), (on - off).abs().max().item()
