"""`labkit serve`'s Prometheus `/metrics`, under vLLM's metric names, so what reads vLLM reads it too (the
serve sweep's `servermetrics` scraper, AIPerf's server metrics, a Grafana dashboard made for vLLM).

Same names, types, labels (`model_name`, `engine`) and buckets as vLLM's v1 engine, for what the scheduler
measures: running/waiting requests, KV cache usage (pages in use over all lanes), prompt/generation token
counters, finished requests by reason, and the per-request histograms (TTFT, inter-token latency, TPOT,
E2E, queue / prefill / decode / inference time, prompt and generation lengths, max_tokens). All times are
on the scheduler's clock, from the moment a request was queued, as in `/stats`. What vLLM has no name for
carries a `labkit:` prefix: requests running in the offload lane, finished requests per lane.
There is no prefix cache, so no prefix-cache counters (and `cached_tokens` is 0).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


def _1_2_5(top: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `top`."""
    out, e = [], 1
    while True:
        for m in (1, 2, 5):
            if m * e > top:
                return out
            out.append(m * e)
        e *= 10


class _Gauges:
    """Gauges read from the scheduler at scrape time (no thread has to keep them current)."""

    def __init__(self, sched, labels: list[str]):
        self.sched, self.labels = sched, labels

    def collect(self):
        s = self.sched
        pre = s.prefilling                  # read once: the scheduler's thread may clear it meanwhile
        pre = pre[1].name if pre is not None else None
        running = {n: len(l.running) + int(pre == n) for n, l in s.lanes.items()}
        names = ["model_name", "engine"]
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", sum(running.values())),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(s.waiting) + len(s.future))):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(self.labels, value)
            yield g
        pages = [l.cache.pages for l in s.lanes.values()]
        total = sum(p.n_pages for p in pages)
        g = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=names)
        g.add_metric(self.labels, (total - sum(p.n_free for p in pages)) / total if total else 0.0)
        yield g
        g = GaugeMetricFamily("labkit:num_requests_running_by_lane",
                              "Requests running (or being prefilled) per lane: resident (device KV) or offload (host KV).",
                              labels=names + ["lane"])
        for lane, n in running.items():
            g.add_metric(self.labels + [lane], n)
        yield g


class ServeMetrics:
    def __init__(self, sched, model_name: str, max_model_len: int):
        self.registry = reg = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.values = [model_name, "0"]
        reg.register(_Gauges(sched, self.values))

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=reg)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(*self.values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*self.values)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(*self.values)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(*self.values)
        self.success = counter("vllm:request_success", "Count of successfully processed requests.", ["finished_reason"])
        for reason in ("stop", "length", "abort"):      # present from the start, as vLLM's are
            self.success.labels(*self.values, reason)
        self.by_lane = counter("labkit:request_finished_by_lane", "Finished requests per lane.", ["lane"])
        tokens = _1_2_5(max_model_len)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TPOT_BUCKETS)
        self.tpot_legacy = hist("vllm:time_per_output_token_seconds",
                                "Histogram of time per output token in seconds (every gap; vLLM's older name).", TPOT_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS)
        self.n_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.n_gen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.max_tokens = hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens)

    def token(self, req, t: float) -> None:
        """One generated token (the scheduler's thread); the first one ends the prompt's prefill."""
        n = len(req.tokens)
        if n == 1:
            self.prompt_tokens.inc(len(req.prompt))
            self.ttft.observe(t - req.arrival)
        else:
            gap = t - req.token_times[-2]
            self.itl.observe(gap)
            self.tpot_legacy.observe(gap)
        self.generation_tokens.inc()

    def finished(self, req, reason: str, max_tokens: int) -> None:
        """A request that ended (done, stopped or aborted); reason is vLLM's finish reason."""
        self.success.labels(*self.values, reason).inc()
        if req.lane:
            self.by_lane.labels(*self.values, req.lane).inc()
        tt = req.token_times
        if not tt:
            return
        end, first = tt[-1], tt[0]
        start = req.start_time if req.start_time is not None else req.arrival
        self.e2e.observe(end - req.arrival)
        self.queue.observe(start - req.arrival)
        self.prefill.observe(first - start)
        self.decode.observe(end - first)
        self.inference.observe(end - start)
        if len(tt) > 1:
            self.tpot.observe((end - first) / (len(tt) - 1))
        self.n_prompt.observe(len(req.prompt))
        self.n_gen.observe(len(tt))
        self.max_tokens.observe(max_tokens)

    def page(self) -> bytes:
        return generate_latest(self.registry)
