#!/usr/bin/env bash
# bench/ab.sh — two builds of `fabriq` side by side on one measurement: each pair of runs is one
# run of build A then one of build B, so load that comes and goes on a shared host falls on both
# alike. Prints every pair, then the median of each build's p50, the ratio B / A and in how many
# pairs B was faster.
#
# Usage:
#   bench/ab.sh A_BIN B_BIN [PAIRS] [-- fabriq perf arguments]
# e.g. build the old tree, copy target/release/fabriq to /tmp/fabriq-old, build the new one:
#   bench/ab.sh /tmp/fabriq-old target/release/fabriq 31
# Default measurement (client CPU 0, server CPU 1, caller progress):
#   perf --local --layer channel --progress caller -d shm0 -t send_lat -s 8 -n 50000 --cpu 0 --server-cpu 1
set -u -o pipefail

if [ $# -lt 2 ]; then
    sed -n '2,12p' "$0" >&2
    exit 2
fi
A=$1
B=$2
shift 2
PAIRS=31
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
    PAIRS=$1
    shift
fi
[ "${1:-}" = "--" ] && shift
if [ $# -gt 0 ]; then
    ARGS=("$@")
else
    ARGS=(--local --layer channel --progress caller -d shm0 -t send_lat -s 8 -n 50000 --cpu 0 --server-cpu 1)
fi
for bin in "$A" "$B"; do
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

out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "fabriq perf ${ARGS[*]}"
for i in $(seq "$PAIRS"); do
    a=$(p50 "$A")
    b=$(p50 "$B")
    echo "pair $i: A $a  B $b"
    echo "$a $b" >>"$out"
done
python3 - "$out" <<'PY'
import math, statistics, sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1])]
rows = [r for r in rows if not any(math.isnan(x) for x in r)]
if not rows:
    sys.exit("no successful pairs")
a = statistics.median(r[0] for r in rows)
b = statistics.median(r[1] for r in rows)
faster = sum(1 for x, y in rows if y < x)
print(f"median p50: A {a:.3f} us, B {b:.3f} us, B/A {b / a:.3f}; B faster in {faster} of {len(rows)} pairs")
PY
