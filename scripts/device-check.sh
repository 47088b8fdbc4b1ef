#!/usr/bin/env bash
# The engine on an NVIDIA GPU (issues 12 and 42): build mesh-node with the
# `cuda` feature, then run `bench engine --json` and `bench split --json`
# on `--device cuda`, beside the same benches on the host's CPU, and
# issue 42's scenarios: ten verified 3-stage splits on the GPU, and a
# mixed mesh (the coordinator on the GPU, two CPU members) whose receipts
# name each stage's device (`scenario`, below; dry-run on a CPU with
# `scripts/device-check.sh scenario splits|mixed BIN MODEL cpu`).
#
#   scripts/device-check.sh            build, then run (a machine with cargo
#                                      and a GPU)
#   scripts/device-check.sh build      build here and pack .device/ for a GPU
#                                      machine without cargo (the device tool)
#   scripts/device-check.sh run [OUT]  run the stashed binary (see below); the
#                                      reports go to OUT (default $OUT, else
#                                      ./device-report): reports.json and
#                                      logs.txt
#
# Building needs no GPU and no CUDA install: without `nvcc` on PATH, CUDA
# 13.0's compiler is fetched from PyPI (the driver on the device machines
# is CUDA 13.0's, and PTX from a newer nvcc would not load there), and
# candle's kernels are compiled to PTX for compute capability
# $CUDA_COMPUTE_CAP (default 90: Hopper). Linking needs the CUDA libraries'
# names only: without them, stub libraries with the real sonames are made
# from cudarc's bindings; the real ones are found at run time.
#
# The device tool carries at most 64 MiB a call. `build` packs the stripped
# binary and the model in parts of at most 48 MiB, each in its own folder
# .device/N; carry one per call, in order, each call running
#   bash scripts/device-check.sh stash N
# then, in the call that carries the last part, `... stash N && bash
# scripts/device-check.sh run`. `build` prints the calls. A warm machine
# keeps what the earlier calls stashed (in $MESH_DEVICE_STASH, default
# ~/mesh-device); a machine that went back must be given every part again.
#
#   MESH_MODEL          model to bench (default: SmolLM2-135M Q4_1, fetched)
#   MESH_DEVICE_STEPS   which benches `run` runs, by name, comma-separated
#                       (default: all; see run_benches)
#   CUDA_COMPUTE_CAP    default 90
#   MESH_CUDA_CACHE     where the fetched toolkit goes
#                       (default ~/.cache/mesh-node/cuda-13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
cap="${CUDA_COMPUTE_CAP:-90}"
stash="${MESH_DEVICE_STASH:-$HOME/mesh-device}"
part_bytes=$((48 * 1024 * 1024))

toolkit() {
  if command -v nvcc > /dev/null && nvcc --version | grep -q 'release 13\.0,'; then
    CUDA_ROOT="${CUDA_ROOT:-$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)}"
    export CUDA_ROOT
    return
  fi
  local root="${MESH_CUDA_CACHE:-$HOME/.cache/mesh-node/cuda-13.0}"
  if [[ ! -x "$root/nvidia/cu13/bin/nvcc" ]]; then
    echo "device-check: fetching CUDA 13.0's nvcc from PyPI into $root" >&2
    local wheels
    wheels="$(mktemp -d)"
    python3 -m pip download --quiet --no-deps -d "$wheels" \
      nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >&2
    mkdir -p "$root"
    for wheel in "$wheels"/*.whl; do
      python3 -m zipfile -e "$wheel" "$root"
    done
    rm -rf "$wheels"
    chmod +x "$root"/nvidia/cu13/bin/* "$root"/nvidia/cu13/nvvm/bin/*
  fi
  export PATH="$root/nvidia/cu13/bin:$PATH"
  export CUDA_ROOT="$root/nvidia/cu13"
}

# Stub libcuda, libcublas, libcublasLt, libcurand and libnvrtc, exporting
# every function cudarc binds, under the sonames of CUDA 13's libraries:
# enough to link; the binary loads the real ones on the GPU machine. The
# kernels' own library links libcudart, which the fetched toolkit holds.
link_stubs() {
  local stubs="${CUDA_ROOT:?}/lib/stubs"
  mkdir -p "$stubs"
  if [[ -f "$CUDA_ROOT/lib/libcudart.so.13" && ! -e "$CUDA_ROOT/lib/libcudart.so" ]]; then
    ln -s libcudart.so.13 "$CUDA_ROOT/lib/libcudart.so"
  fi
  if ldconfig -p 2> /dev/null | grep 'libcublas\.so ' > /dev/null; then
    return
  fi
  local cudarc
  cudarc="$(cargo metadata --locked --all-features --format-version 1 --manifest-path Cargo.toml |
    python3 -c 'import json,sys,os; m=json.load(sys.stdin); print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"]=="cudarc"))')"
  local spec name soname sys
  for spec in cuda:libcuda.so.1:driver cublas:libcublas.so.13:cublas \
    cublasLt:libcublasLt.so.13:cublaslt curand:libcurand.so.10:curand \
    nvrtc:libnvrtc.so.13:nvrtc; do
    IFS=: read -r name soname sys <<< "$spec"
    grep -oE 'pub unsafe fn [A-Za-z0-9_]+' "$cudarc/src/$sys/sys/mod.rs" |
      awk '{print "void " $4 "(void) {}"}' | sort -u > "$stubs/$name.c"
    cc -shared -fPIC -Wl,-soname,"$soname" -o "$stubs/lib$name.so" "$stubs/$name.c"
  done
}

build() {
  if ! command -v cargo > /dev/null; then
    echo "device-check: no cargo here: build on a machine with Rust (\`$0 build\`), then \`stash\` and \`run\` here" >&2
    exit 2
  fi
  toolkit
  link_stubs
  echo "device-check: building mesh-node --features cuda (PTX for sm_$cap)" >&2
  CUDA_COMPUTE_CAP="$cap" CARGO_PROFILE_RELEASE_DEBUG=0 \
    cargo build --release --locked -p mesh-node --features cuda --target-dir target-cuda >&2
}

model_path() {
  if [[ -n "${MESH_MODEL:-}" ]]; then
    echo "$MESH_MODEL"
  else
    scripts/fetch-smollm2.sh
  fi
}

pack() {
  local model
  model="$(model_path)"
  rm -rf .device
  mkdir -p .device/pack
  cp target-cuda/release/mesh-node .device/pack/mesh-node
  strip .device/pack/mesh-node
  cp "$model" .device/pack/model.gguf
  (cd .device/pack && sha256sum mesh-node model.gguf > SHA256SUMS &&
    tar czf - mesh-node model.gguf SHA256SUMS | split -b "$part_bytes" -d -a 2 - part.)
  local n=0
  for part in .device/pack/part.*; do
    n=$((n + 1))
    mkdir -p ".device/$n"
    mv "$part" ".device/$n/"
  done
  rm -rf .device/pack
  echo "device-check: packed $n parts; on the device tool make these calls in turn:" >&2
  for i in $(seq 1 "$n"); do
    local last=""
    [[ $i == "$n" ]] && last=" && bash scripts/device-check.sh run"
    echo "  run(carry=[\".device/$i\"], command=\"bash scripts/device-check.sh stash $i$last\")" >&2
  done
}

stash_part() {
  local n="$1"
  if [[ $n == 1 ]]; then
    rm -rf "$stash"
  fi
  mkdir -p "$stash"
  cp ".device/$n"/part.* "$stash/"
  ls -la "$stash" >&2
}

# The CUDA libraries the binary links, where a GPU machine's image keeps
# them: the loader's cache first (the driver's libcuda, never CUDA's compat
# copy), then CUDA's folders and Python packages'.
library_path() {
  local dirs="" lib found
  for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 \
    libcurand.so.10 libnvrtc.so.13; do
    found="$( (ldconfig -p 2> /dev/null || true) | awk -v l="$lib" '$1 == l {print $NF}' |
      grep -v compat | head -1 || true)"
    if [[ -z "$found" ]]; then
      found="$(find /usr/local/nvidia /usr/lib /usr/local/cuda* /opt /usr/local/lib \
        -name "$lib" 2> /dev/null | grep -v compat | head -1 || true)"
    fi
    if [[ -n "$found" ]]; then
      dirs="$dirs:$(dirname "$found")"
    else
      echo "device-check: $lib not found" >&2
    fi
  done
  echo "${dirs#:}"
}

# Issue 42's scenarios, each printing one JSON object on stdout (run as a
# step below, or alone for a dry run on a CPU: `scenario NAME BIN MODEL
# DEVICE`). `splits`: ten 3-stage requests with every node on DEVICE, each
# bundle verified (`demo` exits 0 only when its verdict is OK). `mixed`: a
# coordinator on DEVICE and two CPU nodes joined through it, the plan
# pinned to 3 stages (the planner gives each the layers its measured speed
# earns); the request's bundle verified, and each stage's layers and the
# device its receipt names reported.
scenario() {
  local name="$1" bin="$2" model="$3" device="$4" work
  work="$(mktemp -d)"
  case "$name" in
    splits)
      local i ok=0 verdicts=()
      for i in $(seq 1 10); do
        if "$bin" demo --device "$device" --stages 3 --quiet --max-tokens 16 \
          --model "$model" --out "$work/demo$i" > "$work/demo$i.txt" 2>&1; then
          ok=$((ok + 1))
          verdicts+=("\"ok\"")
        else
          verdicts+=("\"failed: $(tail -1 "$work/demo$i.txt" | tr -d '"\\')\"")
        fi
      done
      local joined
      joined="$(IFS=,; echo "${verdicts[*]}")"
      echo "{\"runs\": 10, \"verified\": $ok, \"device\": \"$device\", \"verdicts\": [$joined]}"
      [[ $ok == 10 ]]
      ;;
    mixed)
      local pids=() status=0
      "$bin" keygen --out "$work/coord.key" > /dev/null 2>&1
      "$bin" serve --key "$work/coord.key" --model "$model" --device "$device" \
        --listen 127.0.0.1:0 --no-mdns --stages 3 --data "$work/coord" \
        > "$work/coord.out" 2> "$work/coord.log" &
      pids+=($!)
      local tries=0 bootstrap="" peer=""
      while [[ -z $peer && $tries -lt 600 ]]; do
        sleep 0.1
        tries=$((tries + 1))
        bootstrap="$(sed -n 's/^mesh address: //p' "$work/coord.out" | head -1)"
        peer="$(sed -n 's/^peer address: //p' "$work/coord.out" | head -1)"
      done
      local node
      for node in b c; do
        "$bin" join --model "$model" --device cpu --no-mdns --listen 127.0.0.1:0 \
          --bootstrap "$bootstrap" --data "$work/$node" > /dev/null 2> "$work/$node.log" &
        pids+=($!)
      done
      sleep 20
      if ! "$bin" generate --coordinator "$peer" --prompt "The capital of France is" \
        --max-tokens 16 --json --out "$work/bundle.json" > "$work/generated.json" 2> "$work/generate.log"; then
        status=1
      fi
      "$bin" verify --json "$work/bundle.json" > "$work/verified.json" 2>&1 || status=1
      python3 - "$work" "$status" <<'PY'
import json, sys, binascii
work, status = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        return json.load(open(f"{work}/{name}"))
    except Exception as error:
        return {"unreadable": str(error)}
generated, verified, bundle = load("generated.json"), load("verified.json"), load("bundle.json")
stages = generated.get("details", {}).get("stages", [])
print(json.dumps({
    "ok": status == 0 and verified.get("ok") is True,
    "stages": [{"stage": s.get("stage_index"), "layers": s.get("layers"), "node": s.get("node_id")} for s in stages],
    "coordinator_precision": generated.get("details", {}).get("receipt", {}).get("precision"),
    "stage_receipt_precision": {str(r.get("stage_index")): r.get("precision") for r in verified.get("stage_receipts", [])},
    "energy_parts": generated.get("details", {}).get("energy", {}).get("parts"),
    "verify_ok": verified.get("ok"),
    "text": generated.get("text"),
}))
PY
      kill "${pids[@]}" 2> /dev/null || true
      wait 2> /dev/null || true
      return "$status"
      ;;
    *)
      echo "device-check: no scenario $name" >&2
      return 2
      ;;
  esac
}

# The benches on the GPU, then on the host's CPU; exits 1 when any of them
# failed. The CPU runs use the device machine's spare cores: the engine at
# 1 to 16 threads (does it scale to the cores given?), hop overhead
# (`bench split`, also with one I/O thread) and the WAN delay proxies
# (`bench wan`), measured where no other work shares the cores. The
# reports go into one reports.json (name: report) and logs.txt (the
# machine, then each bench's stderr): the device tool brings back at most
# 8 files. MESH_DEVICE_STEPS (names, comma-separated) runs some of them;
# six of them took 2 to 4 minutes of the tool's 10 a call on an H200 machine.
run_benches() {
  local built="$1" out="${2:-${OUT:-device-report}}" bin model failed=0
  mkdir -p "$out"
  if [[ $built == built ]]; then
    bin=target-cuda/release/mesh-node
    model="$(model_path)"
  else
    mkdir -p "$stash/unpacked"
    cat "$stash"/part.* | tar xzf - -C "$stash/unpacked"
    (cd "$stash/unpacked" && sha256sum -c SHA256SUMS) >&2
    bin="$stash/unpacked/mesh-node"
    model="$stash/unpacked/model.gguf"
  fi
  LD_LIBRARY_PATH="$(library_path)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LD_LIBRARY_PATH
  if ldd "$bin" | grep 'not found' >&2; then
    echo "device-check: $bin cannot load the libraries above" >&2
    exit 1
  fi
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    ldd "$bin" | grep -E 'cuda|cublas|curand|nvrtc' || true
    nproc
    grep -m1 'model name' /proc/cpuinfo || true
  } 2>&1 | tee "$out/logs.txt" >&2
  local cpu_engine="bench engine --device cpu --decode-tokens 32"
  # name | seconds allowed | environment | arguments
  local steps=(
    "engine-cuda|90||bench engine --device cuda"
    "splits-cuda|300||@splits cuda"
    "mixed-cuda|180||@mixed cuda"
    "split-cuda|120||bench split --device cuda --tokens 128 --rounds 2"
    "engine-cpu-t1|60|CANDLE_NUM_THREADS=1 RAYON_NUM_THREADS=1|$cpu_engine"
    "engine-cpu-t2|60|CANDLE_NUM_THREADS=2 RAYON_NUM_THREADS=2|$cpu_engine"
    "engine-cpu-t4|60|CANDLE_NUM_THREADS=4 RAYON_NUM_THREADS=4|$cpu_engine"
    "engine-cpu-t8|60|CANDLE_NUM_THREADS=8 RAYON_NUM_THREADS=8|$cpu_engine"
    "engine-cpu|60||$cpu_engine"
    "engine-cpu-rayon1|60|RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=$(nproc)|$cpu_engine"
    "split-cpu|90||bench split --device cpu --tokens 128 --rounds 2"
    "split-cpu-io1|90||--io-threads 1 bench split --device cpu --tokens 128 --rounds 2"
    "wan-cpu|150||bench wan --rtt-ms 40 --stages 2,3 --rounds 3"
  )
  local step name seconds environment args reports=()
  for step in "${steps[@]}"; do
    IFS='|' read -r name seconds environment args <<< "$step"
    if [[ -n ${MESH_DEVICE_STEPS:-} && ",$MESH_DEVICE_STEPS," != *",$name,"* ]]; then
      continue
    fi
    echo "device-check: $name: $environment mesh-node $args" >&2
    echo "== $name: $environment mesh-node $args" >> "$out/logs.txt"
    local ran
    if [[ $args == @* ]]; then
      # A scenario: `@NAME DEVICE`.
      read -r scenario_name scenario_device <<< "${args#@}"
      export -f scenario
      ran=0
      timeout "$seconds" bash -c 'scenario "$@"' _ "$scenario_name" "$bin" "$model" \
        "$scenario_device" > "$out/$name.json" 2> "$out/$name.log" || ran=$?
    else
      ran=0
      # shellcheck disable=SC2086 # the environment and arguments are words
      timeout "$seconds" env $environment "$bin" $args --model "$model" --json \
        > "$out/$name.json" 2> "$out/$name.log" || ran=$?
    fi
    if [[ $ran == 0 ]]; then
      reports+=("$(printf '"%s": ' "$name"; cat "$out/$name.json")")
    else
      echo "device-check: $name failed: see $out/logs.txt" >&2
      failed=1
    fi
    tail -3 "$out/$name.log" >&2
    cat "$out/$name.log" >> "$out/logs.txt"
    rm -f "$out/$name.log" "$out/$name.json"
    # Rewritten after every step: a call cut off at its limit still
    # brings back the reports of the steps that finished.
    {
      echo "{"
      local i
      for i in "${!reports[@]}"; do
        ((i > 0)) && echo ","
        echo "${reports[$i]}"
      done
      echo "}"
    } > "$out/reports.json.tmp"
    mv "$out/reports.json.tmp" "$out/reports.json"
  done
  ls -la "$out" >&2
  return "$failed"
}

case "$mode" in
  # Each function is a command of its own: `set -e` does not reach into
  # one called from an && list.
  all)
    build
    run_benches built "${2:-}"
    ;;
  build)
    build
    pack
    ;;
  stash) stash_part "${2:?which part}" ;;
  # A dry run of one scenario with any binary and device (a CPU here).
  scenario) scenario "${2:?splits or mixed}" "${3:?binary}" "${4:?model}" "${5:-cpu}" ;;
  run) run_benches stashed "${2:-}" ;;
  *)
    echo "usage: $0 [build | stash N | run [OUT] | scenario NAME BIN MODEL [DEVICE]]" >&2
    exit 2
    ;;
esac
