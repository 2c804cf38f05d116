"""Background responses (`background: true` on `/v1/responses`) through the real `openai` SDK: the create call answers
at once, polling shows the response until it has finished, equal to the same request run in the foreground;
streamed, a client may leave and join again after any sequence number; `cancel` and `delete` stop a running one and
free its slot and KV blocks."""
from __future__ import annotations

import time

import openai
import pytest

from tests.server.test_concurrency import _cancelled
from tests.server.test_responses import NO_THINK, _settled

LONG = dict(input="Tell me about the weather.", max_output_tokens=3000, extra_body={"ignore_eos": True})


def _poll(client, response_id: str, until: tuple[str, ...], timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status in until or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_a_background_response_is_polled_to_what_the_foreground_answers(demo_server):
    client = demo_server.openai()
    kw = dict(model=demo_server.model, input="Say hello.", max_output_tokens=12, temperature=1.0,
              extra_body={"seed": 9, **NO_THINK})
    fg = client.responses.create(**kw)
    bg = client.responses.create(background=True, **kw)
    assert bg.background is True and bg.status in ("queued", "in_progress") and bg.usage is None
    done = _poll(client, bg.id, ("completed", "incomplete", "failed"))
    assert done.status == fg.status and done.output_text == fg.output_text
    assert done.usage.output_tokens == fg.usage.output_tokens and done.background is True
    follow = client.responses.create(model=demo_server.model, previous_response_id=bg.id, input="More.",
                                     max_output_tokens=1)
    assert follow.usage.input_tokens > done.usage.input_tokens  # the background turn is in the history


def test_cancel_stops_a_running_background_response_and_frees_its_slot(demo_server):
    client = demo_server.openai()
    free = demo_server.stats().num_free_blocks
    before = _cancelled(demo_server)
    bg = client.responses.create(model=demo_server.model, background=True, **LONG)
    running = _poll(client, bg.id, ("in_progress",))
    assert running.status == "in_progress" and demo_server.stats().num_running == 1
    items_running = client.responses.input_items.list(bg.id).data  # listed while it runs, as once stored
    assert [(i.type, i.role, i.content[0].text) for i in items_running] == [("message", "user", LONG["input"])]
    with pytest.raises(openai.BadRequestError) as e:  # its conversation is not settled yet
        client.responses.create(model=demo_server.model, previous_response_id=bg.id, input="x", max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(bg.id)
    assert cancelled.status == "cancelled" and cancelled.id == bg.id
    _settled(demo_server, free)
    assert _cancelled(demo_server) - before == 1
    assert client.responses.retrieve(bg.id).status == "cancelled"
    assert client.responses.input_items.list(bg.id).data == items_running
    assert client.responses.cancel(bg.id).status == "cancelled"  # cancelling again answers the same


def test_deleting_a_running_background_response_stops_it(demo_server):
    client = demo_server.openai()
    free = demo_server.stats().num_free_blocks
    bg = client.responses.create(model=demo_server.model, background=True, **LONG)
    _poll(client, bg.id, ("in_progress",))
    assert client.responses.delete(bg.id) is None
    _settled(demo_server, free)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(bg.id)


def test_only_background_responses_can_be_cancelled(demo_server):
    client = demo_server.openai()
    r = client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(r.id)
    assert e.value.body["param"] == "response_id"
    # one that already ended is too late to cancel (it answered 200 as it ended: the client could not tell)
    bg = client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=1, background=True)
    _poll(client, bg.id, ("completed", "incomplete"))
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(bg.id)
    assert "Cannot cancel a completed response" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_missing")


def test_a_streamed_background_response_goes_on_without_its_client_and_replays(demo_server):
    client = demo_server.openai()
    kw = dict(model=demo_server.model, input="Say hello.", max_output_tokens=12, temperature=1.0,
              extra_body={"seed": 4, **NO_THINK})
    fg = client.responses.create(**kw)
    stream = client.responses.create(background=True, stream=True, **kw)
    first = []
    for ev in stream:
        first.append(ev)
        if len(first) == 3:
            break
    stream.close()  # the client leaves; the response goes on
    rid = first[0].response.id
    assert first[0].type == "response.created" and first[0].response.background is True
    # queued, as the create call and GET show it, until generation starts
    assert [e.type for e in first] == ["response.created", "response.queued", "response.in_progress"]
    assert [e.response.status for e in first] == ["queued", "queued", "in_progress"]
    done = _poll(client, rid, ("completed", "incomplete"))
    assert done.output_text == fg.output_text
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=2))
    assert [e.sequence_number for e in rest] == list(range(3, 3 + len(rest)))
    assert rest[-1].type == f"response.{done.status}" and rest[-1].response.output_text == fg.output_text
    whole = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in whole] == list(range(len(whole))) and whole[3:] == rest
    assert [e.type for e in whole[:3]] == [e.type for e in first] and whole[0].response.status == "queued"


def test_joining_a_running_stream_follows_it_until_it_is_cancelled(demo_server):
    client = demo_server.openai()
    free = demo_server.stats().num_free_blocks
    bg = client.responses.create(model=demo_server.model, background=True, **LONG)
    _poll(client, bg.id, ("in_progress",))
    joined = client.responses.retrieve(bg.id, stream=True, starting_after=0)
    seen = []
    for ev in joined:
        seen.append(ev)
        if len(seen) == 8:
            client.responses.cancel(bg.id)  # the stream then ends by itself
    assert seen[0].sequence_number == 1 and len(seen) >= 8
    assert [e.sequence_number for e in seen] == list(range(1, 1 + len(seen)))
    _settled(demo_server, free)
    with pytest.raises(openai.BadRequestError) as e:
        foreground = client.responses.create(model=demo_server.model, input="Hi", max_output_tokens=1)
        list(client.responses.retrieve(foreground.id, stream=True))
    assert e.value.body["param"] == "stream"
