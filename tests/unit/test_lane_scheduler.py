"""`LaneScheduler` (pipeline/engine/lane_scheduler.py) driven step by step, as vLLM's engine core drives
it: a real vLLM scheduler and KV cache manager on the embedded model's config; the model runner's
output is a sampled token for each request past its prompt. No engine starts."""

from __future__ import annotations

import pytest

BLOCK = 16
BUDGET = 64
THRESHOLD = 16
INTERACTIVE, LONG = 0, 10


@pytest.fixture(scope="module")
def model_config():
    from vllm.config import ModelConfig

    from moonserve.pipeline.prepare.language_model import prepare_language_model

    return ModelConfig(model=str(prepare_language_model(progress=False)), dtype="float32",
                       max_model_len=4096, seed=0)


class Engine:
    """The scheduler plus the bookkeeping of vLLM's engine core loop."""

    def __init__(self, model_config, *, policy="priority", background_priority=None,
                 chunk_tokens=32, num_blocks=1024):
        import torch
        from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from moonserve.pipeline.config import EngineConfig
        from moonserve.pipeline.engine.lane_scheduler import LaneScheduler

        options = EngineConfig(background_priority=background_priority,
                               background_prefill_chunk_tokens=chunk_tokens,
                               scheduling_policy="priority",
                               strict_prefill_priority=True).scheduler_options()
        config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=16, max_num_batched_tokens=BUDGET, max_model_len=4096, policy=policy,
                long_prefill_token_threshold=THRESHOLD, enable_chunked_prefill=True,
                is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
            additional_config=options)
        config.cache_config.num_gpu_blocks = num_blocks
        kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                         dtype=torch.float32))])
        self.scheduler = LaneScheduler(vllm_config=config, kv_cache_config=kv, block_size=BLOCK,
                                       structured_output_manager=StructuredOutputManager(config))
        self.outputs: dict[str, int] = {}

    def add(self, name: str, prompt_tokens: int, priority: int, max_tokens: int = 4) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.outputs[name] = 0
        start = 1000 + 7919 * len(self.outputs)
        self.scheduler.add_request(Request(
            name, list(range(start, start + prompt_tokens)),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, priority=priority))

    def step(self) -> dict[str, int]:
        """One engine step: {request: tokens scheduled}."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()  # advances each request's num_computed_tokens
        ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[7] if requests[r].num_computed_tokens >= requests[r].num_prompt_tokens else []
                   for r in ids]
        for r, tokens in zip(ids, sampled):
            self.outputs[r] += len(tokens)
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
        return dict(out.num_scheduled_tokens)

    def run_out(self, max_steps: int = 500) -> int:
        steps = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < max_steps, "requests left unfinished"
        return steps


def test_long_prefill_sits_out_the_steps_where_a_chat_request_prefills(model_config):
    engine = Engine(model_config)
    engine.add("long", 1000, LONG)
    assert engine.step() == {"long": BUDGET}  # alone, no background cap configured
    engine.add("chat", 40, INTERACTIVE)
    assert engine.step() == {"chat": 40}  # the long chunk waits
    # The chat request decodes: the long prefill goes on beside it, capped by vLLM's threshold.
    assert engine.step() == {"chat": 1, "long": THRESHOLD}


def test_a_chat_prompt_longer_than_a_step_holds_long_prefills_until_its_last_chunk(model_config):
    engine = Engine(model_config)
    engine.add("long", 1000, LONG)
    engine.step()
    engine.add("chat", 150, INTERACTIVE)
    # The chat prompt runs alone in its steps, so vLLM gives it the whole budget.
    assert [engine.step() for _ in range(3)] == [{"chat": BUDGET}, {"chat": BUDGET}, {"chat": 22}]
    assert engine.step() == {"chat": 1, "long": THRESHOLD}


def test_waiting_long_requests_do_not_start_beside_a_chat_prefill(model_config):
    engine = Engine(model_config)
    engine.add("chat", 20, INTERACTIVE)
    engine.add("long", 1000, LONG)
    assert engine.step() == {"chat": 20}
    assert engine.step() == {"chat": 1, "long": THRESHOLD}


def test_long_requests_keep_decoding_beside_a_whole_chat_prompt(model_config):
    engine = Engine(model_config)
    engine.add("long", 40, LONG, max_tokens=8)
    engine.step()  # its whole prompt: now it decodes
    engine.add("chat", 34, INTERACTIVE)
    # vLLM alone would cut the chat prompt at the threshold (16 + 16 + 2 over three steps).
    assert engine.step() == {"long": 1, "chat": 34}


def test_prefills_that_share_a_step_keep_the_threshold(model_config):
    engine = Engine(model_config)
    engine.add("a", 40, INTERACTIVE)
    engine.add("b", 40, INTERACTIVE)
    assert engine.step() == {"a": THRESHOLD, "b": THRESHOLD}


def test_a_lone_background_prefill_takes_the_background_chunk(model_config):
    engine = Engine(model_config, background_priority=LONG, chunk_tokens=32)
    engine.add("long", 1000, LONG)
    assert engine.step() == {"long": 32}
    engine.add("chat", 40, INTERACTIVE)
    assert engine.step() == {"chat": 40}
    assert engine.step() == {"chat": 1, "long": THRESHOLD}
    # Beside decodes of its own priority: the background chunk, not the whole budget.
    both = Engine(model_config, background_priority=LONG, chunk_tokens=32)
    both.add("decoding", 20, LONG, max_tokens=8)
    both.step()
    both.add("long", 1000, LONG)
    assert both.step() == {"decoding": 1, "long": 32}
    # A lone request of interactive priority still gets the whole budget.
    fresh = Engine(model_config, background_priority=LONG, chunk_tokens=32)
    fresh.add("chat", 1000, INTERACTIVE)
    assert fresh.step() == {"chat": BUDGET}


def test_fcfs_policy_is_vllms_own_behaviour(model_config):
    engine = Engine(model_config, policy="fcfs")
    engine.add("long", 1000, 0)
    engine.step()
    engine.add("chat", 40, 0)
    assert engine.step() == {"long": THRESHOLD, "chat": THRESHOLD}


def test_when_kv_blocks_run_short_nothing_is_held(model_config):
    # 80 blocks of 16 tokens: the long prefill holds 60 when a chat prompt needing 26 arrives.
    # Held out of sight, the long request could neither finish nor be preempted, and the chat
    # request would wait for blocks forever; with nothing held, vLLM finishes the long prompt
    # and then admits the chat request.
    engine = Engine(model_config, num_blocks=80)
    engine.add("long", 1000, LONG)
    while engine.scheduler.requests["long"].num_computed_tokens < 960:
        engine.step()
    engine.add("chat", 400, INTERACTIVE)
    assert "long" in engine.step()
    engine.run_out()
    assert engine.outputs == {"long": 4, "chat": 4}


def test_every_request_finishes_with_all_its_tokens_under_churn(model_config):
    import random

    rng = random.Random(3)
    engine = Engine(model_config, background_priority=LONG)
    expected = {}
    for i in range(30):
        name, long = f"r{i}", rng.random() < 0.3
        max_tokens = rng.randint(1, 6)
        engine.add(name, rng.randint(200, 900) if long else rng.randint(5, 120),
                   LONG if long else INTERACTIVE, max_tokens)
        expected[name] = max_tokens
        for _ in range(rng.randint(0, 3)):
            engine.step()
    engine.run_out()
    assert engine.outputs == expected
    assert not engine.scheduler.running and not engine.scheduler.waiting
