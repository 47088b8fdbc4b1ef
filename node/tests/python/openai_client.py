"""Drives a mesh-node coordinator's HTTP API with the official `openai`
Python client, as any application would, and prints what it saw as one
JSON object for node/tests/openai_api.rs to check.

    python openai_client.py BASE_URL PROMPT MAX_TOKENS BUNDLE_PATH
"""
import json
import sys
import urllib.request

from openai import OpenAI

base_url, prompt, max_tokens, bundle_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
client = OpenAI(base_url=base_url, api_key="not-needed")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": prompt}]

whole = client.chat.completions.create(
    model=model, messages=messages, temperature=0, max_tokens=max_tokens, seed=1
)

pieces, finish_reason, stream_usage, chunk_ids = [], None, None, set()
for chunk in client.chat.completions.create(
    model=model, messages=messages, temperature=0, max_tokens=max_tokens, seed=1, stream=True
):
    chunk_ids.add(chunk.id)
    if chunk.choices:
        if chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices[0].finish_reason:
            finish_reason = chunk.choices[0].finish_reason
    if chunk.usage is not None:
        stream_usage = chunk.usage.model_dump()

completion = client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=8, temperature=0, stop=["\n"]
)

# An application's default model name: answered by the served model, and
# said so in a header.
raw = client.chat.completions.with_raw_response.create(
    model="gpt-4o", messages=messages, temperature=0, max_tokens=4
)
unknown_model = {
    "status": raw.status_code,
    "fallback": raw.headers.get("x-mesh-model-fallback"),
    "model": raw.parse().model,
}

usage = whole.usage.model_dump()
base = base_url.rsplit("/v1", 1)[0]
with urllib.request.urlopen(base + usage["energy"]["bundle"]) as reply, open(bundle_path, "wb") as out:
    out.write(reply.read())

print(json.dumps({
    "model": model,
    "text": whole.choices[0].message.content,
    "finish_reason": whole.choices[0].finish_reason,
    "usage": usage,
    "streamed": "".join(pieces),
    "stream_finish_reason": finish_reason,
    "stream_usage": stream_usage,
    "stream_ids": len(chunk_ids),
    "completion_text": completion.choices[0].text,
    "completion_finish_reason": completion.choices[0].finish_reason,
    "unknown_model": unknown_model,
}))
