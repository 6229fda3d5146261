"""Plans and runs fanned out over a Ray cluster of the lab's GPU boxes.

    labkit node --head --ip 10.0.0.5                        the head box (also runs entries if it has GPUs)
    labkit node --address 10.0.0.5:6379 --ip 10.0.0.7      another box joins
    labkit nightly --plan nightly/plan.toml --cluster 10.0.0.5:6379
    labkit run decode -p context_lens=8K,1M --cluster 10.0.0.5:6379 --on h200

A box advertises what it is as Ray resources (`node.py`): `gpu:<kind>: <count>` (`gpu:rtx3090: 3`,
`gpu:h200: 1`) or `cpu_only: 1`, and the commit of its labkit checkout as `labkit@<sha>`. Each plan entry
(or run) is one Ray task (`executor.py`) that asks for one kind's GPUs and the head's commit, so a box
whose checkout is at another commit is never given work, and a box busy with as many entries as it has
GPUs queues the next one rather than sharing a GPU. The task runs `labkit run ...` (or the nightly's one
entry) in the node's checkout as a subprocess, exactly as it would run there by hand, and returns the run
folder as a tar archive that lands under the head's `results/`.

Nothing here is imported without `--cluster` or `labkit node`: a local run never imports Ray.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..results import git_sha

GPU_PREFIX = "gpu:"             # gpu:<kind>: the box's GPUs of that kind
CPU_ONLY = "cpu_only"           # a box without a GPU: kind `cpu`, one entry at a time
COMMIT_PREFIX = "labkit@"       # labkit@<sha>: the commit of the box's labkit checkout


def token_auth_env() -> None:
    """Ray's token authentication for this process when a token is here (`RAY_AUTH_TOKEN`, the file
    `RAY_AUTH_TOKEN_PATH`, or ~/.ray/auth_token, where `labkit node --head` writes it). Ray reads the mode
    when it is imported, so this runs first."""
    if os.environ.get("RAY_AUTH_MODE") is None:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        if os.environ.get("RAY_AUTH_TOKEN") or path.is_file():
            os.environ["RAY_AUTH_MODE"] = "token"


def kind_resource(kind: str) -> str:
    return CPU_ONLY if kind == "cpu" else f"{GPU_PREFIX}{kind}"


def commit_resource(sha: str) -> str:
    return f"{COMMIT_PREFIX}{sha}"


def checkout_commit() -> str:
    """The commit of this labkit checkout (12 hex digits; `LABKIT_GIT_SHA` names it for a copy without .git).
    A dirty tree is still that commit: the cluster compares commits, the run's manifest records the rest."""
    return git_sha().removesuffix("-dirty")


def gpus_needed(needs: str) -> int:
    """GPUs one run of an experiment takes, from its `needs` line ("2+ CUDA GPUs ..." -> 2; else 1)."""
    m = re.match(r"\s*(\d+)\+?\s*CUDA GPUs", needs or "")
    return int(m.group(1)) if m else 1
