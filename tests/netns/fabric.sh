#!/usr/bin/env bash
# A four-path ECMP fabric in network namespaces, for the udp (MP-RDMA) provider's tests and
# experiments:
#
#        hA ── l1 ══ s1..s4 ══ l2 ── hB
#
# hA and hB are hosts; l1 and l2 are leaves with 4-way ECMP routes over the spines s1..s4, hashing
# the true 5-tuple (fib_multipath_hash_policy=3, fields 0x37), so each UDP source port (a virtual
# path) lands on one spine and different ports spread over all four. Addresses are from
# 198.18.0.0/15 (RFC 2544 benchmarking range) and exist only inside these namespaces.
#
#   fabric.sh up                  build it (tears down first; idempotent)
#   fabric.sh down                remove every namespace
#   fabric.sh shape RATE [R2 R3 R4]   tbf on every spine egress, both directions: RATE (e.g.
#                                 100mbit) on all four, or RATE, R2, R3, R4 on spines 1..4
#                                 (queue bound: $FABRIQ_TBF_LATENCY, default 20ms)
#   fabric.sh unshape             remove the shaping
#   fabric.sh loss K PERTENTHOUSAND   drop that share of packets forwarded by spine K (5 = 0.05%... 50 = 0.5%)
#   fabric.sh ecn K PERCENT       mark CE on that share of ECT packets through spine K
#   fabric.sh ecn-rate K PPS      mark CE on packets above PPS through spine K
#   fabric.sh clear K             remove loss/ECN rules of spine K
#   fabric.sh fail K              take the spine K → l2 link down (invisible to l1: a blackhole)
#   fabric.sh restore K           bring it back and re-add the routes the kernel dropped
#   fabric.sh path SPORT DPORT    which spine l1 sends hA:SPORT → hB:DPORT (UDP) through
#   fabric.sh counters            packets forwarded / dropped / marked per spine
#   fabric.sh counters-json       the same as one JSON object {"s1":{"total":..,"drop":..,"ce":..},..}
#   fabric.sh reset-counters      zero those counters
#   fabric.sh check               exit 0 if namespaces can be made here (root, iproute2, veth)
#
# The hosts' interfaces cut UDP GSO sends into datagrams themselves (gso_max_segs 1), as a NIC
# with segmentation offload would: every datagram crosses the fabric as its own packet, so loss,
# ECN marking and the counters act per datagram.
#
# Namespace names take the prefix $FABRIQ_NETNS_PREFIX (default "fq"), e.g. fq-hA.
set -euo pipefail

P=${FABRIQ_NETNS_PREFIX:-fq}
HA=$P-hA; HB=$P-hB; L1=$P-l1; L2=$P-l2
SPINES=(1 2 3 4)
A_ADDR=198.18.1.1; B_ADDR=198.18.2.1

ns() { local n=$1; shift; ip netns exec "$n" "$@"; }

# nftables (loss and ECN rules, counters) comes from Debian's package; install it when missing.
need_tools() {
  command -v nft >/dev/null && command -v tc >/dev/null && return 0
  [ "$(id -u)" = 0 ] || return 1
  command -v apt-get >/dev/null || return 1
  echo "fabric: installing nftables iproute2" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables iproute2 >/dev/null 2>&1
  command -v nft >/dev/null && command -v tc >/dev/null
}
sp() { echo "$P-s$1"; }

down() {
  for n in $HA $HB $L1 $L2 $(for k in "${SPINES[@]}"; do sp "$k"; done); do
    ip netns del "$n" 2>/dev/null || true
  done
}

link() { # link NS1 IF1 NS2 IF2
  ip link add "tmp$$a" type veth peer name "tmp$$b"
  ip link set "tmp$$a" netns "$1"; ip -n "$1" link set "tmp$$a" name "$2"
  ip link set "tmp$$b" netns "$3"; ip -n "$3" link set "tmp$$b" name "$4"
  ip -n "$1" link set dev "$2" up; ip -n "$3" link set dev "$4" up
}

router() {
  ns "$1" sysctl -qw net.ipv4.ip_forward=1
  ns "$1" sysctl -qw net.ipv4.conf.all.rp_filter=0
  ns "$1" sysctl -qw net.ipv4.conf.default.rp_filter=0
  ns "$1" sysctl -qw net.ipv4.conf.all.ignore_routes_with_linkdown=1
  ns "$1" sysctl -qw net.ipv4.fib_multipath_hash_policy=3
  ns "$1" sysctl -qw net.ipv4.fib_multipath_hash_fields=0x0037
}

leaf_routes() { # re-create the multipath routes of l1 and l2
  local hops1=() hops2=()
  for k in "${SPINES[@]}"; do
    hops1+=(nexthop via "198.18.$((10 + k)).2" dev "s$k" weight 1)
    hops2+=(nexthop via "198.18.$((20 + k)).1" dev "s$k" weight 1)
  done
  ip -n "$L1" route replace 198.18.2.0/24 "${hops1[@]}"
  ip -n "$L2" route replace 198.18.1.0/24 "${hops2[@]}"
}

spine_routes() {
  local k=$1 s; s=$(sp "$k")
  ip -n "$s" route replace 198.18.2.0/24 via "198.18.$((20 + k)).2" dev l2
  ip -n "$s" route replace 198.18.1.0/24 via "198.18.$((10 + k)).1" dev l1
}

up() {
  down
  for n in $HA $HB $L1 $L2 $(for k in "${SPINES[@]}"; do sp "$k"; done); do
    ip netns add "$n"; ip -n "$n" link set lo up
  done
  link "$HA" eth0 "$L1" a
  link "$HB" eth0 "$L2" b
  ip -n "$HA" addr add $A_ADDR/24 dev eth0; ip -n "$L1" addr add 198.18.1.254/24 dev a
  ip -n "$HB" addr add $B_ADDR/24 dev eth0; ip -n "$L2" addr add 198.18.2.254/24 dev b
  ip -n "$HA" link set dev eth0 gso_max_segs 1
  ip -n "$HB" link set dev eth0 gso_max_segs 1
  ip -n "$HA" route add default via 198.18.1.254
  ip -n "$HB" route add default via 198.18.2.254
  router "$L1"; router "$L2"
  for k in "${SPINES[@]}"; do
    local s; s=$(sp "$k")
    router "$s"
    link "$L1" "s$k" "$s" l1
    link "$s" l2 "$L2" "s$k"
    ip -n "$L1" addr add "198.18.$((10 + k)).1/30" dev "s$k"; ip -n "$s" addr add "198.18.$((10 + k)).2/30" dev l1
    ip -n "$s" addr add "198.18.$((20 + k)).1/30" dev l2; ip -n "$L2" addr add "198.18.$((20 + k)).2/30" dev "s$k"
    spine_routes "$k"
  done
  leaf_routes
  # Per-spine nftables table with counters (loss and ECN rules are added to its chain).
  for k in "${SPINES[@]}"; do
    ns "$(sp "$k")" nft -f - <<NFT
table inet fabriq {
  counter ctr_total { }
  counter ctr_drop { }
  counter ctr_ce { }
  chain spine {
    type filter hook forward priority 0; policy accept;
    counter name ctr_total
  }
}
NFT
  done
  # veth links take a moment to come up: wait until every one has carrier.
  for _ in $(seq 1 100); do
    local down=0
    for n in $HA $HB $L1 $L2 $(for k in "${SPINES[@]}"; do sp "$k"; done); do
      ip -n "$n" -o link show | grep -v ' lo:' | grep -qv 'LOWER_UP' && down=1
    done
    [ "$down" = 0 ] && return 0
    sleep 0.05
  done
  echo "fabric: links did not come up" >&2
  return 1
}

reset_chain() {
  local s; s=$(sp "$1")
  ns "$s" nft flush chain inet fabriq spine
  ns "$s" nft add rule inet fabriq spine counter name ctr_total
}

case "${1:-}" in
  up) need_tools || { echo "fabric: nftables/tc unavailable" >&2; exit 1; }; up ;;
  down) down ;;
  check)
    [ "$(id -u)" = 0 ] || { echo "not root"; exit 1; }
    need_tools || { echo "nftables or tc missing and cannot be installed"; exit 1; }
    ip netns add "$P-probe" 2>/dev/null || { echo "cannot create network namespaces"; exit 1; }
    ip netns del "$P-probe"; echo ok ;;
  shape)
    shift
    rates=("$@")
    [ "${#rates[@]}" = 1 ] && rates=("$1" "$1" "$1" "$1")
    [ "${#rates[@]}" = 4 ] || { echo "shape: one rate or four" >&2; exit 2; }
    for k in "${SPINES[@]}"; do
      for dev in l1 l2; do
        ns "$(sp "$k")" tc qdisc replace dev "$dev" root tbf rate "${rates[$((k - 1))]}" burst 32kb latency "${FABRIQ_TBF_LATENCY:-20ms}"
      done
    done ;;
  unshape)
    for k in "${SPINES[@]}"; do for dev in l1 l2; do ns "$(sp "$k")" tc qdisc del dev "$dev" root 2>/dev/null || true; done; done ;;
  loss)
    k=$2; n=$3; reset_chain "$k"
    ns "$(sp "$k")" nft add rule inet fabriq spine meta l4proto udp numgen random mod 10000 lt "$n" counter name ctr_drop drop ;;
  ecn)
    k=$2; pct=$3; reset_chain "$k"
    ns "$(sp "$k")" nft add rule inet fabriq spine ip ecn ect0 numgen random mod 100 lt "$pct" counter name ctr_ce ip ecn set ce ;;
  ecn-rate)
    k=$2; pps=$3; reset_chain "$k"
    ns "$(sp "$k")" nft add rule inet fabriq spine ip ecn ect0 limit rate over "$pps"/second burst 16 packets counter name ctr_ce ip ecn set ce ;;
  clear) reset_chain "$2" ;;
  fail) ip -n "$(sp "$2")" link set dev l2 down ;;
  restore)
    k=$2
    ip -n "$(sp "$k")" link set dev l2 up
    ip -n "$L2" link set dev "s$k" up
    for _ in $(seq 1 30); do
      ip -n "$(sp "$k")" link show dev l2 | grep -q 'LOWER_UP' && break; sleep 0.1
    done
    spine_routes "$k"; leaf_routes ;;
  path)
    sport=$2; dport=$3
    ip -n "$L1" route get $B_ADDR from $A_ADDR iif a ipproto udp sport "$sport" dport "$dport" |
      sed -n 's/.* dev s\([0-9]\).*/\1/p' ;;
  counters)
    for k in "${SPINES[@]}"; do
      printf 's%s ' "$k"
      ns "$(sp "$k")" nft list counters table inet fabriq | awk '/counter/ {n=$2} /packets/ {printf "%s=%s ", n, $2}'
      echo
    done ;;
  counters-json)
    sep='{'
    for k in "${SPINES[@]}"; do
      printf '%s"s%s":' "$sep" "$k"; sep=','
      ns "$(sp "$k")" nft list counters table inet fabriq |
        awk '/counter/ {n=$2; sub("ctr_", "", n)} /packets/ {v[n]=$2}
             END {printf "{\"total\":%d,\"drop\":%d,\"ce\":%d}", v["total"], v["drop"], v["ce"]}'
    done
    echo '}' ;;
  reset-counters)
    for k in "${SPINES[@]}"; do ns "$(sp "$k")" nft reset counters table inet fabriq >/dev/null; done ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
