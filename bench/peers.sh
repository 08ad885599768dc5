#!/usr/bin/env bash
# bench/peers.sh — fabriq perf side by side with UCX (ucx_perftest), libfabric (fi_pingpong)
# and a plain busy-polled kernel-TCP ping-pong, on loopback, one process per core; beside the
# tcp bandwidth rows, one kernel TCP stream (iperf3) placed the same way.
#
# Usage (as root on Debian/Ubuntu, from anywhere in the repository):
#   bench/peers.sh                 # R=3 repetitions, writes docs/BENCHMARKS.md
#   R=5 OUT=/tmp/b.md bench/peers.sh
#   QUICK=1 bench/peers.sh         # 10x fewer iterations (smoke run)
#   NO_INSTALL=1 bench/peers.sh    # do not apt-get anything
#   SIZES="8 4096" TESTS="send_lat send_bw" bench/peers.sh   # a subset
#   MW=0 bench/peers.sh            # skip the middleware-layer rows (fabriq Channel / Rpc)
#   MW_PROGRESS=thread bench/peers.sh   # middleware worker driven by its thread, not the caller
#   PROFILE=release-lto bench/peers.sh  # fabriq built as a deployment would (fat LTO, one
#                                       # codegen unit; Cargo.toml), not the default release
#
# Every figure is the median of R runs. Latency is one-way (RTT/2) p50 in microseconds,
# except fi_pingpong, which only reports the mean one-way time per transfer. Bandwidth is
# payload MiB/s with the message rate in million messages per second. A peer tool that is
# missing or fails is written into the table as such; the script itself does not stop.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
R=${R:-3}
OUT=${OUT:-$ROOT/docs/BENCHMARKS.md}
CLIENT_CPU=${CLIENT_CPU:-0}
SERVER_CPU=${SERVER_CPU:-1}
QUICK=${QUICK:-0}
RUN_TIMEOUT=${RUN_TIMEOUT:-60}
read -r -a SIZES <<<"${SIZES:-8 4096 65536 1048576}"
read -r -a TESTS <<<"${TESTS:-send_lat write_lat send_bw write_bw}"
MW=${MW:-1}
MW_PROGRESS=${MW_PROGRESS:-caller}
PROFILE=${PROFILE:-release}
PORT=${PORT_BASE:-23000}
LOG=${LOG:-/tmp/fabriq-peers.log}
: >"$LOG"

log() { printf '%s\n' "$*" | tee -a "$LOG" >&2; }

# ---------------------------------------------------------------- install + build
install_peers() {
    [ "${NO_INSTALL:-0}" = 1 ] && return 0
    local need=()
    for pkg in ucx-utils libfabric-bin iperf3; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    [ ${#need[@]} -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ]; then
        log "not root: cannot install ${need[*]}; those columns will say so"
        return 0
    fi
    log "installing ${need[*]}"
    apt-get update -qq >>"$LOG" 2>&1 || log "apt-get update failed (see $LOG)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >>"$LOG" 2>&1 \
        || log "apt-get install ${need[*]} failed (see $LOG)"
}

build_fabriq() {
    log "building fabriq ($PROFILE)"
    (cd "$ROOT" && cargo build --profile "$PROFILE" -p fabriq-cli >>"$LOG" 2>&1) || {
        log "cargo build failed (see $LOG)"
        exit 1
    }
    local dir=${CARGO_TARGET_DIR:-$ROOT/target}
    FABRIQ="$dir/$PROFILE/fabriq"
    [ -x "$FABRIQ" ] || { log "no binary at $FABRIQ"; exit 1; }
}

# ---------------------------------------------------------------- helpers
# a fresh port per peer run (a file counter: measurements run in subshells)
PORT_FILE=$(mktemp)
echo "$PORT" >"$PORT_FILE"
next_port() {
    local p
    p=$(($(cat "$PORT_FILE") + 1))
    [ "$p" -gt 60000 ] && p=${PORT_BASE:-23000}
    echo "$p" >"$PORT_FILE"
    echo "$p"
}

# reap PID: give a peer server we started 5 s to exit after its client, then stop it
reap() {
    local pid=$1
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

# iterations per (kind, size): enough for a stable median, bounded for 1 MiB
iters() {
    local kind=$1 size=$2 n
    case $kind in
        lat) case $size in 8|4096) n=10000 ;; 65536) n=2000 ;; *) n=300 ;; esac ;;
        # fi_pingpong runs in milliseconds per transfer on this kind of box: fewer iterations
        fi) case $size in 8|4096) n=1000 ;; 65536) n=200 ;; *) n=30 ;; esac ;;
        *) case $size in 8) n=100000 ;; 4096) n=20000 ;; 65536) n=5000 ;; *) n=200 ;; esac ;;
    esac
    [ "$QUICK" = 1 ] && n=$((n / 10))
    echo "$n"
}

# median of numeric arguments; non-numeric ones are ignored
median() {
    printf '%s\n' "$@" | grep -E '^[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$' | sort -g |
        awk '{v[NR]=$1} END { if (NR==0) exit 1; if (NR%2) printf "%s", v[(NR+1)/2];
             else printf "%.4g", (v[NR/2]+v[NR/2+1])/2 }'
}

# json_field NAME FILE: first numeric value of "NAME": in a JSON file
json_field() {
    grep -o "\"$1\": *[-0-9.eE+]*" "$2" | head -n1 | sed 's/.*: *//'
}

# repeat R times a function that prints one value (or FAIL:...); print the median, or the
# first failure when no run produced a number
repeat() {
    local vals=() v first_fail=""
    for _ in $(seq "$R"); do
        v=$("$@" 2>>"$LOG" | tail -n1)
        case $v in
            FAIL*|"") [ -z "$first_fail" ] && first_fail=${v:-FAIL:no output} ;;
            *) vals+=("$v") ;;
        esac
    done
    if [ ${#vals[@]} -gt 0 ]; then
        median "${vals[@]}"
        [ -n "$first_fail" ] && printf ' (%d/%s ok)' "${#vals[@]}" "$R"
    else
        printf '%s' "${first_fail#FAIL:}"
    fi
}

# ---------------------------------------------------------------- fabriq
# fabriq_one DEVICE TEST SIZE FIELD  → value of FIELD in the JSON result
fabriq_one() {
    local dev=$1 test=$2 size=$3 field=$4 kind=lat tmp
    [[ $test == *_bw ]] && kind=bw
    tmp=$(mktemp)
    if timeout "$RUN_TIMEOUT" "$FABRIQ" perf --local -d "$dev" -t "$test" -s "$size" \
        -n "$(iters "$kind" "$size")" --cpu "$CLIENT_CPU" --server-cpu "$SERVER_CPU" \
        --json >"$tmp" 2>>"$LOG"; then
        json_field "$field" "$tmp"
    else
        echo "FAIL:fabriq failed (exit $?)"
    fi
    rm -f "$tmp"
}

tcp_baseline_one() {
    local size=$1 tmp
    tmp=$(mktemp)
    if timeout "$RUN_TIMEOUT" "$FABRIQ" perf --local --tcp-baseline -s "$size" \
        -n "$(iters lat "$size")" --cpu "$CLIENT_CPU" --server-cpu "$SERVER_CPU" \
        --json >"$tmp" 2>>"$LOG"; then
        json_field p50_us "$tmp"
    else
        echo "FAIL:baseline failed (exit $?)"
    fi
    rm -f "$tmp"
}

# ---------------------------------------------------------------- fabriq middleware layers
# fabriq_mw_one DEVICE LAYER TEST SIZE FIELD → value of FIELD in the JSON result
fabriq_mw_one() {
    local dev=$1 layer=$2 test=$3 size=$4 field=$5 n tmp
    case $test in
        send_lat|rpc_lat) n=$(iters lat "$size") ;;
        rpc_rate) n=20000; [ "$QUICK" = 1 ] && n=2000 ;;
        *) n=$(iters bw "$size") ;;
    esac
    tmp=$(mktemp)
    if timeout "$RUN_TIMEOUT" "$FABRIQ" perf --local --layer "$layer" --progress "$MW_PROGRESS" \
        -d "$dev" -t "$test" -s "$size" -n "$n" --cpu "$CLIENT_CPU" --server-cpu "$SERVER_CPU" \
        --json >"$tmp" 2>>"$LOG"; then
        json_field "$field" "$tmp"
    else
        echo "FAIL:fabriq --layer $layer failed (exit $?)"
    fi
    rm -f "$tmp"
}

# fabriq_connect_one DEVICE cold|cached|floor|ratio|bound → connect_lat's cold, cached or wake
# floor p50 (µs), cold ÷ cached, or cold ÷ floor (the most any cached connect could show on this
# host), of one run (two processes, each pinned; the kinds in turn)
fabriq_connect_one() {
    local dev=$1 what=$2 n=200 tmp cold cached floor
    [ "$QUICK" = 1 ] && n=50
    tmp=$(mktemp)
    if timeout "$RUN_TIMEOUT" "$FABRIQ" perf --local --layer channel --progress "$MW_PROGRESS" \
        -d "$dev" -t connect_lat -n "$n" --cpu "$CLIENT_CPU" --server-cpu "$SERVER_CPU" \
        --json >"$tmp" 2>>"$LOG"; then
        # Rows in order: cold, cached, floor.
        cold=$(grep -o '"p50_us": *[-0-9.eE+]*' "$tmp" | sed -n 1p | sed 's/.*: *//')
        cached=$(grep -o '"p50_us": *[-0-9.eE+]*' "$tmp" | sed -n 2p | sed 's/.*: *//')
        floor=$(grep -o '"p50_us": *[-0-9.eE+]*' "$tmp" | sed -n 3p | sed 's/.*: *//')
        case $what in
            cold) echo "$cold" ;;
            cached) echo "$cached" ;;
            floor) echo "${floor:-FAIL:no wake floor row}" ;;
            ratio) awk -v a="$cold" -v b="$cached" 'BEGIN { printf "%.2f\n", a / b }' ;;
            bound)
                if [ -n "$floor" ]; then
                    awk -v a="$cold" -v b="$floor" 'BEGIN { printf "%.2f\n", a / b }'
                else
                    echo "FAIL:no wake floor row"
                fi
                ;;
        esac
    else
        echo "FAIL:fabriq connect_lat failed (exit $?)"
    fi
    rm -f "$tmp"
}

# ---------------------------------------------------------------- one kernel TCP stream
# iperf3_one → MiB/s received over one TCP connection, 1 MiB writes, 3 s, pinned like the rest
iperf3_one() {
    local port out bps
    command -v iperf3 >/dev/null || { echo "FAIL:iperf3 not installed"; return; }
    port=$(next_port)
    timeout "$RUN_TIMEOUT" taskset -c "$SERVER_CPU" iperf3 -s -1 -p "$port" >>"$LOG" 2>&1 &
    local spid=$!
    sleep 0.3
    out=$(timeout "$RUN_TIMEOUT" taskset -c "$CLIENT_CPU" iperf3 -c 127.0.0.1 -p "$port" \
        -l 1M -t 3 -J 2>>"$LOG")
    wait "$spid" 2>/dev/null
    bps=$(printf '%s' "$out" | tr -d '\n' | grep -o '"sum_received":[^}]*' |
        grep -o '"bits_per_second":[[:space:]]*[0-9.eE+]*' | head -n1 | sed 's/.*:[[:space:]]*//')
    [ -n "$bps" ] || { echo "FAIL:iperf3 failed"; return; }
    awk -v b="$bps" 'BEGIN { printf "%.1f", b / 8 / 1048576 }'
}

# ---------------------------------------------------------------- UCX
# ucx_one TLS TEST SIZE COLUMN → column of the "Final:" line
#   columns: 2 iterations, 3 p50 latency, 4 avg lat, 5 overall lat, 6 avg MB/s,
#            7 overall MB/s, 8 avg msg/s, 9 overall msg/s
ucx_one() {
    local tls=$1 test=$2 size=$3 col=$4 kind=lat port out
    command -v ucx_perftest >/dev/null || { echo "FAIL:ucx_perftest not installed"; return; }
    [[ $test == *_bw ]] && kind=bw
    port=$(next_port)
    UCX_TLS=$tls timeout "$RUN_TIMEOUT" taskset -c "$SERVER_CPU" ucx_perftest -p "$port" \
        >>"$LOG" 2>&1 &
    local spid=$!
    sleep 0.3
    # the server may still be starting on a loaded machine: retry a refused connection
    for _ in 1 2 3; do
        out=$(UCX_TLS=$tls timeout "$RUN_TIMEOUT" taskset -c "$CLIENT_CPU" ucx_perftest 127.0.0.1 \
            -p "$port" -t "$test" -s "$size" -n "$(iters "$kind" "$size")" 2>&1)
        echo "$out" | grep -qi "refused" || break
        sleep 1
    done
    echo "$out" >>"$LOG"
    reap "$spid"
    local v
    v=$(echo "$out" | awk -v c="$col" '$1=="Final:" {print $c}' | tail -n1)
    if [ -n "$v" ]; then echo "$v"; else
        echo "FAIL:ucx_perftest failed: $(echo "$out" | grep -m1 -iE 'error|unsupported|fail' | cut -c1-60)"
    fi
}

# ---------------------------------------------------------------- libfabric
fi_has() { command -v fi_info >/dev/null && fi_info -l 2>/dev/null | grep -q "^$1:"; }

# fi_one PROVIDER SIZE → mean one-way usec per transfer
fi_one() {
    local prov=$1 size=$2 port out n
    command -v fi_pingpong >/dev/null || { echo "FAIL:fi_pingpong not installed"; return; }
    fi_has "$prov" || { echo "FAIL:provider $prov absent"; return; }
    port=$(next_port)
    n=$(iters fi "$size")
    timeout "$RUN_TIMEOUT" taskset -c "$SERVER_CPU" fi_pingpong -p "$prov" -e rdm -B "$port" \
        -S "$size" -I "$n" >>"$LOG" 2>&1 &
    local spid=$!
    sleep 0.3
    for _ in 1 2 3; do
        out=$(timeout "$RUN_TIMEOUT" taskset -c "$CLIENT_CPU" fi_pingpong -p "$prov" -e rdm \
            -P "$port" -S "$size" -I "$n" 127.0.0.1 2>&1)
        echo "$out" | grep -qi "refused" || break
        sleep 1
    done
    echo "$out" >>"$LOG"
    reap "$spid"
    local v
    # last data row: "bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec" (bytes as "4k")
    v=$(echo "$out" | awk 'NF>=8 && $7 ~ /^[0-9]+(\.[0-9]+)?$/ {v=$7} END {print v}')
    if [ -n "$v" ]; then echo "$v"; else
        echo "FAIL:fi_pingpong failed: $(echo "$out" | grep -m1 -iE 'error|fail' | cut -c1-60)"
    fi
}

# ---------------------------------------------------------------- measurement plan
ucx_test_for() {
    case $1 in send_lat) echo tag_lat ;; write_lat) echo ucp_put_lat ;;
        send_bw) echo tag_bw ;; write_bw) echo ucp_put_bw ;; esac
}

human() {
    case $1 in 8) echo "8 B" ;; 4096) echo "4 KiB" ;; 65536) echo "64 KiB" ;;
        1048576) echo "1 MiB" ;; *) echo "$1 B" ;; esac
}

declare -A RES

measure() {
    local transport dev tls fiprov test size kind
    for transport in shm tcp; do
        if [ "$transport" = shm ]; then dev=shm0 tls=posix,self fiprov=shm
        else dev=tcp0 tls=tcp,self fiprov=tcp; fi
        for test in "${TESTS[@]}"; do
            for size in "${SIZES[@]}"; do
                log "== $transport $test $(human "$size")"
                if [[ $test == *_lat ]]; then
                    RES[$transport,$test,$size,fabriq]=$(repeat fabriq_one "$dev" "$test" "$size" p50_us)
                    RES[$transport,$test,$size,ucx]=$(repeat ucx_one "$tls" "$(ucx_test_for "$test")" "$size" 3)
                    if [ "$test" = send_lat ]; then
                        RES[$transport,$test,$size,fi]=$(repeat fi_one "$fiprov" "$size")
                        [ "$transport" = tcp ] &&
                            RES[$transport,$test,$size,tcp]=$(repeat tcp_baseline_one "$size")
                    fi
                else
                    [ "$transport,$test,$size" = tcp,send_bw,1048576 ] &&
                        RES[tcp,stream_bw,1048576]=$(repeat iperf3_one)
                    RES[$transport,$test,$size,fabriq]=$(repeat fabriq_one "$dev" "$test" "$size" mib_s)
                    RES[$transport,$test,$size,ucx]=$(repeat ucx_one "$tls" "$(ucx_test_for "$test")" "$size" 7)
                fi
            done
        done
    done
}

# the middleware layers beside UCX's active messages (ucp_am_lat) and tag matching (tag_bw);
# UCX_TLS posix,self for shm, tcp for tcp
measure_mw() {
    [ "$MW" = 1 ] || return 0
    local transport dev tls
    for transport in shm tcp; do
        if [ "$transport" = shm ]; then dev=shm0 tls=posix,self; else dev=tcp0 tls=tcp; fi
        log "== $transport middleware layers"
        RES[$transport,mw,chan_lat,fabriq]=$(repeat fabriq_mw_one "$dev" channel send_lat 8 p50_us)
        RES[$transport,mw,chan_lat,ucx]=$(repeat ucx_one "$tls" ucp_am_lat 8 3)
        RES[$transport,mw,chan_bw,fabriq]=$(repeat fabriq_mw_one "$dev" channel send_bw 1048576 mib_s)
        RES[$transport,mw,chan_bw,ucx]=$(repeat ucx_one "$tls" tag_bw 1048576 7)
        RES[$transport,mw,rpc_lat,fabriq]=$(repeat fabriq_mw_one "$dev" rpc rpc_lat 8 p50_us)
        RES[$transport,mw,rpc_rate,fabriq]=$(repeat fabriq_mw_one "$dev" rpc rpc_rate 8 calls_per_s)
        RES[$transport,mw,conn_cold,fabriq]=$(repeat fabriq_connect_one "$dev" cold)
        RES[$transport,mw,conn_cached,fabriq]=$(repeat fabriq_connect_one "$dev" cached)
        RES[$transport,mw,conn_ratio,fabriq]=$(repeat fabriq_connect_one "$dev" ratio)
        RES[$transport,mw,conn_floor,fabriq]=$(repeat fabriq_connect_one "$dev" floor)
        RES[$transport,mw,conn_bound,fabriq]=$(repeat fabriq_connect_one "$dev" bound)
    done
}

# ---------------------------------------------------------------- report
# a result cell, numbers rounded (latency to 3 decimals, bandwidth to 1); failures as text
cell() {
    local v=${RES[$1]:-} dec=3
    [[ $1 == *_bw,* ]] && dec=1
    [[ $1 == *,rpc_rate,* ]] && dec=0
    [ -z "$v" ] && { echo "n/a"; return; }
    echo "$v" | awk -v d="$dec" '$1 ~ /^[0-9.eE+-]+$/ { $1 = sprintf("%." d "f", $1) } { print }'
}

# message rate (M msg/s) from a MiB/s cell and the message size
mrate() {
    local n
    n=$(num "$1")
    if [ -n "$n" ]; then awk -v v="$n" -v s="$2" 'BEGIN { printf "%.3f", v * 1048576 / s / 1e6 }'
    else echo "—"; fi
}

num() { echo "$1" | awk '{print $1}' | grep -E '^[0-9.eE+-]+$'; }

target_line() { # NAME VALUE OP LIMIT UNIT
    local name=$1 v=$2 op=$3 lim=$4 unit=$5 n verdict
    n=$(num "$v")
    if [ -z "$n" ]; then verdict="not measured ($v)"; n="—"
    elif awk -v a="$n" -v b="$lim" -v o="$op" 'BEGIN { exit !((o=="le" && a<=b) || (o=="ge" && a>=b)) }'; then
        verdict="**hit**"
    else verdict="**miss**"; fi
    local sym="≤"; [ "$op" = ge ] && sym="≥"
    echo "| $name | $sym $lim $unit | $n $unit | $verdict |"
}

NOTES_MARK='<!-- notes below this line are kept when bench/peers.sh regenerates the file -->'

write_report() {
    local cpu kernel date rev ucxv fiv notes=""
    # hand-written notes after the marker survive regeneration
    [ -f "$OUT" ] && notes=$(awk -v m="$NOTES_MARK" 'f {print} $0 == m {f=1}' "$OUT")
    cpu=$(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}')
    kernel=$(uname -r)
    date=$(date -u '+%Y-%m-%d %H:%M UTC')
    rev=$(cd "$ROOT" && git rev-parse --short HEAD 2>/dev/null || echo unknown)
    ucxv=$(ucx_info -v 2>/dev/null | awk '/Version/ {print $3; exit}')
    fiv=$(fi_info --version 2>/dev/null | awk '/libfabric:/ {print $2; exit}')
    {
        echo "# Benchmarks: fabriq perf vs. UCX, libfabric and plain TCP"
        echo
        echo "Generated by \`bench/peers.sh\` on $date (fabriq $rev)."
        echo
        echo "| | |"
        echo "|---|---|"
        echo "| machine | shared 2-core VM ($(nproc) CPUs visible), $(free -g | awk '/Mem:/ {print $2}') GiB RAM |"
        echo "| CPU | $cpu |"
        echo "| kernel | $kernel |"
        echo "| UCX | ${ucxv:-not installed} (Debian ucx-utils) |"
        echo "| libfabric | ${fiv:-not installed} (Debian libfabric-bin) |"
        echo "| fabriq build | cargo profile \`$PROFILE\` |"
        echo "| repetitions | $R per cell, median shown |"
        echo "| pinning | client on CPU $CLIENT_CPU, server on CPU $SERVER_CPU (fabriq pins itself; peers via taskset) |"
        echo
        echo "**Read these numbers with care.** The machine is a shared 2-core VM (other tenants,"
        echo "load average \`$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)\` when the run ended); the two benchmark processes busy-poll"
        echo "one core each and get preempted whenever anything else runs. Medians hide part of that"
        echo "noise, not all of it, and every tool suffers it alike. Treat the tables as a"
        echo "side-by-side comparison on one noisy box, not as the speed of the software."
        echo
        echo "Units: latency = one-way (RTT/2) median in µs (fi_pingpong: mean one-way µs per"
        echo "transfer, the only figure it prints). Bandwidth = payload MiB/s, with the message"
        echo "rate in million messages per second in square brackets (derived: MiB/s ÷ size). UCX's MB/s is MiB/s."
        echo
        local transport test size label
        for transport in shm tcp; do
            if [ "$transport" = shm ]; then
                echo "## Shared memory: fabriq \`shm0\` vs. UCX \`posix,self\` vs. libfabric \`shm\`"
            else
                echo "## TCP loopback: fabriq \`tcp0\` vs. UCX \`tcp,self\` vs. libfabric \`tcp\` vs. plain TCP"
            fi
            echo
            echo "| test | size | fabriq | UCX (test) | fi_pingpong | plain TCP ping-pong |"
            echo "|---|---|---|---|---|---|"
            for test in "${TESTS[@]}"; do
                for size in "${SIZES[@]}"; do
                    label=$(human "$size")
                    if [[ $test == *_lat ]]; then
                        local fi_c="—" tcp_c="—"
                        if [ "$test" = send_lat ]; then
                            fi_c=$(cell "$transport,$test,$size,fi")
                            [ "$transport" = tcp ] && tcp_c=$(cell "$transport,$test,$size,tcp")
                        fi
                        echo "| $test | $label | $(cell "$transport,$test,$size,fabriq") | $(cell "$transport,$test,$size,ucx") ($(ucx_test_for "$test")) | $fi_c | $tcp_c |"
                    else
                        local f u
                        f=$(cell "$transport,$test,$size,fabriq")
                        u=$(cell "$transport,$test,$size,ucx")
                        echo "| $test | $label | $f [$(mrate "${RES[$transport,$test,$size,fabriq]:-}" "$size")] | $u [$(mrate "${RES[$transport,$test,$size,ucx]:-}" "$size")] ($(ucx_test_for "$test")) | — | — |"
                    fi
                done
            done
            echo
        done
        if [ "$MW" = 1 ]; then
            echo "## Middleware layers: fabriq \`Channel\` / \`Rpc\` vs. UCX active messages and tag matching"
            echo
            echo "fabriq runs with \`--progress $MW_PROGRESS\` (the application thread drives the worker"
            echo "when \`caller\`); UCX with \`UCX_TLS=posix,self\` (shm) and \`UCX_TLS=tcp\` (tcp)."
            echo
            echo "| transport | test | fabriq | UCX |"
            echo "|---|---|---|---|"
            for transport in shm tcp; do
                echo "| $transport | channel send_lat 8 B, one-way p50 µs | $(cell "$transport,mw,chan_lat,fabriq") | $(cell "$transport,mw,chan_lat,ucx") (ucp_am_lat) |"
                echo "| $transport | channel send_bw 1 MiB, MiB/s | $(cell "$transport,mw,chan_bw,fabriq") | $(cell "$transport,mw,chan_bw,ucx") (tag_bw) |"
                echo "| $transport | rpc_lat 8 B, round-trip p50 µs | $(cell "$transport,mw,rpc_lat,fabriq") | — |"
                echo "| $transport | rpc_rate 8 B, 8 callers, calls/s | $(cell "$transport,mw,rpc_rate,fabriq") | — |"
                echo "| $transport | connect_lat p50 µs, cold / cached (cold ÷ cached) | $(cell "$transport,mw,conn_cold,fabriq") / $(cell "$transport,mw,conn_cached,fabriq") ($(cell "$transport,mw,conn_ratio,fabriq")) | — |"
                echo "| $transport | connect_lat wake floor p50 µs (cold ÷ floor: the most a cached connect can show here) | $(cell "$transport,mw,conn_floor,fabriq") ($(cell "$transport,mw,conn_bound,fabriq")) | — |"
            done
            echo
        fi
        echo "## Targets"
        echo
        echo "| target | goal | measured (median) | verdict |"
        echo "|---|---|---|---|"
        target_line "shm SEND 8 B one-way p50" "$(cell shm,send_lat,8,fabriq)" le 0.30 µs
        target_line "shm WRITE 8 B one-way p50" "$(cell shm,write_lat,8,fabriq)" le 0.15 µs
        local base tcp_goal
        base=$(num "$(cell tcp,send_lat,8,tcp)")
        if [ -n "$base" ]; then
            tcp_goal=$(awk -v b="$base" 'BEGIN { printf "%.3f", b * 1.1 }')
            target_line "tcp SEND 8 B one-way p50 (≤ 1.1 × plain TCP $base µs)" "$(cell tcp,send_lat,8,fabriq)" le "$tcp_goal" µs
        else
            echo "| tcp SEND 8 B ≤ 1.1 × plain TCP | — | — | not measured (baseline failed) |"
        fi
        target_line "shm 8 B send_bw message rate" "$(mrate "${RES[shm,send_bw,8,fabriq]:-}" 8)" ge 3 "M msg/s"
        target_line "shm 1 MiB write_bw" "$(cell shm,write_bw,1048576,fabriq)" ge 6144 MiB/s
        target_line "shm 1 MiB send_bw" "$(cell shm,send_bw,1048576,fabriq)" ge 6144 MiB/s
        if [ "$MW" = 1 ]; then
            target_line "shm channel 8 B one-way p50" "$(cell shm,mw,chan_lat,fabriq)" le 0.40 µs
            local vsend
            vsend=$(num "$(cell shm,send_lat,8,fabriq)")
            if [ -n "$vsend" ]; then
                target_line "shm channel 8 B (≤ 1.3 × verbs SEND $vsend µs)" "$(cell shm,mw,chan_lat,fabriq)" le "$(awk -v b="$vsend" 'BEGIN { printf "%.3f", b * 1.3 }')" µs
            fi
            target_line "shm channel 1 MiB send_bw" "$(cell shm,mw,chan_bw,fabriq)" ge 6144 MiB/s
            target_line "tcp channel 1 MiB send_bw" "$(cell tcp,mw,chan_bw,fabriq)" ge 4096 MiB/s
            for transport in shm tcp; do
                target_line "$transport cached connect ≥ 5 × faster than cold (two processes)" "$(cell "$transport,mw,conn_ratio,fabriq")" ge 5 ×
                target_line "$transport cached connect p50 (two processes)" "$(cell "$transport,mw,conn_cached,fabriq")" le 50 µs
            done
        fi
        echo
        echo "Reference points from the same run: UCX shm tag_lat 8 B = $(cell shm,send_lat,8,ucx) µs,"
        echo "ucp_put_lat 8 B = $(cell shm,write_lat,8,ucx) µs; one kernel TCP stream (iperf3, 1 MiB"
        echo "writes, pinned like the rest) = $(cell tcp,stream_bw,1048576) MiB/s, for scale beside the tcp"
        echo "provider's one TCP connection per QP."
        echo
        echo "## Exact commands"
        echo
        echo "Iterations per run: latency 10000 (8 B, 4 KiB), 2000 (64 KiB), 300 (1 MiB);"
        echo "fi_pingpong 1000 (8 B, 4 KiB), 200 (64 KiB), 30 (1 MiB);"
        echo "bandwidth 100000 (8 B), 20000 (4 KiB), 5000 (64 KiB), 200 (1 MiB)$([ "$QUICK" = 1 ] && echo ", divided by 10 (QUICK=1)")."
        echo
        echo '```sh'
        echo "# fabriq (server child started and pinned by --local)"
        echo "fabriq perf --local -d {shm0|tcp0} -t {send_lat|write_lat|send_bw|write_bw} -s SIZE -n N --cpu $CLIENT_CPU --server-cpu $SERVER_CPU --json"
        echo "# plain TCP ping-pong baseline (busy-polled non-blocking sockets, TCP_NODELAY)"
        echo "fabriq perf --local --tcp-baseline -s SIZE -n N --cpu $CLIENT_CPU --server-cpu $SERVER_CPU --json"
        echo "# UCX"
        echo "UCX_TLS={posix,self|tcp,self} taskset -c $SERVER_CPU ucx_perftest -p PORT &"
        echo "UCX_TLS={posix,self|tcp,self} taskset -c $CLIENT_CPU ucx_perftest 127.0.0.1 -p PORT -t {tag_lat|ucp_put_lat|tag_bw|ucp_put_bw} -s SIZE -n N"
        if [ "$MW" = 1 ]; then
            echo "# fabriq middleware layers (rpc_rate: -n 20000, 8 callers)"
            echo "fabriq perf --local --layer channel --progress $MW_PROGRESS -d {shm0|tcp0} -t {send_lat|send_bw} -s SIZE -n N --cpu $CLIENT_CPU --server-cpu $SERVER_CPU --json"
            echo "fabriq perf --local --layer rpc --progress $MW_PROGRESS -d {shm0|tcp0} -t {rpc_lat|rpc_rate} -s 8 -n N --cpu $CLIENT_CPU --server-cpu $SERVER_CPU --json"
            echo "fabriq perf --local --layer channel --progress $MW_PROGRESS -d {shm0|tcp0} -t connect_lat -n 200 --cpu $CLIENT_CPU --server-cpu $SERVER_CPU --json"
            echo "UCX_TLS={posix,self|tcp} ucx_perftest … -t {ucp_am_lat|tag_bw} (as above)"
        fi
        echo "# one kernel TCP stream"
        echo "taskset -c $SERVER_CPU iperf3 -s -1 -p PORT &"
        echo "taskset -c $CLIENT_CPU iperf3 -c 127.0.0.1 -p PORT -l 1M -t 3 -J   # end.sum_received.bits_per_second"
        echo "# libfabric"
        echo "taskset -c $SERVER_CPU fi_pingpong -p {shm|tcp} -e rdm -B PORT -S SIZE -I N &"
        echo "taskset -c $CLIENT_CPU fi_pingpong -p {shm|tcp} -e rdm -P PORT -S SIZE -I N 127.0.0.1"
        echo '```'
        echo
        echo "Parsed fields: fabriq \`p50_us\`, \`mib_s\` and \`calls_per_s\` of the JSON; ucx_perftest the"
        echo "\`Final:\` line (50%ile latency, overall MB/s, overall msg/s); fi_pingpong the"
        echo "\`usec/xfer\` column. Raw output of the last run: \`$LOG\` (not kept in the repository)."
        echo
        echo "$NOTES_MARK"
        [ -n "$notes" ] && printf '%s\n' "$notes"
    } >"$OUT"
    log "wrote $OUT"
}

install_peers
build_fabriq
measure
measure_mw
write_report
rm -f "$PORT_FILE"
