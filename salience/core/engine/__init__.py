"""vLLM behind a small typed interface: `Engine` (engine.py) takes token ids and `SamplingOptions`
(requests.py) and yields `TokenEvent`s and `ScoredToken`s, checking every request first (checks.py,
images.py, constraints.py) and letting it into vLLM when its client's turn comes on a contended engine
(fair_share.py), with the settings it starts and serves with (settings.py). Starting it and ending
its processes is start/'s, none of it on a request's path; what vLLM's processes run while serving
stays here: the worker extension vLLM loads (worker_extension.py, with logprobs_worker.py) and the
engine core's scheduler (newcomer_scheduler.py).
Chat: messages (chat_messages.py) rendered by the model's template (chat.py), and tool calls read
from a reply by vLLM's parsers (tool_parsers.py).

Imports `core.probes` and `core.models`. requests.py and constraints.py stay importable without
torch and vLLM: the clients' LMTP codec uses them.
"""
