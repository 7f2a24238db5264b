"""gRPC session workflows through the thick client, and the status codes their faults must get."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from collections.abc import Awaitable

import grpc

from salience.grpc_frontend.client import AsyncSalienceClient, AsyncSession, GenerateResult
from salience.proto.salience.v1 import salience_pb2 as pb
from tools.soak.state import Soak


async def rpc_error(soak: Soak, call: Awaitable) -> grpc.aio.AioRpcError | str:
    """The error a call ended with, or why there was none."""
    try:
        await asyncio.wait_for(call, soak.timeout)
    except grpc.aio.AioRpcError as error:
        return error
    except TimeoutError:
        return "unanswered"
    return "succeeded"


def judge_status(soak: Soak, kind: str, error: grpc.aio.AioRpcError | str, code: grpc.StatusCode, expect: str) -> None:
    if isinstance(error, str):
        if error == "unanswered":
            soak.tally.fault(kind, "unanswered", f"no answer within {soak.timeout:.0f} s")
        else:
            soak.tally.fault(kind, "wrong", f"the call succeeded, expected {code.name}")
    elif error.code() == code and expect in (error.details() or ""):
        soak.tally.fault(kind, "specific")
    else:
        soak.tally.fault(kind, "wrong", f"{error.code().name} {error.details()!r}, expected {code.name} {expect!r}")


async def expect_status(soak: Soak, kind: str, call: Awaitable, code: grpc.StatusCode, expect: str) -> None:
    judge_status(soak, kind, await rpc_error(soak, call), code, expect)


def check_turn(result: GenerateResult, before: int, appended: int, max_tokens: int, width: int) -> str | None:
    done = result.done
    if done is None:
        return "no GenerateDone"
    if done.prompt_tokens != before + appended:
        return f"prompt_tokens {done.prompt_tokens}, expected {before + appended}"
    if done.completion_tokens != len(result.tokens):
        return f"completion_tokens {done.completion_tokens} but {len(result.tokens)} tokens streamed"
    reason = pb.GenerateDone.FinishReason.Name(done.finish_reason)
    if not (
        (reason == "FINISH_REASON_LENGTH" and len(result.tokens) == max_tokens)
        or (reason == "FINISH_REASON_EOS" and len(result.tokens) <= max_tokens)
    ):
        return f"{reason} after {len(result.tokens)} of {max_tokens} tokens"
    positions = [t.position for t in result.tokens]
    if positions != list(range(before + appended, before + appended + len(positions))):
        return f"decoded positions {positions[:4]}..., expected from {before + appended}"
    if width and any(len(t.readout) != width for t in result.tokens):
        return f"a decoded token without a {width}-float readout"
    return None


class SessionWorkflow:
    """Open, several turns with offset checks (and faults between), Fork, Dump, Close: one run."""

    kind = "grpc/session"

    def __init__(self, soak: Soak, client: AsyncSalienceClient, rng: random.Random) -> None:
        self.soak, self.client, self.rng = soak, client, rng
        self.tokens = 0  # decoded, over every turn

    async def turn(self, session: AsyncSession, expected: list[int], max_tokens: int) -> str | None:
        """One Generate; `expected` (the session's tokens as this side knows them) grows by it,
        and the offset the client tracks must come out equal to its length."""
        append = self.soak.model.prompt(self.rng, 2, 24)
        before = len(expected)
        width = self.soak.model.readout_width if self.rng.random() < 0.3 else 0
        params: dict = {"max_tokens": max_tokens, "readout_ranges": [(before + len(append), None)] if width else ()}
        params |= {"top_k": 1} if self.rng.random() < 0.5 else {"temperature": 0.9}
        result = await asyncio.wait_for(session.generate(append, **params), self.soak.timeout)
        expected += append + result.token_ids
        self.tokens += len(result.tokens)
        return check_turn(result, before, len(append), max_tokens, width) or (
            None
            if session.length == len(expected)
            else f"the client's offset is {session.length} after the turn, the session has {len(expected)} tokens"
        )

    async def busy(self, session: AsyncSession, expected: list[int]) -> str | None:
        """A second Generate while a long turn runs: ABORTED. The long turn is then cancelled by
        leaving its stream; the session keeps what was decoded, which DumpSession must show.
        Under load the long turn can run to its end before the cancel (or even the intruder)
        reaches the server, so the answer is judged once DumpSession tells what happened: a
        turn cut short was running when the intruder came (ABORTED); one that ran to its end
        may have ended before it (then the offset is what is wrong) or after (ABORTED)."""
        append = self.soak.model.prompt(self.rng, 2, 8)
        room = self.soak.model.max_model_len - len(expected) - len(append) - 128  # later turns need some
        if room < 64:
            return None
        max_tokens = min(room, 512)
        received: list[int] = []
        error: grpc.aio.AioRpcError | str = "unanswered"
        stream = session.stream(append, max_tokens=max_tokens, top_k=1)
        async with contextlib.aclosing(stream) as events:
            async for event in events:
                if event.HasField("done"):
                    return f"a {max_tokens}-token turn ended before the intruder got its answer"
                if not event.token.is_prefill:
                    received.append(event.token.id)
                    intruder = AsyncSession(self.client, session.id, session.length)
                    error = await rpc_error(self.soak, intruder.generate([1], max_tokens=1, top_k=1))
                    break
        if not received:
            return "the long turn's stream ended without a decoded token"
        self.tokens += len(received)
        dumped = await asyncio.wait_for(session.dump(), self.soak.timeout)
        sent = expected + append + received
        if dumped[: len(sent)] != sent:
            return f"after a cancelled turn DumpSession does not start with the {len(sent)} tokens sent and received"
        ran_out = len(dumped) >= len(expected) + len(append) + max_tokens
        if ran_out and not (isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.ABORTED):
            # It may have ended before the intruder came, and the offset is then what is wrong.
            judge_status(self.soak, "grpc-offset-drift", error, grpc.StatusCode.FAILED_PRECONDITION, "does not match")
        else:  # cut short by the cancel, it ran while the intruder came; or the intruder was told so
            judge_status(self.soak, "grpc-session-busy", error, grpc.StatusCode.ABORTED, "already generating")
        expected[:] = dumped
        return None

    async def run(self) -> None:
        soak, rng = self.soak, self.rng
        soak.tally.start(self.kind)
        session = await asyncio.wait_for(self.client.open_session(soak.model.name), soak.timeout)
        expected: list[int] = []
        try:
            why = None
            for _ in range(rng.randint(2, 4)):
                why = why or await self.turn(session, expected, soak.tokens)
                if rng.random() < 0.3:  # an offset the server does not have: nothing changes
                    drift = session.generate([7], truncate_to=session.length + rng.randint(1, 5), max_tokens=1)
                    await expect_status(
                        soak, "grpc-offset-drift", drift, grpc.StatusCode.FAILED_PRECONDITION, "does not match"
                    )
            if rng.random() < 0.3:
                why = why or await self.busy(session, expected)
            dumped = await asyncio.wait_for(session.dump(), soak.timeout)
            why = why or (
                None if dumped == expected else f"DumpSession has {len(dumped)} tokens, expected {len(expected)}"
            )
            why = why or await self.fork(session, expected)
        finally:
            await asyncio.wait_for(session.close(), soak.timeout)
        await expect_status(soak, "grpc-closed-session", session.dump(), grpc.StatusCode.NOT_FOUND, "no session")
        if why is None:
            soak.tally.complete(self.kind, self.tokens)
        else:
            soak.tally.lose(self.kind, why, self.tokens)

    async def fork(self, session: AsyncSession, expected: list[int]) -> str | None:
        at = self.rng.randint(1, len(expected))
        branch = await asyncio.wait_for(session.fork(at), self.soak.timeout)
        try:
            dumped = await asyncio.wait_for(branch.dump(), self.soak.timeout)
            if dumped != expected[:at]:
                return f"the fork at {at} holds {len(dumped)} tokens, expected the first {at}"
            return await self.turn(branch, expected[:at], self.soak.tokens)
        finally:
            await asyncio.wait_for(branch.close(), self.soak.timeout)


async def grpc_worker(soak: Soak, rng: random.Random) -> None:
    async with AsyncSalienceClient(soak.server.grpc, token=soak.options.auth_token, tls=soak.server.tls) as client:
        while soak.running():
            try:
                await SessionWorkflow(soak, client, rng).run()
            except (grpc.aio.AioRpcError, TimeoutError) as error:
                soak.tally.lose("grpc/session", describe(error))
                if isinstance(error, grpc.aio.AioRpcError):
                    soak.tally.unexpected[f"gRPC {error.code().name}: {error.details()}"[:70]] += 1
            if rng.random() < 0.5:
                stranger = AsyncSession(client, "soak-" + secrets.token_urlsafe(8))
                await expect_status(
                    soak, "grpc-unknown-session", stranger.dump(), grpc.StatusCode.NOT_FOUND, "no session"
                )


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
