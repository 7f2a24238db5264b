"""Starting an engine and ending its processes; nothing here is on a request's path.

`Engine.start` (startup.py) reads them in this order: settings_checks.py (with model_config.py),
environment.py, vllm_args.py (with tap_config.py, transport.py, served_saes.py, and ray_cpu.py for
Ray on CPU), launch.py (vLLM's processes forked from fork_server.py, which imported vLLM once and
ran sampler_warm_up.py, unless they are spawned); then each worker watches the server and ends its
engine once the server is gone (orphans.py), the engine's live.py sets the taps up from the same
tap_config.py and transport.py, and the served SAEs are named (served_saes.py). As a command ends,
every process it started is ended (children.py).

startup.py imports the serving modules it sets up (fair_share.py, images.py, live.py) but takes
the Engine class as a parameter: engine.py imports startup.py, not the other way round.
"""
