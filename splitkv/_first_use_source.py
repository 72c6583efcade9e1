"""The one hook between the runtime and the measuring code above it: what measures a GPU that
has no profile, the first time a wrapper needs one (docs/design/first-use.md).

The first-use probes time decode plans through a wrapper, so they belong above the runtime
(``splitkv.measure.first_use_probes``); a wrapper needs them below, when its ``profile`` finds
none for its GPU. So the runtime never imports them: ``splitkv/__init__.py``, which runs before
any module of splitkv, installs a factory of them here, and a wrapper's ``profile`` passes
``first_use_source()`` to ``load_profile(first_use=...)``. Nothing here imports anything of
splitkv, so ``import splitkv`` stays light.
"""

from __future__ import annotations

from typing import Callable

_factory: Callable[[], object] | None = None


def install(factory: Callable[[], object] | None) -> None:
    """Make ``factory()`` (no arguments: the current device) what ``first_use_source`` gives;
    None: nothing (a wrapper then plans with the roofline prior where no profile is found)."""
    global _factory
    _factory = factory


def first_use_source():
    """A first-use source for the current device (``planner.first_use.resolve``'s ``source``),
    made by the installed factory; None where none is installed."""
    return None if _factory is None else _factory()
