"""The real-model quality lab: top-k sparse attention inside HF models, policies, measurements, traces.

- `sparse`: the `labkit_sparse` attention function and its per-layer `SparseController`;
- `indexer`: the 66 B/token calibrated index keys;
- `corpora`: code (CPython stdlib), prose (Shakespeare), yaml (PyTorch's operator registry) and pydoc (Python's
  documentation topics, modern English prose) texts,
  calibration/eval split, the seeded draw of evaluation sequences;
- `measure`: perplexity / recall / head-map sweeps as tidy DataFrames;
- `traces`: selection traces from greedy generation, their file format and locality statistics.
"""
