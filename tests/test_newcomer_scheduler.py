"""The newcomer step (core/engine/newcomer_scheduler.py) on vLLM's own scheduler, fed the
outputs a model would give (the engine-level effect, a newcomer's first token sooner under load,
is measured by tools/bench_fairness.py; test_fair_share.py runs the real engine through it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from salience.core.engine.newcomer_scheduler import EVERY, NEWCOMER, NewcomerScheduler, ReadoutNewcomerScheduler
from salience.core.engine.settings import EngineSettings
from salience.core.engine.start import vllm_args

BLOCKS = 256


@pytest.fixture(scope="module")
def scheduler_parts(tiny_model: Path):
    settings = EngineSettings(model=tiny_model, served_model_name="tiny", max_model_len=256)
    config = vllm_args.engine_args(settings, True, None, False).create_engine_config()
    config.cache_config.num_gpu_blocks = BLOCKS  # what the engine sets once it has sized the KV cache
    return config, config.cache_config.block_size


@pytest.fixture(params=[NewcomerScheduler, ReadoutNewcomerScheduler])
def scheduler(request: pytest.FixtureRequest, scheduler_parts) -> NewcomerScheduler:
    """As it runs without readouts, and with them carried on the steps' output."""
    config, block = scheduler_parts
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return request.param(config, kv, StructuredOutputManager(config), block_size=block)


def arriving(name: str, newcomer: bool = False) -> Request:
    params = SamplingParams(max_tokens=100, ignore_eos=True, extra_args={NEWCOMER: True} if newcomer else None)
    params.update_from_generation_config({}, eos_token_id=None)
    return Request(name, list(range(5, 13)), params, None, arrival_time=0.0)


def step(scheduler: NewcomerScheduler) -> set[str]:
    """One step: who was scheduled, each then given the token a model would sample."""
    output: SchedulerOutput = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7]] * len(ids)
    )
    scheduler.update_from_output(output, sampled)
    return set(ids)


def test_a_newcomers_prompt_runs_alone_then_everyone_goes_on(scheduler: NewcomerScheduler) -> None:
    for name in ("a1", "a2", "a3"):
        scheduler.add_request(arriving(name))
    assert step(scheduler) == {"a1", "a2", "a3"}
    scheduler.add_request(arriving("a4"))  # another of A's: waits with everyone else
    scheduler.add_request(arriving("b", newcomer=True))
    assert step(scheduler) == {"b"}, "the newcomer's prompt takes a step of its own"
    assert step(scheduler) == {"a1", "a2", "a3", "a4", "b"}, "the others lost one step, and nothing else"
    assert [r.request_id for r in scheduler.running] == ["a1", "a2", "a3", "b", "a4"]
    assert [len(r.output_token_ids) for r in scheduler.running] == [2, 2, 2, 2, 1]


def test_at_most_one_newcomers_step_in_every(scheduler: NewcomerScheduler) -> None:
    scheduler.add_request(arriving("a"))
    step(scheduler)
    scheduler.add_request(arriving("b", newcomer=True))
    scheduler.add_request(arriving("c", newcomer=True))
    assert step(scheduler) == {"b", "c"}, "the newcomers waiting then share their step"
    scheduler.add_request(arriving("d", newcomer=True))
    alone = []
    for _ in range(EVERY):
        scheduled = step(scheduler)
        alone.append(scheduled == {"d"})
        if "d" in scheduled:
            break
    assert not any(alone), "d came too soon after b and c: it shares a step with the others"
    for _ in range(EVERY):
        step(scheduler)
    scheduler.add_request(arriving("e", newcomer=True))
    assert step(scheduler) == {"e"}


def test_without_newcomers_or_without_others_nothing_changes(scheduler: NewcomerScheduler) -> None:
    scheduler.add_request(arriving("b", newcomer=True))  # an idle engine: its step is its own anyway
    assert step(scheduler) == {"b"}
    scheduler.add_request(arriving("a"))
    assert step(scheduler) == {"a", "b"}
