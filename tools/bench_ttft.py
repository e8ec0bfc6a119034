#!/usr/bin/env python3
"""Time to first token of a short request while long prompts prefill, against
a running `slotstream serve`: the short request alone, then the same request
sent while `--long` long raw prompts (`--long-words` words each) are being
fed. Each request is a greedy /api/generate; the short one asks for one
token, so its time to first token is its whole request's time (the first
streamed line would wait for text, which a synthetic vocabulary often holds
back). Prints one row per round and the median ratio (the issue's bar: at
most 2x). Standard library
only; run by tools/bench_batch.sh with BENCH_TTFT=1.

    python3 tools/bench_ttft.py --url http://127.0.0.1:11434 --model synth
"""

import argparse
import json
import threading
import time
import urllib.request

from bench_batch import WORDS, prompt


def generate(url, model, text, tokens):
    """A greedy generate of `tokens` tokens; returns its seconds."""
    body = json.dumps({
        "model": model, "prompt": text, "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": tokens},
    }).encode()
    req = urllib.request.Request(url + "/api/generate", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        reply = json.loads(r.read())
    if reply.get("eval_count") != tokens:
        raise SystemExit(f"asked for {tokens} tokens, got {reply.get('eval_count')}")
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:11434")
    p.add_argument("--model", required=True)
    p.add_argument("--long", type=int, default=3, help="long prompts prefilling at once")
    p.add_argument("--long-words", type=int, default=400, help="words per long prompt")
    p.add_argument("--short-words", type=int, default=8, help="words in the short prompt")
    p.add_argument("--tokens", type=int, default=8, help="tokens each long request generates")
    p.add_argument("--delay", type=float, default=0.3, help="seconds after the long prompts start")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    short = prompt(7, a.short_words)
    generate(a.url, a.model, short, 1)  # warm-up
    print(f"| round | short alone (s) | short with {a.long} long prefilling (s) | ratio | long prompts done (s) |")
    print("|---:|---:|---:|---:|---:|")
    ratios = []
    for r in range(1, a.rounds + 1):
        alone = generate(a.url, a.model, short, 1)
        # Each round's long prompts differ (no prefix shared with the last round's).
        longs = [" ".join([WORDS[(r + i) % len(WORDS)]] + [prompt(r * 5 + i, a.long_words)]) for i in range(a.long)]
        done = [None] * a.long

        def run(i):
            done[i] = generate(a.url, a.model, longs[i], a.tokens)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(a.long)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(a.delay)
        busy = generate(a.url, a.model, short, 1)
        for t in threads:
            t.join()
        longest = time.perf_counter() - start
        ratio = busy / alone
        ratios.append(ratio)
        print(f"| {r} | {alone:.3f} | {busy:.3f} | {ratio:.2f}x | {longest:.2f} |")
    ratios.sort()
    print(f"\nmedian ratio {ratios[len(ratios) // 2]:.2f}x over {a.rounds} rounds")


if __name__ == "__main__":
    main()
