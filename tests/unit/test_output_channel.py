"""The LanguageModel -> Router output channel over real TCP on 127.0.0.1: frames, the token
check, per-step batching, merging, errors and lost connections (the Router with the channel is
tested end to end in test_router.py and in the server tests)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
import pytest

from moonserve.pipeline.api.output_wire import (
    MAX_FRAME_BYTES,
    TOKEN_BYTES,
    ChannelAddress,
    FrameEncoder,
    FrameError,
    FrameReader,
    encode_frame,
)
from moonserve.pipeline.api.protocol import GenerationDelta, TokenLogprob, merge_deltas
from moonserve.pipeline.engine.output_sender import OutputSenders, send_outputs
from moonserve.pipeline.router.output_receiver import ChannelLost, OutputReceiver

pytestmark = pytest.mark.timeout(60)

TOKEN = b"t" * TOKEN_BYTES


def frame(*items) -> bytes:
    return encode_frame(FrameEncoder(), list(items))


def test_frames_split_anywhere_decode_whole():
    data = TOKEN + frame(("a", GenerationDelta("x", 1, 3))) + \
        frame(("b", GenerationDelta("y", 2, 4, "stop", token_ids=[5, 6], finished=True)))
    for cut in range(1, len(data)):
        reader = FrameReader(TOKEN)
        frames = reader.feed(data[:cut]) + reader.feed(data[cut:])
        assert [[(rid, d.text, d.finished) for rid, d in f] for f in frames] == \
            [[("a", "x", False)], [("b", "y", True)]]


def test_wrong_token_is_refused_before_any_frame_is_read():
    reader = FrameReader(TOKEN)
    with pytest.raises(FrameError, match="token"):
        reader.feed(b"x" * TOKEN_BYTES + frame(("a", GenerationDelta("x", 1, 3))))


def test_oversized_frame_is_refused_from_its_header():
    reader = FrameReader(TOKEN)
    header = (MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(FrameError, match="over the"):
        reader.feed(TOKEN + header + b"\x90")  # the body never has to arrive


def test_malformed_frame_is_a_frame_error():
    reader = FrameReader(TOKEN)
    with pytest.raises(FrameError, match="malformed"):
        reader.feed(TOKEN + (3).to_bytes(4, "big") + b"\x93\x01\x02")


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


async def scripted(deltas, steps: list[asyncio.Event] | None = None):
    """`deltas`, the k-th once `steps[k]` is set (an engine step waking every request)."""
    for k, delta in enumerate(deltas):
        if steps is not None:
            await steps[k].wait()
        yield delta


class CountingReceiver(OutputReceiver):
    """Counts the frames delivered, to see what one engine step's pushes became."""

    def __init__(self):
        super().__init__("127.0.0.1")
        self.frames: list[list[str]] = []

    def deliver(self, items, connection) -> None:
        self.frames.append([request_id for request_id, _ in items])
        super().deliver(items, connection)


@dataclass
class Channel:
    receiver: CountingReceiver
    address: ChannelAddress
    senders: OutputSenders


@pytest.fixture
async def channel():
    """A Router's receiver listening on 127.0.0.1 and a LanguageModel replica's senders."""
    receiver = CountingReceiver()
    senders = OutputSenders()
    yield Channel(receiver, await receiver.start(), senders)
    senders.close()
    receiver.stop()


async def read_all(outputs) -> list[GenerationDelta]:
    got = []
    while (deltas := await outputs.next()) is not None:
        got += deltas
    return got


async def test_one_loop_turn_of_pushes_is_one_frame_for_all_requests(channel):
    steps = [asyncio.Event() for _ in range(3)]
    deltas = [[GenerationDelta(f"{r}{k}", 1, 3, finished=k == 2) for k in range(3)]
              for r in "abcd"]
    outputs = {r: channel.receiver.open(r) for r in "abcd"}
    sends = [asyncio.ensure_future(send_outputs(channel.senders, channel.address, r,
                                                scripted(deltas[i], steps)))
             for i, r in enumerate("abcd")]
    for step in steps:
        await asyncio.sleep(0.1)  # connected, every request waiting for this step
        step.set()  # every request wakes in the same loop turn
    assert await asyncio.gather(*sends) == [3, 3, 3, 3]
    for r in "abcd":
        assert "".join(d.text for d in await read_all(outputs[r])) == f"{r}0{r}1{r}2"
    # One frame per step with every request's delta, not one message per request per token.
    assert channel.receiver.frames == [list("abcd")] * 3


async def test_a_reader_behind_gets_one_merged_delta_per_read(channel):
    outputs = channel.receiver.open("r")
    deltas = [GenerationDelta(t, 1, 3, token_ids=[k]) for k, t in enumerate("abc")]
    deltas[-1] = msgspec.structs.replace(deltas[-1], finish_reason="stop", finished=True)
    await send_outputs(channel.senders, channel.address, "r", scripted(deltas))
    await asyncio.sleep(0.1)
    (merged,) = await outputs.next()
    assert (merged.text, merged.num_tokens, merged.token_ids, merged.finish_reason) == \
        ("abc", 3, [0, 1, 2], "stop")
    assert await outputs.next() is None


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


async def test_deltas_before_a_failure_are_written_before_it_leaves(channel):
    outputs = channel.receiver.open("r")

    async def failing():
        yield GenerationDelta("a", 1, 3)
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError):
        await send_outputs(channel.senders, channel.address, "r", failing())
    # Written to the socket before the failure went back to the Router (over Ray), not left
    # for the next loop turn.
    assert (await channel.senders.get(channel.address)).pending == []
    await asyncio.sleep(0.1)
    assert [d.text for d in await outputs.next()] == ["a"]


async def test_lost_connection_fails_the_requests_it_carried(channel):
    outputs = channel.receiver.open("r")
    await send_outputs(channel.senders, channel.address, "r",
                       scripted([GenerationDelta("a", 1, 3)]))
    await asyncio.sleep(0.1)
    assert [d.text for d in await outputs.next()] == ["a"]
    channel.senders.close()  # the replica's end goes away before the request's last delta
    with pytest.raises(ChannelLost):
        await asyncio.wait_for(outputs.next(), 5)


async def test_a_peer_with_the_wrong_token_is_disconnected_and_delivers_nothing(channel, caplog):
    outputs = channel.receiver.open("r")
    reader, writer = await asyncio.open_connection(channel.address.host, channel.address.port)
    writer.write(b"w" * TOKEN_BYTES + frame(("r", GenerationDelta("a", 1, 3, finished=True))))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the Router hung up
    assert outputs.pending == [] and not outputs.finished
    assert "wrong channel token" in caplog.text
    writer.close()


async def test_senders_reconnect_after_the_router_closes_the_connection(channel):
    first = await channel.senders.get(channel.address)
    first.close()
    await first.writer.wait_closed()
    second = await channel.senders.get(channel.address)
    assert second is not first and not second.closed
