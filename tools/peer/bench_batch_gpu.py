#!/usr/bin/env python3
"""Concurrent greedy streams on the GPU (issue 48): slotstream's wgpu backend serving --parallel N
against llama.cpp's batched decode, on the same weights, one GPU, one run. Driven by
tools/bench_gpu_peer.sh (its `batch` phase), on bench_gpu_peer.py's model A (qwen3_moe trunk,
every expert resident).

  ours:    `slotstream serve --backend wgpu --parallel N`, then tools/bench_batch.py --streams N:
           N greedy /api/generate of --tokens tokens one after another, then all N at once
           (--rounds rounds); the aggregate generated tok/s of both, their ratio, and whether
           each stream's text at once equals its text alone.
  theirs:  llama-batched-bench -npp 16 -ntg TOKENS -npl 1,N,...: S_TG (generated tokens per second
           over all sequences) for each number of parallel sequences, the engine path of
           llama-server's parallel slots (one batch per step over every slot).
Prints one markdown table; results.json and table.md go to --results, the logs beside them.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_peer as bp  # noqa: E402


def wait_ready(url, seconds=300):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/api/tags", timeout=5):
                return True
        except OSError:
            time.sleep(0.5)
    return False


def ours(a, model, streams, port):
    """bench_batch.py against a server with --parallel streams: per round, tok/s in a row and at once."""
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(a.results, f"ours_serve_{streams}.log"), "w")
    server = subprocess.Popen([a.slotstream, "serve", "--model", model, "--name", "synth", "--backend", a.gpu_backend,
                               "--port", str(port), "--parallel", str(streams), "--no-prefix-cache"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_ready(url):
            return {"error": "the server did not answer within 300 s"}
        r = subprocess.run([sys.executable, os.path.join(bp.REPO, "tools", "bench_batch.py"), "--url", url, "--model", "synth",
                            "--streams", str(streams), "--tokens", str(a.tokens), "--rounds", str(a.rounds)],
                           capture_output=True, text=True, timeout=a.timeout)
        open(os.path.join(a.results, f"ours_bench_{streams}.out"), "w").write(r.stdout + r.stderr)
        rows = []
        for line in r.stdout.splitlines():
            m = re.match(r"\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)x\s*\|\s*(\w+)", line)
            if m:
                rows.append({"row_tps": float(m.group(3)), "once_tps": float(m.group(5)), "ratio": float(m.group(6)),
                             "same": m.group(7) == "yes"})
        if not rows:
            return {"error": f"no rounds in bench_batch.py's output (rc {r.returncode}): {r.stderr[-400:]}"}
        med = lambda k: sorted(x[k] for x in rows)[len(rows) // 2]  # noqa: E731
        return {"row_tps": med("row_tps"), "once_tps": med("once_tps"), "ratio": med("ratio"),
                "same": all(x["same"] for x in rows), "rounds": rows}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def theirs(a, gguf, streams):
    """llama-batched-bench's S_TG for 1 and each count in `streams`."""
    npl = ",".join(str(n) for n in sorted({1, *streams}))
    cmd = [os.path.join(a.llama, "bin", "llama-batched-bench"), "-m", gguf, "-ngl", "99", "-c", str(max(streams) * (a.tokens + 64) + 256),
           "-npp", "16", "-ntg", str(a.tokens), "-npl", npl]
    r = bp.run(cmd, "llama_batched", a, env=bp.llama_env(a))
    out = {"cmd": " ".join(["llama-batched-bench"] + cmd[1:]), "gpu_mib": r["gpu_mib"]}
    for line in r["stdout"].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        if len(cells) >= 8 and cells[2].isdigit():
            try:
                out[int(cells[2])] = float(cells[7])
            except ValueError:
                pass
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slotstream", required=True)
    ap.add_argument("--llama", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--tokens", type=bp.positive, default=128)
    ap.add_argument("--rounds", type=bp.positive, default=2)
    bp.model_args(ap)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    a.depth = None
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    streams = [int(x) for x in a.streams.split(",") if x.strip()]
    family, experts, args = (bp.SMALL if a.small else bp.FULL)["A"]
    name, model, _ = bp.make_model(a, "A", family, experts, args, False)
    gguf, _ = bp.make_gguf(a, name, model)
    results = {"commit": a.commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tokens": a.tokens,
               "ours": {}, "theirs": theirs(a, gguf, streams)}
    for i, n in enumerate(streams):
        bp.log(f"== ours, {n} streams")
        results["ours"][n] = ours(a, model, n, 11600 + i)
        json.dump(results, open(os.path.join(a.results, "results.json"), "w"), indent=1, default=str)
    t = results["theirs"]
    one = results["ours"].get(1, {}).get("once_tps")
    lines = [f"commit {a.commit}; ours: `serve --backend {a.gpu_backend} --parallel N` + tools/bench_batch.py "
             f"({a.tokens} greedy tokens a stream, median of {a.rounds} rounds); theirs: llama-batched-bench "
             f"(Vulkan, same Q4_0 bits, -npp 16 -ntg {a.tokens})", "",
             "| streams | ours: in a row tok/s | ours: at once tok/s | ours at once / in a row | ours / ours at 1 | same text "
             "| theirs S_TG tok/s | theirs / theirs at 1 | ours / theirs |",
             "|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    ratio = lambda x, y: f"{x / y:.2f}x" if x and y else "-"  # noqa: E731
    for n in streams:
        o = results["ours"][n]
        if "error" in o:
            lines.append(f"| {n} | {o['error']} | | | | | {t.get(n, '-')} | | |")
            continue
        their = t.get(n)
        lines.append(f"| {n} | {o['row_tps']:.1f} | {o['once_tps']:.1f} | {o['ratio']:.2f}x | {ratio(o['once_tps'], one)} "
                     f"| {'yes' if o['same'] else 'NO'} | {their if their else '-'} | {ratio(their, t.get(1))} "
                     f"| {ratio(o['once_tps'], their)} |")
    md = "\n".join(lines)
    open(os.path.join(a.results, "table.md"), "w").write(md + "\n")
    json.dump(results, open(os.path.join(a.results, "results.json"), "w"), indent=1, default=str)
    print(md)


if __name__ == "__main__":
    main()
