"""Shared fixtures: test models built once per cache, one engine per configuration per run.

Models live under SALIENCE_HOME (like the server's own cache), so a CI run
builds the tiny model and converts the default model once, and a developer's
second run reuses both. The tiny model's folder is keyed by the builder's
source, so editing tests/tiny_model.py rebuilds it.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import socket
from collections.abc import AsyncIterator, Collection
from pathlib import Path

import pytest
import pytest_asyncio

from salience.core.models.home import configure_environment

configure_environment()  # before anything imports vllm or torch

import torch  # noqa: E402

from salience.core.engine.engine import Engine  # noqa: E402
from salience.core.engine.settings import EngineSettings  # noqa: E402
from salience.core.features.sae import SparseAutoencoder, load_sae  # noqa: E402
from salience.core.models import portable  # noqa: E402
from salience.core.models.atomic import build_folder_once  # noqa: E402
from salience.core.models.default_model import ensure_default_model  # noqa: E402
from salience.core.models.folders import model_fingerprint  # noqa: E402
from salience.core.models.home import salience_home  # noqa: E402
from salience.core.models.points import Point  # noqa: E402
from salience.core.probes.concepts import ConceptSet  # noqa: E402
from salience.core.serving import default_concepts as default_concept_set  # noqa: E402
from tests.engines import EnginePool, engine_settings  # noqa: E402
from tests.random_sae import random_sae, stored  # noqa: E402
from tests.reference import Reference  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402
from tests.tiny_vl_model import build_tiny_vl_model  # noqa: E402

# The tiny model's cache key: every source its folder depends on.
TINY_SOURCES = [Path(__file__).with_name("tiny_model.py"), Path(portable.__file__)]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in TINY_SOURCES)).hexdigest()[:12]
    return build_folder_once(salience_home() / "test-models" / f"tiny-qwen2-{key}", build_tiny_model)


# The tiny VL model extends the tiny model's tokenizer, so its key covers both builders.
TINY_VL_SOURCES = [Path(__file__).with_name("tiny_vl_model.py"), *TINY_SOURCES]


@pytest.fixture(scope="session")
def tiny_vl_model(tiny_model: Path) -> Path:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in TINY_VL_SOURCES)).hexdigest()[:12]
    target = salience_home() / "test-models" / f"tiny-qwen2vl-{key}"
    return build_folder_once(target, lambda out: build_tiny_vl_model(out, tiny_model))


@pytest.fixture(scope="session")
def default_model() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def default_concepts(default_model: Path) -> ConceptSet:
    """The built-in concept set, as `salience serve` finds it: the shipped one (a plain fixture, so
    no event loop is running if it has to be built)."""
    concept_set = ConceptSet.load(default_concept_set.default_concepts(default_model))
    concept_set.check_model(default_model)
    return concept_set


async def start_engine(model: Path, **settings) -> Engine:
    """An engine of the test's own, for what must start afresh (a start's own behaviour, a
    setting no other module shares); modules share theirs through `engines`."""
    return await Engine.start(EngineSettings(model=model, **engine_settings(model, settings)))


class Plan:
    """The run's tests in order, and where each fixture is used: the pool keeps an idle engine
    while a test still to run uses a fixture that asks for it (tests/engines.py)."""

    def __init__(self) -> None:
        self._items: list[pytest.Item] | None = None
        self._index: dict[int, int] = {}  # id(item) -> its place in the run
        self._places: dict[str, list[int]] = {}  # "name", "name[param]" -> places of the tests using it
        self._current: int | None = None

    def running(self, item: pytest.Item) -> None:
        items = item.session.items
        if items is not self._items or len(items) != len(self._index):
            self._learn(items)
        self._current = self._index.get(id(item))

    def _learn(self, items: list[pytest.Item]) -> None:
        self._items, self._index, self._places = items, {}, {}
        for place, item in enumerate(items):
            self._index[id(item)] = place
            callspec = getattr(item, "callspec", None)
            params = callspec.params if callspec is not None else {}
            for name in getattr(item, "fixturenames", ()):
                self._places.setdefault(name, []).append(place)
                if name in params:
                    self._places.setdefault(f"{name}[{params[name]}]", []).append(place)

    def running_test(self) -> str:
        if self._current is None or self._items is None:
            return "no test"
        return self._items[self._current].nodeid

    def next_use(self, fixtures: Collection[str]) -> float:
        """The place of the next test (after the running one) using one of `fixtures`, math.inf if none."""
        if self._current is None:  # a test the plan does not know: everything may still be used
            return 0.0
        later = []
        for fixture in fixtures:
            places = self._places.get(fixture, [])
            i = bisect.bisect_right(places, self._current)
            if i < len(places):
                later.append(places[i])
        return min(later, default=math.inf)


PLAN = Plan()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    PLAN.running(item)


@pytest_asyncio.fixture(scope="session")
async def engines() -> AsyncIterator[EnginePool]:
    # Six: from test_readouts to test_steering the default, tiny, eager and compiled read and two
    # tensor-parallel engines wait for a later module (14 GB with this process); a start wants
    # 8 GB available beside them, for itself and a module's own engine.
    pool = EnginePool(keep=6, room_gib=8.0, next_use=PLAN.next_use, running=PLAN.running_test)
    yield pool
    pool.close()
    POOLED.append(pool)


POOLED: list[EnginePool] = []  # the run's pool, for its summary


def pytest_terminal_summary(terminalreporter) -> None:
    """How many engines the run started and what each start cost (each configuration once unless
    the pool had to let it go; then what the pool did and when), so the next person sees the time."""
    for pool in POOLED:
        starts = pool.starts
        again = {key for key in starts if starts.count(key) > 1}
        total = sum(pool.seconds)
        terminalreporter.write_sep("-", "test engines")
        terminalreporter.write_line(
            f"test engines: {len(starts)} starts, {len(set(starts))} configurations, {total:.0f} s starting"
        )
        for label, seconds in sorted(zip(pool.labels, pool.seconds, strict=True), key=lambda s: -s[1]):
            terminalreporter.write_line(f"  {seconds:6.1f} s  {label}")
        for event in pool.events:
            if any(key in event for key in again):
                terminalreporter.write_line(f"  {event}")


@pytest_asyncio.fixture(scope="module")
async def tiny_engine(engines: EnginePool, tiny_model: Path) -> AsyncIterator[Engine]:
    async with engines.engine(
        tiny_model, ("tiny_engine",), served_model_name="tiny", max_model_len=2048, max_logprobs=20
    ) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module")
async def default_engine(
    engines: EnginePool, default_model: Path, default_concepts: ConceptSet
) -> AsyncIterator[Engine]:
    """The default model with its concept set, compiled, as `salience serve` runs it."""
    async with engines.engine(
        default_model, ("default_engine",), max_model_len=2048, concepts=default_concepts, compile=True
    ) as engine:
        yield engine


def _in_mode(engines: EnginePool, name: str, model: Path, compiled: bool, **settings):
    """The pooled engine of fixture `name` (eager), of `name`_each_mode (eager, then compiled) and
    of `name`_compiled: the eager one is the first two fixtures', the compiled one the last two's."""
    fixtures = (f"{name}_each_mode[compiled]", f"{name}_compiled") if compiled else (name, f"{name}_each_mode[eager]")
    return engines.engine(model, fixtures, compile=compiled, **settings)


def _read(engines: EnginePool, tiny_model: Path, tiny_concepts: ConceptSet, compiled: bool):
    return _in_mode(
        engines,
        "read_engine",
        tiny_model,
        compiled,
        served_model_name="tiny",
        max_model_len=1024,
        concepts=tiny_concepts,
    )


@pytest_asyncio.fixture(scope="module")
async def read_engine(engines: EnginePool, tiny_model: Path, tiny_concepts: ConceptSet) -> AsyncIterator[Engine]:
    """The tiny model reading `tiny_concepts`, eager: what most modules of the readout side use."""
    async with _read(engines, tiny_model, tiny_concepts, compiled=False) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", params=["eager", "compiled"])
async def read_engine_each_mode(
    request: pytest.FixtureRequest, engines: EnginePool, tiny_model: Path, tiny_concepts: ConceptSet
) -> AsyncIterator[Engine]:
    """`read_engine`, then the same compiled: the module's tests run on each."""
    async with _read(engines, tiny_model, tiny_concepts, compiled=request.param == "compiled") as engine:
        yield engine


@pytest_asyncio.fixture(params=["eager", "compiled"])
async def tensor_parallel_engine(
    request: pytest.FixtureRequest,
    engines: EnginePool,
    tiny_model: Path,
    tiny_concepts: ConceptSet,
    tiny_saes: dict[str, SparseAutoencoder],
) -> AsyncIterator[Engine]:
    """The tiny model reading `tiny_concepts` and serving the `top` SAE over two tensor-parallel
    ranks (the two CPU cores), eager then compiled: test_readouts, test_steering and test_features
    check their numbers on the same two."""
    async with engines.engine(
        tiny_model,
        (f"tensor_parallel_engine[{request.param}]",),
        max_model_len=512,
        concepts=tiny_concepts,
        saes=(tiny_saes["top"],),
        sae_top=TINY_SAE_TOP,
        tensor_parallel_size=2,
        compile=request.param == "compiled",
    ) as engine:
        yield engine


TINY_SAE_TOP = 16  # --sae-top of the engines serving `tiny_saes`


@pytest.fixture(scope="session")
def tiny_saes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SparseAutoencoder]:
    """Random SAEs of the tiny model in SAELens's three architectures, each at the same path on every
    run (a compiled engine serving them loads the forward an earlier run compiled)."""
    root = tmp_path_factory.mktemp("saes")
    threshold = torch.full((256,), 0.3)
    made = {
        "top": stored(random_sae(root / "top", "topk", 2, 512, 1, k=8)),
        "plain": stored(random_sae(root / "plain", "standard", 1, 256, 2)),
        "jump": stored(random_sae(root / "jump", "jumprelu", 3, 256, 3, threshold=threshold)),
    }
    return {name: load_sae(folder, name=name) for name, folder in made.items()}


def _sae(engines: EnginePool, tiny_model: Path, tiny_concepts: ConceptSet, saes: dict, compiled: bool):
    return _in_mode(
        engines,
        "sae_engine",
        tiny_model,
        compiled,
        max_model_len=1024,
        concepts=tiny_concepts,
        saes=tuple(saes.values()),
        sae_top=TINY_SAE_TOP,
    )


@pytest_asyncio.fixture(scope="module")
async def sae_engine(
    engines: EnginePool, tiny_model: Path, tiny_concepts: ConceptSet, tiny_saes: dict[str, SparseAutoencoder]
) -> AsyncIterator[Engine]:
    """The tiny model reading `tiny_concepts` and serving the three `tiny_saes`, eager."""
    async with _sae(engines, tiny_model, tiny_concepts, tiny_saes, compiled=False) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module")
async def sae_engine_compiled(
    engines: EnginePool, tiny_model: Path, tiny_concepts: ConceptSet, tiny_saes: dict[str, SparseAutoencoder]
) -> AsyncIterator[Engine]:
    """`sae_engine` compiled, every tap in the graph (readouts, steering, residual rows, features)."""
    async with _sae(engines, tiny_model, tiny_concepts, tiny_saes, compiled=True) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", params=["eager", "compiled"])
async def sae_engine_each_mode(
    request: pytest.FixtureRequest,
    engines: EnginePool,
    tiny_model: Path,
    tiny_concepts: ConceptSet,
    tiny_saes: dict[str, SparseAutoencoder],
) -> AsyncIterator[Engine]:
    """`sae_engine`, then the same compiled: test_features runs on each."""
    async with _sae(engines, tiny_model, tiny_concepts, tiny_saes, compiled=request.param == "compiled") as engine:
        yield engine


TINY_LAYERS = (0, 2, 3)  # 3 is the last layer: read before the final norm
TINY_CONCEPTS = ("alpha", "beta", "gamma", "delta", "epsilon")


def random_concepts(
    model: Path, concepts: tuple[str, ...], layers: tuple[int, ...], seed: int, path: Path, point: Point = "resid_post"
) -> ConceptSet:
    """Random unit vectors of a 4-layer, hidden-128 tiny model at `point` of `layers`, saved to
    `path` and loaded back (as a server loads a set), checked against `model`."""
    generator = torch.Generator().manual_seed(seed)
    vectors = {}
    for layer in layers:
        v = torch.randn(len(concepts), 128, generator=generator)
        vectors[layer] = v / v.norm(dim=1, keepdim=True)
    built = ConceptSet(
        concepts=concepts,
        vectors=vectors,
        hidden_size=128,
        num_layers=4,
        model_fingerprint=model_fingerprint(model),
        provenance={"method": "random unit vectors", "seed": seed},
        point=point,
    )
    built.save(path)
    loaded = ConceptSet.load(path)
    loaded.check_model(model)
    assert loaded.point == point
    return loaded


@pytest.fixture(scope="session")
def tiny_concepts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ConceptSet:
    """Random unit vectors at three of the tiny model's four layers."""
    path = tmp_path_factory.mktemp("concepts") / "tiny.safetensors"
    return random_concepts(tiny_model, TINY_CONCEPTS, TINY_LAYERS, 1, path)


@pytest.fixture(scope="module")
def tiny_reference(tiny_model: Path) -> Reference:
    return Reference(tiny_model)


async def drop_live_concepts(engine: Engine) -> None:
    """Delete every live concept and wait until their columns are zeroed: the next test starts clean."""
    for concept in engine.live.table.live():
        engine.live.delete(concept.name)
    await engine.live.settled()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
