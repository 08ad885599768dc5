#!/usr/bin/env bash
# MP-RDMA over the udp provider on a 4-spine ECMP fabric in network namespaces
# (tests/netns/fabric.sh): the kernel-testbed experiments of docs/MPRDMA.md ("On a real kernel network").
#
#   sudo bench/netns.sh [bandwidth|loss|failure|ecn|all]     (default all)
#
# Needs root, iproute2, nftables. Builds the udp_goodput example in release mode and prints one
# JSON line per run (client and server), prefixed with the experiment and its setting.
set -euo pipefail
cd "$(dirname "$0")/.."
export FABRIQ_NETNS_PREFIX=${FABRIQ_NETNS_PREFIX:-fqbench}
FAB=tests/netns/fabric.sh
SECS=${SECS:-5}
RATE=${RATE:-100mbit}
SIZE=${SIZE:-65536}
cargo build --release -q -p fabriq-verbs --example udp_goodput
BIN=${CARGO_TARGET_DIR:-target}/release/examples/udp_goodput
trap 'bash $FAB down' EXIT

MP=(--opt mode=multi --opt paths=16)
SP=(--opt mode=single --opt paths=1 --opt "line_rate_mbps=${RATE%mbit}")

run() { # run LABEL OPTS...
  local label=$1; shift
  ip netns exec "$FABRIQ_NETNS_PREFIX-hB" "$BIN" server --bind 198.18.2.1:47000 --oob 198.18.2.1:47999 \
    --secs "$SECS" --size "$SIZE" "$@" > /tmp/fq_server.json &
  local srv=$!
  ip netns exec "$FABRIQ_NETNS_PREFIX-hA" "$BIN" client --bind 198.18.1.1:46000 --oob 198.18.2.1:47999 \
    --secs "$SECS" --size "$SIZE" --depth 32 --interval-ms "${INTERVAL_MS:-250}" "$@" | sed "s|^|$label client |"
  wait "$srv"; sed "s|^|$label server |" /tmp/fq_server.json
}

fresh() { bash $FAB up; bash $FAB shape "$RATE"; }

bandwidth() {
  fresh
  run "bandwidth single" "${SP[@]}"
  run "bandwidth multi" "${MP[@]}"
}

loss() {
  fresh
  local k; k=$(bash $FAB path 46000 47000)
  for per in 50 100 500; do
    bash $FAB loss "$k" "$per"
    run "loss=${per}e-4 spine=$k single" "${SP[@]}"
    run "loss=${per}e-4 spine=$k multi" "${MP[@]}"
  done
}

failure() {
  fresh
  ( sleep $((SECS / 3)); bash $FAB fail 2; sleep $((SECS / 3)); bash $FAB restore 2 ) &
  INTERVAL_MS=100 run "failure spine=2 multi" "${MP[@]}"
  wait
}

ecn() {
  fresh
  bash $FAB ecn-rate 3 2000
  run "ecn-rate spine=3 multi" "${MP[@]}"
  bash $FAB counters
}

case "${1:-all}" in
  bandwidth) bandwidth ;;
  loss) loss ;;
  failure) failure ;;
  ecn) ecn ;;
  all) bandwidth; loss; failure; ecn ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
