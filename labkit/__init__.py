"""labkit: a Jupyter-first lab for measuring KV-cache offloading to host RAM in LLM inference.

Data flows one way: shape -> engine -> experiment -> records + telemetry -> run folder -> report.
"""
__version__ = "0.1.0"
