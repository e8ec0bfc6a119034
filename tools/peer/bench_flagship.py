#!/usr/bin/env python3
"""The flagship slice streamed at the memory shares of real machines (issue 50): run by
tools/bench_flagship.sh (the dev VM's CPU) and `tools/bench_gpu_peer.sh flagship` (the device).

For each machine size M GB in --shares, the slice gets M * layers / 48 GB (`--memory-gb`: the
slice's share of that machine, as its 12 of 48 layers are a quarter of the model's experts)
and the planner picks the pool. Per share:
  decode   a --decode-prompt-chars prompt, then --decode tokens: decode tok/s, the planner's
           pool and estimate, decode hit rate, MB read per token, n-gram rows read per token,
           and the disk-bound limit: the disk's rate / the bytes read per decoded token
  layers   the same decode on the slice's first 4 layers (a config-only view of the same files)
           with the pool per layer the planner gave the slice: per-layer time and the rest
           (embeddings, lm_head, sampling), extrapolated to 48 layers (see below)
  prefill  a --prefill-tokens prompt (about) from a cold page cache (the model's files evicted
           with posix_fadvise), one token generated: prefill tok/s, time to first token (wall,
           load included), bytes read and the disk-bound limit (those bytes / the disk's rate)
The disk's rate: tools/peer/disk_pace.py reading the slice's files in expert-sized O_DIRECT
pieces, 16 in flight, no idle gaps (what a layer's misses look like), before the runs.

Extrapolation to 48 layers: a decoded token costs fixed + layers x per_layer; from the 12- and
4-layer runs at the same pool per layer, per_layer = (t12 - t4) / 8 and fixed = t4 - 4 per_layer,
so t48 = fixed + 48 per_layer. It assumes every layer costs what the slice's layers cost on
average (the 4-layer pattern repeats: 3 DeltaNet + 1 QSA), that the 48-layer model's pool per
layer (and so its hit rate) is the slice's at the same share of a 4x larger machine, and that
the disk's rate holds at 4x the bytes per token; the n-gram table (32 GB instead of the slice's
--ngram-gb) costs the same rows per token.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def prompt_text(chars):
    """English text of the repository (README.md, then ARCHITECTURE.md), `chars` long."""
    text = ""
    for name in ["README.md", "ARCHITECTURE.md"]:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            text += f.read() + "\n"
    while len(text) < chars:
        text += text
    return text[:chars]


def evict(model):
    """Drop the model's files from the page cache (this process's files only)."""
    for name in os.listdir(model):
        path = os.path.join(model, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(a, model, prompt, max_tokens, extra, log):
    cmd = [a.slotstream, "run", "--model", model, "--backend", a.backend, "--raw", "--ignore-eos", "--json",
           "--max-tokens", str(max_tokens), "--plan-context", str(a.plan_context), "--prompt", "-"] + extra
    env = dict(os.environ, XDG_CACHE_HOME=a.cache)
    t0 = time.monotonic()
    p = subprocess.run(cmd, input=prompt.encode(), capture_output=True, env=env)
    wall = time.monotonic() - t0
    with open(log, "wb") as f:
        f.write(b"$ " + " ".join(cmd[:-1] + ["<prompt>"]).encode() + b"\n" + p.stderr + b"\n" + p.stdout)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} failed ({p.returncode}); see {log}:\n{p.stderr.decode()[-2000:]}")
    o = json.loads(p.stdout)
    o["wall_seconds"] = wall
    return o


def view(model, layers, out):
    """A config-only copy of `model` with its first `layers` layers (the shards linked)."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(model):
        dst = os.path.join(out, name)
        if name != "config.json" and not os.path.lexists(dst):
            os.symlink(os.path.join(os.path.abspath(model), name), dst)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    tc = cfg["text_config"]
    tc["num_hidden_layers"], tc["layer_types"] = layers, tc["layer_types"][:layers]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return out


def disk_rate(a):
    out = os.path.join(a.results, "disk.json")
    # An expert record (2.7 MB) per read; smaller on a toy model's small files.
    largest = max(os.path.getsize(os.path.join(a.model, n)) for n in os.listdir(a.model))
    piece = max(4, min(2700, largest // 4096 // 4 * 4))
    subprocess.run([sys.executable, os.path.join(HERE, "disk_pace.py"), "--dir", a.model, "--gaps-ms", "0",
                    "--piece-kib", str(piece), "--burst-mb", "28", "--threads", "16", "--seconds", str(a.disk_seconds),
                    "--rounds", "2", "--out", out], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        d = json.load(f)
    return d, [m["average_gbs"] for m in next(iter(d["runs"].values()))]


def flagship_plan(a, machine_gb):
    """The planner's auto choice for the published 48-layer model on a machine of `machine_gb`
    (its known sizes, no weights; 85% of the RAM reclaimable): what a user of that machine gets."""
    cmd = [a.slotstream, "doctor", "--model", "qwen3.8-flash-next:4bit", "--backend", a.backend, "--sim-ram", str(machine_gb),
           "--sim-available", f"{0.85 * machine_gb:.2f}", "--json"]
    p = subprocess.run(cmd, capture_output=True, env=dict(os.environ, XDG_CACHE_HOME=a.cache))
    if p.returncode != 0:
        return {"error": p.stderr.decode()[-500:]}
    plan = json.loads(p.stdout)["plan"]
    return {k: plan.get(k) for k in ("reason", "experts_per_layer", "pool_bytes", "peak_bytes", "expected_decode_tokens_per_second")}


def experts(o, part):
    e = o["stats"]["decode_experts"] if part == "decode" else o["experts"]["total"]
    if part == "prefill":
        d = o["stats"]["decode_experts"]
        e = {k: e[k] - d.get(k, 0) for k in ("hits", "misses", "bytes_read")}
    return e


def summarize_decode(a, dec, lay, rate):
    layers = a.layers
    gen = dec["stats"]["generated_tokens"]
    de = experts(dec, "decode")
    uses = de["hits"] + de["misses"]
    bpt = de["bytes_read"] / max(1, gen)
    ng = dec.get("ngram_rows") or {}
    toks = dec["stats"]["prompt_tokens"] + gen
    plan = dec["plan"]
    t12 = 1 / dec["stats"]["decode_tokens_per_second"]
    t4 = 1 / lay["stats"]["decode_tokens_per_second"]
    v = lay["view_layers"]
    per_layer = (t12 - t4) / (layers - v)
    fixed = t4 - v * per_layer
    le = experts(lay, "decode")
    return {
        "plan": {k: plan.get(k) for k in ("mode", "reason", "slots", "pool_bytes", "experts_per_layer", "peak_bytes", "total_experts",
                                          "expected_decode_tokens_per_second", "expected_decode_from_runs")},
        "decode": {
            "tokens": gen, "prompt_tokens": dec["stats"]["prompt_tokens"], "tok_s": dec["stats"]["decode_tokens_per_second"],
            "hit_rate": de["hits"] / max(1, uses), "mb_per_token": bpt / 1e6, "misses_per_token": de["misses"] / max(1, gen),
            "ngram_rows_read_per_token": ng.get("misses", 0) / max(1, toks),
            "ngram_rows_per_token": (ng.get("hits", 0) + ng.get("misses", 0)) / max(1, toks),
            "disk_limit_tok_s": rate * 1e9 / bpt if bpt else None,
            "waited_ms_per_token": 1e3 * dec["stats"]["decode_experts"]["wait_seconds"] / max(1, gen),
            "compute_limit_tok_s": gen / max(1e-9, dec["stats"]["decode_seconds"] - dec["stats"]["decode_experts"]["wait_seconds"]),
            "peak_rss_gb": (dec.get("peak_rss_bytes") or 0) / 1e9,
        },
        "layers": {"view_layers": v, "view_tok_s": lay["stats"]["decode_tokens_per_second"],
                   "view_hit_rate": le["hits"] / max(1, le["hits"] + le["misses"]),
                   "per_layer_ms": per_layer * 1e3, "fixed_ms": fixed * 1e3,
                   "extrapolated_48_tok_s": 1 / (fixed + 48 * per_layer) if fixed + 48 * per_layer > 0 else None,
                   "disk_limit_48_tok_s": rate * 1e9 / (bpt * 48 / layers) if bpt else None},
    }


def summarize_prefill(a, pre, rate):
    pe = experts(pre, "prefill")
    pt = pre["stats"]["prompt_tokens"]
    png = pre.get("ngram_rows") or {}
    plan = pre["plan"]
    # The floor: a cold pool reads every routed expert at least once (a long prompt routes to
    # nearly all of them); what the chunks read beyond that is the prefill's own choice.
    floor = plan["total_experts"] * plan["pool_bytes"] / max(1, plan["slots"])
    return {
        "prompt_tokens": pt, "tok_s": pre["stats"]["prefill_tokens_per_second"], "seconds": pre["stats"]["prefill_seconds"],
        "ttft_wall_s": pre["wall_seconds"], "gb_read": pe["bytes_read"] / 1e9, "hit_rate": pe["hits"] / max(1, pe["hits"] + pe["misses"]),
        "disk_limit_tok_s": pt / (pe["bytes_read"] / (rate * 1e9)) if pe["bytes_read"] else None,
        "floor_gb": floor / 1e9, "floor_limit_tok_s": pt / (floor / (rate * 1e9)) if floor else None,
        "ngram_rows_read_per_token": png.get("misses", 0) / max(1, pt), "peak_rss_gb": (pre.get("peak_rss_bytes") or 0) / 1e9,
    }


def table(a, rows, rate, rates):
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
    out = [f"Flagship slice: {a.layers} of 48 layers, {a.backend}, commit {a.commit}, {a.machine}; routing "
           f"{a.routing}; disk {rate:.2f} GB/s ({', '.join(f'{r:.2f}' for r in rates)}; disk_pace.py, 2.7 MB O_DIRECT reads, 16 in flight)", "",
           "| machine | slice's share | planner: pool (experts/layer, GB) | planner's decode estimate | flagship on this machine (auto): experts/layer | decode tok/s | disk-bound limit | ratio | waited for reads | compute-bound limit | decode hits | MB read/token | n-gram rows read/token | peak RSS |",
           "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in [r for r in rows if "decode" in r]:
        p, d = r["plan"], r["decode"]
        ratio = d["tok_s"] / d["disk_limit_tok_s"] if d["disk_limit_tok_s"] else None
        out.append(f"| {r['machine_gb']} GB | {r['memory_gb']} GB | {f(p['experts_per_layer'], 0)}, {f(p['pool_bytes'] / 1e9)} GB | "
                   f"{f(p['expected_decode_tokens_per_second'])} ({'runs' if p.get('expected_decode_from_runs') else 'rates'}) | {f((r.get('flagship_plan') or {}).get('experts_per_layer'), 0)} | {f(d['tok_s'])} | {f(d['disk_limit_tok_s'])} | {f(ratio)} | "
                   f"{f(d['waited_ms_per_token'], 0)} ms/token | {f(d['compute_limit_tok_s'])} | "
                   f"{100 * d['hit_rate']:.1f}% | {f(d['mb_per_token'], 1)} | {f(d['ngram_rows_read_per_token'], 1)} | {f(d['peak_rss_gb'])} GB |")
    out += ["", f"Prefill of a ~{a.prefill_tokens}-token prompt from a cold page cache, one token generated:", "",
            "| machine | prompt tokens | prefill tok/s | disk-bound limit (bytes read) | GB read | disk-bound limit (each expert once) | expert hits | time to first token (wall, load included) | n-gram rows read/token | peak RSS |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in [r for r in rows if "prefill" in r]:
        p = r["prefill"]
        out.append(f"| {r['machine_gb']} GB | {p['prompt_tokens']} | {f(p['tok_s'])} | {f(p['disk_limit_tok_s'])} | {f(p['gb_read'], 1)} | "
                   f"{f(p.get('floor_limit_tok_s'), 0)} ({f(p.get('floor_gb'), 1)} GB) | "
                   f"{100 * p['hit_rate']:.1f}% | {f(p['ttft_wall_s'], 1)} s | {f(p['ngram_rows_read_per_token'], 1)} | {f(p['peak_rss_gb'])} GB |")
    out += ["", "Per-layer time extrapolated to 48 layers (same pool per layer; tools/peer/bench_flagship.py says what it assumes):", "",
            "| machine (48 layers) | slice's decode | its first layers' decode | per layer | rest (embed, lm_head, sampling) | 48 layers, extrapolated | 48 layers, disk-bound limit | the seed (M5 Pro 48 GB) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in [r for r in rows if "layers" in r]:
        l, d = r["layers"], r["decode"]
        out.append(f"| {r['machine_gb']} GB | {f(d['tok_s'])} tok/s | {f(l['view_tok_s'])} tok/s ({l['view_layers']} layers) | {f(l['per_layer_ms'], 1)} ms | {f(l['fixed_ms'], 1)} ms | "
                   f"{f(l['extrapolated_48_tok_s'])} tok/s | {f(l['disk_limit_48_tok_s'])} tok/s | {'12 tok/s' if r['machine_gb'] == 48 else '-'} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slotstream", required=True)
    ap.add_argument("--model", required=True, help="the slice (tools/synth.py --family qwen4_exp --layers N)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--shares", default="16,24,48", help="machine sizes in GB")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--decode-prompt-chars", type=int, default=600)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--chars-per-token", type=float, default=1.5, help="of the fixture tokenizer on the prompt text")
    ap.add_argument("--plan-context", type=int, default=9216)
    ap.add_argument("--disk-seconds", type=float, default=5.0)
    ap.add_argument("--phases", default="decode,prefill", help="decode (with the layer view), prefill, or both")
    ap.add_argument("--results", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--machine", default="")
    a = ap.parse_args()
    os.makedirs(a.results, exist_ok=True)
    a.cache = os.path.join(a.results, "cache")  # the planner's rates and run history, this benchmark's own
    with open(os.path.join(a.model, "config.json")) as f:
        a.layers = json.load(f)["text_config"]["num_hidden_layers"]
    synth = os.path.join(a.model, "synth.json")
    a.routing = "unknown (no synth.json)"
    if os.path.exists(synth):
        with open(synth) as f:
            s = json.load(f)
        a.routing = f"--router-skew {s.get('router_skew')} (tools/synth.py)"
    print(f"load average before: {os.getloadavg()}", flush=True)
    d, rates = disk_rate(a)
    # The planner's rates for this machine and backend, measured before any run (its estimates
    # then start from them; later shares' estimates also learn from the earlier runs).
    subprocess.run([a.slotstream, "doctor", "--model", a.model, "--backend", a.backend, "--measure"],
                   env=dict(os.environ, XDG_CACHE_HOME=a.cache), stdout=open(os.path.join(a.results, "doctor.log"), "w"),
                   stderr=subprocess.STDOUT, check=True)
    rate = sum(rates) / len(rates)
    print(f"disk: {rate:.2f} GB/s", flush=True)
    # A slice of 12 layers is timed again on its first 4 (one 3 DeltaNet + 1 QSA period fewer
    # layers than any multiple of 4); a toy slice of 4 layers on its first 2.
    a.view_layers = 4 if a.layers > 4 else 2
    lay_model = view(a.model, a.view_layers, os.path.join(a.results, f"view{a.view_layers}"))
    dec_prompt = prompt_text(a.decode_prompt_chars)
    pre_prompt = prompt_text(int(a.prefill_tokens * a.chars_per_token))
    # Rows of an earlier call (the device runs the shares and phases in several calls) are kept.
    rows, raw, saved = {}, {}, os.path.join(a.results, "results.json")
    if os.path.exists(saved):
        with open(saved) as f:
            old = json.load(f)
        rows = {float(r["machine_gb"]): r for r in old["rows"]}
        for r in rows.values():  # rows written before rows kept their own disk rate: their call's
            r.setdefault("disk_gbps", sum(old["disk_gbps"]) / len(old["disk_gbps"]))
        raw = {float(k): v for k, v in old["runs"].items()} if isinstance(old["runs"], dict) else \
            {float(r["machine_gb"]): v for r, v in zip(old["rows"], old["runs"])}
    for share, runs in raw.items():
        # Summaries recomputed from the kept runs (with the disk rate of their call).
        row = rows.setdefault(share, {"machine_gb": share, "memory_gb": round(share * a.layers / 48, 2)})
        lay = runs.get("layers") or runs.get("layers4")
        if runs.get("decode") and lay:
            lay.setdefault("view_layers", 4)
            row.update(summarize_decode(a, runs["decode"], lay, row.get("decode_disk_gbps") or row.get("disk_gbps") or rate))
        if runs.get("prefill"):
            row["prefill"] = summarize_prefill(a, runs["prefill"], row.get("prefill_disk_gbps") or row.get("disk_gbps") or rate)
    phases = set(a.phases.split(","))
    for share in [float(x) for x in a.shares.split(",") if x.strip()]:
        share = int(share) if share == int(share) else share
        row, runs = rows.setdefault(float(share), {}), raw.setdefault(float(share), {})
        row.update({"machine_gb": share, "memory_gb": round(share * a.layers / 48, 2)})
        mem = ["--memory-gb", f"{share * a.layers / 48:.2f}"]
        if "decode" in phases:
            dec = run(a, a.model, dec_prompt, a.decode, mem, os.path.join(a.results, f"decode-{share}.log"))
            epl = max(1, int(round(dec["plan"]["experts_per_layer"])))
            print(f"{share} GB: decode {dec['stats']['decode_tokens_per_second']:.2f} tok/s, pool {epl}/layer", flush=True)
            lay = run(a, lay_model, dec_prompt, a.decode, ["--experts-per-layer", str(epl)],
                      os.path.join(a.results, f"layers{a.view_layers}-{share}.log"))
            lay["view_layers"] = a.view_layers
            row.update(summarize_decode(a, dec, lay, rate))
            row.update({"decode_disk_gbps": rate, "decode_commit": a.commit})
            runs.update({"decode": dec, "layers": lay})
        if "prefill" in phases:
            evict(a.model)
            pre = run(a, a.model, pre_prompt, 1, mem, os.path.join(a.results, f"prefill-{share}.log"))
            print(f"{share} GB: prefill {pre['stats']['prefill_tokens_per_second']:.2f} tok/s, ttft {pre['wall_seconds']:.1f} s", flush=True)
            row["prefill"] = summarize_prefill(a, pre, rate)
            row.update({"prefill_disk_gbps": rate, "prefill_commit": a.commit})
            runs["prefill"] = pre
        write(a, rows, raw, rates, pre_prompt, rate)
    md = write(a, rows, raw, rates, pre_prompt, rate)
    print(md)


def write(a, rows, raw, rates, pre_prompt, rate):
    for share, r in rows.items():
        r["flagship_plan"] = flagship_plan(a, r["machine_gb"])
    ordered = [rows[k] for k in sorted(rows)]
    md = table(a, ordered, rate, rates)
    with open(os.path.join(a.results, "table.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.results, "results.json"), "w") as f:
        json.dump({"commit": a.commit, "machine": a.machine, "loadavg_after": os.getloadavg(), "backend": a.backend,
                   "routing": a.routing, "disk_gbps": rates, "prompt_sha256": hashlib.sha256(pre_prompt.encode()).hexdigest(),
                   "rows": ordered, "runs": {str(k): raw[k] for k in sorted(raw)}}, f, indent=1)
    return md


if __name__ == "__main__":
    main()
