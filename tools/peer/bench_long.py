#!/usr/bin/env python3
"""Long prompts and long contexts: slotstream's wgpu backend against llama.cpp's Vulkan backend
on the same weights, one GPU, one run (issue 46, item 6). Driven by tools/bench_gpu_peer.sh
(its `long` phase), on the models of tools/peer/bench_gpu_peer.py (A, B: every expert resident).

Per model and per context length N in --lengths (default 8192,32768):
  llama.cpp: llama-bench -ngl 99 -p N -n 64 -d 0 (prefill ppN, decode tg64 from depth 0), then
             -p 0 -n 64 -d N (tg64 @ dN); -r --peer-reps. Its peak GPU memory in the tg64 @ dN run.
  ours:      slotstream run --backend wgpu --raw --ignore-eos, a prompt of N tokens then 65 tokens:
             the prompt's prefill tok/s (as ppN) and decode from depth N (as tg64 @ dN); peak GPU
             memory (nvidia-smi), and the backend's own count of it by use (`run --json`'s
             device_memory: weights, expert pool, KV cache, activation pool, staging; its peak). With --flash-off, the same with SLOTSTREAM_WGPU_FLASH=0 (the per-head
             attention kernels) at the first length, before and after on one machine.
  parity:    with --parity L, a copy of each model cut to its first L layers (the same shapes)
             answers the longest prompt with 8 greedy tokens on cpu:exact, wgpu:exact, wgpu and cpu:
             whether each gives cpu:exact's ids (issue 46: a 32k context on both backends).
  per-op:    with --bench-gpu, our kernel times (bench_gpu --prompt N: decode at depth N and the
             N-token prefill by kernel; the decode again with --no-flash-decode) and llama.cpp's (GGML_VK_PERF_LOGGER=1 llama-bench -p 0 -n 4
             -d N), raw logs kept for BENCHMARKS.md, at the first length only; the prefill by kernel
             in chunks of 1024 and 2048 with the matrix units and without (bench_gpu --no-coop), and once,
             prefill-sized products against exact mode's (bench_gpu --gemm: error and TFLOP/s).
             --kernels decode keeps only the decode at depth by kernel (both ways) and the peer's.
  perplexity: with --perplexity, the demo model one token at a time on the GPU against cpu:exact.
  fixed:     first, ours on the bundled demo model (13 MB of weights): nvidia-smi's peak against the
             backend's own count, the GPU memory that does not scale with the model (the driver's
             context and pipelines, the local memory it reserves for spilled registers);
             --no-fixed-share skips it.
Prints one markdown table; results.json, table.md and every log go to --results.
"""

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_peer as bp  # noqa: E402
from gpu_peer_table import f1 as f, ratio  # noqa: E402


def calibrated(a, n):
    """bench_gpu_peer's calibrate_prompt, remembered in tools/peer/long_prompts.json (characters
    of the calibration text per token count): on the GPU machine, a 32k-token calibration would
    spend minutes of device time."""
    path = os.path.join(bp.HERE, "long_prompts.json")
    known = json.load(open(path)) if os.path.exists(path) else {}
    text = ""
    for f in ["ARCHITECTURE.md", "README.md", "BENCHMARKS.md"]:
        text += open(os.path.join(bp.REPO, f), encoding="utf-8").read() + "\n"
    # The digest covers only the prompt itself (the first `chars` characters), so editing the
    # documents past it (BENCHMARKS.md, mostly) keeps the calibration.
    def digest(chars):
        return hashlib.sha256(text[:chars].encode()).hexdigest()[:16]
    entry = known.get(str(n))
    if entry and entry.get("prompt_sha256") == digest(entry["chars"]):
        return text[:entry["chars"]], entry["tokens"]
    prompt, tokens = bp.calibrate_prompt(a, n)
    known[str(n)] = {"chars": len(prompt), "tokens": tokens, "prompt_sha256": digest(len(prompt))}
    json.dump(known, open(path, "w"), indent=1)
    return prompt, tokens


def peer_rows(a, gguf, tag, p, n, d, reps, env=None, llama=None):
    llama = llama or a.llama
    env = env or dict(os.environ, LD_LIBRARY_PATH=os.path.join(llama, "bin") + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    cmd = [os.path.join(llama, "bin", "llama-bench"), "-m", gguf, "-ngl", "99", "-p", str(p), "-n", str(n),
           "-d", str(d), "-r", str(reps), "-o", "json"]
    r = bp.run(cmd, tag, a, env=env)
    out = {"gpu_mib": r["gpu_mib"], "wall_s": r["wall_s"], "rc": r["rc"]}
    try:
        rows = json.loads(r["stdout"][r["stdout"].index("["):])
        for row in rows:
            kind = "prefill" if row["n_prompt"] and not row["n_gen"] else "decode"
            out[kind] = row["avg_ts"]
            out[kind + "_sd"] = row["stddev_ts"]
            out["build"], out["flash_attn"] = row.get("build_commit"), row.get("flash_attn")
    except Exception as ex:  # noqa: BLE001
        out["error"] = f"{type(ex).__name__}: {ex}; rc={r['rc']}; {r['stderr'][-600:]}"
        bp.log("  " + out["error"])
    return out


def ours_long(a, model, experts, prompt, tag, env=None):
    # The plan's context: the prompt and the tokens it generates.
    extra = ("--plan-context", str(a.depth + a.decode + 64))
    r = bp.ours(a, model, a.gpu_backend, prompt, a.decode + 1, experts, tag, env=env, extra=extra)
    keys = ("prefill", "decode", "prompt_tokens", "gpu_mib", "wall_s", "error", "backend_name", "device_memory")
    return {k: r.get(k) for k in keys}


PARITY_BACKENDS = ["cpu:exact", "wgpu:exact", "wgpu", "cpu"]


def parity(a, key, family, experts, args, prompt, n_prompt):
    """8 greedy tokens after `prompt` on each of PARITY_BACKENDS, on `key` cut to a.parity
    layers; each backend's ids against cpu:exact's."""
    name, model, _ = bp.make_model(a, f"{key}_{a.parity}L", family, experts, f"{args} --layers {a.parity}", False)
    a.depth = n_prompt
    out = {"layers": a.parity, "prompt_tokens": n_prompt, "backends": {}}
    for backend in PARITY_BACKENDS:
        extra = ("--plan-context", str(n_prompt + 8 + 64))
        r = bp.ours(a, model, backend, prompt, 8, experts, f"{name}_parity_{backend.replace(':', '_')}", extra=extra)
        out["backends"][backend] = {k: r.get(k) for k in ("ids", "prefill", "wall_s", "error")}
    want = out["backends"]["cpu:exact"].get("ids")
    for backend, r in out["backends"].items():
        r["same_as_cpu_exact"] = want is not None and r.get("ids") == want
    if not a.keep:
        bp.shutil.rmtree(model, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slotstream", required=True)
    ap.add_argument("--bench-gpu", help="our bench_gpu example, for per-kernel times")
    ap.add_argument("--llama", required=True)
    ap.add_argument("--llama-cuda", help="llama.cpp's CUDA build (bin/llama-bench): its ppN and tg64 @ dN too")
    ap.add_argument("--work", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--models", default="A,B")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--decode", type=bp.positive, default=64)
    ap.add_argument("--peer-reps", type=int, default=2)
    ap.add_argument("--flash-off", action="store_true", help="also ours with SLOTSTREAM_WGPU_FLASH=0 at the first length")
    ap.add_argument("--variant-wgsl", help="also ours at every length with SLOTSTREAM_WGPU_WGSL_DIR=DIR "
                    "(another commit's kernel files, compared in the same call)")
    bp.model_args(ap)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--parity", type=int, default=0, metavar="LAYERS",
                    help="also greedy ids at the longest length on each backend, on the model cut to LAYERS layers")
    ap.add_argument("--kernels", choices=["all", "decode"], default="all",
                    help="with --bench-gpu: every per-kernel run (products, decode both ways, prefill by chunk), "
                         "or decode at depth by kernel only (flash_decode and without, the peer's perf logger)")
    ap.add_argument("--kernels-every-length", action="store_true",
                    help="with --bench-gpu: the per-kernel runs at every length, not only the first (8k and 32k "
                         "per-op times beside the peer's; about 100 s more a model at 32k)")
    ap.add_argument("--no-fixed-share", action="store_true",
                    help="skip the fixed share of GPU memory (ours on the bundled demo model, nvidia-smi against the ledger)")
    ap.add_argument("--perplexity", action="store_true",
                    help="also the bundled demo model's perplexity one token at a time on the GPU (every step from the "
                         "1,024th key on takes flash_decode) against cpu:exact's, before the models")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    a.depth = None
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    prompts = {n: calibrated(a, n) for n in lengths}
    results = []
    fixed = None if a.no_fixed_share else fixed_share(a)
    ppl = demo_perplexity(a) if a.perplexity else None
    if a.bench_gpu and a.kernels == "all":
        # Prefill-sized products against exact mode's: the matrix units' error and speed.
        bp.run([a.bench_gpu, *adapter(a), "--gemm", "2048:2048:4096,2048:4096:2048,8192:2048:5120,2048:768:2048", "--reps", "10"], "ours_gemm", a)
    for key in [k.strip() for k in a.models.split(",") if k.strip()]:
        family, experts, args = (bp.SMALL if a.small else bp.FULL)[key]
        name, model, _ = bp.make_model(a, key, family, experts, args, False)
        gguf, _ = bp.make_gguf(a, name, model)
        bp.log(f"== {key}")
        res = {"key": key, "family": family, "lengths": {}}
        for i, n in enumerate(lengths):
            prompt, n_prompt = prompts[n]
            row = {"prompt_tokens": n_prompt}
            row["peer_pp"] = peer_rows(a, gguf, f"{key}_llama_pp{n}", n, a.decode, 0, a.peer_reps)
            row["peer_tg"] = peer_rows(a, gguf, f"{key}_llama_tg_d{n}", 0, a.decode, n, a.peer_reps)
            if a.llama_cuda:
                row["cuda_pp"] = peer_rows(a, gguf, f"{key}_llama_cuda_pp{n}", n, a.decode, 0, a.peer_reps, llama=a.llama_cuda)
                row["cuda_tg"] = peer_rows(a, gguf, f"{key}_llama_cuda_tg_d{n}", 0, a.decode, n, a.peer_reps, llama=a.llama_cuda)
            a.depth = n_prompt
            row["ours"] = ours_long(a, model, experts, prompt, f"{key}_ours_{n}")
            if a.variant_wgsl:
                env = dict(os.environ, SLOTSTREAM_WGPU_WGSL_DIR=os.path.abspath(a.variant_wgsl))
                row["ours_variant"] = ours_long(a, model, experts, prompt, f"{key}_ours_{n}_variant", env=env)
            if i == 0 and a.flash_off:
                env = dict(os.environ, SLOTSTREAM_WGPU_FLASH="0")
                row["ours_flash_off"] = ours_long(a, model, experts, prompt, f"{key}_ours_{n}_flash_off", env=env)
            if (i == 0 or a.kernels_every_length) and a.bench_gpu:
                decode = [a.bench_gpu, *adapter(a), "--model", model, "--prompt", str(n), "--decode", "16", "--no-matvec",
                          "--flush", "16", "--depth", "32", "--pp", "32"]
                bp.run(decode, f"{key}_ours_kernels_{n}", a)
                # Decode at depth without flash_decode.wgsl (flash_attention's tiles instead).
                bp.run(decode + ["--no-flash-decode"], f"{key}_ours_kernels_{n}_no_flash_decode", a,
                       env=dict(os.environ, BENCH_SKIP_BEFORE="1"))
                env = dict(bp.llama_env(a), GGML_VK_PERF_LOGGER="1")
                peer_rows(a, gguf, f"{key}_llama_kernels_d{n}", 0, 4, n, 1, env=env)
                # Prefill by kernel with the matrix units and without (matmul_coop.wgsl).
                for coop in ([], ["--no-coop"]) if a.kernels == "all" else ():
                    bp.run([a.bench_gpu, *adapter(a), "--model", model, "--prompt", str(n), "--chunks", "1024,2048"] + coop,
                           f"{key}_ours_prefill_{n}{'_no_coop' if coop else ''}", a)
            res["lengths"][n] = row
            json.dump(results + [res], open(os.path.join(a.results, "results.json"), "w"), indent=1, default=str)
        if a.parity:
            n = lengths[-1]
            res["parity"] = parity(a, key, family, experts, args, *prompts[n])
            json.dump(results + [res], open(os.path.join(a.results, "results.json"), "w"), indent=1, default=str)
        results.append(res)
        if not a.keep:
            os.remove(gguf)
            bp.shutil.rmtree(model, ignore_errors=True)
    md = table(a, results, fixed)
    if ppl:
        md += "\n\n" + ppl["line"]
    open(os.path.join(a.results, "table.md"), "w").write(md + "\n")
    json.dump({"commit": a.commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "fixed_share": fixed, "perplexity": ppl, "results": results},
              open(os.path.join(a.results, "results.json"), "w"), indent=1, default=str)
    print(md)


def adapter(a):
    """bench_gpu's adapter choice for --gpu-backend (a software rasterizer only where asked for)."""
    return ["--adapter", "software"] if "software" in a.gpu_backend else []


def last_json(r):
    """The JSON object on the last line of a run's stdout."""
    return json.loads(r["stdout"].strip().splitlines()[-1])


def fixed_share(a):
    """GPU memory that does not scale with the model: ours on the bundled demo model (13 MB of
    weights), nvidia-smi's peak (less the reading before) beside the backend's own count; the
    difference is the driver's share (context, pipelines, the local memory reserved for the
    kernels' spilled registers) and the allocator's rounding."""
    model = os.path.join(bp.REPO, "tools", "demo", "model")
    r = bp.run([a.slotstream, "run", "--model", model, "--backend", a.gpu_backend, "--max-tokens", "8",
                "--json", "--prompt", "Hello there"], "ours_fixed_share", a)
    out = {"gpu_mib": r["gpu_mib"], "rc": r["rc"]}
    try:
        m = last_json(r).get("device_memory") or {}
        out["ledger_peak_mib"] = round(m.get("peak_bytes", 0) / 2**20, 1)
        out["allocator_block_mib"] = round((m.get("allocator_block_bytes") or 0) / 2**20, 1)
    except Exception as ex:  # noqa: BLE001
        out["error"] = f"{type(ex).__name__}: {ex}; {r['stderr'][-400:]}"
    return out


def demo_perplexity(a):
    """The demo model's perplexity over one 2,048-token window of tools/demo/heldout_sample.txt:
    cpu:exact (the reference) and the GPU backend one token at a time with an f16 cache (its decode
    kernels: flash_decode from the 1,024th key; a software rasterizer would keep f32 otherwise)."""
    base = [a.slotstream, "perplexity", "--model", os.path.join(bp.REPO, "tools", "demo", "model"),
            "--file", os.path.join(bp.REPO, "tools", "demo", "heldout_sample.txt"), "--window", "2048"]
    out = {}
    for tag, extra in (("cpu:exact", ["--backend", "cpu:exact"]), (a.gpu_backend, ["--backend", a.gpu_backend, "--kv-cache", "f16", "--one-token"])):
        r = bp.run(base + extra, f"ours_perplexity_{tag.replace(':', '_')}", a)
        try:
            out[tag] = last_json(r)["perplexity"]
        except Exception as ex:  # noqa: BLE001
            out[tag] = None
            out["error"] = f"{tag}: {type(ex).__name__}: {ex}; {r['stderr'][-400:]}"
    ref, got = out.get("cpu:exact"), out.get(a.gpu_backend)
    change = f"{100 * (got / ref - 1):+.3f}%" if ref and got else "failed"
    out["line"] = (f"Demo perplexity (one 2,048-token window of tools/demo/heldout_sample.txt): cpu:exact {ref}, "
                   f"{a.gpu_backend} --kv-cache f16 --one-token {got} ({change})" + (f"; {out['error']}" if "error" in out else ""))
    return out


def table(a, results, fixed=None):
    lines = [f"commit {a.commit}; ours: `run --backend {a.gpu_backend}`, theirs: llama-bench (Vulkan), same Q4_0 bits", "",
             "| model | context | ours prefill | theirs ppN | ratio | ours decode @ dN | theirs tg64 @ dN | ratio "
             "| ours GPU MiB | theirs GPU MiB | ours flash off: prefill / decode |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for n, row in r["lengths"].items():
            o, pp, tg = row["ours"], row["peer_pp"], row["peer_tg"]
            off = row.get("ours_flash_off")
            off_s = f"{f(off.get('prefill'))} / {f(off.get('decode'))}" if off else "—"
            lines.append(f"| {r['key']} | {row['prompt_tokens']} | {f(o.get('prefill'))} | {f(pp.get('prefill'))} "
                         f"| {ratio(o.get('prefill'), pp.get('prefill'))} | {f(o.get('decode'))} | {f(tg.get('decode'))} "
                         f"| {ratio(o.get('decode'), tg.get('decode'))} | {o.get('gpu_mib')} | {tg.get('gpu_mib')} | {off_s} |")
    if fixed:
        lines.append(f"\nFixed share (ours on the bundled demo model): nvidia-smi {fixed.get('gpu_mib')} MiB, the backend's "
                     f"own count {fixed.get('ledger_peak_mib')} MiB, allocator blocks {fixed.get('allocator_block_mib')} MiB"
                     + (f" ({fixed['error']})" if fixed.get("error") else ""))
    for r in results:
        for n, row in r["lengths"].items():
            m = row["ours"].get("device_memory")
            if m:
                mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
                uses = ", ".join(f"{k} {mib(v)}" for k, v in sorted(m["at_peak"].items(), key=lambda kv: -kv[1]) if v)
                lines.append(f"\n{r['key']} @ {n}, ours by the backend's own count (`run --json` device_memory): peak "
                             f"{mib(m['peak_bytes'])} MiB ({uses}); pooled scratch in use at most {mib(m['scratch_peak_bytes'])} MiB; "
                             f"allocator blocks {mib(m.get('allocator_block_bytes') or 0)} MiB after the run")
    for r in results:
        for n, row in r["lengths"].items():
            if "ours_variant" in row:
                o = row["ours_variant"]
                lines.append(f"\n{r['key']} @ {n}, kernels of {a.variant_wgsl}: prefill {f(o.get('prefill'))}, decode {f(o.get('decode'))}")
    for r in results:
        for n, row in r["lengths"].items():
            if "cuda_pp" in row:
                o, pp, tg = row["ours"], row["cuda_pp"], row["cuda_tg"]
                lines.append(f"\n{r['key']} @ {n}, llama.cpp CUDA: pp{n} {f(pp.get('prefill'))} (ours "
                             f"{ratio(o.get('prefill'), pp.get('prefill'))}), tg64 @ d{n} {f(tg.get('decode'))} (ours "
                             f"{ratio(o.get('decode'), tg.get('decode'))}), GPU {tg.get('gpu_mib')} MiB")
    for r in results:
        if "parity" in r:
            pr = r["parity"]
            same = ", ".join(f"{b} {'same' if x['same_as_cpu_exact'] else 'DIFFERENT' if x.get('ids') else 'failed'}"
                             for b, x in pr["backends"].items() if b != "cpu:exact")
            lines.append(f"\n{r['key']}, first {pr['layers']} layers, {pr['prompt_tokens']}-token prompt, 8 greedy ids "
                         f"against cpu:exact's: {same}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
