"""vLLM behind a small typed interface: `Engine` (engine.py) takes token ids and `SamplingOptions`
(requests.py) and yields `TokenEvent`s and `ScoredToken`s, checking every request first (checks.py,
images.py, constraints.py) and letting it into vLLM when its client's turn comes on a contended engine
(fair_share.py). Also how vLLM is started (startup.py), in the order a start reads: settings.py
and settings_checks.py, environment.py, vllm_args.py (with tap_config.py, transport.py,
served_saes.py), launch.py, ray_cpu.py; the worker extension it loads (worker_extension.py, with
logprobs_worker.py); and, as a command ends, every process it started ended (children.py).
Chat: messages (chat_messages.py) rendered by the model's template (chat.py), and tool calls read
from a reply by vLLM's parsers (tool_parsers.py).

Imports `core.probes` and `core.models`. requests.py and constraints.py stay importable without
torch and vLLM: the clients' LMTP codec uses them.
"""
