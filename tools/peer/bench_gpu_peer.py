#!/usr/bin/env python3
"""slotstream's wgpu backend vs llama.cpp's Vulkan backend on the same weights, one GPU,
one run (issue 14, item 5). Driven by tools/bench_gpu_peer.sh (its `run` phase); prints one
markdown table for BENCHMARKS.md and writes results.json, table.md and every log to --results.

Per model (written here by tools/synth.py, MLX 4-bit g64 with --symmetric, so that
tools/peer/to_gguf.py --outtype q4_0 repacks the same bits into a Q4_0 GGUF: what
`llama-quantize --pure Q4_0` would give, without its rounding):
  llama.cpp: llama-bench -ngl 99 -p 256 -n 64 -d 0,432 -r 3 (prefill pp256, decode tg64, both
             read at depth 432; depth 0 kept in results.json);
  ours:      slotstream run --backend wgpu --raw --ignore-eos, a prompt of 432 tokens then 65
             tokens (64 decode passes: the first token comes from the prefill's logits), so decode
             runs from depth 432, as llama-bench's tg64 @ d432; `stats` of --json give prefill
             and decode tok/s (median of --rounds runs);
  both:      peak GPU memory (nvidia-smi memory.used sampled every 100 ms, minus the reading before
             the run; the SM clock sampled with it, each run's timeline in <tag>.clocks.csv) and
             peak host RSS (the child's rusage); and the first prompt of a fresh process on a GPU
             idle for --idle seconds (ours: `run --max-tokens 1`; theirs: llama-bench -p <prompt>
             -n 0 -r 1 --no-warmup), --first-rounds of each, alternating;
  streaming models (64 experts per layer, --experts-per-layer 16 = 25% of them, routers skewed):
             our GPU and CPU backends, their runs alternating and which goes first alternating
             too (--rounds of each: the disk's speed drifts between runs, and both wait on it),
             with each run's ms per token beside its expert reads and the disk's rate while its
             reads were in flight (decode tok/s per GB/s of that rate compares the backends with
             the drift taken out); the expert counters of a prefill-only run (--max-tokens 1)
             are subtracted from the full run's, giving decode-only hit rate, bytes read per token
             and read-wait; the disk's O_DIRECT read rate is measured on the model's own files, and
             the disk-bound limit is that rate / bytes read per token.
"""

import argparse
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_peer_table import table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

FULL = {
    # Qwen3-30B-A3B's trunk, 16 experts per layer (every expert resident).
    "A": ("qwen3_moe", 16, "--hidden 2048 --layers 48 --top-k 8 --moe-inter 768 --heads 32 --kv-heads 4 "
                           "--head-dim 128 --vocab 151936"),
    # Qwen3-Next-80B-A3B's trunk.
    "B": ("qwen3_next", 16, "--hidden 2048 --layers 48 --top-k 10 --moe-inter 512 --shared-inter 512 --heads 16 "
                            "--kv-heads 2 --head-dim 256 --vocab 151936"),
}
SMALL = {
    "A": ("qwen3_moe", 16, "--hidden 256 --layers 4 --top-k 8 --moe-inter 128 --heads 4 --kv-heads 2 --head-dim 64 --vocab 4096"),
    "B": ("qwen3_next", 16, "--hidden 256 --layers 4 --top-k 10 --moe-inter 128 --shared-inter 128 --heads 4 "
                            "--kv-heads 2 --head-dim 64 --vocab 4096"),
}
STREAM_EXPERTS, POOL_PER_LAYER = 64, 16


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class GpuMemory:
    """Polls nvidia-smi's memory.used (MiB) and SM clock (MHz) from a thread while a run lasts
    (a query every ~100 ms; `-lms` output through a pipe is block-buffered and lost when it is
    stopped); peak memory minus the reading before the run, and the clock's timeline (a GPU
    that idled slows the first work after it)."""

    def __init__(self):
        self.ok = shutil.which("nvidia-smi") is not None
        self.peak_mib = None
        self.clocks = []

    @staticmethod
    def query():
        """(memory.used MiB, clocks.sm MHz), or None."""
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,clocks.sm", "--format=csv,noheader,nounits", "-i", "0"],
                               capture_output=True, text=True, timeout=10)
            if r.returncode or not r.stdout.strip():
                return None
            fields = [v.strip() for v in r.stdout.strip().splitlines()[0].split(",")]
            clock = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
            return int(fields[0]), clock
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def _poll(self):
        t0 = time.time()
        while not self.stop.is_set():
            v = self.query()
            if v is not None:
                self.vals.append(v[0])
                if v[1] is not None:
                    self.clocks.append((round(time.time() - t0, 2), v[1]))
            self.stop.wait(0.1)

    def __enter__(self):
        if self.ok:
            first = self.query()
            self.base = first[0] if first else None
            self.vals, self.stop = [], threading.Event()
            self.t = threading.Thread(target=self._poll, daemon=True)
            self.t.start()
        return self

    def __exit__(self, *exc):
        if self.ok:
            self.stop.set()
            self.t.join()
            if self.vals and self.base is not None:
                self.peak_mib = max(self.vals) - self.base


def run(cmd, tag, a, env=None, timeout=None):
    """Runs `cmd`; returns rc, stdout, stderr, wall, peak RSS (bytes, from rusage), peak GPU MiB."""
    outp, errp = os.path.join(a.results, f"{tag}.out"), os.path.join(a.results, f"{tag}.err")
    t0 = time.time()
    with open(outp, "w") as fo, open(errp, "w") as fe, GpuMemory() as gm:
        fe.write(" ".join(cmd) + "\n")
        fe.flush()
        try:
            p = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env, start_new_session=True)
        except OSError as e:
            log(f"  [{tag}] cannot start: {e}")
            return {"rc": 127, "stdout": "", "stderr": str(e), "wall_s": 0, "rss_bytes": None, "gpu_mib": None}
        killer = threading.Timer(timeout or a.timeout, lambda: os.killpg(p.pid, 9))
        killer.start()
        _, status, ru = os.wait4(p.pid, 0)
        killer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - t0
    r = {"rc": p.returncode, "stdout": open(outp).read(), "stderr": open(errp).read(), "wall_s": round(wall, 2),
         "rss_bytes": ru.ru_maxrss * 1024, "gpu_mib": gm.peak_mib,
         # CPU seconds the process spent (its threads, user and kernel), and times it was preempted.
         "cpu_s": round(ru.ru_utime + ru.ru_stime, 2), "preempted": ru.ru_nivcsw}
    if gm.clocks:
        # Seconds into the run and the SM clock then: where a first prompt ran slow, why.
        with open(os.path.join(a.results, f"{tag}.clocks.csv"), "w") as f:
            f.write("seconds,sm_mhz\n" + "".join(f"{t},{c}\n" for t, c in gm.clocks))
        r["sm_mhz"] = [min(c for _, c in gm.clocks), max(c for _, c in gm.clocks)]
    log(f"  [{tag}] rc={r['rc']} {wall:.1f} s, RSS {r['rss_bytes'] / 2**20:.0f} MiB, GPU {r['gpu_mib']} MiB")
    return r


def ours(a, model, backend, prompt, max_tokens, experts_per_layer, tag, env=None, wrap=(), extra=()):
    """One run of ours; `wrap` goes before the command (taskset -c CPUS, say), `extra` after it."""
    cmd = [*wrap, a.slotstream, "run", "--model", model, "--backend", backend, "--raw", "--ignore-eos",
           "--max-tokens", str(max_tokens), "--prompt", prompt, "--json", "--experts-per-layer", str(experts_per_layer), *extra]
    r = run(cmd, tag, a, env=env)
    label = f"'<{a.depth}-token prompt>'" if getattr(a, "depth", None) else repr(prompt)
    shown = [label if c == prompt else c for c in cmd]
    res = {"cmd": " ".join(shown), "rss_bytes": r["rss_bytes"], "cpu_s": r.get("cpu_s"), "preempted": r.get("preempted"),
           "gpu_mib": r["gpu_mib"], "wall_s": r["wall_s"], "sm_mhz": r.get("sm_mhz")}
    try:
        o = json.loads(r["stdout"].strip().splitlines()[-1])
        s, e = o["stats"], o["experts"]
        res.update(backend_name=o["backend"], prompt_tokens=s["prompt_tokens"], generated=s["generated_tokens"],
                   prefill=s["prefill_tokens_per_second"], decode=s["decode_tokens_per_second"],
                   prefill_s=s["prefill_seconds"], decode_s=s["decode_seconds"], slots=e["slots"],
                   pool_bytes=e["pool_bytes"], direct_io=e["direct_io"], counters=e["total"],
                   ids=o["generated_ids"], device_memory=o.get("device_memory"))
        passes = max(1, s["generated_tokens"] - 1)
        d = s.get("decode_experts")
        if d and d.get("misses"):
            res["decode_hit_rate"] = d["hits"] / (d["hits"] + d["misses"])
            # What a decoded token costs besides waiting on its expert reads.
            res["beside_reads_ms"] = 1e3 * (s["decode_seconds"] - d["wait_seconds"]) / passes
            res["wait_ms"] = 1e3 * d["wait_seconds"] / passes
            # Of which writing the experts read into their slots.
            res["write_ms"] = 1e3 * d.get("write_seconds", 0.0) / passes
            # Between one MoE layer's last read landing and the next layer's reads
            # going out: the call's tail (writes, table, CPU compute), then the
            # lead to the next call's reads (compute, GPU read-back).
            res["tail_ms"] = 1e3 * d.get("tail_seconds", 0.0) / passes
            res["lead_ms"] = 1e3 * d.get("lead_seconds", 0.0) / passes
            # What was read from disk per decoded token (guesses included).
            res["decode_mb_per_token"] = d.get("bytes_read", 0) / 1e6 / passes
            # How long no expert read was in flight: the disk left idle.
            if "disk_busy_seconds" in d:
                res["disk_idle_ms"] = 1e3 * max(0.0, s["decode_seconds"] - d["disk_busy_seconds"]) / passes
                if d["disk_busy_seconds"] > 0 and d.get("bytes_read"):
                    # The disk's rate while this run's reads were in flight; it
                    # drifts by tens of percent within minutes on a shared host.
                    res["busy_read_gbs"] = d["bytes_read"] / 1e9 / d["disk_busy_seconds"]
                    res["decode_per_busy_gbs"] = s["decode_tokens_per_second"] / res["busy_read_gbs"]
                if d["disk_busy_seconds"] > 0 and d.get("disk_reads"):
                    # Reads in flight on average while any was, and a read's mean
                    # time: a shallow queue and slow reads look alike in the rate.
                    res["reads_in_flight"] = d["disk_read_seconds"] / d["disk_busy_seconds"]
                    res["ms_per_read"] = 1e3 * d["disk_read_seconds"] / d["disk_reads"]
    except Exception as ex:  # noqa: BLE001
        res["error"] = f"{type(ex).__name__}: {ex}; rc={r['rc']}; {r['stderr'][-600:]}"
        log("  " + res["error"])
    return res


def llama_env(a):
    return dict(os.environ, LD_LIBRARY_PATH=os.path.join(a.llama, "bin") + ":" + os.environ.get("LD_LIBRARY_PATH", ""))


def peer(a, gguf, tag):
    cmd = [os.path.join(a.llama, "bin", "llama-bench"), "-m", gguf, "-ngl", "99", "-p", "256", "-n", str(a.decode),
           "-d", f"0,{a.depth}", "-r", str(a.peer_reps), "-o", "json"]
    r = run(cmd, tag, a, env=llama_env(a))
    res = {"cmd": " ".join(["llama-bench"] + cmd[1:2] + [os.path.basename(gguf)] + cmd[3:]),
           "rss_bytes": r["rss_bytes"], "gpu_mib": r["gpu_mib"], "wall_s": r["wall_s"], "sm_mhz": r.get("sm_mhz")}
    try:
        text = r["stdout"][r["stdout"].index("["):]
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:
            # Stopped part way (a crash): keep the tests it finished.
            rows = json.loads(text[:text.rindex("}") + 1] + "]")
            res["partial"] = f"llama-bench rc={r['rc']} after {len(rows)} tests"
            log(f"  {res['partial']}")
        for row in rows:
            d = row.get("n_depth", 0)
            kind = "prefill" if row["n_prompt"] and not row["n_gen"] else "decode"
            key = kind if d == a.depth else f"{kind}_d{d}"
            res[key] = row["avg_ts"]
            res[key + "_sd"] = row["stddev_ts"]
        first = rows[0]
        res.update(gpu_info=first.get("gpu_info"), backends=first.get("backends"), build=first.get("build_commit"),
                   flash_attn=first.get("flash_attn"), n_threads=first.get("n_threads"),
                   model_size=first.get("model_size"), model_n_params=first.get("model_n_params"))
        m = re.search(r"ggml_vulkan: 0 = (.*)", r["stderr"])
        if m:
            res["vulkan_device"] = m.group(1).strip()
    except Exception as ex:  # noqa: BLE001
        res["error"] = f"{type(ex).__name__}: {ex}; rc={r['rc']}; {r['stderr'][-600:]}"
        log("  " + res["error"])
    return res


def first_prompts(a, model, gguf, prompt, n_prompt, pool, name):
    """What a user waits for on a first prompt: both engines in fresh processes on a GPU left
    idle for --idle seconds, alternating, --first-rounds each. Theirs: llama-bench without its
    warmup run (-p N -n 0 -r 1 --no-warmup); ours: `run --max-tokens 1` (its prefill rate)."""
    theirs, mine = [], []
    cmd = [os.path.join(a.llama, "bin", "llama-bench"), "-m", gguf, "-ngl", "99", "-p", str(n_prompt), "-n", "0",
           "-r", "1", "--no-warmup", "-o", "json"]
    for i in range(a.first_rounds):
        time.sleep(a.idle)
        r = run(cmd, f"{name}_llama_first_{i}", a, env=llama_env(a))
        try:
            theirs.append(json.loads(r["stdout"][r["stdout"].index("["):])[0]["avg_ts"])
        except (ValueError, KeyError, IndexError) as ex:
            log(f"  llama-bench first prompt: {type(ex).__name__}: {ex}; rc={r['rc']}")
        time.sleep(a.idle)
        o = ours(a, model, a.gpu_backend, prompt, 1, pool, f"{name}_ours_first_{i}")
        if o.get("prefill"):
            mine.append(o["prefill"])
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    return {"ours": med(mine), "theirs": med(theirs), "ours_runs": mine, "theirs_runs": theirs}


def disk_read_gbs(paths, total_bytes=2 << 30, chunk=4 << 20, threads=16):
    """O_DIRECT read rate (GB/s) over the model's files, `threads` reads of `chunk` in flight."""
    jobs = []
    for p in paths:
        size = os.path.getsize(p) // chunk * chunk
        jobs += [(p, off) for off in range(0, size, chunk)]
    jobs = jobs[: max(1, total_bytes // chunk)]
    if not jobs:
        return None
    local = threading.local()

    def read(job):
        p, off = job
        if not hasattr(local, "buf"):
            local.buf = mmap.mmap(-1, chunk)
            local.fds = {}
        fd = local.fds.get(p)
        if fd is None:
            fd = local.fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
        return os.preadv(fd, [local.buf], off)

    try:
        t0 = time.time()
        with ThreadPoolExecutor(threads) as ex:
            n = sum(ex.map(read, jobs))
        return n / (time.time() - t0) / 1e9
    except OSError as e:
        log(f"  disk read test failed: {e}")
        return None


def calibrate_prompt(a, target):
    """A prefix of a repository text that our tokenizer encodes to `target` tokens (every
    synthetic model has the same tokenizer), found with a tiny model on the CPU backend."""
    text = ""
    for f in ["ARCHITECTURE.md", "README.md", "BENCHMARKS.md"]:
        text += open(os.path.join(REPO, f), encoding="utf-8").read() + "\n"
    tiny = os.path.join(a.work, "calibrate")
    if not os.path.exists(os.path.join(tiny, "config.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "synth.py"), "--out", tiny, "--hidden", "64",
                        "--layers", "1", "--experts", "4", "--top-k", "2", "--moe-inter", "64", "--heads", "2",
                        "--kv-heads", "1", "--head-dim", "32", "--vocab", "4096"], check=True, capture_output=True)
        # Room for the longest prompts the search tries.
        cfg_path = os.path.join(tiny, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["max_position_embeddings"] = 1 << 20
        json.dump(cfg, open(cfg_path, "w"), indent=1)

    def count(n):
        r = subprocess.run([a.slotstream, "run", "--model", tiny, "--backend", "cpu", "--raw", "--max-tokens", "1",
                            "--plan-context", str(1 << 20), "--prompt", text[:n], "--json"], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"calibration run failed: {r.stderr[-800:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])["stats"]["prompt_tokens"]

    lo, hi = 1, min(len(text), 4 * target)
    while count(hi) < target:
        if hi >= len(text):
            sys.exit(f"the calibration text has fewer than {target} tokens")
        lo, hi = hi, min(len(text), 2 * hi)
    while lo < hi:  # smallest prefix with >= target tokens
        mid = (lo + hi) // 2
        if count(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    n = count(lo)
    log(f"prompt: {lo} characters -> {n} tokens")
    return text[:lo], n


def model_files(d):
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


def make_model(a, key, family, experts, args, streaming):
    name = f"{key}{'64' if streaming else ''}"
    out = os.path.join(a.work, name)
    cmd = [sys.executable, os.path.join(REPO, "tools", "synth.py"), "--family", family, "--out", out,
           "--experts", str(experts), "--bits", "4", "--group", "64", "--symmetric", "--jobs", str(a.jobs),
           "--seed", "1"] + args.split()
    cmd += ["--mixer-out-scale", str(a.mixer_out_scale), "--router-skew", str(a.router_skew)]
    stamp = os.path.join(out, "synth-args.txt")
    t = {}
    if not (os.path.exists(stamp) and open(stamp).read() == " ".join(cmd[2:])):
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"synth failed: {r.stderr[-2000:]}")
        open(stamp, "w").write(" ".join(cmd[2:]))
        if streaming:
            os.sync()  # our expert reads use O_DIRECT: no dirty pages left for them to wait on
        t["synth_s"] = round(time.time() - t0, 1)
        log(f"  synth {name}: {t['synth_s']} s, {json.loads(r.stdout.strip().splitlines()[-1])['total_bytes'] / 1e9:.2f} GB")
    return name, out, t


def make_gguf(a, name, model):
    gguf = os.path.join(a.work, f"{name}-Q4_0.gguf")
    stamp = gguf + ".from"
    src = open(os.path.join(model, "synth-args.txt")).read()
    if os.path.exists(gguf) and os.path.exists(stamp) and open(stamp).read() == src:
        return gguf, {}
    t0 = time.time()
    r = subprocess.run([sys.executable, os.path.join(HERE, "to_gguf.py"), "--model", model, "--out", gguf,
                        "--outtype", "q4_0", "--jobs", str(a.jobs), "--gguf-py", os.path.join(a.llama, "gguf-py")],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"to_gguf failed: {r.stderr[-2000:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    if info.get("requantized_tensors"):
        log(f"  warning: {info['requantized_tensors']} tensors requantized, not repacked")
    open(stamp, "w").write(src)
    t = {"convert_s": round(time.time() - t0, 1)}
    log(f"  gguf {name}: {t['convert_s']} s, {info['bytes'] / 1e9:.2f} GB")
    return gguf, t


def median(rs, key):
    v = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(v) if v else None


def subtract(full, pre):
    f, p = full.get("counters"), pre.get("counters")
    if not f or not p:
        return {}
    d = {k: f[k] - p[k] for k in ("hits", "misses", "bytes_read", "read_seconds", "wait_seconds")}
    passes = max(1, full["generated"] - 1)
    n = d["hits"] + d["misses"]
    return {"decode_hit_rate": d["hits"] / n if n else None, "decode_bytes_per_token": d["bytes_read"] / passes,
            "decode_read_gbs": d["bytes_read"] / d["read_seconds"] / 1e9 if d["read_seconds"] > 0 else None,
            "total_hit_rate": f["hits"] / max(1, f["hits"] + f["misses"])}


def bench_model(a, key, streaming, prompt):
    family, experts, args = (SMALL if a.small else FULL)[key]
    if streaming:
        experts = STREAM_EXPERTS
    name, model, times = make_model(a, key, family, experts, args, streaming)
    res = {"key": name, "family": family, "experts": experts, "streaming": streaming, "synth_args": args, **times}
    pool = POOL_PER_LAYER if streaming else experts
    res["pool_per_layer"] = pool
    gguf, peers = None, []
    if not streaming or a.peer_streaming:
        gguf, t = make_gguf(a, name, model)
        res.update(t)
        peers.append(peer(a, gguf, f"{name}_llama"))
        if not streaming and a.first_rounds > 0:
            res["first_prompt"] = first_prompts(a, model, gguf, prompt, a.n_prompt, pool, name)
    cpu_too = a.cpu == "all" or (a.cpu == "streaming" and streaming)
    gpu, cpu = [], []
    for i in range(a.rounds):
        # Further llama-bench runs alternate with ours: its speed moves with
        # how long the machine has been busy, by more than the engines differ.
        if gguf and 0 < i < a.peer_rounds:
            peers.append(peer(a, gguf, f"{name}_llama_{i}"))
        # Streamed, both backends wait on the disk, whose speed drifts: their
        # runs alternate, which goes first alternates too, and each side's
        # median is compared (also per GB/s of the disk's rate in each run).
        cpu_now = cpu_too and (streaming or i == 0)
        if cpu_now and streaming and i % 2 == 1:
            cpu.append(ours(a, model, "cpu", prompt, a.decode + 1, pool, f"{name}_ours_cpu_{i}"))
            cpu_now = False
        gpu.append(ours(a, model, a.gpu_backend, prompt, a.decode + 1, pool, f"{name}_ours_gpu_{i}"))
        if cpu_now:
            cpu.append(ours(a, model, "cpu", prompt, a.decode + 1, pool, f"{name}_ours_cpu_{i}"))
    if gguf and not a.keep:
        os.remove(gguf)
    if peers:
        # The run with the median decode speaks for the peer (its other
        # figures with it); every run's decode is kept.
        ok = sorted((p for p in peers if p.get("decode") is not None), key=lambda p: p["decode"])
        res["peer"] = ok[len(ok) // 2] if ok else peers[0]
        res["peer_decode_runs"] = [p.get("decode") for p in peers]
    res["ours_gpu_runs"] = gpu
    res["ours_gpu"] = {"prefill": median(gpu, "prefill"), "decode": median(gpu, "decode"),
                       "rss_bytes": max((r["rss_bytes"] for r in gpu if r.get("rss_bytes")), default=None),
                       "gpu_mib": max((r["gpu_mib"] for r in gpu if r["gpu_mib"] is not None), default=None),
                       "backend_name": next((r.get("backend_name") for r in gpu if r.get("backend_name")), None),
                       "prompt_tokens": gpu[0].get("prompt_tokens"),
                       "beside_reads_ms": median(gpu, "beside_reads_ms"), "wait_ms": median(gpu, "wait_ms"),
                       "write_ms": median(gpu, "write_ms"), "disk_idle_ms": median(gpu, "disk_idle_ms"),
                       "tail_ms": median(gpu, "tail_ms"), "lead_ms": median(gpu, "lead_ms"),
                       "busy_read_gbs": median(gpu, "busy_read_gbs"), "decode_per_busy_gbs": median(gpu, "decode_per_busy_gbs"),
                       "reads_in_flight": median(gpu, "reads_in_flight"), "ms_per_read": median(gpu, "ms_per_read")}
    if streaming:
        pre = ours(a, model, a.gpu_backend, prompt, 1, pool, f"{name}_ours_gpu_prefill_only")
        res["ours_gpu"].update(subtract(gpu[-1], pre))
        res["disk_read_gbs"] = disk_read_gbs(model_files(model))
        bpt = res["ours_gpu"].get("decode_bytes_per_token")
        if res["disk_read_gbs"] and bpt:
            res["disk_limit_tps"] = res["disk_read_gbs"] * 1e9 / bpt
    if cpu:
        res["ours_cpu_runs"] = cpu
        res["ours_cpu"] = {k: median(cpu, k) for k in ("prefill", "decode", "beside_reads_ms", "wait_ms", "write_ms", "disk_idle_ms", "tail_ms", "lead_ms",
                                                       "busy_read_gbs", "decode_per_busy_gbs", "reads_in_flight", "ms_per_read")}
        res["ours_cpu"].update(rss_bytes=max((c["rss_bytes"] for c in cpu if c.get("rss_bytes")), default=None),
                               backend_name=next((c["backend_name"] for c in cpu if c.get("backend_name")), None),
                               error=next((c["error"] for c in cpu if c.get("error")), None))
        c = cpu[-1]
        if streaming and c.get("counters"):
            res["ours_cpu"]["total_hit_rate"] = c["counters"]["hits"] / max(1, c["counters"]["hits"] + c["counters"]["misses"])
    if not a.keep:
        shutil.rmtree(model, ignore_errors=True)
    return res


def model_args(ap):
    """The options of the scripts that build this file's models (make_model) and run ours on them."""
    ap.add_argument("--gpu-backend", default="wgpu")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--router-skew", type=float, default=0.4)
    ap.add_argument("--mixer-out-scale", type=float, default=0.1)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)


def positive(v):
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{v}: needs at least 1")
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slotstream", required=True)
    ap.add_argument("--llama", required=True, help="unpacked llama.cpp tarball (bin/, gguf-py/)")
    ap.add_argument("--work", required=True, help="where models are written")
    ap.add_argument("--results", required=True)
    ap.add_argument("--models", default="A,B,A64,B64")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--peer-reps", type=int, default=3)
    ap.add_argument("--peer-rounds", type=positive, default=1,
                    help="llama-bench runs per resident model, alternating with ours (at most --rounds)")
    ap.add_argument("--depth", type=int, default=432)
    ap.add_argument("--decode", type=positive, default=64)
    ap.add_argument("--gpu-backend", default="wgpu")
    ap.add_argument("--cpu", choices=["all", "streaming", "none"], default="all")
    ap.add_argument("--peer-streaming", action="store_true", help="also llama.cpp on the 64-expert models (all resident)")
    ap.add_argument("--router-skew", type=float, default=0.4)
    ap.add_argument("--mixer-out-scale", type=float, default=0.1)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--keep", action="store_true", help="keep models and GGUFs (default: delete after each model)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--first-rounds", type=int, default=2, help="first-prompt runs of each engine per resident model (0: none)")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds the GPU idles before each first-prompt run")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    t_start = time.time()
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.results, exist_ok=True)
    gpu, driver = "unknown", "unknown"
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True)
        if r.returncode == 0 and "," in r.stdout:
            gpu, driver = [x.strip() for x in r.stdout.strip().split(",", 1)]
    prompt, n_prompt = calibrate_prompt(a, a.depth)
    a.n_prompt = n_prompt
    results = []
    for key in [k.strip() for k in a.models.split(",") if k.strip()]:
        base, streaming = key.rstrip("64") or key, key.endswith("64")
        if base not in FULL:
            sys.exit(f"unknown model {key} (A, B, A64, B64)")
        log(f"== {key}")
        results.append(bench_model(a, base, streaming, prompt))
        json.dump(results, open(os.path.join(a.results, "results.json"), "w"), indent=1, default=str)
    peers = [r["peer"] for r in results if r.get("peer") and not r["peer"].get("error")]
    ours_name = next((r["ours_gpu"]["backend_name"] for r in results if r["ours_gpu"].get("backend_name")), "?")
    if gpu == "unknown":
        m = re.search(r"\((.*?),", ours_name)
        gpu = m.group(1) if m else "?"
    meta = {"commit": a.commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu, "driver": driver,
            "cpus": os.cpu_count(), "ours_backend": ours_name,
            "peer_build": f"build {peers[0].get('build')}, {peers[0].get('backends')}, flash_attn {peers[0].get('flash_attn')}" if peers else "not run",
            "peer_device": peers[0].get("vulkan_device") or peers[0].get("gpu_info") if peers else "—",
            "prompt_tokens": n_prompt, "elapsed_s": time.time() - t_start}
    md = table(a, meta, results)
    json.dump({"meta": meta, "results": results}, open(os.path.join(a.results, "results.json"), "w"), indent=1, default=str)
    open(os.path.join(a.results, "table.md"), "w").write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
