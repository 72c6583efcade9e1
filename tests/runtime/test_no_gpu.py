"""Without a usable GPU the GPU entry points say so: ``BatchDecodeWrapper.plan()`` and
``run()`` raise ``GPUUnavailableError`` (a RuntimeError) with ``gpu_available()``'s reason
before any other work, not a ModuleNotFoundError (no CuPy) or a CUDARuntimeError (CuPy, no
driver). Constructing a wrapper does no GPU work and works anywhere."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import splitkv
import splitkv.runtime
from splitkv import DecodeProblem, PageTable
from splitkv.planner import choose_plan
from splitkv.planner.profiles import prior_profile
from splitkv.runtime import GPUUnavailableError, gpu_available

ROOT = str(Path(splitkv.__file__).resolve().parents[1])
HERE_OK, HERE_WHY = gpu_available()


def test_the_error_is_exported_and_a_runtime_error():
    assert splitkv.GPUUnavailableError is GPUUnavailableError
    assert "GPUUnavailableError" in splitkv.__all__ and "GPUUnavailableError" in splitkv.runtime.__all__
    assert issubclass(GPUUnavailableError, RuntimeError)


@pytest.mark.skipif(HERE_OK, reason="a GPU is usable here")
def test_plan_and_run_without_a_gpu_raise_a_clear_error(monkeypatch):
    monkeypatch.setattr(splitkv.runtime, "_gpu_found", False)
    wrapper = splitkv.BatchDecodeWrapper(32, 8, 128, 16)          # no GPU work: works
    table = PageTable.from_block_table(np.array([[0, 1]]), np.array([20]), 16)
    for call, what in ((lambda: wrapper.plan(table), "plan()"),
                       (lambda: wrapper.run(None, None, None), "run()")):
        with pytest.raises(GPUUnavailableError) as raised:
            call()
        assert str(raised.value) == f"BatchDecodeWrapper.{what} needs a usable CUDA GPU: {HERE_WHY}"
        assert raised.value.reason == HERE_WHY


def test_plan_names_a_bad_host_argument_before_the_missing_gpu(monkeypatch):
    """An engine wired up on a machine without a GPU sees its bad lengths, tables and variant
    values refused as a GPU would refuse them; good ones reach the missing GPU."""
    monkeypatch.setattr(splitkv.runtime, "_gpu_found", False)
    wrapper = splitkv.BatchDecodeWrapper(32, 8, 128, 16)
    table = np.zeros((2, 4), np.int32)
    for kw, error, match in (
            ({}, TypeError, "page_table: give exactly one of"),
            (dict(seq_lens=np.array([-1, 3])), ValueError, "seq_lens: lengths must be >= 0"),
            (dict(seq_lens=np.array([1.5, 3.0])), TypeError, "seq_lens: expected an integer"),
            (dict(seq_lens=np.array([5, 3]), strategy="bogus"), ValueError, "strategy"),
            (dict(seq_lens=np.array([5, 3]), num_splits=0), ValueError, "num_splits"),
            (dict(seq_lens=np.array([5, 3]), window_left=-2), ValueError, "window_left"),
            (dict(seq_lens=np.array([5, 3]), logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
            (dict(seq_lens=np.array([5, 3]), alibi_slopes=[0.5]), ValueError, "alibi_slopes"),
            (dict(seq_lens=np.array([5, 3])), GPUUnavailableError, "needs a usable CUDA GPU")):
        with pytest.raises(error, match=match):
            wrapper.plan(**({"block_table": table} if kw else {}), **kw)

    class OnDevice:             # a CUDA tensor where CuPy is missing: the GPU's to check
        __cuda_array_interface__ = {"shape": (2, 4), "typestr": "<i4", "data": (0, False),
                                    "version": 3}

    model = prior_profile("NVIDIA H200").cost_model()
    plan = choose_plan(DecodeProblem([5, 3], 32, 8, 128, 16), model)
    for kw in (dict(block_table=OnDevice(), seq_lens=np.array([5, 3])),
               dict(block_table=table, seq_lens=np.array([5, 3]), plan=plan, strategy="bogus")):
        with pytest.raises(GPUUnavailableError):         # split arguments a plan makes unread
            wrapper.plan(**kw)


def test_without_cupy_plan_and_run_raise_a_clear_error():
    """A fresh interpreter in which ``import cupy`` fails, as where CuPy is not installed."""
    script = textwrap.dedent("""
        import sys
        sys.modules["cupy"] = None                       # import cupy: ModuleNotFoundError
        import numpy as np
        from splitkv import BatchDecodeWrapper, GPUUnavailableError, PageTable
        wrapper = BatchDecodeWrapper(32, 8, 128, 16, use_cuda_graph=True, max_batch_size=4,
                                     max_num_pages=8)
        table = PageTable.from_block_table(np.array([[0, 1]]), np.array([20]), 16)
        for call in (lambda: wrapper.plan(table), lambda: wrapper.run(None, None, None)):
            try:
                call()
            except GPUUnavailableError as exc:
                print(exc)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    why = ("CuPy is not installed (in splitkv's source tree, python3 -m pip install -e "
           "'.[cuda13]' (CUDA 13 driver) or -e '.[cuda12]' (CUDA 12 driver))")
    assert done.stdout.splitlines() == [f"BatchDecodeWrapper.plan() needs a usable CUDA GPU: {why}",
                                        f"BatchDecodeWrapper.run() needs a usable CUDA GPU: {why}"]


def test_require_gpu_checks_until_a_gpu_is_found(monkeypatch):
    calls = []
    monkeypatch.setattr(splitkv.runtime, "_gpu_found", False)
    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: calls.append(1) or (False, "none"))
    for _ in range(2):
        with pytest.raises(GPUUnavailableError, match="^x needs a usable CUDA GPU: none$"):
            splitkv.runtime.require_gpu("x")
    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: calls.append(1) or (True, "GPU"))
    splitkv.runtime.require_gpu("x")
    splitkv.runtime.require_gpu("x")                 # found once: not asked again
    assert len(calls) == 3


def test_a_gpu_without_the_nvrtc_library_is_not_usable(monkeypatch):
    """The kernels compile at run time: CuPy and a device without NVRTC would fail at the first
    plan(), so the check says so, with the install that brings NVRTC."""
    pytest.importorskip("cupy", reason="CuPy is not installed")
    import cupy

    monkeypatch.setattr(cupy.cuda, "is_available", lambda: True)
    monkeypatch.setattr(splitkv.runtime, "device_info", lambda: {"name": "Some GPU"})
    monkeypatch.setattr(splitkv.runtime, "nvrtc_available", lambda: (False, "no libnvrtc"))
    assert gpu_available() == (False, "no libnvrtc")
    monkeypatch.setattr(splitkv.runtime, "nvrtc_available", lambda: (True, "NVRTC 13.0"))
    assert gpu_available() == (True, "Some GPU")


def test_nvrtc_check_names_the_install_when_the_library_is_missing(monkeypatch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy is not installed")

    def missing():
        raise RuntimeError('Failure finding "libnvrtc.so.13"\nmore detail')

    splitkv.runtime.nvrtc_available.cache_clear()
    monkeypatch.setattr(nvrtc, "getVersion", missing)
    try:
        ok, why = splitkv.runtime.nvrtc_available()
    finally:
        splitkv.runtime.nvrtc_available.cache_clear()
    assert not ok
    assert why == ('the NVRTC library cannot be loaded (Failure finding "libnvrtc.so.13"); '
                   + splitkv.runtime.INSTALL_HINT)
    assert "pip install -e '.[cuda13]'" in why


@pytest.mark.skipif(HERE_OK, reason="a GPU is usable here")
def test_what_a_wrapper_reads_from_the_device_says_there_is_none(monkeypatch):
    """The profile (looked up for the device) and a graph-stable capacity's default chunks (sized
    from its SMs) raise the same clear error as plan(), not an ImportError."""
    monkeypatch.setattr(splitkv.runtime, "_gpu_found", False)
    wrapper = splitkv.BatchDecodeWrapper(32, 8, 128, 16, use_cuda_graph=True, max_batch_size=4,
                                         max_num_pages=8)
    for what in ("profile", "max_chunks"):
        with pytest.raises(GPUUnavailableError, match=f"^BatchDecodeWrapper.{what} needs a usable"):
            getattr(wrapper, what)


def test_the_install_hint_fits_how_splitkv_was_installed(monkeypatch, tmp_path):
    """From a source tree: the editable install of an extra; from a wheel (no pyproject.toml
    beside the package): the extra by name."""
    import splitkv.runtime as runtime

    assert "pip install -e '.[cuda13]'" in runtime._install_hint()      # this checkout
    package = tmp_path / "site-packages" / "splitkv" / "runtime"
    package.mkdir(parents=True)
    monkeypatch.setattr(runtime, "__file__", str(package / "__init__.py"))
    hint = runtime._install_hint()
    assert "'splitkv[cuda13]'" in hint and " -e " not in hint
