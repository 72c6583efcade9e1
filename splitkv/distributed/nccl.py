"""One NCCL communicator per process (one GPU each), through CuPy's bindings.

    group = init_process_group()          # under `python3 -m splitkv.distributed.launch`
    group.all_gather(send, recv, stream)  # enqueued on the caller's stream, no host sync

CuPy's ``NcclCommunicator`` takes raw pointers, an element count per rank, an NCCL dtype code
and a raw stream handle; this module checks the arrays first so a mistake raises here instead
of corrupting memory or hanging in NCCL. Host waits (``wait``, ``gather_host``) poll with a
deadline, and an uncaught exception aborts the communicators before the process exits: a
plain exit would run ncclCommDestroy and free device memory, and either can block forever
behind a collective whose peer is gone.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from .rendezvous import RankInfo, publish_unique_id, wait_unique_id

NCCL_INSTALL_HINT = ("pip install 'nvidia-nccl-cu13>=2.27.7,<3' (cupy-cuda13x) or "
                     "'nvidia-nccl-cu12' (cupy-cuda12x)")
_LIVE_GROUPS: list["NcclGroup"] = []


def _nccl():
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        raise RuntimeError(f"CuPy's NCCL bindings are not usable (libnccl not found): {NCCL_INSTALL_HINT}")
    return nccl


def _nccl_dtype(dtype) -> int:
    nccl = _nccl()
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


class NcclGroup:
    """This process's place in the job and its communicator. ``rank``, ``world_size``,
    ``device_id`` (the CUDA device it drives)."""

    def __init__(self, comm, rank: int, world_size: int, device_id: int, timeout_s: float):
        self.comm, self.rank, self.world_size = comm, rank, world_size
        self.device_id, self.timeout_s = device_id, timeout_s

    def __repr__(self) -> str:
        return f"NcclGroup(rank={self.rank}, world_size={self.world_size}, device={self.device_id})"

    # ---------------------------------------------------------------- collectives
    def all_gather(self, send, recv, stream=None) -> None:
        """recv[r] = send of rank r. send: contiguous CuPy array; recv: contiguous, same dtype,
        ``world_size * send.size`` elements (any shape, e.g. [world_size, *send.shape]).
        Enqueued on ``stream`` (default: the current stream); capturable in a CUDA graph."""
        import cupy

        from ..runtime.arrays import as_cupy_stream

        for name, arr in (("send", send), ("recv", recv)):
            if not isinstance(arr, cupy.ndarray):
                raise TypeError(f"{name}: expected a CuPy array, got {type(arr).__name__}")
            if not arr.flags.c_contiguous:
                raise ValueError(f"{name}: expected a contiguous array")
            if arr.device.id != self.device_id:
                raise ValueError(f"{name}: is on device {arr.device.id}, the communicator on "
                                 f"{self.device_id}")
        if recv.dtype != send.dtype:
            raise TypeError(f"recv: expected dtype {send.dtype} (that of send), got {recv.dtype}")
        if recv.size != self.world_size * send.size:
            raise ValueError(f"recv: expected {self.world_size} x {send.size} = "
                             f"{self.world_size * send.size} elements, got {recv.size}")
        code = _nccl_dtype(send.dtype)
        s = as_cupy_stream(stream)
        self._live().allGather(send.data.ptr, recv.data.ptr, send.size, code, s.ptr)

    def gather_host(self, values, stream=None) -> np.ndarray:
        """All-gather a small host vector and wait: float64 [world_size, len(values)]. Every rank
        must call it (it is a collective)."""
        import cupy

        from ..runtime.arrays import as_cupy_stream

        flat = np.ascontiguousarray(values, dtype=np.float64).ravel()
        s = as_cupy_stream(stream)
        with s:
            send = cupy.asarray(flat)
            recv = cupy.empty(self.world_size * flat.size, dtype=np.float64)
        self.all_gather(send, recv, s)
        self.wait(s)
        return recv.get(stream=s).reshape(self.world_size, flat.size)

    def agree(self, ok: bool, stream=None) -> bool:
        """True on every rank if ``ok`` is true on every rank (a collective)."""
        return bool(self.gather_host([1.0 if ok else 0.0], stream).min() > 0)

    def wait(self, stream=None, timeout_s: float | None = None) -> None:
        """Wait on the host for ``stream``; raise ``TimeoutError`` (aborting the communicator, so
        its kernels stop) after ``timeout_s`` (default: the rendezvous timeout), or NCCL's own
        error if it reports one."""
        import cupy

        from ..runtime.arrays import as_cupy_stream

        timeout = self.timeout_s if timeout_s is None else timeout_s
        event = cupy.cuda.Event(disable_timing=True)
        event.record(as_cupy_stream(stream))
        deadline = time.monotonic() + timeout
        polls = 0
        while not event.done:
            polls += 1
            if polls % 100 == 0:
                self._live().check_async_error()
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(f"rank {self.rank}: the GPU work did not finish within {timeout:g} s "
                                   "(a peer rank is missing or stuck); communicator aborted")
            time.sleep(50e-6 if polls < 1000 else 1e-3)

    # ---------------------------------------------------------------- lifetime
    def _live(self):
        if self.comm is None:
            raise RuntimeError(f"rank {self.rank}: the communicator was closed or aborted")
        return self.comm

    def abort(self) -> None:
        """Abort the communicator: in-flight NCCL kernels return and nothing waits for peers."""
        self._release("abort")

    def close(self) -> None:
        """Destroy the communicator (after the work on it has finished)."""
        self._release("destroy")

    def _release(self, how: str) -> None:
        """End the communicator with its ``abort`` or ``destroy``, once; forget the group."""
        if self.comm is not None:
            getattr(self.comm, how)()
            self.comm = None
        if self in _LIVE_GROUPS:
            _LIVE_GROUPS.remove(self)


def init_process_group(name: str = "world", *, timeout_s: float | None = None,
                       abort_on_exception: bool = True) -> NcclGroup:
    """Join the job the launcher started: read RANK / WORLD_SIZE / LOCAL_RANK, make device
    LOCAL_RANK current, get the NCCL unique id from rank 0 through the rendezvous directory,
    and create the communicator (blocks until every rank has joined).

    ``name`` tells apart several communicators of one job. With ``abort_on_exception``, an
    uncaught exception prints its traceback, aborts every communicator and exits with status 1
    at once, so the launcher can stop the other ranks instead of this one hanging at exit.
    """
    import cupy

    info = RankInfo.from_env()
    timeout = info.timeout_s if timeout_s is None else float(timeout_s)
    nccl = _nccl()
    cupy.cuda.Device(info.local_rank).use()
    if info.rank == 0:
        unique_id = _id_bytes(nccl.get_unique_id())
        if info.world_size > 1:
            publish_unique_id(info.rendezvous_dir, unique_id, name)
    else:
        unique_id = wait_unique_id(info.rendezvous_dir, timeout, name)
    if abort_on_exception:
        _install_abort_hook()
    try:
        comm = nccl.NcclCommunicator(info.world_size, bytes(unique_id), info.rank)
    except TypeError:
        comm = nccl.NcclCommunicator(info.world_size, _legacy_comm_id(unique_id), info.rank)
    group = NcclGroup(comm, info.rank, info.world_size, info.local_rank, timeout)
    _LIVE_GROUPS.append(group)
    return group


def _install_abort_hook() -> None:
    if getattr(sys.excepthook, "_splitkv_abort", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        rank = os.environ.get("RANK", "0")
        print(f"[rank {rank}] uncaught {exc_type.__name__}: aborting NCCL and exiting", file=sys.stderr)
        for group in list(_LIVE_GROUPS):
            try:
                group.abort()
            except Exception:   # already broken; we are exiting anyway
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    hook._splitkv_abort = True
    sys.excepthook = hook
