"""The real-model quality lab: top-k sparse attention inside HF models, policies, measurements, traces.

- `sparse`: the `labkit_sparse` attention function and its per-layer `SparseController`;
- `indexer`: the 66 B/token calibrated index keys;
- `corpora`: code (CPython stdlib) and prose (Shakespeare) texts, calibration/eval split;
- `measure`: perplexity / recall / head-map sweeps as tidy DataFrames;
- `traces`: selection traces from greedy generation, their file format and locality statistics.
"""
