"""``splitkv env`` and ``splitkv cache``: the report's lines with and without CuPy (a simulated
GPU for the device lines), where the caches are, and what ``cache clear`` removes and keeps."""

import importlib.metadata
import json
import os
import sys
import types
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from splitkv import cli
from splitkv.cli import cache as cache_cli
from splitkv.cli import env as env_cli
from splitkv.planner.first_use import FIRST_USE_ENV, ProbesDeferred, first_use_path
from splitkv.planner.profile_lookup import load_profile
from splitkv.planner.profiles import prior_profile, user_profile_path


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No SPLITKV_*, CUPY_* or cache variables but $SPLITKV_CACHE_DIR = tmp_path/cache and
    $CUPY_CACHE_DIR = tmp_path/kernels; returns the cache folder."""
    for name in list(os.environ):
        if name.startswith(env_cli.ENV_PREFIXES) or name in env_cli.ENV_NAMES:
            monkeypatch.delenv(name)
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "kernels"))
    return tmp_path / "cache"


@pytest.fixture
def no_cupy(monkeypatch):
    """CuPy not importable, whether or not it is installed here."""
    for name in ("cupy", "cupy_backends"):
        monkeypatch.setitem(sys.modules, name, None)


def env_lines(capsys, *argv) -> list[str]:
    assert cli.main(["env", *argv]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "Traceback" not in out
    return out.splitlines()


def value(lines, key) -> str:
    found = [line[len(key) + 2:] for line in lines if line.startswith(f"{key}: ")]
    assert len(found) == 1, (key, lines)
    return found[0]


def test_env_without_cupy_prints_every_key(clean_env, no_cupy, capsys):
    lines = env_lines(capsys)
    for key in env_cli.KEYS[:-1]:
        value(lines, key)
    assert value(lines, "cupy").startswith("CuPy is not installed (")
    assert value(lines, "nvrtc") == "n/a: no CuPy (see the cupy line)"
    assert value(lines, "profile") == ("shipped: splitkv:nvidia-h200.yaml (for NVIDIA H200, "
                                       "the reference device: no GPU here)")
    assert f"$SPLITKV_CACHE_DIR: {clean_env}" in lines
    assert not any(line.startswith("warning:") for line in lines)


def test_env_json_is_one_object_with_the_same_keys(clean_env, no_cupy, capsys):
    assert cli.main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == list(env_cli.KEYS)
    assert report["cache dir"] == {"path": str(clean_env), "exists": False, "files": 0,
                                   "bytes": 0, "from": "from $SPLITKV_CACHE_DIR"}
    assert report["environment"]["SPLITKV_CACHE_DIR"] == str(clean_env)


class FakeDistribution:
    def __init__(self, name, version):
        self.metadata, self.version = {"Name": name}, version


def test_env_warns_of_two_cupy_distributions(clean_env, no_cupy, monkeypatch, capsys):
    dists = [FakeDistribution("numpy", "2.0.0"), FakeDistribution("cupy-cuda13x", "14.2.0"),
             FakeDistribution("cupy-cuda12x", "13.6.0")]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(dists))
    lines = env_lines(capsys)
    assert value(lines, "cupy distributions") == "cupy-cuda12x 13.6.0, cupy-cuda13x 14.2.0"
    warned = [line for line in lines if line.startswith("warning: ")]
    assert len(warned) == 1 and warned[0].startswith(
        "warning: 2 CuPy distributions are installed (cupy-cuda12x 13.6.0, cupy-cuda13x 14.2.0)")
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(dists[:2]))
    lines = env_lines(capsys)
    assert value(lines, "cupy distributions") == "cupy-cuda13x 14.2.0"
    assert not any(line.startswith("warning: ") for line in lines)


def test_env_cache_paths_follow_the_variables(clean_env, no_cupy, monkeypatch, tmp_path,
                                              capsys):
    (clean_env / "profiles" / "first-use").mkdir(parents=True)
    (clean_env / "profiles" / "a.yaml").write_bytes(b"x" * 10)
    (clean_env / "profiles" / "first-use" / "b.yaml").write_bytes(b"y" * 20)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / f"{'0' * 40}.cubin").write_bytes(b"z" * 7)
    lines = env_lines(capsys)
    assert value(lines, "cache dir") == f"{clean_env} (2 files, 30 bytes; from $SPLITKV_CACHE_DIR)"
    assert value(lines, "profiles cache") == f"{clean_env / 'profiles'} (1 file, 10 bytes)"
    assert value(lines, "first-use cache") == (f"{clean_env / 'profiles' / 'first-use'} "
                                               "(1 file, 20 bytes)")
    assert value(lines, "kernel cache") == (f"{tmp_path / 'kernels'} (1 file, 7 bytes; from "
                                            "$CUPY_CACHE_DIR)")
    assert value(lines, "precompiled kernels") == f"{clean_env / 'kernels'} (absent)"
    (clean_env / "kernels").mkdir()
    (clean_env / "kernels" / f"decode_x.sm_90.{'1' * 40}.cubin").write_bytes(b"c" * 5)
    lines = env_lines(capsys)
    assert value(lines, "precompiled kernels") == f"{clean_env / 'kernels'} (1 file, 5 bytes)"
    assert value(lines, "cache dir") == f"{clean_env} (3 files, 35 bytes; from $SPLITKV_CACHE_DIR)"
    monkeypatch.delenv("SPLITKV_CACHE_DIR")
    monkeypatch.delenv("CUPY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    lines = env_lines(capsys)
    assert value(lines, "cache dir") == (f"{tmp_path / 'xdg' / 'splitkv'} (absent; in "
                                         "$XDG_CACHE_HOME)")
    assert value(lines, "kernel cache") == (f"{tmp_path / 'home' / '.cupy' / 'kernel_cache'} "
                                            "(absent; CuPy's default)")


def test_env_names_the_profile_and_where_it_came_from(clean_env, no_cupy, monkeypatch, capsys):
    path = load_profile().save(user_profile_path("NVIDIA H200"))
    assert value(env_lines(capsys), "profile") == (f"user cache: {path} (for NVIDIA H200, the "
                                                   "reference device: no GPU here)")
    monkeypatch.setenv("SPLITKV_PROFILE", str(path))
    assert value(env_lines(capsys), "profile").startswith(f"explicit ($SPLITKV_PROFILE): {path} (")
    monkeypatch.setenv("SPLITKV_PROFILE", str(clean_env / "missing.yaml"))
    assert value(env_lines(capsys), "profile").startswith(
        f"error: profile {clean_env / 'missing.yaml'}: cannot read it")


def test_env_reports_a_profile_named_for_another_gpu_as_planning_uses_it(clean_env, no_cupy,
                                                                        monkeypatch, tmp_path,
                                                                        capsys):
    """$SPLITKV_PROFILE calibrated on another GPU than the reference H200: without a GPU,
    planning (splitkv plan, load_profile()) plans for that GPU with it, and the profile line
    names it so, with a note, rather than an error."""
    path = replace(load_profile(), device_name="NVIDIA H100 80GB HBM3", num_sms=114).save(
        tmp_path / "h100.yaml")
    monkeypatch.setenv("SPLITKV_PROFILE", str(path))
    assert value(env_lines(capsys), "profile") == (
        f"explicit ($SPLITKV_PROFILE): {path} (for NVIDIA H100 80GB HBM3, 114 SMs, the "
        "profile's GPU: no GPU here); calibrated on another GPU than the reference NVIDIA H200: "
        "planning without a GPU plans for its GPU with it, a wrapper on another GPU refuses it")
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    assert f"profile:   NVIDIA H100 80GB HBM3, 114 SMs (calibrated; {path})" in out


def test_env_on_a_gpu_says_a_profile_for_another_gpu_is_refused_there(clean_env, monkeypatch,
                                                                       tmp_path):
    """On a GPU, load_profile refuses $SPLITKV_PROFILE calibrated on another one, as a wrapper
    there does: the line says so, and what planning without a GPU does with it."""
    monkeypatch.setattr(env_cli, "_NoProbes", NoProbes)
    path = replace(load_profile(), device_name="NVIDIA H100 80GB HBM3").save(tmp_path / "h.yaml")
    monkeypatch.setenv("SPLITKV_PROFILE", str(path))
    assert env_cli._profile({"name": "NVIDIA H200", "num_sms": 132}) == (
        f"error: profile {path}: made for 'NVIDIA H100 80GB HBM3', not 'NVIDIA H200' (named by "
        "$SPLITKV_PROFILE); calibrated on another GPU: a wrapper on this one refuses it as well, "
        "planning without a GPU (splitkv plan) plans for NVIDIA H100 80GB HBM3 with it")
    assert env_cli._profile({"name": "NVIDIA H100 80GB HBM3", "num_sms": 132}) == (
        f"explicit ($SPLITKV_PROFILE): {path} (for NVIDIA H100 80GB HBM3, 132 SMs)")
    assert env_cli._profile({"name": "NVIDIA H100 80GB HBM3", "num_sms": 114}).startswith(
        f"error: profile {path}: made for 132 SMs, this device has 114 (a MIG slice or another "
        "model?) (named by $SPLITKV_PROFILE); calibrated on another GPU: ")


class NoProbes:
    driver_version = "555"

    def probe(self):
        raise ProbesDeferred("not here")

    calibrate = probe


def test_env_profile_of_a_gpu_without_one_reads_the_first_use_cache(clean_env, monkeypatch):
    """A GPU with no profile: the first-use model where one is cached, else the prior and what
    a wrapper's first plan would do; nothing is timed."""
    monkeypatch.setattr(env_cli, "_NoProbes", NoProbes)
    device = {"name": "NVIDIA Made Up", "num_sms": 100}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prior = env_cli._profile(device)
        monkeypatch.setenv(FIRST_USE_ENV, "off")
        off = env_cli._profile(device)
        monkeypatch.delenv(FIRST_USE_ENV)
        cached = prior_profile("NVIDIA Made Up", 100).save(first_use_path("NVIDIA Made Up", "555"))
        first_use = env_cli._profile(device)
    assert prior == ("prior: roofline prior (for NVIDIA Made Up, 100 SMs); a wrapper's first "
                     "plan times the first-use probes (seconds) and caches the model in "
                     f"{cached.parent}")
    assert off.endswith("; $SPLITKV_FIRST_USE=off keeps it")
    assert first_use == f"first-use: {cached} (for NVIDIA Made Up, 100 SMs)"


def test_env_with_a_gpu_lists_cuda_and_the_devices(clean_env, monkeypatch, capsys):
    """A simulated CuPy and GPU: the versions as CUDA numbers them, one line a device, the
    profile looked up for the device in use."""
    import splitkv.runtime

    fake = types.SimpleNamespace(__version__="14.2.0", __file__="/x/cupy/__init__.py",
                                 cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(
                                     runtimeGetVersion=lambda: 13020)))
    h200 = {"name": "NVIDIA H200", "num_sms": 132, "cc": "90", "device_id": 0}

    def device_info(device_id=None):
        if device_id not in (None, 0):
            raise RuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        return h200

    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (True, "NVIDIA H200"))
    monkeypatch.setattr(splitkv.runtime, "nvrtc_available", lambda: (True, "NVRTC 13.0"))
    monkeypatch.setattr(splitkv.runtime, "device_info", device_info)
    monkeypatch.setattr(splitkv.runtime, "driver_version", lambda: "13000")
    lines = env_lines(capsys)
    assert value(lines, "cupy") == "14.2.0 (/x/cupy)"
    assert value(lines, "cuda runtime") == "13.2 (CuPy's build)"
    assert value(lines, "nvrtc") == "13.0"
    assert value(lines, "cuda driver") == "13.0 (the newest CUDA this driver runs)"
    assert value(lines, "gpu") == "usable (NVIDIA H200)"
    assert value(lines, "devices") == "1"
    assert value(lines, "device 0") == "NVIDIA H200, compute capability 9.0, 132 SMs"
    assert value(lines, "profile") == "shipped: splitkv:nvidia-h200.yaml (for NVIDIA H200, 132 SMs)"


def test_env_says_why_a_probe_failed_rather_than_a_traceback(clean_env, monkeypatch, capsys):
    import splitkv.runtime

    def broken(*args):
        raise RuntimeError("the driver went away\nsecond line")

    monkeypatch.setattr(splitkv.runtime, "gpu_available", broken)
    monkeypatch.setattr(cache_cli, "folder_usage", broken)
    lines = env_lines(capsys)
    for key in ("gpu", "devices", "cache dir", "kernel cache"):
        assert value(lines, key) == "unavailable (RuntimeError: the driver went away)", key


# ------------------------------------------------------------------ splitkv cache clear
def make_caches(cache: Path, kernels: Path) -> dict[Path, bytes]:
    """A cache of each kind of file, splitkv's and CuPy's and others'; {path: its bytes}."""
    files = {cache / "profiles" / "nvidia-h100.yaml": b"p" * 11,
             cache / "profiles" / "nvidia-h100.csv": b"m" * 13,
             cache / "profiles" / "nvidia-h100-decisions.png": b"g" * 3,
             cache / "profiles" / ".nvidia-h100.yaml.123.abcd.tmp": b"t" * 2,
             cache / "profiles" / "first-use" / "nvidia-h100-driver-1-splitkv-0.yaml": b"f" * 17,
             cache / "profiles" / "notes.txt": b"mine",
             cache / "unrelated.yaml": b"mine too",
             kernels / f"{'ab' * 20}.cubin": b"k" * 19,
             kernels / f"{'cd' * 16}_2.cubin": b"k" * 5,
             kernels / "mine.cubin": b"not CuPy's"}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def files_under(*folders) -> set[Path]:
    return {p for folder in folders for p in folder.rglob("*") if p.is_file()}


def test_cache_clear_removes_splitkvs_files_and_nothing_else(clean_env, tmp_path, capsys):
    kernels = tmp_path / "kernels"
    files = make_caches(clean_env, kernels)
    assert cli.main(["cache", "clear"]) == 0
    out = capsys.readouterr().out.splitlines()
    ours = [p for p in files if p.parent.name in ("profiles", "first-use") and p.suffix != ".txt"]
    assert files_under(clean_env, kernels) == set(files) - set(ours)
    assert sorted(line.split()[1] for line in out if line.startswith("removed /")) == \
        sorted(map(str, ours))
    assert out[-1] == "removed 5 files, 46 bytes"
    assert f"kept 1 file in {clean_env / 'profiles'}: not named as splitkv names its files" in out
    assert f"kept CuPy's kernel cache {kernels} (3 files, 34 bytes): --kernels clears it too" in out
    assert cli.main(["cache", "clear", "--kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert files_under(clean_env, kernels) == {clean_env / "profiles" / "notes.txt",
                                               clean_env / "unrelated.yaml", kernels / "mine.cubin"}
    assert out[-1] == "removed 2 files, 24 bytes" and kernels.is_dir()


def test_cache_clear_removes_the_precompiled_kernels_with_kernels_only(clean_env, tmp_path,
                                                                        capsys):
    ours = {clean_env / "kernels" / f"decode_bfloat16_d128_r16_s3.sm_90.{'ab' * 20}.cubin": 11,
            clean_env / "kernels" / f"device_plan.sm_100.{'cd' * 20}.cubin": 13,
            clean_env / "kernels" / f".device_plan.sm_90.{'ef' * 20}.cubin.12.0a1b.tmp": 2}
    others = {clean_env / "kernels" / "notes.txt": 4,
              clean_env / "kernels" / f"{'ab' * 20}.cubin": 3}       # CuPy's name, not ours
    for path, size in {**ours, **others}.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"k" * size)
    assert cli.main(["cache", "clear"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert files_under(clean_env) == set(ours) | set(others)
    assert (f"kept splitkv's precompiled kernels {clean_env / 'kernels'} (5 files, 33 bytes): "
            "--kernels clears them too") in out
    assert cli.main(["cache", "clear", "--kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert files_under(clean_env) == set(others)
    assert sorted(line.split()[1] for line in out if line.startswith("removed /")) == \
        sorted(map(str, ours))
    assert (f"kept 2 files in {clean_env / 'kernels'}: not named as splitkv names its files"
            in out)
    assert out[-1] == "removed 3 files, 26 bytes"


def test_cache_clear_dry_run_removes_nothing(clean_env, tmp_path, capsys):
    kernels = tmp_path / "kernels"
    files = make_caches(clean_env, kernels)
    assert cli.main(["cache", "clear", "--kernels", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert files_under(clean_env, kernels) == set(files)
    assert all(p.read_bytes() == data for p, data in files.items())
    assert sum(line.startswith("would remove /") for line in out) == 7
    assert out[-1] == "would remove 7 files, 70 bytes (--dry-run: nothing removed)"


def test_cache_clear_never_touches_the_shipped_profiles(clean_env, monkeypatch, capsys):
    """Where $SPLITKV_CACHE_DIR is the package's folder, its profiles are not clearable (asked
    of ``clearable``, which lists and removes nothing); and where one is taken for the shipped
    folder, ``cache clear`` keeps it."""
    shipped = cache_cli.shipped_profiles_dir()
    assert (shipped / "nvidia-h200.yaml").is_file()
    chosen, kept = cache_cli.clearable(shipped, cache_cli.PROFILE_FILES)   # *.yaml, yet kept
    assert chosen == [] and kept >= 1
    (clean_env / "profiles").mkdir(parents=True)
    (clean_env / "profiles" / "nvidia-h200.yaml").write_text("kept")
    monkeypatch.setenv("SPLITKV_CACHE_DIR", str(clean_env))
    monkeypatch.setattr(cache_cli, "shipped_profiles_dir", lambda: clean_env / "profiles")
    assert cli.main(["cache", "clear"]) == 0
    assert (clean_env / "profiles" / "nvidia-h200.yaml").read_text() == "kept"


def test_cache_clear_leaves_an_empty_cupy_cache_dir_alone(clean_env, monkeypatch, tmp_path,
                                                          capsys):
    """$CUPY_CACHE_DIR set but empty: CuPy writes into the working folder, never cleared."""
    monkeypatch.setenv("CUPY_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    kernel = tmp_path / f"{'ab' * 20}.cubin"
    kernel.write_bytes(b"k")
    assert cli.main(["cache", "clear", "--kernels"]) == 0
    assert "$CUPY_CACHE_DIR is set but empty" in capsys.readouterr().out
    assert kernel.is_file()


def test_cache_without_an_action_prints_its_usage_and_exits_2(capsys):
    assert cli.main(["cache"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: splitkv cache ") and "clear" in err


@pytest.mark.parametrize("argv, message", [
    (["cache", "empty"], "splitkv cache: error: argument ACTION: invalid choice: 'empty'"),
    (["cache", "clear", "--all"], "splitkv cache clear: error: unrecognized arguments: --all"),
    (["env", "--yaml"], "splitkv env: error: unrecognized arguments: --yaml"),
])
def test_a_bad_argument_is_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(message), err


def test_env_flags_settings_a_later_call_would_refuse(clean_env, no_cupy, monkeypatch, capsys):
    monkeypatch.setenv(FIRST_USE_ENV, "bogus")
    lines = env_lines(capsys)
    assert any(line.startswith(f"warning: ${FIRST_USE_ENV}: expected one of off, probe, "
                               "calibrate, got 'bogus'") for line in lines), lines
    clean_env.parent.mkdir(exist_ok=True)
    clean_env.write_text("not a folder")                 # $SPLITKV_CACHE_DIR names a file
    monkeypatch.delenv(FIRST_USE_ENV)
    assert value(env_lines(capsys), "cache dir").startswith(f"{clean_env} (not a folder;")


def test_cache_clear_says_a_cache_dir_that_is_a_file_and_still_clears_cupys(clean_env,
                                                                           tmp_path, capsys):
    clean_env.parent.mkdir(exist_ok=True)
    clean_env.write_text("not a folder")
    assert cli.main(["cache", "clear"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith(f"splitkv cache: {clean_env} (from $SPLITKV_CACHE_DIR) is not a "
                          "folder: none of splitkv's files cleared")
    assert out.splitlines()[-1] == "removed 0 files, 0 bytes"
    cupy_file = tmp_path / "kernels" / f"{'ab' * 32}.cubin"  # CuPy's cache is elsewhere
    cupy_file.parent.mkdir()
    cupy_file.write_bytes(b"k" * 5)
    assert cli.main(["cache", "clear", "--kernels"]) == 1
    assert not cupy_file.exists() and clean_env.read_text() == "not a folder"
