"""LMTP over real sockets against the real engine on the tiny model."""

from __future__ import annotations

import asyncio
import json

import pytest

from salience.core.types import SamplingOptions
from tests.lmtp.conftest import LmtpServer

PROMPT = [0, *range(40, 60)]


def generate(stream_id: int, prompt=PROMPT, **fields) -> str:
    body = {"model": "tiny", "prompt": prompt, "stream_id": stream_id, "max_tokens": 8, "temperature": 0.0}
    body |= {"ignore_eos": True} | fields
    return "GENERATE " + json.dumps(body)


async def direct(lmtp_server: LmtpServer, prompt, **options) -> list:
    generation = lmtp_server.engine.generate(prompt, SamplingOptions(ignore_eos=True, **options))
    return [event async for event in generation]


async def test_generate_payloads_have_exactly_what_lmql_reads(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send(generate(1, top_logprobs=3, max_tokens=6))
    payloads = await client.stream(1)
    expected = await direct(lmtp_server, PROMPT, max_tokens=6, temperature=0.0, logprobs=3)
    assert [p["token"] for p in payloads] == [e.token_id for e in expected]
    for payload, event in zip(payloads, expected, strict=True):
        assert set(payload) == {"token", "stream_id", "logprob", "finish_reason", "top_logprobs"}
        assert payload["stream_id"] == 1 and isinstance(payload["logprob"], float)
        assert payload["logprob"] == pytest.approx(event.logprob, abs=1e-6)
        assert payload["top_logprobs"] == pytest.approx({str(t): lp for t, lp in event.top_logprobs}, abs=1e-6)
    assert [p["finish_reason"] for p in payloads] == [None] * 5 + ["length"]


async def test_score_payloads(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    scored = [300, 301, 302, 303]
    await client.send("SCORE " + json.dumps({"model": "tiny", "prompt": PROMPT, "scored": scored, "stream_id": 2}))
    payloads = await client.stream(2)
    expected = await lmtp_server.engine.score(PROMPT, scored)
    assert [p["token"] for p in payloads] == scored
    assert [p["logprob"] for p in payloads] == pytest.approx([s.logprob for s in expected], abs=1e-6)
    assert all("top_logprobs" not in p for p in payloads)
    assert [p["finish_reason"] for p in payloads] == [None, None, None, "length"]


async def test_model_info_and_tokenizer_messages(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send('MODEL_INFO {"stream_id": 3, "model": "tiny", "data": {"model": "tiny"}}')
    info = await asyncio.wait_for(client.messages.get(), 10)
    assert info["stream_id"] == 3 and info["model_info"]["model"] == "tiny"
    assert info["model_info"]["vocab_size"] == lmtp_server.engine.vocab_size
    text = "def héllo(x): return '日本' 🎉"
    await client.send("TOKENIZE " + json.dumps({"stream_id": 4, "text": text}))
    tokens = (await asyncio.wait_for(client.messages.get(), 10))["tokens"]
    assert tokens == lmtp_server.engine.tokenizer.encode(text, add_special_tokens=False)
    await client.send("DETOKENIZE " + json.dumps({"stream_id": 5, "tokens": tokens}))
    assert (await asyncio.wait_for(client.messages.get(), 10)) == {"stream_id": 5, "text": text}


async def test_text_mode_never_splits_a_character(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    text = "naïve café — 日本語のテキスト 🎉🎉 done"
    tokens = lmtp_server.engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(text.split())  # multi-byte characters really are split across tokens
    score = {"model": "tiny", "prompt": [0], "scored": tokens, "stream_id": 6, "text": True}
    await client.send("SCORE " + json.dumps(score))
    pieces = [p["text"] for p in await client.stream(6)]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # some token completed no character and was held back

    await client.send(generate(7, text=True, max_tokens=20))
    payloads = await client.stream(7)
    generated = [p["token"] for p in payloads]
    assert "".join(p["text"] for p in payloads) == lmtp_server.engine.tokenizer.decode(generated)


async def test_cancel_ends_the_stream_with_cancelled(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send(generate(8, max_tokens=1000))
    queue = client.streams.setdefault(8, asyncio.Queue())
    first = await asyncio.wait_for(queue.get(), 30)
    await client.send('CANCEL {"stream_id": 8}')
    payloads = [first, *await client.stream(8)]
    assert payloads[-1]["finish_reason"] == "cancelled"
    assert len(payloads) < 1000
    await client.send('CANCEL {"stream_id": 8}')
    assert "not running" in (await client.stream(8))[0]["error"]


@pytest.mark.parametrize(
    ("line", "stream_id", "message"),
    [
        (generate(20, prompt=[0, 10**6]), 20, "prompt[1] = 1000000 is not a token id"),
        (generate(21, prompt=[0, -4]), 21, "prompt[1] must be a non-negative integer"),
        (generate(22, model="gpt-5"), 22, "model 'gpt-5' is not served here"),
        (generate(23, prompt=[0] * 3000), 23, "exceed the model's context"),
        (generate(24, top_logprobs=100), 24, "top logprobs must be an integer in 0..20"),
        (generate(25, logit_bias={"1": "x"}), 25, "logit_bias[1] must be a number"),
        (generate(26, temprature=2), 26, "unknown field 'temprature'"),
        ('GENERATE {"stream_id": 27, "prompt": [0, 1', 27, "not valid JSON"),
        ("SCORE " + json.dumps({"stream_id": 28, "prompt": [0], "scored": [99999]}), 28, "continuation[0]"),
    ],
)
async def test_stream_errors_reach_their_stream_and_nothing_else(
    lmtp_server: LmtpServer, connect, line: str, stream_id: int, message: str
) -> None:
    client = await connect()
    await client.send(generate(99, max_tokens=40))
    await client.send(line)
    error = await client.stream(stream_id)
    assert len(error) == 1 and message in error[0]["error"]
    survivor = await client.stream(99)
    assert len(survivor) == 40 and survivor[-1]["finish_reason"] == "length"
    expected = await direct(lmtp_server, PROMPT, max_tokens=40, temperature=0.0)
    assert [p["token"] for p in survivor] == [e.token_id for e in expected]


@pytest.mark.parametrize(
    ("line", "message"),
    [("HELLO", "expected 'TYPE <json>'"), ("FROB {}", "unknown message type 'FROB'"), ("MODEL_INFO [", "not valid")],
)
async def test_connection_level_errors_come_as_msg(connect, line: str, message: str) -> None:
    client = await connect()
    await client.send(line)
    reply = await asyncio.wait_for(client.messages.get(), 10)
    assert message in reply["error"]
    await client.send(generate(1, max_tokens=2))
    assert len(await client.stream(1)) == 2


async def test_reused_stream_id_is_an_error_for_that_id_only(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send(generate(30, max_tokens=60))
    await client.send(generate(30, max_tokens=5))
    await client.send(generate(31, max_tokens=5))
    payloads = await client.stream(30)
    assert "already running" in payloads[-1]["error"]
    assert len(await client.stream(31)) == 5
    rest = await client.stream(30)
    assert len(payloads) - 1 + len(rest) == 60 and rest[-1]["finish_reason"] == "length"


async def test_fifty_streams_over_five_connections(lmtp_server: LmtpServer, connect) -> None:
    clients = [await connect() for _ in range(5)]
    prompts = {key: [0, *range(100 + 3 * key, 110 + 3 * key)] for key in range(50)}
    for c, client in enumerate(clients):
        for s in range(10):
            await client.send(generate(s, prompt=prompts[c * 10 + s], max_tokens=16))
    results = await asyncio.gather(*(client.stream(s) for client in clients for s in range(10)))
    for key, payloads in zip(sorted(prompts), results, strict=True):
        expected = await direct(lmtp_server, prompts[key], max_tokens=16, temperature=0.0)
        assert [p["token"] for p in payloads] == [e.token_id for e in expected]
        assert [p["finish_reason"] for p in payloads][-1] == "length"
    assert any(len({p["stream_id"] for p in payloads}) > 1 for client in clients for _, payloads in client.frames)


async def test_disconnect_aborts_every_running_request(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    for s in range(6):
        await client.send(generate(s, max_tokens=1500))
    await asyncio.wait_for(client.streams.setdefault(5, asyncio.Queue()).get(), 30)
    assert lmtp_server.engine.num_unfinished_requests() == 6
    await client.ws.close()
    for _ in range(100):
        if lmtp_server.engine.num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    assert lmtp_server.engine.num_unfinished_requests() == 0


async def test_plain_tcp_transport(lmtp_server: LmtpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", lmtp_server.tcp_port)
    writer.write((generate(1, max_tokens=5) + "\nFROB {}\n").encode())
    await writer.drain()
    tokens, errors = [], []
    while len(tokens) < 5 or not errors:
        kind, _, body = (await asyncio.wait_for(reader.readline(), 30)).decode().partition(" ")
        for payload in json.loads(body):
            (tokens if kind == "TOKEN" else errors).append(payload)
    writer.close()
    expected = await direct(lmtp_server, PROMPT, max_tokens=5, temperature=0.0)
    assert [p["token"] for p in tokens] == [e.token_id for e in expected]
    assert "unknown message type" in errors[0]["error"]
