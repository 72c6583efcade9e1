#!/usr/bin/env bash
# Nsight Compute on the streaming-read probe and on one decode case, same sections, so their
# L2 and DRAM figures can be compared side by side (why the decode kernel stops near 83%).
#   bash benchmarks/ncu_compare.sh OUTDIR [case] [num_splits]
set -o pipefail
OUTDIR=${1:?outdir}; CASE=${2:-b32_n8k}; SPLITS=${3:-1}
export PYTHONPATH=$PWD
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables"
ncu --clock-control none --kernel-name stream_read --launch-skip 2 --launch-count 1 $SECTIONS \
  python3 -c "from splitkv.bench.bandwidth import read_bandwidth_gbps as r; print(r(1 << 30, trials=1))" \
  > "$OUTDIR/ncu-read-probe.txt" 2>&1
ncu --clock-control none --kernel-name decode_partial --launch-skip 3 --launch-count 1 $SECTIONS \
  python3 benchmarks/profile_case.py "$CASE" "$SPLITS" > "$OUTDIR/ncu-$CASE.txt" 2>&1
for f in "$OUTDIR"/ncu-read-probe.txt "$OUTDIR/ncu-$CASE.txt"; do
  echo "== $f"; grep -E "DRAM Throughput|L2 Cache Throughput|L2 Hit Rate|Memory Throughput|Duration|L2 Fabric|lts__" "$f" | head -20
done
