"""Calibrated readouts and monitors on the tiny model, against the transformers float32 reference.

The tiny set's vectors are random; its calibration is made here so that probabilities cross
the thresholds inside the generations: per concept and layer, scale is a multiple of 1 / the raw
readouts' spread and offset = -scale * their median, over the reference's greedy continuations.
What is tested is that the served probabilities are the published map applied to the readouts,
and that monitors fire exactly where the reference probabilities say they must.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch

from salience.core.engine.engine import Engine
from salience.core.engine.requests import FinishReason, Probes, SamplingOptions
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.monitors import Action, Monitor
from salience.errors import InvalidArgument
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.lmtp.codec import readout_values
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.conftest import TINY_CONCEPTS, TINY_LAYERS, start_engine
from tests.inprocess import Frontends, frontends
from tests.reference import Reference, probabilities, reference_readouts

PROMPTS = [[0, *range(40 + 13 * i, 60 + 13 * i)] for i in range(8)]
DECODE = 16
GREEDY = SamplingOptions(max_tokens=DECODE, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Reference:
    return Reference(tiny_model)


@pytest.fixture(scope="module")
def continuations(reference: Reference) -> list[list[int]]:
    return [prompt + reference.greedy(prompt, DECODE) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def calibrated(tiny_concepts: ConceptSet, reference: Reference, continuations: list[list[int]]) -> ConceptSet:
    raw = torch.cat(
        [reference_readouts(reference, tiny_concepts, ids)[len(PROMPTS[0]) :] for ids in continuations]
    ).reshape(-1, len(TINY_LAYERS), len(TINY_CONCEPTS))
    median, spread = raw.median(dim=0).values, raw.std(dim=0)
    info = []
    for c, name in enumerate(TINY_CONCEPTS):
        layers = []
        for i, layer in enumerate(TINY_LAYERS):
            scale = (1 + c / 2) / float(spread[i, c])  # probabilities spread over (0, 1), steeper per concept
            offset = -scale * float(median[i, c])
            layers.append(
                {
                    "layer": layer, "scale": scale, "offset": offset, "running_scale": 3 * scale,
                    "running_offset": 3 * offset + 0.25, "auroc": 0.5, "accuracy": 0.5,
                    "auroc_interval": [0.4, 0.6], "background_fpr": 0.05, "background_fpr_interval": [0.0, 0.1],
                }
            )  # fmt: skip
        info.append(
            {
                "name": name, "recommended_layer": TINY_LAYERS[c % 3], "method": "diff_means", "n_fit": 0,
                "n_heldout": 0, "validation": "made by the test", "layers": layers,
            }
        )  # fmt: skip
    return ConceptSet(
        concepts=tiny_concepts.concepts,
        vectors=tiny_concepts.vectors,
        hidden_size=tiny_concepts.hidden_size,
        num_layers=tiny_concepts.num_layers,
        model_fingerprint=tiny_concepts.model_fingerprint,
        info=tuple(info),
    )


@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model: Path, calibrated: ConceptSet) -> AsyncIterator[Engine]:
    engine = await start_engine(tiny_model, max_model_len=1024, concepts=calibrated, compile=True)
    yield engine
    engine.shutdown()


@pytest_asyncio.fixture(scope="module")
async def served(engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(engine) as running:
        yield running


def column(concept: str, layer: int) -> int:
    return TINY_LAYERS.index(layer) * len(TINY_CONCEPTS) + TINY_CONCEPTS.index(concept)


def generated_p(calibrated: ConceptSet, reference: Reference, i: int, ids: list[int], concept: str, layer: int):
    """The reference's probabilities of `concept` at `layer` over prompt i's generated positions."""
    p = probabilities(calibrated, reference_readouts(reference, calibrated, ids))
    return p[len(PROMPTS[i]) :, column(concept, layer)]


def threshold(p: torch.Tensor) -> float:
    """A threshold inside the range of `p` but at least 1e-3 from every value, so float32 vs float64
    cannot move a crossing."""
    values = sorted(p.tolist())
    middle = len(values) / 2
    gaps = [(abs(i + 1 - middle), (a + b) / 2) for i, (a, b) in enumerate(itertools.pairwise(values)) if b - a > 2e-3]
    return min(gaps)[1]


def expected(p: torch.Tensor, above: float, action: Action) -> list[int]:
    """Indices (into the decoded tokens) where a monitor `above` fires: the first where it holds for
    a stop, each start of a run where it holds for a flag."""
    holds = [bool(x > above) for x in p.tolist()]
    if action is Action.STOP:
        return [holds.index(True)] if True in holds else []
    return [i for i, h in enumerate(holds) if h and (i == 0 or not holds[i - 1])]


async def test_probabilities_are_the_published_map_of_the_readouts(
    served: Frontends, calibrated: ConceptSet, reference: Reference, continuations: list[list[int]]
) -> None:
    """Each view is the manifest's map applied to the raw rows the same request reads (1e-9): the
    token view row by row, the running view to the mean of the rows read so far. Position 0 is
    not read in either (null), nor counted in a running mean."""
    client = await LmtpClient.connect(served.ws)
    try:
        info = (await client.request("MODEL_INFO"))["model_info"]["readout_manifest"]
        assert info["concept_info"] == [dict(c) for c in calibrated.info]
        fields = {"prompt": PROMPTS[0], "max_tokens": DECODE, "temperature": 0.0, "ignore_eos": True}
        fields["readout"] = [[0, 100]]
        raw = [p async for p in client.stream("GENERATE", **fields)]
        decoded = continuations[0][len(PROMPTS[0]) :]
        assert [p["token"] for p in raw if not p.get("prompt")] == decoded
        want = probabilities(calibrated, reference_readouts(reference, calibrated, continuations[0]))
        rows = torch.tensor([r["readout"] for r in raw], dtype=torch.float64)
        assert [r["position"] for r in raw] == list(range(len(continuations[0])))
        views = {
            "probability": probabilities(calibrated, rows),
            "token": probabilities(calibrated, rows),
            "running": probabilities(calibrated, rows[1:], "running"),
        }
        for view, mapped in views.items():
            shown = [p async for p in client.stream("GENERATE", **fields, readout_format=view)]
            assert [p["token"] for p in shown if not p.get("prompt")] == decoded
            assert [p["position"] for p in shown] == list(range(len(continuations[0])))
            assert shown[0]["readout"] == [None] * len(TINY_LAYERS) * len(TINY_CONCEPTS), view
            got = torch.tensor([p["readout"] for p in shown[1:]], dtype=torch.float64)
            assert torch.allclose(got, mapped if view == "running" else mapped[1:], rtol=0, atol=1e-9), view
        # The token view equals the reference's map of its own readouts, to float32 readouts' precision.
        assert torch.allclose(views["token"][1:], want[1 : len(raw)], atol=1e-4)
        # A running mean starts where the request reads: here, at position 8 of a SCORE.
        score = {"prompt": PROMPTS[1][:10], "scored": PROMPTS[1][10:], "readout": [[8, 12]]}
        raw_scored = [p for p in [p async for p in client.stream("SCORE", **score)] if "readout" in p]
        for view in ("token", "running"):
            shown = [
                p for p in [p async for p in client.stream("SCORE", **score, readout_format=view)] if "readout" in p
            ]
            assert [p["position"] for p in shown] == [p["position"] for p in raw_scored] == [8, 9, 10, 11]
            rows = torch.tensor([p["readout"] for p in raw_scored], dtype=torch.float64)
            got = torch.tensor([p["readout"] for p in shown], dtype=torch.float64)
            assert torch.allclose(got, probabilities(calibrated, rows, view), rtol=0, atol=1e-9), view
        # f32 carries the same numbers, the unread first token as NaN.
        f32 = [p async for p in client.stream("GENERATE", **fields, readout_format="running", readout_encoding="f32")]
        values = [readout_values(p["readout"]) for p in f32]
        assert all(math.isnan(v) for v in values[0])
        assert torch.allclose(torch.tensor(values[1:], dtype=torch.float64), views["running"], atol=1e-6)
    finally:
        await client.close()


@pytest.mark.parametrize("action", [Action.STOP, Action.FLAG])
async def test_a_monitor_fires_where_the_reference_crosses(
    engine: Engine, calibrated: ConceptSet, reference: Reference, continuations: list[list[int]], action: Action
) -> None:
    concept, layer = "gamma", 2
    ids = continuations[2]
    p = generated_p(calibrated, reference, 2, ids, concept, layer)
    above = threshold(p)
    fires = expected(p, above, action)
    assert fires, "the threshold must be crossed inside the generation"
    monitor = Monitor(concept=concept, layer=layer, above=above, action=action)
    events = [e async for e in engine.generate(PROMPTS[2], GREEDY, probes=Probes(monitors=[monitor]))]
    fired = [i for i, e in enumerate(events) if e.monitors]
    assert fired == fires
    for i in fired:
        (event,) = events[i].monitors
        assert (event.concept, event.layer, event.position, event.action) == (
            concept,
            layer,
            len(PROMPTS[2]) + i,
            action,
        )
        assert event.probability == pytest.approx(float(p[i]), abs=1e-4)
    assert all(e.readout is None for e in events)  # monitors read, but nobody asked to see readouts
    if action is Action.STOP:
        assert len(events) == fires[0] + 1
        assert events[-1].finish_reason is FinishReason.MONITOR and events[-1].stopped_by is not None
        assert [e.token_id for e in events] == ids[len(PROMPTS[2]) : len(PROMPTS[2]) + len(events)]
    else:
        assert len(events) == DECODE and events[-1].finish_reason is FinishReason.LENGTH


async def test_recommended_layer_and_below(
    engine: Engine, calibrated: ConceptSet, reference: Reference, continuations
) -> None:
    concept = "beta"  # recommended layer TINY_LAYERS[1]
    ids = continuations[3]
    raw = reference_readouts(reference, calibrated, ids)
    p = probabilities(calibrated, raw)[len(PROMPTS[3]) :, column(concept, TINY_LAYERS[1])]
    below = threshold(p)
    holds = [bool(x < below) for x in p.tolist()]
    events = [
        e
        async for e in engine.generate(
            PROMPTS[3], GREEDY, probes=Probes(monitors=[Monitor(concept=concept, below=below, action=Action.STOP)])
        )
    ]
    assert len(events) == holds.index(True) + 1
    assert events[-1].stopped_by.layer == TINY_LAYERS[1]


async def test_mixed_concurrent_streams(
    engine: Engine, calibrated: ConceptSet, reference: Reference, continuations: list[list[int]]
) -> None:
    """Eight at once, monitored (stop or flag) and unmonitored mixed: each as it runs alone."""
    concept, layer = "delta", 3
    plans = []
    for i, ids in enumerate(continuations):
        p = generated_p(calibrated, reference, i, ids, concept, layer)
        action = (None, Action.STOP, Action.FLAG)[i % 3]
        above = threshold(p)
        plans.append((action, above, expected(p, above, action) if action else []))

    async def run(i: int):
        action, above, _ = plans[i]
        monitors = [Monitor(concept=concept, layer=layer, above=above, action=action)] if action else []
        return [
            e
            async for e in engine.generate(
                PROMPTS[i], GREEDY, probes=Probes(monitors=monitors, readout_ranges=[(0, 3)] if i == 4 else ())
            )
        ]

    results = await asyncio.gather(*(run(i) for i in range(8)))
    for i, events in enumerate(results):
        action, _, fires = plans[i]
        assert [e.token_id for e in events] == continuations[i][len(PROMPTS[i]) :][: len(events)]
        assert [n for n, e in enumerate(events) if e.monitors] == fires
        if action is Action.STOP and fires:
            assert len(events) == fires[0] + 1
        else:
            assert len(events) == DECODE


async def test_a_stopped_session_turn_keeps_its_last_token(
    served: Frontends, calibrated: ConceptSet, reference: Reference, continuations: list[list[int]]
) -> None:
    concept, layer = "alpha", 0
    ids = continuations[5]
    p = generated_p(calibrated, reference, 5, ids, concept, layer)
    above = threshold(p)
    (stop,) = expected(p, above, Action.STOP)
    client = await LmtpClient.connect(served.ws)
    try:
        session = (await client.request("OPEN_SESSION"))["session_id"]
        monitors = [{"concept": concept, "layer": layer, "above": above, "action": "stop"}]
        payloads = [
            p
            async for p in client.stream(
                "SESSION_GENERATE", session_id=session, offset=0, append=PROMPTS[5], max_tokens=DECODE,
                temperature=0.0, monitors=monitors,
            )
        ]  # fmt: skip
        tokens = [p for p in payloads if "token" in p and not p.get("prompt")]
        assert len(tokens) == stop + 1
        assert tokens[-1]["monitors"][0]["action"] == "stop"
        assert payloads[-1]["finish_reason"] == f"monitor:{concept}"
        assert payloads[-1]["usage"]["completion_tokens"] == stop + 1
        dumped = (await client.request("DUMP_SESSION", session_id=session))["tokens"]
        assert dumped == ids[: len(PROMPTS[5]) + stop + 1]
    finally:
        await client.close()


async def test_over_grpc(served: Frontends, calibrated: ConceptSet, reference: Reference, continuations) -> None:
    concept, layer = "epsilon", 2
    ids = continuations[6]
    raw = reference_readouts(reference, calibrated, ids)
    p = probabilities(calibrated, raw)[len(PROMPTS[6]) :, column(concept, layer)]
    above = threshold(p)
    (stop,) = expected(p, above, Action.STOP)
    async with grpc.aio.insecure_channel(served.grpc_target) as channel:
        seed, extensions = salience_pb2_grpc.SalienceStub(channel), extensions_pb2_grpc.SalienceExtensionsStub(channel)
        manifest = await extensions.GetConceptManifest(ext.GetConceptManifestRequest())
        assert [c.name for c in manifest.concepts] == list(TINY_CONCEPTS)
        fit, want = manifest.concepts[0].info.layers[1], calibrated.info[0]["layers"][1]
        assert (fit.scale, fit.running_scale, fit.running_offset) == pytest.approx(
            (want["scale"], want["running_scale"], want["running_offset"])
        )
        assert (fit.auroc_low, fit.auroc_high, fit.background_fpr_low, fit.background_fpr_high) == (0.4, 0.6, 0.0, 0.1)
        assert fit.HasField("background_fpr") and fit.background_fpr == 0.05
        session = (await seed.OpenSession(pb.OpenSessionRequest(model="tiny"))).session_id
        request = ext.ExtendedGenerateRequest(
            generate=pb.GenerateRequest(
                session_id=session, append_tokens=PROMPTS[6], max_tokens=DECODE, top_k=1,
                readout_ranges=[pb.PositionRange(start=len(PROMPTS[6]), end=len(PROMPTS[6]) + DECODE)],
            ),
            readout_format=ext.ExtendedGenerateRequest.READOUT_FORMAT_RUNNING,
            monitors=[ext.Monitor(concept=concept, layer=layer, above=above, action=ext.Monitor.ACTION_STOP)],
        )  # fmt: skip
        events = [e async for e in extensions.ExtendedGenerate(request)]
        tokens = [e for e in events if e.event.HasField("token")]
        assert len(tokens) == stop + 1
        # The running view over the positions read: the generated ones, from the first on.
        want = probabilities(calibrated, raw[len(PROMPTS[6]) : len(PROMPTS[6]) + len(tokens)], "running")
        for event, expected_row in zip(tokens, want, strict=True):
            assert list(event.event.token.readout) == pytest.approx(expected_row.tolist(), abs=1e-4)
        assert tokens[-1].monitors[0].action == ext.Monitor.ACTION_STOP
        done = events[-1]
        assert done.event.done.finish_reason == pb.GenerateDone.FINISH_REASON_UNSPECIFIED
        assert (done.stopped_by.concept, done.stopped_by.position) == (concept, len(PROMPTS[6]) + stop)
        bad = ext.ExtendedGenerateRequest(
            generate=pb.GenerateRequest(session_id=session, offset=len(PROMPTS[6]) + stop + 1, max_tokens=2),
            monitors=[ext.Monitor(concept=concept, above=1.5, action=ext.Monitor.ACTION_FLAG)],
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [e async for e in extensions.ExtendedGenerate(bad)]
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "strictly between 0 and 1" in caught.value.details()


BAD_MONITORS = [
    ({"concept": "zeta", "above": 0.5, "action": "stop"}, "unknown concept 'zeta'"),
    ({"concept": "alpha", "layer": 1, "above": 0.5, "action": "stop"}, "layer 1 is not read"),
    ({"concept": "alpha", "above": 1.0, "action": "stop"}, "strictly between 0 and 1"),
    ({"concept": "alpha", "below": 0, "action": "flag"}, "strictly between 0 and 1"),
    ({"concept": "alpha", "above": 0.5, "below": 0.2, "action": "flag"}, "exactly one of 'above' and 'below'"),
    ({"concept": "alpha", "above": 0.5, "action": "warn"}, "'action' must be 'flag' or 'stop'"),
    ({"concept": "alpha", "above": 0.5}, "'action' must be 'flag' or 'stop'"),
    ({"concept": "alpha", "above": 0.5, "action": "flag", "when": 1}, "unknown field(s) when"),
]


async def test_bad_monitors_get_their_error_and_nothing_else_changes(served: Frontends, engine: Engine) -> None:
    client = await LmtpClient.connect(served.ws)
    try:
        fields = {"prompt": PROMPTS[7], "max_tokens": 20, "temperature": 0.0, "ignore_eos": True}
        running = asyncio.ensure_future(_collect(client.stream("GENERATE", **fields)))
        for monitor, message in [
            *BAD_MONITORS,
            ([{"concept": "alpha", "above": 0.5, "action": "flag"}] * 17, "at most 16"),
        ]:
            monitors = monitor if isinstance(monitor, list) else [monitor]
            with pytest.raises(LmtpStreamError, match=message.replace("(", r"\(").replace(")", r"\)")):
                await _collect(client.stream("GENERATE", **fields, monitors=monitors))
        with pytest.raises(LmtpStreamError, match="readout_format must be one of"):
            await _collect(client.stream("GENERATE", **fields, readout_format="percent"))
        assert len([p for p in await running if "token" in p]) == 20
    finally:
        await client.close()
    with pytest.raises(InvalidArgument, match="unknown concept"):
        engine.generate(
            PROMPTS[0], GREEDY, probes=Probes(monitors=[Monitor(concept="zeta", above=0.5, action=Action.STOP)])
        )
    assert engine.num_unfinished_requests() == 0


async def test_an_uncalibrated_set_says_so(tiny_engine: Engine, read_engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="no concept set loaded"):
        tiny_engine.calibration()
    engine = read_engine  # tiny_concepts: random vectors, never calibrated
    assert engine.readouts.manifest.concept_info == (None,) * len(TINY_CONCEPTS)
    with pytest.raises(InvalidArgument, match="no calibration for alpha, beta, gamma, delta, epsilon"):
        engine.generate(
            PROMPTS[0], GREEDY, probes=Probes(monitors=[Monitor(concept="alpha", above=0.5, action=Action.STOP)])
        )
    # Raw readouts are untouched.
    events = [e async for e in engine.generate(PROMPTS[0], GREEDY, probes=Probes(readout_ranges=[(20, 22)]))]
    assert events[0].readout is not None and not math.isnan(events[0].readout[0])


async def _collect(stream) -> list[dict]:
    return [payload async for payload in stream]
