#!/usr/bin/env python3
"""One line from `slotstream run --json` output on stdin (for the bench scripts)."""
import json
import sys

o = json.load(sys.stdin)
s, e = o["stats"], o["experts"]["total"]
rss = o.get("peak_rss_bytes") or 0
print(
    "prompt {} tok: prefill {:.1f} tok/s; decode {} tok: {:.2f} tok/s; "
    "experts {} slots, hit {:.1f}%, read {:.2f} GB at {:.2f} GB/s, waited {:.2f} s; peak RSS {:.2f} GB [{}]".format(
        s["prompt_tokens"], s["prefill_tokens_per_second"], s["generated_tokens"], s["decode_tokens_per_second"],
        o["experts"]["slots"], 100.0 * e["hits"] / max(1, e["hits"] + e["misses"]),
        e["bytes_read"] / 1e9, e["bytes_read"] / 1e9 / e["read_seconds"] if e["read_seconds"] else 0.0,
        e["wait_seconds"], rss / 1e9, o["backend"],
    )
)
