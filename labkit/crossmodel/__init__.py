"""Cross-model KV transfer: a small model prefills, a ridge mapper turns its features into
the large model's KV cache, the cache travels through /dev/shm into vLLM, the large model only decodes.

Modules: `pair` (the two checkpoints, `first:N` derived small models, layer alignment), `features`
(what the mapper reads and predicts; RoPE), `mapper` (streamed closed-form ridge, λ on held-out text,
safetensors with metadata), `transfer` (fitting and building a mapped cache), `quality` (the
pure-transformers reference: perplexity ratio, top-1 agreement, R²), `shm` (the /dev/shm layout),
`producer` (small prefill + mapping -> /dev/shm), `connector` (the vLLM KV connector that loads it),
`ttft` (time to first token, mapped against the large model's own), `seeded` (TTFT at the published Qwen3-0.6B
-> 1.7B shapes with seeded weights, `-p weights=seeded`). The experiment that measures with them is
`labkit.experiments.crossmodel` (`labkit run crossmodel`); the mapper studies over them (`labkit study
crossmodel-ablation`, `-frontier`, `-attribution`) sit beside it there.
"""
