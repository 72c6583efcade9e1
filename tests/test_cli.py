"""The ``splitkv`` command: the dispatcher, the entry points, and what each subcommand prints
on a machine without a GPU (``splitkv calibrate``'s runs with a simulated GPU are in
test_calibration.py)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import splitkv
from splitkv import cli
from splitkv.bench.harness import markdown_table
from splitkv.cli import plan as plan_cli

ROOT = str(Path(splitkv.__file__).resolve().parents[1])


def run_module(*args):
    """``python -m <args>`` from a fresh interpreter that imports this checkout's splitkv."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env)


def test_every_command_loads():
    for name in cli.COMMANDS:
        assert cli.load_command(name) is not None, name


def test_no_command_prints_the_help(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in cli.COMMANDS)


def test_a_broken_command_says_why_and_leaves_the_others(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "broken", ("splitkv.no_such_module", "a broken command"))
    assert cli.main(["broken"]) == 2
    assert "splitkv broken: not available: splitkv.no_such_module" in capsys.readouterr().err
    assert cli.main(["plan", "--top", "1"]) == 0


@pytest.mark.parametrize("module", ["splitkv", "splitkv.cli"])
def test_python_dash_m_runs_the_command(module):
    done = run_module(module, "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"splitkv {splitkv.__version__}"


def test_python_dash_m_splitkv_bench_takes_the_bench_arguments():
    done = run_module("splitkv.bench", "--help")
    assert done.returncode == 0
    assert "python -m splitkv.bench" in done.stdout and "--min-total-mib" in done.stdout


def test_demo_on_the_cpu(capsys):
    assert cli.main(["demo", "--cpu", "--cases", "mha,b16-ragged"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "plans from splitkv.planner.choose_plan (the shipped H200 profile)"
    assert out[1].split() == ["case", "B", "heads", "tokens", "strategy", "splits", "work",
                              "items", "max", "rel", "err", "lse", "err"]
    assert [line.split()[0] for line in out[2:4]] == ["b16-ragged", "mha"]   # the cases' order
    assert out[3].split()[1:4] == ["4", "32/32", "4096"] and out[3].endswith("ok")
    assert out[4] == "tolerance: rel err <= 1e-09, lse err <= 1e-09; 2 of 2 cases within it"
    assert out[5] == "ran on the CPU fallback: --cpu was given"


def test_demo_refuses_unknown_cases(capsys):
    assert cli.main(["demo", "--cases", "mha,nope"]) == 2
    assert "unknown case(s) nope" in capsys.readouterr().err


def test_plan_command(capsys):
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    assert plan_cli.run(parser.parse_args(["--batch", "8", "--kv-len", "8192", "--heads", "32/8",
                                           "--top", "3"])) == 0
    out = capsys.readouterr().out
    assert "plan:" in out and "predicted:" in out and "top 3 of" in out
    assert plan_cli.run(parser.parse_args(["--lens", "100,2000,30000", "--strategy", "fused"])) == 0
    out = capsys.readouterr().out
    assert "fused" in out and "merge:     by the last CTA" in out    # ragged: the ticket
    # the shipped H200 profile has clusters: one short request cut in 8 merges in a cluster
    assert plan_cli.run(parser.parse_args(["--kv-len", "1024", "--num-splits", "8",
                                           "--strategy", "fused"])) == 0
    assert "clusters of 8" in capsys.readouterr().out
    assert plan_cli.run(parser.parse_args(["--head-dim", "96"])) == 2
    assert "head_dim" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--heads", "32:8"])



def test_bench_without_a_gpu_exits_2(monkeypatch, capsys):
    import splitkv.runtime

    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (False, "no device here"))
    assert cli.main(["bench", "--cases", "b1_n1k"]) == 2
    assert "splitkv bench: needs a GPU (no device here)" in capsys.readouterr().err


def test_bench_markdown_table():
    row = {"case": "b1_n1k", "us": 5.0, "gbps": 1700.0, "frac_read_bw": 0.4, "rel_err": 1.2e-3,
           "strategy": "fused", "num_splits": 4, "best_paged_peer_us": 8.6, "peer_us": 7.5}
    result = {"read_gbps": 4500.0, "first_call_compile_s": 1.5, "plan_cpu_us_ragged_b32": 20.0,
              "plan_cpu_us_ragged_b256": 90.0, "wrapper_plan_cpu_us_ragged_b32": 300.0,
              "cases": [row, dict(row, case="ragged_b32", us=150.0, peer_us=None,
                                  graph_stable_us=153.0, graph_stable_plan="fused/7")]}
    lines = markdown_table(result).splitlines()
    assert lines[0].startswith("read floor: 4,500 GB/s (the fastest streaming read of ")
    assert lines[4] == ("| b1_n1k | 5.00 | 1700 | 40.0 | 1.2e-03 | fused/4 | 8.6 | 7.5 | n/a | "
                        "<=peer, miss 4.5us, <=1.05 sdpa |")
    assert lines[5] == ("| ragged_b32 | 150.00 | 1700 | 40.0 | 1.2e-03 | fused/4 | 8.6 | None | "
                        "153.00 (fused/7, 1.020) | >peer |")
