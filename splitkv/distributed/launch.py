"""Start one process per GPU and watch them: ``python3 -m splitkv.distributed.launch``.

    python3 -m splitkv.distributed.launch --nproc 2 script.py args...
    python3 -m splitkv.distributed.launch --nproc 2 -m package.module args...

Each child gets RANK, WORLD_SIZE, LOCAL_RANK (its GPU; or CUDA_VISIBLE_DEVICES with
``--isolate-devices``), SPLITKV_RENDEZVOUS_DIR (a fresh temporary directory, where rank 0
publishes the NCCL unique id), SPLITKV_RENDEZVOUS_TIMEOUT, and always NCCL_NVLS_ENABLE=0
(NVLink multicast must stay off on our machines). No wait is unbounded: when a child exits
non-zero (or is killed), the launcher stops the others (SIGTERM, then SIGKILL after
``--grace`` seconds) and exits non-zero naming the failed rank; after ``--timeout`` seconds it
stops everyone and exits 124. Ctrl-C stops everyone too. Pure Python: no CuPy needed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .rendezvous import DEFAULT_TIMEOUT_S, ENV_DIR, ENV_LOCAL_RANK, ENV_RANK, ENV_TIMEOUT, ENV_WORLD_SIZE

EXIT_TIMEOUT = 124
PREFIX = "splitkv.distributed.launch"


def child_env(rank: int, nproc: int, rendezvous_dir: str, rendezvous_timeout: float,
              isolate_devices: bool, base=None) -> dict:
    """The environment of rank ``rank``."""
    env = dict(os.environ if base is None else base)
    env.update({ENV_RANK: str(rank), ENV_WORLD_SIZE: str(nproc), ENV_LOCAL_RANK: str(rank),
                "LOCAL_WORLD_SIZE": str(nproc), ENV_DIR: rendezvous_dir,
                ENV_TIMEOUT: str(rendezvous_timeout), "NCCL_NVLS_ENABLE": "0",
                "PYTHONUNBUFFERED": "1"})
    if isolate_devices:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(nproc)]
        if len(devices) < nproc:
            raise SystemExit(f"{PREFIX}: CUDA_VISIBLE_DEVICES={visible} lists fewer than {nproc} devices")
        env["CUDA_VISIBLE_DEVICES"] = devices[rank]
        env[ENV_LOCAL_RANK] = "0"
    return env


def _die_with_parent():
    """In the child, before exec: get SIGKILL if the launcher dies (Linux), so no rank outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def stop(procs, grace_s: float) -> None:
    """SIGTERM every running child's process group, SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [p for p in procs if p.poll() is None]
        for p in running:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(0.02)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass


def launch(command: list[str], nproc: int, *, timeout_s: float, rendezvous_timeout_s: float,
           grace_s: float = 5.0, isolate_devices: bool = False) -> int:
    """Run ``command`` (argv after the interpreter) in ``nproc`` ranks; return the exit status."""
    rendezvous_dir = tempfile.mkdtemp(prefix="splitkv-rendezvous-")
    procs: list[subprocess.Popen] = []

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_signal)
    try:
        for rank in range(nproc):
            env = child_env(rank, nproc, rendezvous_dir, rendezvous_timeout_s, isolate_devices)
            procs.append(subprocess.Popen([sys.executable, *command], env=env,
                                          start_new_session=True, preexec_fn=_die_with_parent))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                first = failed[0]          # ranks seen failed in the same poll: lowest first
                what = "; ".join(f"rank {r} {describe(codes[r])}" for r in failed)
                print(f"{PREFIX}: {what}; stopping the other ranks", file=sys.stderr, flush=True)
                stopped_by_us = {r for r, c in enumerate(codes) if c is None}
                stop(procs, grace_s)
                report(procs, stopped_by_us, f"rank{'s' if len(failed) > 1 else ''} "
                       f"{', '.join(map(str, failed))} failed")
                return codes[first] if codes[first] > 0 else 128 - codes[first]
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                stopped_by_us = {r for r, c in enumerate(codes) if c is None}
                print(f"{PREFIX}: timed out after {timeout_s:g} s; ranks still running: "
                      f"{sorted(stopped_by_us)}; stopping them", file=sys.stderr, flush=True)
                stop(procs, grace_s)
                report(procs, stopped_by_us, "timed out")
                return EXIT_TIMEOUT
            time.sleep(0.02)
    except KeyboardInterrupt:
        print(f"{PREFIX}: interrupted; stopping all ranks", file=sys.stderr, flush=True)
        stop(procs, grace_s)
        return 130
    finally:
        stop([p for p in procs if p.poll() is None], grace_s)
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


def report(procs, stopped_by_us: set[int], headline: str) -> None:
    lines = [f"{PREFIX}: {headline}:"]
    for r, p in enumerate(procs):
        how = "stopped by the launcher" if r in stopped_by_us else describe(p.returncode)
        lines.append(f"  rank {r} (pid {p.pid}): {how}")
    print("\n".join(lines), file=sys.stderr, flush=True)


FLAGS = {"--isolate-devices", "-h", "--help"}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, the child's argv): the child's part starts at the first token that is
    not a launcher option (the script) or at ``-m MODULE``, so its own options pass untouched."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "-m":
            return argv[:i], argv[i:]
        if not token.startswith("-"):
            return argv[:i], argv[i:]
        i += 1 if token in FLAGS or "=" in token else 2
    return argv, []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m splitkv.distributed.launch",
                                 usage="%(prog)s --nproc N [options] (script.py | -m module) [args...]",
                                 description="Run a script in N processes, one per GPU, for NCCL.")
    ap.add_argument("--nproc", type=int, required=True, help="number of ranks (GPUs)")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="stop every rank after this many seconds (default %(default)s)")
    ap.add_argument("--rendezvous-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="how long ranks > 0 wait for rank 0's NCCL unique id (default %(default)s)")
    ap.add_argument("--grace", type=float, default=5.0,
                    help="seconds between SIGTERM and SIGKILL when stopping ranks (default %(default)s)")
    ap.add_argument("--isolate-devices", action="store_true",
                    help="give each rank one GPU through CUDA_VISIBLE_DEVICES (default: all GPUs "
                         "visible, rank r uses device r)")
    options, command = split_argv(list(sys.argv[1:] if argv is None else argv))
    ns = ap.parse_args(options)
    if ns.nproc < 1:
        ap.error("--nproc: expected >= 1")
    if min(ns.timeout, ns.rendezvous_timeout, ns.grace) <= 0:
        ap.error("--timeout, --rendezvous-timeout and --grace must be > 0")
    if not command or command == ["-m"]:
        ap.error("give a script (or -m module) to run")
    return launch(command, ns.nproc, timeout_s=ns.timeout, rendezvous_timeout_s=ns.rendezvous_timeout,
                  grace_s=ns.grace, isolate_devices=ns.isolate_devices)


if __name__ == "__main__":
    sys.exit(main())
