"""Random command lines for ``splitkv plan`` and ``splitkv demo`` (on the CPU fallback, tiny):
the only outcomes are exit 0 with output, or exit 2 with one line on stderr that names the
argument -- never a traceback or another exit status.

Derandomized, so the suite runs the same examples every time; SPLITKV_FUZZ_EXAMPLES=N runs N
of each (random) for a longer search, and ``-s`` prints how the outcomes fell.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import splitkv
from splitkv import cli
from splitkv.core.validation import STRATEGIES

LONG_RUN = int(os.environ.get("SPLITKV_FUZZ_EXAMPLES", "0"))
SHIPPED_PROFILE = str(Path(splitkv.__file__).parent / "planner" / "profiles" / "nvidia-h200.yaml")

# What a refusal names: the command-line argument (argparse's "argument --x"), or the library
# argument its check names ("num_splits: ...", "profile ...: ...").
NAMES_AN_ARGUMENT = re.compile(
    r"^splitkv( plan| demo)?: (error: (argument --[a-z-]+: |unrecognized arguments: |"
    r"the following arguments are required: )|--(num-splits|q-len) \d+: |"
    r"--(strategy|num-splits|kv-dtype): |"
    r"(num_splits|strategy|kv_lens|page_size|head_dim|num_qo_heads|num_kv_heads|max_chunks): |"
    r"profile )")

EDGE_INTS = ["0", "-1", "1", "2147483647", "2147483648", "-2147483649", "1048576", "1048577",
             "10" * 20, "1e3", "0x10", " 7", "+8", "1_000", "", " ", "nan", "inf", "\u0663",
             "3.0", "-0", "--1"]

def mostly(valid, invalid):
    """``valid`` nine times in ten, so that half the command lines of a few arguments get past
    the parser."""
    return st.integers(0, 9).flatmap(lambda i: invalid if i == 0 else valid)


int_text = mostly(st.integers(1, 70).map(str),
                  st.one_of(st.integers(-3, 0).map(str), st.sampled_from(EDGE_INTS)))
junk = st.text(max_size=8)

lens_text = mostly(
    st.lists(mostly(st.integers(0, 5000).map(str), st.sampled_from(EDGE_INTS)),
             min_size=1, max_size=6).map(",".join),
    st.one_of(junk, st.just("")))
heads_text = mostly(
    st.tuples(st.sampled_from([1, 2, 4, 5, 8, 32, 40, 64]), st.sampled_from([1, 2, 4, 8, 0]))
    .map(lambda t: f"{t[0]}/{t[1]}"),
    st.one_of(st.sampled_from(["32:8", "/", "8", "1/1/1", "2147483647/1", "2147483648/1",
                               "-32/-8", "32/ 8", "a/b"]), junk))
path_text = mostly(st.just(SHIPPED_PROFILE),
                   st.sampled_from(["/no/such/profile.yaml", "/", "/dev/null", "", "broken.yaml",
                                    "empty.yaml", "not-a-profile.yaml"]))

PLAN_VALUES = {
    "--batch": int_text, "--kv-len": int_text, "--lens": lens_text, "--heads": heads_text,
    "--head-dim": mostly(st.sampled_from(["64", "96", "128", "256"]), st.one_of(st.just("80"), int_text)),
    "--page-size": int_text, "--profile": path_text,
    "--device-name": mostly(st.sampled_from(["NVIDIA H200", "NVIDIA H100 80GB HBM3"]),
                            st.one_of(st.sampled_from(["", " "]), junk)),
    "--num-sms": int_text, "--num-splits": int_text,
    "--strategy": mostly(st.sampled_from(STRATEGIES), junk), "--top": int_text,
    "--window-left": mostly(st.sampled_from(["-1", "0", "63", "4095"]), int_text),
    "--q-len": mostly(st.sampled_from(["1", "2", "4", "16"]), st.one_of(st.just("17"), int_text)),
    "--kv-dtype": mostly(st.sampled_from(["fp8_e4m3", "float8_e5m2"]), junk),
}


@st.composite
def plan_argv(draw):
    argv = ["plan"]
    for flag in draw(st.lists(st.sampled_from(sorted(PLAN_VALUES)), max_size=5)):
        argv += [flag, draw(PLAN_VALUES[flag])]
    ending = draw(st.sampled_from(["", "", "", "", "", "", "flag", "junk"]))   # mostly pairs
    if ending == "flag":
        argv.append(draw(st.sampled_from(sorted(PLAN_VALUES))))     # a flag without its value
    elif ending == "junk":
        argv.append(draw(junk))
    return argv


@st.composite
def demo_argv(draw):
    # always --cases, and of the real ones only b16-ragged: it runs in a quarter of a second on
    # the CPU fallback (all five take three)
    argv = ["demo", "--cpu"]
    if draw(st.booleans()):
        argv += ["--seed", draw(st.one_of(int_text, st.integers(0, 2**70).map(str)))]
    return argv + ["--cases", draw(st.one_of(
        st.lists(st.sampled_from(["b16-ragged", "nope", "", " ", "B16-RAGGED"]),
                 max_size=3).map(",".join), junk))]


OUTCOMES: Counter = Counter()


@pytest.fixture(scope="module")
def profile_files(tmp_path_factory):
    """Profiles that are broken in their own ways, named as ``path_text`` names them, and no
    user cache or $SPLITKV_PROFILE to find another."""
    folder = tmp_path_factory.mktemp("profiles")
    (folder / "broken.yaml").write_text("device_name: [unclosed\n  num_sms: :\n")
    (folder / "empty.yaml").write_text("")
    (folder / "not-a-profile.yaml").write_text("- 1\n- 2\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.setenv("XDG_CACHE_HOME", str(folder / "cache"))
        mp.delenv("SPLITKV_PROFILE", raising=False)
        yield folder
    print(f"\nCLI fuzz outcomes: {dict(sorted(OUTCOMES.items()))}")


def run_and_check(argv, allowed=(0, 2)):
    """Run ``splitkv argv`` in this process; check it ended one of the two allowed ways."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)          # any exception but SystemExit fails the test here
    out, err = out.getvalue(), err.getvalue()
    assert "Traceback" not in err, (argv, err)
    assert status in allowed, (argv, status, err)
    if status == 0:
        assert out.strip(), argv
        assert all(line.startswith("note: ") for line in err.splitlines()), (argv, err)
        OUTCOMES[f"{argv[0]}: exit 0"] += 1
    else:
        assert out == "", (argv, out)
        assert err.count("\n") == 1 and err.endswith("\n"), (argv, err)
        assert NAMES_AN_ARGUMENT.match(err), (argv, err)
        OUTCOMES[f"{argv[0]}: exit 2, " + ("argparse" if ": error: " in err else "library")] += 1


FUZZ = dict(deadline=None, database=None, derandomize=not LONG_RUN,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@settings(max_examples=LONG_RUN or 1000, **FUZZ)
@given(argv=plan_argv())
def test_plan_command_lines(profile_files, argv):
    run_and_check(argv)


@settings(max_examples=LONG_RUN or 30, **FUZZ)
@given(argv=demo_argv())
def test_demo_command_lines(profile_files, argv):
    run_and_check(argv)
