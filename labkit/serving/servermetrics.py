"""The server's `/metrics` (Prometheus text) scraped at 1-2 Hz beside NVML, parsed with prometheus_client.

    with MetricsScraper(base_url, period_s=0.5, extra=connector_stats_reader) as s:
        ...load...
    s.frame()        # one row per scrape: timestamp, source="vllm", kv_cache_usage_perc, num_requests_running, ...

Kept: KV cache usage, running/waiting requests, prefix-cache queries/hits, prompt tokens by cache source
(`prompt_tokens_cached_<source>`), prompt/generation token totals, preemptions; plus, through `extra`,
labkit's connector counters (its JSON stats files). Counters are cumulative: differences between two
scrapes give rates. Values are summed over label sets other than `source` (one engine, one model).
"""
from __future__ import annotations

import threading
import time

import httpx
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

from ..telemetry import Background

KEEP = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_perc",          # name before vLLM 0.10
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "num_preemptions",
    "vllm:external_prefix_cache_queries_total": "external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits_total": "external_prefix_cache_hits",
    # llama.cpp's server (`--metrics`), under the same names where they mean the same
    "llamacpp:kv_cache_usage_ratio": "kv_cache_usage_perc",
    "llamacpp:requests_processing": "num_requests_running",
    "llamacpp:requests_deferred": "num_requests_waiting",
    "llamacpp:prompt_tokens_total": "prompt_tokens",
    "llamacpp:tokens_predicted_total": "generation_tokens",
}
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


def parse_metrics(text: str) -> dict:
    """Selected values from one /metrics page (sums over label sets; cached tokens split by source)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in KEEP:
                key = KEEP[s.name]
                out[key] = out.get(key, 0.0) + float(s.value)
            elif s.name == BY_SOURCE or s.name == BY_SOURCE[:-6]:
                key = f"prompt_tokens_cached_{s.labels.get('source', 'unknown')}"
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


class MetricsScraper(Background):
    def __init__(self, base_url: str, period_s: float = 0.5, extra=None, tags: dict | None = None):
        self.url = base_url.rstrip("/") + "/metrics"
        self.period_s, self.extra, self.tags = period_s, extra, dict(tags or {})
        self.rows: list[dict] = []
        self.errors = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def scrape_once(self, client: httpx.Client) -> dict | None:
        row = {"timestamp": time.time(), "source": "vllm", **self.tags}
        try:
            r = client.get(self.url)
            r.raise_for_status()
            row.update(parse_metrics(r.text))
        except Exception:
            self.errors += 1          # a server that died mid-sweep: the gap in the series shows it
            return None
        if self.extra is not None:
            try:
                row.update(self.extra())
            except Exception:
                pass
        with self._lock:
            self.rows.append(row)
        return row

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                self.scrape_once(client)
                self._stop.wait(max(0.0, self.period_s - (time.monotonic() - t)))

    def set_tags(self, **tags) -> None:
        with self._lock:
            self.tags.update(tags)

    def start(self) -> "MetricsScraper":
        self._launch("labkit-metrics")
        return self

    def frame(self) -> pd.DataFrame:
        with self._lock:
            return pd.DataFrame(self.rows)
