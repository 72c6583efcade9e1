"""Kernel launches with programmatic dependent launch (PDL, sm_90+), through the driver's
``cuLaunchKernelEx``: CuPy's ``RawKernel`` call cannot pass launch attributes.

With the attribute, a kernel may start while the kernel before it in the stream is still
running: its CTAs become resident and do the work that reads nothing the earlier kernel
writes (here: the chunk records), then wait in ``griddepcontrol.wait`` (``common.cuh``) until
that kernel has completed. What it saves is the launch gap between two kernels and the first
dependent round trip. Inside a CUDA graph capture the attribute becomes a programmatic edge.

The argument buffers are built once per plan (``PdlLaunch``); a run only writes the tensor
pointers into them and calls the driver, under a lock (two threads may run one wrapper), so it
adds no NumPy or CuPy work per launch. The caller makes the plan's device current.
"""

from __future__ import annotations

import ctypes
import sys
import threading

# cuda.h: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, then a 64-byte value union (its first int
    is ``programmaticStreamSerializationAllowed``)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int), ("value_pad", ctypes.c_char * 60)]


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
        _DRIVER = lib
    return _DRIVER


def _error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if _driver().cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {code}"


# Kernel parameter kinds, as the kernels declare them.
POINTER, INT64, INT32, FLOAT32 = "pointer", "int64", "int32", "float32"
_CTYPES = {POINTER: ctypes.c_uint64, INT64: ctypes.c_int64, INT32: ctypes.c_int32,
           FLOAT32: ctypes.c_float}


class PdlLaunch:
    """One kernel launch configuration with the PDL attribute and reusable argument slots.

    kernel: a ``cupy.RawKernel`` (loaded on the current device); kinds: the kind of each
    kernel parameter, in order (``POINTER``, ``INT64``, ``INT32``, ``FLOAT32``).
    """

    def __init__(self, kernel, grid, block, shared_bytes: int, kinds):
        self._kernel = kernel                  # keeps the module, hence the function, loaded
        self._function = ctypes.c_void_p(kernel.kernel.ptr)
        self._lock = threading.Lock()          # the slots are shared by every call
        self._slots = [_CTYPES[kind]() for kind in kinds]
        self._params = (ctypes.c_void_p * len(self._slots))(
            *[ctypes.addressof(slot) for slot in self._slots])
        self._attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._config = _LaunchConfig()
        for dims, field in ((grid, self._config.grid), (block, self._config.block)):
            dims = tuple(dims) + (1,) * (3 - len(dims))
            for i, d in enumerate(dims):
                field[i] = int(d)
        self._config.shared_bytes = int(shared_bytes)
        self._config.attrs = ctypes.pointer(self._attr)
        self._config.num_attrs = 1

    def __call__(self, args, stream_ptr: int) -> None:
        """Launch with ``args`` (one Python number per parameter) on the stream ``stream_ptr``."""
        if len(args) != len(self._slots):
            raise ValueError(f"args: expected {len(self._slots)} kernel arguments, got {len(args)}")
        with self._lock:       # ctypes releases the GIL during the call
            for slot, value in zip(self._slots, args):
                slot.value = value
            self._config.stream = stream_ptr or None
            code = _driver().cuLaunchKernelEx(ctypes.byref(self._config), self._function,
                                              self._params, None)
        if code != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed: {_error_name(code)}")
