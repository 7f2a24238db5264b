"""What frontends drive on top of an engine: the server's lifecycle and stream admission
(status.py), sessions and their turns (sessions.py, turns.py, session_images.py; whose a session
is, its expiry and the limits: session_pool.py), a session's chat (conversations.py), and jobs
that run texts through an engine (concept_builder.py; the default set shipped or built:
default_concepts.py). Reports what it counts through observers.py, never to a metrics library.

Imports `core.engine`, `core.probes` and `core.models`.
"""
