#!/usr/bin/env python3
"""Host-to-GPU copies at a set rate, until stopped: the PCIe traffic a streaming GPU decode
makes (each streamed expert crosses to the device), without its reads or its kernels.

`stream_pairs.py`'s BESIDE=pcie runs this beside a CPU-backend arm, to tell whether that
traffic alone slows the disk's reads of a process that does not touch the GPU. Needs PyTorch
with CUDA (the device machines have it); it copies a pinned host buffer to the device in
chunks, sleeping to hold --gbs, and appends "done" to --log after each GiB copied."""

import argparse
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gbs", type=float, default=1.5, help="GB/s to copy (default 1.5: B64's streamed rate)")
    ap.add_argument("--chunk-mb", type=int, default=4, help="MB per copy (default 4: a streamed piece)")
    ap.add_argument("--log", required=True, help="file that gets a 'done' line per GiB copied")
    a = ap.parse_args()
    if a.gbs <= 0 or a.chunk_mb <= 0:
        sys.exit("--gbs and --chunk-mb must be positive")
    try:
        import torch
    except ImportError:
        sys.exit("BESIDE=pcie needs PyTorch (pip install torch); none is installed")
    if not torch.cuda.is_available():
        sys.exit("BESIDE=pcie needs a CUDA GPU; torch sees none")
    n = a.chunk_mb << 20
    src = torch.empty(64 * n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(64 * n, dtype=torch.uint8, device="cuda")
    start, copied, logged = time.monotonic(), 0, 0
    with open(a.log, "a") as log:
        while True:
            at = (copied // n) % 64 * n
            dst[at:at + n].copy_(src[at:at + n], non_blocking=True)
            torch.cuda.current_stream().synchronize()
            copied += n
            if copied - logged >= 1 << 30:
                logged = copied
                log.write(f"done {copied / (time.monotonic() - start) / 1e9:.2f} GB/s\n")
                log.flush()
            ahead = copied / (a.gbs * 1e9) - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)


if __name__ == "__main__":
    main()
