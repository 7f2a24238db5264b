"""LMTP, the line protocol `lmql serve-model` speaks, over WebSocket and plain TCP (docs/lmtp.md).

Sans-IO codec and messages: codec.py (a line to a type and JSON and back), messages.py (one frozen
dataclass per client message) and fields.py (each message's field readers). One connection:
session.py sequences its streams and replies, streams.py runs GENERATE, SCORE and SESSION_GENERATE
on the core, replies.py answers the calls that are not streams, payloads.py translates both ways,
outbox.py batches what goes out; config.py holds what connections are held to, websocket.py and
tcp.py the two transports. client.py is a small client (`salience repl`, salience.repl, uses it).
The HTTP application serving the WebSocket beside the other frontends is salience.http_app.
"""
