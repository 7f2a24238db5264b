"""`salience features top`: a feature's top activations in a capture against brute force over every
row, its firing counts, contexts that stay inside their document across a shard boundary, the
refusals, and the command's output. No engine: captures are written with ShardWriter directly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from salience.capture.commands import format_table
from salience.capture.feature_tops import FeatureHit, FeatureReport, feature_report, top_activations
from salience.capture.shards import CapturedDocument, ShardWriter
from salience.cli import main
from salience.core.features.sae import SparseAutoencoder, load_sae, save_sae
from salience.errors import InvalidArgument

HIDDEN, D_SAE, LAYERS, SAE_LAYER = 16, 32, (2, 5), 5
LENGTHS = (5, 9, 3, 7, 1, 6)  # shard_tokens 15: documents 0-2 (17 rows) in shard 0, 3-5 (14) in shard 1
PLANTED = 7  # the feature whose encoder column is DIRECTION
DIRECTION = np.array([1, -2, 0, 1, 2, 0, -1, 1, 0, 0, 2, -1, 1, 0, 1, -2], np.float32)
PEAK = (3, 4)  # (document, index in its rows) where the planted feature fires most: 2 * DIRECTION
EVERYWHERE = 9  # fires 1.0 on every row: all ties, so corpus order decides


def documents(token_ids: list[list[int]] | None = None) -> list[CapturedDocument]:
    """Integer-valued rows, exact in float32 and bfloat16, so activations tie exactly and often."""
    rng = np.random.default_rng(0)
    built = []
    for index, n in enumerate(LENGTHS):
        rows = rng.integers(-3, 4, size=(n, len(LAYERS), HIDDEN)).astype(np.float32)
        if index == PEAK[0]:
            rows[PEAK[1], LAYERS.index(SAE_LAYER)] = 2 * DIRECTION
        ids = np.asarray(token_ids[index] if token_ids else rng.integers(10, 1000, size=n), np.int64)
        positions = np.arange(1, n + 1)  # as --drop-first captures them: no position 0
        built.append(CapturedDocument(index, f"doc-{index}", ids, positions, rows))
    return built


def write_capture(folder: Path, docs: list[CapturedDocument], *, model: str = "tiny", dtype: str = "float32") -> Path:
    settings = {"model": model, "layers": list(LAYERS), "hidden_size": HIDDEN, "dtype": dtype}
    writer = ShardWriter.open(folder, settings, shard_tokens=15)
    for document in docs:
        writer.add(document)
    writer.finish()
    return folder


def make_sae(folder: Path, architecture: str = "standard", *, d_in: int = HIDDEN, layer: int = SAE_LAYER) -> Path:
    generator = torch.Generator().manual_seed(1)
    w_enc = torch.randn(d_in, D_SAE, generator=generator)
    b_enc = torch.randn(D_SAE, generator=generator) * 0.1
    if architecture == "standard":
        w_enc[:, PLANTED], b_enc[PLANTED] = torch.from_numpy(DIRECTION[:d_in]), 0.0
        w_enc[:, EVERYWHERE], b_enc[EVERYWHERE] = 0.0, 1.0
    w_dec = torch.randn(D_SAE, d_in, generator=generator)
    k = 4 if architecture == "topk" else None
    threshold = torch.full((D_SAE,), 1.0) if architecture == "jumprelu" else None
    save_sae(folder, architecture=architecture, layer=layer, W_enc=w_enc, b_enc=b_enc, W_dec=w_dec,
             b_dec=torch.zeros(d_in), k=k, threshold=threshold)  # fmt: skip
    return folder


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    return write_capture(tmp_path / "capture", documents())


@pytest.fixture
def sae(tmp_path: Path) -> SparseAutoencoder:
    return load_sae(make_sae(tmp_path / "sae"))


def brute_force(docs: list[CapturedDocument], sae: SparseAutoencoder, feature: int) -> list[tuple[float, int, int]]:
    """(activation, document, index) of every row it fires on, best first, ties in corpus order."""
    rows = np.concatenate([d.rows[:, LAYERS.index(sae.layer)] for d in docs])
    with torch.no_grad():
        acts = torch.as_tensor(sae.encode(torch.from_numpy(rows)))[:, feature].numpy().astype(np.float64)
    where = [(d.index, i) for d in docs for i in range(len(d.token_ids))]
    order = np.lexsort((np.arange(len(acts)), -acts))
    return [(float(acts[r]), *where[r]) for r in order if acts[r] > 0]


def check_hit(hit: FeatureHit, docs: list[CapturedDocument], document: int, index: int, context: int, after: int):
    ids = docs[document].token_ids.tolist()
    assert (hit.document, hit.document_id, hit.position) == (document, f"doc-{document}", index + 1)
    assert hit.token_id == ids[index]
    assert hit.before == tuple(ids[max(0, index - context) : index])
    assert hit.after == tuple(ids[index + 1 : index + 1 + after])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_hits_are_the_rows_brute_force_ranks_highest(tmp_path: Path, sae, dtype: str, chunk_rows: int | None) -> None:
    docs = documents()
    folder = write_capture(tmp_path / "c", docs, dtype=dtype)
    report = feature_report(folder, sae, PLANTED, count=6, context=3, chunk_rows=chunk_rows)
    expected = brute_force(docs, sae, PLANTED)
    # Independently of the SAE's code: relu(x . DIRECTION), exact on integer rows.
    numpy_acts = sorted(max(0.0, float(r[LAYERS.index(SAE_LAYER)] @ DIRECTION)) for d in docs for r in d.rows)
    assert [a for a, _, _ in expected] == sorted((a for a in numpy_acts if a > 0), reverse=True)
    assert (expected[0][1], expected[0][2]) == PEAK and expected[0][0] == float(2 * DIRECTION @ DIRECTION)
    assert len({a for a, _, _ in expected[:8]}) < 8, "the data must have ties for this test to test them"
    assert len(report.hits) == 6
    for hit, (activation, document, index) in zip(report.hits, expected[:6], strict=True):
        assert abs(hit.activation - activation) < 1e-5
        check_hit(hit, docs, document, index, context=3, after=2)
    assert (report.tokens_seen, report.fired, report.documents_seen, report.shards_read) == (31, len(expected), 6, 2)
    assert report.density == pytest.approx(len(expected) / 31) and report.complete
    assert report.max_activation == pytest.approx(expected[0][0], abs=1e-5)
    assert top_activations(folder, sae, PLANTED, count=6, context=3) == list(report.hits)


@pytest.mark.parametrize("architecture", ["topk", "jumprelu"])
def test_other_architectures_match_brute_force(tmp_path: Path, capture: Path, architecture: str) -> None:
    sae = load_sae(make_sae(tmp_path / architecture, architecture))
    docs = documents()
    rows = torch.from_numpy(np.concatenate([d.rows[:, LAYERS.index(SAE_LAYER)] for d in docs]))
    with torch.no_grad():  # the feature whose threshold, or top-k cut, silences the most positive rows
        silenced = (sae.pre_activations(rows) > 0).sum(0) - (sae.encode(rows) > 0).sum(0)
    feature = int(silenced.argmax())
    expected = brute_force(docs, sae, feature)
    assert silenced[feature] > 0
    report = feature_report(capture, sae, feature, count=50, context=2, chunk_rows=3)
    assert 0 < report.fired == len(expected) == len(report.hits) < 31  # fewer than count: only tokens it fired on
    assert [(h.document, h.position - 1) for h in report.hits] == [(d, i) for _, d, i in expected]
    assert np.allclose([h.activation for h in report.hits], [a for a, _, _ in expected], atol=1e-5)


def test_every_context_stays_in_its_document_across_the_shard_boundary(capture: Path, sae) -> None:
    docs = documents()
    report = feature_report(capture, sae, EVERYWHERE, count=100, context=8, after=3, chunk_rows=5)
    assert (report.fired, report.density, report.max_activation) == (31, 1.0, 1.0)
    assert [(h.document, h.position - 1) for h in report.hits] == [
        (d.index, i) for d in docs for i in range(len(d.token_ids))
    ]  # all tie at 1.0: corpus order
    for hit in report.hits:
        check_hit(hit, docs, hit.document, hit.position - 1, context=8, after=3)
    first_of_shard_1 = next(h for h in report.hits if h.document == 3)
    last_of_shard_0 = next(h for h in reversed(report.hits) if h.document == 2)
    assert first_of_shard_1.before == () and last_of_shard_0.after == ()
    # Fewer kept than a chunk's ties at the cut: the earliest win.
    assert feature_report(capture, sae, EVERYWHERE, count=3, context=8, after=3).hits == report.hits[:3]


def test_an_unfinished_capture_is_read_as_far_as_it_goes(tmp_path: Path, sae) -> None:
    writer = ShardWriter.open(tmp_path, {"model": "tiny", "layers": list(LAYERS), "hidden_size": HIDDEN,
                                         "dtype": "float32"}, shard_tokens=15)  # fmt: skip
    for document in documents()[:4]:  # the fourth stays pending: never written
        writer.add(document)
    report = feature_report(tmp_path, sae, EVERYWHERE, count=3)
    assert not report.complete and (report.tokens_seen, report.documents_seen, report.shards_read) == (17, 3, 1)


def test_refusals(tmp_path: Path, capture: Path, sae) -> None:
    def refused(match: str, folder: Path = capture, model: SparseAutoencoder = sae, **options) -> None:
        with pytest.raises(InvalidArgument, match=match):
            feature_report(folder, model, options.pop("feature", PLANTED), **options)

    refused("layers 2, 5", model=load_sae(make_sae(tmp_path / "l4", layer=4)))
    refused("12-wide.*16-wide", model=load_sae(make_sae(tmp_path / "narrow", d_in=12)))
    refused("feature -1 is out of range.*0 to 31", feature=-1)
    refused("feature 32 is out of range", feature=D_SAE)
    refused("not a capture folder", folder=tmp_path / "missing")
    refused("not a capture folder", folder=tmp_path)
    refused("count must be 1 or more", count=0)
    refused("context must be 0 or more", context=-1)


def test_table_marks_the_firing_token() -> None:
    hits = (
        FeatureHit(2.5, 3, "doc-3", 7, 4, before=(1, 2, 3), after=(5, 6)),
        FeatureHit(1.0, 0, "a", 1, 6, before=(), after=()),
        FeatureHit(0.5, 1, "b", 2, 0, before=(5,), after=(1,)),
    )
    report = FeatureReport(feature=PLANTED, layer=SAE_LAYER, hits=hits, context=3, after=2, tokens_seen=31,
                           fired=3, max_activation=2.5, documents_seen=6, shards_read=2, complete=True)  # fmt: skip
    words = {0: "\n", 6: " w6\n"}
    table = format_table(report, lambda ids: "".join(words.get(i, f" w{i}") for i in ids))
    assert table.splitlines() == [
        "rank  activation  document  text",
        "   1      2.5000  doc-3     … w1 w2 w3 [[w4]] w5 w6⏎…",  # full context both sides: the document goes on
        "   2      1.0000  a          [[w6⏎]]",  # the leading space outside the marks, the newline inside
        "   3      0.5000  b          w5[[⏎]] w1",  # a whitespace token stays whole
    ]
    assert format_table(dataclasses.replace(report, hits=()), str) == "feature 7 never fired on these 31 tokens"


TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n        print(name)\n"


def test_command_prints_one_json_object_per_hit(tmp_path: Path, tiny_model: Path, capsys) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokens, ends = tokenizer.encode(TEXT), np.cumsum(LENGTHS)
    assert len(tokens) >= ends[-1], "the text must have a token for every row"
    token_ids = [tokens[end - n : end] for n, end in zip(LENGTHS, ends, strict=True)]
    docs = documents(token_ids)
    sae = make_sae(tmp_path / "sae")
    named = write_capture(tmp_path / "named", docs, model=tiny_model.name)  # as `salience capture` writes it
    path = write_capture(tmp_path / "path", docs, model=str(tiny_model))
    common = ["features", "top", str(PLANTED), "--sae", str(sae), "--count", "4", "--context", "3", "--json"]
    expected = feature_report(path, load_sae(sae), PLANTED, count=4, context=3).hits
    for argv in (["--capture", str(named), "--model", str(tiny_model)], ["--capture", str(path)]):
        assert main([*common, *argv]) == 0
        out, err = capsys.readouterr()
        lines = [json.loads(line) for line in out.splitlines()]
        assert [line["rank"] for line in lines] == [1, 2, 3, 4]
        for line, hit in zip(lines, expected, strict=True):
            assert (line["document"], line["id"], line["position"], line["token_id"]) == (
                hit.document, hit.document_id, hit.position, hit.token_id)  # fmt: skip
            assert line["activation"] == pytest.approx(hit.activation, abs=1e-5)
            assert line["token"] == tokenizer.decode([hit.token_id])
            assert line["before"] == tokenizer.decode(list(hit.before)) and line["before_ids"] == list(hit.before)
        assert "fired on" in err and "31 tokens" in err
    assert main([*common[:-1], "--capture", str(path)]) == 0
    table = capsys.readouterr().out
    assert "[[" in table.splitlines()[2] and "doc-3" in table.splitlines()[2]
    assert main([*common, "--capture", str(named)]) == 2
    assert "name its folder with --model" in capsys.readouterr().err
