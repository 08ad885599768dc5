#!/usr/bin/env bash
# The project's test run: what README.md tells a newcomer to run, and what .ci/run calls.
# Installs nothing by hand: every lane that needs a package or a capability sets it up itself
# and says loudly when it has to skip.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
export RUST_BACKTRACE=${RUST_BACKTRACE:-1}

echo "== cargo test --workspace (unit, conformance on every provider, middleware, mpath, sim)"
cargo test --workspace --release
