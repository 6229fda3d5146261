import os
import signal
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HAS_CUDA = torch.cuda.is_available()

# In a pytest-xdist worker (make test runs two), the worker and every process it starts (a `labkit run`, a
# notebook kernel, a server) compute on their share of the cores: two processes that each spread torch over
# every core stall at each parallel region's barrier (a real-model test took eight times its serial time).
THREADS = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def worker_cores(worker: str) -> str:
    """The cores of worker gwN's share, as vLLM's VLLM_CPU_OMP_THREADS_BIND names them ("0", "2,3")."""
    cores = sorted(os.sched_getaffinity(0))
    first = int(worker.removeprefix("gw")) * THREADS % len(cores)
    return ",".join(map(str, (cores[first:] + cores)[:min(THREADS, len(cores))]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = str(THREADS)
        torch.set_num_threads(THREADS)
        # vLLM's CPU build sets its own thread count, one thread bound to each core of the machine
        # (VLLM_CPU_OMP_THREADS_BIND=auto), whatever OMP_NUM_THREADS says: a server a worker starts (the
        # suite's own, or a sweep's) gets that worker's cores, so its step does not wait at every barrier for
        # a thread stuck behind the other worker (2 x 160 tokens: 23 s bound to both cores beside a busy
        # process, 14 s bound to one), and two workers' servers never share a core
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = worker_cores(os.environ["PYTEST_XDIST_WORKER"])


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device host: pytest -m gpu)")
    for it in items:
        if "gpu" in it.keywords and not HAS_CUDA:
            it.add_marker(skip)
    if hasattr(config, "workerinput"):        # a pytest-xdist worker: the longest groups first
        rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda it: rank.get(group_of(it.nodeid), len(LONGEST_FIRST)))    # stable: a file keeps its order


# ------------------------------------------------------------------ two workers (make test: pytest-xdist)
# `make test` runs the suite in two pytest-xdist workers (`-n 2 --dist loadfile`). A test file stays whole in
# one worker, so a module's fixture (a vLLM server, a Ray cluster, a Chromium, a model) is made once, as in a
# serial run; the files that reuse the run folders tests/browser_util.py makes once per process go to one
# worker together, so those runs are made once, not once per worker. The longest groups are handed out
# first and the short files last, so the two workers finish close together. Every file runs beside the other
# worker, AIPerf's timing check included (it pairs each request with the server's own record of it).
MADE_ONCE = "runs made once per process"
SHARES_RUNS = {"test_browser.py", "test_explore.py", "test_index_compare.py", "test_nightly.py",
               "test_results_size.py"}
# (the order: each group's summed test time in a two-worker run, longest first)
LONGEST_FIRST = ["test_vllm_serving.py", MADE_ONCE, "test_cluster.py", "test_gemv.py", "test_kernels_compile.py",
                 "test_experiments_cpu.py", "test_run_status.py", "test_vllm_xfer.py", "test_serve_target.py",
                 "test_hot_cache.py", "test_sparse_prefill.py", "test_engine.py", "test_xfer_real.py", "test_report.py",
                 "test_capacity.py", "test_local_security.py", "test_cli.py", "test_faults.py", "test_stopped_runs.py",
                 "test_select.py", "test_sweep.py", "test_serve_aiperf.py", "test_quality_real.py", "test_models.py",
                 "test_quality_notebook.py", "test_experts.py"]


def group_of(nodeid: str) -> str:
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return MADE_ONCE if name in SHARES_RUNS else name


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the files in SHARES_RUNS as one unit; in the order the workers collected."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndSharedRuns(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False
    return FilesAndSharedRuns(config, log)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


# ------------------------------------------------------------------ the run's last line
# A quiet "24 skipped" hides whole groups that never ran (the browser tests without Chromium, the GPU
# tests without CUDA). The run ends with one line naming each group that did not run, why, and the
# command that runs it.

HOW = {
    "browser": "as root: scripts/ensure_chromium.sh (apt-get install -y chromium), then make test",
    "gpu": "on a CUDA host: python -m pytest -m gpu (offline host: scripts/device.sh gpu-tests)",
}
_SKIPPED: dict[str, Counter] = {}


def _group(report) -> str:
    for g in ("gpu", "browser", "slow"):
        if g in report.keywords:
            return g
    return "other"


def pytest_runtest_logreport(report):
    if report.skipped and report.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.setdefault(_group(report), Counter())[reason.removeprefix("Skipped: ")] += 1


def not_run_line(skipped: dict[str, Counter]) -> str:
    if not skipped:
        return "labkit: every collected test ran (none skipped)"
    parts = []
    for g in sorted(skipped, key=lambda g: (g == "other", g)):
        n = sum(skipped[g].values())
        why = "; ".join(r for r, _ in skipped[g].most_common(2))
        parts.append(f"{n} {g} test{'s' if n != 1 else ''} ({why}{'; run them ' + HOW[g] if g in HOW else ''})")
    return "labkit: NOT RUN: " + ", ".join(parts)


def pytest_unconfigure(config):
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None and getattr(config.option, "collectonly", False) is False:
        tr.write_line(not_run_line(_SKIPPED), yellow=bool(_SKIPPED), bold=True)


@pytest.fixture(autouse=True)
def _sigint_left_as_a_terminal_gives_it(request):
    """Each test ends with Ctrl-C's handler as Python starts with it. A test left SIGINT ignored in a worker of
    fresh-clone runs (not found which): the tests after it that check a command's handlers, or Ctrl-C a child (an
    ignored signal is inherited across exec), then failed in whichever worker it was. Put back, with a warning
    naming the test that left it, so the summary says where to look."""
    yield
    if threading.current_thread() is threading.main_thread():
        was = signal.getsignal(signal.SIGINT)
        if was is not signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            warnings.warn(f"{request.node.nodeid} left SIGINT's handler as {was!r}; put back",
                          pytest.PytestWarning)

