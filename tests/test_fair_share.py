"""Fair share across clients (core/engine/fair_share.py): the admission's rules on their own, a
simulated continuous-batching engine driven by it, and the real engine on the tiny model, where
tokens are counted per client in the same window (never timed)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.core.engine.fair_share import PROMPT_WEIGHT, FairShare, Slot, admission
from salience.core.engine.newcomer_scheduler import NEWCOMER
from salience.core.engine.requests import SamplingOptions
from salience.core.engine.settings import EngineSettings
from salience.core.engine.start import settings_checks
from salience.core.serving.sessions import SessionStore
from salience.core.serving.turns import Turn
from salience.errors import InvalidArgument
from tests.engines import EnginePool

# ---- the rules -------------------------------------------------------------------------------


def granted(slots: list[Slot]) -> list[bool]:
    return [slot.granted for slot in slots]


def test_one_client_is_first_come_first_served() -> None:
    share = FairShare(max_running=3, room=4)
    slots = [share.enter("anonymous", 1.0, 8) for _ in range(5)]
    assert granted(slots) == [True, True, True, False, False]  # all of N, none of the room above it
    assert share.waiting() == 2
    slots[1].release()
    assert granted(slots[3:]) == [True, False]
    slots[0].release()
    assert slots[4].granted and share.running == 3 and share.waiting() == 0


def test_a_clients_line_keeps_vllms_order_and_other_clients_their_turn() -> None:
    """Within a line the request's own priority goes first (lower first, as vLLM orders its
    queue), then arrival; across clients, service decides, whatever the priorities."""
    share = FairShare(max_running=1, room=1)
    running = share.enter("a", 1.0, 0, priority=5)
    batch, interactive = share.enter("a", 1.0, 0, priority=10), share.enter("a", 1.0, 0, priority=0)
    running.release()
    assert interactive.granted and not batch.granted
    urgent = share.enter("c", 1.0, 0, priority=-100)
    interactive.generated(5)
    interactive.release()  # a has been served 5, c nothing: c's turn, priority or not
    assert urgent.granted and not batch.granted


def test_a_client_with_nothing_running_while_others_run_is_a_newcomer() -> None:
    """Its prompt may take a step of its own (newcomer_scheduler.py): only when it enters at once."""
    share = FairShare(max_running=2, room=3)
    assert not share.enter("a", 1.0, 8).newcomer  # a quiet engine: its step is its own anyway
    assert not share.enter("a", 1.0, 8).newcomer  # a runs one already
    b = share.enter("b", 1.0, 8)
    assert b.granted and b.newcomer
    second = share.enter("b", 1.0, 8)
    assert not second.newcomer  # b's second
    c = share.enter("c", 1.0, 8)
    assert not c.granted and not c.newcomer  # it waits: by its turn, it is one of many
    second.release()
    b.release()
    assert c.granted and not c.newcomer


def test_a_quiet_engine_holds_nothing_back() -> None:
    share = FairShare(max_running=4, room=4)
    slots = [share.enter(name, 1.0, 8) for name in ("a", "b", "a", "c")]
    assert all(granted(slots))


def test_a_client_below_its_share_enters_past_max_running() -> None:
    share = FairShare(max_running=4, room=6)
    a = [share.enter("a", 1.0, 8) for _ in range(6)]
    assert granted(a) == [True] * 4 + [False] * 2
    b = [share.enter("b", 1.0, 8) for _ in range(3)]
    assert granted(b) == [True, True, False]  # its share, 2 of 4, at once; the third waits
    assert share.running == 6
    a[0].release()
    a[1].release()  # 4 run: b, below its share no more, and a wait for a free slot
    assert share.running == 4 and not any(granted(a[4:])) and not b[2].granted


def test_room_is_the_ceiling_and_a_client_below_its_share_goes_first() -> None:
    share = FairShare(max_running=2, room=2)
    a = [share.enter("a", 1.0, 8) for _ in range(4)]
    b = share.enter("b", 1.0, 8)
    assert not b.granted  # vLLM runs no more
    a[0].generated(100)
    a[0].release()
    assert b.granted and not a[2].granted


def test_backlogged_clients_take_turns_by_service() -> None:
    share = FairShare(max_running=1, room=1)
    running = share.enter("a", 1.0, 0)
    waiting = {share.enter(name, 1.0, 0): name for name in ("a", "c", "a", "c", "a", "c")}
    turns = []
    for _ in range(6):
        running.generated(10)
        running.release()
        running = next(slot for slot in waiting if slot.granted and waiting[slot])
        turns.append(waiting[running])
        waiting[running] = ""
    # c, the least served, first; then ties at equal service go to the longest waiting
    assert turns == ["c", "a", "c", "a", "c", "a"]


def test_a_client_becoming_active_is_lifted_to_the_floor() -> None:
    share = FairShare(max_running=1, room=1)
    a = share.enter("a", 1.0, 0)
    a.generated(500)
    again = share.enter("a", 1.0, 0)
    b = share.enter("b", 1.0, 0)
    assert share.counters()["b"] == 500  # not 0: time idle is no credit to spend later
    a.release()
    assert again.granted and not b.granted  # equal service: the longest waiting goes first


def test_an_idle_client_keeps_a_deficit_and_counters_end_with_the_busy_period() -> None:
    share = FairShare(max_running=4, room=4)
    a = share.enter("a", 1.0, 0)
    b = share.enter("b", 1.0, 0)
    b.generated(300)
    b.release()  # b pauses above the floor (a's 0) ...
    share.enter("b", 1.0, 0)
    assert share.counters()["b"] == 300  # ... and comes back owing it
    a.release()
    assert set(share.counters()) == {"b"}  # a, idle at the floor, is forgotten
    share = FairShare(max_running=4, room=4)
    slot = share.enter("c", 1.0, 0)
    slot.generated(50)
    slot.release()
    assert share.counters() == {}  # nobody active: a new busy period starts from nothing


def test_prompt_tokens_count_half_and_cached_ones_not_at_all() -> None:
    share = FairShare(max_running=4, room=4)
    slot = share.enter("a", 2.0, 100)
    assert share.counters()["a"] == PROMPT_WEIGHT * 100 / 2
    slot.cached(60)
    slot.generated(10)
    assert share.counters()["a"] == (PROMPT_WEIGHT * 40 + 10) / 2


async def test_a_request_cancelled_while_it_waits_leaves_the_line() -> None:
    share = FairShare(max_running=1, room=1)
    first = share.enter("a", 1.0, 0)
    second, third = share.enter("a", 1.0, 0), share.enter("a", 1.0, 0)
    waiter = asyncio.create_task(second.ready())
    await asyncio.sleep(0)
    second.release()
    assert await waiter is False
    first.release()
    assert third.granted and await third.ready()


def test_admission_from_settings() -> None:
    settings = EngineSettings(model=Path("m"), served_model_name="m")
    share = admission(settings, max_num_seqs=128)
    assert (share.max_running, share.room) == (96, 128)
    share = admission(dataclasses.replace(settings, max_running=10, data_parallel_size=2), max_num_seqs=16)
    assert (share.max_running, share.room) == (20, 32)
    assert admission(dataclasses.replace(settings, fair_share=False), max_num_seqs=128) is None
    with pytest.raises(InvalidArgument, match="max_num_seqs=170"):
        admission(dataclasses.replace(settings, max_running=128), max_num_seqs=64)
    with pytest.raises(InvalidArgument, match="--max-running must be 1 or more"):
        settings_checks.check(dataclasses.replace(settings, max_running=0))


# ---- a simulated engine ---------------------------------------------------------------------


@dataclasses.dataclass
class Load:
    """A client keeping `streams` requests outstanding, each `tokens` long, resubmitted as one ends."""

    streams: int
    tokens: int
    weight: float = 1.0
    prompt: int = 16


def simulate(share: FairShare, loads: dict[str, Load], steps: int) -> Iterator[Counter[str]]:
    """Continuous batching: each step every granted request decodes one token; a finished one is
    released and its stream submits the next. Yields each step's tokens per client."""
    left: dict[Slot, int] = {}
    owner: dict[Slot, str] = {}

    def submit(name: str) -> None:
        slot = share.enter(name, loads[name].weight, loads[name].prompt)
        left[slot], owner[slot] = loads[name].tokens, name

    for name, load in loads.items():
        for _ in range(load.streams):
            submit(name)
    for _ in range(steps):
        step: Counter[str] = Counter()
        for slot in [s for s in left if s.granted]:
            slot.generated(1)
            step[owner[slot]] += 1
            left[slot] -= 1
            if left[slot] == 0:
                del left[slot]
                slot.release()
                submit(owner[slot])
        yield step


def window(share: FairShare, loads: dict[str, Load], settle: int, steps: int) -> Counter[str]:
    """Tokens per client over `steps` steps after `settle` steps."""
    total: Counter[str] = Counter()
    for i, step in enumerate(simulate(share, loads, settle + steps)):
        if i >= settle:
            total += step
    return total


@pytest.mark.parametrize("b_streams", [1, 4, 16])
def test_simulated_b_gets_its_share_or_all_it_asks_for(b_streams: int) -> None:
    n, steps = 16, 400
    got = window(FairShare(max_running=n, room=24), {"a": Load(64, 24), "b": Load(b_streams, 40)}, 100, steps)
    asks = min(b_streams, n // 2) * steps  # one token a step per request, up to half of N
    # The bound: what one request more or less than the share decodes while it runs.
    assert abs(got["b"] - asks) <= 40
    assert got["a"] + got["b"] >= n * steps - 2 * 24  # work-conserving: N tokens a step


def test_simulated_weights_divide_the_tokens() -> None:
    n, steps = 12, 600
    loads = {"a": Load(64, 20, weight=2.0), "b": Load(64, 30), "c": Load(64, 10)}
    got = window(FairShare(max_running=n, room=16), loads, 100, steps)
    for name, part in (("a", 0.5), ("b", 0.25), ("c", 0.25)):
        assert abs(got[name] - part * n * steps) <= 2 * 30


# ---- the real engine -------------------------------------------------------------------------

SLOTS = 8  # vLLM's max_num_seqs on the test engine: the room fair share works in
MAX_RUNNING = 6


@pytest_asyncio.fixture(scope="module")
async def fair_share_engine(engines: EnginePool, tiny_model: Path) -> AsyncIterator[Engine]:
    """Named for the pool (no other module asks for it: it goes once this module is done)."""
    async with engines.engine(
        tiny_model, ("fair_share_engine",), max_running=MAX_RUNNING, engine_args={"max_num_seqs": SLOTS}
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def engine(fair_share_engine: Engine) -> Engine:
    return fair_share_engine


def prompt(i: int) -> list[int]:
    return [0, *range(10 + 3 * (i % 40), 26 + 3 * (i % 40))]


async def contend(engine: Engine, a_requests: int, b_requests: int) -> list[str]:
    """A's requests (8 tokens each), then B's (48 each), all at once: the client of every token in
    the order they came, and "b-end" as each of B's requests ends."""
    log: list[str] = []

    async def run(client: str, i: int, tokens: int) -> None:
        options = SamplingOptions(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(prompt(i), options, client=client):
            log.append(client)
        if client == "b":
            log.append("b-end")

    await asyncio.gather(*(run("a", i, 8) for i in range(a_requests)), *(run("b", i, 48) for i in range(b_requests)))
    return log


def b_window(log: list[str], asked: int, wanted: int) -> Counter[str]:
    """Tokens per client from the start until fewer than `wanted` of B's `asked` requests are left:
    B wants that many slots all along."""
    ends = [i for i, entry in enumerate(log) if entry == "b-end"]
    return Counter(entry for entry in log[: ends[asked - wanted]] if entry != "b-end")


@pytest.mark.parametrize("b_requests", [2, 4])
async def test_b_gets_its_share_of_the_tokens_in_the_same_window(engine: Engine, b_requests: int) -> None:
    """A floods the engine with 64 short requests, B asks for 2 (within its share of 3 of the 6
    running) or 4 (beyond it). While B wants `wanted` slots, B gets one token a step for each, so
    its part of the tokens is wanted / 6, less at most what A's requests already running when B
    came decode beyond A's share: 6 x 8 tokens (docs/security.md#fair-share)."""
    wanted = min(b_requests, MAX_RUNNING // 2)
    bound = MAX_RUNNING * 8
    got = b_window(await contend(engine, 64, b_requests), b_requests, wanted)
    assert got["b"] >= wanted / MAX_RUNNING * got.total() - bound, got

    fair_share, engine.fair_share = engine.fair_share, None  # first come, first served: B waits behind A
    try:
        unfair = b_window(await contend(engine, 64, b_requests), b_requests, wanted)
    finally:
        engine.fair_share = fair_share
    assert unfair["b"] < wanted / MAX_RUNNING * unfair.total() - bound, unfair


async def test_one_client_keeps_its_order_and_its_results(engine: Engine) -> None:
    """Anonymous requests, more than run at once: the first 6 enter, the rest in the order they came
    as earlier ones end (each shorter than the next), and every result is the one without fair share."""
    log: list[int] = []

    async def run(i: int) -> list[int]:
        options = SamplingOptions(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True)
        tokens = []
        async for event in engine.generate(prompt(i), options):
            log.append(i)
            tokens.append(event.token_id)
        return tokens

    fair = await asyncio.gather(*(run(i) for i in range(12)))
    starts = sorted(range(12), key=log.index)
    assert starts[MAX_RUNNING:] == list(range(MAX_RUNNING, 12))
    fair_share, engine.fair_share = engine.fair_share, None
    try:
        assert await asyncio.gather(*(run(i) for i in range(12))) == fair
    finally:
        engine.fair_share = fair_share


async def test_a_request_on_a_quiet_engine_never_waits(engine: Engine) -> None:
    generation = engine.generate(prompt(0), SamplingOptions(max_tokens=2, temperature=0.0), client="b", weight=2.0)
    assert engine.fair_share.running == 1  # granted as it was made: vLLM sees it on the first step
    async with generation:
        assert len([event async for event in generation]) == 2
    with pytest.raises(InvalidArgument, match="weight must be a positive number"):
        engine.generate(prompt(0), SamplingOptions(max_tokens=2), weight=0.0)
    with pytest.raises(InvalidArgument, match="client must be a non-empty string"):
        await engine.prefill(prompt(0), client="")


async def test_session_turns_and_passes_count_for_their_client(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    entered = []
    enter = engine.fair_share.enter

    def spy(client: str, weight: float, prompt_tokens: int, priority: int = 0) -> Slot:
        entered.append((client, weight))
        return enter(client, weight, prompt_tokens, priority)

    monkeypatch.setattr(engine.fair_share, "enter", spy)
    store = SessionStore(lambda: engine)
    generating, scoring_session = store.open("s"), store.open("t")  # a session is its client's
    options = SamplingOptions(max_tokens=4, temperature=0.0)
    async for _ in await store.start(generating, Turn(offset=0, append=prompt(1), sampling=options, client="s")):
        assert "s" in engine.fair_share.counters()
    scoring = Turn(offset=0, append=prompt(1), logprob_ranges=((1, 4),), client="t", weight=0.5)  # one pass
    async for _ in await store.start(scoring_session, scoring):
        pass
    assert entered == [("s", 1.0), ("t", 0.5)]
    with pytest.raises(InvalidArgument, match="weight must be a positive number"):
        await store.start(scoring_session, dataclasses.replace(scoring, offset=len(prompt(1)), append=(), weight=-1.0))
    await store.close(generating, "s")
    await store.close(scoring_session, "t")


async def test_a_newcomers_generation_and_pass_both_ask_for_their_own_step(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What reaches vLLM: a client with nothing running while another runs is a newcomer, for a
    generation and a pass alike (newcomer_scheduler.py gives its prompt a step of its own)."""
    marked: dict[str, bool] = {}
    generate = engine._llm.generate

    def spy(prompt, params, request_id, *args, **kwargs):
        marked[request_id] = bool((params.extra_args or {}).get(NEWCOMER))
        return generate(prompt, params, request_id, *args, **kwargs)

    monkeypatch.setattr(engine._llm, "generate", spy)
    # The whole context, to outlast the three requests on any machine; it ends with `async with`.
    long = SamplingOptions(max_tokens=2048 - len(prompt(0)), temperature=0.0, ignore_eos=True)
    running = engine.generate(prompt(0), long, client="a")
    async with running:
        await anext(running)  # a runs
        await engine.prefill(prompt(1), client="b")
        newcomer = engine.generate(prompt(2), SamplingOptions(max_tokens=2, temperature=0.0), client="c")
        second = engine.generate(prompt(3), SamplingOptions(max_tokens=2, temperature=0.0), client="c")
        for generation in (newcomer, second):
            async with generation:
                assert len([event async for event in generation]) == 2
    assert list(marked.values()) == [False, True, True, False], marked  # a on a quiet engine; c's second
