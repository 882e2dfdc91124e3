"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml): vLLM loads it in
every process it starts, engine workers included, before any model runs.

Work-around for vLLM 0.32's CPU build: a seeded request (`seed` in the API) whose sampled token is
discarded (a partial prefill chunk: any prompt longer than one engine step's token budget) makes
the model runner rewind the request's generator with `set_offset`, which CPU generators do not
have ("RuntimeError: CPU Generator does not use offset"). That kills the engine and every request
in it. On CPU the rewind is skipped: a seeded request stays deterministic for a given engine
configuration (the discarded sample still consumes its random numbers); on GPUs nothing changes.
`tests/test_api.py` sends a seeded long prompt.
"""

from __future__ import annotations


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
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
