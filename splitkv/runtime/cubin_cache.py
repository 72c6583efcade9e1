"""splitkv's cache of compiled kernels: CUBINs that ``splitkv precompile`` writes ahead of time
(an image build, with no GPU) and the runtime loads instead of compiling with NVRTC in serving.

One file a module, in ``<cache>/kernels/`` (``planner.profiles.cache_root``), named by a hash of
all that decides its binary: the source, NVRTC's options, the architecture and the NVRTC build.
A file made from other source, options or compiler is never found, so none is ever used stale.
A file is written whole or not at all (its own temporary file, renamed over the name); one that
cannot be read or is not a whole CUDA ELF image is skipped with one notice naming it (a WARNING
record of the ``splitkv`` logger), and the runtime compiles as if it were absent. Needs neither
CuPy nor a GPU, but NVRTC to compile."""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from functools import lru_cache
from pathlib import Path

from .._log import logger
from ..planner.profile_files import write_atomically
from ..planner.profiles import cache_root

KERNELS_FOLDER = "kernels"
# The names this cache writes (and ``splitkv cache clear --kernels`` removes): <label>.<arch>.
# <40 hex digits>.cubin, and write_atomically's temporary files.
CUBIN_FILE = re.compile(r"[A-Za-z0-9_]+\.sm_\d+[a-z]?\.[0-9a-f]{40}\.cubin")
CUBIN_TEMP_FILE = re.compile(r"\..+\.cubin\.\d+\.[0-9a-f]+\.tmp")
# What CuPy's RawModule adds to a module's options before NVRTC sees them (flushing denormals,
# the execution space; cupy.cuda.compiler): a cached CUBIN is compiled with them too, so it is
# the binary a compile at run time would have loaded.
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
KEY_FORMAT = 1          # what a key hashes; a change makes every older file unfound
_LABEL = re.compile(r"[A-Za-z0-9_]+")
_ARCH = re.compile(r"sm_\d+[a-z]?")
EM_CUDA = 190           # ELF e_machine of a CUDA binary


class CubinError(ValueError):
    """A cached file that cannot be used: unreadable, or not a whole CUDA ELF image."""


def cubin_dir() -> Path:
    """The folder of the precompiled kernels: ``kernels`` in splitkv's cache folder."""
    return cache_root() / KERNELS_FOLDER


@lru_cache(maxsize=None)
def nvrtc_build() -> str:
    """The NVRTC this process compiles with, as a key reads it: its version, and the build the
    header of an empty program's PTX names (release and build ID), which tells patch releases
    of one minor apart (they report the same version). Read once a process: an empty program
    compiles in milliseconds, and makes no module."""
    from cupy_backends.cuda.libs import nvrtc

    from .kernel_source import compile_ptx

    major, minor = nvrtc.getVersion()
    try:
        ptx = compile_ptx("", "empty.cu", f"compute_{min(nvrtc.getSupportedArchs())}")
    except Exception:                # no PTX header to read: the version alone
        return f"{major}.{minor}"
    build = re.findall(r"^// (Compiler Build ID: \S+|Cuda compilation tools, .*)$", ptx, re.M)
    return f"{major}.{minor}" + (f" ({'; '.join(build)})" if build else "")


def cubin_options(options) -> tuple:
    """NVRTC's options (before ``-arch``) of a cached module whose runtime options are
    ``options``: CuPy's additions appended."""
    return (*options, *CUPY_ADDED_OPTIONS)


def cubin_name(label: str, source: str, options, arch: str, nvrtc: str | None = None) -> str:
    """The file name of a module: ``label`` (for people), ``arch``, and the hash that finds it.
    ``options``: as the runtime passes them; ``nvrtc``: ``nvrtc_build()`` unless given."""
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise ValueError(f"label: expected letters, digits and underscores, got {label!r}")
    if not isinstance(arch, str) or not _ARCH.fullmatch(arch):
        raise ValueError(f"arch: expected an architecture like 'sm_90', got {arch!r}")
    key = json.dumps([KEY_FORMAT, source, list(cubin_options(options)), arch,
                      nvrtc if nvrtc is not None else nvrtc_build()])
    return f"{label}.{arch}.{hashlib.sha256(key.encode()).hexdigest()[:40]}.cubin"


def _elf_end(data: bytes, where) -> int:
    """Where the ELF image in ``data`` ends: past its header, tables and sections; raises
    ``CubinError`` naming ``where`` unless it is a 64-bit CUDA ELF image."""
    def bad(what):
        return CubinError(f"{where}: {what}; not a CUBIN splitkv wrote")

    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise bad("no ELF header")
    if data[4] != 2 or data[5] != 1:
        raise bad("not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine != EM_CUDA:
        raise bad(f"ELF machine {machine}, not CUDA ({EM_CUDA})")
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    if shnum == 0 or shentsize < 64:
        raise bad("no section table")
    end = max(64, phoff + phnum * phentsize, shoff + shnum * shentsize)
    if shoff + shnum * shentsize > len(data):
        raise bad(f"cut short: its section table ends past its {len(data):,} bytes")
    for i in range(shnum):
        kind, _, _, offset, size = struct.unpack_from("<IQQQQ", data, shoff + i * shentsize + 4)
        if kind != 8:                               # 8: SHT_NOBITS, no bytes in the file
            end = max(end, offset + size)
    return end


def whole_cubin(data: bytes) -> bytes:
    """NVRTC's CUBIN as CuPy's ``getCUBIN`` returns it, whole again: CuPy drops its last byte
    as if it ended in a C string's NUL. That byte ends the program headers, which NVRTC puts
    last: the top byte of the last one's alignment, 0. (Loaded from a Python ``bytes``, as
    CuPy's cache does, the NUL after a bytes object's data stands in for it; a file must hold
    it.)"""
    phoff = struct.unpack_from("<Q", data, 32)[0] if len(data) >= 64 else 0
    if _elf_end(data, "NVRTC's CUBIN") == len(data) + 1 and phoff > struct.unpack_from(
            "<Q", data, 40)[0]:
        return data + b"\x00"
    return data


def check_cubin(data: bytes, where) -> None:
    """Raise ``CubinError`` naming ``where`` unless ``data`` is a whole 64-bit CUDA ELF image:
    its header, and every table and section it points to, within its bytes (a copy cut short
    loses at least its program headers, which NVRTC puts last)."""
    end = _elf_end(data, where)
    if end > len(data):
        raise CubinError(f"{where}: cut short: {len(data):,} bytes of {end:,}; not a CUBIN "
                         "splitkv wrote")


def read_cubin(path) -> bytes | None:
    """The checked bytes of a cached file; None where there is none; ``CubinError`` where it
    cannot be read or is damaged."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CubinError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    check_cubin(data, path)
    return data


_warned: set[str] = set()


def skip_cubin(path, why) -> None:
    """Say, once a process for each file, that it is skipped and NVRTC compiles its module
    instead."""
    if str(path) in _warned:
        return
    _warned.add(str(path))
    logger.warning(f"skipping the precompiled kernel {path} ({why}); compiling it with NVRTC "
                   "instead (splitkv precompile writes it again)")


def cached_cubin(label: str, source: str, options, arch: str, folder=None) -> Path | None:
    """The cache's file of this module, checked; None where it is absent, or damaged or
    unreadable (then skipped with one notice naming it)."""
    path = Path(folder or cubin_dir()) / cubin_name(label, source, options, arch)
    try:
        data = read_cubin(path)
    except CubinError as exc:
        skip_cubin(path, str(exc).removeprefix(f"{path}: "))
        return None
    return path if data is not None else None


def precompile_module(label: str, source: str, options, arch: str, folder=None,
                      dry_run: bool = False) -> dict:
    """Compile one module to a CUBIN for ``arch`` into the cache unless a whole one is there
    (a damaged one is replaced). Returns {"label", "arch", "path", "status" ("written",
    "present" or "would write"), "bytes", "seconds"}."""
    from .kernel_source import compile_cubin

    path = Path(folder or cubin_dir()) / cubin_name(label, source, options, arch)
    record = {"label": label, "arch": arch, "path": str(path)}
    try:
        data = read_cubin(path)
    except CubinError:
        data = None
    if data is not None:
        return {**record, "status": "present", "bytes": len(data), "seconds": 0.0}
    if dry_run:
        return {**record, "status": "would write", "bytes": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    data, _ = compile_cubin(source, arch, f"{label}.cu", options=cubin_options(options))
    data = whole_cubin(data)
    check_cubin(data, f"NVRTC's CUBIN of {label} for {arch}")
    write_atomically(path, data)
    return {**record, "status": "written", "bytes": len(data),
            "seconds": round(time.perf_counter() - t0, 3)}
