"""A run rendered: what every figure draws with (figures.py: colours, log axes, empty figures, telemetry; each
experiment's own figures are labkit/experiments/NAME/figures.py), headline ratios (summary.py), self-contained HTML
reports from executed notebooks (notebook.py), the run index and run-vs-run comparison. It reads run folders and
imports no measuring code; the docs' generated tables and the claims card are `labkit.docs`, after it."""
