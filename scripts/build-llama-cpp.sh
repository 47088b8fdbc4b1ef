#!/usr/bin/env bash
# Build llama.cpp's llama-bench once, outside the workspace, from the source
# tree that ships inside the PyPI sdist of llama-cpp-python. Prints the path
# of llama-bench.
#   MESH_BENCH_DIR  where to build (default: ~/.cache/mesh-node/llama.cpp)
set -euo pipefail
version="0.3.36"
root="${MESH_BENCH_DIR:-$HOME/.cache/mesh-node/llama.cpp}"
bench="$root/build/bin/llama-bench"
if [[ -x "$bench" ]]; then
  echo "$bench"
  exit 0
fi
mkdir -p "$root"
if ! command -v cmake >/dev/null; then
  echo "build-llama-cpp: installing cmake from PyPI" >&2
  python3 -m pip install --quiet cmake >&2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
rm -rf "$root/src"
mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$root/src"
echo "build-llama-cpp: building llama-bench (a few minutes on 2 cores)" >&2
cmake -S "$root/src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$root/build" --target llama-bench -j "$(nproc)" >&2
echo "$bench"
