#!/usr/bin/env bash
# Run a fuzz target with libFuzzer on the stable toolchain (cargo-fuzz needs
# nightly). Usage: fuzz/run-stable.sh verify_document|stage_block|stage_frame|control|mesh1|advert|reach|tape [SECONDS]
set -euo pipefail
cd "$(dirname "$0")"
target="${1:-verify_document}"
seconds="${2:-60}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing" \
  cargo build --release --target "$triple" --target-dir target/fuzzbuild --bin "$target"
mkdir -p "corpus/$target"
# Seed with the project's own vectors.
cp ../vectors/split-stage/bundles/*.json "corpus/$target/" 2>/dev/null || true
exec "target/fuzzbuild/$triple/release/$target" "corpus/$target" \
  -max_total_time="$seconds" -max_len=262144
