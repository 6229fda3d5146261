"""The documentation's generated part, from committed run folders: the measured tables in README.md and docs/*.md
(readme_tables.py, with reference_tables.py and roofline_tables.py) and the claims card (claims.py); the runs
behind them are named once in docs/runs.toml (runs.py). It reads run folders through `labkit.report` and sits
after it: nothing below imports it."""
