"""How the processes of one job find each other: environment variables set by the launcher,
and the NCCL unique id passed from rank 0 to the others through a file. Pure Python.

Rank 0 creates the unique id (``ncclGetUniqueId`` also starts the bootstrap listener in that
process, so no one else can make it), writes it to a temporary name and renames it into place,
so a reader never sees half a file. The other ranks poll for the file until a deadline.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
ENV_DIR = "SPLITKV_RENDEZVOUS_DIR"
ENV_TIMEOUT = "SPLITKV_RENDEZVOUS_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
UNIQUE_ID_BYTES = 128


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in the job (from the launcher's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    rendezvous_dir: str | None
    timeout_s: float

    @classmethod
    def from_env(cls, environ=None) -> "RankInfo":
        """Read RANK, WORLD_SIZE, LOCAL_RANK (default RANK), SPLITKV_RENDEZVOUS_DIR and
        SPLITKV_RENDEZVOUS_TIMEOUT. Without RANK/WORLD_SIZE: a job of one process."""
        env = os.environ if environ is None else environ

        def read_int(name, default):
            raw = env.get(name)
            if raw is None:
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}: expected an integer, got {raw!r}") from None

        rank, world = read_int(ENV_RANK, 0), read_int(ENV_WORLD_SIZE, 1)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"{ENV_RANK}={rank}, {ENV_WORLD_SIZE}={world}: expected 0 <= rank < world_size")
        timeout = float(env.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
        directory = env.get(ENV_DIR)
        if world > 1 and not directory:
            raise ValueError(f"{ENV_DIR} is not set; start the job with "
                             "`python3 -m splitkv.distributed.launch --nproc N script.py`")
        return cls(rank, world, read_int(ENV_LOCAL_RANK, rank), directory, timeout)


def unique_id_path(directory, name: str = "world") -> Path:
    return Path(directory) / f"nccl-unique-id-{name}"


def publish_unique_id(directory, unique_id: bytes, name: str = "world") -> Path:
    """Rank 0: write the id atomically (temporary file, then rename)."""
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"unique_id: expected {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    path = unique_id_path(directory, name)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(bytes(unique_id).hex())
    os.replace(tmp, path)
    return path


def wait_unique_id(directory, timeout_s: float, name: str = "world", poll_s: float = 0.02) -> bytes:
    """Other ranks: poll for rank 0's id; ``TimeoutError`` after ``timeout_s`` seconds."""
    path = unique_id_path(directory, name)
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists():
            data = bytes.fromhex(path.read_text())
            if len(data) != UNIQUE_ID_BYTES:
                raise ValueError(f"{path}: expected {UNIQUE_ID_BYTES} bytes, got {len(data)}")
            return data
        if time.monotonic() >= deadline:
            raise TimeoutError(f"rank 0 did not publish the NCCL unique id at {path} within "
                               f"{timeout_s:g} s (did rank 0 fail or never call init_process_group?)")
        time.sleep(poll_s)
