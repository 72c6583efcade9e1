"""splitkv: decode attention over a paged KV cache, split adaptively across the GPU.

Host-side pieces (problem description, plans, the float64 reference, the CPU plan executor and
``merge_states``) import without a GPU or CuPy. The GPU wrapper is imported lazily from
``splitkv.runtime``.
"""

from ._version import __version__
from .core.cpu_executor import execute_plan_cpu
from .core.merge import merge_states, merge_states_n
from .core.plan import Plan, plan_chunk_tokens, plan_fixed_splits, plan_from_chunk_counts
from .core.problem import DecodeProblem, PageTable
from .core.reference import reference_decode

__all__ = [
    "BatchDecodeWrapper", "DecodeProblem", "GPUUnavailableError", "PageTable", "Plan",
    "execute_plan_cpu", "merge_states", "merge_states_n", "plan_chunk_tokens",
    "plan_fixed_splits", "plan_from_chunk_counts", "reference_decode", "__version__",
]


def __getattr__(name):
    if name == "BatchDecodeWrapper":
        from .runtime.wrapper import BatchDecodeWrapper
        return BatchDecodeWrapper
    if name == "GPUUnavailableError":
        from .runtime import GPUUnavailableError
        return GPUUnavailableError
    raise AttributeError(f"module 'splitkv' has no attribute {name!r}")
