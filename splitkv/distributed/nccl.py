"""One NCCL communicator per process (one GPU each), through CuPy's bindings
(``splitkv.runtime.collectives``).

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

from ..runtime.arrays import as_cupy_stream
from ..runtime.collectives import NCCL_INSTALL_HINT  # noqa: F401  (importable from here, as before)
from ..runtime.collectives import (nccl_bindings, nccl_dtype, new_communicator, new_unique_id,
                                   record_event, use_device)
from ..runtime.cupy_arrays import check_cupy_array, empty, to_device
from .rendezvous import RankInfo, publish_unique_id, wait_unique_id

_LIVE_GROUPS: list["NcclGroup"] = []


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
        for name, arr in (("send", send), ("recv", recv)):
            check_cupy_array(name, arr)
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
        code = nccl_dtype(send.dtype)
        s = as_cupy_stream(stream)
        self._live().allGather(send.data.ptr, recv.data.ptr, send.size, code, s.ptr)

    def gather_host(self, values, stream=None) -> np.ndarray:
        """All-gather a small host vector and wait: float64 [world_size, len(values)]. Every rank
        must call it (it is a collective)."""
        flat = np.ascontiguousarray(values, dtype=np.float64).ravel()
        s = as_cupy_stream(stream)
        with s:
            send = to_device(flat)
            recv = empty(self.world_size * flat.size, np.float64)
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
        timeout = self.timeout_s if timeout_s is None else timeout_s
        event = record_event(stream)
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
    info = RankInfo.from_env()
    timeout = info.timeout_s if timeout_s is None else float(timeout_s)
    nccl_bindings()                      # no libnccl: say so before touching the device
    use_device(info.local_rank)
    if info.rank == 0:
        unique_id = new_unique_id()
        if info.world_size > 1:
            publish_unique_id(info.rendezvous_dir, unique_id, name)
    else:
        unique_id = wait_unique_id(info.rendezvous_dir, timeout, name)
    if abort_on_exception:
        _install_abort_hook()
    comm = new_communicator(info.world_size, unique_id, info.rank)
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
