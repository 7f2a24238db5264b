"""The model families Salience serves, one module each: a new family joins by adding a module
that defines FAMILY (family.py says what it holds).

`family_of` answers for a config.json's architectures; readouts or steering on an architecture no
module names are refused, in one line naming what is read, before vLLM starts.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from salience.core.models.families.family import Family
from salience.errors import ModelError

__all__ = ["Family", "families", "family_of"]


@cache
def families() -> dict[str, Family]:
    """Every architecture name of every family module, to its family."""
    found: dict[str, Family] = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name == "family":
            continue
        family: Family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
        for architecture in family.architectures:
            if architecture in found:
                raise RuntimeError(f"{architecture} is claimed by {found[architecture].name} and {family.name}")
            found[architecture] = family
    return found


def family_of(architectures: list[str] | tuple[str, ...]) -> Family:
    """The family of a model whose config.json names `architectures` (the first one known)."""
    known = families()
    for architecture in architectures:
        if architecture in known:
            return known[architecture]
    raise ModelError(
        f"architecture {', '.join(map(str, architectures)) or '(none)'} is not one Salience can read; "
        f"it reads {', '.join(sorted(known))} (--no-readouts serves any model vLLM does, without readouts)"
    )
