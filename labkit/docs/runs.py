"""The committed runs behind every generated table and card: one place, `docs/runs.toml` (`[runs]`: a key per
figure or table; `[files]`: which doc holds each generated block)."""
from __future__ import annotations

import tomllib

from ..results import REPO

RUNS_FILE = REPO / "docs" / "runs.toml"
TOML = tomllib.loads(RUNS_FILE.read_text())
RUNS: dict = TOML["runs"]


