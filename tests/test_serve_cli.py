"""`labkit serve`'s front door, in this process through `labkit.cli.main`: every option out of range (nan and inf
included, argparse's own errors too) is one line on stderr and exit 2, before the model is built (`build` is
watched); SIGINT, SIGTERM and SIGHUP end a running server with the one stop line and 128 + the signal, as the
docs promise (it used to exit 0 without a word)."""
import os
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from labkit import cli
from labkit.serving import engine_server

SMALL = ["--device", "cpu", "--capacity", "64", "--budget", "16", "--page-size", "16", "--prefill-chunk", "64",
         "--resident-slots", "1", "--offload-slots", "0", "--policy", "resident", "--tokenizer", "none"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def built(monkeypatch):
    """The engines `labkit serve` builds: none, for a bad option."""
    seen = []

    def build(args):
        seen.append(args)
        raise AssertionError("the model was built")
    monkeypatch.setattr(engine_server, "build", build)
    return seen


def _one_line(capsys) -> str:
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("labkit: ") and not out.out, out
    return lines[0]


@pytest.mark.parametrize("option,value,says", [
    ("--port", "99999", "--port must be 1 to 65535, got 99999"),
    ("--port", "0", "--port must be 1 to 65535, got 0"),
    ("--capacity", "0", "--capacity must be >= 1, got 0"),
    ("--page-size", "0", "--page-size must be >= 1, got 0"),
    ("--budget", "-1", "--budget must be >= 1, got -1"),
    ("--prefill-chunk", "0", "--prefill-chunk must be >= 1, got 0"),
    ("--max-body-mib", "inf", "--max-body-mib must be 0.001 to 1024, got inf"),
    ("--max-body-mib", "nan", "--max-body-mib must be 0.001 to 1024, got nan"),
    ("--max-body-mib", "-inf", "--max-body-mib must be 0.001 to 1024, got -inf"),
    ("--max-body-mib", "1e-9", "--max-body-mib must be 0.001 to 1024"),
    ("--resident-slots", "-1", "--resident-slots must be >= 0, got -1"),
    ("--offload-slots", "-2", "--offload-slots must be >= 0, got -2"),
    ("--timeline-every", "-1", "--timeline-every must be >= 0, got -1"),
    ("--seed", "-1", "--seed must be 0 to 2147483647, got -1"),
    ("--seed", "99999999999999999999", "--seed must be 0 to 2147483647"),
    ("--keep-records", "0", "--keep-records must be 1 to 1000000, got 0"),
    ("--keep-records", "1" + "0" * 30, "--keep-records must be 1 to 1000000"),
    ("--resident-slots", "0", "--resident-slots and --offload-slots are both 0"),
    ("--host", "0.0.0.0", "loopback interface only"),
    ("--switching", "maybe", "--switching must be on or off"),
    ("--overflow", "sometimes", "--overflow must be on or off"),
    ("--log-level", "loud", "--log-level must be one of critical, error, warning, info, debug, trace"),
    ("--tokenizer", "gpt2", "--tokenizer: unknown tokenizer 'gpt2': choose auto, none or one of smollm2-135m"),
    ("--model-name", "", "--model-name must be 1 to 256 printable characters"),
    ("--model-name", "bad\udc80name", "--model-name 'bad\\udc80name' is not valid text"),
    ("--shape", "nope", "--shape: unknown shape 'nope'"),
    ("--policy", "threshold:nan", "unknown placement policy 'threshold:nan'"),
    ("--policy", "threshold:inf", "unknown placement policy 'threshold:inf'"),
    ("--policy", "threshold:-5", "unknown placement policy 'threshold:-5'"),
    ("--device", "tpu", "device 'tpu'"),
    ("--capacity", "100000000000", "need"),          # 10^11 tokens of KV per slot: more than any machine's memory
])
def test_an_option_out_of_range_is_one_line_before_the_model_is_built(built, capsys, option, value, says):
    rc = cli.main(["serve", *SMALL, f"{option}={value}"])
    line = _one_line(capsys)
    assert rc == 2 and says in line and not built, line


def test_an_offload_strategy_that_does_not_exist_and_a_bad_shape_file(built, capsys, tmp_path):
    assert cli.main(["serve", *SMALL, "--offload-slots", "1", "--strategy", "nope"]) == 2
    assert "--strategy 'nope' is not a transfer strategy" in _one_line(capsys)
    for text in ("{not json", '{"layers": "many"}', "[]"):
        f = tmp_path / "shape.json"
        f.write_text(text)
        assert cli.main(["serve", *SMALL, "--shape", str(f)]) == 2
        assert _one_line(capsys).startswith("labkit: --shape: ")
    assert not built


def test_a_port_in_use_is_one_line_before_the_model_is_built(built, capsys):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert cli.main(["serve", *SMALL, "--port", str(port)]) == 2
    assert f"port {port} on 127.0.0.1 is taken" in _one_line(capsys) and not built


@pytest.mark.parametrize("option,value", [("--port", "nan"), ("--capacity", "inf"), ("--port", "abc"),
                                          ("--budget", "1.5")])
def test_a_number_argparse_cannot_read_is_one_line_too(built, capsys, option, value):
    with pytest.raises(SystemExit) as ex:
        cli.main(["serve", *SMALL, option, value])
    line = _one_line(capsys)
    assert ex.value.code == 2 and f"argument {option}: invalid" in line and repr(value) in line and not built


def _stop_when_up(port: int, sig: int) -> threading.Thread:
    """Once the server answers, one request through it, then `sig` to this process (as Ctrl-C sends it)."""
    url = f"http://127.0.0.1:{port}"

    def go():
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
                    os.kill(os.getpid(), sig)
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
    th = threading.Thread(target=go, daemon=True)
    th.start()
    return th


@pytest.mark.parametrize("sig,code,words", [(signal.SIGINT, 130, "SIGINT (Ctrl-C)"), (signal.SIGTERM, 143, "SIGTERM"),
                                            (signal.SIGHUP, 129, "SIGHUP (its terminal closed)")])
def test_a_signal_ends_serve_with_one_line_and_128_plus_it(capsys, sig, code, words):
    port = _free_port()
    th = _stop_when_up(port, sig)
    rc = cli.main(["serve", *SMALL, "--port", str(port)])
    th.join(timeout=10)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == code and len(lines) == 1, (rc, out.err)
    assert re.fullmatch(rf"labkit: serve stopped by {re.escape(words)} after \d+ s; \d+ requests? finished", lines[0])
    assert "labkit serve: shape tiny" in out.out and "Ctrl-C stops it" in out.out
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler        # the handlers given back


def test_ctrl_c_while_the_model_is_built(monkeypatch, capsys):
    def build(args):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)           # the signal lands here
        raise AssertionError("Ctrl-C did not stop the build")
    monkeypatch.setattr(engine_server, "build", build)
    t0 = time.time()
    assert cli.main(["serve", *SMALL, "--port", str(_free_port())]) == 130
    line = _one_line(capsys)
    assert line.startswith("labkit: serve stopped by SIGINT (Ctrl-C) after ") and line.endswith("; nothing was served")
    assert time.time() - t0 < 2


def test_a_mistyped_number_answers_before_torch_is_imported():
    import subprocess
    import sys
    code = ("import sys\n"
            "from labkit.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "print(rc, ','.join(m for m in ('torch', 'uvicorn', 'fastapi') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code, "serve", "--port", "99999"], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.split() == ["2"] and r.stderr.strip() == "labkit: --port must be 1 to 65535, got 99999", r
