"""A server the user already runs, as the serve experiment's target (`labkit run serve_sweep -p target=URL`).

    url = check_url("http://127.0.0.1:8000")          # BadInput (one line) for what is not a server's address
    ident = identify(url)                              # what the server says it is, as far as it says
    srv = Target(url)                                  # alive(), died(), start() and stop() as a launched server's

Nothing is launched or stopped: the sweep measures the server as it is. What it says about itself is recorded
(`identify`): `GET /version` (vLLM, SGLang), `GET /v1/models` (every OpenAI-compatible server; vLLM adds
`max_model_len` and the checkpoint's path as `root`, llama.cpp `meta.n_vocab` and `meta.n_ctx_train`),
`GET /props` (llama.cpp: build, context size, slots), the `/metrics` families (name and type; vLLM's `vllm:`,
SGLang's `sglang:`, llama.cpp's `llamacpp:` with `--metrics`) and the response headers of those requests. The
engine is named from those answers (`engine_of`), never assumed.

Prompts are token ids (`labkit.serving.workload`): an id must lie inside the server's vocabulary. `prompt_vocab`
takes it from what the server or the checkpoint says, else tries one id near the top of a common vocabulary and
a smaller one (a server answers an id it does not know with HTTP 400), and says which way it was found.
"""
from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
import time

import httpx

from ..params import BadInput, one_line

TIMEOUT_S = 10.0
COMMON_VOCAB = 32000          # every common vocabulary (Llama 2, Mistral, Qwen, Gemma, SmolLM2 ...) has at least these
SMALL_VOCAB = 512             # labkit's own `tiny` shape
KEEP_HEADERS = ("server", "x-request-id", "content-type", "via", "x-powered-by")
PREFIXES = {"vllm:": "vllm", "sglang:": "sglang", "llamacpp:": "llama.cpp", "tgi_": "tgi"}


def check_url(url: str) -> str:
    """The server's base URL (no trailing `/` or `/v1`), or one line saying why `url` is not one."""
    u = urllib.parse.urlsplit(url.strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise BadInput(f"target must be a server's URL such as http://127.0.0.1:8000, got {url!r}")
    if u.query or u.fragment:
        raise BadInput(f"target {url!r}: give the server's address without a query or fragment")
    try:
        u.port                       # an out-of-range or non-numeric port raises here
    except ValueError as ex:
        raise BadInput(f"target {url!r}: {ex}") from None
    path = u.path.rstrip("/")
    path = path[:-3] if path.endswith("/v1") else path
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path, "", ""))


def is_local(url: str) -> bool:
    """The server runs on this machine (loopback): this machine's GPU and telemetry are its."""
    host = urllib.parse.urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _get(client: httpx.Client, url: str, path: str) -> tuple[int | None, object, dict]:
    """(status, parsed JSON or text, kept headers) of one GET; status None when nothing answered."""
    try:
        r = client.get(url + path)
    except httpx.HTTPError:
        return None, None, {}
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return r.status_code, body, {k: v for k, v in r.headers.items() if k.lower() in KEEP_HEADERS}


def _parsed(text: str) -> list:
    """The /metrics page's families as Prometheus parses them ([] for what is not Prometheus text)."""
    # prometheus_client is the optional `serve` extra
    from prometheus_client.parser import text_string_to_metric_families
    try:
        return list(text_string_to_metric_families(text))
    except Exception:            # not Prometheus text: the server has no metrics page worth the name
        return []


def _families(text: str) -> list[dict]:
    """The /metrics page's families: name and type (the samples change, the families tell what is exposed)."""
    # prometheus_client's `_created` timestamps are families of their own in the text: not what a server exposes
    return [{"name": f.name, "type": f.type} for f in _parsed(text) if not f.name.endswith("_created")]


def cache_config(text: str) -> dict | None:
    """The labels of vLLM's `cache_config_info` gauge (`cache_dtype`, `block_size`, ...): how the server holds its
    KV cache, as it publishes it; None where the page has none."""
    for fam in _parsed(text):
        for sample in fam.samples:
            if sample.name.endswith("cache_config_info"):
                return dict(sample.labels)
    return None


def identify(url: str, timeout_s: float = TIMEOUT_S) -> dict:
    """What the server at `url` says about itself; BadInput (one line) when no OpenAI-compatible server answers."""
    with httpx.Client(timeout=timeout_s) as client:
        try:
            r = client.get(url + "/v1/models")
        except httpx.HTTPError as ex:
            raise BadInput(f"target {url}: no server answers ({one_line(ex)})") from None
        if r.status_code in (401, 403):
            raise BadInput(f"target {url}: the server wants an API key (HTTP {r.status_code}); labkit sends none, "
                           f"so start it without one on a loopback address")
        try:
            models = r.json()
            ids = [m["id"] for m in models["data"]]
        except (ValueError, KeyError, TypeError):
            raise BadInput(f"target {url}: GET /v1/models answered HTTP {r.status_code} without a model list: "
                           f"not an OpenAI-compatible server") from None
        headers = {"/v1/models": {k: v for k, v in r.headers.items() if k.lower() in KEEP_HEADERS}}
        out = {"url": url, "local": is_local(url), "models": models["data"], "model_ids": ids}
        for path in ("/version", "/props"):
            status, body, hdr = _get(client, url, path)
            out[path.strip("/")] = body if status == 200 and isinstance(body, dict) else None
            if status == 200:
                headers[path] = hdr
        status, body, hdr = _get(client, url, "/metrics")
        out["metric_families"] = _families(body) if status == 200 and isinstance(body, str) else []
        out["cache_config"] = cache_config(body) if status == 200 and isinstance(body, str) else None
        if status == 200:
            headers["/metrics"] = hdr
    out["props"] = _props_kept(out.pop("props"))
    out["headers"] = headers
    out["engine"], out["engine_version"] = engine_of(out)
    return out


def _props_kept(props: dict | None) -> dict | None:
    """llama.cpp's /props without its chat template (kilobytes of Jinja) and prompt defaults."""
    if not props:
        return None
    keep = {k: props[k] for k in ("build_info", "model_path", "total_slots", "n_ctx", "modalities") if k in props}
    gen = props.get("default_generation_settings") or {}
    if isinstance(gen, dict) and "n_ctx" in gen:
        keep.setdefault("n_ctx", gen["n_ctx"])
    return keep


def engine_of(ident: dict) -> tuple[str, str | None]:
    """(engine, version) from what the server said: labkit's own server by its models' owner, llama.cpp by its
    /props build, the others by their metric names and /version."""
    owners = {str(m.get("owned_by", "")).lower() for m in ident.get("models") or [] if isinstance(m, dict)}
    version = (ident.get("version") or {}).get("version")
    props = ident.get("props") or {}
    if "labkit" in owners:
        return "labkit-serve", None
    if props.get("build_info") or "llamacpp" in owners:
        return "llama.cpp", props.get("build_info")
    names = [f["name"] for f in ident.get("metric_families") or []]
    for prefix, engine in PREFIXES.items():
        if any(n.startswith(prefix) for n in names):
            return engine, version
    if "vllm" in owners:
        return "vllm", version
    return "unknown", version


def served_model(ident: dict, given: str) -> str:
    """The model name requests carry: `given` if the server serves it, else the server's only model."""
    ids = ident["model_ids"]
    if given:
        if given not in ids:
            raise BadInput(f"target {ident['url']} serves {', '.join(ids) or 'no model'}, not {given!r}")
        return given
    if len(ids) != 1:
        raise BadInput(f"target {ident['url']} serves {len(ids)} models ({', '.join(ids)}): name one with -p model=NAME")
    return ids[0]


def max_model_len(ident: dict, model: str) -> int | None:
    """Tokens one request may hold, where the server says: vLLM's and labkit's `max_model_len`, llama.cpp's
    per-slot context (its /props `n_ctx` is shared by the slots)."""
    for m in ident.get("models") or []:
        if isinstance(m, dict) and m.get("id") == model and isinstance(m.get("max_model_len"), int):
            return m["max_model_len"]
    props = ident.get("props") or {}
    if isinstance(props.get("n_ctx"), int) and props["n_ctx"] > 0:
        return props["n_ctx"] // max(1, int(props.get("total_slots") or 1))
    return None


@dataclass
class Vocab:
    size: int         # prompt ids are drawn below this
    found: str        # how it was found, for the manifest


def prompt_vocab(ident: dict, model: str, given: int = 0) -> Vocab:
    """The vocabulary prompt ids are drawn from: given, else what the server or the checkpoint says, else probed."""
    if given:
        return Vocab(given, "given (vocab parameter)")
    for m in ident.get("models") or []:
        meta = m.get("meta") if isinstance(m, dict) and m.get("id") == model else None
        if isinstance(meta, dict) and isinstance(meta.get("n_vocab"), int):
            return Vocab(meta["n_vocab"], "the server's /v1/models (meta.n_vocab)")
    for m in ident.get("models") or []:
        root = m.get("root") if isinstance(m, dict) and m.get("id") == model else None
        cfg = Path(str(root)) / "config.json" if root and ident.get("local") else None
        try:
            if cfg is not None and cfg.is_file():
                v = json.loads(cfg.read_text()).get("vocab_size")
                if isinstance(v, int) and v > 256:
                    return Vocab(v, "the checkpoint's config.json (the server's /v1/models root)")
        except (OSError, ValueError, AttributeError):
            pass
    for size in (COMMON_VOCAB, SMALL_VOCAB):
        if accepts_id(ident["url"], model, size - 1):
            return Vocab(size, f"probed: the server took token id {size - 1}")
    raise BadInput(f"target {ident['url']}: the server refused token ids {COMMON_VOCAB - 1} and {SMALL_VOCAB - 1}; "
                   f"give its vocabulary size with -p vocab=N")


def accepts_id(url: str, model: str, token: int) -> bool:
    """Does the server take a one-token prompt of this id (HTTP 200 for one generated token)?"""
    body = {"model": model, "prompt": [token], "max_tokens": 1, "temperature": 0.0}
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=60.0).status_code == 200
    except httpx.HTTPError:
        return False


class Target:
    """The running server as the sweep sees a launched one: a base URL, whether it answers; starting and
    stopping it are no-ops (it is the user's)."""

    def __init__(self, url: str):
        self.base_url, self.log_path, self.pid, self.command = url, None, None, None

    def alive(self) -> bool:
        try:
            return httpx.get(self.base_url + "/v1/models", timeout=TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def died(self, grace_s: float = 3.0) -> bool:
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self.alive():
                return False
            time.sleep(0.5)
        return not self.alive()

    def start(self) -> "Target":
        return self

    def stop(self) -> None:
        return None
