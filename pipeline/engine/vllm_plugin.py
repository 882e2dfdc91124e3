"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): vLLM loads it in
every process it starts, engine workers included, before any model runs.

Three fixes for vLLM 0.32's CPU build, a step pace for tests (4), and on GPUs one addition (5).

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
   `tests/smollm2/test_speculative.py` checks sampled tokens against the model's exact
   distribution.

3. Top-k with speculation. In a step whose requests have no draft positions, the rejection sampler
   still applies top-k to its zero rows of draft logits, and the CPU build's top-k (`k.max()` over
   an empty tensor) raises, which kills the engine and every request in it; a request with
   `top_k` did this within its first tokens (tests/server/test_sampling_extensions.py). On CPU,
   zero rows skip the constraint (there is nothing to constrain).

4. A step pace (CPU, for tests): `LanguageModel.collective_rpc("set_step_pace", seconds)` makes
   each of the worker's model steps last at least that long, the rest slept (the core stays
   free); 0 turns it off; MOONSERVE_STEP_PACE_S in the engine's environment sets it from the
   start. A tiny random-weight model then keeps a real model's timing: the tests that hold a
   slot or a stream for a while run on it (tests/serving.py `RunningServer.paced`, the
   two-node cluster of tests/cluster).

5. The DraftService on model runner V2 (GPUs). V2 has no `custom_class` proposer: its
   `init_speculator` builds speculators by method name, and `VllmConfig` lists custom_class among
   the features V2 lacks, so vLLM falls back to V1 (or, with `VLLM_USE_V2_MODEL_RUNNER=1`, fails).
   For moonserve's `ServiceProposer` only, `init_speculator` builds `ServiceSpeculator`
   (`speculator_v2.py`) and custom_class leaves that list. Any other custom class keeps vLLM's
   behaviour. `tests/unit/test_speculator_v2.py` asks vLLM's own config and `init_speculator`.
"""

from __future__ import annotations

import os
import time


SERVICE_PROPOSER = "moonserve.pipeline.engine.proposer.ServiceProposer"
V2_UNSUPPORTED = "speculative method 'custom_class'"  # vLLM's entry (config/vllm.py)


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        service_speculator_on_v2()
        return
    skip_generator_rewind()
    expand_draft_sampling_params()
    step_pace()


def is_service_proposer(speculative_config) -> bool:
    return speculative_config is not None and speculative_config.method == "custom_class" \
        and speculative_config.model == SERVICE_PROPOSER


def service_speculator_on_v2() -> None:
    """Model runner V2 builds `ServiceSpeculator` for `ServiceProposer` (item 5 above)."""
    import sys

    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu import spec_decode

    original = spec_decode.init_speculator
    if getattr(original, "moonserve_service", False):
        return

    def init_speculator(vllm_config, device, req_states):
        if not is_service_proposer(vllm_config.speculative_config):
            return original(vllm_config, device, req_states)
        from moonserve.pipeline.engine.speculator_v2 import ServiceSpeculator

        runner = sys._getframe(1).f_locals.get("self")  # the model runner, building its sampler
        speculator = ServiceSpeculator(vllm_config, device, req_states, lambda: getattr(
            getattr(runner, "sampler", None), "sampling_states", None))
        if speculator.hidden_layers:
            aux_hidden_states_from_load(runner, speculator)
        return speculator

    init_speculator.moonserve_service = True
    spec_decode.init_speculator = init_speculator
    # The model runner binds the name when it is imported; a process may have imported it first.
    runner_module = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner_module is not None:
        runner_module.init_speculator = init_speculator

    unsupported = VllmConfig._get_v2_model_runner_unsupported_features

    def v2_unsupported(self) -> list[str]:
        found = unsupported(self)
        if is_service_proposer(self.speculative_config):
            found = [f for f in found if f != V2_UNSUPPORTED]
        return found

    VllmConfig._get_v2_model_runner_unsupported_features = v2_unsupported


def aux_hidden_states_from_load(runner, speculator) -> None:
    """The V2 `runner`'s target returns the hidden states `speculator` sends: vLLM's aux hidden
    states on (the runner reads the flag when it loads the model, runs it and captures its
    graphs), their layers set as soon as the model is loaded, before anything compiles it."""
    runner.use_aux_hidden_state_outputs = True
    load_model = runner.load_model

    def load_model_and_set_aux_layers(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        speculator.set_aux_layers(runner.model)
        return loaded

    runner.load_model = load_model_and_set_aux_layers


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


def step_pace() -> None:
    """Item 4: `set_step_pace(seconds)` on vLLM's worker (what `collective_rpc` calls by name),
    and each `execute_model` padded to at least that many seconds."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    original = WorkerWrapperBase.execute_model
    if getattr(original, "moonserve_pace", False):
        return
    from_start = float(os.environ.get("MOONSERVE_STEP_PACE_S", "0"))

    def execute_model(self, *args, **kwargs):
        began = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            rest = getattr(self, "moonserve_step_pace_s", from_start) - (time.monotonic() - began)
            if rest > 0:
                time.sleep(rest)

    def set_step_pace(self, seconds: float) -> None:
        self.moonserve_step_pace_s = float(seconds)

    execute_model.moonserve_pace = True
    WorkerWrapperBase.execute_model = execute_model
    WorkerWrapperBase.set_step_pace = set_step_pace
