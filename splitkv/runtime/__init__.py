"""The only package that touches CuPy and the GPU: compiles the CUDA sources with NVRTC,
uploads plans, launches kernels. It runs, it does not measure: the timing routine and the
first-use probes are ``splitkv.measure``'s, above it, which reach the device through the thin
CuPy calls here (``cupy_timers``, ``probe_kernels``, ``cupy_arrays``)."""

from __future__ import annotations

import os
from functools import lru_cache


class GPUUnavailableError(RuntimeError):
    """No usable CUDA GPU here (no CuPy, no driver, no device, no NVRTC): raised by the GPU
    entry points (``BatchDecodeWrapper.plan()``, ``plan_on_device()``, ``run()``, and the
    ``profile`` and ``max_chunks`` that depend on the device) before any other work.
    ``reason`` is ``gpu_available()``'s."""

    def __init__(self, what: str, reason: str):
        super().__init__(f"{what} needs a usable CUDA GPU: {reason}")
        self.reason = reason


_gpu_found = False     # once a GPU is found usable, it stays found: the check costs nothing after

def _install_hint() -> str:
    """What to install, said the same way by every error that suggests an install: each extra
    brings one CuPy and the NVRTC library of its CUDA major; the command fits how splitkv was
    installed (a source tree beside the package, or a wheel)."""
    from pathlib import Path

    if (Path(__file__).resolve().parents[2] / "pyproject.toml").is_file():
        return ("in splitkv's source tree, python3 -m pip install -e '.[cuda13]' (CUDA 13 "
                "driver) or -e '.[cuda12]' (CUDA 12 driver)")
    return ("python3 -m pip install 'splitkv[cuda13]' (CUDA 13 driver) or 'splitkv[cuda12]' "
            "(CUDA 12 driver)")


INSTALL_HINT = _install_hint()


def require_gpu(what: str) -> None:
    """Raise ``GPUUnavailableError`` naming ``what`` unless ``gpu_available()``."""
    global _gpu_found
    if _gpu_found:
        return
    ok, reason = gpu_available()
    if not ok:
        raise GPUUnavailableError(what, reason)
    _gpu_found = True


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when CuPy is installed, sees a CUDA device and loads the NVRTC
    library, else (False, why)."""
    try:
        import cupy
    except ImportError:
        return False, f"CuPy is not installed ({INSTALL_HINT})"
    except Exception as exc:  # installed but broken (e.g. a CUDA library it needs is missing)
        return False, f"CuPy cannot be imported: {type(exc).__name__}: {exc}"
    try:
        if not cupy.cuda.is_available():
            return False, "CuPy found no usable CUDA device (no GPU or no driver)"
        name = device_info()["name"]
    except Exception as exc:  # driver present but unusable
        return False, f"CUDA is not usable: {exc}"
    ok, why = nvrtc_available()    # the kernels are compiled at run time: no NVRTC, no kernels
    return (True, name) if ok else (False, why)


def cupy_build() -> dict | None:
    """The CuPy this process imports: its ``version``, its ``path``, and the CUDA runtime it
    was built for (``cuda_runtime``, CUDA's integer, or None where that cannot be read); None
    when CuPy does not import."""
    try:
        import cupy
    except Exception:         # not installed, or broken: gpu_available() says which
        return None
    try:
        runtime = int(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:         # the CUDA runtime library is missing
        runtime = None
    return {"version": getattr(cupy, "__version__", "?"), "path": os.path.dirname(cupy.__file__),
            "cuda_runtime": runtime}


@lru_cache(maxsize=None)
def nvrtc_available() -> tuple[bool, str]:
    """(True, "NVRTC major.minor") when CuPy's NVRTC bindings load the NVRTC library, else
    (False, why). Needs no GPU: the compile-only tests skip on it."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        return False, f"CuPy is not installed ({INSTALL_HINT})"
    except Exception as exc:  # installed but broken
        return False, f"CuPy cannot be imported: {type(exc).__name__}: {exc}"
    try:
        major, minor = nvrtc.getVersion()
    except Exception as exc:  # the bindings are there, the library is not
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return False, f"the NVRTC library cannot be loaded ({first_line}); {INSTALL_HINT}"
    return True, f"NVRTC {major}.{minor}"


@lru_cache(maxsize=None)
def _device_info(device_id: int) -> dict:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return {"name": name, "num_sms": int(props["multiProcessorCount"]),
            "l2_bytes": int(props["l2CacheSize"]), "cc": f"{props['major']}{props['minor']}",
            "shared_per_block_optin": int(props.get("sharedMemPerBlockOptin", 0)),
            "shared_per_sm": int(props.get("sharedMemPerMultiprocessor", 0)),
            "device_id": device_id}


def driver_version() -> str:
    """The CUDA driver's version (e.g. '12040'; '0' where no driver is installed): a new driver
    may time differently."""
    import cupy

    return str(cupy.cuda.runtime.driverGetVersion())


def device_info(device_id: int | None = None) -> dict:
    """Name, SM count, L2 bytes and compute capability of the current (or given) device."""
    import cupy

    return _device_info(cupy.cuda.runtime.getDevice() if device_id is None else device_id)


__all__ = ["INSTALL_HINT", "GPUUnavailableError", "cupy_build", "device_info", "driver_version",
           "gpu_available", "nvrtc_available", "require_gpu"]
