"""The cache of precompiled CUBINs without a GPU: a module's file name changes with whatever
changes its binary (source, options, architecture, NVRTC), the files hold whole CUDA ELF
images, a damaged or unreadable one is skipped with one notice naming it (a WARNING record of
the ``splitkv`` logger), and the runtime's
loader (with a stand-in for CuPy) takes the file where there is a whole one and compiles
otherwise, counting each."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from splitkv.runtime import cubin_cache as CC
from splitkv.runtime import modules
from splitkv.runtime.kernel_source import NVRTC_OPTIONS, KernelBuild

TINY = 'extern "C" __global__ void tiny(int *x) { x[0] = 1; }\n'


def test_a_name_changes_with_the_source_options_arch_and_nvrtc():
    variant = KernelBuild("bfloat16", 128, 1)
    other = KernelBuild("bfloat16", 128, 2)
    args = (variant.name, variant.source(), NVRTC_OPTIONS, "sm_90")
    name = CC.cubin_name(*args, nvrtc="13.0")
    assert name == CC.cubin_name(*args, nvrtc="13.0")                   # the same module: found
    assert CC.CUBIN_FILE.fullmatch(name) and name.startswith(f"{variant.name}.sm_90.")
    changed = {
        CC.cubin_name(variant.name, other.source(), NVRTC_OPTIONS, "sm_90", nvrtc="13.0"),
        CC.cubin_name(variant.name, variant.source() + "\n", NVRTC_OPTIONS, "sm_90",
                      nvrtc="13.0"),
        CC.cubin_name(variant.name, variant.source(), (*NVRTC_OPTIONS, "--fmad=false"),
                      "sm_90", nvrtc="13.0"),
        CC.cubin_name(variant.name, variant.source(), NVRTC_OPTIONS[::-1], "sm_90",
                      nvrtc="13.0"),
        CC.cubin_name(*args[:3], "sm_100", nvrtc="13.0"),
        CC.cubin_name(*args, nvrtc="13.1"),
        CC.cubin_name(*args, nvrtc="13.0+1234"),
    }
    assert name not in changed and len(changed) == 7
    # the label only names the file: the hash is the same whatever it says
    assert CC.cubin_name("x", *args[1:], nvrtc="13.0").split(".")[2] == name.split(".")[2]


@pytest.mark.parametrize("label, arch, message", [
    ("a/b", "sm_90", "label: expected letters, digits and underscores"),
    ("", "sm_90", "label: expected"),
    ("ok", "compute_90", "arch: expected an architecture like 'sm_90'"),
    ("ok", "sm_", "arch: expected"),
])
def test_a_bad_label_or_arch_is_named(label, arch, message):
    with pytest.raises(ValueError, match=message):
        CC.cubin_name(label, TINY, NVRTC_OPTIONS, arch, nvrtc="13.0")


def test_the_folder_is_kernels_in_splitkvs_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path / "c"))
    assert CC.cubin_dir() == tmp_path / "c" / "kernels"
    monkeypatch.delenv("SPLITKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert CC.cubin_dir() == tmp_path / "x" / "splitkv" / "kernels"


@pytest.mark.parametrize("data, message", [
    (b"", "no ELF header"),
    (b"not an ELF file at all" * 4, "no ELF header"),
    (b"\x7fELF\x01\x01" + bytes(90), "not a 64-bit little-endian ELF file"),
    (b"\x7fELF\x02\x01" + bytes(12) + b"\x3e\x00" + bytes(80), "ELF machine 62, not CUDA"),
])
def test_what_is_no_cubin_is_named(data, message):
    with pytest.raises(CC.CubinError, match=message):
        CC.check_cubin(data, "the file")


# ------------------------------------------------------------------ with NVRTC
@pytest.mark.nvrtc
def test_precompile_writes_a_whole_cubin_once(tmp_path):
    first = CC.precompile_module("tiny", TINY, NVRTC_OPTIONS, "sm_90", tmp_path)
    path = tmp_path / CC.cubin_name("tiny", TINY, NVRTC_OPTIONS, "sm_90")
    assert first["status"] == "written" and first["path"] == str(path)
    data = path.read_bytes()
    CC.check_cubin(data, path)                       # every table and section within its bytes
    assert first["bytes"] == len(data) and [p.name for p in tmp_path.iterdir()] == [path.name]
    again = CC.precompile_module("tiny", TINY, NVRTC_OPTIONS, "sm_90", tmp_path)
    assert again["status"] == "present" and path.read_bytes() == data
    dry = CC.precompile_module("tiny", TINY, NVRTC_OPTIONS, "sm_80", tmp_path, dry_run=True)
    assert dry["status"] == "would write" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.nvrtc
def test_a_cubin_cut_short_is_refused():
    from splitkv.runtime.kernel_source import compile_cubin

    data = CC.whole_cubin(compile_cubin(TINY, "sm_90", options=CC.cubin_options(NVRTC_OPTIONS))[0])
    CC.check_cubin(data, "whole")
    for size in (len(data) - 1, len(data) // 2, 64):
        with pytest.raises(CC.CubinError, match="cut short"):
            CC.check_cubin(data[:size], "cut")


@pytest.mark.nvrtc
def test_a_precompiled_cubin_is_the_binary_cupy_compiles(monkeypatch, tmp_path):
    """CuPy's own NVRTC path (private; the architecture given rather than read from a GPU),
    with the flag its cache adds before it (-ftz=true), makes the same bytes, but the last one
    its getCUBIN drops: a precompiled module computes what one compiled at run time does."""
    compiler = pytest.importorskip("cupy.cuda.compiler")
    names = ("_compile_using_nvrtc_no_warning", "_get_arch_for_options_for_nvrtc")
    if not all(hasattr(compiler, name) for name in names):
        pytest.skip("this CuPy compiles through other private functions")
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc",
                        lambda arch=None: ("-arch=sm_90", "cubin"))
    assert "-ftz=true" in CC.CUPY_ADDED_OPTIONS
    for variant in (KernelBuild("bfloat16", 64, 1),
                    KernelBuild("float16", 128, 2, kv_dtype="float8_e4m3fn")):
        theirs, _ = compiler._compile_using_nvrtc_no_warning(
            variant.source(), (*NVRTC_OPTIONS, "-ftz=true"), "90", "kernel.cu")
        record = CC.precompile_module(variant.name, variant.source(), NVRTC_OPTIONS, "sm_90",
                                      tmp_path)
        ours = Path(record["path"]).read_bytes()
        assert ours == theirs + b"\x00", variant.name


def _damage(path, how):
    if how == "cut short":
        path.write_bytes(path.read_bytes()[:-40])
    elif how == "garbage":
        path.write_bytes(b"\x00garbage" * 100)
    else:                                   # a folder where the file should be: unreadable
        path.unlink()
        path.mkdir()


@pytest.mark.nvrtc
@pytest.mark.parametrize("how, why", [("cut short", "cut short"), ("garbage", "no ELF header"),
                                      ("unreadable", "cannot read it")])
def test_a_damaged_file_is_skipped_with_one_notice(how, why, tmp_path, notices):
    CC.precompile_module("tiny", TINY, NVRTC_OPTIONS, "sm_90", tmp_path)
    path = tmp_path / CC.cubin_name("tiny", TINY, NVRTC_OPTIONS, "sm_90")
    assert CC.cached_cubin("tiny", TINY, NVRTC_OPTIONS, "sm_90", tmp_path) == path
    _damage(path, how)
    with notices() as said:
        for _ in range(3):
            assert CC.cached_cubin("tiny", TINY, NVRTC_OPTIONS, "sm_90", tmp_path) is None
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said.messages
    message = said.messages[0]
    assert str(path) in message and why in message and "NVRTC" in message
    if how != "unreadable":                 # precompile writes a damaged file again
        assert CC.precompile_module("tiny", TINY, NVRTC_OPTIONS, "sm_90",
                                    tmp_path)["status"] == "written"
        assert CC.cached_cubin("tiny", TINY, NVRTC_OPTIONS, "sm_90", tmp_path) == path


class FakeRawModule:
    """What ``load_module`` asks of ``cupy.RawModule``, recorded; ``refuse``: the driver
    refuses every file."""

    made: list = []
    refuse = False

    def __init__(self, *, code=None, path=None, options=()):
        self.code, self.path, self.options = code, path, options
        FakeRawModule.made.append("path" if path is not None else "code")

    def compile(self):
        if self.path is not None and FakeRawModule.refuse:
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")


@pytest.fixture
def fake_cupy(monkeypatch, tmp_path):
    """A stand-in CuPy, an sm_90 device, and splitkv's cache in tmp_path."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=FakeRawModule))
    monkeypatch.setattr(modules, "current_arch", lambda: "sm_90")
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(FakeRawModule, "made", [])
    monkeypatch.setattr(FakeRawModule, "refuse", False)
    return tmp_path / "kernels"


def _loads(source=TINY):
    before = modules.module_origins()
    module, origin = modules.load_module(source, NVRTC_OPTIONS, "tiny")
    after = modules.module_origins()
    return origin, {k: after[k] - before[k] for k in after}, module


@pytest.mark.nvrtc
def test_the_loader_takes_the_precompiled_file_and_compiles_without_one(fake_cupy):
    origin, counted, module = _loads()
    assert (origin, counted, FakeRawModule.made) == ("nvrtc", {"cubin": 0, "nvrtc": 1}, ["code"])
    assert module.code == TINY and module.options == NVRTC_OPTIONS
    CC.precompile_module("tiny", TINY, NVRTC_OPTIONS, "sm_90", fake_cupy)
    origin, counted, module = _loads()
    assert (origin, counted) == ("cubin", {"cubin": 1, "nvrtc": 0})
    assert module.path == str(fake_cupy / CC.cubin_name("tiny", TINY, NVRTC_OPTIONS, "sm_90"))
    origin, _, _ = _loads(TINY + "// another source\n")       # not this file: compiled
    assert origin == "nvrtc"


@pytest.mark.nvrtc
def test_the_loader_compiles_where_the_driver_refuses_the_file(fake_cupy, notices):
    CC.precompile_module("tiny", TINY, NVRTC_OPTIONS, "sm_90", fake_cupy)
    FakeRawModule.refuse = True
    with notices("the CUDA driver refused it") as said:
        origin, counted, _ = _loads()
    assert (origin, counted) == ("nvrtc", {"cubin": 0, "nvrtc": 1})
    assert FakeRawModule.made == ["path", "code"] and len(said) == 1
    assert said.at(logging.WARNING) and str(fake_cupy) in said.messages[0]


@pytest.mark.nvrtc
def test_the_loader_compiles_past_a_damaged_file(fake_cupy, notices):
    CC.precompile_module("tiny", TINY, NVRTC_OPTIONS, "sm_90", fake_cupy)
    path = fake_cupy / CC.cubin_name("tiny", TINY, NVRTC_OPTIONS, "sm_90")
    path.write_bytes(path.read_bytes()[:100])
    with notices("cut short"):
        origin, counted, _ = _loads()
    assert (origin, counted, FakeRawModule.made) == ("nvrtc", {"cubin": 0, "nvrtc": 1}, ["code"])
