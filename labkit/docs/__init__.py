"""The documentation's generated part, from committed run folders: the measured tables in README.md and docs/*.md
and the claims card (claims/). Each experiment's tables sit beside it (labkit/experiments/NAME/tables.py);
readme_tables.py binds every block to the function that makes it and the runs docs/runs.toml names (runs.py), and
keeps here only the blocks that span experiments (headlines.py; roofline_tables.py: the step's kernels, the benches
and the spreads across processes; reference_tables.py: the published model's study). It reads run folders through
`labkit.report` and the experiments' tables and sits after them: nothing below imports it."""
