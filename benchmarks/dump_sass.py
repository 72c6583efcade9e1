"""Writes the SASS of decode variants (built as the runtime builds them, through NVRTC) to
OUTDIR, for reading instruction counts of the main loop:

    PYTHONPATH=$PWD python3 benchmarks/dump_sass.py OUTDIR [kv_dtype ...]
"""
import shutil
import subprocess
import sys
from pathlib import Path

from splitkv.runtime.kernel_source import DecodeVariant, compile_cubin

out = Path(sys.argv[1])
tool = shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"   # reads a bare cubin
for kv in ["", *sys.argv[2:]]:
    v = DecodeVariant("bfloat16", 128, 1, kv_dtype=kv)
    cubin, _ = compile_cubin(v.source(), "sm_90", v.name)
    path = out / f"{v.name}.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([tool, "-c", str(path)], capture_output=True, text=True)
    (out / f"{v.name}.sass").write_text(sass.stdout + sass.stderr)
    path.unlink()
    print(v.name, len(sass.stdout.splitlines()), "lines")
