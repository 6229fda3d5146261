"""A model's logits over graph-replayed decode steps with teacher-forced tokens: the comparison the GPU
tests of a fused path against its torch path share (a near-tie flipping an argmax cannot send the two runs
down different paths, and whatever state or KV a step writes is what the later steps read)."""
import dataclasses

import torch

from labkit.engine import Engine, OffloadCache, get_strategy
from labkit.engine.drive.runner import DecodeRunner
from labkit.shapes import PRESETS

REF = PRESETS["qwen3.8-flash-next-standin"]
MID = dataclasses.replace(REF, name="mid", layers=8, vocab=4096)     # the reference's layers, 8 of them


def teacher_forced_logits(model, steps: int = 64) -> torch.Tensor:
    """[steps, 4, vocab] fp32 logits of 4 requests (3000/1000/2500/700 cached tokens, resident, budget 512)."""
    cache = OffloadCache.allocate(model, "device", 4, 4096)
    cache.fill_random_([3000, 1000, 2500, 700], seed=2)
    r = DecodeRunner(Engine(model, cache, get_strategy("resident"), 512), 4)
    r.prepare(warmup=1)
    assert r.graph_mode == "full"
    out = []
    for i in range(steps):
        r.state.tokens.copy_((torch.tensor([11, 222, 3333, 44], device="cuda") + 7 * i) % model.shape.vocab)
        r.step()
        out.append(r.state.logits.float().clone())
    torch.cuda.synchronize()
    return torch.stack(out)
