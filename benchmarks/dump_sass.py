"""Writes the SASS of decode variants to OUTDIR, for reading instruction counts of the main loop.

NVRTC's own cubins do not disassemble here (nvdisasm calls them invalid ELF), so the variant's
PTX (NVRTC, as the runtime builds it) goes through the toolkit's ptxas, then nvdisasm. Both are
looked up on PATH, in /usr/local/cuda*/bin and in the nvidia-*-cu13 wheels' bin folders. The
ptxas there may be newer than NVRTC's built-in one: counts are indicative, not exact.

    PYTHONPATH=$PWD python3 benchmarks/dump_sass.py OUTDIR [kv_dtype ...]
"""
import glob
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from splitkv.runtime.kernel_source import DecodeVariant, compile_ptx


def find(tool: str) -> str:
    found = shutil.which(tool) or next(iter(sorted(
        glob.glob(f"/usr/local/cuda*/bin/{tool}")
        + glob.glob(f"{sysconfig.get_paths()['purelib']}/nvidia/cu*/bin/{tool}"))), None)
    if found is None:
        sys.exit(f"dump_sass.py: {tool} not found (PATH, /usr/local/cuda*/bin, nvidia wheels)")
    return found


out = Path(sys.argv[1])
ptxas, nvdisasm = find("ptxas"), find("nvdisasm")
for kv in ["", *sys.argv[2:]]:
    v = DecodeVariant("bfloat16", 128, 1, kv_dtype=kv)
    ptx, cubin = out / f"{v.name}.ptx", out / f"{v.name}.cubin"
    ptx.write_text(compile_ptx(v.source(), v.name))
    subprocess.run([ptxas, "-arch=sm_90", "-o", str(cubin), str(ptx)], check=True)
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True)
    (out / f"{v.name}.sass").write_text(sass.stdout)
    ptx.unlink()
    cubin.unlink()
    print(v.name, sum(";" in line for line in sass.stdout.splitlines()), "instructions")
