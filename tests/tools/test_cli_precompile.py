"""``splitkv precompile`` without a GPU: it writes, for a named architecture, the CUBIN of every
build ``warmup()`` of that configuration would compile (the core's ``reachable_builds``,
worked out here on their own), under the names the runtime looks them up by; keeps what is
there; lists without writing (``--dry-run``, ``--json``); and refuses a wrong argument in one
line with exit status 2, a failed compile or write with exit status 1."""

from __future__ import annotations

import json
import sys

import pytest

from splitkv import cli
from splitkv.cli import precompile as precompile_cli
from splitkv.core.architectures import architecture_properties
from splitkv.core.builds import reachable_builds, shape_build
from splitkv.runtime import cubin_cache as CC
from splitkv.runtime.kernel_source import NVRTC_OPTIONS, KernelBuild

# a configuration of two builds (the soft cap on and off; head_dim 64, no clusters): seconds
SMALL = ["--head-dim", "64", "--no-clusters", "--soft-cap"]


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """splitkv's cache in tmp_path/cache; returns its kernels folder."""
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def expected_names(arch_cc: int, head_dim: int, soft_caps, clusters: bool) -> set[str]:
    """The files of the builds a 32/8 bfloat16 wrapper with pages of 16 warms up on a GPU of
    ``arch_cc``, as ``BatchDecodeWrapper.warmup`` asks ``core.builds`` for them."""
    base = shape_build("bfloat16", head_dim, 4, 16, None, build_type=KernelBuild)
    builds = reachable_builds(base, device=architecture_properties(arch_cc), page_size=16,
                              group_size=4, soft_caps=soft_caps, clusters=clusters)
    return {CC.cubin_name(b.name, b.source(), NVRTC_OPTIONS, f"sm_{arch_cc}") for b in builds}


@pytest.mark.nvrtc
def test_precompile_writes_what_warmup_would_compile_and_keeps_it(cache, capsys):
    assert cli.main(["precompile", "--arch", "sm_90", *SMALL]) == 0
    out = capsys.readouterr().out.splitlines()
    want = expected_names(90, 64, (False, True), clusters=False)
    assert len(want) == 2 and {p.name for p in cache.iterdir()} == want
    for path in cache.iterdir():
        CC.check_cubin(path.read_bytes(), path)
    assert out[0].startswith(f"splitkv's kernel cache: {cache} (from $SPLITKV_CACHE_DIR); NVRTC ")
    assert sorted(line.split()[1] for line in out if line.startswith("wrote ")
                  and line.endswith("s)")) == sorted(want)
    assert out[-1].startswith("wrote 2 of 2 modules (0 already there) in ")
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert cli.main(["precompile", "--arch", "90", *SMALL]) == 0          # kept as they are
    out = capsys.readouterr().out.splitlines()
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    assert out[-1].startswith("wrote 0 of 2 modules (2 already there) in ")


@pytest.mark.nvrtc
def test_dry_run_lists_each_arch_and_the_planning_kernel_and_writes_nothing(cache, capsys):
    assert cli.main(["precompile", "--arch", "sm_80,sm_90", "--arch", "9.0", "--graph-stable",
                     "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["arches"] == ["sm_80", "sm_90"] and report["dry_run"] is True
    assert report["cache"] == str(cache) and not cache.exists()
    assert report["configuration"]["graph_stable"] is True
    modules = report["modules"]
    assert {m["status"] for m in modules} == {"would write"}
    for arch in ("sm_80", "sm_90"):
        labels = [m["label"] for m in modules if m["arch"] == arch]
        assert "device_plan" in labels and len(labels) == len(set(labels)) >= 2
    # the same module for two architectures: two files
    plans = [m["path"] for m in modules if m["label"] == "device_plan"]
    assert len(set(plans)) == 2
    assert cli.main(["precompile", "--arch", "sm_90", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "would write 4 of 4 modules (0 already there; --dry-run: nothing written)"
    assert {line.split()[2] for line in out if line.startswith("would write decode")} == \
        expected_names(90, 128, (False,), clusters=True)


BAD_ARGUMENTS = [
    (["--arch", "sm_9x"], "error: argument --arch: expected an architecture like sm_90 (or 90, "
                          "9.0), got 'sm_9x'"),
    (["--arch", "sm_90,"], "error: argument --arch: expected architectures like sm_90 or "
                           "sm_90,sm_100, got 'sm_90,'"),
    (["--arch", "sm_90", "--heads", "32/5"], "error: argument --heads: num_qo_heads: 32 is not "
                                             "a multiple of num_kv_heads=5"),
    (["--arch", "sm_90", "--head-dim", "80"], "error: argument --head-dim: head_dim: 80 is not "
                                              "supported"),
    (["--arch", "sm_90", "--head-dim", "96", "--kv-dtype", "fp8_e4m3"],
     "--kv-dtype: fp8 K/V ('float8_e4m3fn') is not supported at head_dim 96"),
    (["--arch", "sm_90", "--page-size", "0"], "error: argument --page-size: expected an integer "
                                              "from 1"),
    (["--arch", "sm_90", "--max-q-len", "17"], "error: argument --max-q-len: expected an integer "
                                               "from 1 to 16, got 17"),
    (["--arch", "sm_90", "--dtype", "float32"], "error: argument --dtype: invalid choice: "
                                                "'float32'"),
    (["--arch", "sm_90", "--kv-dtype", "int8"], "error: argument --kv-dtype: "),
    (["--arch", "sm_90", "--jobs", "0"], "error: argument --jobs: expected an integer from 1 to "
                                         "256, got 0"),
    (["--arch"], "error: argument --arch: expected one argument"),
    (["--arch", "sm_90", "--bogus"], "error: unrecognized arguments: --bogus"),
    (["--arch", "sm_90", "--graph-stable", "--unified-max"],
     "--unified-max: graph-stable wrappers do not take it"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS,
                         ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_a_wrong_argument_is_one_line_and_exit_2(argv, message, cache, capsys):
    assert cli.main(["precompile", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("splitkv precompile: ") and message in err, err
    assert not cache.exists()


def test_without_a_gpu_the_arch_is_required(cache, monkeypatch, capsys):
    monkeypatch.setattr(precompile_cli, "_current_gpu", lambda: (None, "no usable GPU here"))
    assert cli.main(["precompile", "--heads", "32/8"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("splitkv precompile: --arch: expected the architectures to compile "
                          "for (like --arch sm_90; sm_80, sm_86, sm_89, sm_90, sm_100, sm_120): "
                          "no GPU here to take one from (no usable GPU here)")


def test_without_nvrtc_it_says_so_in_one_line(cache, monkeypatch, capsys):
    import splitkv.runtime as runtime

    monkeypatch.setattr(runtime, "nvrtc_available", lambda: (False, "libnvrtc not found"))
    assert cli.main(["precompile", "--arch", "sm_90"]) == 1
    assert capsys.readouterr().err == ("splitkv precompile: needs NVRTC, which does not load: "
                                       "libnvrtc not found\n")


class NVRTCUsed(RuntimeError):
    pass


@pytest.fixture
def no_nvrtc(monkeypatch):
    """NVRTC absent, whether or not it is here: CuPy's NVRTC module raises on any use, and so
    does each splitkv function that reaches it, so a test fails if one is called anyway."""
    import types

    import splitkv.runtime as runtime

    def used(*args, **kwargs):
        raise NVRTCUsed("NVRTC was used")

    def attribute(name):
        if name.startswith("__"):
            raise AttributeError(name)
        used()

    fake = types.ModuleType("cupy_backends.cuda.libs.nvrtc")
    fake.__getattr__ = attribute
    try:
        import cupy_backends.cuda.libs as libs
    except ImportError:              # no CuPy: nothing to load NVRTC with
        libs = None
    if libs is not None:
        monkeypatch.setattr(libs, "nvrtc", fake, raising=False)
        monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.nvrtc", fake)
    for name in ("compile_cubin", "compile_ptx", "nvrtc_archs"):
        monkeypatch.setattr(f"splitkv.runtime.kernel_source.{name}", used)
    monkeypatch.setattr(CC, "nvrtc_build", used)
    # its probe, unremembered: it tries the module above, which raises
    monkeypatch.setattr(runtime, "nvrtc_available", runtime.nvrtc_available.__wrapped__)


def expected_labels(arch_cc: int, head_dim: int, clusters: bool) -> set[str]:
    """The labels (no file names: those need NVRTC) of ``expected_names``' builds."""
    base = shape_build("bfloat16", head_dim, 4, 16, None, build_type=KernelBuild)
    return {b.name for b in reachable_builds(base, device=architecture_properties(arch_cc),
                                             page_size=16, group_size=4, soft_caps=(False,),
                                             clusters=clusters)}


def test_dry_run_without_nvrtc_lists_the_modules_by_label(cache, no_nvrtc, capsys):
    """A dry run needs no NVRTC: it lists each module a run would compile by its label and
    architecture (a file's name hashes the NVRTC build, so none is named) and writes nothing;
    a run that compiles still refuses in one line."""
    from splitkv.runtime import nvrtc_available

    assert nvrtc_available()[0] is False
    assert cli.main(["precompile", "--arch", "sm_90", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"splitkv's kernel cache: {cache} (from $SPLITKV_CACHE_DIR); NVRTC "
                             "does not load here: ")
    assert out[1] == "32/8 heads, head_dim 128, page 16, bfloat16; sm_90"
    listed = [line.split()[2] for line in out[2:-1]]
    assert all(line.endswith(" for sm_90") for line in out[2:-1])
    assert sorted(listed) == sorted(expected_labels(90, 128, clusters=True)) and len(listed) == 4
    assert out[-1] == ("would compile 4 modules (--dry-run without NVRTC: the files are named by "
                       "the NVRTC that compiles them, so which are already there is not known; "
                       "nothing written)")
    assert cli.main(["precompile", "--arch", "sm_80,sm_90", "--graph-stable", "--dry-run",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["nvrtc"] is None and report["nvrtc_error"] and report["dry_run"] is True
    assert report["arches"] == ["sm_80", "sm_90"]
    modules = report["modules"]
    assert {(m["status"], m["path"]) for m in modules} == {("would compile", None)}
    for arch in ("sm_80", "sm_90"):
        labels = [m["label"] for m in modules if m["arch"] == arch]
        assert "device_plan" in labels and len(labels) == len(set(labels)) >= 2
    assert not cache.exists()
    assert cli.main(["precompile", "--arch", "sm_90"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("splitkv precompile: needs NVRTC, which does not load: ")
    assert err.count("\n") == 1 and not cache.exists()


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch, message", [
    ("sm_75", "--arch: expected one of sm_80, sm_86, sm_89, sm_90, sm_100, sm_120 (or this "
              "machine's GPU's), got sm_75"),
    ("sm_87", "--arch: expected one of sm_80, "),   # NVRTC compiles for it; splitkv has no limits
    ("sm_1000", "--arch: expected one of sm_80, "),
    ("sm_30", "--arch: expected one of sm_80, "),
])
def test_an_architecture_without_its_limits_or_compiler_is_refused(arch, message, cache, capsys):
    """splitkv's own architectures are the list a refusal gives (NVRTC compiles for more)."""
    assert cli.main(["precompile", "--arch", arch]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("splitkv precompile: --arch: ") and message in err, err


@pytest.mark.nvrtc
def test_an_architecture_this_nvrtc_cannot_compile_for_is_refused(cache, monkeypatch, capsys):
    monkeypatch.setattr("splitkv.runtime.kernel_source.nvrtc_archs", lambda: [75, 80, 86])
    assert cli.main(["precompile", "--arch", "sm_90"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("splitkv precompile: --arch: NVRTC ") and err.endswith(
        "compiles for sm_75, sm_80, sm_86; got sm_90\n"), err


@pytest.mark.nvrtc
def test_a_failed_compile_or_write_is_one_line_and_exit_1(cache, monkeypatch, capsys, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path / "a-file"))
    assert cli.main(["precompile", "--arch", "sm_90", *SMALL]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("splitkv precompile: "), err

    def broken(*args, **kwargs):
        raise RuntimeError("NVRTC failed to compile tiny.cu for sm_90: NVRTC_ERROR\nthe log")

    monkeypatch.setattr("splitkv.runtime.kernel_source.compile_cubin", broken)
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["precompile", "--arch", "sm_90", *SMALL]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == ("splitkv precompile: NVRTC failed to compile tiny.cu for "
                                 "sm_90: NVRTC_ERROR\n")


@pytest.mark.nvrtc
def test_alibi_plans_warm_up_their_own_builds_too(cache, capsys):
    """--alibi (warmup(alibi=True): the wrapper's plans take alibi_slopes): the builds of the
    same grids, each with ALiBi, per-shape and graph-stable alike."""
    for graph_stable in ([], ["--graph-stable"]):
        args = ["precompile", "--arch", "sm_90", "--dry-run", "--json", "--head-dim", "64",
                "--no-clusters", *graph_stable]
        assert cli.main(args) == 0
        plain = {m["label"] for m in json.loads(capsys.readouterr().out)["modules"]}
        assert cli.main([*args, "--alibi"]) == 0
        labels = {m["label"] for m in json.loads(capsys.readouterr().out)["modules"]}
        assert labels and all("_alibi" in label for label in labels if label != "device_plan")
        assert {label.replace("_alibi", "") for label in labels} == plain
