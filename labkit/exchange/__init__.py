"""Rows out, rows in: a lab run as the rows people with consumer GPU rigs share (one measured operating point per
row, with the command that made it), and such rows brought back as external runs the lab's figures draw beside
its own.

- `archive`: the row's fields (the public 4x RTX 3090 archive's schema-v2 names where a field means the same) and
  how each measured point of a lab run becomes one (`rows_of_run`);
- `export`: `labkit export RUN --format jsonl|sqlite|markdown` (an imported run: the rows it took in);
- `importer`: `labkit import FILE.jsonl|FILE.sqlite`: rows into an `external-...` run folder under results/, listed
  by the run index like any run, and exported again as the same rows;
- `beside`: imported points matched on model, context and concurrency to a decode, prefill or serving figure, drawn
  there labelled external with their source.
"""
