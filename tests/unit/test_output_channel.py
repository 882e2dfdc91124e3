"""The output channel over real TCP on 127.0.0.1 (issue 31): the LanguageModel side
(`EngineOutputs`, over a fake engine core that scripts token ids) sends vLLM's engine core outputs,
one frame per engine step for all of a Router's requests; the Router side (`OutputReceiver`) runs
vLLM's own OutputProcessor on them with the embedded model's real tokenizer, once per token, and
sends back the requests a stop string ended. Frames, the token check, merging, n > 1, stop
strings, cancellation and lost connections. The Router with the channel is tested end to end in
test_router.py and in the server tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from moonserve.deployments.language_model import sampling_params
from moonserve.pipeline.engine.output_wire import (
    ABORT,
    MAX_FRAME_BYTES,
    OUTPUTS,
    REQUEST,
    TOKEN_BYTES,
    ChannelAddress,
    FrameError,
    FrameReader,
    WireDecoders,
    WireEncoder,
    encode_frame,
)
from moonserve.pipeline.api.protocol import GenerationDelta, SamplingSpec, TokenLogprob, merge_deltas
from moonserve.pipeline.engine.output_sender import EngineOutputs
from moonserve.pipeline.router.output_receiver import ChannelLost, OutputReceiver
from tests.fake_engine import engine_request, fake_engine

pytestmark = pytest.mark.timeout(60)

TOKEN = b"t" * TOKEN_BYTES
PROMPT = [1, 9038, 2]


@pytest.fixture(scope="module")
def tokenizer():
    from vllm.tokenizers import get_tokenizer

    from moonserve.pipeline.prepare.language_model import prepare_language_model

    return get_tokenizer(str(prepare_language_model(progress=False)))


def steps_of(tokenizer, *pieces: str) -> list[list[int]]:
    """The token ids of each text piece: one engine step each."""
    return [tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]


def test_frames_split_anywhere_decode_whole():
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    request = engine_request("r", PROMPT, sampling_params(SamplingSpec(4)))
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput(request.request_id, [5, 6])])
    encoder, decoders = WireEncoder(), WireDecoders()
    data = TOKEN + encode_frame(encoder, REQUEST, request) + encode_frame(encoder, OUTPUTS, outputs)
    for cut in range(1, len(data), 7):
        reader = FrameReader(TOKEN)
        frames = [decoders.decode(k, b) for k, b in reader.feed(data[:cut]) + reader.feed(data[cut:])]
        assert [type(f).__name__ for f in frames] == ["EngineCoreRequest", "EngineCoreOutputs"]
        assert frames[0].request_id == request.request_id and frames[0].prompt_token_ids == PROMPT
        assert frames[0].sampling_params.max_tokens == 4
        assert frames[1].outputs[0].new_token_ids == [5, 6]


def test_wrong_token_is_refused_before_any_frame_is_read():
    reader = FrameReader(TOKEN)
    with pytest.raises(FrameError, match="token"):
        reader.feed(b"x" * TOKEN_BYTES + encode_frame(WireEncoder(), ABORT, ["a"]))


def test_oversized_frame_is_refused_from_its_header():
    reader = FrameReader(TOKEN)
    header = (MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(FrameError, match="over the"):
        reader.feed(TOKEN + header + b"\x02")  # the body never has to arrive


def test_malformed_frames_are_frame_errors():
    decoders = WireDecoders()
    body = memoryview((1).to_bytes(2, "big") + (3).to_bytes(4, "big") + b"\x93\x01\x02")
    with pytest.raises(FrameError, match="malformed"):
        decoders.decode(OUTPUTS, body)
    with pytest.raises(FrameError, match="add up"):
        decoders.decode(ABORT, memoryview((1).to_bytes(2, "big") + (9).to_bytes(4, "big") + b"x"))
    with pytest.raises(FrameError, match="unknown frame kind"):
        decoders.decode(7, body)


def test_merge_keeps_choices_apart_and_every_token():
    lp = TokenLogprob("a", -0.5, (("a", -0.5),))
    merged = merge_deltas([
        GenerationDelta("a", 1, 7, logprobs=[lp], index=0, token_ids=[1]),
        GenerationDelta("x", 1, 7, index=1, token_ids=[9]),
        GenerationDelta("b", 1, 7, "length", logprobs=[lp], index=0, token_ids=[2], finished=True),
    ])
    assert [(d.index, d.text, d.num_tokens, d.token_ids, d.finish_reason, d.finished)
            for d in merged] == [(0, "ab", 2, [1, 2], "length", True), (1, "x", 1, [9], None, False)]
    assert merged[0].logprobs == [lp, lp]


class CountingReceiver(OutputReceiver):
    """Counts the output frames processed, to see what one engine step became."""

    def __init__(self, tokenizer):
        super().__init__("127.0.0.1", tokenizer)
        self.frames: list[list[str]] = []

    def process(self, outputs, connection) -> None:
        self.frames.append(sorted(o.request_id.split("-")[0] for o in outputs.outputs))
        super().process(outputs, connection)


@dataclass
class Channel:
    receiver: CountingReceiver
    address: ChannelAddress
    outputs: EngineOutputs
    engine_core: object

    async def run(self, request_id: str, spec: SamplingSpec, prompt=PROMPT):
        """One request from the LanguageModel's side: (its engine request, the run's task)."""
        request = engine_request(request_id, prompt, sampling_params(spec))
        connection = await self.outputs.connections.get(self.address)
        return request, asyncio.ensure_future(self.outputs.run(request, connection))


def make_channel(tokenizer, script, finish_reason="stop"):
    engine = fake_engine(script, finish_reason)
    return CountingReceiver(tokenizer), EngineOutputs(engine), engine.engine_core


@pytest.fixture
async def open_channel(tokenizer):
    """Opens a Router's receiver on 127.0.0.1 and a LanguageModel replica's outputs over a fake
    engine core whose every request produces `pieces` (one engine step each)."""
    made = []

    async def open_channel(*pieces: str) -> Channel:
        receiver, outputs, core = make_channel(tokenizer, lambda r: steps_of(tokenizer, *pieces))
        made.append((receiver, outputs))
        return Channel(receiver, await receiver.start(), outputs, core)

    yield open_channel
    for receiver, outputs in made:
        outputs.close()
        receiver.stop()


@pytest.fixture
async def channel(open_channel) -> Channel:
    return await open_channel("Hello", " there", "!")


async def read_all(outputs) -> list[GenerationDelta]:
    got = []
    while (deltas := await outputs.next()) is not None:
        got += deltas
    return got


async def test_one_engine_step_is_one_frame_for_all_of_a_routers_requests(channel):
    outputs = {r: channel.receiver.open(r) for r in "abcd"}
    channel.engine_core.hold_after = 0
    runs = [(await channel.run(r, SamplingSpec(8)))[1] for r in "abcd"]
    await asyncio.sleep(0.1)  # every request added before the first step
    channel.engine_core.gate.set()
    assert await asyncio.gather(*runs) == [4, 4, 4, 4]  # the end-of-sequence token counts
    for r in "abcd":
        got = await read_all(outputs[r])
        assert "".join(d.text for d in got) == "Hello there!"
        assert got[-1].finished and got[-1].finish_reason == "stop"
        assert got[-1].num_prompt_tokens == len(PROMPT)
    # One frame per engine step with every request's output, not one message per request.
    assert channel.receiver.frames == [list("abcd")] * 3
    assert channel.outputs.routes == {}


async def test_a_reader_behind_gets_one_merged_delta_per_read(channel):
    outputs = channel.receiver.open("r")
    _, run = await channel.run("r", SamplingSpec(8))
    assert await run == 4
    await asyncio.sleep(0.1)
    (merged,) = await outputs.next()
    assert (merged.text, merged.num_tokens, merged.finish_reason) == ("Hello there!", 4, "stop")
    assert await outputs.next() is None


async def test_a_stop_string_ends_the_request_in_the_router_and_aborts_it_in_the_engine(
        open_channel):
    channel = await open_channel("The answer", " is 42", ". Done", " and more")
    outputs = channel.receiver.open("r")
    request, run = await channel.run("r", SamplingSpec(16, stop=("42",)))
    got = await read_all(outputs)
    assert "".join(d.text for d in got) == "The answer is "  # vLLM's stop: the string left out
    assert got[-1].finish_reason == "stop"
    await asyncio.wait_for(run, 5)  # the engine's side ended too
    assert request.request_id in channel.engine_core.aborted
    assert channel.outputs.routes == {}


async def test_n_choices_are_fanned_out_alike_on_both_sides(channel):
    outputs = channel.receiver.open("r")
    request, run = await channel.run("r", SamplingSpec(8, n=3, temperature=1.0, seed=7))
    assert await run == 12
    got = await read_all(outputs)
    texts = {i: "".join(d.text for d in got if d.index == i) for i in range(3)}
    assert texts == {0: "Hello there!", 1: "Hello there!", 2: "Hello there!"}
    seeds = sorted(r.sampling_params.seed for r in channel.engine_core.added)
    assert seeds == [7, 8, 9]  # vLLM's parallel sampling: child i samples with seed + i
    assert got[-1].finished


async def test_logprobs_are_decoded_and_finite(tokenizer):
    import numpy as np
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.outputs import LogprobsLists

    receiver = OutputReceiver("127.0.0.1", tokenizer)
    outputs = receiver.open("r", num_logprobs=1)
    request = engine_request("r", PROMPT, sampling_params(SamplingSpec(4, logprobs=1)))
    (ids,) = steps_of(tokenizer, " sea")

    class Connection:
        def send_abort(self, ids):
            pass

    receiver.add_request(request, Connection())
    logprobs = LogprobsLists(np.array([[ids[0], 11]]), np.array([[-0.5, -np.inf]]),
                             np.array([1]))
    receiver.process(EngineCoreOutputs(outputs=[EngineCoreOutput(
        request.request_id, ids, new_logprobs=logprobs, finish_reason=FinishReason.LENGTH)]),
        Connection())
    (delta,) = await outputs.next()
    assert delta.text == " sea"
    (entry,) = delta.logprobs
    assert entry.token == " sea" and entry.logprob == -0.5
    assert entry.top[0] == (" sea", -0.5)


async def test_cancelling_the_call_aborts_the_request_in_the_engine(channel):
    channel.receiver.open("r")
    channel.engine_core.hold_after = 0
    request, run = await channel.run("r", SamplingSpec(8))
    await asyncio.sleep(0.05)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert channel.engine_core.aborted == [request.request_id]
    assert channel.outputs.routes == {}


async def test_error_comes_after_the_deltas_before_it_and_not_after_the_last(channel):
    outputs = channel.receiver.open("r")
    outputs.put(GenerationDelta("a", 1, 3))
    outputs.fail(RuntimeError("engine died"))
    assert [d.text for d in await outputs.next()] == ["a"]
    with pytest.raises(RuntimeError, match="engine died"):
        await outputs.next()
    done = channel.receiver.open("s")
    done.put(GenerationDelta("b", 1, 3, "stop", finished=True))
    done.fail(RuntimeError("late"))  # the call failed after the last delta: nothing is lost
    assert [d.text for d in await done.next()] == ["b"]
    assert await done.next() is None


async def test_lost_connection_fails_the_requests_it_carried_on_both_sides(channel):
    outputs = channel.receiver.open("r")
    channel.engine_core.hold_after = 0
    request, run = await channel.run("r", SamplingSpec(8))
    await asyncio.sleep(0.05)
    (await channel.outputs.connections.get(channel.address)).close()
    with pytest.raises(ChannelLost):
        await asyncio.wait_for(outputs.next(), 5)
    with pytest.raises(ConnectionResetError):  # the LanguageModel's call fails and aborts it
        await asyncio.wait_for(run, 5)
    assert channel.engine_core.aborted == [request.request_id]


async def test_a_peer_with_the_wrong_token_is_disconnected_and_delivers_nothing(channel, caplog):
    outputs = channel.receiver.open("r")
    reader, writer = await asyncio.open_connection(channel.address.host, channel.address.port)
    writer.write(b"w" * TOKEN_BYTES + encode_frame(WireEncoder(), ABORT, ["r"]))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the Router hung up
    assert outputs.pending == [] and not outputs.finished
    assert "wrong channel token" in caplog.text
    writer.close()


async def test_connections_reconnect_after_the_router_closes_one(channel):
    first = await channel.outputs.connections.get(channel.address)
    first.close()
    await asyncio.sleep(0.05)
    second = await channel.outputs.connections.get(channel.address)
    assert second is not first and not second.closed


class RecordedStats:
    """A stat logger manager that keeps vLLM's IterationStats, as the replica records them."""

    def __init__(self):
        self.iterations = []

    def record(self, engine_idx, scheduler_stats, iteration_stats):
        if iteration_stats is not None:
            self.iterations.append(iteration_stats)


async def test_vllm_metrics_count_every_request_once_stop_strings_and_choices_too(open_channel):
    from vllm.v1.engine import FinishReason

    channel = await open_channel("The answer", " is 42", ". Done")
    channel.outputs.engine.logger_manager = recorded = RecordedStats()
    stopped, chosen = channel.receiver.open("r"), channel.receiver.open("s")
    _, stop_run = await channel.run("r", SamplingSpec(16, stop=("42",)))
    _, choices_run = await channel.run("s", SamplingSpec(16, n=2, temperature=1.0))
    await read_all(stopped), await read_all(chosen)
    await asyncio.gather(stop_run, choices_run)
    finished = sorted((f.request_id, f.finish_reason) for i in recorded.iterations
                      for f in i.finished_requests)
    # Each choice of "s" ended with the end-of-sequence token; "r" with its stop string, counted
    # `stop` as vLLM's frontend counts it, not as an abort.
    assert finished == [("r", FinishReason.STOP), ("s", FinishReason.STOP),
                        ("s", FinishReason.STOP)]
    # vLLM's n > 1 accounting: one entry per request once its last choice ended.
    assert sorted(n for i in recorded.iterations for n in i.n_params_iter) == [1, 2]
    assert sum(i.num_generation_tokens for i in recorded.iterations) >= 2 + 2 * 3
