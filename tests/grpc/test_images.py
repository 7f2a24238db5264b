"""Images in sessions on a tiny random Qwen2-VL, over a real gRPC channel, against transformers."""

from __future__ import annotations

import base64
import contextlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
import pytest_asyncio
import torch
from aiohttp import web
from PIL import Image

from salience.core.engine.engine import Engine
from salience.core.engine.requests import ImageBlock, SamplingOptions
from salience.core.models.folders import model_fingerprint
from salience.core.probes.concepts import ConceptSet
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.core.serving.turns import Turn
from salience.grpc_frontend.client import AsyncSalienceClient
from salience.grpc_frontend.server import GrpcServer, start_grpc_server
from salience.http_app import make_app
from salience.lmtp.session import LmtpConfig
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from tests.conftest import free_port, start_engine
from tests.images import decode, image_bytes
from tests.reference import assert_readout_close, reference_readouts
from tests.vl_reference import VlReference, expected_pads

MODEL = "tiny-vl"
LAYERS = (0, 3)
MIMES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


@pytest.fixture(scope="module")
def vl_concepts(tiny_vl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ConceptSet:
    generator = torch.Generator().manual_seed(2)
    vectors = {
        layer: torch.nn.functional.normalize(torch.randn(3, 128, generator=generator), dim=1) for layer in LAYERS
    }
    built = ConceptSet(
        concepts=("a", "b", "c"),
        vectors=vectors,
        hidden_size=128,
        num_layers=4,
        model_fingerprint=model_fingerprint(tiny_vl_model),
        provenance={"method": "random unit vectors", "seed": 2},
    )
    path = tmp_path_factory.mktemp("vl-concepts") / "concepts.safetensors"
    built.save(path)
    return ConceptSet.load(path)


@pytest_asyncio.fixture(scope="module", params=["eager", "compiled"])
async def served(
    request: pytest.FixtureRequest, tiny_vl_model: Path, vl_concepts: ConceptSet
) -> AsyncIterator[tuple[Engine, GrpcServer]]:
    engine = await start_engine(
        tiny_vl_model,
        served_model_name=MODEL,
        max_model_len=1024,
        concepts=vl_concepts,
        compile=request.param == "compiled",
        engine_args={"worker_extension_cls": "tests.encoder_probe.EncoderCountingWorker"},
    )
    await encoder_passes(engine)  # hooks the vision tower before any image is seen
    status = ServerStatus(MODEL)
    status.ready(engine)
    server = await start_grpc_server(status, SessionStore(status.serving_engine), "127.0.0.1", 0)
    await server.serving(True)
    yield engine, server
    await server.stop(0)
    engine.shutdown()


@pytest_asyncio.fixture
async def client(served) -> AsyncIterator[AsyncSalienceClient]:
    async with AsyncSalienceClient(f"127.0.0.1:{served[1].port}") as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_vl_model: Path) -> VlReference:
    return VlReference(tiny_vl_model)


class Vocab:
    def __init__(self, engine: Engine) -> None:
        vision = engine.vision
        assert vision is not None
        self.start, self.pad, self.end = vision.start, vision.pad, vision.end

    def block(self, n: int) -> list[int]:
        return [self.start, *[self.pad] * n, self.end]


def attachment(data: bytes, start: int, n: int, mime: str = "image/png") -> pb.ImageAttachment:
    return pb.ImageAttachment(bytes=data, mime=mime, pad_range_start=start, pad_range_end=start + n + 2)


def huge_png() -> bytes:
    """A small file that would decode to 72 Mpixels: refused from its header."""
    out = io.BytesIO()
    Image.new("1", (9000, 8000)).save(out, "PNG")
    return out.getvalue()


async def status_of(awaitable) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value.code(), info.value.details()


PRE = [0, *range(60, 70)]
POST = list(range(80, 86))


async def test_image_info_gives_the_processor_count(served, tiny_vl_model: Path) -> None:
    engine, server = served
    rpc = extensions_pb2_grpc.SalienceExtensionsStub(grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))
    vocab = Vocab(engine)
    for fmt, size in (("PNG", (112, 84)), ("JPEG", (200, 120)), ("WEBP", (56, 56)), ("GIF", (90, 130))):
        data = image_bytes(fmt, size)
        reply = await rpc.ImageInfo(ext.ImageInfoRequest(bytes=data, mime=MIMES[fmt]))
        n, grid = expected_pads(tiny_vl_model, decode(data))
        assert (reply.pad_tokens, reply.block_tokens, (reply.grid_t, reply.grid_h, reply.grid_w)) == (n, n + 2, grid)
        assert (reply.vision_start_token_id, reply.image_pad_token_id, reply.vision_end_token_id) == (
            vocab.start,
            vocab.pad,
            vocab.end,
        )
        assert (reply.width, reply.height) == size
    code, details = await status_of(rpc.ImageInfo(ext.ImageInfoRequest(bytes=b"not an image", mime="image/png")))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "do not decode as an image" in details


async def test_one_image_logprobs_readouts_and_greedy_match_the_reference(
    served, client: AsyncSalienceClient, reference: VlReference, vl_concepts: ConceptSet, tiny_vl_model: Path
) -> None:
    engine, _ = served
    vocab = Vocab(engine)
    data = image_bytes("PNG", (112, 84), seed=1)
    image = decode(data)
    n, _ = expected_pads(tiny_vl_model, image)
    tokens = PRE + vocab.block(n) + POST
    session = await client.open_session(MODEL)
    covered = [(len(PRE) - 1, len(tokens) + 3)]  # the block, the text after it, the decoded tokens
    result = await session.generate(
        tokens,
        images=[attachment(data, len(PRE), n)],
        max_tokens=3,
        top_k=1,
        logprobs_ranges=covered,
        logprob_top_k=2,
        readout_ranges=covered,
    )
    ids = await session.dump()
    assert ids == tokens + result.token_ids and session.length == len(ids)
    assert result.token_ids == reference.greedy(tokens, [image], 3)
    logprobs = reference.logprobs(ids, [image])
    want = reference_readouts(reference, vl_concepts, ids, [image])
    events = result.prefill + result.tokens
    assert [t.position for t in events] == list(range(*covered[0]))
    for token in events:
        assert token.id == ids[token.position]
        expected = logprobs[token.position - 1, token.id].item()
        assert token.sampled_logprob == pytest.approx(expected, rel=1e-4, abs=1e-5), token.position
        assert_readout_close(list(token.readout), want[token.position])  # image pads included


async def test_two_images_in_one_turn_then_a_third_in_the_next(
    served, client: AsyncSalienceClient, reference: VlReference, tiny_vl_model: Path
) -> None:
    engine, _ = served
    vocab = Vocab(engine)
    folder = tiny_vl_model
    first, second, third = (
        image_bytes("JPEG", (84, 84), 2),
        image_bytes("WEBP", (140, 56), 3),
        image_bytes("GIF", seed=4),
    )
    n1, n2, n3 = (expected_pads(folder, decode(d))[0] for d in (first, second, third))
    turn1 = PRE + vocab.block(n1) + [70, 71] + vocab.block(n2) + POST
    session = await client.open_session(MODEL)
    attachments = [
        attachment(second, len(PRE) + n1 + 4, n2, "image/webp"),
        attachment(first, len(PRE), n1, "image/jpeg"),
    ]
    one = await session.generate(turn1, images=attachments, max_tokens=2, top_k=1)
    images = [decode(first), decode(second)]
    assert one.token_ids == reference.greedy(turn1, images, 2)

    start = session.length + 1
    turn2 = [72, *vocab.block(n3), 73]
    two = await session.generate(turn2, images=[attachment(third, start, n3, "image/gif")], max_tokens=2, top_k=1)
    ids = await session.dump()
    assert ids == turn1 + one.token_ids + turn2 + two.token_ids
    images.append(decode(third))
    assert two.token_ids == reference.greedy(ids[: len(ids) - 2], images, 2)
    assert two.done.prompt_tokens == len(ids) - 2


async def test_attachment_validation(
    served, client: AsyncSalienceClient, reference: VlReference, tiny_vl_model: Path
) -> None:
    engine, _ = served
    vocab = Vocab(engine)
    data = image_bytes("PNG", seed=5)
    n, grid = expected_pads(tiny_vl_model, decode(data))
    good = PRE + vocab.block(n) + POST
    session = await client.open_session(MODEL)
    at = len(PRE)
    bad = [
        (good, [attachment(data, at, n - 1)], "images[0]: block"),
        (PRE + vocab.block(n - 1) + POST, [attachment(data, at, n - 1)], f"this image needs {n} (grid {grid[0]}x"),
        (good, [attachment(data, at + 1, n)], "must run from <|vision_start|>"),
        (good, [attachment(data, at, n + 10)], "must lie in this call's appended tokens"),
        (
            [*good[:at], vocab.start, 5, *([vocab.pad] * (n - 1)), vocab.end, *POST],
            [attachment(data, at, n)],
            "not <|image_pad|>",
        ),
        (good, [], "the vision block starting at position 11 has no image attached"),
        ([*PRE, vocab.pad, *POST], [], "position 11 holds vision token"),
        (good + vocab.block(n), [attachment(data, at, n)], "has no image attached"),
        (good, [attachment(data, at, n), attachment(data, at, n)], "overlap"),
        (good, [attachment(b"garbage", at, n)], "do not decode as an image"),
        (good, [attachment(data, at, n, "image/jpeg")], "declared image/jpeg but the bytes are PNG"),
        (good, [attachment(data, at, n, "image/tiff")], "mime 'image/tiff' is not one of"),
        (good, [attachment(huge_png(), at, n)], "9000x8000 pixels exceed the limit"),
    ]
    for tokens, attachments, message in bad:
        code, details = await status_of(session.generate(tokens, images=attachments))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and message in details, (message, details)
    assert await session.dump() == []


async def test_fork_and_rewind_respect_image_blocks(
    served, client: AsyncSalienceClient, reference: VlReference, tiny_vl_model: Path
) -> None:
    engine, _ = served
    vocab = Vocab(engine)
    data = image_bytes("PNG", seed=6)
    image = decode(data)
    n, _ = expected_pads(tiny_vl_model, image)
    tokens = PRE + vocab.block(n) + POST
    session = await client.open_session(MODEL)
    await session.generate(tokens, images=[attachment(data, len(PRE), n)])
    block_end = len(PRE) + n + 2
    for inside in (len(PRE) + 1, block_end - 1):
        code, details = await status_of(session.fork(inside))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "inside the image block" in details
        code, details = await status_of(session.generate([1], truncate_to=inside))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "inside the image block" in details

    # A fork at the block's end keeps the image: its next turn still sees it.
    kept = await session.fork(block_end)
    more = await kept.generate([90, 91], max_tokens=2, top_k=1)
    assert more.token_ids == reference.greedy([*tokens[:block_end], 90, 91], [image], 2)
    # A fork at the block's start drops it; the client may write a new block there.
    dropped = await session.fork(len(PRE))
    assert await dropped.dump() == PRE
    code, details = await status_of(dropped.generate(vocab.block(n)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "no image attached" in details
    # Rewinding to the block's start drops the image too, and a new one can take its place.
    other = image_bytes("PNG", seed=7)
    m, _ = expected_pads(tiny_vl_model, decode(other))
    again = await session.generate(
        vocab.block(m), truncate_to=len(PRE), images=[attachment(other, len(PRE), m)], max_tokens=1, top_k=1
    )
    assert again.token_ids == reference.greedy(PRE + vocab.block(m), [decode(other)], 1)


async def test_lmtp_sessions_take_images_too(served, tiny_vl_model: Path) -> None:
    engine, _ = served
    vocab = Vocab(engine)
    data = image_bytes("WEBP", seed=8)
    encoded = base64.b64encode(data).decode()
    async with (
        http_frontend(engine) as port,
        aiohttp.ClientSession() as http,
        http.ws_connect(f"http://127.0.0.1:{port}/") as ws,
    ):

        async def ask(kind: str, **body) -> list[dict]:
            await ws.send_str(f"{kind} {json.dumps(body)}")
            payloads = []
            while True:
                frame = json.loads((await ws.receive()).data.partition(" ")[2])
                payloads += frame
                if any("finish_reason" not in p or p["finish_reason"] or p.get("error") for p in frame):
                    return payloads

        info = (await ask("IMAGE_INFO", stream_id=1, data=encoded, mime="image/webp"))[0]
        n, grid = expected_pads(tiny_vl_model, decode(data))
        assert (info["pad_tokens"], info["grid_thw"]) == (n, list(grid))
        sid = (await ask("OPEN_SESSION", stream_id=2))[0]["session_id"]
        image = {"data": encoded, "mime": "image/webp", "start": len(PRE), "end": len(PRE) + n + 2}
        tokens = PRE + vocab.block(n) + POST
        payloads = await ask(
            "SESSION_GENERATE",
            stream_id=3,
            session_id=sid,
            offset=0,
            append=tokens,
            images=[image],
            max_tokens=2,
            temperature=0,
        )
        assert payloads[-1]["finish_reason"] == "length" and payloads[-1]["usage"]["prompt_tokens"] == len(tokens)
        wrong = dict(image, end=image["end"] - 1)
        payloads = await ask(
            "SESSION_GENERATE", stream_id=4, session_id=sid, offset=len(tokens) + 2, append=[], images=[wrong]
        )
        assert "must lie in this call's appended tokens" in payloads[-1]["error"]


@contextlib.asynccontextmanager
async def http_frontend(engine: Engine) -> AsyncIterator[int]:
    """The WebSocket and HTTP port (LMTP and the OpenAI API) on the engine; yields the port."""
    status = ServerStatus(MODEL)
    status.ready(engine)
    runner = web.AppRunner(make_app(status, LmtpConfig()))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def test_chat_messages_carry_images_as_transformers_processor_places_them(
    served, reference: VlReference, tiny_vl_model: Path
) -> None:
    """An image_url part with a data: URL, through the OpenAI API and LMTP's messages: the prompt
    is the processor's own (each image expanded to its pads), the greedy reply and its logprobs
    are transformers' on it, and SCORE refuses an image it cannot read."""
    from transformers import AutoProcessor

    engine, _ = served
    first, second = image_bytes("PNG", seed=4), image_bytes("GIF", size=(84, 112), seed=5)
    messages = [
        {"role": "system", "content": "Compare."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(first, "image/png")}},
                {"type": "text", "text": "and"},
                {"type": "image_url", "image_url": {"url": data_url(second, "image/gif"), "detail": "auto"}},
            ],
        },
    ]
    processor = AutoProcessor.from_pretrained(tiny_vl_model)
    own = [
        messages[0],
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
    ]
    text = processor.apply_chat_template(own, add_generation_prompt=True, tokenize=False)
    images = [decode(first), decode(second)]
    prompt = processor(text=[text], images=images, return_tensors="np")["input_ids"][0].tolist()
    want = reference.greedy(prompt, images, 3)
    logprobs = reference.logprobs(prompt + want, images)
    async with http_frontend(engine) as port:
        api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=1
        )
        assert reply.usage.prompt_tokens == len(prompt)
        got = reply.choices[0].logprobs.content
        assert reply.choices[0].message.content == engine.tokenizer.decode(want, skip_special_tokens=True)
        for i, (token, entry) in enumerate(zip(want, got, strict=True)):
            assert entry.logprob == pytest.approx(logprobs[len(prompt) + i - 1, token].item(), rel=1e-4, abs=1e-5)
        async with aiohttp.ClientSession() as http, http.ws_connect(f"http://127.0.0.1:{port}/") as ws:
            await ws.send_str(
                f"GENERATE {json.dumps({'stream_id': 1, 'messages': messages, 'max_tokens': 3, 'temperature': 0})}"
            )
            await ws.send_str(f"SCORE {json.dumps({'stream_id': 2, 'messages': messages, 'scored': [5]})}")
            payloads: list[dict] = []
            while sum(1 for p in payloads if p.get("finish_reason") or p.get("error")) < 2:
                payloads += json.loads((await ws.receive()).data.partition(" ")[2])
        ones = [p for p in payloads if p["stream_id"] == 1]
        assert ones[0]["prompt_ids"] == prompt
        assert [p["token"] for p in ones[1:]] == want
        assert "SCORE reads none" in next(p["error"] for p in payloads if p["stream_id"] == 2)


async def encoder_passes(engine: Engine) -> int:
    return (await engine._llm.collective_rpc("salience_test_encoder_passes"))[0]


async def test_later_turns_reuse_the_cached_image_prefix(served, tiny_vl_model: Path) -> None:
    """A second turn is served from the prefix cache past the first turn's image block, so vLLM
    runs the vision encoder for the first turn only, though every turn resubmits the image."""
    engine, _ = served
    passes = await encoder_passes(engine)
    vocab = Vocab(engine)
    data = image_bytes("PNG", seed=9)
    n, _ = expected_pads(tiny_vl_model, decode(data))
    store = SessionStore(lambda: engine)
    sid = store.open()
    text = [(11 * j) % 1500 + 100 for j in range(300)]
    first = await store.start(
        sid,
        Turn(
            offset=0,
            append=PRE + vocab.block(n) + text,
            images=[ImageBlock(start=len(PRE), end=len(PRE) + n + 2, data=data, mime="image/png")],
            sampling=SamplingOptions(max_tokens=2, temperature=0.0),
        ),
    )
    assert len([t async for t in first]) == 2
    assert await encoder_passes(engine) > passes
    passes = await encoder_passes(engine)
    length = len(store.tokens(sid))
    second = await store.start(
        sid, Turn(offset=length, append=[5, 6], sampling=SamplingOptions(max_tokens=2, temperature=0.0))
    )
    assert len([t async for t in second]) == 2
    assert await encoder_passes(engine) == passes
    assert first.done.cached_tokens == 0
    assert second.done.cached_tokens >= 256 > len(PRE) + n + 2  # whole 128-token blocks, the image's included
