#!/usr/bin/env python3
"""How a layer's missed experts read on this disk, by how many reads are in flight (issue 50).

A streamed decode reads each MoE layer's misses as one burst: in the MLX layout each expert is 9
pieces (gate/up/down x weight/scales/biases, each in its own stacked tensor: 3 of 819 KB and 6 of
51 KB in the flagship), so 10 misses are 90 reads. This times bursts of --experts random experts
of a random layer, read with O_DIRECT at their real offsets in the model's safetensors files, with
--depths reads in flight, as
  pieces   the 9 pieces of each expert, each its own read (what the store issues for a decode)
  records  one contiguous read of a record's size per expert (what a layout that stores each
           expert's record whole would allow; the bytes are the weight tensor's, same size)
and prints per depth and shape the rate while the burst was in flight (GB/s) and reads/s.

  tools/peer/expert_read_queue.py --model /work/f50-models/slice12 [--experts 10] [--depths 4,8,16,32,64]
"""

import argparse
import concurrent.futures
import json
import mmap
import os
import random
import struct
import time

ALIGN = 4096


def tensors(model):
    """name -> (path, absolute start, end) for every tensor of the model's safetensors files."""
    out = {}
    for name in sorted(os.listdir(model)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(model, name)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                a, b = v["data_offsets"]
                out[k] = (path, 8 + n + a, 8 + n + b)
    return out


def expert_tensors(all_tensors, experts):
    """Per MoE layer prefix, its 9 stacked expert tensors as (path, start, per-expert bytes)."""
    layers = {}
    for k, (path, a, b) in all_tensors.items():
        if ".switch_mlp." in k:
            prefix = k.split(".switch_mlp.")[0]
            layers.setdefault(prefix, []).append((path, a, (b - a) // experts))
    return [sorted(v) for _, v in sorted(layers.items()) if len(v) == 9]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--experts", type=int, default=10, help="misses per burst (the flagship's top-10)")
    ap.add_argument("--per-layer", type=int, default=512)
    ap.add_argument("--depths", default="4,8,16,32,64")
    ap.add_argument("--bursts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    layers = expert_tensors(tensors(a.model), a.per_layer)
    fds = {}
    def fd(path):
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
        return fds[path]
    def read(job):
        path, off, n = job
        start = off // ALIGN * ALIGN
        end = -(-(off + n) // ALIGN) * ALIGN
        buf = mmap.mmap(-1, end - start)
        got = os.preadv(fd(path), [buf], start)
        buf.close()
        return got
    rng = random.Random(a.seed)
    print(f"{len(layers)} MoE layers, {a.experts} experts a burst, {a.bursts} bursts per row")
    for depth in [int(d) for d in a.depths.split(",")]:
        with concurrent.futures.ThreadPoolExecutor(depth) as pool:
            for shape in ["pieces", "records"]:
                total_bytes, total_reads, seconds = 0, 0, 0.0
                for _ in range(a.bursts):
                    ts = rng.choice(layers)
                    es = rng.sample(range(a.per_layer), a.experts)
                    if shape == "pieces":
                        jobs = [(p, s + e * per, per) for e in es for (p, s, per) in ts]
                    else:
                        record = sum(per for _, _, per in ts)
                        big = max(ts, key=lambda t: t[2])
                        # A record's bytes from the weight tensor, wherever they fit (same size and spread).
                        span = big[2] * a.per_layer - record
                        jobs = [(big[0], big[1] + (e * big[2]) % max(1, span) // ALIGN * ALIGN, record) for e in es]
                    t = time.monotonic()
                    list(pool.map(read, jobs))
                    seconds += time.monotonic() - t
                    total_bytes += sum(n for _, _, n in jobs)
                    total_reads += len(jobs)
                print(f"depth {depth:3d} {shape:8s}: {total_bytes / seconds / 1e9:5.2f} GB/s in flight, "
                      f"{total_reads / seconds:7.0f} reads/s, {1e3 * seconds / a.bursts:6.1f} ms a burst "
                      f"({total_reads // a.bursts} reads, {total_bytes / a.bursts / 1e6:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
