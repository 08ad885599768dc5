#!/usr/bin/env bash
# The soft-RoCE lane: builds the test binaries on the host, boots the rxe VM (run.sh) and runs,
# on the kernel's own RoCEv2 (rdma_rxe on the guest's loopback):
#   1. `fabriq info` (rxe0 with its real attributes),
#   2. the full verbs conformance suite on the rdma-core provider,
#   3. the middleware's channel / RPC / remote-memory tests on rxe0, its connection-manager
#      tests and its `Endpoint` connect tests (QP cache reuse over many connects included),
#      and `fabriq demo -d rxe0` (two processes),
#   4. `fabriq perf` send_lat and write_bw beside perftest's ib_send_lat and ib_write_bw, and
#      cold against cached connects through `Endpoint` (examples/connect_spin_ab): a sanity
#      comparison printed side by side, never a timing assertion.
#
#   tests/rxe/lane.sh [--record]     --record also writes the perf table to docs/BENCHMARKS.md
#
# Exits non-zero when any step fails, and loudly when QEMU cannot run the lane at all.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
record=0
[ "${1:-}" = "--record" ] && record=1

profile=release
echo "rxe lane: building test binaries"
cargo build --release -p fabriq-cli --bin fabriq >/dev/null
cargo build --release -p fabriq --example connect_spin_ab >/dev/null
test_bin() { # package test-target -> path of the built test executable
  cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null |
    python3 -c 'import sys,json
for l in sys.stdin:
    try: m=json.loads(l)
    except Exception: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["kind"]==["test"]: print(m["executable"])' | tail -1
}
stage=$(mktemp -d /tmp/fabriq-rxe-stage.XXXXXX)
trap 'rm -rf "$stage"' EXIT
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import sys,json; print(json.load(sys.stdin)["target_directory"])')
cp "$target_dir/$profile/fabriq" "$stage/fabriq"
cp "$target_dir/$profile/examples/connect_spin_ab" "$stage/connect_spin_ab"
conf=$(test_bin fabriq-verbs conformance)
[ -n "$conf" ] || { echo "rxe lane: FAILED: conformance test binary not built"; exit 1; }
cp "$conf" "$stage/conformance"
for t in channel_e2e conn endpoint_conn; do
  b=$(test_bin fabriq "$t")
  [ -n "$b" ] || { echo "rxe lane: FAILED: middleware test $t not built"; exit 1; }
  cp "$b" "$stage/mw-$t"
done

cat > "$stage/lane-guest.sh" <<'GUEST'
set -u
fail=0
step() { echo; echo "=== rxe lane: $*"; }
gid_index() { # the RoCE v2 GID holding ::ffff:127.0.0.1
  for f in /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/*; do
    i=$(basename "$f")
    [ "$(cat "$f" 2>/dev/null)" = "RoCE v2" ] || continue
    g=$(cat /sys/class/infiniband/rxe0/ports/1/gids/$i 2>/dev/null)
    case "$g" in *ffff:7f00:0001) echo "$i"; return;; esac
  done
  echo 1
}
step "fabriq info"
./fabriq info || fail=1
step "verbs conformance suite on rdma-core (rxe0)"
FABRIQ_CONFORMANCE_PROVIDERS=rdma-core ./conformance --test-threads=2 || fail=1
step "middleware: channel, RPC and remote memory on rxe0 (also under load: order, back-pressure without RNR, concurrent RPC)"
FABRIQ_TEST_DEVICES=rxe0 ./mw-channel_e2e on_named_devices --test-threads=1 --nocapture || fail=1
step "middleware: connection manager, QP cache on rxe0"
FABRIQ_TEST_DEVICES=rxe0 ./mw-conn --test-threads=1 || fail=1
step "middleware: Endpoint connects on rxe0 (typed failures, QP cache reuse over many connects)"
FABRIQ_TEST_DEVICES=rxe0 ./mw-endpoint_conn --test-threads=1 || fail=1
step "fabriq demo on rxe0 (two processes: channel, rendezvous, RPC, CAS lock)"
timeout 300 ./fabriq demo -d rxe0 -n 300 || fail=1
step "perf: fabriq beside perftest (sanity comparison, TCG-emulated CPU)"
gi=$(gid_index)
# perftest pair: the server in the background (bounded), the client retried while the server is
# not listening yet (a slow emulated guest can take more than a second to start it).
perftest_pair() { # OUT TOOL ARGS...
  out=$1; shift
  timeout 300 "$@" > /dev/null 2>&1 &
  srv=$!
  for try in 1 2 3 4 5 6 7 8 9 10; do
    sleep 1
    timeout 300 "$@" 127.0.0.1 > "$out" 2>&1 && break
    grep -q "Couldn't connect" "$out" || break
  done
  kill "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
}
{
  timeout 300 ./fabriq perf --local -d rxe0 -t send_lat -s 8 -n 2000 --json > perf-fabriq-send_lat.json 2> perf-fabriq-send_lat.err
  timeout 300 ./fabriq perf --local -d rxe0 -t write_bw -s 65536 -n 2000 --json > perf-fabriq-write_bw.json 2> perf-fabriq-write_bw.err
  perftest_pair perf-ib_send_lat.txt ib_send_lat -d rxe0 -x "$gi" -s 8 -n 2000 -F
  perftest_pair perf-ib_write_bw.txt ib_write_bw -d rxe0 -x "$gi" -s 65536 -n 2000 -F --report_gbits
  AB_BLOCK=10 timeout 300 ./connect_spin_ab rxe0 100 50 > perf-connect.txt 2>&1
} || true
cat perf-ib_send_lat.txt perf-ib_write_bw.txt 2>/dev/null | grep -E '^ *[0-9]' || true
cat perf-connect.txt 2>/dev/null || true
exit $fail
GUEST

status=0
tests/rxe/run.sh --stage "$stage" -- "sh ./lane-guest.sh" || status=$?
python3 tests/rxe/report.py "$stage" "$record" || true
exit $status
