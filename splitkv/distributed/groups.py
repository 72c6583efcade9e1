"""The caller's process group, behind the few calls context parallelism makes.

splitkv starts no processes and makes no communicator of its own: the ranks come from whatever
started the job (``torchrun``, an engine's workers) and the group from the caller. Two kinds:

- a ``torch.distributed`` ProcessGroup (or None: torch's default group). NCCL exchanges CuPy
  buffers viewed as torch tensors, ordered on the caller's stream; a group whose backend has
  no NCCL (gloo, say) exchanges host arrays, for ``ContextParallelDecode``'s CPU path.
- a CuPy communicator from ``cupyx.distributed.init_process_group``: NCCL on the caller's
  stream itself.

Every adapter has ``rank``, ``world_size``, ``device`` ("cuda" or "cpu") and:
``bind_all_gather(send, recv)`` (a function of the stream that all-gathers ``send`` into
``recv``, made once per buffer pair so a decode step pays no conversion), ``gather_host``
(a small host vector from every rank; a collective that waits), ``agree`` and ``wait``.
Timeouts are the group's: torch's ``timeout=`` (its NCCL watchdog or gloo's own deadline), or
``timeout_s`` for the host waits of a CuPy communicator, which then aborts it.
"""

from __future__ import annotations

import sys
import time

import numpy as np

DEFAULT_TIMEOUT_S = 300.0


class ExchangeGroup:
    """What ``ContextParallelDecode`` needs of a group (see the module docstring)."""

    rank: int
    world_size: int
    device: str

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device!r})")

    def bind_all_gather(self, send, recv):
        raise NotImplementedError

    def gather_host(self, values, stream=None) -> np.ndarray:
        raise NotImplementedError

    def wait(self, stream=None) -> None:
        raise NotImplementedError

    def agree(self, ok: bool, stream=None) -> bool:
        """True on every rank if ``ok`` is true on every rank (a collective)."""
        return bool(self.gather_host([1.0 if ok else 0.0], stream).min() > 0)

    def _failed(self, what: str, exc: BaseException) -> RuntimeError:
        return RuntimeError(f"rank {self.rank} of {self.world_size}: {what} failed ({exc}); a "
                            "peer rank failed, or did not join within the group's timeout")


def _check_pair(send, recv, world_size: int) -> None:
    for name, arr in (("send", send), ("recv", recv)):
        if not arr.flags.c_contiguous:
            raise ValueError(f"{name}: expected a contiguous array")
    if recv.dtype != send.dtype:
        raise TypeError(f"recv: expected dtype {send.dtype} (that of send), got {recv.dtype}")
    if recv.size != world_size * send.size:
        raise ValueError(f"recv: expected {world_size} x {send.size} = {world_size * send.size} "
                         f"elements, got {recv.size}")


class TorchGroup(ExchangeGroup):
    """A ``torch.distributed`` ProcessGroup. ``device`` "cuda" needs an NCCL backend; "cpu"
    any backend that gathers host tensors (gloo)."""

    def __init__(self, group, device: str | None = None):
        import torch.distributed as dist

        self.group = group
        self.rank, self.world_size = int(group.rank()), int(group.size())
        backend = str(dist.get_backend(group)).lower()
        has_nccl = "nccl" in backend
        if device is None:
            device = "cuda" if has_nccl else "cpu"
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device: expected 'cuda', 'cpu' or None, got {device!r}")
        if device == "cuda" and not has_nccl:
            raise ValueError(f"group: its backend is {backend!r}, which does not gather CUDA "
                             "buffers here; give an NCCL group, or device='cpu' for the CPU path")
        self.device, self.backend = device, backend
        # all_gather_single is the newer name (torch 2.13 warns on the older one)
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._streams: dict[tuple[int, int], object] = {}

    def _torch_stream(self, stream):
        """The caller's stream (anything ``as_cupy_stream`` takes) as a torch stream."""
        import torch

        from ..runtime.arrays import as_cupy_stream

        s = as_cupy_stream(stream)
        index = getattr(s, "device_id", None)
        # CuPy's null stream has device_id -1 (bound to no device): the current one
        device = torch.device("cuda", torch.cuda.current_device() if index is None or index < 0
                              else index)
        if s.ptr == 0:
            return torch.cuda.default_stream(device)
        key = (s.ptr, device.index)
        hit = self._streams.get(key)
        if hit is None:
            hit = self._streams[key] = torch.cuda.ExternalStream(s.ptr, device=device)
        return hit

    def _views(self, send, recv):
        import torch

        _check_pair(send, recv, self.world_size)
        if self.device == "cpu":
            return torch.from_numpy(recv).view(-1), torch.from_numpy(send).view(-1)
        device = torch.device("cuda", send.device.id)
        recv_t, send_t = (torch.as_tensor(a, device=device).view(-1) for a in (recv, send))
        if send.size and (send_t.data_ptr() != send.data.ptr or recv_t.data_ptr() != recv.data.ptr):
            raise RuntimeError("torch copied a CuPy buffer instead of viewing it")
        return recv_t, send_t

    def _run(self, recv_t, send_t, stream, what: str) -> None:
        import torch

        try:
            if self.device == "cpu":
                self._gather(recv_t, send_t, group=self.group)
            else:
                with torch.cuda.stream(self._torch_stream(stream)):
                    self._gather(recv_t, send_t, group=self.group)
        except RuntimeError as exc:      # torch's DistBackendError is one too
            raise self._failed(what, exc) from exc

    def bind_all_gather(self, send, recv):
        recv_t, send_t = self._views(send, recv)
        return lambda stream=None: self._run(recv_t, send_t, stream,
                                             "the all-gather of the attention states")

    def gather_host(self, values, stream=None) -> np.ndarray:
        flat = np.ascontiguousarray(values, dtype=np.float64).ravel()
        recv = np.empty(self.world_size * flat.size)
        if self.device == "cpu":
            self._run(*self._views(flat, recv), None, "a host gather")
            return recv.reshape(self.world_size, flat.size)
        from ..runtime.arrays import as_cupy_stream
        from ..runtime.cupy_arrays import empty, to_device, to_host

        s = as_cupy_stream(stream)
        with s:
            send_d, recv_d = to_device(flat), empty(recv.size, np.float64)
        self._run(*self._views(send_d, recv_d), s, "a host gather")
        s.synchronize()
        return to_host(recv_d).reshape(self.world_size, flat.size)

    def wait(self, stream=None) -> None:
        """Wait for ``stream`` (a stuck collective is ended by torch's NCCL watchdog after the
        group's timeout)."""
        if self.device == "cuda":
            from ..runtime.arrays import as_cupy_stream

            as_cupy_stream(stream).synchronize()


class CupyGroup(ExchangeGroup):
    """A ``cupyx.distributed`` NCCL communicator. Host waits poll with a deadline of
    ``timeout_s`` seconds and abort the communicator when it passes, so nothing waits forever
    for a peer that is gone."""

    device = "cuda"

    def __init__(self, comm, timeout_s: float | None = None):
        self.comm = comm
        self.rank = int(comm.rank)
        size = getattr(comm, "_n_devices", None)
        if size is None:
            size = comm._comm.size()
        self.world_size = int(size)
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0 seconds, got {timeout_s}")

    def bind_all_gather(self, send, recv):
        from ..runtime.arrays import as_cupy_stream

        _check_pair(send, recv, self.world_size)
        if recv.device.id != send.device.id:
            raise ValueError(f"recv: is on device {recv.device.id}, send on {send.device.id}")
        count = send.size

        def all_gather(stream=None):
            self.comm.all_gather(send, recv, count, stream=as_cupy_stream(stream))

        return all_gather

    def gather_host(self, values, stream=None) -> np.ndarray:
        from ..runtime.arrays import as_cupy_stream
        from ..runtime.cupy_arrays import empty, to_device, to_host

        flat = np.ascontiguousarray(values, dtype=np.float64).ravel()
        s = as_cupy_stream(stream)
        with s:
            send, recv = to_device(flat), empty(self.world_size * flat.size, np.float64)
        self.bind_all_gather(send, recv)(s)
        self.wait(s)
        return to_host(recv).reshape(self.world_size, flat.size)

    def wait(self, stream=None, timeout_s: float | None = None) -> None:
        """Wait on the host for ``stream``; after ``timeout_s`` (default the group's) abort the
        communicator, so its kernels return, and raise ``TimeoutError``."""
        from ..runtime.collectives import record_event

        timeout = self.timeout_s if timeout_s is None else timeout_s
        event = record_event(stream)
        deadline = time.monotonic() + timeout
        polls = 0
        while not event.done:
            polls += 1
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(f"rank {self.rank} of {self.world_size}: the GPU work did not "
                                   f"finish within {timeout:g} s (a peer rank is missing or "
                                   "stuck); communicator aborted")
            time.sleep(50e-6 if polls < 1000 else 1e-3)

    def abort(self) -> None:
        """Abort the NCCL communicator: in-flight collectives return, nothing waits for peers."""
        inner = getattr(self.comm, "_comm", None)
        if inner is not None:
            inner.abort()


def as_group(group, *, device: str | None = None, timeout_s: float | None = None) -> ExchangeGroup:
    """The adapter for the caller's ``group``: a torch ProcessGroup, None (torch's default
    group), a cupyx.distributed communicator, or an ``ExchangeGroup`` (returned as it is)."""
    if isinstance(group, ExchangeGroup):
        return group
    module = type(group).__module__
    if group is None or module.startswith("torch"):
        dist = _torch_distributed(group)
        if group is None:
            if not dist.is_initialized():
                raise ValueError("group: None means torch.distributed's default group, which is "
                                 "not initialized; call torch.distributed.init_process_group() "
                                 "(under torchrun) or pass a group")
            group = dist.group.WORLD
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected a torch.distributed ProcessGroup, got {module}."
                            f"{type(group).__name__}")
        return TorchGroup(group, device)
    if module.startswith("cupyx.distributed"):
        if device not in (None, "cuda"):
            raise ValueError(f"device: a CuPy communicator exchanges CUDA buffers; got {device!r}")
        return CupyGroup(group, timeout_s)
    raise TypeError("group: expected a torch.distributed ProcessGroup, None (torch's default "
                    "group) or a communicator from cupyx.distributed.init_process_group, got "
                    f"{module}.{type(group).__name__}")


def _torch_distributed(group):
    if group is None and "torch" not in sys.modules:
        raise ValueError("group: None means torch.distributed's default group, and torch is not "
                         "imported; pass the group (a torch ProcessGroup or a CuPy communicator)")
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("group: this torch has no torch.distributed")
    return dist
