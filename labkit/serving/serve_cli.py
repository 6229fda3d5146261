"""`labkit serve`'s front door: every option checked, each in one line, before anything is built; the server run
until a signal; and the one line a signal ends it with.

    $ labkit serve --port 99999
    labkit: --port must be 1 to 65535, got 99999                 (exit 2: nothing imported, nothing built)
    $ labkit serve --shape tiny
    labkit serve: shape tiny with seeded random weights ...; Ctrl-C stops it
    ^Clabkit: serve stopped by SIGINT (Ctrl-C) after 4 min 2 s; 118 requests finished         (exit 130)

Checks come cheapest first: numbers and words before torch is imported, then the shape, policy, device and
transfer strategy, then whether the slots' KV cache can fit the memory it would live in at all, and whether
the port is free. A number that is not finite (`nan`, `inf`) is out of every range. argparse's own errors
(`--port abc`) are one line too (`one_line_errors`).

SIGINT, SIGTERM and SIGHUP end the server the same way: while the model is built at once; while it serves,
through uvicorn's graceful shutdown (no new connections; requests in flight finish; a second Ctrl-C cuts them
off), then `labkit: serve stopped by ...` and 128 + the signal, as every labkit command stops (`labkit.stops`).
"""
from __future__ import annotations

import math
import signal
import socket
import sys
import threading
import time

from ..params import BadInput, gib, resolve_device
from .. import lazy, stops

# Imported when first used, after every option that needs nothing imported is checked (check_words): a mistyped
# number answers before torch is (tests/test_serve_cli.py). uvicorn and FastAPI are the optional `serve` extra.
torch = lazy.module("torch")
psutil = lazy.module("psutil")
uvicorn = lazy.module("uvicorn")
tokentext = lazy.module(".tokentext", __package__)
engine_server = lazy.module(".engine_server", __package__)
shapes = lazy.module("..shapes", __package__)
scheduler = lazy.module("..engine.drive.scheduler", __package__)
transfer_base = lazy.module("..engine.transfer.base", __package__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")      # uvicorn's

# Each number `labkit serve` takes: its option, lowest, highest (None: no bound of its own; the slots' memory is
# checked as a whole). The seed stays within what every generator seeded from it takes; --keep-records
# within what /stats can answer in one response; the body limit between about 1 KiB (a smaller limit refuses
# ordinary requests) and 1 GiB (the parsed body is held in memory several times over).
NUMBERS = (
    ("--port", "port", 1, 65535),
    ("--resident-slots", "resident_slots", 0, None),
    ("--offload-slots", "offload_slots", 0, None),
    ("--capacity", "capacity", 1, None),
    ("--budget", "budget", 1, None),
    ("--page-size", "page_size", 1, None),
    ("--prefill-chunk", "prefill_chunk", 1, None),
    ("--timeline-every", "timeline_every", 0, None),
    ("--seed", "seed", 0, 2**31 - 1),
    ("--keep-records", "keep_records", 1, 1_000_000),
    ("--max-body-mib", "max_body_mib", 0.001, 1024),
)


def one_line_errors(parser) -> None:
    """argparse's errors for `labkit serve` (`--port abc`) as one line and exit 2, without the usage block:
    the same as every other bad option."""
    def error(message: str):
        parser.exit(2, f"labkit: serve: {message} (`labkit serve --help` lists the options)\n")
    parser.error = error


def _number_problem(option: str, v, lo, hi) -> str | None:
    """Why `v` is out of [lo, hi], or None; nan and inf are out of every range."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= lo \
            and (hi is None or v <= hi):
        return None
    def shown(x):
        return str(x) if isinstance(x, int) else f"{x:g}"
    return f"{option} must be " + (f">= {shown(lo)}" if hi is None else f"{shown(lo)} to {shown(hi)}") + f", got {v}"


def check_words(args) -> None:
    """The options that need nothing imported: numbers, names, the loopback host."""
    for option, attr, lo, hi in NUMBERS:
        why = _number_problem(option, getattr(args, attr), lo, hi)
        if why:
            raise BadInput(why)
    if args.resident_slots + args.offload_slots < 1:
        raise BadInput("--resident-slots and --offload-slots are both 0: no request could be served")
    if args.host not in LOOPBACK:
        raise BadInput(f"labkit serve binds to the loopback interface only, not {args.host}")
    for option, v in (("--switching", args.switching), ("--overflow", args.overflow)):
        if v not in ("on", "off"):
            raise BadInput(f"{option} must be on or off, got {v!r}")
    if args.tokenizer not in ("auto", "none", *tokentext.TOKENIZERS):
        raise BadInput(f"--tokenizer: unknown tokenizer {args.tokenizer!r}: choose auto, none or one of "
                       f"{', '.join(tokentext.TOKENIZERS)}")
    if args.log_level not in LOG_LEVELS:
        raise BadInput(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    name = args.model_name
    try:
        name.encode("utf-8")            # undecodable bytes on the command line arrive as lone surrogates
    except UnicodeEncodeError:
        raise BadInput(f"--model-name {ascii(name)} is not valid text (UTF-8)") from None
    if not name or not name.isprintable() or len(name) > 256:
        raise BadInput(f"--model-name must be 1 to 256 printable characters, got {ascii(name)[:300]}")


def check_engine(args):
    """The options the engine reads, checked before it is built: the shape (returned), the placement policy, the
    device, the offload lane's strategy, and whether the slots' KV cache can fit where it would live."""
    try:
        shape = shapes.ModelShape.from_name(args.shape)
    except (ValueError, TypeError, OSError) as ex:      # a .json shape file that is not one: one line
        raise BadInput(f"--shape: {ex}") from None
    scheduler.parse_policy(args.policy, scheduler.Costs(0, 0, 0))
    device = resolve_device(args.device)
    if args.offload_slots and args.strategy not in transfer_base.STRATEGIES:
        raise BadInput(f"--strategy {args.strategy!r} is not a transfer strategy: choose one of "
                       f"{', '.join(transfer_base.STRATEGIES)}")
    _check_memory(args, shape, device)
    return shape


def _check_memory(args, shape, device) -> None:
    """The KV cache of every slot (capacity rounded up to whole pages), where it lives: the resident lane's on the
    device, the offload lane's in host RAM. Only a lower bound of what the engine allocates: refused here is
    what could never be allocated, in one line instead of an out-of-memory traceback."""
    per_slot = -(-args.capacity // args.page_size) * args.page_size * shape.kv_bytes_per_token()
    ram = psutil.virtual_memory().total
    if device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device).total_memory
        places = [("resident", args.resident_slots, str(device), gpu), ("offload", args.offload_slots, "host RAM", ram)]
    else:
        places = [("resident and offload", args.resident_slots + args.offload_slots, "RAM", ram)]
    for lanes, slots, where, have in places:
        need = slots * per_slot
        if need > have:
            raise BadInput(f"{slots:,} {lanes} slots x --capacity {args.capacity:,} tokens need {gib(need)} of KV "
                           f"cache ({shape.kv_bytes_per_token():,} B/token) in {where}, which has {gib(have)}: "
                           "fewer slots or a smaller capacity")


def check_port(host: str, port: int) -> None:
    """Refuse a port something else listens on before the model is built (binding as uvicorn will)."""
    family = socket.AF_INET6 if host == "::1" else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1" if host == "localhost" else host, port))
        except OSError as ex:
            raise BadInput(f"port {port} on {host} is taken ({ex.strerror}): choose another --port") from None


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP ended `labkit serve`."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopOnSignals:
    """While `labkit serve` runs, SIGINT, SIGTERM and SIGHUP raise `Stopped`: at once while the model is built;
    while the server runs (`server` set), after its graceful shutdown. uvicorn takes SIGINT and SIGTERM itself
    while it serves, shuts down, puts these handlers back and raises the signal again, which lands here."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.server = None
        self.old: dict = {}

    def _handler(self, signum, frame):
        srv = self.server
        if srv is not None and not srv.should_exit:     # SIGHUP while serving: shut down as uvicorn would
            srv.handle_exit(signum, frame)              # (it raises the signal again once shut down)
            return
        raise Stopped(signum)

    def __enter__(self) -> "StopOnSignals":
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def _text(tokenizer: str, vocab: int):
    """How string prompts become tokens: SmolLM2's tokenizer where asked (or, for auto, where installed)."""
    TokenText = tokentext.TokenText
    if tokenizer == "auto":             # SmolLM2's where the lab's model package is installed, else none
        try:
            return TokenText("smollm2-135m", vocab)
        except ValueError:
            return TokenText(None, vocab)
    try:
        return TokenText(None if tokenizer == "none" else tokenizer, vocab)
    except ValueError as ex:            # an unknown name, the tokenizer's package missing: one line
        raise BadInput(str(ex)) from ex


def cmd_serve(args) -> int:
    check_words(args)                   # nothing imported yet: a mistyped number answers at once
    t0 = time.monotonic()
    with StopOnSignals() as signals:
        loop = None
        try:
            shape = check_engine(args)
            check_port(args.host, args.port)
            text = _text(args.tokenizer, shape.vocab)
            # uvicorn is the optional `serve` extra: without it, this line fails, before the model is built
            Server, Config = uvicorn.Server, uvicorn.Config
            loop = engine_server.build(args).start()
            app = engine_server.create_app(loop, args.model_name, text, max_body_bytes=int(args.max_body_mib * 2**20))
            print(f"labkit serve: shape {args.shape} with seeded random weights (seed {args.seed}), not a trained "
                  "model: the engine's speed and protocol are real, its replies are random tokens; "
                  f"lanes {', '.join(f'{n}={l.cache.n_slots} slots' for n, l in loop.sched.lanes.items())}, "
                  f"policy {args.policy}, switching {args.switching}, {text.describe()}, "
                  f"http://{args.host}:{args.port}/v1/completions and /v1/chat/completions, /metrics; "
                  "Ctrl-C stops it", flush=True)
            # uvicorn.Server, not uvicorn.run: run() swallows the Ctrl-C that ends the server
            signals.server = Server(Config(app, host=args.host, port=args.port, log_level=args.log_level))
            signals.server.run()
        except Stopped as ex:
            n = loop.requests.seen if loop is not None else None
            seen = "nothing was served" if n is None else f"{n:,} request{'' if n == 1 else 's'} finished"
            print(stops.stop_line("serve", ex.signum, f"after {stops.duration(time.monotonic() - t0)}", seen),
                  file=sys.stderr, flush=True)
            return stops.exit_code(ex.signum)
        finally:
            if loop is not None:
                loop.stop()
    return 0
