"""A fake of vLLM's engine core for tests that cannot start one: what the LanguageModel replica's
`EngineOutputs` uses of an AsyncLLM (its engine core client, LoRA states, stat loggers), with
scripted token ids instead of a model.

`FakeEngineCore(script)`: each request added gets `script(request)`, a list of steps, each the
token ids that request produces in that step; the last step carries the finish reason (`stop` by
default, after the end-of-sequence token, which vLLM's engine core sends and its detokenizer leaves
out of the text). Every call of `get_output_async` is one engine step: one `EngineCoreOutput` per
running request, as vLLM's engine core returns them. Once `hold_after` steps are out, `gate` is
awaited before each further step; at step `fail_at[0]` the core stops and sets `failure` to
`fail_at[1]` (what the replica's call then raises).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace


class FakeEngineCore:
    def __init__(self, script, finish_reason: str = "stop", eos_token_id: int = 2):
        self.script = script
        self.finish_reason = finish_reason
        self.eos_token_id = eos_token_id
        self.running: dict[str, list] = {}
        self.added: list = []
        self.aborted: list[str] = []
        self.steps = 0
        self.hold_after: int | None = None
        self.gate = asyncio.Event()
        self.fail_at: tuple[int, BaseException] | None = None
        self._failure: asyncio.Future | None = None
        self.wake = asyncio.Event()

    @property
    def failure(self) -> asyncio.Future:
        """Set to `fail_at`'s exception when the core reaches that step."""
        if self._failure is None:
            self._failure = asyncio.get_running_loop().create_future()
        return self._failure

    async def add_request_async(self, request) -> None:
        self.added.append(request)
        steps = [list(step) for step in self.script(request)]
        if self.finish_reason == "stop":
            steps[-1].append(self.eos_token_id)
        self.running[request.request_id] = steps
        self.wake.set()

    async def abort_requests_async(self, request_ids) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.running.pop(request_id, None)

    async def get_output_async(self):
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        while not self.running:
            self.wake.clear()
            await self.wake.wait()
        if self.hold_after is not None and self.steps >= self.hold_after:
            await self.gate.wait()
        if self.fail_at is not None and self.steps == self.fail_at[0]:
            if not self.failure.done():
                self.failure.set_result(self.fail_at[1])
            await asyncio.Event().wait()  # the engine is gone
        await asyncio.sleep(0)
        self.steps += 1
        outputs = []
        for request_id, steps in list(self.running.items()):
            token_ids = steps.pop(0)
            last = not steps
            if last:
                del self.running[request_id]
            reason = getattr(FinishReason, self.finish_reason.upper()) if last else None
            outputs.append(EngineCoreOutput(request_id=request_id, new_token_ids=list(token_ids),
                                            finish_reason=reason))
        return EngineCoreOutputs(engine_index=0, outputs=outputs, timestamp=time.monotonic())


def fake_engine(script, finish_reason: str = "stop") -> SimpleNamespace:
    """The parts of an AsyncLLM that `EngineOutputs` reads. Made inside a running loop, it starts
    a reader of the core's outputs that drops them, as AsyncLLM starts its output handler there
    (and drops outputs of requests its own OutputProcessor does not know)."""
    from vllm.v1.metrics.stats import LoRARequestStates

    engine = SimpleNamespace(engine_core=FakeEngineCore(script, finish_reason),
                             output_processor=SimpleNamespace(lora_states=LoRARequestStates(True)),
                             logger_manager=None, output_handler=None)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return engine
    engine.output_handler = asyncio.ensure_future(drop_outputs(engine.engine_core))
    return engine


async def drop_outputs(engine_core: FakeEngineCore) -> None:
    while True:
        await engine_core.get_output_async()


def engine_request(request_id: str, prompt_token_ids: list[int], sampling_params):
    """An EngineCoreRequest as vLLM's input processor makes it (ids assigned as it assigns them)."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.input_processor import InputProcessor

    request = EngineCoreRequest(
        request_id=request_id, prompt_token_ids=list(prompt_token_ids), mm_features=None,
        sampling_params=sampling_params, pooling_params=None, arrival_time=time.time(),
        lora_request=None, cache_salt=None, data_parallel_rank=None)
    InputProcessor.assign_request_id(request)
    return request
