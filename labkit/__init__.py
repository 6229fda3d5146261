"""labkit: a Jupyter-first lab for measuring KV-cache offloading to host RAM in LLM inference.

Data flows one way: shape -> engine -> experiment -> records + telemetry -> run folder -> report.
"""
import sys

__version__ = "0.1.0"

# nbformat (under papermill, nbconvert and the lab) imports jsonschema, which imports `rfc3987_syntax` when it is
# installed (Jupyter's event schemas pull it in) for its optional "iri" format checks only; nbformat's validation
# never checks formats. That import compiles a Lark grammar, 1.6 s of every `labkit run` and every process that
# renders a notebook. An absent entry makes jsonschema skip it as it does where the package is not installed.
sys.modules.setdefault("rfc3987_syntax", None)
