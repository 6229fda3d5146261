"""A run rendered: Plotly figures over run folders (figures.py), headline ratios (summary.py), self-contained HTML
reports from executed notebooks (notebook.py), the run index and run-vs-run comparison. It reads run folders and
imports no measuring code; the docs' generated tables and the claims card are `labkit.docs`, after it."""
