#!/usr/bin/env python3
"""Pack a stripped executable small enough to carry to the GPU machine, and unpack it there.

The carried files and the working tree share one 64 MiB budget, and our release binary
embeds the demo model (`include_bytes!` of tools/demo/model/model.safetensors, 13 MB of
weights that xz barely compresses), which the working tree already holds. `pack` cuts the
bytes of each given repository file out of the binary where they appear verbatim, and
xz-compresses the rest; `unpack` splices them back from the repository copy on the other
machine and checks the whole binary's sha256.

    pack_binary.py pack BINARY OUT.xz [REPO_FILE ...] [--beside OTHER]   # writes OUT.xz and OUT.xz.json
    pack_binary.py unpack OUT.xz DEST [REPO_ROOT]

--beside OTHER compresses a second executable in the same xz stream (the bench_gpu example: it
shares most of its code with the binary, so one stream takes 2.4 MB less than two); unpack
writes it beside DEST under its own name.
"""

import hashlib
import json
import lzma
import os
import sys


def pack(binary, out, files, beside=None):
    data = open(binary, "rb").read()
    cuts = []
    for f in files:
        blob = open(f, "rb").read()
        at = data.find(blob)
        if at < 0 or len(blob) < 4096:
            print(f"pack_binary: {f} not found verbatim in {binary}; carried whole", file=sys.stderr)
            continue
        cuts.append({"file": f, "offset": at, "size": len(blob)})
    cuts.sort(key=lambda c: c["offset"])
    rest, pos = bytearray(), 0
    for c in cuts:
        rest += data[pos:c["offset"]]
        pos = c["offset"] + c["size"]
    rest += data[pos:]
    meta = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "cuts": cuts}
    if beside:
        other = open(beside, "rb").read()
        rest += other
        meta["beside"] = {"name": os.path.basename(beside), "size": len(other), "sha256": hashlib.sha256(other).hexdigest()}
    with lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(rest)
    json.dump(meta, open(out + ".json", "w"), indent=1)
    print(f"pack_binary: {len(data)} bytes -> {os.path.getsize(out)} ({sum(c['size'] for c in cuts)} bytes left to the repository copy)")


def unpack(packed, dest, root="."):
    meta = json.load(open(packed + ".json"))
    rest = lzma.open(packed).read()
    if "beside" in meta:
        b = meta["beside"]
        other, rest = rest[len(rest) - b["size"]:], rest[:len(rest) - b["size"]]
        if hashlib.sha256(other).hexdigest() != b["sha256"]:
            sys.exit(f"pack_binary: {b['name']} in {packed} is damaged; run prepare again")
        write_executable(os.path.join(os.path.dirname(os.path.abspath(dest)), b["name"]), other)
    data, pos = bytearray(), 0
    for c in meta["cuts"]:
        take = c["offset"] - len(data)
        data += rest[pos:pos + take]
        pos += take
        data += open(os.path.join(root, c["file"]), "rb").read()
    data += rest[pos:]
    if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
        sys.exit(f"pack_binary: {dest} does not match what was packed (the repository files it needs differ: "
                 f"{[c['file'] for c in meta['cuts']]}); run prepare from this same checkout")
    write_executable(dest, data)


def write_executable(dest, data):
    with open(dest, "wb") as f:
        f.write(data)
    os.chmod(dest, 0o755)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "pack":
        args, beside = sys.argv[4:], None
        if "--beside" in args:
            i = args.index("--beside")
            if i + 1 >= len(args):
                sys.exit(__doc__)
            beside = args[i + 1]
            args = args[:i] + args[i + 2:]
        pack(sys.argv[2], sys.argv[3], args, beside)
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "unpack":
        unpack(*sys.argv[2:])
    else:
        sys.exit(__doc__)
