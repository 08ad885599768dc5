#!/usr/bin/env bash
# The project's test run: what README.md tells a newcomer to run, and what .ci/run calls.
# Nothing is installed by hand: every lane that needs a package or a capability sets it up
# itself, and says loudly when it has to skip.
#
#   1. cargo test --workspace --release: unit tests, the verbs conformance suite on every
#      provider (separate processes), the middleware, fabriq-mpath, fabriq-sim, the CLI, and the
#      udp provider on a network-namespace ECMP fabric (root; prints SKIP without it).
#   2. The soft-RoCE lane (root): the rdma-core provider and the middleware on the kernel's rxe
#      in a QEMU guest (tests/rxe/lane.sh). FABRIQ_SKIP_RXE=1 leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}

# The network-namespace tests (udp fabric, auto with a peer on another host) need iproute2.
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null 2>&1; then
  echo "== installing iproute2 (network-namespace tests)"
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null 2>&1 \
    || echo "== could not install iproute2: the network-namespace tests will print SKIP"
fi

echo "== cargo test --workspace --release"
cargo test --workspace --release

if [ "${FABRIQ_SKIP_RXE:-0}" = 1 ]; then
  echo "== SKIP soft-RoCE lane: FABRIQ_SKIP_RXE=1"
elif [ "$(id -u)" != 0 ]; then
  echo "== SKIP soft-RoCE lane: needs root (debootstrap, QEMU, 9p); run: sudo tests/rxe/lane.sh"
else
  echo "== soft-RoCE lane (tests/rxe/lane.sh)"
  tests/rxe/lane.sh
fi
