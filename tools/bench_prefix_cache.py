#!/usr/bin/env python3
"""Time to first token across an 8-turn chat against a running `slotstream serve`.

Each turn adds a user message of about `--words` words to the conversation,
streams the reply over /v1/chat/completions and records the time to the first
content chunk, the prompt length and the prompt tokens the prefix cache reused.
Run it once against a server with the prefix cache and once against one started
with --no-prefix-cache; with the cache, later turns should cost only their new
tokens. Standard library only; prints a Markdown table.

    python3 tools/bench_prefix_cache.py --url http://127.0.0.1:11434 --model qwen3_moe_mlx4
"""

import argparse
import json
import time
import urllib.request

WORDS = ["river", "stone", "lantern", "orbit", "cedar", "harbor", "signal", "meadow", "copper", "drift"]


def turn(url, model, messages, max_tokens):
    body = json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    first, text, usage = None, "", None
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece
    return first if first is not None else time.perf_counter() - start, text, usage


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:11434")
    p.add_argument("--model", default="qwen3_moe_mlx4")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--words", type=int, default=150, help="words per user message")
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    messages = [{"role": "system", "content": "You are a patient assistant."}]
    print("| turn | prompt tokens | reused | new | TTFT (s) |")
    print("|---:|---:|---:|---:|---:|")
    for t in range(1, a.turns + 1):
        words = " ".join(WORDS[(t * 7 + i * 3) % len(WORDS)] for i in range(a.words))
        messages.append({"role": "user", "content": f"Turn {t}: {words}"})
        ttft, reply, usage = turn(a.url, a.model, messages, a.max_tokens)
        messages.append({"role": "assistant", "content": reply})
        prompt = usage["prompt_tokens"]
        reused = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        print(f"| {t} | {prompt} | {reused} | {prompt - reused} | {ttft:.3f} |")


if __name__ == "__main__":
    main()
