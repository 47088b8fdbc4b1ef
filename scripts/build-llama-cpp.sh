#!/usr/bin/env bash
# Build one of llama.cpp's tools once, outside the workspace, from the source
# tree that ships inside the PyPI sdist of llama-cpp-python. Prints its path.
#   scripts/build-llama-cpp.sh [TOOL]   TOOL: llama-bench (default), llama-server,
#                                       llama-completion or llama-tokenize
#   MESH_BENCH_DIR  where to build (default: ~/.cache/mesh-node/llama.cpp)
#   MESH_LLAMA_AMX=0  build without AMX (in build-noamx/): where the CPU
#                     advertises AMX but llama.cpp's AMX kernels die with
#                     SIGILL (seen on a VM, 2026-12-03), as on this machine
set -euo pipefail
version="0.3.36"
tool="${1:-llama-bench}"
case "$tool" in
  llama-bench | llama-server | llama-completion | llama-tokenize) ;;
  *) echo "build-llama-cpp: TOOL is llama-bench, llama-server, llama-completion or llama-tokenize, not $tool" >&2; exit 2 ;;
esac
root="${MESH_BENCH_DIR:-$HOME/.cache/mesh-node/llama.cpp}"
build="$root/build"
flags=()
if [[ "${MESH_LLAMA_AMX:-1}" == 0 ]]; then
  build="$root/build-noamx"
  flags=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
         -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
binary="$build/bin/$tool"
if [[ -x "$binary" ]]; then
  echo "$binary"
  exit 0
fi
mkdir -p "$root"
if ! command -v cmake >/dev/null; then
  echo "build-llama-cpp: installing cmake from PyPI" >&2
  python3 -m pip install --quiet cmake >&2
fi
if [[ ! -d "$root/src" ]]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work" >&2
  tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
  mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$root/src"
fi
echo "build-llama-cpp: building $tool (a few minutes on 2 cores)" >&2
cmake -S "$root/src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON "${flags[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$build" --target "$tool" -j "$(nproc)" >&2
echo "$binary"
