"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): vLLM loads it in
every process it starts, engine workers included, before any model runs.

Four changes to vLLM 0.32's CPU build; on GPUs nothing changes.

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

4. Waiting without spinning. vLLM's CPU build always runs the worker in a process of its own (the
   mp executor), and a reader of vLLM's shared-memory queues (`shm_broadcast.SpinCondition`)
   spins on `sched_yield` for a second after each message before it waits on the writer's
   notification socket. So while the worker computes a step, the engine core spins for its
   output, and between steps the worker spins for the next one: on this 2-core machine the
   engine core took 74% of a core under load, beside a worker bound to one core and the Router,
   proxy and Ray daemons that share the other. On CPU a reader waits on the notification from
   the start: the writer sends one after every message, so no message waits longer than its
   wake-up. `MOONSERVE_VLLM_SPIN=1` keeps vLLM's spinning: the `pipeline_vllm_spin` arm of
   `moonserve bench overhead` measures the two against each other (docs/benchmarks.md).
"""

from __future__ import annotations

import os


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    skip_generator_rewind()
    expand_draft_sampling_params()
    if os.environ.get("MOONSERVE_VLLM_SPIN") != "1":
        wait_without_spinning()


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


def wait_without_spinning() -> None:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    original = SpinCondition.wait
    if getattr(original, "moonserve_no_spin", False):
        return

    def wait(self, timeout_ms=None):
        self.busy_loop_s = 0  # the reader's spin window after each read: none
        return original(self, timeout_ms)

    wait.moonserve_no_spin = True
    SpinCondition.wait = wait
