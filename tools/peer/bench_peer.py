#!/usr/bin/env python3
"""Side-by-side runs of slotstream and llama.cpp (issue 8, items 3-5); prints one table.

Driven by tools/bench_peer.sh, which builds both engines and writes the models.
Runs alternate (ours, peer, ours, peer, ...) so that load from other work on the
machine falls on both sides alike.

  (a) model resident, CPU, 2 threads: prefill and decode tok/s, peak RSS.
      ours: `slotstream run` with a ~512-token prompt and 128 generated tokens, every
      expert resident (--experts-per-layer = experts);
      peer: `llama-bench -p 512 -n 128 -d 0,P -t 2` (its defaults: mmap, CPU weight
      repacking), P = our prompt's token count: prefill is read at depth 0 and
      decode at depth P, so both sides decode against the same KV cache length
      (decode at depth 0 is reported beside it as decode_at_0).
  (b) model ~3x larger than a cgroup v1 memory limit that holds both processes:
      ours: `--memory-gb` at the limit (expert slots streamed with O_DIRECT);
      peer: `llama-bench -p 0 -n N -t 2 --repack 0 -lm mmap` (weights stay in the
      mmapped file, so the kernel pages them in and out under the limit).
      The model files are evicted from the page cache (posix_fadvise DONTNEED)
      before each run, so neither side starts with pages charged elsewhere.
  (depth, with --depth D) model a resident, CPU, 2 threads, at a long context:
      ours: `slotstream run --backend cpu` with a ~D-token prompt (calibrated with our
      tokenizer) and --depth-tokens generated (default 32), `--plan-context` D plus room;
      peer: `llama-bench -p 0 -n 32 -d P` (decode of 32 tokens after P tokens of
      context, P = our prompt's token count) and `llama-bench -p P -n 0` (prefill of
      P tokens from an empty context), the same threads; each with llama.cpp's
      default flash attention (on) and with `-fa 0`.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

CG_ROOT = "/sys/fs/cgroup/memory"


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, **kw)


def evict(paths):
    for p in paths:
        files = [os.path.join(p, f) for f in os.listdir(p)] if os.path.isdir(p) else [p]
        for f in files:
            if os.path.isfile(f):
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def time_v(path):
    """Max RSS (bytes) and exit info from /usr/bin/time -v output."""
    txt = open(path).read() if os.path.exists(path) else ""
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", txt)
    sig = re.search(r"Command terminated by signal (\d+)", txt)
    st = re.search(r"Exit status: (\d+)", txt)
    return (int(m.group(1)) * 1024 if m else None,
            f"signal {sig.group(1)}" if sig else (int(st.group(1)) if st else None))


class Cgroup:
    def __init__(self, name, limit_bytes):
        self.path = os.path.join(CG_ROOT, name)
        os.makedirs(self.path, exist_ok=True)
        # echo, not a Python write: a Python print redirect wrote 0 on this machine.
        for f, v in [("memory.limit_in_bytes", limit_bytes)]:
            r = sh(f"echo {v} > {self.path}/{f}")
            if r.returncode:
                sys.exit(f"cgroup {f}: {r.stderr}")
        self.limit = int(open(f"{self.path}/memory.limit_in_bytes").read())
        if abs(self.limit - limit_bytes) > 4096:
            sys.exit(f"cgroup limit reads {self.limit}, wanted {limit_bytes}")

    def reset(self):
        sh(f"echo 0 > {self.path}/memory.max_usage_in_bytes")
        sh(f"echo 0 > {self.path}/memory.failcnt")

    def stats(self):
        rd = lambda f: int(open(f"{self.path}/{f}").read())
        return {"cg_max_usage": rd("memory.max_usage_in_bytes"), "cg_failcnt": rd("memory.failcnt")}

    def wrap(self, cmd):
        # The shell joins the cgroup, then becomes the engine (exec): only the engine
        # and its threads are inside; /usr/bin/time stays outside and reads its rusage.
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"] + cmd


def run_timed(cmd, tag, outdir, timeout, stdin=None):
    tv = os.path.join(outdir, f"{tag}.time")
    t0 = time.time()
    # Own process group, so that a timeout stops the engine too, not only /usr/bin/time.
    pr = subprocess.Popen(["/usr/bin/time", "-v", "-o", tv] + cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                          text=True, errors="replace", start_new_session=True)
    try:
        out, err = pr.communicate(input=stdin, timeout=timeout)
        rc = pr.returncode
    except subprocess.TimeoutExpired:
        os.killpg(pr.pid, 15)
        out, err = pr.communicate()
        rc = "timeout"
    wall = time.time() - t0
    with open(os.path.join(outdir, f"{tag}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n--- stdout\n" + out + "\n--- stderr\n" + err)
    rss, status = time_v(tv)
    return {"rc": rc, "stdout": out, "stderr": err, "wall_s": wall, "max_rss": rss, "status": status}


def ours(a, model, prompt, max_tokens, mem_args, cg=None, tag="ours"):
    # The prompt goes in on stdin: a long one would pass the argument-size limit.
    cmd = [a.slotstream, "run", "--model", model, "--raw", "--ignore-eos", "--max-tokens", str(max_tokens),
           "--prompt", "-", "--json", "--threads", str(a.threads)] + mem_args
    if cg:
        cmd = cg.wrap(cmd)
    r = run_timed(cmd, tag, a.outdir, a.timeout, stdin=prompt)
    res = {"engine": "slotstream", "cmd": cmd, "max_rss": r["max_rss"], "status": r["status"], "wall_s": r["wall_s"]}
    try:
        o = json.loads(r["stdout"].strip().splitlines()[-1])
        s, e = o["stats"], o["experts"]["total"]
        res.update(prompt_tokens=s["prompt_tokens"], gen_tokens=s["generated_tokens"],
                   prefill=s["prefill_tokens_per_second"], decode=s["decode_tokens_per_second"],
                   peak_rss_self=o.get("peak_rss_bytes"), slots=o["experts"]["slots"],
                   hit=e["hits"] / max(1, e["hits"] + e["misses"]), read_gb=e["bytes_read"] / 1e9)
    except Exception as ex:  # noqa: BLE001
        res["error"] = f"{ex}: rc={r['rc']} {r['stderr'][-400:]}"
    return res


def peer(a, gguf, p, n, extra, cg=None, tag="peer", timeout=None, decode_depth=0):
    """llama-bench: prefill of `p` tokens from an empty context; decode of `n`
    tokens after `decode_depth` tokens of context (llama-bench's `-d`), so that
    it reads the same KV cache as our decode after a `decode_depth`-token prompt."""
    if decode_depth:
        extra = extra + ["-d", f"0,{decode_depth}"]
    cmd = [os.path.join(a.llama_bin, "llama-bench"), "-m", gguf, "-p", str(p), "-n", str(n),
           "-t", str(a.threads), "-o", "json"] + extra
    if cg:
        cmd = cg.wrap(cmd)
    r = run_timed(cmd, tag, a.outdir, timeout or a.timeout)
    if r["rc"] == "timeout":
        r["status"] = f"stopped after {timeout or a.timeout} s"
    res = {"engine": "llama.cpp", "cmd": cmd, "max_rss": r["max_rss"], "status": r["status"], "wall_s": r["wall_s"]}
    try:
        rows = json.loads(r["stdout"][r["stdout"].index("["):])
        for row in rows:
            depth = row.get("n_depth", 0)
            if row["n_prompt"] and not row["n_gen"] and depth == 0:
                res.update(prefill=row["avg_ts"], prefill_sd=row["stddev_ts"], prompt_tokens=row["n_prompt"])
            if row["n_gen"] and not row["n_prompt"] and depth == decode_depth:
                res.update(decode=row["avg_ts"], decode_sd=row["stddev_ts"], gen_tokens=row["n_gen"], decode_depth=depth)
            if row["n_gen"] and not row["n_prompt"] and depth == 0 and decode_depth:
                res.update(decode_at_0=row["avg_ts"])
    except Exception as ex:  # noqa: BLE001
        if r["status"] in (0, None):
            res["error"] = f"{ex}: rc={r['rc']} {r['stderr'][-400:]}"
    return res


def peer_completion(a, gguf, prompt, n, extra, cg=None, tag="peer_completion"):
    """llama-completion, greedy, the same prompt text as ours: the same token stream
    (llama-bench's tg feeds random token ids, which route differently)."""
    cmd = [os.path.join(a.llama_bin, "llama-completion"), "-m", gguf, "-p", prompt, "-n", str(n),
           "--temp", "0", "--ignore-eos", "-no-cnv", "-t", str(a.threads), "-c", "512"] + extra
    if cg:
        cmd = cg.wrap(cmd)
    r = run_timed(cmd, tag, a.outdir, a.timeout)
    res = {"engine": "llama.cpp (completion)", "cmd": cmd, "max_rss": r["max_rss"], "status": r["status"], "wall_s": r["wall_s"]}
    pe = re.search(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens.*?([\d.]+) tokens per second", r["stderr"])
    ev = re.search(r"\beval time =\s*[\d.]+ ms /\s*(\d+) runs.*?([\d.]+) tokens per second", r["stderr"])
    if pe:
        res.update(prompt_tokens=int(pe.group(1)), prefill=float(pe.group(2)))
    if ev:
        res.update(gen_tokens=int(ev.group(1)), decode=float(ev.group(2)))
    if not ev and r["status"] in (0, None):
        res["error"] = f"no timings: rc={r['rc']} {r['stderr'][-400:]}"
    return res


def fmt(x, nd=1):
    return "—" if x is None else f"{x:.{nd}f}"


def gb(x):
    return "—" if not x else f"{x / 2**20:.0f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slotstream", required=True)
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--model-a", required=True)
    ap.add_argument("--gguf-a", required=True)
    ap.add_argument("--model-b", required=True)
    ap.add_argument("--gguf-b", required=True)
    ap.add_argument("--experts-a", type=int, required=True)
    ap.add_argument("--model-next", default=None, help="optional qwen3_next model for a second resident comparison")
    ap.add_argument("--gguf-next", default=None)
    ap.add_argument("--experts-next", type=int, default=0)
    ap.add_argument("--limit-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-file", required=True)
    ap.add_argument("--b-tokens", type=int, default=32)
    ap.add_argument("--b-peer-tokens", type=int, default=16)
    ap.add_argument("--b-experts-per-layer", type=int, default=0, help="also run ours with this pool (0: skip)")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--outdir", default="/tmp/slotstream-peer/bench")
    ap.add_argument("--skip", default="", help="comma list of a,next,b to skip")
    ap.add_argument("--depth", type=int, default=0, help="also compare decode at this depth on model a (0: skip)")
    ap.add_argument("--depth-tokens", type=int, default=32, help="tokens decoded at --depth")
    ap.add_argument("--depth-prefill", type=int, default=1, help="also time the peer's prefill of the depth prompt (0: no)")
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    results = []

    def resident(label, model, gguf, experts):
        # Calibrate a ~512-token prompt for our tokenizer (llama-bench uses 512 tokens).
        text = open(a.prompt_file, encoding="utf-8").read()
        cal = ours(a, model, text[:2000], 1, ["--experts-per-layer", str(experts)], tag=f"{label}_calibrate")
        prompt = text[:int(2000 * 512 / cal["prompt_tokens"])]
        for rnd in range(a.rounds):
            o = ours(a, model, prompt, 128, ["--experts-per-layer", str(experts)], tag=f"{label}_ours_{rnd}")
            results.append((label, rnd, o))
            print(json.dumps({k: v for k, v in o.items() if k != "cmd"}), flush=True)
            depth = o.get("prompt_tokens", 512)
            p = peer(a, gguf, 512, 128, ["-r", "3"], tag=f"{label}_peer_{rnd}", decode_depth=depth)
            results.append((label, rnd, p))
            print(json.dumps({k: v for k, v in p.items() if k != "cmd"}), flush=True)
            # How much of llama.cpp's speed is its CPU weight repacking (Q4_0 -> interleaved rows).
            p = peer(a, gguf, 512, 128, ["-r", "3", "--repack", "0"], tag=f"{label}_peer_norepack_{rnd}", decode_depth=depth)
            results.append((f"{label} no-repack", rnd, p))
            print(json.dumps({k: v for k, v in p.items() if k != "cmd"}), flush=True)

    def at_depth(label, model, gguf, experts):
        text = open(a.prompt_file, encoding="utf-8").read()
        # Calibrate on a prefix of a quarter of the depth (~2 characters a token).
        probe = text[:a.depth // 2]
        cal = ours(a, model, probe, 1, ["--experts-per-layer", str(experts), "--backend", "cpu"], tag=f"{label}_depth_calibrate")
        if "error" in cal:
            sys.exit(f"calibration failed: {cal['error']}")
        prompt = text[:int(len(probe) * a.depth / cal["prompt_tokens"])]
        plan = ["--experts-per-layer", str(experts), "--backend", "cpu",
                "--plan-context", str(a.depth * 9 // 8 + a.depth_tokens)]
        label = f"{label} @ depth"
        for rnd in range(a.rounds):
            o = ours(a, model, prompt, a.depth_tokens, plan, tag=f"depth_ours_{rnd}")
            results.append((label, rnd, o))
            print(json.dumps({k: v for k, v in o.items() if k != "cmd"}), flush=True)
            depth = o.get("prompt_tokens", a.depth)
            # Decode of depth_tokens after `depth` tokens of context (and from an empty one),
            # with llama.cpp's default (flash attention: on for the CPU) and without it
            # (-fa 0: faster here at depth, so the fairer bar).
            for fa in ("default", "0"):
                extra = ["-r", "3"] + ([] if fa == "default" else ["-fa", fa])
                p = peer(a, gguf, 0, a.depth_tokens, extra, tag=f"depth_peer_fa{fa}_{rnd}", decode_depth=depth)
                p["engine"] = "llama.cpp" + ("" if fa == "default" else f" -fa {fa}")
                if a.depth_prefill:
                    pp = peer(a, gguf, depth, 0, ["-r", "1"] + extra[2:], tag=f"depth_peer_pp_fa{fa}_{rnd}")
                    p.update({k: pp[k] for k in ("prefill", "prompt_tokens") if k in pp})
                    if "error" in pp:
                        p["error"] = "prefill: " + pp["error"]
                results.append((label, rnd, p))
                print(json.dumps({k: v for k, v in p.items() if k != "cmd"}), flush=True)

    if "a" not in skip:
        resident("a", a.model_a, a.gguf_a, a.experts_a)
    if "next" not in skip and a.model_next:
        resident("a qwen3_next", a.model_next, a.gguf_next, a.experts_next)

    if a.depth:
        at_depth("a", a.model_a, a.gguf_a, a.experts_a)

    if "b" not in skip:
        limit = a.limit_mib * 2**20
        cg = Cgroup("slotstream-peer-b", limit)
        prompt_b = "The quick brown fox jumps over the lazy dog. " * 2
        for rnd in range(a.rounds):
            evict([a.model_b, a.gguf_b])
            cg.reset()
            o = ours(a, a.model_b, prompt_b, a.b_tokens, ["--memory-gb", f"{limit / 1e9:.3f}", "--plan-context", "512"], cg=cg, tag=f"b_ours_{rnd}")
            o.update(cg.stats())
            results.append(("b", rnd, o))
            print(json.dumps({k: v for k, v in o.items() if k != "cmd"}), flush=True)
            evict([a.model_b, a.gguf_b])
            cg.reset()
            p = peer_completion(a, a.gguf_b, prompt_b, a.b_tokens, ["-nr", "-lm", "mmap", "--no-warmup"], cg=cg, tag=f"b_peer_completion_{rnd}")
            p.update(cg.stats())
            results.append(("b", rnd, p))
            print(json.dumps({k: v for k, v in p.items() if k != "cmd"}), flush=True)
            if a.b_experts_per_layer:
                # The planner reserves 400 MB for the runtime; a pool sized by hand shows
                # what the same limit allows when that reserve is closer to the real use.
                evict([a.model_b, a.gguf_b])
                cg.reset()
                o = ours(a, a.model_b, prompt_b, a.b_tokens, ["--experts-per-layer", str(a.b_experts_per_layer)], cg=cg, tag=f"b_ours_epl_{rnd}")
                o.update(cg.stats())
                results.append((f"b, --experts-per-layer {a.b_experts_per_layer}", rnd, o))
                print(json.dumps({k: v for k, v in o.items() if k != "cmd"}), flush=True)
            evict([a.model_b, a.gguf_b])
            cg.reset()
            p = peer(a, a.gguf_b, 0, a.b_peer_tokens, ["-r", "1", "--repack", "0", "-lm", "mmap"], cg=cg, tag=f"b_peer_{rnd}")
            p.update(cg.stats())
            results.append(("b, llama-bench tg (random token ids)", rnd, p))
            print(json.dumps({k: v for k, v in p.items() if k != "cmd"}), flush=True)
        # Once: llama.cpp with its default weight repacking (anonymous copies) under the same limit.
        evict([a.gguf_b])
        cg.reset()
        p = peer(a, a.gguf_b, 0, a.b_peer_tokens, ["-r", "1"], cg=cg, tag="b_peer_repack", timeout=180)
        p.update(cg.stats())
        results.append(("b-repack", 0, p))
        print(json.dumps({k: v for k, v in p.items() if k != "cmd"}), flush=True)

    json.dump([(s, r, {k: v for k, v in x.items()}) for s, r, x in results],
              open(os.path.join(a.outdir, "results.json"), "w"), indent=1)

    print()
    print("| run | round | engine | prompt tok | prefill tok/s | gen tok | decode tok/s | peak RSS (time -v) | cgroup max usage | notes |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for s, rnd, x in results:
        notes = []
        if "slots" in x:
            notes.append(f"{x['slots']} slots, hit {100 * x['hit']:.0f}%, read {x['read_gb']:.2f} GB, self-reported peak RSS {gb(x.get('peak_rss_self'))}")
        if "decode_sd" in x:
            notes.append(f"±{x['decode_sd']:.1f} decode sd")
        if x.get("decode_depth"):
            notes.append(f"decode after {x['decode_depth']} tokens of context; {fmt(x.get('decode_at_0'), 2)} tok/s from an empty one")
        if x.get("status") not in (0, None):
            notes.append(f"exit: {x['status']}")
        if "error" in x:
            notes.append("ERROR " + x["error"][:120].replace("|", "/").replace("\n", " "))
        print(f"| {s} | {rnd} | {x['engine']} | {x.get('prompt_tokens', '—')} | {fmt(x.get('prefill'))} | "
              f"{x.get('gen_tokens', '—')} | {fmt(x.get('decode'), 2)} | {gb(x.get('max_rss'))} | "
              f"{gb(x.get('cg_max_usage'))} | {'; '.join(notes)} |")


if __name__ == "__main__":
    main()
