"""Tiny synthetic checkpoints that tests and benchmarks write; no product code imports them.

- `k3`: Kimi K3 and K3 DSpark configs and tokenizer, no weights (vLLM's config objects from the
  production YAML; a K3 chat template).
- `k3_random_weights`: random weights beside them, sized for the GPU smoke run (`SMOKE_DIMS`).
- `k25`: a Kimi-K2.5 checkpoint with random weights that vLLM's CPU build serves (the encoder
  cache tests).
"""
