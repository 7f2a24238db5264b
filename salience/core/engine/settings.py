"""Engine settings, with defaults that suit the machine the server runs on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from salience.core.probes.concepts import ConceptSet

if TYPE_CHECKING:
    from salience.core.engine.chat import ChatTemplate
    from salience.core.features.sae import SparseAutoencoder
    from salience.core.models.points import Point

__all__ = ["EngineSettings"]


@dataclass(kw_only=True)
class EngineSettings:
    """What the CLI exposes of vLLM, plus `engine_args` for anything else.

    On CPU the defaults are float32 (exact against a float32 reference; bf16
    matmuls are slow on AVX2) and an in-process worker (1.4x the throughput of
    vLLM's three-process layout on two cores, measured in engine-baseline.md).
    """

    model: Path
    served_model_name: str
    chat_template: ChatTemplate | None = None  # --chat-template, in place of the model's own (chat.py)
    tool_call_parser: str | None = None  # --tool-call-parser: vLLM's parser of calls (None: the template's)
    max_model_len: int | None = None
    dtype: str | None = None  # None: float32 on CPU, the model's own on GPU
    kv_cache_gib: float = 2.0  # CPU only: KV cache size
    gpu_memory_utilization: float = 0.9  # GPU only
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages, each holding a contiguous range of decoder layers
    data_parallel_size: int = 1  # engine replicas behind this one server; each session stays on one
    distributed_executor_backend: str | None = None  # "mp" or "ray"; None: vLLM's choice (mp on one node)
    ray_address: str | None = None  # an existing Ray cluster ("auto", "host:port"); None: Ray's default
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    compile: bool = False  # vLLM's compiled graph, readout taps included: faster decode, slower first start
    multiprocess: bool | None = None  # None: in-process worker on CPU, vLLM's default on GPU
    # vLLM's processes forked from a fork server that imported vLLM once (start/fork_server.py): for a
    # process starting many engines, or `salience serve` once it started one early.
    fork_server: bool = False
    seed: int = 0
    max_images: int = 16  # vision-language models: images one request (a session) may carry
    concepts: ConceptSet | None = None  # readouts on (taps in the model's forward) when set
    steering_set: ConceptSet | None = None  # more directions to steer along (--steering FILE)
    steering: bool = True  # steering along the concept set's and steering set's vectors
    spare_concepts: int = 16  # readout and steering columns for live concepts (needs a concept set)
    steer_vectors: int = 16  # steering columns for requests' own vectors, distinct ones running at once
    saes: tuple[SparseAutoencoder, ...] = ()  # sparse autoencoders the taps encode with (needs a concept set)
    patch_points: tuple[Point, ...] = ()  # points patched at every layer (--patch-points; probes/patching.py)
    max_residual_rows: int = 16384  # residual rows (positions x layers) one request may ask for
    residual_memory_mib: int = 512  # residual rows all requests may hold at once (row_budget.py)
    sae_top: int = 32  # features per token the graph keeps of each SAE: the most a request may ask for
    # Admission in front of vLLM giving each active client its weighted share (fair_share.py), and the
    # requests running per replica before it holds any back (None: 3/4 of vLLM's max_num_seqs).
    fair_share: bool = True
    max_running: int | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
