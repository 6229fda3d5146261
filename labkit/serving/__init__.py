"""Request-level serving: launch profiles, the vLLM server lifecycle, the load generator, metrics, connectors."""
