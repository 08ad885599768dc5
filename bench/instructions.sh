#!/usr/bin/env bash
# bench/instructions.sh — instructions per 8-byte exchange on shm0, counted by valgrind's
# callgrind: the channel's one-thread exchange (A sends 8 bytes, B receives and echoes them,
# A receives: four channel operations, two messages) and the same exchange at the verbs level
# (two SENDs into pre-posted receives); then an 8-byte one-sided READ through
# `RemoteRegion::read` and at the verbs level. An instruction count is the same run after run, whatever
# else the host does, so it tells the software cost of a change on a noisy machine where a
# timed A/B cannot (bench/ab.sh times the cross-core ping-pong beside it).
#
# Usage: bench/instructions.sh [ITERS] [--keep DIR]
#   ITERS   exchanges counted (default 20000); the count of a run with none is subtracted
#   --keep  keep the callgrind profiles in DIR (callgrind_annotate DIR/channel.out ...)
#
# The counting build (target/instructions) is the release profile with one codegen unit per
# crate — with several, where the compiler splits a crate (and so what it inlines) moves with
# unrelated edits, a few percent either way, which would drown the change being measured —,
# maps shm segments of 4 GiB instead of 64 GiB (FABRIQ_SHM_SEGMENT_BITS=32: valgrind maps
# only a few tens of GiB) and reads the clock through libc (rustix's own vDSO lookup does not
# run under valgrind). valgrind is installed from Debian's packages when missing (root).
set -euo pipefail
cd "$(dirname "$0")/.."

ITERS=20000
KEEP=""
while [ $# -gt 0 ]; do
    case "$1" in
        --keep) KEEP=$2; shift 2 ;;
        *) ITERS=$1; shift ;;
    esac
done

. bench/need.sh
need valgrind

# FABRIQ_CLOCK=monotonic: the worker reads CLOCK_MONOTONIC instead of calibrating the CPU
# counter at start (a calibration runs until it converges: its length would differ between the
# counted run and the run it is subtracted from).
export FABRIQ_SHM_SEGMENT_BITS=32 CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1 FABRIQ_CLOCK=monotonic
RUSTFLAGS="--cfg rustix_use_libc" CARGO_TARGET_DIR=target/instructions \
    cargo build --release -p fabriq --example exchange_count >&2
bin=target/instructions/release/examples/exchange_count

out=$(mktemp -d /tmp/fabriq-instructions.XXXXXX)
trap 'rm -rf "$out"' EXIT

count() { # name iters [mode] -> total instructions of the run
    valgrind --tool=callgrind --callgrind-out-file="$out/$1.out" "$bin" "$2" shm0 ${3:-} 2>&1 |
        awk '/Collected :/ { print $4 }'
}

per_exchange() { # name [mode]
    local base total
    base=$(count "$1-base" 0 "${2:-}")
    total=$(count "$1" "$ITERS" "${2:-}")
    echo $(((total - base) / ITERS))
}

channel=$(per_exchange channel)
verbs=$(per_exchange verbs verbs)
echo "| exchange (8 B there and back, one thread, shm0) | instructions |"
echo "|---|---|"
echo "| channel (caller progress) | $channel |"
echo "| verbs (SEND into pre-posted receives) | $verbs |"
echo "| channel − verbs, per message | $(((channel - verbs) / 2)) |"
read=$(per_exchange read read)
verbs_read=$(per_exchange verbs-read verbs-read)
echo
echo "| one-sided READ (8 B, one thread, shm0) | instructions |"
echo "|---|---|"
echo "| RemoteRegion::read (caller progress) | $read |"
echo "| verbs READ | $verbs_read |"
echo "(fabriq $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $ITERS exchanges, valgrind $(valgrind --version | sed 's/valgrind-//'))"
if [ -n "$KEEP" ]; then
    mkdir -p "$KEEP"
    cp "$out"/*.out "$KEEP"/
fi
