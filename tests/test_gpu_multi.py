"""Several GPUs of one host (marked `gpu`; skipped below two GPUs): the layer split and the pipelined
micro-batches on real devices. Run on the x2 host: `pytest -m gpu tests/test_gpu_multi.py`."""
import dataclasses

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.drive.pipeline import PipelineEngine, bubbles, model_block_costs, place_layers, split_model
from labkit.shapes import PRESETS
from labkit.engine.drive.runner import DecodeRunner

pytestmark = pytest.mark.gpu
MID = dataclasses.replace(PRESETS["qwen3.8-flash-next-standin"], name="mid", layers=8, vocab=4096)
N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
need_two = pytest.mark.skipif(N_GPU < 2, reason=f"needs 2 GPUs, this host has {N_GPU}")


def _prompts(lens: list[int]) -> list[torch.Tensor]:
    return [torch.randint(0, MID.vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]


def _pipe(strategy: str, n_slots: int, lens: list[int], n_dev: int = 2, seed: int = 9) -> PipelineEngine:
    """Prefilled, not filled at random: a random fill draws each stage's layers from its own stream."""
    model = HybridModel(MID, "cpu", seed=seed)
    stages = split_model(model, place_layers(model_block_costs(model, 512), n_dev), [f"cuda:{i}" for i in range(n_dev)])
    pipe = PipelineEngine(stages, strategy, 512, n_slots=n_slots, capacity=8192)
    for s, t in enumerate(_prompts(lens)):
        pipe.prefill(s, t)
    return pipe


def _single(strategy: str, n_slots: int, lens: list[int], seed: int = 9) -> Engine:
    """The one-GPU reference: the same CPU-initialised weights as one stage on cuda:0, same prompts."""
    model = split_model(HybridModel(MID, "cpu", seed=seed), [(0, MID.layers)], ["cuda:0"])[0]
    st = get_strategy(strategy)
    e = Engine(model, OffloadCache.allocate(model, st.medium, n_slots, 8192), st, 512)
    for s, t in enumerate(_prompts(lens)):
        e.prefill(s, t.cuda())
    return e


@pytest.fixture
def launches_on_their_device(monkeypatch):
    """Fails the test if any Triton kernel is launched while another GPU than its tensors' is current
    (Triton launches on the current device; torch's own ops follow their tensors)."""
    from triton.runtime.jit import JITFunction
    wrong: list[str] = []
    run = JITFunction.run

    def checked(self, *args, **kwargs):
        cur = torch.cuda.current_device()
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.is_cuda and a.device.index != cur:
                wrong.append(f"{self.fn.__name__}: tensor on cuda:{a.device.index}, current cuda:{cur}")
                break
        return run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", checked)
    yield wrong
    assert not wrong, wrong[:5]


@need_two
@pytest.mark.parametrize("strategy", ["zero_copy", "resident"])
def test_split_over_two_gpus_equals_one_gpu(strategy, launches_on_their_device):
    """Logits, every QSA layer's selected positions and the bytes moved, step after step, identical to
    one GPU; every Triton launch under its stage's device (graphs captured, replayed, anatomy marked)."""
    lens = [5000, 3000]
    e = _single(strategy, 2, lens)
    r = DecodeRunner(e, 2)
    pipe = _pipe(strategy, 2, lens)
    pr = pipe.decoder(2)
    pr.grid[0][0].state.tokens.copy_(r.state.tokens.to("cuda:0"))
    r.prepare(1)
    pr.prepare(1)
    for _ in range(3):
        r.step()
        pr.step()
        torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
        assert torch.equal(pr.logits().cpu(), r.state.logits.cpu())
        sel = torch.cat([row.state.last_sel.cpu() for row in pr.grid[0]])
        assert torch.equal(sel, r.state.last_sel.cpu())
    assert pr.h2d_bytes_per_step == r.h2d_bytes_per_step
    assert pr.anatomy(repeats=2)["marked_step_ms"] > 0


@need_two
def test_pipelined_micro_batches_equal_each_micro_batch_alone(launches_on_their_device):
    """Four requests as two micro-batches in flight on two GPUs: each micro-batch's logits equal the same
    micro-batch (same slots, same size) decoded on one GPU; and the stages overlap (less idle than the
    stages taking turns)."""
    lens = [6000, 5000, 4000, 7000]
    pipe = _pipe("zero_copy", 4, lens)
    pr = pipe.decoder(4, micro_batches=2)
    refs = []
    for row in pr.grid:
        e = _single("zero_copy", 4, lens)
        ref = DecodeRunner(e, row[0].state.batch, first=row[0].state.span.start)
        row[0].state.tokens.copy_(ref.state.tokens.to("cuda:0"))
        ref.prepare(1)
        refs.append(ref)
    pr.prepare(1)
    for _ in range(3):
        pr.step()
        for ref, row in zip(refs, pr.grid):
            ref.step()
            torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
            assert torch.equal(row[-1].state.logits.cpu(), ref.state.logits.cpu())
    piped = bubbles(pr.timeline(steps=5))
    assert piped["bubble_share"] < 0.5, piped       # two stages taking turns idle >= half the time
