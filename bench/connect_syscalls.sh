#!/usr/bin/env bash
# bench/connect_syscalls.sh — system calls per connect through `Endpoint`, counted by strace:
# on an otherwise idle host the same count run after run (to a few hundredths; under load
# wake-ups come later and receives find nothing more often), so it tells what a change of the
# connect path does where a timed A/B drowns in the host's noise.
#
# Runs `examples/connect_spin_ab` under `strace -f` with `AB_MARK=1` (a getppid call opens and
# closes each timed part: `connect` on the client plus the server's `accept` returning),
# after every thread of both ends went back to sleep (`AB_SETTLE_US`, so no close of the
# previous round is counted), and prints the calls of every thread of the process made inside
# the timed parts, per connect, by name; "would block" counts the calls that returned EAGAIN.
# sched_yield is counted apart: how many a spin makes depends on how long it waits.
#
# Usage: bench/connect_syscalls.sh [DEVICE] [ROUNDS] [MODE]
#   DEVICE  tcp0 (default) or shm0;  ROUNDS  timed connects (default 200);
#   MODE    cached (default) or cold
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${1:-tcp0}
ROUNDS=${2:-200}
MODE=${3:-cached}

. bench/need.sh
need strace

cargo build --release -p fabriq --example connect_spin_ab >&2
bin=${CARGO_TARGET_DIR:-target}/release/examples/connect_spin_ab

trace=$(mktemp /tmp/fabriq-connect-syscalls.XXXXXX)
trap 'rm -f "$trace"' EXIT
# One handshake spin budget (the default's 50 µs); blocks of 10 rounds.
AB_MARK=1 AB_MODES=$MODE AB_SETTLE_US=2000 AB_BLOCK=10 \
    strace -f -qq -o "$trace" "$bin" "$DEVICE" "$ROUNDS" 50 >&2

python3 - "$trace" "$ROUNDS" "$DEVICE" "$MODE" <<'EOF'
import collections, re, sys

path, rounds, device, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
entry = re.compile(r"^(\d+)\s+(\w+)\(")
resumed = re.compile(r"^(\d+)\s+<\.\.\. (\w+) resumed>")
inside = False
windows = 0
calls = collections.Counter()
blocked = collections.Counter()
threads = collections.Counter()
pending = {}  # pid -> (name, counted)
seen_in_window = set()
for line in open(path, errors="replace"):
    m = entry.match(line)
    if m:
        pid, name = m.group(1), m.group(2)
        if name == "getppid":
            if inside:
                windows += 1
                threads[len(seen_in_window)] += 1
                seen_in_window = set()
            inside = not inside
            continue
        if inside:
            calls[name] += 1
            seen_in_window.add(pid)
        if "<unfinished" in line:
            pending[pid] = (name, inside)
        elif inside and "EAGAIN" in line:
            blocked[name] += 1
        continue
    m = resumed.match(line)
    if m:
        pid = m.group(1)
        name, counted = pending.pop(pid, (m.group(2), False))
        if counted and "EAGAIN" in line:
            blocked[name] += 1
if windows == 0:
    sys.exit("no timed part found in the trace")
total = sum(n for k, n in calls.items() if k != "sched_yield")
print(f"| {device} {mode} connect: system calls per connect ({windows} connects) | calls | would block |")
print("|---|---|---|")
for name, n in sorted(calls.items(), key=lambda kv: -kv[1]):
    if name == "sched_yield":
        continue
    print(f"| {name} | {n / windows:.2f} | {blocked[name] / windows:.2f} |")
print(f"| **all but sched_yield** | **{total / windows:.2f}** | {sum(v for k, v in blocked.items()) / windows:.2f} |")
print(f"| sched_yield (spins) | {calls['sched_yield'] / windows:.2f} | |")
common = threads.most_common(1)[0][0]
print(f"(threads making calls in a connect: {common} in most connects)")
EOF
