"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): vLLM loads it in
every process it starts, engine workers included, before any model runs.

Three fixes for vLLM 0.32's CPU build; on GPUs nothing changes.

1. Seeded long prompts. A seeded request (`seed` in the API) whose sampled token is discarded (a
   partial prefill chunk: any prompt longer than one engine step's token budget) makes the model
   runner rewind the request's generator with `set_offset`, which CPU generators do not have
   ("RuntimeError: CPU Generator does not use offset"). That kills the engine and every request in
   it. On CPU the rewind is skipped: a seeded request stays deterministic for a given engine
   configuration (the discarded sample still consumes its random numbers). `tests/server/test_api.py`
   sends a seeded long prompt.

2. Lossy speculative sampling. The rejection sampler expands each request's temperature, top-k
   and top-p to its draft positions with `expand_batch_to_tokens`; the CPU build's C++ stand-in
   for that Triton kernel casts its float output and input to new int64 tensors and never copies
   the result back, so the draft positions get uninitialized memory as their temperature. Sampled
   (temperature > 0) requests with drafts then accept and recover the wrong tokens: measured on
   the embedded model with vLLM's own ngram drafter, a continuation of probability 0.85 came out
   98 times in 400 samples, and a junk token 182 times. On CPU the expansion is plain torch.
   `tests/server/test_speculative_server.py` checks sampled tokens against the model's exact
   distribution.

3. Top-k with speculation. In a step whose requests have no draft positions, the rejection sampler
   still applies top-k to its zero rows of draft logits, and the CPU build's top-k (`k.max()` over
   an empty tensor) raises, which kills the engine and every request in it; a request with
   `top_k` did this within its first tokens (tests/server/test_sampling_extensions.py). On CPU,
   zero rows skip the constraint (there is nothing to constrain).
"""

from __future__ import annotations


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    skip_generator_rewind()
    expand_draft_sampling_params()


def skip_generator_rewind() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._bookkeeping_sync
    if getattr(original, "moonserve_cpu_generators", False):
        return  # vLLM may load plugins more than once per process

    def bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        if not generators:
            return original(self, *args, **kwargs)
        self.input_batch.generators = {}  # its only use there is the offset rewind
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    bookkeeping_sync.moonserve_cpu_generators = True
    GPUModelRunner._bookkeeping_sync = bookkeeping_sync


def expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """[batch_size] -> [num_tokens]: each request's value repeated over its draft positions, with
    `replace_from` values replaced by `replace_to` (the contract of vLLM's Triton kernel)."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    x = torch.where(x == replace_from, torch.tensor(replace_to, dtype=x.dtype, device=x.device), x)
    return torch.repeat_interleave(x, counts, output_size=num_tokens)


def expand_draft_sampling_params() -> None:
    # apply_sampling_constraints looks both functions up in its module at each call.
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    top_k_top_p = rejection_sampler.apply_top_k_top_p
    if getattr(top_k_top_p, "moonserve_empty_rows", False):
        return

    def apply_top_k_top_p(logits, k, p):
        return logits if logits.shape[0] == 0 else top_k_top_p(logits, k, p)

    apply_top_k_top_p.moonserve_empty_rows = True
    rejection_sampler.apply_top_k_top_p = apply_top_k_top_p
