"""The cost model's rows are declared once (``features.ROW_EXPRESSIONS``) and compiled twice:
NumPy for the host planner, C++ for the planner on the device. Both, from the same
declaration, give the same bits: every shipped row, and a row declared here (as a new one
would be), through the header built with g++ (``helpers.device_plan_reference``)."""

from __future__ import annotations

import numpy as np
import pytest

from splitkv.planner import expressions as E
from splitkv.planner.features import (FEATURE_ROWS, ROW_CONSTANTS, ROW_EXPRESSIONS, ROW_INPUTS,
                                      new_feature_rows, row_features)
from splitkv.runtime.device_planner import header_defines, row_members

from helpers.device_plan_reference import compiler, device_rows

needs_gxx = pytest.mark.skipif(compiler() is None, reason="no host C++ compiler (g++)")


def random_inputs(rng, n: int, real: bool):
    """Statistics [len(ROW_INPUTS), n] ('clustered' 0, as on the device) and the constants:
    integers as a planner meets them, or (``real``) arbitrary positive reals, which round
    differently under any other order of the operations."""
    stats = np.zeros((len(ROW_INPUTS), n))
    if real:
        stats[:-1] = rng.lognormal(3.0, 2.0, (len(ROW_INPUTS) - 1, n))
        constants = (rng.lognormal(2.0, 1.0), rng.lognormal(5.0, 1.0), rng.lognormal(4.0, 1.0),
                     rng.lognormal(4.0, 0.5), rng.lognormal(3.0, 1.0))
    else:
        chunks = rng.integers(1, 5000, n).astype(float)
        chunks[: n // 8] = 0.0                 # no chunk: the mean's guard against 0 items
        stats[:-1] = rng.integers(0, 200000, (len(ROW_INPUTS) - 1, n))
        stats[0] = chunks
        stats[ROW_INPUTS.index("max_splits")] = rng.integers(1, 70, n)
        stats[ROW_INPUTS.index("max_chunk_tokens")] = rng.choice([64, 512, 1023, 1024, 5000], n)
        constants = (int(rng.integers(1, 64)), int(rng.choice([132, 264, 396])), 132,
                     float(rng.choice([4460.0 / 70.0, 3350.0 / 70.0])), int(rng.integers(1, 300)))
    assert len(constants) == len(ROW_CONSTANTS)
    return stats, constants


def as_device_inputs(stats, constants) -> np.ndarray:
    """RowInputs' members [ROW_INPUTS then ROW_CONSTANTS, n]."""
    n = stats.shape[1]
    return np.vstack([stats, np.array(constants, float)[:, None].repeat(n, axis=1)])


def same_bits(a, b) -> bool:
    return np.asarray(a, np.float64).tobytes() == np.asarray(b, np.float64).tobytes()


@needs_gxx
@pytest.mark.parametrize("real", [False, True], ids=["integers", "reals"])
def test_every_row_is_the_same_bits_on_the_device(real):
    """``row_features`` (the planner's NumPy) and ``feature_rows`` (the header's C++, g++ with
    -ffp-contract=off) from the same statistics: every member of FeatureRows, bit for bit."""
    rng = np.random.default_rng(5 + real)
    for _ in range(4):
        stats, constants = random_inputs(rng, 257, real)
        rows, stat_rows = new_feature_rows(stats.shape[1])
        stat_rows[:] = stats[:len(stat_rows)]
        ipc, slots, num_sms, stream_ratio, batch = constants
        row_features(rows, ipc, slots, num_sms, stream_ratio, batch_size=batch)
        device = device_rows(as_device_inputs(stats, constants))
        members = row_members()
        assert len(device) == len(members)
        for name, values in zip(members, device):
            assert same_bits(rows[FEATURE_ROWS.index(name)], values), name


def a_new_row():
    """A row as one would add it: one declaration, reading statistics, constants and a shared
    node, with every operation the expressions have."""
    s, c = E.inputs(*ROW_INPUTS), E.inputs(*ROW_CONSTANTS)
    items = s.num_chunks * c.items_per_chunk
    mean = s.total_tokens / E.at_least_one(items)
    scalar = c.slots * 0.5 + 1.0 / c.num_sms - c.batch_size        # constants alone
    return E.select(E.gt(s.max_splits, 1.0),
                    E.fmod(E.ceil(mean), 7.0) + E.floor(mean * 0.1),
                    E.minimum(s.odd_chunks, scalar) - E.maximum(mean, s.max_chunk_tiles)) \
        + E.ge(mean, 100.0) * E.le(items, c.slots) * E.lt(s.split_chunks, 3.0) \
        + E.eq(E.ceil(items / c.num_sms), 1.0) * (mean * c.stream_ratio - 2.0 * mean)


@needs_gxx
@pytest.mark.parametrize("real", [False, True], ids=["integers", "reals"])
def test_a_new_row_declared_once_is_the_same_on_host_and_device(real):
    """A new row declared in Python: it is in the C++ written for the header (a member of
    FeatureRows, computed by DEVICE_PLAN_ROWS), and the header built with it (g++) gives the
    bits the host's NumPy gives, for random inputs."""
    table = dict(ROW_EXPRESSIONS, new_row=a_new_row())
    defines = header_defines(table)
    assert "r.new_row = " in defines and "new_row" in row_members(table)
    members_line = next(line for line in defines.splitlines()
                        if line.startswith("#define DEVICE_PLAN_ROW_MEMBERS"))
    assert "new_row" in members_line
    program = E.RowProgram(table, ROW_INPUTS, ROW_CONSTANTS)
    rng = np.random.default_rng(17 + real)
    stats, constants = random_inputs(rng, 300, real)
    rows = program.new_rows(stats.shape[1])
    rows[:len(ROW_INPUTS)] = stats
    program.fill(rows, *(np.array(float(v)) for v in constants))
    host = rows[program.names.index("new_row")]
    assert np.isfinite(host).all() and len(set(host.tolist())) > 50
    device = device_rows(as_device_inputs(stats, constants), table)
    assert same_bits(device[row_members(table).index("new_row")], host)


@pytest.mark.nvrtc
def test_a_new_row_compiles_for_the_gpu():
    """The same header with the new row (every operation) compiles with NVRTC as the planning
    kernel does (--fmad=false), warning of nothing in the rows."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from splitkv.runtime.device_planner import PLAN_NVRTC_OPTIONS
    from splitkv.runtime.kernel_source import compile_cubin, read_source

    probe = """
extern "C" __global__ void rows_probe(const device_plan::RowInputs* in,
                                      device_plan::FeatureRows* out) {
  out[threadIdx.x] = device_plan::feature_rows(in[threadIdx.x]);
}
"""
    table = dict(ROW_EXPRESSIONS, new_row=a_new_row())
    source = (header_defines(table) + "#define DEVICE_PLAN_HD __device__\n"
              + read_source("device_plan.cuh") + probe)
    cubin, log = compile_cubin(source, "sm_90", "rows_probe.cu", options=PLAN_NVRTC_OPTIONS)
    assert cubin[:4] == b"\x7fELF"
    # the header alone, without its kernel, leaves constants unused (#177); nothing else
    assert all("#177-D" in line for line in log.splitlines() if "warning #" in line), log


def test_operations_are_emitted_once_each_in_one_order():
    """A shared node is one statement; operands come first; constants read back exactly."""
    x, y = E.inputs("x", "y").x, E.inputs("y").y
    shared = x * 0.1
    lines = E.cpp_statements({"a": (shared + y) + shared, "b": shared})
    assert lines == ["const double t0 = in.x * 0.1;", "const double t1 = t0 + in.y;",
                     "const double t2 = t1 + t0;", "r.a = t2;", "r.b = t0;"]
    program = E.RowProgram({"a": (shared + y) + shared, "b": shared}, ("x", "y"), ())
    assert program.scratch == 1 and program.source.count("multiply(") == 1
    rows = program.new_rows(3)
    rows[:2] = [[1.0, 2.0, 3.0], [0.25, 0.5, 0.75]]
    program.fill(rows)
    assert same_bits(rows[2], (rows[0] * 0.1 + rows[1]) + rows[0] * 0.1)
    assert same_bits(rows[3], rows[0] * 0.1)


def test_at_least_one_is_skipped_only_where_every_column_has_work():
    x = E.inputs("x").x
    program = E.RowProgram({"mean": 10.0 / E.at_least_one(x)}, ("x",), ())
    rows = program.new_rows(2)
    rows[0] = [0.0, 4.0]
    assert program.fill(rows)[1].tolist() == [10.0, 2.5]
    rows[0] = [0.5, 4.0]
    assert program.fill(rows, some_items=True)[1].tolist() == [20.0, 2.5]


def test_mistakes_are_refused():
    x = E.inputs("x").x
    with pytest.raises(TypeError, match="no truth value"):
        bool(E.ge(x, 1.0))
    with pytest.raises(TypeError, match="not supported"):
        x >= 1.0                                      # ge(x, 1.0): an operator would be a bool
    with pytest.raises(ValueError, match="not inputs"):
        E.RowProgram({"a": x + E.inputs("z").z}, ("x",), ())
    with pytest.raises(ValueError, match="also inputs"):
        E.RowProgram({"x": x + 1.0}, ("x",), ())
    with pytest.raises(ValueError, match="finite"):
        x + float("inf")
    with pytest.raises(TypeError, match="expression or a number"):
        x + "1"
