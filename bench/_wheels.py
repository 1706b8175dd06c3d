"""Drop folders from a wheel, in place: what `bench/gpu_wheels.sh` does to NIXL's wheel.

NIXL's wheel for CUDA 13 (``nixl-cu13``) is 59 MB, of which 31 MB is ``nixl_ep_cu13/`` (expert-parallel kernels
for three torch releases), which reshard never imports; with it, the wheels ``make gpu-check`` carries to a GPU host
came to 75 MB, past the 64 MiB some remote runners take. The folder's files and their lines in the wheel's
``RECORD`` go; everything else is copied as it is.

    python bench/_wheels.py WHEEL FOLDER [FOLDER ...]
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path


def drop(wheel: Path, folders: list[str]) -> int:
    """Rewrite ``wheel`` without the files under ``folders`` (each ``name/``); returns how many files went."""
    prefixes = tuple(f.rstrip("/") + "/" for f in folders)
    tmp = wheel.with_name(wheel.name + ".tmp")
    dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if info.filename.startswith(prefixes):
                dropped += 1
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(prefixes)).encode()
            out.writestr(info, data)
    os.replace(tmp, wheel)
    return dropped


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    n = drop(wheel, argv[1:])
    print(f"{wheel.name}: {n} files under {', '.join(argv[1:])} dropped, {wheel.stat().st_size / 1e6:.1f} MB left")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
