"""Every kernel launch goes through the driver's ``cuLaunchKernelEx`` (ctypes), the one call that
takes launch attributes: CuPy's ``RawKernel`` call passes none.

Programmatic dependent launch (PDL, sm_90+): with the attribute, a kernel may start while the
kernel before it in the stream is still running: its CTAs become resident and do the work that
reads nothing the earlier kernel writes (here: the chunk records), then wait in
``griddepcontrol.wait`` (``common.cuh``) until that kernel has completed. What it saves is the
launch gap between two kernels and the first dependent round trip. Inside a CUDA graph capture
the attribute becomes a programmatic edge.

Thread-block clusters: a cluster variant of the kernel declares its cluster size at compile time
(``__cluster_dims__``), so its launch sets no cluster attribute (the driver refuses both at
once) and cannot run in any other cluster size.

Both kernels take one argument, a ``DecodeParams`` (``kernel_abi``): a launch passes its address
and the driver copies its bytes into the kernel's parameter space. A plan builds its launches and
its ``DecodeParams`` once (``DecodeLaunch``); a run writes the tensors' pointers into the struct
and calls the driver, under a lock (two threads may run one wrapper, and ctypes releases the GIL),
in the plan's device context.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from .device_features import spreads_one_per_sm
from .kernel_abi import DecodeParams
from .params import LaunchGrid, RunArguments, write_run_arguments

# cuda.h: CUlaunchAttributeID
_CLUSTER_DIMENSION = 4                        # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6        # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttributeValue(ctypes.Union):
    """CUlaunchAttributeValue: a 64-byte union; the members used or documented here."""

    _fields_ = [("programmatic_stream_serialization_allowed", ctypes.c_int),
                ("cluster_dim", ctypes.c_uint * 3), ("pad", ctypes.c_char * 64)]


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, then the value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_DRIVER = None


def _driver():
    """The CUDA driver library, loaded once (it is already in the process when CuPy runs)."""
    global _DRIVER
    if _DRIVER is None:
        name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        lib = ctypes.CDLL(name)
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuGetErrorName.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for fn in (lib.cuCtxGetCurrent, lib.cuCtxSetCurrent):
            fn.restype = ctypes.c_int
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        _DRIVER = lib
    return _DRIVER


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if _driver().cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {code}"


def _check(code: int, call: str) -> None:
    if code != 0:
        raise RuntimeError(f"{call} failed: {_error_name(code)}")


def current_context() -> int:
    """The calling thread's current CUDA context (0 if none)."""
    ctx = ctypes.c_void_p()
    _check(_driver().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value or 0


class KernelLaunch:
    """One kernel's launch configuration: grid, block, dynamic shared memory and, with ``pdl``,
    the programmatic-stream-serialization attribute. ``kernel``: a ``cupy.RawKernel`` loaded
    in the current context; kept, so its module stays loaded."""

    def __init__(self, kernel, grid: int, block: int, shared_bytes: int, *, pdl: bool = False):
        self._kernel = kernel
        self._function = ctypes.c_void_p(kernel.kernel.ptr)
        self._config = _LaunchConfig()
        self._config.grid[:] = (int(grid), 1, 1)
        self._config.block[:] = (int(block), 1, 1)
        self._config.shared_bytes = int(shared_bytes)
        self.pdl = bool(pdl)
        if pdl:
            self._attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
            self._attr.value.programmatic_stream_serialization_allowed = 1
            self._config.attrs = ctypes.pointer(self._attr)
            self._config.num_attrs = 1

    @property
    def grid(self) -> int:
        return self._config.grid[0]

    @property
    def shared_bytes(self) -> int:
        return self._config.shared_bytes

    def __call__(self, args, stream_ptr: int) -> None:
        """Launch with ``args`` (a ``ctypes.c_void_p`` array: one pointer per kernel parameter)
        on the stream ``stream_ptr``. The caller holds the lock that guards ``args``."""
        self._config.stream = stream_ptr or None
        _check(_driver().cuLaunchKernelEx(ctypes.byref(self._config), self._function, args, None),
               "cuLaunchKernelEx")


class DecodeLaunch:
    """The launches of one plan: the partial kernel, then the merge kernel when the plan has a
    merge kernel, both with the plan's ``DecodeParams`` (``params``, filled but for the
    tensors). ``context``: the driver context the kernels were loaded in (``current_context()``
    at plan time)."""

    def __init__(self, params: DecodeParams, partial: KernelLaunch,
                 merge: KernelLaunch | None, context: int,
                 partial_plain: KernelLaunch | None = None):
        self.params = params
        self.partial, self.merge = partial, merge
        # the partial kernel without PDL, for a run right after a kernel that wrote the records
        # (the planning kernel): a PDL launch reads its record before it waits
        self.partial_plain = partial_plain or partial
        self._args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self._context = context
        self._lock = threading.Lock()

    @property
    def pdl(self) -> bool:
        return self.partial.pdl

    def __call__(self, args: RunArguments, stream_ptr: int, plain: bool = False) -> None:
        """Launch on ``stream_ptr`` with a run's ``args`` (``params.RunArguments``: the
        tensors' device pointers and strides, the fp8 scales and the sinks);
        ``plain``: the partial kernel without PDL."""
        with self._lock:
            write_run_arguments(self.params, args)
            previous = current_context()
            if previous != self._context:    # the driver launches in the current context
                _check(_driver().cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
            try:
                (self.partial_plain if plain else self.partial)(self._args, stream_ptr)
                if self.merge is not None:
                    self.merge(self._args, stream_ptr)
            finally:
                if previous != self._context:
                    _driver().cuCtxSetCurrent(previous or None)


def bind_decode_launch(kernels, params: DecodeParams, grid: LaunchGrid, *, num_kv_heads: int,
                       head_dim: int, pdl: bool, spread: bool | None) -> DecodeLaunch:
    """The launches of ``grid`` with ``kernels`` (a compiled variant) and its ``params``: the
    partial kernel (one CTA per SM under PDL when ``spread``, None: where the grid's rule says
    so; also without PDL for a device-planned grid) and, with ``grid.merge``, the merge kernel
    (one thread per (request, qo head, 4 dims); compact_merge: per split request's)."""
    ctas = grid.num_chunks * num_kv_heads * grid.per_kv_head
    shared = kernels.build.shared_bytes
    if spread is None:
        spread = spreads_one_per_sm(ctas, grid.cluster_size)
    if pdl and spread:
        shared = kernels.one_per_sm_shared_bytes
    threads = kernels.build.threads
    partial = KernelLaunch(kernels.partial, ctas, threads, shared, pdl=pdl)
    plain = None
    if pdl and grid.device_planned:
        plain = KernelLaunch(kernels.partial, ctas, threads, kernels.build.shared_bytes)
    merge = None
    if grid.merge:
        requests = params.num_split_requests or grid.batch_size
        slots = requests * grid.heads * (head_dim // 4)
        merge = KernelLaunch(kernels.merge, -(-slots // threads), threads, 0, pdl=pdl)
    return DecodeLaunch(params, partial, merge, current_context(), plain)
