#!/usr/bin/env bash
# Decode and prefill tokens/s of llama.cpp and of mesh-node's engine on the
# same GGUF, one thread each, side by side in one run.
#   usage: scripts/bench-vs-llama-cpp.sh [MODEL.gguf]   (default: SmolLM2-135M Q4_1)
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-$(scripts/fetch-smollm2.sh)}"
bench="$(scripts/build-llama-cpp.sh)"
cargo build --release --locked -q -p mesh-node
echo "model: $model"
llama_json="$("$bench" -m "$model" -p 64 -n 64 -t 1 -o json)"
mesh_json="$(RAYON_NUM_THREADS=1 ./target/release/mesh-node bench engine --model "$model" --prompt-tokens 64 --decode-tokens 64 --json)"
python3 - "$llama_json" "$mesh_json" <<'PY'
import json, sys
llama = json.loads(sys.argv[1])
mesh = json.loads(sys.argv[2])
def llama_rate(kind):
    for r in llama:
        if kind == "prefill" and r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            return r["avg_ts"]
        if kind == "decode" and r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            return r["avg_ts"]
    return float("nan")
unsplit = next(r for r in mesh["runs"] if r["slices"] == 1 and r["execution"].startswith("stored"))
print(f"{'one thread':<28} {'prefill tok/s':>14} {'decode tok/s':>14}")
print(f"{'llama.cpp (llama-bench)':<28} {llama_rate('prefill'):>14.1f} {llama_rate('decode'):>14.1f}")
print(f"{'mesh-node engine':<28} {unsplit['prefill_tokens_per_s']:>14.1f} {unsplit['decode_tokens_per_s']:>14.1f}")
print(f"{'ratio mesh-node/llama.cpp':<28} {unsplit['prefill_tokens_per_s']/llama_rate('prefill'):>14.3f} {unsplit['decode_tokens_per_s']/llama_rate('decode'):>14.3f}")
PY
