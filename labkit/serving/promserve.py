"""`labkit serve`'s Prometheus `/metrics`, under vLLM's metric names, so what reads vLLM reads it too (the
serve sweep's `servermetrics` scraper, AIPerf's server metrics, a Grafana dashboard made for vLLM).

Same names, types, labels (`model_name`, `engine`) and buckets as vLLM's v1 engine, for what the scheduler
measures: running/waiting requests, KV cache usage (pages in use over all lanes), prompt/generation token
counters, finished requests by reason, and the per-request histograms (TTFT, inter-token latency, TPOT,
E2E, queue / prefill / decode / inference time, prompt and generation lengths, max_tokens). All times are
on the scheduler's clock, from the moment a request was queued, as in `/stats`. What vLLM has no name for
carries a `labkit:` prefix: requests running in the offload lane, finished requests per lane.

The families vLLM 0.32 has that say what this engine does not have are there with their true values, so a
dashboard made for vLLM finds every panel: no prefix cache (`vllm:prefix_cache_queries` counts the prompt
tokens, every hit counter stays 0, every prompt token's source is `local_compute`), no multi-modal cache,
no queue limit (`vllm:admission_rejections` 0), never asleep, never preempted, n always 1. The process's own
families (`process_*`, `python_*`: memory, CPU time, open files, garbage collection) are prometheus_client's
collectors, as vLLM's server exports them. The five `http_*` families vLLM's API server gets from
prometheus-fastapi-instrumentator (requests by handler, method and status class; request and response sizes;
durations) are measured here by `HttpMetrics`, an ASGI middleware, the same way. Not exported: the per-step token histogram, the FLOP and byte
estimates and `vllm:cache_config_info` (vLLM's cache settings, most of which have no meaning here).
"""
from __future__ import annotations

import time

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter,
                               Histogram, Summary, generate_latest)
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]

# prometheus-fastapi-instrumentator's default buckets, and the handlers vLLM's server leaves out (a pattern
# found anywhere in the handler's template, or in the path where no route matched)
HTTP_HIGHR_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10,
                      30, 60]
HTTP_LOWR_BUCKETS = [0.1, 0.5, 1]
HTTP_EXCLUDED = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")


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
        g = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                              "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
                              "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
                              "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
                              labels=names + ["reason"])
        g.add_metric(self.labels + ["capacity"], len(s.waiting) + len(s.future))
        g.add_metric(self.labels + ["deferred"], 0)
        yield g
        g = GaugeMetricFamily("vllm:engine_sleep_state",
                              "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
                              "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                              labels=names + ["sleep_state"])
        for state, v in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            g.add_metric(self.labels + [state], v)
        yield g
        g = GaugeMetricFamily("labkit:num_requests_running_by_lane",
                              "Requests running (or being prefilled) per lane: resident (device KV) or offload (host KV).",
                              labels=names + ["lane"])
        for lane, n in running.items():
            g.add_metric(self.labels + [lane], n)
        yield g


class HttpFamilies:
    """The `http_*` families of prometheus-fastapi-instrumentator's default set, as vLLM's server names them."""

    def __init__(self, reg: CollectorRegistry):
        self.total = Counter("http_requests", "Total number of requests by method, status and handler.",
                             ["method", "status", "handler"], registry=reg)
        self.in_size = Summary("http_request_size_bytes", "Content length of incoming requests by handler (the "
                               "Content-Length header; the bytes read where there is none).", ["handler"], registry=reg)
        self.out_size = Summary("http_response_size_bytes", "Bytes of the response bodies sent, by handler.",
                                ["handler"], registry=reg)
        self.highr = Histogram("http_request_duration_highr_seconds", "Latency with many buckets but no API "
                               "specific labels. Made for more accurate percentile calculations.",
                               buckets=HTTP_HIGHR_BUCKETS, registry=reg)
        self.lowr = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler. Made to "
                              "be only used if aggregation by handler is important.", ["method", "handler"],
                              buckets=HTTP_LOWR_BUCKETS, registry=reg)

    def observe(self, method: str, handler: str, status: int, got: int, sent: int, seconds: float) -> None:
        self.total.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.in_size.labels(handler).observe(got)
        self.out_size.labels(handler).observe(sent)
        self.highr.observe(seconds)
        self.lowr.labels(method, handler).observe(seconds)


def route_template(routes, scope) -> str | None:
    """The path template of the route a request matches (a full match, else the first partial one: the path
    matched but not the method), as the instrumentator names handlers; None where no route matches."""
    partial = None
    for route in routes:
        path = getattr(route, "path", None)
        if path is None:
            continue
        match, _ = route.matches(scope)
        if match.name == "FULL":
            return path
        if match.name == "PARTIAL" and partial is None:
            partial = path
    return partial


class HttpMetrics:
    """ASGI middleware measuring every HTTP request the app answers into `HttpFamilies`, as the instrumentator
    does in vLLM's server: the handler is the matched route's template (`none` where no route matched), the
    status its class (`2xx`, `4xx`; 500 where the app raised before answering), the duration from the request
    reaching the app to its last body byte sent (a stream included). The request's size is its Content-Length
    header (the bytes the app read where there is none); the response's is the body bytes sent, which for a
    whole answer is its Content-Length and for a stream what it sent (the instrumentator reads only the header,
    so vLLM's streams count 0). Handlers in `HTTP_EXCLUDED` are not measured."""

    def __init__(self, app, router, families: HttpFamilies):
        self.app, self.router, self.families = app, router, families

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        path = route_template(self.router.routes, scope)
        if any(x in (path or scope["path"]) for x in HTTP_EXCLUDED):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        got, sent, status = 0, 0, 500

        async def counted_receive():
            nonlocal got
            message = await receive()
            if message["type"] == "http.request":
                got += len(message.get("body", b""))
            return message

        async def counted_send(message):
            nonlocal sent, status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)
        try:
            await self.app(scope, counted_receive, counted_send)
        finally:
            size = int(declared) if declared.isdigit() else got
            self.families.observe(scope["method"], path or "none", status, size, sent, time.perf_counter() - start)


class ServeMetrics:
    def __init__(self, sched, model_name: str, max_model_len: int):
        self.registry = reg = CollectorRegistry()
        self.http = HttpFamilies(reg)
        labels = ["model_name", "engine"]
        self.values = [model_name, "0"]
        reg.register(_Gauges(sched, self.values))
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):     # process_*, python_* (as vLLM's)
            reg.register(c)

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
        # what this engine has none of, at its true value (see the module note)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.").labels(*self.values)
        for name, doc in (("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                          ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                           "cross-instance cache sharing, in terms of number of queried tokens."),
                          ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                           "cross-instance cache sharing, in terms of number of cached tokens."),
                          ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
                          ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
                          ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")):
            counter(name, doc).labels(*self.values)
        self.by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ["source"])
        for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
            self.by_source.labels(*self.values, src)
        cached = counter("vllm:prompt_tokens_cached_by_source",
                         "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
                         "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
                         "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
                         "vllm:external_prefix_cache_hits.", ["source"])
        for src in ("device", "host", "p2p", "disk", "external_unspecified"):
            cached.labels(*self.values, src)
        rejected = Counter("vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by "
                           "reason.", ["model_name", "reason"], registry=reg)
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            rejected.labels(model_name, reason)
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
        self.max_gen = hist("vllm:request_max_num_generation_tokens",
                            "Histogram of maximum number of requested generation tokens.", tokens)
        self.n_param = hist("vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.preempted = hist("vllm:request_num_preemptions", "Histogram of the number of times a request was "
                              "preempted.", [1, 2, 3, 4, 5, 10, 20])
        self.prefill_kv = hist("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed "
                               "during prefill (excluding cached tokens).", tokens)

    def token(self, req, t: float) -> None:
        """One generated token (the scheduler's thread); the first one ends the prompt's prefill."""
        n = len(req.tokens)
        if n == 1:
            self.prompt_tokens.inc(len(req.prompt))
            self.prefix_queries.inc(len(req.prompt))
            self.by_source.labels(*self.values, "local_compute").inc(len(req.prompt))
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
        self.max_gen.observe(len(tt))
        self.n_param.observe(1)
        self.preempted.observe(0)
        self.prefill_kv.observe(len(req.prompt))

    def page(self) -> bytes:
        return generate_latest(self.registry)
