"""Stored responses (`store`, `previous_response_id`) kept as Salience's sessions.

Theory of operation. A stored response is a session of the SessionStore every frontend shares:
it holds the tokens the model read and wrote (the prompt and the reply) and the conversation
they render, so it is bounded, expires and is evicted like any session (--session-ttl,
--max-sessions, --max-session-tokens, a client's `max_sessions` in the tokens file) and belongs
to the client that stored it. A response's id is its session's, prefixed `resp_`; to another
client, or once expired, evicted or deleted, an id is unknown, word for word (404).

The session is opened before the response runs, so a store past its bound is refused (429, with
Retry-After when a client's own limit is reached) before anything is generated; the response is
kept in it once it has ended, or the session closed if it failed.

A follow-up renders the earlier items and its own input with the chat template; the stored
session's tokens are that rendering's prefix, so vLLM's prefix cache serves them and only the new
tokens are computed (`usage.input_tokens_details.cached_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from salience.auth import Client
from salience.core.engine.chat_messages import ChatMessage
from salience.core.serving.conversations import Conversation, Mark
from salience.core.serving.sessions import SessionStore
from salience.errors import NotFound

__all__ = ["PREFIX", "ResponseStore", "Stored"]

PREFIX = "resp_"


@dataclass(frozen=True)
class Stored:
    """What GET answers (`body`), and the items a follow-up reads (`history`: input and output,
    without the instructions)."""

    body: dict
    history: tuple[ChatMessage, ...]


class ResponseStore:
    def __init__(self, sessions: SessionStore) -> None:
        self._sessions = sessions

    def reserve(self, client: Client) -> str:
        """A new response id of `client`, its session opened (ResourceExhausted past a bound)."""
        return PREFIX + self._sessions.open(client.share, client.limits.sessions)

    def keep(
        self,
        response_id: str,
        client: Client,
        rendered: Sequence[ChatMessage],
        tokens: Sequence[int],
        reply_start: int,
        stored: Stored,
    ) -> None:
        """The ended response: `rendered` the messages the prompt rendered (the reply last),
        `tokens` the prompt's and the reply's, the reply from `reply_start`."""
        conversation = Conversation(tuple(rendered), (Mark(len(rendered), reply_start, len(tokens)),))
        self._sessions.keep(_session(response_id), client.share, tokens, conversation, stored)

    def find(self, response_id: str, client: Client) -> Stored:
        """`client`'s stored response, or NotFound (unknown, expired, deleted, another's, running)."""
        try:
            stored = self._sessions.kept(_session(response_id), client.share)
        except NotFound:
            stored = None
        if not isinstance(stored, Stored):
            raise NotFound(f"no response {response_id!r}: it was deleted, expired, or never existed")
        return stored

    async def delete(self, response_id: str, client: Client) -> None:
        """Forget `client`'s stored response (NotFound as `find`)."""
        self.find(response_id, client)
        await self._sessions.close(_session(response_id), client.share)

    async def drop(self, response_id: str, client: Client) -> None:
        """Close a reserved response's session that will not be kept (its run failed)."""
        await self._sessions.close(_session(response_id), client.share)


def _session(response_id: str) -> str:
    return response_id.removeprefix(PREFIX) if response_id.startswith(PREFIX) else ""
