"""Stateful sessions: a token list a client grows turn by turn, held for it between calls.

Theory of operation. Sessions exist for bandwidth: the client sends only the tokens it adds,
and every turn submits the session's whole token list to vLLM, whose prefix cache holds the
KV of what came before, so only the delta is computed. The client stays the source of truth
for content: each turn states the length it believes the session has (`offset`) and whether
it means to rewrite history (`truncating`); any other view is drift, refused with both
lengths in the message, never repaired silently.

A turn is validated whole before anything changes: offset, token ids, ranges, room in the
context and the store's limits. Then the append (after a rewind) is committed and the turn
runs; decoded tokens join the session as they are handed out, so a cancelled turn keeps what
the client already saw (turns.py). One turn runs per session at a time.

A chat turn (`chat`) appends instead what the chat template's rendering of the session's
conversation adds, and its reply joins the conversation (conversations.py).

An exchange a frontend ran outside any session can be kept as one (`keep`): the OpenAI
Responses API's stored response is a session holding its prompt's and reply's tokens and their
conversation, so it is bounded, expires and belongs to its client like any other.

The store holds its sessions in a SessionPool (session_pool.py), which decides whose each is,
when an idle one expires and which is evicted past the limits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from salience.core.engine.chat_messages import ChatMessage
from salience.core.engine.engine import Engine
from salience.core.engine.fair_share import ANONYMOUS, check_client
from salience.core.engine.generation import Generation
from salience.core.engine.images import ImageFacts, Vision
from salience.core.engine.prompt_scores import PromptScores
from salience.core.engine.prompts import PlacedImage
from salience.core.serving import conversations
from salience.core.serving.conversations import ChatTurn, Conversation
from salience.core.serving.observers import OBSERVERS
from salience.core.serving.session_images import place_images
from salience.core.serving.session_pool import SessionLimits, SessionPool
from salience.core.serving.turns import Range, Turn, TurnRun
from salience.errors import ContextOverflow, FailedPrecondition, InvalidArgument, SessionBusy

__all__ = ["SessionLimits", "SessionStore"]


@dataclass(eq=False)
class _Session:
    id: str
    owner: str  # the client that opened it (Client.share): only its calls find it
    tokens: array = field(default_factory=lambda: array("I"))
    images: list[PlacedImage] = field(default_factory=list)  # by block start
    conversation: Conversation = field(default_factory=Conversation)  # what its chat turns said
    last_used: float = 0.0
    run: TurnRun | None = None
    kept: object = None  # what a frontend keeps with an exchange it ran outside the session (`keep`)
    # The data-parallel engine every turn runs on, so each reads its prefix cache; chosen at the
    # first turn (the least loaded), inherited by forks.
    dp_rank: int | None = None

    def block_around(self, position: int) -> PlacedImage | None:
        """The image block that `position` would split (strictly inside it), if any."""
        return next((b for b in self.images if b.start < position < b.end), None)


class SessionStore:
    """Every open session of one engine. Not thread-safe: use from the event loop.

    `engine` returns the engine or raises Unavailable (`ServerStatus.serving_engine`):
    the store exists before the model has loaded, as the frontends do. Every call names its
    client, `owner` (a turn's: `Turn.client`); like `Turn.client` it defaults to ANONYMOUS.
    """

    def __init__(
        self,
        engine: Callable[[], Engine],
        limits: SessionLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._pool: SessionPool[_Session] = SessionPool(limits or SessionLimits(), clock)
        OBSERVERS.store_opened(self)

    def __len__(self) -> int:
        return len(self._pool)

    def stored_tokens(self) -> int:
        return self._pool.stored_tokens()

    def sweep(self) -> int:
        """Evict sessions idle longer than the TTL; return how many went."""
        return self._pool.sweep()

    async def sweep_forever(self) -> None:
        """Evict expired sessions even when no calls come in (their memory is not free)."""
        await self._pool.sweep_forever()

    # ---- lifecycle ---------------------------------------------------------------------

    def open(self, owner: str = ANONYMOUS, max_owned: int | None = None) -> str:
        """A new session of `owner`, who may hold at most `max_owned` (ResourceExhausted past it)."""
        self._engine()
        self._pool.check_quota(owner, max_owned)
        self._pool.make_room(sessions=1, tokens=0, keep=None)
        session = _Session(secrets.token_urlsafe(16), owner=owner)
        self._pool.add(session)
        return session.id

    async def close(self, session_id: str, owner: str = ANONYMOUS) -> None:
        """Forget `owner`'s session, stopping its running turn. Closing twice is fine, and so, alike,
        is closing an id that is another's: that session stays."""
        session = self._pool.remove(session_id, owner)
        if session is not None and session.run is not None:
            await session.run.cancel()

    def fork(self, session_id: str, at_position: int, owner: str = ANONYMOUS, max_owned: int | None = None) -> str:
        """A new session of `owner` (as `open`), holding the first `at_position` tokens of its `session_id`."""
        self._engine()  # a new session: none while loading or draining
        source = self._pool.get(session_id, owner)
        self._pool.check_quota(owner, max_owned)
        if at_position > len(source.tokens):
            raise FailedPrecondition(
                f"cannot fork at position {at_position}: the session has {len(source.tokens)} tokens"
            )
        if (block := source.block_around(at_position)) is not None:
            raise FailedPrecondition(_split_message("fork", at_position, block))
        self._pool.make_room(sessions=1, tokens=at_position, keep=source)
        child = _Session(secrets.token_urlsafe(16), tokens=source.tokens[:at_position], owner=owner)
        child.images = [b for b in source.images if b.end <= at_position]
        child.conversation = source.conversation.cut(at_position)
        child.dp_rank = source.dp_rank
        self._pool.add(child)
        return child.id

    def tokens(self, session_id: str, owner: str = ANONYMOUS) -> list[int]:
        return self._pool.get(session_id, owner).tokens.tolist()

    def keep(
        self, session_id: str, owner: str, tokens: Sequence[int], conversation: Conversation, kept: object
    ) -> None:
        """Make `owner`'s idle session hold an exchange a frontend ran outside it (the OpenAI
        Responses API's stored response): its tokens and conversation, and `kept`, the frontend's
        own record of it. The tokens count against the limits as a turn's do."""
        session = self._pool.get(session_id, owner)
        self._check_offset(session, len(session.tokens), truncating=None)  # no turn running
        self._pool.make_room(sessions=0, tokens=max(len(tokens) - len(session.tokens), 0), keep=session)
        session.tokens = array("I", tokens)
        session.images = []
        session.conversation = conversation
        session.kept = kept

    def kept(self, session_id: str, owner: str) -> object:
        """What `keep` kept with `owner`'s session (None: nothing yet)."""
        return self._pool.get(session_id, owner).kept

    # ---- turns ---------------------------------------------------------------------------

    async def start(self, session_id: str, turn: Turn, engine: Engine | None = None) -> TurnRun:
        """Validate the turn on its client's session, apply its append, and return it ready to iterate.

        Every error is raised here, before the session changes. Images are decoded and the
        constraint validated first, in threads (a large one takes a while, and other streams must
        not wait); everything that reads or changes the session happens after that, without
        awaiting. `engine` is the one the caller was admitted with (ServerStatus.admit), so a
        turn admitted before the server began draining runs; by default the store asks for the
        serving engine."""
        engine = engine or self._engine()
        facts = await self._inspect(turn, engine)
        await engine.checks.constraint(turn.sampling.structured_outputs)
        session = self._pool.get(session_id, turn.client)
        self._check_offset(session, turn.offset, turn.truncating)
        run = self._commit(session, turn, engine, facts, functools.partial(self._finished, session))
        session.conversation = session.conversation.cut(turn.offset)
        return run

    async def chat(
        self, session_id: str, messages: Sequence[ChatMessage], turn: Turn, engine: Engine | None = None
    ) -> ChatTurn:
        """Add `messages` to the session's conversation, append the tokens the chat template's
        rendering adds (conversations.py), and return the assistant's turn ready to iterate.
        `turn` holds the reply's options; its offset is the session's length as the client knows it."""
        engine = engine or self._engine()
        conversations.check(messages, turn, vision=engine.vision is not None)
        await engine.checks.constraint(turn.sampling.structured_outputs)
        session = self._pool.get(session_id, turn.client)
        self._check_offset(session, turn.offset, truncating=None)
        appended = conversations.plan(engine.chat, engine.tokenizer, session.conversation, session.tokens, messages)
        start = appended.offset + len(appended.tokens)

        def finished() -> None:
            done = chat.run.done
            chat.reply = conversations.reply(
                engine.tokenizer, session.tokens[start:], done.finish_reason if done is not None else None
            )
            session.conversation = appended.conversation.replied(chat.reply, start, len(session.tokens))
            self._finished(session)

        run = self._commit(session, conversations.chat_turn(turn, appended), engine, [], finished)
        chat = ChatTurn(appended, run)
        session.conversation = appended.conversation
        return chat

    def _check_offset(self, session: _Session, offset: int, truncating: bool | None) -> None:
        """The client's view of the session's length (`truncating`: it may rewind; None: a chat
        turn, which never does) against the session's, and no turn running."""
        if session.run is not None:
            raise SessionBusy(f"session {session.id} is already generating; wait for its Done or cancel that call")
        length = len(session.tokens)
        if offset != length and not (truncating and offset < length):
            hint = "; set truncating to rewind to a shorter offset" if truncating is False else ""
            raise FailedPrecondition(
                f"offset {offset} does not match the session's length {length}{hint}", field="offset"
            )

    def _commit(
        self, session: _Session, turn: Turn, engine: Engine, facts: list[ImageFacts], on_end: Callable[[], None]
    ) -> TurnRun:
        """Check the rest of the turn, then apply its append (after its rewind) and make its run."""
        check_client(turn.client, turn.weight)
        length = len(session.tokens)
        if (block := session.block_around(turn.offset)) is not None:
            raise FailedPrecondition(_split_message("rewind", turn.offset, block))
        append = engine.checks.tokens("append_tokens", turn.append)
        tokens = session.tokens[: turn.offset].tolist() + append
        kept = [i for i in session.images if i.end <= turn.offset]
        images = kept
        if turn.images or engine.vision is not None:
            images = kept + place_images(Vision.of(engine.vision, engine.model_name), turn, tokens, facts)
        if len(images) > engine.settings.max_images:
            raise InvalidArgument(
                f"the session would hold {len(images)} images; this server takes at most {engine.settings.max_images}",
                field="images",
            )
        budget = turn.sampling.max_tokens
        if not isinstance(budget, int) or budget < 0:
            raise InvalidArgument(f"max_tokens must be a non-negative integer, got {budget!r}", field="max_tokens")
        if len(tokens) + budget > engine.max_model_len:
            raise ContextOverflow(
                f"the session's {len(tokens)} tokens plus max_tokens ({budget}) exceed the model's context of "
                f"{engine.max_model_len} tokens",
                field="max_tokens",
            )
        end = len(tokens) + budget
        logprob_ranges = _check_ranges("logprobs_ranges", turn.logprob_ranges, end)
        readout_ranges = _check_ranges("readout_ranges", turn.probes.readout_ranges, end)
        if budget and not tokens:
            raise InvalidArgument("the session is empty: append at least one token to generate from")
        steer = engine.preparation.resolve_steer(turn.probes.steer, len(tokens)).interventions
        probes = dataclasses.replace(turn.probes, readout_ranges=readout_ranges, steer=steer)
        growth = len(tokens) - length + budget
        self._pool.make_room(sessions=0, tokens=max(growth, 0), keep=session)
        if session.dp_rank is None:
            session.dp_rank = engine.inflight.pick_rank()

        work: Generation | None = None
        scoring: Callable[[], Awaitable[PromptScores]] | None = None
        # From the ranges, not by scanning positions: sessions run to 100K+ tokens.
        row_ranges = [tuple(r) for ask in (probes.residual, probes.features) if ask is not None for r in ask.ranges]
        prompt_ranges = [range(s, min(e, len(tokens))) for s, e in logprob_ranges + readout_ranges + row_ranges]
        prefill_wanted = sorted(set().union(*prompt_ranges))
        scored = any(max(s, 1) < min(e, len(tokens)) for s, e in logprob_ranges)  # position 0 has no logprob
        scored_from = min((max(s, 1) for s, _ in logprob_ranges), default=1)
        if budget:
            decode_logprobs = any(e > len(tokens) for _, e in logprob_ranges)
            options = turn.sampling
            if decode_logprobs:
                options = dataclasses.replace(options, logprobs=turn.logprob_top_k)
            work = engine.generate(
                tokens,
                options,
                probes=probes,
                request_id=turn.request_id,
                prompt_logprobs=turn.logprob_top_k if scored else None,
                logprobs_from=scored_from,
                images=images,
                dp_rank=session.dp_rank,
                client=turn.client,
                weight=turn.weight,
            )
        elif prefill_wanted:
            top_k = turn.logprob_top_k if scored else None
            engine.checks.top_k(top_k or 0)

            def scoring() -> Awaitable[PromptScores]:
                return engine.prefill(
                    tokens,
                    top_logprobs=top_k,
                    logprobs_from=scored_from,
                    probes=probes,
                    images=images,
                    request_id=turn.request_id,
                    dp_rank=session.dp_rank,
                    client=turn.client,
                    weight=turn.weight,
                )

        # Committed: the append is the client's content whatever happens to the turn.
        del session.tokens[turn.offset :]
        session.tokens.extend(append)
        session.images = images
        run = TurnRun(session.tokens, on_end, work, scoring, prefill_wanted, logprob_ranges)
        session.run = run
        self._pool.touch(session)
        return run

    async def _inspect(self, turn: Turn, engine: Engine) -> list[ImageFacts]:
        if not turn.images:
            return []
        vision = Vision.of(engine.vision, engine.model_name)
        return list(
            await asyncio.gather(
                *(asyncio.to_thread(vision.inspect, b.data, b.mime, f"images[{i}]") for i, b in enumerate(turn.images))
            )
        )

    def _finished(self, session: _Session) -> None:
        session.run = None
        if session in self._pool:
            self._pool.touch(session)


def _check_ranges(what: str, ranges: Sequence[Range], end: int) -> list[Range]:
    checked = []
    for i, (start, stop) in enumerate(ranges):
        if not 0 <= start < stop <= end:
            raise InvalidArgument(
                f"{what}[{i}] = [{start}, {stop}) must satisfy 0 <= start < end <= {end} "
                "(the session's length after the append, plus max_tokens)",
                field=f"{what}[{i}]",
            )
        checked.append((start, stop))
    return checked


def _split_message(what: str, position: int, block: PlacedImage) -> str:
    return f"cannot {what} at position {position}: it falls inside the image block [{block.start}, {block.end})"
