"""Benchmarks of the engine against Hugging Face transformers (`jaxinfer bench ...`).

- `workload`: seeded benchmark requests (random token ids, given or random lengths).
- `hf_peer`: transformers `generate` on the same weights, static left-padded batches.
- `throughput`: offline throughput (`jaxinfer bench throughput`), plus shared report helpers.
- `latency`: fixed-batch decode latency (`jaxinfer bench latency`).

Nothing here imports jax or torch at import time; the benchmark functions do.
"""
