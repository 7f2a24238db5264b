"""Inspect's entry point (`inspect_ai` in setup.cfg): registers the `salience/<model>` provider.

The provider module is imported only when a `salience/...` model is asked for.
"""

from inspect_ai.model import ModelAPI, modelapi


@modelapi(name="salience")
def salience() -> type[ModelAPI]:
    from salience.evals.provider import SalienceAPI

    return SalienceAPI
