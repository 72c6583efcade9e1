"""The live FlashInfer peer's host side: which paths a shape has, XQA's block tables, and that
the module (and the bench's --flashinfer) needs neither FlashInfer nor PyTorch to import."""

import subprocess
import sys

import numpy as np

from splitkv.bench.flashinfer_peer import block_tables, flashinfer_available, supported_paths
from splitkv.core.problem import PageTable


def test_paths_follow_flashinfers_limits():
    assert supported_paths(32, 8, 16) == ["xqa", "tensor_core", "cuda_core"]
    assert supported_paths(32, 8, 1) == ["tensor_core", "cuda_core"]        # XQA: pages 16..128
    assert supported_paths(40, 8, 16) == ["xqa", "tensor_core"]             # group 5: no CUDA core
    assert supported_paths(128, 8, 64) == ["xqa", "tensor_core", "cuda_core"]   # group 16
    assert supported_paths(32, 8, 16, "float8_e4m3fn")[0] == "xqa"
    assert "xqa" not in supported_paths(32, 8, 16, "float8_e5m2")   # XQA builds e4m3 only


def test_block_tables_hold_each_requests_pages_in_order():
    pt = PageTable.from_flashinfer(np.array([0, 3, 3, 4]), np.array([7, 2, 9, 5]),
                                   np.array([5, 0, 16]), 16)
    table, lens = block_tables(pt)
    assert table.dtype == np.int32 and table.shape == (3, 3)
    assert table[0].tolist() == [7, 2, 9] and table[2, 0] == 5
    assert lens.tolist() == [2 * 16 + 5, 0, 16] and lens.dtype == np.int32


def test_imports_without_flashinfer_or_torch_and_says_why():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['flashinfer'] = None\n"
            "from splitkv.bench.flashinfer_peer import flashinfer_available\n"
            "ok, why = flashinfer_available(); assert not ok and 'PyTorch' in why, why")
    subprocess.run([sys.executable, "-c", code], check=True)
    ok, why = flashinfer_available()
    assert isinstance(ok, bool) and why
