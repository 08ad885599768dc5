#!/usr/bin/env bash
# bench/rss.sh — memory of many connections: two processes open N channels (default 256) and
# run the same traffic on each (64 eager messages of 4000 bytes each way), first as plain verbs
# code with per-connection buffers (`naive`: a registered 64 × 8 KiB receive ring and send
# buffer per connection), then as fabriq channels (`fabriq`). Each process reports its VmRSS
# and VmHWM (/proc/self/status) and the bytes it registered for the connections.
#
# Usage (from anywhere in the repository):
#   bench/rss.sh                      # shm0 and tcp0, 256 channels
#   N=64 DEVICES=shm0 bench/rss.sh    # a subset
# Output: one JSON line per process on stderr, then a Markdown table on stdout.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${N:-256}
read -r -a DEVICES <<<"${DEVICES:-shm0 tcp0}"
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}

cargo build --release -q -p fabriq --example channels_rss --manifest-path "$ROOT/Cargo.toml" >&2 || exit 1
BIN=$TARGET/release/examples/channels_rss

run_pair() { # mode device -> two JSON lines (server, client)
    local mode=$1 dev=$2 out
    out=$(mktemp)
    "$BIN" server "$mode" "$dev" "$N" 127.0.0.1:0 >"$out" &
    local srv=$!
    local addr=""
    for _ in $(seq 1 600); do
        addr=$(sed -n 's/^listening //p' "$out")
        [ -n "$addr" ] && break
        sleep 0.05
    done
    if [ -z "$addr" ]; then
        echo "server ($mode $dev) did not start" >&2
        kill "$srv" 2>/dev/null
        rm -f "$out"
        return 1
    fi
    local client
    client=$("$BIN" client "$mode" "$dev" "$N" "$addr") || echo "client ($mode $dev) failed" >&2
    wait "$srv" || echo "server ($mode $dev) failed" >&2
    grep '^{' "$out"
    printf '%s\n' "$client" | grep '^{'
    rm -f "$out"
}

results=$(mktemp)
for dev in "${DEVICES[@]}"; do
    for mode in naive fabriq; do
        # A pair that fails (e.g. a QP timing out on a machine too loaded to run its progress
        # engine in time) is run once more.
        for attempt in 1 2; do
            out=$(run_pair "$mode" "$dev")
            [ "$(printf '%s\n' "$out" | grep -c '^{')" = 2 ] && break
            echo "retrying $mode $dev" >&2
        done
        printf '%s\n' "$out" | tee -a "$results" >&2
    done
done

python3 - "$results" "$N" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
n = sys.argv[2]
by = {(r['device'], r['mode'], r['role']): r for r in rows}
print(f"| device | process | naive VmRSS / VmHWM (MiB) | fabriq VmRSS / VmHWM (MiB) | RSS change | naive registered (MiB) | fabriq registered (MiB) | registered change |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for dev in sorted({r['device'] for r in rows}):
    for role in ("server", "client"):
        a, b = by.get((dev, 'naive', role)), by.get((dev, 'fabriq', role))
        if not a or not b:
            print(f"| {dev} | {role} | {'missing' if not a else ''} | {'missing' if not b else ''} | | | | |")
            continue
        mib = lambda k: k / 1024
        rss = lambda r: f"{mib(r['vm_rss_kib']):.1f} / {mib(r['vm_hwm_kib']):.1f}"
        d_rss = (b['vm_hwm_kib'] - a['vm_hwm_kib']) / a['vm_hwm_kib'] * 100
        d_reg = (b['registered_bytes'] - a['registered_bytes']) / a['registered_bytes'] * 100
        print(f"| {dev} | {role} ({n} ch) | {rss(a)} | {rss(b)} | {d_rss:+.0f}% (peak) | "
              f"{a['registered_bytes']/2**20:.1f} | {b['registered_bytes']/2**20:.1f} | {d_reg:+.0f}% |")
PY
rm -f "$results"
