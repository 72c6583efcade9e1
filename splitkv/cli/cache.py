"""``splitkv cache clear``: remove splitkv's cached profiles and first-use models, and with
``--kernels`` the compiled kernels (splitkv's precompiled CUBINs and CuPy's cache), printing
each file and the bytes freed (``--dry-run``: the same list, nothing removed).

Only files these caches write are removed, chosen by name, one folder deep, never a folder:
in ``<cache>/profiles/`` the profiles ``splitkv calibrate`` writes (``*.yaml``), their
measurements (``*.csv``) and plots, and the temporary files of an interrupted write; in its
``first-use/`` folder the first-use models; in ``<cache>/kernels/`` the CUBINs ``splitkv
precompile`` writes (``<build>.sm_XX.<hash>.cubin``); in CuPy's kernel cache
(``$CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``) the files CuPy names by a hash
(``<sha1>.cubin`` and the like). A file anyone else put there stays, and so does anything
inside the profiles shipped with splitkv, wherever ``$SPLITKV_CACHE_DIR`` points. The folders'
locations are decided where the library decides them (``planner.profiles.cache_root``,
``planner.first_use``, ``runtime.cubin_cache``); ``splitkv env`` prints them with their sizes.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
from importlib import resources
from pathlib import Path

from ..planner.first_use import first_use_path
from ..planner.profiles import CACHE_DIR_ENV, REFERENCE_DEVICE, cache_root, user_profile_dir
from ..runtime.cubin_cache import CUBIN_FILE, CUBIN_TEMP_FILE, cubin_dir
from . import args as A

CUPY_CACHE_ENV = "CUPY_CACHE_DIR"
CUPY_DEFAULT_CACHE = "~/.cupy/kernel_cache"     # CuPy's folder when $CUPY_CACHE_DIR is unset
# What splitkv writes in its profiles folder: profiles, `splitkv calibrate`'s measurements
# (<profile>.csv, .fp8.csv, .partial.csv) and --plot's PNGs, and write_atomically's
# temporary files (.<name>.<pid>.<token>.tmp) left by a killed process.
PROFILE_FILES = ("*.yaml", "*.csv", "*-predicted-vs-measured.png", "*-decisions.png", ".*.tmp")
FIRST_USE_FILES = ("*.yaml", ".*.tmp")
# CuPy's kernel cache entries: a hex digest of the compile's key and the binary's suffix
# (<sha1>.cubin since CuPy 14, <md5>_2.cubin before; .ltoir, .hsaco on ROCm), and the source
# saved beside one under $CUPY_CACHE_SAVE_CUDA_SOURCE (<name>.cu).
CUPY_FILE = re.compile(r"[0-9a-f]{32,64}(_\d+)?\.(cubin|ltoir|hsaco)(\.cu)?")


def cache_dir() -> Path:
    """splitkv's cache folder: the one the profiles and kernels folders are in."""
    return cache_root()


def cache_dir_source() -> str:
    """What chose ``cache_dir()``, in words (the choice itself is ``cache_root``'s)."""
    if os.environ.get(CACHE_DIR_ENV):
        return f"from ${CACHE_DIR_ENV}"
    if os.environ.get("XDG_CACHE_HOME"):
        return "in $XDG_CACHE_HOME"
    return "the default"


def is_cubin_file(name: str) -> bool:
    """Whether ``splitkv precompile`` names a file so (its CUBINs and their temporary files)."""
    return bool(CUBIN_FILE.fullmatch(name) or CUBIN_TEMP_FILE.fullmatch(name))


def first_use_dir() -> Path:
    """The folder of the first-use models (every GPU's in one)."""
    return first_use_path(REFERENCE_DEVICE, 0).parent


def kernel_cache_dir() -> Path | None:
    """CuPy's kernel cache folder, as CuPy reads ``$CUPY_CACHE_DIR`` (taken as given, no ``~``
    expanded); None where it is set but empty (CuPy then writes into the working folder,
    which is no folder to clear)."""
    value = os.environ.get(CUPY_CACHE_ENV)
    if value is None:
        return Path(os.path.expanduser(CUPY_DEFAULT_CACHE))
    return Path(value) if value else None


def shipped_profiles_dir() -> Path:
    """The profiles that ship inside the package: never removed."""
    return Path(str(resources.files("splitkv.planner").joinpath("profiles")))


def _is_within(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except (OSError, ValueError):
        return False


def folder_files(folder: Path, recursive: bool = False) -> list[Path]:
    """The regular files in ``folder`` (not the links), in its subfolders too if
    ``recursive``; none where it does not exist."""
    found, pending = [], [folder]
    while pending:
        try:
            entries = sorted(os.scandir(pending.pop()), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                found.append(Path(entry.path))
            elif recursive and entry.is_dir(follow_symlinks=False):
                pending.append(Path(entry.path))
    return found


def folder_usage(folder: Path | None, recursive: bool = False) -> dict:
    """{"path", "exists", "files", "bytes"} of a folder's files (``folder_files``), and
    "not_a_folder" where something else has the folder's name."""
    if folder is None:
        return {"path": None, "exists": False, "files": 0, "bytes": 0}
    files = folder_files(folder, recursive)
    usage = {"path": str(folder), "exists": folder.is_dir(), "files": len(files),
             "bytes": sum(_size(f) for f in files)}
    if folder.exists() and not folder.is_dir():
        usage["not_a_folder"] = True
    return usage


def files_and_bytes(count: int, size: int) -> str:
    """'1 file, 2,345 bytes'."""
    return f"{count:,} file{'s' * (count != 1)}, {size:,} bytes"


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def clearable(folder: Path, patterns=None, match=None) -> tuple[list[Path], int]:
    """(the files in ``folder`` that a pattern or ``match`` names, outside the shipped
    profiles; how many other files stay)."""
    shipped = shipped_profiles_dir()
    chosen, others = [], 0
    for path in folder_files(folder):
        named = (match(path.name) if match is not None
                 else any(fnmatch.fnmatchcase(path.name, p) for p in patterns))
        if named and not _is_within(path, shipped):
            chosen.append(path)
        else:
            others += 1
    return chosen, others


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(cache_parser=parser)
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    clear = actions.add_parser(
        "clear", help="remove cached profiles and first-use models (--kernels: the compiled "
                      "kernels)",
        description="Remove splitkv's calibrated profiles, their measurements and the first-use "
                    "models from its cache folder; never the profiles shipped with splitkv.")
    clear.add_argument("--kernels", action="store_true",
                       help=f"also remove the compiled kernels: splitkv precompile's CUBINs "
                            f"(<cache>/kernels) and CuPy's (${CUPY_CACHE_ENV}, else "
                            f"{CUPY_DEFAULT_CACHE}): the next run compiles them again")
    clear.add_argument("--dry-run", action="store_true",
                       help="list what would be removed, remove nothing")
    clear.set_defaults(action_parser=clear)     # its own errors name `splitkv cache clear`


def run(args: argparse.Namespace) -> int:
    if args.action is None:
        args.cache_parser.print_help(sys.stderr)
        return 2
    return _clear(args.kernels, args.dry_run)


def _clear(kernels: bool, dry_run: bool) -> int:
    folder = cache_dir()
    not_a_folder = folder.exists() and not folder.is_dir()
    groups = []
    if not_a_folder:             # splitkv's files cannot be there; CuPy's cache is elsewhere
        print(f"splitkv cache: {folder} ({cache_dir_source()}) is not a folder: none of "
              "splitkv's files cleared", file=sys.stderr)
    else:
        print(f"splitkv's cache: {folder} ({cache_dir_source()})")
        groups = [("splitkv", user_profile_dir(), dict(patterns=PROFILE_FILES)),
                  ("splitkv", first_use_dir(), dict(patterns=FIRST_USE_FILES))]
        if kernels:
            groups.append(("splitkv", cubin_dir(), dict(match=is_cubin_file)))
    cupy_dir = kernel_cache_dir()
    if kernels and cupy_dir is None:
        print(f"CuPy's kernel cache: not cleared: ${CUPY_CACHE_ENV} is set but empty (CuPy "
              "writes its kernels into the working folder)")
    elif kernels:
        groups.append(("CuPy", cupy_dir, dict(match=CUPY_FILE.fullmatch)))
    verb = "would remove" if dry_run else "removed"
    count = total = failed = 0
    for writer, where, how in groups:
        files, others = clearable(where, **how)
        for path in files:
            size = _size(path)
            if not dry_run:
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue            # removed meanwhile (another clear)
                except OSError as exc:
                    failed += 1
                    print(f"splitkv cache: cannot remove {path}: {A.one_line(exc.strerror or exc)}",
                          file=sys.stderr)
                    continue
            count, total = count + 1, total + size
            print(f"{verb} {path} ({size:,} bytes)")
        if others:
            print(f"kept {others:,} file{'s' * (others != 1)} in {where}: not named as "
                  f"{writer} names its files")
    if not kernels and not not_a_folder:
        usage = folder_usage(cubin_dir())
        if usage["files"]:
            print(f"kept splitkv's precompiled kernels {cubin_dir()} "
                  f"({files_and_bytes(usage['files'], usage['bytes'])}): --kernels clears them "
                  "too")
    if not kernels and cupy_dir is not None:
        usage = folder_usage(cupy_dir)
        if usage["files"]:
            print(f"kept CuPy's kernel cache {cupy_dir} "
                  f"({files_and_bytes(usage['files'], usage['bytes'])}): --kernels clears it too")
    print(f"{verb} {files_and_bytes(count, total)}"
          + (" (--dry-run: nothing removed)" if dry_run else ""))
    return 1 if failed or not_a_folder else 0
