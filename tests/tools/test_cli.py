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


def child_env(**extra) -> dict:
    """The environment of a child interpreter that imports this checkout's splitkv."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                **extra)


def run_module(*args):
    """``python -m <args>`` from a fresh interpreter that imports this checkout's splitkv."""
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          env=child_env())


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


def test_demo_names_the_profile_it_plans_with(capsys, monkeypatch, tmp_path):
    """$SPLITKV_PROFILE: the demo's plans come from that file, and its first line says so."""
    from splitkv.planner.profiles import shipped_profile

    path = tmp_path / "mine.yaml"
    shipped_profile("nvidia-h200").save(path)
    monkeypatch.setenv("SPLITKV_PROFILE", str(path))
    assert cli.main(["demo", "--cpu", "--cases", "mha"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"plans from splitkv.planner.choose_plan (NVIDIA H200's profile: {path})")


def test_demo_on_the_cpu(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)     # a terminal: the wait explained
    assert cli.main(["demo", "--cpu", "--cases", "mha,b16-ragged"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("note: running 2 case(s) on the CPU executor in float64")
    out = out.splitlines()
    assert out[0].startswith("plans from splitkv.planner.choose_plan (NVIDIA H200's profile: ")
    assert out[1].split() == ["case", "B", "heads", "tokens", "strategy", "splits", "work",
                              "items", "max", "rel", "err", "lse", "err"]
    assert [line.split()[0] for line in out[2:4]] == ["b16-ragged", "mha"]   # the cases' order
    assert out[3].split()[1:4] == ["4", "32/32", "4096"] and out[3].endswith("ok")
    assert out[4] == "tolerance: rel err <= 1e-09, lse err <= 1e-09; 2 of 2 cases within it"
    assert out[5] == "ran on the CPU fallback: --cpu was given"


def test_demo_refuses_unknown_cases(capsys):
    assert cli.main(["demo", "--cases", "mha,nope"]) == 2
    assert "argument --cases: unknown case(s) 'nope'" in capsys.readouterr().err


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
    with pytest.raises(SystemExit):
        parser.parse_args(["--heads", "32:8"])


def test_bench_without_a_gpu_exits_1(monkeypatch, capsys):
    """The machine lacks something (1), not the call (2)."""
    import splitkv.runtime

    monkeypatch.setattr(splitkv.runtime, "gpu_available", lambda: (False, "no device here"))
    assert cli.main(["bench", "--cases", "b1_n1k"]) == 1
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
    assert lines[4] == ("| b1_n1k | 5.00 | 1700 | 40.0 | 1.2e-03 | fused/4 | 8.6 | not run | 7.5 | "
                        "n/a | <=peer, miss 4.5us, <=1.05 sdpa |")
    assert lines[5] == ("| ragged_b32 | 150.00 | 1700 | 40.0 | 1.2e-03 | fused/4 | 8.6 | not run | "
                        "None | 153.00 (fused/7, 1.020) | >peer |")


def test_bench_markdown_table_with_the_live_flashinfer_peer():
    """The live peer's paths (n/a where the shape has none) and a verdict against the fastest
    of them, beside the recorded peer's."""
    row = {"case": "b32_n8k", "us": 135.0, "gbps": 3976.0, "frac_read_bw": 0.87, "rel_err": 1.7e-3,
           "strategy": "single", "num_splits": 1, "best_paged_peer_us": 133.1, "peer_us": None,
           "flashinfer_us": {"xqa": 140.5, "tensor_core": 210.0, "cuda_core": None}}
    result = {"read_gbps": 4500.0, "first_call_compile_s": 1.5, "plan_cpu_us_ragged_b32": 20.0,
              "kv_dtype": "float8_e4m3fn", "cases": [row]}
    line = markdown_table(result).splitlines()[4]
    assert "| 133.1 | 140.50 / 210.00 / n/a | None |" in line
    assert line.endswith("| >peer, <=live peer |")


def test_bench_markdown_table_says_when_kv_is_fp8():
    row = {"case": "b32_n8k", "us": 120.0, "gbps": 4000.0, "frac_read_bw": 0.9, "rel_err": 3e-3,
           "strategy": "single", "num_splits": 1, "best_paged_peer_us": 133.1, "peer_us": None}
    result = {"read_gbps": 4500.0, "first_call_compile_s": 1.5, "plan_cpu_us_ragged_b32": 20.0,
              "kv_dtype": "float8_e4m3fn", "cases": [row]}
    lines = markdown_table(result).splitlines()
    assert lines[0].startswith("K/V: float8_e4m3fn (GB/s and % of the floor count its one-byte")
    assert lines[4].endswith("| <=peer |")


def plan_output(capsys, *argv) -> str:
    """What ``splitkv plan`` with ``argv`` prints (it must succeed)."""
    from splitkv import cli

    assert cli.main(["plan", *argv]) == 0
    return capsys.readouterr().out


def predicted(out: str) -> str:
    """The ``predicted:`` line of ``splitkv plan``'s output."""
    return next(line for line in out.splitlines() if line.startswith("predicted:"))


def test_plan_with_a_window_plans_only_its_tokens(capsys):
    windowed = plan_output(capsys, "--kv-len", "131072", "--window-left", "4095")
    assert "window_left=4095" in windowed and "16.0 MiB of K and V" in windowed
    plain = plan_output(capsys, "--kv-len", "4096")
    assert predicted(windowed) == predicted(plain)


def test_plan_with_attention_chunks_plans_only_the_last_chunk(capsys):
    from splitkv import cli

    chunked = plan_output(capsys, "--kv-len", "131072", "--attention-chunk-size", "8192")
    assert "attention_chunk_size=8192" in chunked and "32.0 MiB of K and V" in chunked
    plain = plan_output(capsys, "--kv-len", "8192")
    assert predicted(chunked) == predicted(plain)
    assert cli.main(["plan", "--attention-chunk-size", "64", "--q-len", "2"]) == 2
    assert capsys.readouterr().err == ("splitkv plan: --attention-chunk-size 64 with --q-len 2: "
                                       "chunked attention takes one query row a request\n")


def test_plan_takes_head_dim_96_with_16_bit_kv_and_refuses_fp8_there(capsys):
    from splitkv import cli

    assert "head_dim=96" in plan_output(capsys, "--head-dim", "96")
    assert cli.main(["plan", "--head-dim", "96", "--kv-dtype", "fp8_e4m3"]) == 2
    assert capsys.readouterr().err == (
        "splitkv plan: --kv-dtype: fp8 K/V ('float8_e4m3fn') is not supported at head_dim 96; "
        "expected head_dim one of (64, 128, 256) with fp8 K/V, or K/V in the model's dtype\n")


def test_plan_for_a_named_gpu_keeps_the_other_notices_and_first_use_off(capsys, monkeypatch):
    from splitkv.planner import profiles
    from splitkv.planner.first_use import FIRST_USE_ENV

    monkeypatch.setattr(profiles, "_warned_files", set())     # said once a process
    monkeypatch.delenv(FIRST_USE_ENV, raising=False)
    # the shipped profile refused for its SMs: said, and the kin planned with
    assert cli.main(["plan", "--device-name", "NVIDIA H100 80GB HBM3", "--num-sms", "114"]) == 0
    captured = capsys.readouterr()
    assert "made for 132 SMs, this device has 114" in captured.err
    assert "the shipped profile of NVIDIA H200 at a guessed" in captured.out
    monkeypatch.setenv(FIRST_USE_ENV, "off")                  # that GPU's first plan: the prior
    assert cli.main(["plan", "--device-name", "NVIDIA H100 PCIe"]) == 0
    assert "NVIDIA H100 PCIe, 114 SMs (prior" in capsys.readouterr().out


def test_plan_with_query_rows_and_fp8(capsys):
    """--q-len: the kernel's rows are q_len x the heads (the problem counts them), the same plan
    the wrapper makes; --kv-dtype: the profile's fp8 fit and one-byte K/V."""
    from splitkv import DecodeProblem
    from splitkv.planner import choose_plan
    from splitkv.planner.profile_lookup import load_profile

    assert cli.main(["plan", "--batch", "8", "--q-len", "4", "--kv-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "heads=128/8" in out and "4 query rows a request" in out
    assert "128.0 MiB of K and V" in out and "float8_e4m3fn" in out
    model = load_profile(device_name="NVIDIA H200", num_sms=132).cost_model("float8_e4m3fn")
    # the multi-token builds' tiles (for_multi_token), as the wrapper plans them; 200 x 300
    # tokens is a batch where they move the prediction (odd tile counts, not a lone grid)
    multi = model.for_multi_token()
    want = choose_plan(DecodeProblem([8192] * 8, 128, 8, 128, 16), multi)
    assert f"predicted: {want.predicted_us:.2f} us" in out
    assert cli.main(["plan", "--batch", "200", "--kv-len", "300", "--q-len", "4",
                     "--kv-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    problem = DecodeProblem([300] * 200, 128, 8, 128, 16)
    want, single_token = choose_plan(problem, multi), choose_plan(problem, model)
    assert want.predicted_us != single_token.predicted_us
    assert f"predicted: {want.predicted_us:.2f} us" in out
    assert cli.main(["plan", "--kv-len", "20000", "--q-len", "4", "--window-left", "100"]) == 0
    assert "window_left=103" in capsys.readouterr().out      # every row's window covered
    assert cli.main(["plan", "--q-len", "16", "--heads", "65535/1"]) == 2
    assert "--q-len 16: 16 x 65535 query heads = 1,048,560 exceed" in capsys.readouterr().err
    assert cli.main(["plan", "--kv-dtype", "fp8_e4m3", "--device-name", "NVIDIA A100-SXM4-80GB",
                     "--num-sms", "108"]) == 0
    assert "the profile's 16-bit fit: it has no fp8 fit" in capsys.readouterr().out
    # a GPU splitkv knows: its SM count; one whose architecture has a shipped profile of
    # another GPU: what its first plan takes, that profile at a bandwidth guessed from the name
    assert cli.main(["plan", "--device-name", "NVIDIA H100 PCIe", "--kv-dtype", "fp8"]) == 0
    captured = capsys.readouterr()
    assert "profile:   NVIDIA H100 PCIe, 114 SMs" in captured.out and not captured.err
    assert ("the shipped profile of NVIDIA H100 80GB HBM3 at a guessed 1,800 GB/s"
            in captured.out and "the profile's fp8 fit" in captured.out)
    assert cli.main(["plan", "--device-name", "nvidia h100 pcie"]) == 0    # named as files are
    assert "nvidia h100 pcie, 114 SMs (first use" in capsys.readouterr().out
    assert cli.main(["plan", "--device-name", "NVIDIA L40S"]) == 0
    assert "NVIDIA L40S, 142 SMs (prior" in capsys.readouterr().out
    assert cli.main(["plan", "--lens", "2,100", "--q-len", "4"]) == 2
    assert capsys.readouterr().err == ("splitkv plan: --q-len 4: a request has fewer tokens "
                                       "(2) than query rows; its new tokens are the last q_len "
                                       "of its KV\n")


# ------------------------------------------------- bad arguments: one line, exit 2, no work
BAD_ARGUMENTS = [
    (["plan", "--q-len", "17"], "argument --q-len: expected an integer from 1 to 16, got 17"),
    (["plan", "--kv-dtype", "int8"], "argument --kv-dtype"),
    # (argv, what the one line on stderr says)
    (["plan", "--batch", "-1"], "argument --batch: expected an integer from 1 to 1,048,576, got -1"),
    (["plan", "--window-left", "-2"], "argument --window-left: expected an integer from -1"),
    (["plan", "--attention-chunk-size", "-3"],
     "argument --attention-chunk-size: expected an integer from 0"),
    (["bench", "--kv-dtype", "int8"], "argument --kv-dtype: expected an fp8 format "
                                      "(float8_e4m3fn, float8_e5m2, or e4m3, e5m2, fp8, "
                                      "fp8_e4m3, fp8_e5m2), got 'int8'"),
    (["demo", "--cases", "mha,,gqa5"], "argument --cases: entry 1 of 'mha,,gqa5' is empty"),
    (["demo", "--extra"], "splitkv demo: error: unrecognized arguments: --extra"),
    (["plan", "--batch", "0"], "argument --batch: expected an integer from 1"),
    (["plan", "--batch", "1048577"], "argument --batch: expected an integer from 1 to 1,048,576"),
    (["plan", "--lens", ""], "argument --lens: expected comma-separated token counts like "
                             "100,2000,30000; entry 0 of '' is empty"),
    (["plan", "--lens", "10,,20"], "entry 1 of '10,,20' is empty"),
    (["plan", "--lens", "10,x"], "entry 1 of '10,x' is 'x'"),
    (["plan", "--lens", "-5"], "argument --lens: entry 0: expected a token count from 0"),
    (["plan", "--lens", "5,2147483648"], "entry 1: expected a token count from 0 to 2,147,483,647"),
    (["plan", "--kv-len", "-1"], "argument --kv-len: expected an integer from 0 to 2,147,483,647"),
    (["plan", "--num-sms", "0"], "argument --num-sms: expected an integer from 1"),
    (["plan", "--num-sms", "-5"], "argument --num-sms: expected an integer from 1"),
    (["plan", "--top", "-1"], "argument --top: expected an integer from 1"),
    (["plan", "--top", "0"], "argument --top: expected an integer from 1"),
    (["plan", "--num-splits", "0"], "argument --num-splits: expected an integer from 1"),
    (["plan", "--num-splits", "2.5"], "argument --num-splits: expected an integer from 1 to "
                                      "4,194,304, got '2.5'"),
    (["plan", "--num-splits", "4194305"], "argument --num-splits: expected an integer from 1 "
                                          "to 4,194,304, got 4194305"),
    (["plan", "--heads", "32:8"], "argument --heads: expected QO/KV heads like 32/8, got '32:8'"),
    (["plan", "--heads", "32/0"], "argument --heads: expected kv heads from 1"),
    (["plan", "--heads", "32/5"], "argument --heads: num_qo_heads: 32 is not a multiple of "
                                  "num_kv_heads=5"),
    (["plan", "--head-dim", "80"], "argument --head-dim: head_dim: 80 is not supported"),
    (["plan", "--page-size", "0"], "argument --page-size: expected an integer from 1"),
    (["plan", "--profile", "/no/such/profile.yaml"],
     "argument --profile: expected an existing file, got '/no/such/profile.yaml' (no such file)"),
    (["plan", "--profile", "/"], "argument --profile: expected an existing file, got '/' "
                                 "(is a directory)"),
    (["plan", "--device-name", " "], "argument --device-name: expected a name, got ' '"),
    (["plan", "--strategy", "nope"], "argument --strategy: invalid choice: 'nope'"),
    (["plan", "--batch"], "argument --batch: expected one argument"),
    (["plan", "--bogus", "a\nb"], "unrecognized arguments: --bogus a\\nb"),
    (["demo", "--seed", "-3"], "argument --seed: expected an integer >= 0, got -3"),
    (["demo", "--cases", ","], "argument --cases: unknown case(s) (none given)"),
    (["bench", "--min-total-mib", "0"], "argument --min-total-mib: expected an integer from 1"),
    (["bench", "--num-splits", "-1"], "argument --num-splits: expected an integer from 1"),
    (["bench", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
    (["bench", "--cases", "b1_n1k,nope"], "argument --cases: unknown case(s) 'nope'; known: "
                                          "groups classes, standard and cases b128_n2k, "),
    (["bench", "--json", "/"], "argument --json: expected a file path to write, got '/'"),
    (["bench", "--markdown", "/dev/null/x.md"], "argument --markdown: cannot write "
                                                "'/dev/null/x.md': '/dev/null' is not a folder"),
    (["calibrate", "--device", "-1"], "argument --device: expected an integer from 0"),
    (["calibrate", "--trials", "0"], "argument --trials: expected an integer from 1"),
    (["calibrate", "--min-trial-ms", "nan"], "argument --min-trial-ms: expected a finite number "
                                             "> 0, got 'nan'"),
    (["calibrate", "--min-trial-ms", "-1"], "argument --min-trial-ms: expected a finite number"),
    (["calibrate", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
    (["calibrate", "--out", "my-gpu.csv"], "argument --out: 'my-gpu.csv': the measurements are "
                                           "written beside the profile as my-gpu.csv"),
    (["calibrate", "--quiet", "--verbose"], "argument --verbose/-v: not allowed with argument "
                                            "--quiet/-q"),
    (["calibrate", "-vq"], "argument --quiet/-q: not allowed with argument --verbose/-v"),
    (["calibrate", "--quiet=yes"], "argument --quiet/-q: ignored explicit argument 'yes'"),
    (["calibrate", "--out", "/"], "argument --out: expected a file path to write, got '/'"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and message in err, err
    assert err.startswith((f"splitkv {argv[0]}: error: argument ",
                           f"splitkv {argv[0]}: error: unrecognized arguments: ",
                           "splitkv: error: "))


def test_an_unknown_argument_of_an_action_names_the_action(capsys):
    assert cli.main(["cache", "clear", "--bogus"]) == 2
    assert capsys.readouterr().err == ("splitkv cache clear: error: unrecognized arguments: "
                                       "--bogus (see splitkv cache clear --help)\n")


def test_calibrate_names_a_missing_flag_before_looking_for_a_gpu(capsys):
    assert cli.main(["calibrate", "--graph-stable"]) == 2
    assert capsys.readouterr().err == ("splitkv calibrate: --graph-stable fits the model "
                                       "graph-stable fp8 wrappers plan with: give --kv-dtype "
                                       "too\n")


def test_bench_refuses_a_split_single_strategy_before_looking_for_a_gpu(capsys):
    assert cli.main(["bench", "--strategy", "single", "--num-splits", "3"]) == 2
    assert capsys.readouterr().err == ("splitkv bench: --strategy single cannot split a request; "
                                       "--num-splits 3 needs split_merge or fused\n")


def test_bench_makes_the_folders_of_its_outputs():
    from splitkv.cli.args import output_file

    assert output_file("/tmp/no/such/folder/yet/result.json") == "/tmp/no/such/folder/yet/result.json"


def test_plan_says_what_a_forced_split_count_became(capsys):
    # a request of 8192 tokens has 128 tiles of 64 tokens: 100000 splits cut it into 128
    assert cli.main(["plan", "--kv-len", "8192", "--num-splits", "100000"]) == 0
    out = capsys.readouterr().out
    assert "num_splits=128," in out
    assert ("splits:    100000 asked, 128 used: a request is cut into at most one chunk per "
            "64-token tile") in out
    listed = out.split("candidates:\n")[1]
    assert "num splits 128 " in listed and "100000" not in listed
    assert cli.main(["plan", "--lens", "100,2000,30000", "--num-splits", "8"]) == 0
    assert "splits:    8 asked, 2..8 (by request) used" in capsys.readouterr().out
    assert cli.main(["plan", "--kv-len", "8192", "--num-splits", "8"]) == 0
    out = capsys.readouterr().out
    assert "splits:" not in out and "num splits 8 " in out


def test_plan_refuses_a_split_count_that_makes_millions_of_chunks(capsys):
    argv = ["plan", "--batch", "64", "--kv-len", "2147483647", "--num-splits", "4194304"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "splitkv plan: --num-splits 4194304: the plan would have 268,435,456 chunks; the "
        "command line plans at most 4,194,304\n")


def test_plan_edges_that_are_valid(capsys):
    for argv in (["--kv-len", "0"], ["--lens", "0,1,2147483647"], ["--top", "2147483647"],
                 ["--num-sms", "2147483647", "--device-name", "some GPU"]):
        assert cli.main(["plan", *argv]) == 0, argv
        assert "predicted:" in capsys.readouterr().out


def test_help_and_version_return_0(capsys):
    assert cli.main(["plan", "--help"]) == 0
    assert "--num-splits" in capsys.readouterr().out
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"splitkv {splitkv.__version__}"


def test_an_interrupt_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_cli, "run", interrupted)
    assert cli.main(["plan"]) == 130
    assert capsys.readouterr().err == "splitkv: interrupted\n"


@pytest.mark.parametrize("argv, status", [
    (["plan"], {1}), (["demo", "--cpu", "--cases", "b16-ragged"], {1}),
    (["plan", "--help"], {0, 1}),   # argparse ignores a failed write of the help, not the flush
])
def test_a_closed_pipe_ends_the_command_quietly(argv, status):
    """``splitkv plan | head -0``: the reader is gone before the first write. Exit status 1, as
    Python's docs have it (signal module, "Note on SIGPIPE"), and nothing on stderr."""
    for unbuffered in ("1", ""):        # each print writes, or one write at the end
        proc = subprocess.Popen([sys.executable, "-m", "splitkv", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=child_env(PYTHONUNBUFFERED=unbuffered))
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.stderr.close()
        assert proc.wait(timeout=60) in status and err == "", err


def test_a_pipe_closed_after_a_line_ends_the_command_quietly(tmp_path):
    """``splitkv plan | head -1`` in a shell: the rest of the output goes nowhere, no traceback."""
    done = subprocess.run(f"'{sys.executable}' -m splitkv plan --top 100 2>err.txt | head -1",
                          shell=True, capture_output=True, text=True, cwd=tmp_path,
                          env=child_env(PYTHONUNBUFFERED="1"))
    assert done.stdout.startswith("problem:   DecodeProblem(") and done.stdout.count("\n") == 1
    assert (tmp_path / "err.txt").read_text() == ""


def test_bench_cases_take_groups_and_names():
    """`--cases` takes case names and the groups 'standard' and 'classes' (the classes outside the standard set),
    in the order given, each case once; a wrong name lists what exists."""
    from splitkv.bench.cases import CLASS_CASES, STANDARD_CASES, select

    assert select(None) == STANDARD_CASES
    assert select("classes") == CLASS_CASES
    both = select("b1_n1k,standard,d256_b8_n8k")
    assert both[0].name == "b1_n1k" and len(both) == len(STANDARD_CASES) + 1
    assert both[-1].head_dim == 256 and both[-1].num_kv_heads == 8
    assert {c.page_size for c in CLASS_CASES} >= {1, 16, 64}
    assert {c.head_dim for c in CLASS_CASES} == {64, 128, 256}
    with pytest.raises(ValueError, match="unknown case.*'nope'.*groups classes, standard and"):
        select("nope")
    with pytest.raises(ValueError, match="unknown case"):
        select(",")


def test_bench_markdown_table_says_when_the_data_went_non_finite():
    """A case whose random q or K/V held a non-finite value before its error check (a kernel
    wrote it) says after which step, beside its error."""
    row = {"case": "d64_b64_n4k", "us": 104.2, "gbps": 2576.0, "frac_read_bw": 0.56,
           "rel_err": float("nan"), "strategy": "single", "num_splits": 1,
           "best_paged_peer_us": None, "peer_us": None, "data_non_finite_after": "the timed runs"}
    result = {"read_gbps": 4500.0, "first_call_compile_s": 1.5, "plan_cpu_us_ragged_b32": 20.0,
              "kv_dtype": "float8_e4m3fn", "cases": [row, dict(row, data_non_finite_after=None,
                                                              rel_err=1.7e-3)]}
    lines = markdown_table(result).splitlines()
    assert "| nan (data not finite after the timed runs) | single/1 |" in lines[4]
    assert "| 1.7e-03 | single/1 |" in lines[5]


def test_the_ab_scripts_rows_name_each_setting_and_its_ratio(monkeypatch, capsys):
    """experiments_ab.run_ab (the A/B scripts' loop): a line a case with each setting's us and
    its ratio to the default, a setting that fails for the case said and left out."""
    from splitkv.bench import experiments_ab
    from splitkv.bench.cases import select

    class FakePlan:
        strategy, num_splits = "split_merge", 2

    def fake_time(case, settings, *, kv_dtype=None, rounds=2, on_error=None):
        on_error("broken", RuntimeError("needs 262,240 bytes"))
        return FakePlan(), {"default": 10.0, "faster": 9.0}

    monkeypatch.setattr(experiments_ab, "time_experiments", fake_time)
    rows = experiments_ab.run_ab(select("b8_n8k"), lambda case: {}, note=lambda c, p: " (x)")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "  b8_n8k: broken: n/a (RuntimeError: needs 262,240 bytes)"
    assert out[1] == ("          b8_n8k  split_merge/2 (x)  default 10.00 (1.000)  "
                      "faster 9.00 (0.900)")
    assert rows[0][0].name == "b8_n8k" and rows[0][2]["faster"] == 9.0
