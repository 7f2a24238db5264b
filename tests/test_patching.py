"""Activation patching and causal-tracing sweeps on the tiny model, compiled, against transformers
float32 with the same activations set by hooks (tests/reference.Reference.patched): a sweep's grid
cell by cell with its baselines, both metrics, on LMTP with progress and CANCEL; patches on the
LMTP and OpenAI wires; the prefix cache kept apart from unpatched requests; every bad input's
error; a failing patch op failing its request alone. Each family's points are patched in
tests/test_families.py."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, ResidualRequest, SamplingOptions
from salience.core.models.points import POINTS, Point, Site
from salience.core.probes import tap_ops
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.patching import Patch
from salience.core.serving.patch_sweep import Sweep, sweep
from salience.errors import EngineError, InvalidArgument
from salience.lmtp.client import LmtpClient, LmtpStreamError
from tests.inprocess import frontends
from tests.reference import LONG_PROMPT, Reference, assert_logprobs_match
from tests.test_steering import in_one_step

CLEAN = [0, 17, 301, 45, 988, 12, 640, 77, 5, 1203]
CORRUPTED = [0, 17, 301, 1500, 1501, 12, 640, 77, 5, 1203]  # positions 3 and 4 replaced


@pytest_asyncio.fixture(scope="module")
async def engine(engines, tiny_model: Path, tiny_concepts: ConceptSet):
    async with engines.engine(
        tiny_model,
        ("patch_engine",),
        served_model_name="tiny",
        max_model_len=1024,
        concepts=tiny_concepts,
        patch_points=POINTS,
        compile=True,
    ) as engine:
        yield engine


def answer_logprob(reference: Reference, prompt: list[int], answer: list[int], patches=()) -> float:
    logprobs, _ = reference.patched(prompt + answer, patches)
    return float(sum(logprobs[len(prompt) - 1 + k, token] for k, token in enumerate(answer)))


def clean_patch(reference: Reference, point: Point, layer: int, position: int) -> Patch:
    row = reference.at(CLEAN, [Site(layer, point)])[Site(layer, point)][position]
    return Patch(point=point, layer=layer, positions=(position,), rows=row.float().numpy().tobytes())


async def test_a_sweeps_grid_equals_the_references_cell_by_cell(engine: Engine, tiny_reference: Reference) -> None:
    """Three points x every layer x every position, the answer two tokens long: each cell is the
    reference's answer logprob with that clean activation put back, as are both baselines; the
    progress counts every cell once, in order."""
    answer = tiny_reference.greedy(CLEAN, 2)
    points: tuple[Point, ...] = ("resid_pre", "attn_out", "mlp_out")
    told: list[tuple[int, int]] = []
    grid = await sweep(
        engine,
        Sweep(clean=tuple(CLEAN), corrupted=tuple(CORRUPTED), answer=tuple(answer), points=points),
        progress=lambda done, total: told.append((done, total)),
    )
    cells = len(points) * 4 * len(CLEAN)
    assert told == [(n, cells) for n in range(1, cells + 1)]
    assert (grid.points, grid.layers, grid.positions) == (points, (0, 1, 2, 3), tuple(range(len(CLEAN))))
    assert grid.clean == pytest.approx(answer_logprob(tiny_reference, CLEAN, answer), abs=1e-4)
    assert grid.corrupted == pytest.approx(answer_logprob(tiny_reference, CORRUPTED, answer), abs=1e-4)
    assert abs(grid.clean - grid.corrupted) > 0.1, "the corruption changes nothing"
    for point in points:
        assert len(grid.values[point]) == 4 and all(len(row) == len(CLEAN) for row in grid.values[point])
        for layer in range(4):
            for position in range(len(CLEAN)):
                want = answer_logprob(
                    tiny_reference, CORRUPTED, answer, [clean_patch(tiny_reference, point, layer, position)]
                )
                assert grid.values[point][layer][position] == pytest.approx(want, abs=1e-4), (point, layer, position)
    # Putting back the residual at an uncorrupted position before the corruption changes nothing;
    # at the corrupted positions entering layer 0, it restores the clean run there.
    assert grid.values["resid_pre"][0][1] == pytest.approx(grid.corrupted, abs=1e-4)
    restored = grid.restored("resid_pre")
    assert max(restored[0][3], restored[0][4]) > 0.1


async def test_a_logit_difference_sweep(engine: Engine, tiny_reference: Reference) -> None:
    answer, foil = tiny_reference.greedy(CLEAN, 1), [1300]
    grid = await sweep(
        engine,
        Sweep(
            clean=tuple(CLEAN),
            corrupted=tuple(CORRUPTED),
            answer=tuple(answer),
            foil=tuple(foil),
            points=("resid_post",),
            layers=(1, 3),
            positions=(3, 9),
            metric="logit_diff",
        ),
    )
    assert (grid.layers, grid.positions) == ((1, 3), (3, 9))

    def diff(prompt: list[int], patches=()) -> float:
        return answer_logprob(tiny_reference, prompt, answer, patches) - answer_logprob(
            tiny_reference, prompt, foil, patches
        )

    assert grid.clean == pytest.approx(diff(CLEAN), abs=1e-4)
    for i, layer in enumerate((1, 3)):
        for j, position in enumerate((3, 9)):
            want = diff(CORRUPTED, [clean_patch(tiny_reference, "resid_post", layer, position)])
            assert grid.values["resid_post"][i][j] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"corrupted": tuple(CORRUPTED[:-1])}, "must be the same length"),
        ({"answer": ()}, "needs answer tokens"),
        ({"points": ("hook_z",)}, "patches no 'hook_z'"),
        ({"layers": (4,)}, r"layers must be distinct layers of this model \(0..3\)"),
        ({"positions": (10,)}, r"positions must be distinct positions of the prompt \(0..9\)"),
        ({"metric": "logit_diff"}, "give foil tokens"),
        ({"foil": (3,)}, "give foil tokens"),
    ],
)
async def test_a_bad_sweep_is_refused_naming_what(engine: Engine, change: dict, error: str) -> None:
    asked = Sweep(clean=tuple(CLEAN), corrupted=tuple(CORRUPTED), answer=(5,))
    with pytest.raises(InvalidArgument, match=error):
        await sweep(engine, Sweep(**{**asked.__dict__, **change}))


async def test_a_sweep_over_lmtp_tells_its_progress_and_a_cancel_ends_it(
    engine: Engine, tiny_reference: Reference
) -> None:
    answer = tiny_reference.greedy(CLEAN, 1)
    fields = {"clean": CLEAN, "corrupted": CORRUPTED, "answer": answer, "points": ["mlp_out"], "positions": [3, 4]}
    async with frontends(engine) as served:
        client = await LmtpClient.connect(served.ws)
        try:
            told: list[tuple[int, int]] = []
            grid = await client.sweep(progress=lambda done, total: told.append((done, total)), **fields)
            assert told[-1] == (8, 8) and [d for d, _ in told] == sorted({d for d, _ in told})
            assert grid["points"] == ["mlp_out"] and grid["layers"] == [0, 1, 2, 3] and grid["positions"] == [3, 4]
            want = answer_logprob(tiny_reference, CORRUPTED, answer, [clean_patch(tiny_reference, "mlp_out", 2, 4)])
            assert grid["grid"]["mlp_out"][2][1] == pytest.approx(want, abs=1e-4)
            with pytest.raises(LmtpStreamError, match="must be the same length"):
                await client.sweep(**{**fields, "corrupted": CORRUPTED[:5]})
            with pytest.raises(LmtpStreamError, match="points must be a list of hook points"):
                await client.sweep(**{**fields, "points": ["nowhere"]})
            # A whole sweep cancelled after its first progress: it answers that it was cancelled.
            big = {**fields, "points": list(POINTS), "positions": []}
            started = asyncio.Event()
            task = asyncio.create_task(client.sweep(progress=lambda done, total: started.set(), **big))
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The connection serves on.
            again = await client.sweep(**{**fields, "positions": [3]})
            assert again["grid"]["mlp_out"][2][0] == pytest.approx(grid["grid"]["mlp_out"][2][0], abs=1e-6)
        finally:
            await client.close()


def rows_b64(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype("<f4").tobytes()).decode()


async def test_a_patch_on_lmtp_equals_the_reference(engine: Engine, tiny_reference: Reference) -> None:
    """SCORE with a patch named by its hook: the scored tokens' logprobs are the reference's with
    the same patch; bad patches are refused naming what."""
    prompt, scored = LONG_PROMPT[:30], LONG_PROMPT[30:36]
    rows = np.random.default_rng(3).normal(0, 2, (2, 128))
    patch = [{"hook": "blocks.2.hook_mlp_out", "positions": [12, 31], "rows": rows_b64(rows)}]
    reference = Patch(point="mlp_out", layer=2, positions=(12, 31), rows=rows.astype(np.float32).tobytes())
    want, _ = tiny_reference.patched(prompt + scored, [reference])
    async with frontends(engine) as served:
        client = await LmtpClient.connect(served.ws)
        try:
            payloads = [p async for p in client.stream("SCORE", prompt=prompt, scored=scored, patch=patch)]
            for bad, error in (
                ([{**patch[0], "positions": [12, 99]}], "position 99 is not in the prompt"),
                ([{**patch[0], "positions": [12]}], "2 rows for 1 positions"),
                ([{**patch[0], "hook": "blocks.9.hook_mlp_out"}], "layer 9 is not a layer of this model"),
                ([{"point": "mlp_out", "layer": 1, "positions": [1]}], "rows are missing"),
                ({"layer": 1}, "patch must be a list of patches"),
            ):
                with pytest.raises(LmtpStreamError, match=error):
                    _ = [p async for p in client.stream("SCORE", prompt=prompt, scored=scored, patch=bad)]
            plain = [p async for p in client.stream("SCORE", prompt=prompt, scored=scored)]  # the connection serves on
        finally:
            await client.close()
    assert [p["token"] for p in payloads] == scored  # one payload per scored token, in order
    for position, p in enumerate(payloads, start=len(prompt)):
        assert p["logprob"] == pytest.approx(float(want[position - 1, p["token"]]), abs=1e-4)
    assert any(abs(a["logprob"] - b["logprob"]) > 1e-3 for a, b in zip(payloads, plain, strict=True))


async def test_a_patched_pass_keeps_apart_from_the_prefix_cache(engine: Engine, tiny_reference: Reference) -> None:
    """A prompt of three KV blocks scored plain twice (the second from the cache), then patched at
    position 250, inside the cache's reach: computed anew, equal to the reference with the patch;
    then patched again: served from its own cache entry, still equal."""
    prompt, scored = LONG_PROMPT[:300], [44, 55, 66]
    rows = np.random.default_rng(5).normal(0, 2, (1, 128)).astype(np.float32)
    patches = (Patch(point="resid_mid", layer=1, positions=(250,), rows=rows.tobytes()),)
    want, _ = tiny_reference.patched(prompt + scored, patches)
    for _ in range(2):
        plain = await engine.score_pass(prompt, scored, top_logprobs=3)
    assert plain.cached_tokens >= 256
    for expect_cached in (False, True):
        patched = await engine.score_pass(prompt, scored, top_logprobs=3, probes=Probes(patch=patches))
        assert (patched.cached_tokens >= 256) is expect_cached, patched.cached_tokens
        events = [patched.at(p) for p in range(len(prompt), len(prompt) + len(scored))]
        assert_logprobs_match(events, want.float(), 3)


async def test_a_patch_reaches_generated_positions(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    """One row at a prompt position and at a position the generation reaches: the decode step
    that computes it is patched too; tokens and logprobs are the reference's under the patch."""
    prompt = LONG_PROMPT[:20]
    rows = np.random.default_rng(4).normal(0, 3, (1, 128)).astype(np.float32)
    patches = (Patch(point=tiny_concepts.point, layer=1, positions=(5, 21), rows=rows.tobytes()),)
    options = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5)
    generation = engine.generate(prompt, options, probes=Probes(patch=patches))
    events = [e async for e in generation]
    ids = prompt + [e.token_id for e in events]
    want, _ = tiny_reference.patched(ids, patches)
    assert [e.token_id for e in events] == [int(want[p - 1].argmax()) for p in range(len(prompt), len(ids))]
    assert_logprobs_match(events, want.float(), 5)


async def test_a_server_without_patch_points_refuses_a_patch(read_engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="patches nowhere"):
        patch = Patch(point="resid_pre", layer=0, positions=(1,), rows=bytes(512))
        await read_engine.prefill(CLEAN, probes=Probes(patch=(patch,)))


async def test_salience_patch_prints_the_grid_and_draws_it(
    engine: Engine, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The command line against a running server: texts tokenized there, the grid printed as the
    share restored (0 at the corrupted run), and a PNG heatmap written."""
    from PIL import Image

    from salience.cli import main

    clean, corrupted = "a b c d", "a e c d"
    tokens = engine.tokenizer.encode
    assert len(tokens(clean)) == len(tokens(corrupted))
    png = tmp_path / "grid.png"
    async with frontends(engine) as served:
        argv = ["patch", clean, "--corrupted", corrupted, "--answer", " c", "--points", "resid_pre,mlp_out"]
        code = await asyncio.to_thread(main, [*argv, "--layers", "0-2", "--png", str(png), "--url", served.ws])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "answer logprob: clean" in out and "resid_pre" in out and "mlp_out" in out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [int(row[0]) for row in rows] == [0, 1, 2, 0, 1, 2]  # two panels of three layers
    assert all(len(row) == 1 + len(tokens(clean)) for row in rows)
    with Image.open(png) as image:
        assert image.width > 100 and image.height > 100


async def test_a_failed_patch_fails_the_request_patching_there_alone(engine: Engine, tiny_reference: Reference) -> None:
    """The patch op made to fail at one site: the request patching there fails naming it, the one
    beside it in the step keeps its exact numbers, and the engine serves on, the same patch
    included."""
    patch = clean_patch(tiny_reference, "mlp_out", 2, 4)
    slot = engine.patching.slot(patch.site)

    async def score(patches: tuple[Patch, ...]):
        return await engine.prefill(CORRUPTED, top_logprobs=3, probes=Probes(patch=patches))

    async def fails(run) -> EngineError:
        with pytest.raises(EngineError) as caught:
            await run
        return caught.value

    await engine._rpc("salience_test_fault", ("patch", slot))
    try:
        failed, plain = await in_one_step(engine, [fails(score((patch,))), score(())])
    finally:
        await engine._rpc("salience_test_fault", (None,))
    assert str(failed).startswith(
        "salience::patch at blocks.2.hook_mlp_out failed (RuntimeError: patch failed on purpose"
    )
    want = tiny_reference.logprobs(CORRUPTED).float()
    assert_logprobs_match([plain.at(p) for p in range(1, len(CORRUPTED))], want, 3)
    patched = await score((patch,))
    want, _ = tiny_reference.patched(CORRUPTED, [patch])
    assert_logprobs_match([patched.at(p) for p in range(1, len(CORRUPTED))], want.float(), 3)
    assert (await engine._llm.collective_rpc("salience_patch_plans"))[0] == 0


def test_a_patch_op_that_fails_records_it_and_leaves_the_activation() -> None:
    """Values of the wrong width, as the graph calls the op: nothing raises, the activation comes
    back as it was."""
    hidden = torch.ones(3, 8)
    tap_ops.Patched.plans = {0: (torch.tensor([1]), torch.zeros(1, 5))}
    try:
        out = tap_ops.patch(hidden, None, 0, -1)
        raised, tap_ops.Faults.raised = tap_ops.Faults.raised, []
    finally:
        tap_ops.Patched.plans = {}
    assert [(op, slot, type(exc)) for op, slot, exc in raised] == [("patch", 0, RuntimeError)]
    assert torch.equal(out, hidden)


async def test_patches_and_sweeps_on_grpc(engine: Engine, tiny_reference: Reference) -> None:
    """PatchSweep through the Python client (progress, the grid, INVALID_ARGUMENT naming the field),
    and ExtendedGenerate with a patch and residual rows at a patch point: the reference's."""
    import grpc

    from salience.grpc_frontend.client import AsyncSalienceClient
    from salience.proto.salience.ext.v1 import extensions_pb2 as ext
    from salience.proto.salience.v1 import salience_pb2 as pb

    answer = tiny_reference.greedy(CLEAN, 1)
    patch = clean_patch(tiny_reference, "attn_out", 1, 3)
    prompt = LONG_PROMPT[:12]
    async with frontends(engine) as served, AsyncSalienceClient(served.grpc_target) as client:
        told: list[tuple[int, int]] = []
        grid = await client.sweep(
            progress=lambda done, total: told.append((done, total)),
            clean=CLEAN,
            corrupted=CORRUPTED,
            answer=answer,
            points=["attn_out"],
            positions=[3, 4],
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.sweep(clean=CLEAN, corrupted=CORRUPTED[:4], answer=answer)
        session = await client.open_session("tiny")
        rows = np.random.default_rng(6).normal(0, 2, (1, 128)).astype(np.float32)
        events = [
            e
            async for e in session.extended(
                prompt,
                max_tokens=2,
                top_k=1,
                patches=[ext.Patch(point="mlp_in", layer=2, positions=[4, 7], rows=rows.tobytes())],
                residual=ext.Residual(layers=[3], ranges=[pb.PositionRange(start=0, end=20)], point="resid_mid"),
            )
        ]
    assert told == [(n, 8) for n in range(1, 9)]
    assert (list(grid.points), list(grid.layers), list(grid.positions)) == (["attn_out"], [0, 1, 2, 3], [3, 4])
    want = answer_logprob(tiny_reference, CORRUPTED, answer, [patch])
    assert grid.grids[0].values[1 * 2 + 0] == pytest.approx(want, abs=1e-4)
    assert grid.clean == pytest.approx(answer_logprob(tiny_reference, CLEAN, answer), abs=1e-4)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "same length" in refused.value.details()
    tokens = [e for e in events if e.event.HasField("token")]
    ids = prompt + [e.event.token.id for e in tokens if e.event.token.position >= len(prompt)]
    mine = Patch(point="mlp_in", layer=2, positions=(4, 7), rows=rows.tobytes())
    logprobs, at = tiny_reference.patched(ids, [mine], [Site(3, "resid_mid")])
    assert ids[len(prompt) :] == [int(logprobs[p - 1].argmax()) for p in range(len(prompt), len(ids))]
    read = {e.event.token.position: np.frombuffer(e.residual, dtype="<f4") for e in tokens if e.residual}
    assert sorted(read) == list(range(len(ids)))
    for position, row in read.items():
        expected = at[Site(3, "resid_mid")][position].numpy()
        assert np.abs(row - expected).max() / np.abs(expected).max() < 1e-4, position


async def test_patches_and_rows_at_a_point_in_the_eager_graph(
    engines, tiny_model: Path, tiny_concepts: ConceptSet, tiny_reference: Reference
) -> None:
    """The same taps run eagerly: a patch at a stream point and at a branch point, side by side,
    and rows read at a patch point, equal the reference's."""
    async with engines.engine(
        tiny_model,
        ("patch_engine_eager",),
        served_model_name="tiny",
        max_model_len=1024,
        concepts=tiny_concepts,
        patch_points=("resid_pre", "mlp_out"),
    ) as eager:
        assert not eager.compiled
        ids = LONG_PROMPT[:16]
        rows = np.random.default_rng(8).normal(0, 2, (2, 128)).astype(np.float32)
        patches = (
            Patch(point="resid_pre", layer=1, positions=(2, 9), rows=rows.tobytes()),
            Patch(point="mlp_out", layer=2, positions=(5,), rows=rows[:1].tobytes()),
        )
        asked = ResidualRequest(layers=(3,), ranges=((0, len(ids)),), point="mlp_out")
        scores = await eager.prefill(ids, top_logprobs=5, probes=Probes(patch=patches, residual=asked))
    want, at = tiny_reference.patched(ids, patches, [Site(3, "mlp_out")])
    assert_logprobs_match([scores.at(p) for p in range(1, len(ids))], want.float(), 5)
    assert sorted(scores.residuals) == list(range(len(ids)))
    for position, row in scores.residuals.items():
        expected = at[Site(3, "mlp_out")][position].numpy()
        assert np.abs(row[0] - expected).max() / np.abs(expected).max() < 1e-4, position
