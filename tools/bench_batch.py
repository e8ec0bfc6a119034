#!/usr/bin/env python3
"""Aggregate decode throughput of concurrent greedy streams against a running
`slotstream serve`: the same N prompts run one after another, then all N at
once, each a greedy /api/generate (raw prompt, `--tokens` generated). Prints
the wall time and aggregate generated tokens per second of both, their
ratio, and whether every stream's text at once equals its text alone
(batching must change speed, never output). Standard library only; run by
tools/bench_batch.sh.

    python3 tools/bench_batch.py --url http://127.0.0.1:11434 --model synth --streams 4
"""

import argparse
import json
import sys
import threading
import time
import urllib.request

WORDS = ["river", "stone", "lantern", "orbit", "cedar", "harbor", "signal", "meadow", "copper", "drift"]


def prompt(i, words):
    return " ".join(WORDS[(i * 3 + j * 7) % len(WORDS)] for j in range(words))


def generate(url, model, text, tokens):
    body = json.dumps({
        "model": model, "prompt": text, "raw": True, "stream": False,
        "options": {"temperature": 0, "num_predict": tokens},
    }).encode()
    req = urllib.request.Request(url + "/api/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        reply = json.loads(r.read())
    return reply["response"], reply["eval_count"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:11434")
    p.add_argument("--model", required=True)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--words", type=int, default=8, help="words per prompt")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    prompts = [prompt(i, a.words) for i in range(a.streams)]
    generate(a.url, a.model, prompts[0], 4)  # warm-up: load, first pages in
    print(f"| round | in a row (s) | tok/s | {a.streams} at once (s) | tok/s | ratio | same text |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    ratios = []
    for r in range(1, a.rounds + 1):
        start = time.perf_counter()
        alone = [generate(a.url, a.model, t, a.tokens) for t in prompts]
        row_s = time.perf_counter() - start
        together = [None] * a.streams

        def run(i):
            together[i] = generate(a.url, a.model, prompts[i], a.tokens)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(a.streams)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        once_s = time.perf_counter() - start
        n_row = sum(n for _, n in alone)
        n_once = sum(n for _, n in together)
        same = all(x[0] == y[0] for x, y in zip(alone, together))
        ratio = (n_once / once_s) / (n_row / row_s)
        ratios.append(ratio)
        print(f"| {r} | {row_s:.2f} | {n_row / row_s:.1f} | {once_s:.2f} | {n_once / once_s:.1f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")
        if not same:
            for i, (x, y) in enumerate(zip(alone, together)):
                if x[0] != y[0]:
                    print(f"stream {i}: alone {x[0][:80]!r} / together {y[0][:80]!r}", file=sys.stderr)
    ratios.sort()
    print(f"\nmedian ratio {ratios[len(ratios) // 2]:.2f}x over {a.rounds} rounds")


if __name__ == "__main__":
    main()
