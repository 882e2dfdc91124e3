"""The LM engine's scheduler: vLLM's own, with strict priority between prefills.

The router's lanes give every request a vLLM priority (lower runs first: interactive 0,
long-context 10). vLLM's priority policy orders the waiting queue and picks preemption victims by
it, but within one engine step it still gives any budget left over to lower-priority prefill
chunks, and a prefill that runs alone gets the whole step. On a CPU, or any engine whose step
time grows with the tokens in it, a chat request's first token waits for the long-prompt chunk
that shares its step and for the long step it arrived during.

`LaneScheduler` adds three rules (`engine.strict_prefill_priority`, `engine.background_priority`):

- While a request of the best priority present waits to start or is still prefilling, the prefill
  chunks of worse-priority requests sit the step out. Their decode steps still run (one token plus
  drafts each), and so does everything else vLLM does. A held request keeps its KV blocks and its
  place, and goes on in the first step with no better-priority prefill. Under a steady stream of
  chat prefills the long-context lane waits; its bounded queue and queue timeout at the router
  bound that wait. When the free KV blocks cannot hold the better-priority prompts, nothing is
  held: vLLM's own step preempts the worse-priority requests to make room.
- vLLM's `long_prefill_token_threshold` caps every prompt's chunk whenever two requests are
  present, so a 34-token chat prompt beside one long-context decode takes three 16-token steps.
  Here it applies only when it protects someone: when two prefills share a step, or a prefill runs
  beside decodes of better priority.
- Otherwise a background prefill (priority `background_priority` or worse) takes at most
  `background_prefill_chunk_tokens` per step, alone too (vLLM gives a lone prefill the whole
  budget), so a chat request that arrives finds a short step in flight.

vLLM loads the class in its engine-core process through `scheduler_cls`; the settings come in
`additional_config["moonserve_lanes"]` (`EngineConfig.scheduler_options`). It extends vLLM's
synchronous `Scheduler`, so the LanguageModel turns vLLM's async scheduling off with it (the CPU
build never has it on); production keeps vLLM's own scheduler.
"""

from __future__ import annotations

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request


def is_prefilling(request: Request) -> bool:
    return request.num_computed_tokens < request.num_prompt_tokens


class LaneScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        options = (self.vllm_config.additional_config or {}).get("moonserve_lanes", {})
        self.background_priority: int | None = options.get("background_priority")
        self.background_chunk_tokens: int = options.get("background_prefill_chunk_tokens", 32)

    def schedule(self, *args, **kwargs):
        if self.policy != SchedulingPolicy.PRIORITY:
            return super().schedule(*args, **kwargs)
        config = self.scheduler_config
        budget, threshold = self.max_num_scheduled_tokens, config.long_prefill_token_threshold
        running, waiting = self.held_prefills()
        held = {id(r) for r in running}
        self.running = [r for r in self.running if id(r) not in held]
        self.waiting.remove_requests(waiting)
        config.long_prefill_token_threshold, self.max_num_scheduled_tokens = \
            self.chunk_limits(threshold, budget)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = budget
            config.long_prefill_token_threshold = threshold
            # After the requests scheduled this step: the next step's running loop reaches the
            # better-priority requests first.
            self.running.extend(running)
            for request in waiting:
                self.waiting.add_request(request)

    def held_prefills(self) -> tuple[list[Request], list[Request]]:
        """The running requests in prefill and the waiting requests whose priority is worse than
        the best priority among all requests that wait or prefill."""
        waiting = list(self.waiting)
        prefilling = [r for r in self.running if is_prefilling(r)]
        candidates = waiting + prefilling
        if not candidates:
            return [], []
        best = min(r.priority for r in candidates)
        if not self.kv_has_room([r for r in candidates if r.priority == best]):
            return [], []  # vLLM's own step: held requests could neither finish nor be preempted
        return ([r for r in prefilling if r.priority > best],
                [r for r in waiting if r.priority > best])

    def kv_has_room(self, requests: list[Request]) -> bool:
        """Whether the free KV blocks hold the rest of these requests' prompts. When they do not,
        holding worse-priority requests out of sight would keep vLLM from preempting them to make
        room, and the better-priority requests would wait for blocks that never free."""
        need = sum(-(-(r.num_prompt_tokens - r.num_computed_tokens) // self.block_size) + 1
                   for r in requests)
        return self.kv_cache_manager.block_pool.get_num_free_blocks() >= need

    def chunk_limits(self, threshold: int, budget: int) -> tuple[int, int]:
        """(long_prefill_token_threshold, token budget) for this step, the held requests being
        out of `running` and `waiting`: vLLM's threshold where it protects someone, else the
        background chunk for a background prefill (alone too: vLLM lifts the threshold for a
        lone request, so the budget carries it), else no cap."""
        prefills = [r for r in self.running if is_prefilling(r)] + list(self.waiting)
        if self.prefill_needs_threshold(prefills):
            return threshold, budget
        if prefills and self.is_background(prefills[0]):
            alone = len(self.running) + len(self.waiting) == 1
            chunk = self.background_chunk_tokens
            return chunk, min(budget, chunk) if alone else budget
        return 0, budget

    def is_background(self, request: Request) -> bool:
        return self.background_priority is not None and request.priority >= self.background_priority

    def prefill_needs_threshold(self, prefills: list[Request]) -> bool:
        """Whether vLLM's `long_prefill_token_threshold` has work this step: when prefills share
        it, or when a prefill runs beside decodes of better priority. A chat prompt beside long-context decodes does not
        need chunking: it is what those decodes must not hold back."""
        if len(prefills) != 1:
            return len(prefills) > 1
        decodes = [r.priority for r in self.running if not is_prefilling(r)]
        return bool(decodes) and min(decodes) < prefills[0].priority
