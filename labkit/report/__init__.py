"""Plotly figures over run folders (figures.py), headline ratios (summary.py) and self-contained HTML
reports from executed notebooks (notebook.py)."""
