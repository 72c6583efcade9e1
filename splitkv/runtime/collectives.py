"""CuPy's NCCL bindings, behind the few calls a rank's process group makes: an NCCL unique id, a
communicator, the NCCL code of a dtype, plus the two device calls around them (making the
rank's GPU current, an event to poll). The group itself, with its argument checks, deadlines
and rendezvous, is ``splitkv.distributed.nccl``."""

from __future__ import annotations

import numpy as np

from .arrays import as_cupy_stream

NCCL_INSTALL_HINT = ("pip install 'nvidia-nccl-cu13>=2.27.7,<3' (cupy-cuda13x) or "
                     "'nvidia-nccl-cu12' (cupy-cuda12x)")


def nccl_bindings():
    """``cupy.cuda.nccl``, or RuntimeError (with the install hint) if libnccl is missing."""
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        raise RuntimeError(f"CuPy's NCCL bindings are not usable (libnccl not found): {NCCL_INSTALL_HINT}")
    return nccl


def nccl_dtype(dtype) -> int:
    """The NCCL dtype code an array of ``dtype`` is sent as."""
    nccl = nccl_bindings()
    codes = {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64, "int32": nccl.NCCL_INT32,
             "int64": nccl.NCCL_INT64, "uint8": nccl.NCCL_UINT8, "float16": nccl.NCCL_FLOAT16,
             "uint16": nccl.NCCL_FLOAT16}     # 16-bit payloads are copied, never reduced
    code = codes.get(np.dtype(dtype).name)
    if code is None:
        raise TypeError(f"dtype {dtype} cannot be sent through NCCL here; expected one of {sorted(codes)}")
    return code


def _legacy_comm_id(unique_id: bytes):
    """CuPy 14 takes the id as bytes; older CuPy took a tuple of 128 signed chars."""
    return tuple(b - 256 if b > 127 else b for b in unique_id)


def _id_bytes(raw) -> bytes:
    return bytes(raw) if isinstance(raw, (bytes, bytearray)) else bytes(b & 0xFF for b in raw)


def new_unique_id() -> bytes:
    """A fresh NCCL unique id (rank 0 makes it and hands it to the others), as bytes."""
    return _id_bytes(nccl_bindings().get_unique_id())


def new_communicator(world_size: int, unique_id: bytes, rank: int):
    """CuPy's ``NcclCommunicator`` for this rank; blocks until every rank has joined."""
    nccl = nccl_bindings()
    try:
        return nccl.NcclCommunicator(world_size, bytes(unique_id), rank)
    except TypeError:
        return nccl.NcclCommunicator(world_size, _legacy_comm_id(unique_id), rank)


def use_device(device_id: int) -> None:
    """Make CUDA device ``device_id`` current in this process."""
    import cupy

    cupy.cuda.Device(device_id).use()


def record_event(stream=None):
    """An event (without timing) recorded on ``stream`` (anything ``as_cupy_stream`` takes),
    for the host to poll with ``.done``."""
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record(as_cupy_stream(stream))
    return event
