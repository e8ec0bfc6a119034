#!/usr/bin/env python3
"""Does the disk give a fixed average rate, whatever idle time it is left? Run by
`tools/bench_gpu_peer.sh disk`.

A streamed decode reads each MoE layer's missed experts in a burst (many reads in flight),
then leaves the disk idle while the layer computes and the next one routes. On the H200
hosts the GPU backend leaves the disk idle less than the CPU backend (5% of a token against
7-10%), yet both read at the same rate averaged over the token: the CPU's reads run faster
while in flight (BENCHMARKS.md, "GPU streaming on the same tokens"). A disk that refills a
budget while idle (a throttled or network volume) would do that, and then only fewer bytes
make a streamed token faster.

This reads pieces of the files under DIR with O_DIRECT (no page cache), in bursts of BURST
MB with THREADS reads in flight, GAP ms of idle between bursts, for SECONDS per gap; the gaps
alternate, rotated each round. Per gap it prints the idle share, the average rate over the
whole time and the rate while reads were in flight. A fixed average rate shows as the same
average at every gap, with the in-flight rate rising as the gaps grow; a disk that idle time
does not help shows a steady in-flight rate and an average that falls with the gaps.
"""

import argparse
import concurrent.futures
import json
import mmap
import os
import random
import statistics
import sys
import threading
import time

ALIGN = 4096


def positive(v):
    n = float(v)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{v}: expected a positive number")
    return n


def files_under(d, piece):
    found = []
    for root, _, names in os.walk(d):
        for n in sorted(names):
            p = os.path.join(root, n)
            size = os.path.getsize(p) // ALIGN * ALIGN
            if size >= piece:
                found.append((p, size))
    return found


class Reader:
    """A pool of threads, each with its own aligned buffer, reading one piece per job."""

    def __init__(self, files, piece, threads):
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        if not hasattr(os, "O_DIRECT"):
            sys.exit("this platform has no O_DIRECT; the test would measure the page cache")
        self.fds = [(os.open(p, flags), size) for p, size in files]
        self.piece = piece
        self.local = threading.local()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
        self.rng = random.Random(7)

    def _read(self, fd, offset):
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = mmap.mmap(-1, self.piece)  # page-aligned, as O_DIRECT needs
        n = os.preadv(fd, [buf], offset)
        if n != self.piece:
            raise OSError(f"short read: {n} of {self.piece} bytes at {offset}")
        return n

    def burst(self, count):
        """Reads `count` random aligned pieces with the pool's threads in flight; returns bytes."""
        jobs = []
        for _ in range(count):
            fd, size = self.rng.choice(self.fds)
            offset = self.rng.randrange(0, (size - self.piece) // ALIGN + 1) * ALIGN
            jobs.append(self.pool.submit(self._read, fd, offset))
        return sum(j.result() for j in jobs)

    def close(self):
        self.pool.shutdown()
        for fd, _ in self.fds:
            os.close(fd)


def run_gap(reader, pieces, gap_s, seconds):
    busy, read, start = 0.0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        read += reader.burst(pieces)
        busy += time.perf_counter() - t0
        if gap_s > 0:
            time.sleep(gap_s)
    wall = time.perf_counter() - start
    return {"bytes": read, "wall_s": wall, "busy_s": busy, "average_gbs": read / wall / 1e9,
            "in_flight_gbs": read / busy / 1e9, "idle_share": 1 - busy / wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="files to read (a streamed model's directory)")
    ap.add_argument("--gaps-ms", default="0,1,2,5", help="idle between bursts, comma-separated")
    ap.add_argument("--burst-mb", type=positive, default=16.0, help="bytes per burst (a layer's misses)")
    ap.add_argument("--piece-kib", type=int, default=768, help="bytes per read (an A64 expert matrix: 768)")
    ap.add_argument("--threads", type=int, default=16, help="reads in flight (the engine's default: 16)")
    ap.add_argument("--seconds", type=positive, default=6.0, help="per gap per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write every measurement here as JSON")
    a = ap.parse_args()
    try:
        gaps = [float(g) for g in a.gaps_ms.split(",") if g.strip()]
    except ValueError:
        sys.exit(f"--gaps-ms {a.gaps_ms!r}: expected milliseconds separated by commas, e.g. 0,1,2,5")
    if not gaps or any(g < 0 for g in gaps):
        sys.exit(f"--gaps-ms {a.gaps_ms!r}: expected one or more gaps of 0 ms or more")
    if a.threads < 1 or a.rounds < 1 or a.piece_kib < 4 or a.piece_kib % 4:
        sys.exit("--threads and --rounds must be at least 1, --piece-kib a multiple of 4")
    piece = a.piece_kib * 1024
    if not os.path.isdir(a.dir):
        sys.exit(f"--dir {a.dir}: not a directory (tools/bench_gpu_peer.sh stream builds one, the A64 model)")
    files = files_under(a.dir, piece)
    if not files:
        sys.exit(f"--dir {a.dir}: no file of at least {piece} bytes to read")
    total = sum(s for _, s in files)
    pieces = max(1, int(a.burst_mb * 1e6 / piece))
    print(f"{len(files)} files, {total / 1e9:.2f} GB; bursts of {pieces} x {a.piece_kib} KiB, {a.threads} in flight; "
          f"gaps {gaps} ms, {a.seconds:g} s each, {a.rounds} rounds, rotated", flush=True)
    reader = Reader(files, piece, a.threads)
    runs = {g: [] for g in gaps}
    try:
        for r in range(a.rounds):
            for i in range(len(gaps)):
                g = gaps[(r + i) % len(gaps)]
                m = run_gap(reader, pieces, g / 1000, a.seconds)
                runs[g].append(m)
                print(f"  round {r} gap {g:g} ms: average {m['average_gbs']:.3f} GB/s, in flight "
                      f"{m['in_flight_gbs']:.3f}, idle {100 * m['idle_share']:.1f}%", flush=True)
    finally:
        reader.close()
    lines = ["| gap between bursts, ms | idle share | GB/s averaged over the time (each round) | mean | GB/s while in flight, mean |",
             "|---:|---:|---|---:|---:|"]
    for g in gaps:
        ms = runs[g]
        each = ", ".join("%.3f" % m["average_gbs"] for m in ms)
        lines.append(f"| {g:g} | {100 * statistics.mean(m['idle_share'] for m in ms):.1f}% | {each} | "
                     f"{statistics.mean(m['average_gbs'] for m in ms):.3f} | {statistics.mean(m['in_flight_gbs'] for m in ms):.3f} |")
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"dir": a.dir, "bytes": total, "piece": piece, "burst_pieces": pieces, "threads": a.threads,
                       "runs": {str(g): runs[g] for g in gaps}, "table": lines}, f, indent=1)


if __name__ == "__main__":
    main()
