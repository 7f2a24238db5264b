"""Inspect AI evals with readouts (`pip install salience[inspect]`, docs/inspect.md).

provider.py is the `salience/<model>` model provider (registered by registry.py, Inspect's entry
point), readings.py what a reply's `ModelOutput.metadata["salience"]` holds, scorers.py the
scorers and metric over it. A client: nothing here imports the server (salience.core, vLLM, torch).
"""

from salience.evals.readings import unpack_rows
from salience.evals.scorers import concept_means, concept_score, monitor_fired

__all__ = ["concept_means", "concept_score", "monitor_fired", "unpack_rows"]
