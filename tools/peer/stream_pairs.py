#!/usr/bin/env python3
"""Streamed decode of several arms (backends, or one backend under settings) on one model,
alternating run by run on one machine: the disk's rate drifts by tens of percent within
minutes on a shared host, so two arms compare only over many rounds, each round running
every arm once in a rotated order. Run by `tools/bench_gpu_peer.sh stream` (which sets the
machine up); arms as NAME=BACKEND[:VAR=VALUE...], e.g.

    gpu=wgpu cpu=cpu exact=wgpu:SLOTSTREAM_WGPU_MATMUL=exact

Each run: `run --json` with a short prompt (decode-sized MoE calls from the first token),
--decode passes, the model's 64 experts per layer with a pool of 16 (25%). Per run it logs
decode tok/s, the disk's rate while reads were in flight (with the reads in flight on
average then, and a read's mean time), ms per token with no read in
flight, the lead and tail between layers' reads, writes and waits, and the process's CPU
seconds and involuntary context switches (`cpu_s`, `preempted`); at the end, per arm, the
median and mean decode, decode per GB/s of that rate, and against the first arm the
geometric mean of the per-round ratios and the rounds it won (table.md, results.json). Every
arm inherits this process's environment (a SLOTSTREAM_ variable exported here applies to all).
With N arms, a multiple of N rounds puts each arm in each position equally often.

An arm's BESIDE=gpu (not passed to the run) keeps the GPU busy from another process while that
arm runs: `slotstream run --backend wgpu` on the demo model, over and over (resident decode,
a submission and a read-back per token; BESIDE=software runs it on lavapipe, to try this
without a GPU; BESIDE=pcie copies host memory to the GPU at B64's streamed rate through
PyTorch, `pcie_load.py`). `cpu=cpu cpuG=cpu:BESIDE=gpu` tells whether a GPU in use slows the disk's
reads of a process that does not touch it: compare the ms per read, not the decode (the load's
host thread takes a core from the CPU backend too). Each run logs how many of the load's runs
completed (`beside_runs`).

An arm's CPUS (not passed to the run either) runs it under `taskset -c CPUS`; CPUS=away runs it
on every CPU but those that take the interrupts of the disk holding the model (from
/proc/interrupts), so that nothing of the run delays the disk's completions on those CPUs.
`gpu=wgpu cpu=cpu gpuA=wgpu:CPUS=away cpuA=cpu:CPUS=away` tells whether the GPU process's reads
are slower because of where its threads run (the GPU driver's work beside the disk's interrupts).

Arms whose numerics differ (the int8 paths of wgpu and cpu) decode different tokens on these
models, so they route to and read different experts (hit rates ~1 point apart). Exact arms
(`gpu=wgpu:exact cpu=cpu:exact`) should decode the same tokens and read the same experts (the
processes compared on the same reads); the "same tokens" column checks it. The table says, per arm, the MB read per decoded token
and whether every run decoded the same tokens as the first arm's run of that round."""

import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_peer as peer  # noqa: E402

PROMPT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
          "of foolishness, it was the epoch of belief")


def parse_arm(text):
    """NAME=BACKEND[:VAR=VALUE...]: the backend spec's own parts (wgpu:software) have no '='."""
    name, _, spec = text.partition("=")
    parts = spec.split(":")
    backend = ":".join(p for p in parts if "=" not in p)
    env = dict(p.split("=", 1) for p in parts if "=" in p)
    if not name or not backend or any(not k for k in env):
        sys.exit(f"arm {text!r}: expected NAME=BACKEND[:VAR=VALUE...]")
    return name, backend, env


# BESIDE's loads: the command each runs over and over, given the binary (software: lavapipe,
# to try this without a GPU; pcie: host-to-GPU copies alone, through PyTorch).
def decode_load(backend):
    return lambda slotstream: (f"{shlex.quote(slotstream)} run --backend {backend} --raw --ignore-eos --max-tokens 400 "
                               "--prompt 'Once upon a time' >/dev/null")


LOADS = {"gpu": decode_load("wgpu"), "software": decode_load("wgpu:software"),
         "pcie": lambda _: f"{shlex.quote(sys.executable)} {shlex.quote(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'pcie_load.py'))} --log \"$BESIDE_LOG\""}


def beside(a, load, tag):
    """Starts `load` (BESIDE's value) in a process group of its own, logging to
    RESULTS/TAG.beside.log; None for no load."""
    if load is None:
        return None
    log = os.path.join(a.results, f"{tag}.beside.log")
    # A run that fails (no GPU) is logged and retried a second later, not in a tight loop.
    loop = (f"while :; do if {LOADS[load](a.slotstream)} 2>>\"$BESIDE_LOG\"; then echo done >>\"$BESIDE_LOG\"; "
            "else sleep 1; fi; done")
    return subprocess.Popen(["bash", "-c", loop], env=dict(os.environ, BESIDE_LOG=log), start_new_session=True), log


def stop(load):
    """Stops a load from `beside` and everything it started; how many of its runs completed."""
    if load is None:
        return None
    proc, log = load
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    if not os.path.exists(log):  # stopped before its first run began
        return 0
    with open(log) as f:
        return sum(line.startswith("done") for line in f)


def disk_irq_cpus(path):
    """The CPUs that have taken interrupts of the block device holding `path` (its
    /proc/interrupts lines are named after the device: virtio0-req.0, nvme0q1, ...)."""
    st = os.stat(path)
    node = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not os.path.exists(os.path.join(node, "device")):  # a partition: its disk is the parent
        node = os.path.dirname(node)
    if not os.path.exists(os.path.join(node, "device")):
        sys.exit(f"CPUS=away: {path} is on no block device (tmpfs?), so no disk's interrupts to keep away from")
    dev = os.path.basename(os.path.realpath(os.path.join(node, "device")))
    with open("/proc/interrupts") as f:
        cpus = [int(c[3:]) for c in f.readline().split()]
        lines = [line.split() for line in f]
    named = re.compile(re.escape(dev) + r"(\D|$)")  # virtio1's lines, not virtio10's
    took = {cpu for parts in lines if parts and named.match(parts[-1])
            for cpu, n in zip(cpus, parts[1:1 + len(cpus)]) if n.isdigit() and int(n) > 0}
    if not took:
        sys.exit(f"CPUS=away: no interrupts of {dev} (the disk holding {path}) in /proc/interrupts")
    return took


def wrap_for(cpus, model):
    """The command prefix for an arm's CPUS value."""
    if cpus is None:
        return []
    if cpus == "away":
        mine = os.sched_getaffinity(0)
        rest = sorted(mine - disk_irq_cpus(model))
        if not rest:
            sys.exit("CPUS=away: the disk's interrupts go to every CPU this process may use")
        cpus = ",".join(map(str, rest))
        peer.log(f"  CPUS=away: {cpus}")
    return ["taskset", "-c", cpus]


def per_run(res):
    return {k: res.get(k) for k in ("backend_name", "decode", "decode_hit_rate", "decode_mb_per_token", "busy_read_gbs", "decode_per_busy_gbs", "reads_in_flight", "ms_per_read",
                                    "disk_idle_ms", "lead_ms", "tail_ms", "write_ms", "wait_ms", "cpu_s", "preempted", "ids", "error")}


def write_summary(a, name, arms, runs, rounds_done):
    """results.json and table.md over the rounds so far (rewritten after each round, so a
    run stopped part way keeps what it measured)."""
    base = arms[0][0]
    summary = {}
    for n, _, _ in arms:
        d = [x["decode"] for x in runs[n] if x.get("decode")]
        s = {"median": statistics.median(d) if d else None, "mean": statistics.mean(d) if d else None,
             "per_busy_gbs": peer.median(runs[n], "decode_per_busy_gbs"),
             "mb_per_token": peer.median(runs[n], "decode_mb_per_token"),
             "busy_gbs": peer.median(runs[n], "busy_read_gbs"), "reads_in_flight": peer.median(runs[n], "reads_in_flight"),
             "ms_per_read": peer.median(runs[n], "ms_per_read")}
        if n != base:
            same = [x.get("ids") is not None and x.get("ids") == y.get("ids") for x, y in zip(runs[n], runs[base])]
            s["same_tokens"] = "yes" if same and all(same) else f"{sum(same)} of {len(same)} runs"
        pairs = [(x["decode"], y["decode"]) for x, y in zip(runs[n], runs[base]) if x.get("decode") and y.get("decode")]
        if n != base and pairs:
            s["geo_mean_ratio"] = math.exp(statistics.mean(math.log(x / y) for x, y in pairs))
            s["rounds_won"] = f"{sum(x > y for x, y in pairs)} of {len(pairs)}"
        summary[n] = s
    json.dump({"commit": a.commit, "model": name, "arms": a.arms, "runs": runs, "summary": summary},
              open(os.path.join(a.results, "results.json"), "w"), indent=1)
    f = lambda v, p=3: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
    names = {n: next((x["backend_name"] for x in runs[n] if x.get("backend_name")), "?") for n, _, _ in arms}
    lines = [f"slotstream `{a.commit}`, {name} (64 experts per layer, a pool of 16), {a.decode} decode passes, "
             f"{rounds_done} rounds, arms rotated each round. Arms: "
             + "; ".join(f"{n} = `{t.partition('=')[2]}` ({names[n]})" for (n, _, _), t in zip(arms, a.arms)) + ".", "",
             f"| arm | decode tok/s, each run | median | mean | per GB/s in flight | MB read per token | GB/s in flight | reads in flight "
             f"| ms per read | against {base} (geometric mean of rounds) | rounds won | same tokens as {base} |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n, _, _ in arms:
        s = summary[n]
        each = ", ".join(f(x.get("decode")) for x in runs[n])
        lines.append(f"| {n} | {each} | {f(s['median'])} | {f(s['mean'])} | {f(s['per_busy_gbs'])} | {f(s['mb_per_token'], 1)} | "
                     f"{f(s['busy_gbs'], 2)} | {f(s['reads_in_flight'], 1)} | {f(s['ms_per_read'], 2)} | {f(s.get('geo_mean_ratio'))} | {s.get('rounds_won', '—')} | {s.get('same_tokens', '—')} |")
    open(os.path.join(a.results, "table.md"), "w").write("\n".join(lines) + "\n")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slotstream", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--results", required=True)
    ap.add_argument("--model", default="A", choices=["A", "B"], help="the trunk, with 64 experts per layer")
    ap.add_argument("--arms", nargs="+", default=["gpu=wgpu", "cpu=cpu"])
    ap.add_argument("--rounds", type=peer.positive, default=4)
    ap.add_argument("--decode", type=peer.positive, default=32)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--router-skew", type=float, default=0.4)
    ap.add_argument("--mixer-out-scale", type=float, default=0.1)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    # Stopped (a time limit): leave through `finally`, so that no load keeps running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(a.results, exist_ok=True)
    arms = [parse_arm(t) for t in a.arms]
    if len({n for n, _, _ in arms}) != len(arms):
        sys.exit("arm names must differ")
    if any(env.get("BESIDE", "gpu") not in LOADS for _, _, env in arms):
        sys.exit(f"BESIDE: the loads are {', '.join(LOADS)}")
    family, _, args = (peer.SMALL if a.small else peer.FULL)[a.model]
    name, model, _ = peer.make_model(a, a.model, family, peer.STREAM_EXPERTS, args, True)
    runs = {n: [] for n, _, _ in arms}
    for r in range(a.rounds):
        for i in range(len(arms)):
            n, backend, env = arms[(r + i) % len(arms)]
            env = dict(env)
            tag = f"{name}_{n}_{r}"
            wrap = wrap_for(env.pop("CPUS", None), model)
            load = beside(a, env.pop("BESIDE", None), tag)
            try:
                res = peer.ours(a, model, backend, PROMPT, a.decode + 1, peer.POOL_PER_LAYER, tag, env=dict(os.environ, **env), wrap=wrap)
            finally:
                done = stop(load)
            row = per_run(res)
            if done is not None:
                row["beside_runs"] = done
            runs[n].append(row)
            peer.log("  " + n + " " + " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in row.items() if v is not None and k not in ("backend_name", "ids")))
        write_summary(a, name, arms, runs, r + 1)
    lines = write_summary(a, name, arms, runs, a.rounds)
    print("\n".join(lines))
    if any(x.get("error") for rs in runs.values() for x in rs):
        sys.exit("some runs failed (their errors are in results.json)")


if __name__ == "__main__":
    main()
