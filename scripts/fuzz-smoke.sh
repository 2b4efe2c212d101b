#!/usr/bin/env bash
# Fuzz smoke test: runs every cargo-fuzz target in fuzz/fuzz_targets for a short while and fails on any
# finding (crash, panic, failed assertion, leak, timeout, out-of-memory).
#
# Usage: scripts/fuzz-smoke.sh [SECONDS_PER_TARGET]    (default 20)
#
# Works on the stable toolchain: RUSTC_BOOTSTRAP=1 lets it accept the -Z flags cargo-fuzz passes.
# Environment:
#   FUZZ_SANITIZER=address|none   sanitizer to build with (default address)
#   FUZZ_SEEDS=0                  do not generate the seed corpus (fuzz/examples/gen_seeds.rs) when a
#                                 target's corpus directory is missing or empty
#   CARGO_BUILD_JOBS=N            limit build parallelism (cargo's own variable)
set -euo pipefail

duration="${1:-20}"
if ! [[ "$duration" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 [SECONDS_PER_TARGET]  (a positive integer, got '$duration')" >&2
    exit 2
fi
sanitizer="${FUZZ_SANITIZER:-address}"

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

targets=()
for f in fuzz/fuzz_targets/*.rs; do
    targets+=("$(basename "$f" .rs)")
done
if [ "${#targets[@]}" -eq 0 ]; then
    echo "no fuzz targets found in fuzz/fuzz_targets" >&2
    exit 1
fi

if [ "${FUZZ_SEEDS:-1}" != 0 ]; then
    for t in "${targets[@]}"; do
        if [ -z "$(ls -A "fuzz/corpus/$t" 2>/dev/null)" ]; then
            echo "== generating the seed corpus"
            cargo run --quiet --release --manifest-path fuzz/Cargo.toml --example gen_seeds -- fuzz/corpus
            break
        fi
    done
fi

echo "== building ${#targets[@]} fuzz target(s) (sanitizer: $sanitizer)"
cargo fuzz build --fuzz-dir fuzz --sanitizer "$sanitizer"

failed=()
for t in "${targets[@]}"; do
    echo "== fuzzing $t for ${duration}s"
    mkdir -p "fuzz/corpus/$t"
    if ! cargo fuzz run --fuzz-dir fuzz --sanitizer "$sanitizer" "$t" "fuzz/corpus/$t" -- \
        -max_total_time="$duration" -timeout=10 -print_final_stats=1; then
        failed+=("$t")
    fi
done

if [ "${#failed[@]}" -ne 0 ]; then
    echo "FAILED: finding(s) in ${failed[*]}; reproducers are in fuzz/artifacts/<target>/" >&2
    exit 1
fi
echo "fuzz smoke passed: ${targets[*]} (${duration}s each)"
