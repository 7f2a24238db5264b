"""Probes of the residual stream: concept sets, the taps vLLM compiles into the model's forward,
readouts (the worker's capture and the engine side's hub), and steering (interventions, their
checks, and the worker's coefficients).

Imports `core.models` only. Knows vLLM's worker and model, never the Engine. steering.py stays
importable without torch: clients parse interventions with it.
"""
