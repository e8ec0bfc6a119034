#!/usr/bin/env python3
"""Pack a stripped executable small enough to carry to the GPU machine, and unpack it there.

The carried files and the working tree share one 64 MiB budget, and our release binary
embeds the demo model (`include_bytes!` of tools/demo/model/model.safetensors, 13 MB of
weights that xz barely compresses), which the working tree already holds. `pack` cuts the
bytes of each given repository file out of the binary where they appear verbatim, and
xz-compresses the rest; `unpack` splices them back from the repository copy on the other
machine and checks the whole binary's sha256.

    pack_binary.py pack BINARY OUT.xz [REPO_FILE ...]   # writes OUT.xz and OUT.xz.json
    pack_binary.py unpack OUT.xz DEST [REPO_ROOT]
"""

import hashlib
import json
import lzma
import os
import sys


def pack(binary, out, files):
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
    with lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(rest)
    meta = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "cuts": cuts}
    json.dump(meta, open(out + ".json", "w"), indent=1)
    print(f"pack_binary: {len(data)} bytes -> {os.path.getsize(out)} ({sum(c['size'] for c in cuts)} bytes left to the repository copy)")


def unpack(packed, dest, root="."):
    meta = json.load(open(packed + ".json"))
    rest = lzma.open(packed).read()
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
    with open(dest, "wb") as f:
        f.write(data)
    os.chmod(dest, 0o755)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "pack":
        pack(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif len(sys.argv) in (4, 5) and sys.argv[1] == "unpack":
        unpack(*sys.argv[2:])
    else:
        sys.exit(__doc__)
