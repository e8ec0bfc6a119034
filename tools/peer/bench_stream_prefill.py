#!/usr/bin/env python3
"""Streamed prefill of long prompts against resident prefill and the disk-bound limit, one GPU,
one call (issue 46, item 6 and its acceptance: "Streamed, A64 with a 25% pool on the device host:
an 8k-token prompt in <= 4 chunks, reading <= 1.25 x (missed expert bytes) per chunk; streamed
prefill >= 0.8 x min(resident prefill, disk-bound limit)"). Driven by tools/bench_gpu_peer.sh
(its `stream-prefill` phase), on the models of tools/peer/bench_gpu_peer.py with 64 experts per
layer (A64, B64; make_model as the `run` and `stream` phases build them).

Prompts: a prefix of the repository's docs (ARCHITECTURE.md, README.md, BENCHMARKS.md, as
bench_long.py's) of exactly N tokens for each N of --lengths (default 2048,8192): the entry of
tools/peer/long_prompts.json where it holds N and the docs are unchanged, else calibrated on a
tiny model (bench_gpu_peer.calibrate_prompt); where no prefix comes to N exactly, the longest one
under N, less trailing white space, is padded with characters no merge of the synthetic
tokenizer joins (one token each).
Every run checks `stats.prompt_tokens` == N.

Per model and prompt, --rounds rounds, the two arms' order alternating:
  streamed: `slotstream run --backend <gpu> --raw --ignore-eos --max-tokens 1 --experts-per-layer 16
            --plan-context N+64 --json` (a pool of 16 of 64 experts per layer, 25%): prefill tok/s
            (`stats.prefill_tokens_per_second`) and the prompt's expert reads
            (`stats.prefill_experts`: bytes read, hits and misses, the distinct experts that missed
            and their bytes, passes = bytes read / missed bytes);
  resident: the same with --experts-per-layer 64 (every expert in the pool, nothing read).
Chunks: ceil(N / the chunk the engine ran): the plan's `prefill_chunk` within the wgpu backend's
bound (PREFILL_ROWS_MAX, read from backends/wgpu/src/matmul.rs of this tree; a resident pool
uses the bound itself, launch.rs); reads per chunk = passes / chunks.
Disk rate: the model's own files read with O_DIRECT (page cache bypassed: cold by construction,
whatever was written or read before; drop_caches is not needed and not tried), 4 MiB reads, 16 in
flight (bench_gpu_peer.disk_read_gbs), up to --disk-gib, before the model's runs and after them;
the limit uses their mean. Our expert reads are O_DIRECT too (`experts.direct_io`, in the table).
Disk-bound limit: N / (bytes the prompt must read / disk rate), with two readings of "must read":
each distinct missed expert once (the floor for any engine with this pool; the acceptance uses
this one, the stricter), and once per chunk (the floor at the chunk the backend allows).
--limit SECONDS: no run starts that could not finish by then (each run is killed at the deadline),
and the table of what was measured is still written. Prints one markdown table; results.json,
table.md and every log go to --results.
"""

import argparse
import hashlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_peer as bp  # noqa: E402

DOCS = ["ARCHITECTURE.md", "README.md", "BENCHMARKS.md"]
# Seconds kept back at the deadline for the table; a run with less than MIN_RUN_S left is skipped.
MARGIN_S, MIN_RUN_S = 10, 20


def rust_const(path, name):
    """An integer `pub const NAME: usize = N;` of this tree's sources (the binary's commit)."""
    try:
        m = re.search(rf"const {name}: usize = ([0-9_]+);", open(os.path.join(bp.REPO, path)).read())
    except OSError:
        m = None
    return int(m.group(1).replace("_", "")) if m else None


def unmerged_chars(model):
    """Printable characters of the model's tokenizer that no merge joins: one token each."""
    tok = json.load(open(os.path.join(model, "tokenizer.json")))["model"]
    merged = {c for pair in tok["merges"] for side in (pair.split(" ") if isinstance(pair, str) else pair) for c in side}
    return [c for c in map(chr, range(33, 127)) if c not in merged and c in tok["vocab"]]


def count_tokens(a, text):
    """Tokens of `text` (run --raw) on the tiny calibration model calibrate_prompt wrote."""
    r = subprocess.run([a.slotstream, "run", "--model", os.path.join(a.work, "calibrate"), "--backend", "cpu", "--raw",
                        "--max-tokens", "1", "--plan-context", str(1 << 20), "--prompt", text, "--json"],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"token count failed: {r.stderr[-800:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["stats"]["prompt_tokens"]


def exact_prompt(a, n, alphabet):
    """A prefix of the docs of exactly n tokens (see the module's doc), and how it was made."""
    text = "".join(open(os.path.join(bp.REPO, f), encoding="utf-8").read() + "\n" for f in DOCS)
    known = {}
    path = os.path.join(bp.HERE, "long_prompts.json")
    if os.path.exists(path):
        known = json.load(open(path))
    entry = known.get(str(n))
    if entry and entry.get("tokens") == n and entry.get("text_sha256") == hashlib.sha256(text.encode()).hexdigest()[:16]:
        return text[:entry["chars"]], "long_prompts.json"
    prompt, tokens = bp.calibrate_prompt(a, n)
    if tokens == n:
        return prompt, "calibrated"
    # The smallest prefix with >= n tokens has more: the one a character shorter has fewer. Not
    # ending in white space, whose split into pre-tokens the next character would change.
    head = prompt[:-1].rstrip()
    short = count_tokens(a, head)
    rng = random.Random(46)
    prompt = head + "".join(rng.choice(alphabet) for _ in range(n - short))
    got = count_tokens(a, prompt)
    if got != n:
        sys.exit(f"could not make a prompt of {n} tokens ({got} after padding {n - short} characters)")
    return prompt, f"calibrated, {n - short} padding tokens"


def remaining(a):
    return a.deadline - time.time() if a.deadline else float("inf")


def one_run(a, model, prompt, n, experts, tag):
    """One prefill (run --max-tokens 1); None where the deadline leaves no time for it."""
    left = remaining(a) - MARGIN_S
    if left < MIN_RUN_S:
        bp.log(f"  [{tag}] skipped: {left:.0f} s left before --limit")
        return None
    a.timeout = int(min(a.run_timeout, left))
    a.depth = n
    r = bp.ours(a, model, a.gpu_backend, prompt, 1, experts, tag, extra=("--plan-context", str(n + 64)))
    res = {k: r.get(k) for k in ("prefill", "prefill_s", "prompt_tokens", "gpu_mib", "rss_bytes", "wall_s", "slots",
                                 "direct_io", "ids", "backend_name", "error", "cmd")}
    try:
        o = json.loads(open(os.path.join(a.results, f"{tag}.out")).read().strip().splitlines()[-1])
        plan, e = o["plan"], o["experts"]
        res.update(plan_chunk=plan["prefill_chunk"], plan_slots=plan["slots"], total_experts=plan["total_experts"],
                   reads=o["stats"].get("prefill_experts"), staging_bytes=e.get("staging_bytes"),
                   disk_busy_s=e["total"].get("disk_busy_seconds"))
    except (OSError, ValueError, KeyError, IndexError) as ex:
        res["error"] = res.get("error") or f"{type(ex).__name__}: {ex}"
    if res.get("prompt_tokens") is not None and res["prompt_tokens"] != n:
        res["error"] = f"the prompt came to {res['prompt_tokens']} tokens, not {n}"
        bp.log("  " + res["error"])
    return res


def chunk_of(a, run):
    """The chunk the engine ran (launch.rs, Engine::chunk_tokens)."""
    bound = a.rows_max if a.gpu_backend.startswith("wgpu") else None
    plan = run.get("plan_chunk")
    if plan is None or (a.gpu_backend.startswith("wgpu") and bound is None):
        return None
    if run["plan_slots"] >= run["total_experts"]:
        plan = min(plan, bound or a.default_chunk or plan)
    return min(plan, bound) if bound else plan


def summary(a, n, streamed, resident, disk_gbs):
    """The row's figures, from the streamed runs (reads are the same each round; the first is kept)
    and the median prefill of each arm."""
    ok_s = [r for r in streamed if r and not r.get("error") and r.get("prefill")]
    ok_r = [r for r in resident if r and not r.get("error") and r.get("prefill")]
    row = {"prompt_tokens": n, "streamed_runs": [r and r.get("prefill") for r in streamed],
           "resident_runs": [r and r.get("prefill") for r in resident],
           "streamed": statistics.median(r["prefill"] for r in ok_s) if ok_s else None,
           "resident": statistics.median(r["prefill"] for r in ok_r) if ok_r else None, "disk_gbs": disk_gbs}
    if not ok_s:
        return row
    s = ok_s[0]
    p = s.get("reads") or {}
    chunk = chunk_of(a, s)
    row.update(chunk=chunk, chunks=math.ceil(n / chunk) if chunk else None, direct_io=s.get("direct_io"),
               slots=s.get("slots"), bytes_read=p.get("bytes_read"), missed_experts=p.get("missed_experts"),
               missed_bytes=p.get("missed_bytes"), passes=p.get("passes"), staged=p.get("staged"),
               hit_rate=p["hits"] / max(1, p["hits"] + p["misses"]) if "hits" in p else None,
               read_gbs_during_prefill=p["bytes_read"] / 1e9 / s["prefill_s"] if p.get("bytes_read") and s.get("prefill_s") else None,
               same_first_token=bool(ok_r) and s.get("ids") == ok_r[0].get("ids"))
    if row["chunks"] and row["passes"] is not None:
        row["reads_per_chunk"] = row["passes"] / row["chunks"]
    if disk_gbs and row["missed_bytes"]:
        row["disk_bound_once"] = n * disk_gbs * 1e9 / row["missed_bytes"]
        if row["chunks"]:
            row["disk_bound_per_chunk"] = row["disk_bound_once"] / row["chunks"]
    for key in ("disk_bound_once", "disk_bound_per_chunk"):
        floor = min((v for v in (row["resident"], row.get(key)) if v), default=None)
        if floor and row["streamed"]:
            row[f"ratio_{key[len('disk_bound_'):]}"] = row["streamed"] / floor
    return row


def disk(a, model):
    files = bp.model_files(model)
    gbs = bp.disk_read_gbs(files, total_bytes=int(a.disk_gib * 2**30))
    bp.log(f"  disk: {gbs and round(gbs, 2)} GB/s (O_DIRECT, 4 MiB reads, 16 in flight)")
    return gbs


def bench_model(a, key, lengths, prompts, out):
    family, _, args = (bp.SMALL if a.small else bp.FULL)[key]
    name, model, times = bp.make_model(a, key, family, bp.STREAM_EXPERTS, args, True)
    out.update(key=name, family=family, synth_args=args, **times)
    alphabet = unmerged_chars(model)
    for n in lengths:
        if n not in prompts:
            prompts[n] = exact_prompt(a, n, alphabet)
            bp.log(f"prompt {n}: {len(prompts[n][0])} characters ({prompts[n][1]})")
    out["disk_before_gbs"] = disk(a, model)
    runs = {n: {"streamed": [], "resident": []} for n in lengths}
    out["runs"] = runs
    for i in range(a.rounds):
        for n in lengths:
            arms = [("streamed", bp.POOL_PER_LAYER), ("resident", bp.STREAM_EXPERTS)]
            for arm, experts in (arms if i % 2 == 0 else arms[::-1]):
                runs[n][arm].append(one_run(a, model, prompts[n][0], n, experts, f"{name}_{arm}_{n}_{i}"))
            yield
    out["disk_after_gbs"] = disk(a, model) if remaining(a) > MARGIN_S + 5 else None
    if not a.keep:
        bp.shutil.rmtree(model, ignore_errors=True)


def rows(a, out):
    """The table's rows of one model, from whatever runs it has."""
    rates = [g for g in (out.get("disk_before_gbs"), out.get("disk_after_gbs")) if g]
    gbs = statistics.mean(rates) if rates else None
    return {n: summary(a, n, r["streamed"], r["resident"], gbs) for n, r in out.get("runs", {}).items()}


class Stopped(Exception):
    """SIGTERM (the phase's backstop timeout): the table is still written."""


def kill_children():
    """Our runs in flight (bench_gpu_peer.run starts each in a session of its own, which a
    signal to this process does not reach): their process groups, by the children's ids."""
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            if stat[stat.rindex(")") + 2:].split()[1] == me:
                os.killpg(int(pid), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass


def f(v, digits=1):
    return "—" if v is None else f"{v:.{digits}f}"


def mark(v, ok):
    return "—" if v is None else f"{v:.2f} {'(met)' if ok(v) else '(**not met**)'}"


def table(a, meta, results):
    lines = [f"commit {a.commit}; `run --backend {a.gpu_backend} --max-tokens 1`, a pool of {bp.POOL_PER_LAYER} of "
             f"{bp.STREAM_EXPERTS} experts per layer (streamed) against {bp.STREAM_EXPERTS} of {bp.STREAM_EXPERTS} "
             f"(resident); {meta['gpu']}, {meta['cpus']} cores; median of {a.rounds} round(s); disk: the model's files, "
             "O_DIRECT, 4 MiB reads, 16 in flight (mean of before and after the runs)", "",
             "| model | prompt | chunks (chunk) | read GB | missed experts (GB) | passes | reads per chunk / missed "
             "| prefill hit rate | streamed tok/s (rounds) | resident tok/s (rounds) | disk GB/s | disk-bound tok/s: "
             "each missed once / once per chunk | streamed / min(resident, disk-bound once) | "
             "streamed / min(resident, disk-bound per chunk) | same first token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for n, row in r.get("rows", {}).items():
            rounds = lambda v: ", ".join(f(x) for x in v)  # noqa: E731
            lines.append(
                f"| {r['key']} | {n} | {row.get('chunks', '—')} ({row.get('chunk', '—')}) "
                f"| {f(row['bytes_read'] / 1e9, 2) if row.get('bytes_read') is not None else '—'} "
                f"| {row.get('missed_experts', '—')} ({f(row['missed_bytes'] / 1e9, 2) if row.get('missed_bytes') else '—'}) "
                f"| {f(row.get('passes'), 2)} | {mark(row.get('reads_per_chunk'), lambda v: v <= 1.25)} "
                f"| {f(100 * row['hit_rate']) + '%' if row.get('hit_rate') is not None else '—'} "
                f"| **{f(row['streamed'])}** ({rounds(row['streamed_runs'])}) | {f(row['resident'])} ({rounds(row['resident_runs'])}) "
                f"| {f(row['disk_gbs'], 2)} | {f(row.get('disk_bound_once'))} / {f(row.get('disk_bound_per_chunk'))} "
                f"| {mark(row.get('ratio_once'), lambda v: v >= 0.8)} | {f(row.get('ratio_per_chunk'), 2)} "
                f"| {'—' if 'same_first_token' not in row else 'yes' if row['same_first_token'] else 'no'} |")
    for r in results:
        for n, row in r.get("rows", {}).items():
            if row.get("chunks") is None:
                continue
            per_chunk, ratio = row.get("reads_per_chunk"), row.get("ratio_once")
            ok = [row["chunks"] <= 4, per_chunk is not None and per_chunk <= 1.25, ratio is not None and ratio >= 0.8]
            checks = [f"chunks {row['chunks']} {'<=' if ok[0] else '>'} 4",
                      f"reads per chunk {f(per_chunk, 2)} x missed bytes {'<=' if ok[1] else 'not <='} 1.25",
                      f"streamed / min(resident, disk-bound) {f(ratio, 2)} {'>=' if ok[2] else 'not >='} 0.8"]
            met = all(ok)
            lines.append(f"\n{r['key']}, {n}-token prompt: {'; '.join(checks)}: **{'met' if met else 'not met'}**"
                         f" (expert reads {'O_DIRECT' if row.get('direct_io') else 'buffered'}; "
                         f"{f(row.get('read_gbs_during_prefill'), 2)} GB/s read over the streamed prefill)")
    for r in results:
        if r.get("error"):
            lines.append(f"\n{r['key']}: {r['error']}")
    skipped = [(r["key"], n) for r in results for n, row in r.get("rows", {}).items() if row.get("streamed") is None]
    if skipped:
        lines.append("\nno streamed result (skipped at --limit or failed; see results.json): "
                     + ", ".join(f"{k} {n}" for k, n in skipped))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slotstream", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--models", default="A64", help="A64, B64 (A, B: the same names)")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--rounds", type=bp.positive, default=2)
    bp.model_args(ap)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--disk-gib", type=float, default=4.0, help="GiB of the model's files each disk measurement reads")
    ap.add_argument("--limit", type=float, default=0, help="seconds for the whole run (0: none)")
    ap.add_argument("--run-timeout", type=int, default=600)
    ap.add_argument("--model-min", type=float, default=180,
                    help="seconds a model after the first needs left of --limit to start (its synthesis and runs)")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    t_start = time.time()
    a.deadline = t_start + a.limit if a.limit > 0 else None
    a.depth = None
    a.rows_max = rust_const("backends/wgpu/src/matmul.rs", "PREFILL_ROWS_MAX")
    a.default_chunk = rust_const("src/plan/mod.rs", "DEFAULT_PREFILL_CHUNK")
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    lengths = sorted({int(x) for x in a.lengths.split(",") if x.strip()}, reverse=True)
    keys = []
    for m in [m.strip() for m in a.models.split(",") if m.strip()]:
        base = m[:-2] if m.endswith("64") else m
        if base not in bp.FULL:
            sys.exit(f"unknown model {m} (A64, B64)")
        keys.append(base)
    gpu = "unknown GPU"
    if bp.shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True, text=True)
        gpu = r.stdout.strip() or gpu
    meta = {"commit": a.commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu,
            "cpus": os.cpu_count(), "wgpu_prefill_rows_max": a.rows_max, "lengths": lengths, "rounds": a.rounds,
            "disk_method": "O_DIRECT reads of the model's files (page cache bypassed), 4 MiB, 16 in flight"}
    prompts, results = {}, []

    def save():
        meta["elapsed_s"] = round(time.time() - t_start, 1)
        json.dump({"meta": meta, "results": results}, open(os.path.join(a.results, "results.json"), "w"), indent=1, default=str)

    def stop(*_):
        raise Stopped()

    signal.signal(signal.SIGTERM, stop)
    stopped = False
    try:
        for i, key in enumerate(keys):
            # A later model starts only with time for its synthesis and runs (synthesis has no deadline).
            if remaining(a) < MARGIN_S + (MIN_RUN_S if i == 0 else a.model_min):
                bp.log(f"== {key}64 skipped: --limit reached")
                continue
            bp.log(f"== {key}64")
            out = {"key": f"{key}64"}
            results.append(out)
            try:
                for _ in bench_model(a, key, lengths, prompts, out):
                    save()
            except SystemExit as ex:  # a failed synthesis or calibration: the other models still run
                out["error"] = str(ex)
                bp.log(f"  {key}64: {ex}")
            save()
    except Stopped:
        bp.log("stopped (SIGTERM): writing the table of what was measured")
        kill_children()
        stopped = True
        if results:
            results[-1].setdefault("error", "stopped by SIGTERM part way")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for r in results:
        r["rows"] = rows(a, r)
    for r in results:
        gpu_name = next((x.get("backend_name") for n in r.get("runs", {}).values() for arm in n.values() for x in arm
                         if x and x.get("backend_name")), None)
        if gpu_name and meta["gpu"] == "unknown GPU":
            meta["gpu"] = gpu_name
    md = table(a, meta, results)
    save()
    open(os.path.join(a.results, "table.md"), "w").write(md + "\n")
    print(md, flush=True)
    if stopped:
        # Not waiting for the killed run's timer thread (bench_gpu_peer.run's, up to --run-timeout).
        os._exit(1)
    if any(r.get("error") or any(row.get("streamed") is None for row in r.get("rows", {}).values()) or not r.get("rows")
           for r in results) or not results:
        sys.exit("some prompts have no streamed result (above)")


if __name__ == "__main__":
    main()
