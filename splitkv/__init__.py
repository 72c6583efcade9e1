"""splitkv: decode attention over a paged KV cache, split adaptively across the GPU.

Host-side pieces (problem description, plans, the planner, the float64 reference, the CPU plan
executor and ``merge_states``) import without a GPU or CuPy. The planner and the GPU wrapper are
imported lazily, on first use of their names.

Notices to operators (a profile skipped, a GPU probed on first use, planning with the roofline
prior) are records of the ``splitkv`` logger (``splitkv._log``); it has a ``NullHandler``, so
nothing prints until the application configures logging.
"""

import logging as _logging

from . import _first_use_source
from ._version import __version__
from .core.cpu_executor import execute_plan_cpu
from .core.merge import merge_states, merge_states_n
from .core.plan import Plan, plan_chunk_tokens, plan_fixed_splits, plan_from_chunk_counts
from .core.problem import DecodeProblem, PageTable
from .core.reference import reference_decode

_logging.getLogger("splitkv").addHandler(_logging.NullHandler())


def _device_probes():
    """The current GPU's first-use probes, for a wrapper whose GPU has no profile: measuring is
    ``splitkv.measure``'s, above the runtime, so it is installed here (this module runs before
    any other of splitkv) and imported only when a wrapper asks (``_first_use_source``)."""
    from .measure.first_use_probes import DeviceProbes

    return DeviceProbes()


_first_use_source.install(_device_probes)

__all__ = [
    "BatchDecodeWrapper", "DecodeProblem", "GPUUnavailableError", "GraphStableDecodeWrapper",
    "PageTable", "Plan",
    "ProfileError", "choose_plan", "execute_plan_cpu", "load_profile", "merge_states",
    "merge_states_n", "plan_chunk_tokens", "plan_fixed_splits", "plan_from_chunk_counts",
    "rank_candidates", "reference_decode", "workspace_size", "__version__",
]

# Names imported on first use: the planner (it reads profiles with PyYAML) and the GPU runtime.
_LAZY = {"BatchDecodeWrapper": "runtime.wrapper", "GPUUnavailableError": "runtime",
         "GraphStableDecodeWrapper": "runtime.graph_stable",
         "ProfileError": "planner", "choose_plan": "planner", "load_profile": "planner",
         "rank_candidates": "planner", "workspace_size": "runtime.workspace"}


def __getattr__(name):
    if name in _LAZY:
        from importlib import import_module
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'splitkv' has no attribute {name!r}")
