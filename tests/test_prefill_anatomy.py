"""The prefill anatomy: every chunk's phases add up to the chunk, the chunks cover the computed prompt, the
phases a dense prefill has are the ones timed, and the work formulas count what the definitions say."""
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.model.prefill_marks import PHASES, PrefillMarks
from labkit.shapes import ModelShape


def test_phases_add_up_to_each_chunk_and_the_chunks_cover_the_prompt():
    shape = ModelShape.from_name("tiny")
    model = HybridModel(shape, torch.device("cpu"), seed=0)
    for strategy, mode in (("resident", "sync"), ("zero_copy", "rotating")):
        st = get_strategy(strategy)
        cache = OffloadCache.allocate(model, st.medium, 1, 256)
        e = Engine(model, cache, st, 16, prefill_chunk=64, prefill_mode=mode)
        marks = PrefillMarks(torch.device("cpu"))
        with torch.inference_mode():
            e.prefill(0, torch.randint(0, shape.vocab, (200,)), marks=marks)
        rows = marks.chunks()
        assert [(r["start"], r["end"]) for r in rows] == [(0, 64), (64, 128), (128, 192), (192, 200)]
        for r in rows:
            total = sum(r[f"{p}_ms"] for p in PHASES)
            assert abs(total - r["chunk_ms"]) <= 1e-6 * max(1.0, r["chunk_ms"])
            for p in ("weights", "deltanet", "kv_write", "attention"):     # what a dense prefill does
                assert r[f"{p}_ms"] > 0, (mode, p)
            assert r["index_score_ms"] == 0 and r["selection_ms"] == 0     # sparse prefill only


def test_work_formulas_count_the_definitions():
    s = ModelShape.from_name("tiny")
    w = s.prefill_chunk_work(64, 128)
    pairs = sum(p + 1 for p in range(64, 128))                           # query at p sees p + 1 keys
    assert w["attention_flops"] == 4 * s.n_heads * s.head_dim * pairs * s.attn_layers
    sparse = s.prefill_chunk_work(64, 128, budget=16)
    assert sparse["attention_flops"] == 4 * s.n_heads * s.head_dim * 64 * 16 * s.attn_layers
    assert sparse["index_score_flops"] == 2 * s.index_heads * s.index_dim * pairs * s.attn_layers
    assert w["kv_read_bytes"] == 128 * s.row_bytes * s.attn_layers
