"""What every driver does the same way: issue a block generator's loads, capture CUDA graphs, warm up.

    res = load(engine, req)                         # the strategy moves req's rows; what moved
    res, done = load_async(engine, req, stream)     # on `stream`, from a background thread (async_load)
    results = [load(engine, req) for req in engine.decode_segments(state)]   # one step op by op, loads inline
    with capture(graph, device, pool):              # capture on a stream of that device
        ...
    warm_up(fn, device, n)                          # n calls outside any capture, on a side stream

Drivers (runner, pipeline, switching, scheduler) differ in *when* they issue loads and replay graphs, not
in how: that lives here once.
"""
from __future__ import annotations

import contextlib

import torch

from ..model.forward import Engine, LoadRequest
from ..transfer import LoadResult


def load(engine: Engine, req: LoadRequest) -> LoadResult:
    """Move the rows `req` names into its staging with the engine's strategy."""
    return engine.strategy.load(engine.cache.pool, req.layer, req.rows, req.out)


def load_async(engine: Engine, req: LoadRequest, stream: torch.cuda.Stream):
    """A strategy with `async_load`: queue the load on `stream` from its background thread; returns
    (LoadResult, Future of the event recorded after the last copy)."""
    if not engine.strategy.async_load:
        raise ValueError(f"{engine.strategy.name} has no asynchronous load")
    return engine.strategy.load_async(engine.cache.pool, req.layer, req.rows, req.out, stream)


_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One capture stream per device. torch.cuda.graph's default capture stream is one per process, made
    on whichever device captured first: a second GPU's work captured on it runs under the first GPU
    (cudaErrorStreamCaptureUnsupported on a two-GPU host)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    s = _capture_streams.get(device)
    if s is None:
        s = _capture_streams[device] = torch.cuda.Stream(device=device)
    return s


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool=None):
    """Capture into `graph` on a stream of `device` (the tensors' own device)."""
    with torch.cuda.graph(graph, pool=pool, stream=capture_stream(device)):
        yield graph


def warm_up(fn, device: torch.device, n: int = 1) -> None:
    """Call `fn` n times before any capture (kernels compiled, workspaces sized). On CUDA on a side stream,
    as torch.cuda.graph's own warm-up does: work on the legacy default stream cannot be captured after."""
    device = torch.device(device)
    if device.type != "cuda":
        for _ in range(n):
            fn()
        return
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
