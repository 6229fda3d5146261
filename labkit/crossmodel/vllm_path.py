"""The mapped path through a real vLLM server: TTFT against vLLM's own prefill, and the vLLM path's quality.

One server (the large model, `--no-enable-prefix-caching` so repeats are honest, labkit's connector
configured) serves both paths: a prompt without a /dev/shm file is prefilled by vLLM as usual (the
baseline), a prompt whose file the producer wrote is loaded by the connector and only its last token
computed. The producer runs in this process (both models loaded once, warm).

TTFT of a request = time from the batch's arrival (t0) until its one-token completion returns:
baseline requests are all sent at t0; on the mapped path the producer writes the batch's files one
after another and each request is sent when its file is complete. Concurrency c = c requests at t0.

Quality: the same held-out sequences as the transformers reference; perplexity of the continuation
from vLLM's `prompt_logprobs` with the cache loaded from the file (covering prompt_len - 1 tokens,
whole blocks) vs vLLM's own prefill, and top-1 agreement teacher-forced on vLLM's own greedy tokens.

The server's lifecycle is the serving experiment's (`labkit.serving.lifecycle`); vLLM runs from `.venv-vllm`
(`make vllm-venv`) or `$LABKIT_VLLM_PYTHON`.
"""

from __future__ import annotations

from .. import envs
import json
import math
import threading
import time
import urllib.request
from pathlib import Path

import pandas as pd
import torch

from labkit.results import REPO
from labkit.crossmodel.mapped_cache import EXACT_PREFIX
from labkit.crossmodel import shm
from labkit.crossmodel.heldout import as_seq
from labkit.crossmodel.producer import Producer
from labkit.crossmodel.quality import summarize, pooled
from labkit.quality.corpora import sequences
from labkit.serving.lifecycle import VllmServer


class Server:
    """The large model behind `vllm serve` with labkit's connector, on the serving experiment's lifecycle
    (`labkit.serving.lifecycle.VllmServer`: launcher from .venv-vllm, 127.0.0.1 and a free port, /health,
    stop by process group)."""

    def __init__(self, ckpt: str, fingerprint: str, shm_root: Path, log_path: Path, max_model_len: int = 8192,
                 dtype: str = "float32", kv_space_gib: int = 2, startup_timeout_s: float = 900):
        cache = Path(envs.get("LABKIT_CACHE") or Path.home() / ".cache" / "labkit") / "vllm"
        (cache / "tmp").mkdir(parents=True, exist_ok=True)
        env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "VLLM_CACHE_ROOT": str(cache), "TMPDIR": str(cache / "tmp"), "HF_HUB_OFFLINE": "1",
               "LABKIT_XFER_SHM": str(shm_root)}
        ktc = {"kv_connector": "LabkitXferConnector", "kv_connector_module_path": "labkit.crossmodel.shm_connector",
               "kv_role": "kv_consumer", "kv_connector_extra_config": {"shm_root": str(shm_root), "fingerprint": fingerprint,
                                                                       "zero_fill_prompt_logprobs": True}}
        args = [ckpt, "--served-model-name", "large", "--max-model-len", str(max_model_len), "--enforce-eager",
                "--dtype", dtype, "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-transfer-config", json.dumps(ktc)]
        self.log_path = Path(log_path)
        self.srv = VllmServer(args, env, self.log_path, startup_timeout_s=startup_timeout_s).start()
        self.url, self.cmd = self.srv.base_url, self.srv.command

    def wait(self) -> float:
        return self.srv.wait_healthy()

    def stop(self) -> None:
        self.srv.stop()

    def complete(self, ids, max_tokens: int = 1, prompt_logprobs: int | None = None, timeout: float = 900,
                 load: bool = False) -> dict:
        body = {"model": "large", "prompt": [int(x) for x in ids], "max_tokens": max_tokens, "temperature": 0.0}
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if load:  # prompt logprobs *with* the connector's tokens (see connector.FORCE_KEY)
            body["vllm_xargs"] = {"labkit_xfer_load": 1}
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())


def _cached_tokens(resp: dict) -> int:
    d = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(d.get("cached_tokens") or 0)


def _prompt_nll(resp: dict, ids, first: int) -> tuple[float, list[int]]:
    """Summed NLL of ids[first:] from prompt_logprobs, and the top-1 token at each of those positions."""
    pl = resp["choices"][0]["prompt_logprobs"]
    shift = len(ids) - len(pl)  # an engine that loaded a prefix may return only the computed tail
    nll, top = 0.0, []
    for pos in range(first, len(ids)):
        entry = pl[pos - shift]
        if entry is None:
            raise RuntimeError(f"vLLM returned no prompt logprob at position {pos}")
        tok = entry.get(str(int(ids[pos])))
        nll -= float(tok["logprob"])
        best = min(entry.items(), key=lambda kv: kv[1].get("rank", 1 << 30))
        top.append(int(best[0]))
    return nll, top


def quality_vllm(server: Server, prod, seqs, prompt_len: int, cont_len: int, agree_tokens: int, log=print) -> list[dict]:
    rows = []
    cover = prompt_len - 1

    for s in map(as_seq, seqs):
        corpus, name, ids = s.corpus, s.document, [int(x) for x in s.ids[: prompt_len + cont_len]]
        base = {"corpus": corpus, "document": name, "offset": s.offset, "prompt_len": prompt_len, "cont_len": cont_len,
                "n_tokens": cont_len, "agree_tokens": agree_tokens}
        true = server.complete(ids, prompt_logprobs=1)
        nll_true, _ = _prompt_nll(true, ids, prompt_len)
        ref_ids = _completion_ids(server, ids[:prompt_len], agree_tokens)
        forced = ids[:prompt_len] + ref_ids[:-1]
        prod.produce(ids, cover=cover)
        mapped = server.complete(ids, prompt_logprobs=1, load=True)
        loaded = _cached_tokens(mapped)
        nll_m, _ = _prompt_nll(mapped, ids, prompt_len)
        prod.produce(forced, cover=cover)
        fr = server.complete(forced, prompt_logprobs=1, load=True)
        _, top = _prompt_nll(fr, forced, prompt_len)
        agree = sum(int(a == b) for a, b in zip(top + [None], ref_ids)) / len(ref_ids)
        for f in (ids, forced):
            Path(_path(prod, f)).unlink(missing_ok=True)
        rows.append(dict(base, mode="true", nll_sum=nll_true, ppl=math.exp(nll_true / cont_len),
                         ppl_true=math.exp(nll_true / cont_len), ppl_ratio=1.0, top1_agree=1.0, loaded_tokens=0))
        rows.append(dict(base, mode="mapped", nll_sum=nll_m, ppl=math.exp(nll_m / cont_len),
                         ppl_true=math.exp(nll_true / cont_len), ppl_ratio=math.exp((nll_m - nll_true) / cont_len),
                         top1_agree=agree, loaded_tokens=loaded))
        if log:
            log(f"vLLM {corpus}/{name}: ppl true {rows[-2]['ppl']:.3f} mapped {rows[-1]['ppl']:.3f} "
                f"(ratio {rows[-1]['ppl_ratio']:.4f}), top1 {agree:.3f}, connector loaded {loaded} tokens")
    return rows


def _path(prod, ids):
    return shm.path_for(ids, prod.root)


def _completion_ids(server: Server, prompt, n: int) -> list[int]:
    """Token ids of a completion: re-tokenized through the server's /tokenize of prompt + text would
    drift, so ask for them with logprobs instead."""
    body = {"model": "large", "prompt": [int(x) for x in prompt], "max_tokens": n, "temperature": 0.0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.loads(r.read())
    toks = out["choices"][0]["logprobs"]["tokens"]
    return [int(t.split(":", 1)[1]) for t in toks]


def ttft_vllm(server: Server, prod, tokenizer, lens, concurrency, repeats: int, log=print):
    need = max(concurrency) * (repeats + 1) * 2
    pool = {n: [ids[:n].tolist() for _, ids in sequences(tokenizer, "prose", n, min(need, 30), split="eval")]
            for n in lens}
    # c=1 at every length first, then higher concurrency: a run cut short keeps the most basic points;
    # each point is yielded (and recorded by the caller) as soon as it is measured
    for c in concurrency:
        for n in lens:
            docs = pool[n]
            k = 0

            def nxt():
                nonlocal k
                k += 1
                return docs[(k - 1) % len(docs)]

            res = {"large_prefill": [], "mapped": []}
            parts = []
            for r in range(repeats + 1):
                for strat in ("large_prefill", "mapped"):
                    prompts = [nxt() for _ in range(c)]
                    # distinct prompts per request; a repeated prompt would only differ by the last token
                    prompts = [p[:-1] + [(p[-1] + 1 + i + r) % 49152] if len(docs) < need else p for i, p in enumerate(prompts)]
                    done = [None] * c
                    info = [None] * c
                    loaded = [0] * c

                    def send(i, p):
                        resp = server.complete(p)
                        done[i] = time.perf_counter()
                        loaded[i] = _cached_tokens(resp)

                    t0 = time.perf_counter()
                    threads = []
                    for i, p in enumerate(prompts):
                        if strat == "mapped":
                            info[i] = prod.produce(p)
                            info[i]["ready"] = time.perf_counter()
                        th = threading.Thread(target=send, args=(i, p))
                        th.start()
                        threads.append(th)
                    for th in threads:
                        th.join()
                    for p in prompts:
                        Path(_path(prod, p)).unlink(missing_ok=True)
                    if r == 0:
                        continue
                    res[strat] += [d - t0 for d in done]
                    if strat == "mapped":
                        if c == 1:
                            parts.append({"small_prefill_ms": info[0]["small_prefill_s"] * 1e3,
                                          "mapping_ms": info[0]["mapping_s"] * 1e3, "prefix_ms": info[0]["prefix_s"] * 1e3,
                                          "write_ms": info[0]["write_s"] * 1e3,
                                          "engine_ms": (done[0] - info[0]["ready"]) * 1e3})
                        res.setdefault("loaded", []).extend(loaded)
            base = {"kind": "ttft", "backend": "vllm", "context_len": n, "concurrency": c, "repeats": repeats}
            st = {}
            for strat in ("large_prefill", "mapped"):
                s = pd.Series(res[strat]) * 1e3
                st[strat] = s.median()
                row = dict(base, strategy=strat, ttft_ms_median=s.median(), ttft_ms_min=s.min(), ttft_ms_max=s.max(),
                           requests=len(s))
                if strat == "mapped":
                    row["speedup"] = st["large_prefill"] / st["mapped"]
                    row["loaded_tokens_min"] = min(res.get("loaded", [0]))
                    row["shm_bytes"] = prod.bytes_for(n - 1)
                    if parts:
                        row.update({k2: float(pd.Series([x[k2] for x in parts]).median()) for k2 in parts[0]})
                yield row
            if log:
                log(f"TTFT vLLM {n} tokens c={c}: large {st['large_prefill']:.0f} ms, mapped {st['mapped']:.0f} ms "
                    f"({st['large_prefill'] / st['mapped']:.2f}x), loaded >= {min(res.get('loaded', [0]))} tokens")


def run_vllm(models, mapper, mapper_path, seqs, run, base: dict, *, prompt_len: int, cont_len: int,
             agree_tokens: int, ttft_lens, concurrency, repeats: int, exact_prefix: int = EXACT_PREFIX,
             log=print) -> None:
    """The vLLM stage of a crossmodel run: quality on `seqs` (prompt_len, cont_len, agree_tokens), then TTFT at
    each of `ttft_lens` and `concurrency` (`repeats` each), into `run` with `base`'s columns."""
    root = shm.default_root()
    prod = Producer(models, mapper, root, dtype=torch.float32, exact_prefix=exact_prefix)
    server = Server(models.pair.large.path, models.pair.large.fingerprint, root, run.path / "vllm_server.log")
    try:
        startup = server.wait()
        run.update_manifest(vllm={"startup_s": round(startup, 1), "cmd": server.cmd[1:],
                                  "note": "vllm-cpu 0.32.0 (third-party CPU build of vLLM 0.32), CPU timings"})
        log(f"vLLM healthy after {startup:.0f} s")
        for row in quality_vllm(server, prod, seqs, prompt_len, cont_len, agree_tokens, log=log):
            run.add(dict(base, kind="quality", backend="vllm", strategy=row["mode"], status="ok", error=None,
                         context_len=row["prompt_len"], concurrency=1, repeats=1, **row))
        m = run.metrics()
        qv = m[(m.get("kind") == "quality") & (m["backend"] == "vllm")]
        if not qv.empty:
            prev = run.path / "quality_summary.parquet"
            old = pd.read_parquet(prev) if prev.is_file() else pd.DataFrame()
            run.write_table("quality_summary", pd.concat([old, summarize(qv).assign(backend="vllm")], ignore_index=True))
            prev = run.path / "quality_pooled.parquet"
            old = pd.read_parquet(prev) if prev.is_file() else pd.DataFrame()
            run.write_table("quality_pooled", pd.concat([old, pooled(qv).assign(backend="vllm")], ignore_index=True))
        if ttft_lens:
            for row in ttft_vllm(server, prod, models.tokenizer, ttft_lens, concurrency, repeats, log=log):
                run.add(dict(base, status="ok", error=None, **row))
    finally:
        server.stop()
