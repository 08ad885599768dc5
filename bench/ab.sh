#!/usr/bin/env bash
# bench/ab.sh — builds of `fabriq` side by side on one measurement: each round runs every build
# once, in an order that rotates from round to round (no build always goes first), so load that
# comes and goes on a shared host falls on all alike. Prints every round, then the median of each
# build's p50, its ratio to the first build's and in how many rounds it was faster than the first.
#
# Usage:
#   bench/ab.sh A_BIN B_BIN [C_BIN ...] [ROUNDS] [-- fabriq perf arguments]
# e.g. build the old tree, copy target/release/fabriq to /tmp/fabriq-old, build the new one:
#   bench/ab.sh /tmp/fabriq-old target/release/fabriq 31
# For a change of a few percent, build every side with functions and branch targets aligned
# (RUSTFLAGS="-C llvm-args=-align-all-functions=6 -C llvm-args=-align-all-nofallthru-blocks=5"):
# code placement alone moved the verbs SEND by 4-13% between two plain builds of code it shares
# (docs/BENCHMARKS.md, 2026-12-04, fourth round).
# Default measurement (client CPU 0, server CPU 1, caller progress):
#   perf --local --layer channel --progress caller -d shm0 -t send_lat -s 8 -n 50000 --cpu 0 --server-cpu 1
set -u -o pipefail

BINS=()
while [ $# -gt 0 ] && [ "$1" != "--" ] && ! [[ "$1" =~ ^[0-9]+$ ]]; do
    BINS+=("$1")
    shift
done
if [ ${#BINS[@]} -lt 2 ]; then
    sed -n '2,16p' "$0" >&2
    exit 2
fi
ROUNDS=31
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
    ROUNDS=$1
    shift
fi
[ "${1:-}" = "--" ] && shift
if [ $# -gt 0 ]; then
    ARGS=("$@")
else
    ARGS=(--local --layer channel --progress caller -d shm0 -t send_lat -s 8 -n 50000 --cpu 0 --server-cpu 1)
fi
for bin in "${BINS[@]}"; do
    [ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }
done

p50() { # bin -> p50 of the first result (µs), or "nan"
    "$1" perf "${ARGS[@]}" --json 2>/dev/null |
        python3 -c 'import sys, json
try:
    print(json.load(sys.stdin)["results"][0]["p50_us"])
except Exception:
    print("nan")'
}

names=ABCDEFGHIJKLMNOPQRSTUVWXYZ
n=${#BINS[@]}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "fabriq perf ${ARGS[*]}"
for k in $(seq 0 $((n - 1))); do
    echo "${names:k:1}: ${BINS[k]}"
done
for i in $(seq "$ROUNDS"); do
    vals=()
    for k in $(seq 0 $((n - 1))); do
        vals+=("")
    done
    for j in $(seq 0 $((n - 1))); do
        k=$(((i - 1 + j) % n))
        vals[k]=$(p50 "${BINS[k]}")
    done
    line="round $i:"
    for k in $(seq 0 $((n - 1))); do
        line="$line ${names:k:1} ${vals[k]} "
    done
    echo "$line"
    echo "${vals[*]}" >>"$out"
done
python3 - "$out" "$names" <<'PY'
import math, statistics, sys
names = sys.argv[2]
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1])]
rows = [r for r in rows if not any(math.isnan(x) for x in r)]
if not rows:
    sys.exit("no successful rounds")
n = len(rows[0])
med = [statistics.median(r[k] for r in rows) for k in range(n)]
parts = [f"{names[k]} {med[k]:.3f} us" for k in range(n)]
print("median p50: " + ", ".join(parts))
for k in range(1, n):
    faster = sum(1 for r in rows if r[k] < r[0])
    print(f"{names[k]}/A {med[k] / med[0]:.3f}; {names[k]} faster in {faster} of {len(rows)} rounds")
PY
