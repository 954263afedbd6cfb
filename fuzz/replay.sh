#!/usr/bin/env bash
# Runs every committed fuzz input once through its target, on the stable
# toolchain: the minimized seed corpora (fuzz/seeds/<target>/, kept by
# `cargo +nightly fuzz cmin`) and the reproducers of fixed bugs
# (fuzz/regressions/, all for `ops`). A target built without cargo-fuzz has
# no coverage instrumentation, so it cannot fuzz, but libFuzzer's main still
# executes the files it is given with every check of the target (the model,
# the KV read-back, atomic errors). So CI, which has no nightly toolchain,
# still replays what fuzzing found.
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v c++ >/dev/null 2>&1; then
  echo "fuzz replay: skipped, no C++ compiler (libfuzzer-sys builds libFuzzer from source)"
  exit 0
fi
cargo build --release --quiet --bin ops --bin groups

replay() {  # target, then input directories; stops at the first batch that fails
  local target=$1
  shift
  local files=() batch log="target/replay-$target.log"
  mapfile -t files < <(find "$@" -type f | sort)
  if [ "${#files[@]}" -eq 0 ]; then
    echo "fuzz replay: no inputs for $target in $*" >&2
    exit 1
  fi
  # Batches of 500 files keep each command line short.
  for ((batch = 0; batch < ${#files[@]}; batch += 500)); do
    if ! "target/release/$target" "${files[@]:batch:500}" >"$log" 2>&1; then
      tail -40 "$log" >&2
      echo "fuzz replay: $target FAILED on an input of the batch above (log: fuzz/$log)" >&2
      exit 1
    fi
  done
  echo "fuzz replay: $target ran ${#files[@]} inputs, all passed"
}

replay ops seeds/ops regressions
replay groups seeds/groups
