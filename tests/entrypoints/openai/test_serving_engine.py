"""merge_async_iterators and StreamState, the pieces the endpoints build on."""

import asyncio

import pytest

from pagedserve.entrypoints.openai.serving_engine import Interrupted, StreamState, merge_async_iterators
from pagedserve.outputs import CompletionOutput


async def ticker(name: str, delays: list[float], closed: list[str], fail_at: int | None = None):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            if i == fail_at:
                raise ValueError(f"{name} failed")
            yield f"{name}{i}"
    finally:
        closed.append(name)


def test_merge_yields_items_as_they_arrive():
    async def main():
        closed = []
        merged = merge_async_iterators(ticker("a", [0.0, 0.5], closed), ticker("b", [0.05, 0.0, 0.0], closed))
        items = [item async for item in merged]
        return items, closed

    items, closed = asyncio.run(main())
    assert items == [(0, "a0"), (1, "b0"), (1, "b1"), (1, "b2"), (0, "a1")]
    assert sorted(closed) == ["a", "b"]


def test_an_error_or_closing_the_merge_closes_every_iterator():
    async def main():
        closed = []
        merged = merge_async_iterators(ticker("a", [0.0, 10.0], closed), ticker("b", [0.01, 0.0], closed, fail_at=1))
        with pytest.raises(ValueError, match="b failed"):
            async for _ in merged:
                pass
        assert sorted(closed) == ["a", "b"]  # "a" was waiting: cancelled, its finally ran

        closed.clear()
        merged = merge_async_iterators(ticker("a", [0.0, 10.0], closed), ticker("b", [10.0], closed))
        assert await anext(merged) == (0, "a0")
        await merged.aclose()
        assert sorted(closed) == ["a", "b"]

    asyncio.run(asyncio.wait_for(main(), timeout=5))


def test_the_until_future_interrupts_the_merge_and_closes_every_iterator():
    """The drain's abort: a future, done at some point, ends every running request's merge."""
    async def main():
        closed = []
        until = asyncio.get_running_loop().create_future()
        merged = merge_async_iterators(ticker("a", [0.0, 10.0], closed), ticker("b", [10.0], closed), until=until)
        assert await anext(merged) == (0, "a0")
        asyncio.get_running_loop().call_later(0.05, until.set_result, None)
        with pytest.raises(Interrupted):
            await anext(merged)
        assert sorted(closed) == ["a", "b"]
        # Finished iterators end the merge even though `until` never completes.
        other = asyncio.get_running_loop().create_future()
        items = [item async for item in merge_async_iterators(ticker("c", [0.0], closed), until=other)]
        assert items == [(0, "c0")] and not other.done()

    asyncio.run(asyncio.wait_for(main(), timeout=5))

def test_stream_state_sends_each_piece_once():
    def out(text, tokens, finish=None):
        return CompletionOutput(index=0, text=text, token_ids=tokens, cumulative_logprob=None, logprobs=None,
                                finish_reason=finish)

    state = StreamState()
    assert state.advance(out("", [5])) is None  # text held back (a possible stop string): wait
    assert state.advance(out("Hel", [5, 6])) == ("Hel", slice(0, 2))
    assert state.advance(out("Hel", [5, 6])) is None
    assert state.advance(out("Hello", [5, 6, 7], "stop")) == ("lo", slice(2, 3))
    assert state.advance(out("Hello", [5, 6, 7], "stop")) is None  # finished: nothing more
    finished_empty = StreamState()
    assert finished_empty.advance(out("", [2], "stop")) == ("", slice(0, 1))  # the finish reason still goes out


def test_a_lone_surrogate_anywhere_in_a_response_is_sent_as_its_json_escape():
    """The last line of defence behind the tool parsers: a whole response and a stream's event
    with a lone surrogate in a string are valid UTF-8 JSON that decodes back to the same text."""
    import json

    from pagedserve.entrypoints.openai.protocol import ChatResponseMessage
    from pagedserve.entrypoints.openai.serving_engine import json_response, sse

    message = ChatResponseMessage(content="a\ud800b \U0001F600")
    body = json_response(message).body
    assert json.loads(body.decode("utf-8"))["content"] == "a\ud800b \U0001F600"
    event = sse(message)
    assert event.startswith("data: ") and event.endswith("\n\n")
    event.encode("utf-8")
    assert json.loads(event.removeprefix("data: "))["content"] == "a\ud800b \U0001F600"


def test_a_response_serialized_choice_by_choice_is_what_json_response_writes():
    from fastapi.responses import JSONResponse

    from pagedserve.entrypoints.openai.protocol import CompletionChoice, CompletionResponse, UsageInfo
    from pagedserve.entrypoints.openai.serving_engine import json_response

    tricky = 'a "choices":[] \\"choices\\":[] ü'  # the splice's key inside strings
    response = CompletionResponse(id="cmpl-1", model=tricky, usage=UsageInfo(prompt_tokens=1, completion_tokens=2,
                                                                              total_tokens=3),
                                  choices=[CompletionChoice(index=i, text=tricky * i, finish_reason="length")
                                           for i in range(3)])
    assert json_response(response).body == JSONResponse(response.model_dump()).body
