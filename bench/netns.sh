#!/usr/bin/env bash
# MP-RDMA over the udp provider on a 4-spine ECMP fabric in network namespaces
# (tests/netns/fabric.sh): the kernel-testbed experiments of docs/MPRDMA.md ("On a real kernel network").
#
#   sudo bench/netns.sh [bandwidth|loss|failure|ecn|sync|loopback|all]... > out.jsonl   (default all)
#   cargo run -p fabriq-sim --bin netns-plot -- out.jsonl docs/img           (figures, table)
#
# Every setting is run R times, the single-path and multi-path runs (or the variants compared)
# alternating, so a burst of load on a shared machine does not land on one side only. Prints
# one JSON line per run: {"exp","setting","mode","variant","run","client":{..},"server":{..},
# "spines":{..}} (spines: packets forwarded, dropped, CE-marked per spine during the run), then
# one {"summary":..} line per setting with the median, min and max goodput over its runs.
#
# `loopback` runs the same transfers over 127.0.0.1 without the fabric (not part of `all`): with
# VARIANTS, a quick before/after comparison of the provider's own cost.
#
# Environment: R (runs per setting, 3), SECS (seconds per run, 5), RATE (spine rate, 100mbit),
# BW_RATES (the spine rates of the bandwidth experiment, "$RATE 40mbit"; it also runs the
# multi-path transfer on the unshaped fabric, the machine's own ceiling),
# SIZE (message bytes, 65536), UNEQUAL (the four spine rates of the sync experiment,
# "100mbit 50mbit 20mbit 10mbit"), ITERS (sync rounds per run, 200), OPTS (udp device options
# added to every run, e.g. "gso=1"), VARIANTS (builds or options compared side by side:
# space-separated NAME:BINARY:OPT,OPT,..; an empty BINARY is this tree's build; default
# "default::"), e.g. VARIANTS="before:/tmp/udp_goodput.old: after::".
#
# Needs root, iproute2, nftables. Builds the udp_goodput example in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
export FABRIQ_NETNS_PREFIX=${FABRIQ_NETNS_PREFIX:-fqbench}
FAB=tests/netns/fabric.sh
R=${R:-3}
SECS=${SECS:-5}
RATE=${RATE:-100mbit}
SIZE=${SIZE:-65536}
UNEQUAL=${UNEQUAL:-100mbit 50mbit 20mbit 10mbit}
ITERS=${ITERS:-200}
BW_RATES=${BW_RATES:-$RATE 40mbit}
OPTS=${OPTS:-}
VARIANTS=${VARIANTS:-default::}
cargo build --release -q -p fabriq-verbs --example udp_goodput >&2
OWN_BIN=${CARGO_TARGET_DIR:-target}/release/examples/udp_goodput
TMP=$(mktemp -d)
trap 'bash $FAB down; rm -rf "$TMP"' EXIT

MP=(mode=multi paths=16)
sp_opts() { SP=(mode=single paths=1 "line_rate_mbps=${1%mbit}"); }
sp_opts "$RATE"

# run EXP SETTING MODE VARIANT RUN EXTRA_ARGS -- DEVICE_OPTS...: one transfer, one JSON line.
run() {
  local exp=$1 setting=$2 mode=$3 variant=$4 n=$5; shift 5
  local extra=()
  while [ "$1" != "--" ]; do extra+=("$1"); shift; done
  shift
  local name=${variant%%:*} rest=${variant#*:}
  local bin=${rest%%:*} vopts=${rest#*:}
  [ -n "$bin" ] || bin=$OWN_BIN
  local opts=()
  for o in "$@" $OPTS ${vopts//,/ }; do opts+=(--opt "$o"); done
  local in_a=(ip netns exec "$FABRIQ_NETNS_PREFIX-hA") in_b=(ip netns exec "$FABRIQ_NETNS_PREFIX-hB")
  local a_addr=198.18.1.1 b_addr=198.18.2.1 spines='{}'
  if [ "$exp" = loopback ]; then
    in_a=(env); in_b=(env); a_addr=127.0.0.1; b_addr=127.0.0.1
  else
    bash $FAB reset-counters
  fi
  "${in_b[@]}" "$bin" server --bind $b_addr:47000 --oob $b_addr:47999 \
    --secs "$SECS" --size "$SIZE" "${extra[@]}" "${opts[@]}" > "$TMP/server" &
  local srv=$!
  "${in_a[@]}" "$bin" client --bind $a_addr:46000 --oob $b_addr:47999 \
    --secs "$SECS" --size "$SIZE" --depth 32 --interval-ms "${INTERVAL_MS:-250}" "${extra[@]}" "${opts[@]}" \
    > "$TMP/client" || true
  wait "$srv" || true
  local c s
  c=$(grep -m1 '^{' "$TMP/client" || echo '{"failed":true}')
  s=$(grep -m1 '^{' "$TMP/server" || echo '{"complete":false}')
  [ "$exp" = loopback ] || spines=$(bash $FAB counters-json)
  local line
  line=$(printf '{"exp":"%s","setting":"%s","mode":"%s","variant":"%s","run":%d,"client":%s,"server":%s,"spines":%s}' \
    "$exp" "$setting" "$mode" "$name" "$n" "$c" "$s" "$spines")
  echo "$line" | tee -a "$TMP/runs"
}

# each EXP SETTING EXTRA_ARGS -- MODE... : R rounds; in each, every mode and variant once.
each() {
  local exp=$1 setting=$2; shift 2
  local extra=()
  while [ "$1" != "--" ]; do extra+=("$1"); shift; done
  shift
  local n mode v
  for n in $(seq 1 "$R"); do
    for mode in "$@"; do
      for v in $VARIANTS; do
        case $mode in
          single) run "$exp" "$setting" single "$v" "$n" "${extra[@]}" -- "${SP[@]}" ;;
          multi) run "$exp" "$setting" multi "$v" "$n" "${extra[@]}" -- "${MP[@]}" ;;
          sync-on) run "$exp" "$setting" sync-on "$v" "$n" "${extra[@]}" --sync on -- "${MP[@]}" ;;
          sync-off) run "$exp" "$setting" sync-off "$v" "$n" "${extra[@]}" --sync off -- "${MP[@]}" ;;
        esac
      done
    done
  done
}

fresh() { bash $FAB up; bash $FAB shape "$@"; }

bandwidth() {
  local rate
  for rate in $BW_RATES; do
    fresh "$rate"
    sp_opts "$rate"
    each bandwidth "spines $rate" -- single multi
  done
  sp_opts "$RATE"
  bash $FAB unshape
  each bandwidth "unshaped" -- multi
}

loss() {
  fresh "$RATE"
  local k per; k=$(bash $FAB path 46000 47000)
  for per in 50 100 500; do
    bash $FAB loss "$k" "$per"
    each loss "loss=${per}e-4 spine=$k" -- single multi
  done
}

failure() {
  fresh "$RATE"
  local n v third
  third=$(awk "BEGIN {printf \"%.2f\", $SECS / 3}")
  for n in $(seq 1 "$R"); do
    for v in $VARIANTS; do
      ( sleep "$third"; bash $FAB fail 2; sleep "$third"; bash $FAB restore 2 ) &
      INTERVAL_MS=100 run failure "spine 2 down from ${third}s for ${third}s" multi "$v" "$n" -- "${MP[@]}"
      wait
    done
  done
}

ecn() {
  fresh "$RATE"
  local n v
  for n in $(seq 1 "$R"); do
    for v in $VARIANTS; do
      bash $FAB clear 3
      run ecn "unmarked" multi "$v" "$n" -- "${MP[@]}"
      bash $FAB ecn-rate 3 2000
      run ecn "CE above 2000 pkt/s on spine 3" multi "$v" "$n" -- "${MP[@]}"
    done
  done
}

loopback() {
  each loopback "127.0.0.1" -- multi
}

sync_exp() {
  # shellcheck disable=SC2086
  fresh $UNEQUAL
  SIZE=16384 each sync "spines ${UNEQUAL// //}" --test sync --iters "$ITERS" --depth 16 -- sync-on sync-off
}

# Median, min and max client goodput per (exp, setting, mode, variant), plus the sync
# violations and the largest out-of-order gap the receivers saw.
summary() {
  [ -s "$TMP/runs" ] || return 0
  sed -E 's/^\{"exp":"([^"]*)","setting":"([^"]*)","mode":"([^"]*)","variant":"([^"]*)".*"client":\{[^}]*"goodput_mbps":([0-9.]+).*/\1|\2|\3|\4\t\5/;t;d' "$TMP/runs" |
    sort -t "$(printf '\t')" -k1,1 -k2,2n |
    awk -F '\t' '
      function flush() {
        if (n == 0) return
        split(key, f, "|")
        med = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
        printf "{\"summary\":{\"exp\":\"%s\",\"setting\":\"%s\",\"mode\":\"%s\",\"variant\":\"%s\"},\"runs\":%d,\"median_mbps\":%.1f,\"min_mbps\":%.1f,\"max_mbps\":%.1f}\n", f[1], f[2], f[3], f[4], n, med, v[1], v[n]
      }
      $1 != key { flush(); key = $1; n = 0 }
      { v[++n] = $2 + 0 }
      END { flush() }'
  local viol
  viol=$(grep -o '"violations":[0-9]*' "$TMP/runs" | awk -F: '{s += $2} END {print s + 0}')
  if grep -q '"violations"' "$TMP/runs"; then
    printf '{"summary":{"exp":"sync"},"violations":%d,"max_ooo_gap":%d}\n' "$viol" \
      "$(grep '"violations"' "$TMP/runs" | sed -E 's/.*"server":(.*),"spines".*/\1/' | grep -o '"max_ooo_gap":[0-9]*' | awk -F: '$2 > m {m = $2} END {print m + 0}')"
  fi
}

[ $# -gt 0 ] || set -- all
for what in "$@"; do
  case $what in
    bandwidth|loss|failure|ecn|loopback) $what ;;
    sync) sync_exp ;;
    all) bandwidth; loss; failure; ecn; sync_exp ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
  esac
done
summary
