"""SAE features on the tiny model: each token's top features from the encoder in the graph (compiled
and eager) against SAELens's math on transformers float32 residuals, for the three architectures;
on LMTP, gRPC and sessions; steering along a feature's decoder row; the manifest; bad input."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from salience.core.engine.engine import Engine
from salience.core.engine.requests import FeatureRequest, FinishReason, Probes, ResidualRequest, SamplingOptions
from salience.core.features.sae import SparseAutoencoder, load_sae
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.monitors import Action, Monitor
from salience.core.probes.steering import Intervention, Op
from salience.errors import InvalidArgument, ModelError
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests import sae_reference
from tests.conftest import TINY_SAE_TOP, start_engine
from tests.inprocess import frontends
from tests.random_sae import random_sae
from tests.reference import Reference, check_rows_across_a_cache_hit

PROMPTS = [[0, *range(40 + 11 * i, 62 + 11 * i)] for i in range(6)]
GREEDY = SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True)
TOP = TINY_SAE_TOP  # --sae-top
TIE = 1e-4  # activations closer than this may swap places (docs/features.md, "Ties")


@pytest.fixture(scope="module")
def saes(tiny_saes: dict[str, SparseAutoencoder]) -> dict[str, SparseAutoencoder]:
    return tiny_saes


@pytest.fixture(scope="module")
def engine(sae_engine_each_mode: Engine) -> Engine:
    return sae_engine_each_mode


def want_top(reference: Reference, sae: SparseAutoencoder, ids: list[int]) -> torch.Tensor:
    """The reference's feature activations [positions, d_sae] at the SAE's layer."""
    residuals = reference.residuals(ids, [sae.layer])[sae.layer]
    return torch.from_numpy(sae_reference.encode(sae_reference.read_folder(sae.folder), residuals.double().numpy()))


def assert_features(got: dict[int, tuple], acts: torch.Tensor, k: int) -> None:
    """Each position's (id, activation) pairs are the reference's k largest active features, in order;
    ids may differ only where activations tie within TIE."""
    assert got
    for position, features in got.items():
        row = acts[position]
        values, ids = torch.topk(row, k)
        want = [(int(i), float(v)) for i, v in zip(ids, values, strict=True) if v > 0]
        assert len(features) == len(want), (position, features, want)
        for (got_id, got_act), (want_id, want_act) in zip(features, want, strict=True):
            assert abs(got_act - want_act) <= 1e-4 * max(1.0, abs(want_act)), (position, got_act, want_act)
            if got_id != want_id:  # a tie: the two activations must be equal within TIE
                assert abs(float(row[got_id]) - want_act) <= TIE, (position, got_id, want_id)


async def generate(engine: Engine, prompt: list[int], features: FeatureRequest, **kwargs):
    generation = engine.generate(prompt, GREEDY, probes=Probes(features=features, **kwargs))
    events = [e async for e in generation]
    return generation, events


@pytest.mark.parametrize("name", ["top", "plain", "jump"])
async def test_prompt_and_decoded_features_equal_the_reference(
    engine: Engine, tiny_reference: Reference, saes: dict[str, SparseAutoencoder], name: str
) -> None:
    sae = saes[name]
    prompt = PROMPTS[0]
    k = 8 if name == "top" else TOP
    features = FeatureRequest(sae=name, k=k, ranges=((2, 6), (len(prompt) - 1, 1000)))
    generation, events = await generate(engine, prompt, features)
    assert len(events) == GREEDY.max_tokens
    ids = prompt + [e.token_id for e in events]
    assert sorted(generation.prompt_rows["features"]) == [2, 3, 4, 5, len(prompt) - 1]
    assert all(e.features is not None and e.readout is None for e in events)  # the last one's too
    got = {**generation.prompt_rows["features"], **{e.position: e.features for e in events}}
    assert_features(got, want_top(tiny_reference, sae, ids), k)
    if name == "top":
        assert all(len(f) <= 8 for f in got.values())


async def test_features_beside_readouts_residuals_and_other_requests(
    engine: Engine, tiny_reference: Reference, saes: dict[str, SparseAutoencoder]
) -> None:
    async def one(i: int):
        prompt = PROMPTS[i]
        features = FeatureRequest(sae="plain", k=4 + i, ranges=((0, 1000),))
        residual = ResidualRequest(layers=(2,), ranges=((0, 3),)) if i % 2 else None
        generation, events = await generate(engine, prompt, features, readout_ranges=[(0, 1000)], residual=residual)
        return prompt, generation, events

    results = await asyncio.gather(*(one(i) for i in range(1, 5)))
    for i, (prompt, generation, events) in enumerate(results, start=1):
        assert len(events) == GREEDY.max_tokens
        ids = prompt + [e.token_id for e in events]
        got = {**generation.prompt_rows["features"], **{e.position: e.features for e in events}}
        assert sorted(got) == list(range(len(ids)))
        assert all(e.readout is not None for e in events)
        assert_features(got, want_top(tiny_reference, saes["plain"], ids), 4 + i)
        assert sorted(generation.prompt_residuals) == ([0, 1, 2] if i % 2 else [])


async def test_a_prefix_cache_hit_still_computes_the_features(
    engine: Engine, tiny_reference: Reference, saes: dict[str, SparseAutoencoder]
) -> None:
    await check_rows_across_a_cache_hit(
        engine,
        "features",
        lambda start: Probes(features=FeatureRequest(sae="plain", k=5, ranges=((start, 1000),))),
        lambda rows, ids: assert_features(rows, want_top(tiny_reference, saes["plain"], ids), 5),
    )


async def test_score_carries_features(
    engine: Engine, tiny_reference: Reference, saes: dict[str, SparseAutoencoder]
) -> None:
    ids = PROMPTS[5]
    scored = await engine.score(
        ids[:7], ids[7:], probes=Probes(features=FeatureRequest(sae="jump", k=TOP, ranges=((0, 1000),)))
    )
    got = {token.position: token.features for token in scored}
    assert sorted(got) == list(range(7, len(ids)))
    assert_features(got, want_top(tiny_reference, saes["jump"], ids), TOP)


async def test_steering_along_a_feature_is_steering_along_its_decoder_row(
    engine: Engine, saes: dict[str, SparseAutoencoder]
) -> None:
    prompt = PROMPTS[3]
    sae = saes["top"]
    feature = Intervention(
        direction="", feature=("top", 7), layers=(), op=Op.ADD, value=6.0, generated=True, prompt=True
    )
    vector = Intervention(
        direction="",
        vector=sae.W_dec[7].numpy().tobytes(),
        layers=(2,),
        op=Op.ADD,
        value=6.0,
        generated=True,
        prompt=True,
    )
    options = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = [e async for e in engine.generate(prompt, options)]
    by_feature = [e async for e in engine.generate(prompt, options, probes=Probes(steer=[feature]))]
    by_vector = [e async for e in engine.generate(prompt, options, probes=Probes(steer=[vector]))]
    assert [(e.token_id, e.logprob) for e in by_feature] == [(e.token_id, e.logprob) for e in by_vector]
    assert [e.logprob for e in by_feature] != [e.logprob for e in plain]
    # The feature's own activation rises where it is steered along.
    reads = FeatureRequest(sae="top", k=8, ranges=((len(prompt), 1000),))
    _, steered = await generate(engine, prompt, reads, steer=[feature])
    assert any(dict(e.features).get(7, 0.0) > 0 for e in steered)


async def test_a_feature_monitor_stops_where_the_reference_activation_first_passes_its_threshold(
    engine: Engine, tiny_reference: Reference, saes: dict[str, SparseAutoencoder]
) -> None:
    prompt = PROMPTS[2]
    options = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
    plain = [e async for e in engine.generate(prompt, options)]
    ids = prompt + [e.token_id for e in plain]
    acts = want_top(tiny_reference, saes["top"], ids)[len(prompt) :]  # per generated token
    feature = int(torch.argmax(acts[1]))  # active on the second generated token
    threshold = float(acts[1, feature]) / 2
    first = next(i for i in range(len(plain)) if acts[i, feature] > threshold)
    monitor = Monitor(concept="", feature=feature, sae="top", above=threshold, action=Action.STOP)
    shown = FeatureRequest(sae="top", k=2, ranges=((len(prompt) - 1, len(prompt) + 1),))
    generation = engine.generate(prompt, options, probes=Probes(monitors=[monitor], features=shown))
    events = [e async for e in generation]
    assert len(events) == first + 1 and events[-1].finish_reason is FinishReason.MONITOR
    stop = events[-1].stopped_by
    assert stop is not None and (stop.sae, stop.feature, stop.layer) == ("top", feature, 2)
    assert abs(stop.probability - float(acts[first, feature])) <= 1e-4
    # The client sees only what it asked for: k=2, at the last prompt position and the first token.
    assert list(generation.prompt_rows["features"]) == [len(prompt) - 1]
    assert len(events[0].features) <= 2 and all(e.features is None for e in events[1:])
    # A flag reports where it starts to hold, and the generation runs on.
    flag = Monitor(concept="", feature=feature, sae="top", above=threshold, action=Action.FLAG)
    flagged = [e async for e in engine.generate(prompt, options, probes=Probes(monitors=[flag]))]
    held = [bool(acts[i, feature] > threshold) for i in range(len(plain))]
    starts = [i for i, h in enumerate(held) if h and (i == 0 or not held[i - 1])]
    assert [i for i, e in enumerate(flagged) if e.monitors] == starts
    assert len(flagged) == len(plain)


async def test_bad_feature_requests_are_refused_before_the_engine(engine: Engine) -> None:
    prompt = PROMPTS[4]
    cases = [
        (FeatureRequest(sae="nope", k=4, ranges=((0, 4),)), "unknown SAE 'nope'"),
        (FeatureRequest(sae=None, k=4, ranges=((0, 4),)), "name the SAE"),
        (FeatureRequest(sae="top", k=9, ranges=((0, 4),)), r"features.k must be an integer in 1..8"),
        (FeatureRequest(sae="plain", k=TOP + 1, ranges=((0, 4),)), rf"1..{TOP}"),
        (FeatureRequest(sae="plain", k=4, ranges=()), "names no positions"),
    ]
    for features, words in cases:
        with pytest.raises(InvalidArgument, match=words):
            engine.generate(prompt, GREEDY, probes=Probes(features=features))
    bad_steer = [
        (Intervention(direction="", feature=("top", 512), layers=(), op=Op.ADD, value=1.0, generated=True), "outside"),
        (Intervention(direction="", feature=("x", 1), layers=(), op=Op.ADD, value=1.0, generated=True), "unknown SAE"),
        (
            Intervention(direction="alpha", feature=("top", 1), layers=(), op=Op.ADD, value=1.0, generated=True),
            "one of direction, vector and feature",
        ),
    ]
    for steer, words in bad_steer:
        with pytest.raises(InvalidArgument, match=words):
            engine.generate(prompt, GREEDY, probes=Probes(steer=[steer]))
    watch = Monitor(concept="", feature=3, sae="top", above=0.5, action=Action.FLAG)
    bad_monitors = [
        ([Monitor(concept="", feature=512, sae="top", above=0.5, action=Action.FLAG)], {}, "outside"),
        ([watch, Monitor(concept="", feature=3, sae="plain", above=0.5, action=Action.FLAG)], {}, "one SAE"),
        ([watch], {"features": FeatureRequest(sae="plain", k=2, ranges=((0, 3),))}, "different SAEs"),
        ([watch], {"features": FeatureRequest(sae="top", k=9, ranges=((0, 3),))}, "1..8"),
    ]
    for monitors, extra, words in bad_monitors:
        with pytest.raises(InvalidArgument, match=words):
            engine.generate(prompt, GREEDY, probes=Probes(monitors=monitors, **extra))
    assert engine.num_unfinished_requests() == 0


async def test_manifest_and_wire(engine: Engine, tiny_reference: Reference, saes: dict[str, SparseAutoencoder]) -> None:
    if engine.compiled:
        pytest.skip("the wire is the same for both graphs")
    prompt = PROMPTS[1]
    fields = {"prompt": prompt, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    async with frontends(engine) as served:
        client = await LmtpClient.connect(served.ws)
        try:
            info = (await client.request("MODEL_INFO", model="tiny"))["model_info"]
            features = {"sae": "top", "k": 8, "ranges": [[len(prompt) - 2, 1000]]}
            payloads = [p async for p in client.stream("GENERATE", **fields, features=features)]
            steer = [{"feature": 7, "sae": "top", "op": "add", "value": 6.0, "positions": "all"}]
            steered = [p async for p in client.stream("GENERATE", **fields, steer=steer)]
            first = next(p for p in payloads if p["position"] == len(prompt))["features"][0][0]
            monitors = [{"feature": first, "sae": "top", "above": 0.0, "action": "stop"}]
            stopped = [p async for p in client.stream("GENERATE", **fields, monitors=monitors)]
            with pytest.raises(LmtpStreamError, match="activation >= 0"):
                bad = [{"feature": 3, "above": -1, "action": "stop"}]
                _ = [p async for p in client.stream("GENERATE", **fields, monitors=bad)]
            with pytest.raises(LmtpStreamError, match="features must be"):
                _ = [p async for p in client.stream("GENERATE", **fields, features=[8])]
            with pytest.raises(LmtpStreamError, match="unknown SAE"):
                _ = [
                    p
                    async for p in client.stream(
                        "GENERATE", **fields, features={"sae": "x", "k": 1, "ranges": [[0, 2]]}
                    )
                ]
        finally:
            await client.close()
        channel = grpc.aio.insecure_channel(served.grpc_target)
        try:
            seed = salience_pb2_grpc.SalienceStub(channel)
            extensions = extensions_pb2_grpc.SalienceExtensionsStub(channel)
            manifest = await extensions.GetSAEManifest(ext.GetSAEManifestRequest())
            opened = await seed.OpenSession(pb.OpenSessionRequest(model="tiny"))
            request = ext.ExtendedGenerateRequest(
                generate=pb.GenerateRequest(session_id=opened.session_id, append_tokens=prompt, max_tokens=3, top_k=1),
                features=ext.Features(sae="jump", k=5, ranges=[pb.PositionRange(start=0, end=1000)]),
            )
            events = [e async for e in extensions.ExtendedGenerate(request)]
        finally:
            await channel.close()
    assert [s["name"] for s in info["saes"]] == ["top", "plain", "jump"]
    top = info["saes"][0]
    assert (top["layer"], top["point"], top["d_sae"], top["architecture"], top["k"], top["top"]) == (
        *(2, "resid_post", 512),
        *("topk", 8, 8),
    )
    assert [(s.name, s.layer, s.point, s.d_sae, s.architecture, s.k, s.top) for s in manifest.saes] == [
        ("top", 2, "resid_post", 512, "topk", 8, 8),
        ("plain", 1, "resid_post", 256, "standard", 0, TOP),
        ("jump", 3, "resid_post", 256, "jumprelu", 0, TOP),
    ]
    lmtp = {p["position"]: tuple((i, a) for i, a in p["features"]) for p in payloads if "features" in p}
    ids = prompt + [p["token"] for p in payloads if not p.get("prompt")]
    assert sorted(lmtp) == list(range(len(prompt) - 2, len(prompt) + 3))
    assert_features(lmtp, want_top(tiny_reference, saes["top"], ids), 8)
    assert [p["logprob"] for p in steered] != [p["logprob"] for p in payloads if not p.get("prompt")]
    assert len(stopped) == 1 and stopped[0]["finish_reason"] == f"monitor:feature:top:{first}"
    assert stopped[0]["monitors"][0]["feature"] == first and stopped[0]["monitors"][0]["activation"] > 0
    tokens = [e for e in events if e.event.HasField("token")]
    grpc_ids = prompt + [e.event.token.id for e in tokens if not e.event.token.is_prefill]
    got = {e.event.token.position: tuple((f.id, f.activation) for f in e.features) for e in tokens}
    assert sorted(got) == list(range(len(grpc_ids)))
    assert_features(got, want_top(tiny_reference, saes["jump"], grpc_ids), 5)


async def test_an_sae_that_does_not_fit_the_model_is_refused_before_vllm_starts(
    tiny_model: Path, tiny_concepts: ConceptSet, tmp_path: Path
) -> None:
    wide = load_sae(random_sae(tmp_path / "deep", "standard", 9, 64, 4))
    with pytest.raises(ModelError, match="layer"):
        await start_engine(tiny_model, concepts=tiny_concepts, saes=(wide,))
    with pytest.raises(ModelError, match="concept set"):
        await start_engine(tiny_model, saes=(load_sae(random_sae(tmp_path / "ok", "standard", 1, 64, 5)),))
    twice = load_sae(tmp_path / "ok", name="same")
    with pytest.raises(ModelError, match="share a name"):
        await start_engine(tiny_model, concepts=tiny_concepts, saes=(twice, twice))


@pytest.mark.multiprocess
async def test_tensor_parallel_two_ranks_carry_residual_rows_and_features(
    tensor_parallel_engine: Engine, tiny_reference: Reference, saes: dict[str, SparseAutoencoder]
) -> None:
    """TP=2 on the two CPU cores (eager, then compiled): the residual is whole on every rank after
    the all-reduce, and rank 0 alone files rows and features."""
    parallel = tensor_parallel_engine
    prompt = PROMPTS[4]
    generation = parallel.generate(
        prompt,
        GREEDY,
        probes=Probes(
            residual=ResidualRequest(layers=(0, 3), ranges=((0, 1000),)),
            features=FeatureRequest(sae="top", k=8, ranges=((0, 1000),)),
        ),
    )
    events = [e async for e in generation]
    ids = prompt + [e.token_id for e in events]
    rows = {**generation.prompt_residuals, **{e.position: e.residual for e in events}}
    assert sorted(rows) == list(range(len(prompt) + GREEDY.max_tokens))
    want = tiny_reference.residuals(ids, (0, 3))
    for position, row in rows.items():
        for i, layer in enumerate((0, 3)):
            expected = want[layer][position].numpy()
            assert abs(row[i] - expected).max() / abs(expected).max() < 1e-4, (position, layer)
    got = {**generation.prompt_rows["features"], **{e.position: e.features for e in events}}
    assert_features(got, want_top(tiny_reference, saes["top"], ids), 8)
