#!/usr/bin/env bash
# Decode and prefill tokens/s of llama.cpp and of mesh-node's engine on the
# same GGUF, at one and two threads, side by side in one run: ROUNDS
# interleaved rounds (default 3; llama-bench repeats each test REPS times
# within a round, default 5), medians reported, since a shared machine's
# speed drifts.
#   usage: scripts/bench-vs-llama-cpp.sh [MODEL.gguf]   (default: SmolLM2-135M Q4_1)
#   PROMPT_TOKENS=N  prefill an N-token prompt, and decode DECODE_TOKENS
#                    (default 64) at depth N (llama-bench's -d N) (default 64)
#   THREADS="1 2"    the thread counts to run
# llama.cpp runs with flash attention on and off; each figure is its faster.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-$(scripts/fetch-smollm2.sh)}"
rounds="${ROUNDS:-3}"
prompt="${PROMPT_TOKENS:-64}"
decode="${DECODE_TOKENS:-64}"
reps="${REPS:-5}"
bench="$(scripts/build-llama-cpp.sh)"
cargo build --release --locked -q -p mesh-node
echo "model: $model  rounds: $rounds  prompt: $prompt tokens  decode: $decode at depth $prompt"
results="$(mktemp)"
trap 'rm -f "$results"' EXIT
for round in $(seq "$rounds"); do
  for threads in ${THREADS:-1 2}; do
    # Prefill from an empty cache, and decode after `prompt` positions, each
    # with flash attention on and off.
    if ! llama_json="$(for fa in on off; do
        "$bench" -m "$model" -p "$prompt" -n 0 -r "$reps" -fa "$fa" -t "$threads" -o jsonl
        "$bench" -m "$model" -p 0 -n "$decode" -d "$prompt" -r "$reps" -fa "$fa" -t "$threads" -o jsonl
      done | python3 -c 'import json,sys; print(json.dumps([json.loads(l) for l in sys.stdin if l.strip()]))')"; then
      echo "llama-bench failed on this CPU; if it died of SIGILL in its AMX kernels, build it without: MESH_LLAMA_AMX=0 $0" >&2
      exit 1
    fi
    mesh_json="$(RAYON_NUM_THREADS="$threads" ./target/release/mesh-node bench engine --model "$model" --prompt-tokens "$prompt" --decode-tokens "$decode" --json)"
    python3 - "$threads" "$llama_json" "$mesh_json" >>"$results" <<'PY'
import json, sys
llama = json.loads(sys.argv[2])
mesh = json.loads(sys.argv[3])
def llama_rate(kind):
    # The faster of flash attention on and off.
    rates = [r["avg_ts"] for r in llama
             if (kind == "prefill" and r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0)
             or (kind == "decode" and r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0)]
    return max(rates) if rates else float("nan")
unsplit = next(r for r in mesh["runs"] if r["slices"] == 1 and r["execution"].startswith("stored"))
print(json.dumps({"threads": int(sys.argv[1]),
    "llama_prefill": llama_rate("prefill"), "llama_decode": llama_rate("decode"),
    "mesh_prefill": unsplit["prefill_tokens_per_s"], "mesh_decode": unsplit["decode_tokens_per_s"]}))
PY
  done
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for threads in sorted({r["threads"] for r in rows}):
    mine = [r for r in rows if r["threads"] == threads]
    med = lambda key: statistics.median(r[key] for r in mine)
    ratio = lambda kind: statistics.median(r[f"mesh_{kind}"] / r[f"llama_{kind}"] for r in mine)
    label = f"{threads} thread" + ("s" if threads > 1 else "") + f", median of {len(mine)}"
    print(f"{label:<28} {'prefill tok/s':>14} {'decode tok/s':>14}")
    print(f"{'llama.cpp (llama-bench)':<28} {med('llama_prefill'):>14.1f} {med('llama_decode'):>14.1f}")
    print(f"{'mesh-node engine':<28} {med('mesh_prefill'):>14.1f} {med('mesh_decode'):>14.1f}")
    print(f"{'ratio mesh-node/llama.cpp':<28} {ratio('prefill'):>14.3f} {ratio('decode'):>14.3f}")
    print("per round (prefill, decode ratios): " + ", ".join(
        f"{r['mesh_prefill']/r['llama_prefill']:.2f}/{r['mesh_decode']/r['llama_decode']:.2f}" for r in mine))
PY
