"""Regenerate ``reshard_pb2.py`` and ``reshard_pb2_grpc.py`` from ``reshard.proto``.

Run ``python proto/generate.py`` after editing the ``.proto``; a test checks
that the committed files equal a fresh generation. protoc writes the gRPC
module's import as ``import reshard_pb2``, which only works with ``proto/`` on
``sys.path``; it is rewritten to the package import ``reshard.proto``.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "reshard.proto"
OUTPUTS = ("reshard_pb2.py", "reshard_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Write the generated modules for ``proto/reshard.proto`` into ``out_dir``."""
    from grpc_tools import protoc

    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{HERE}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(HERE / PROTO),
    ])
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc} on {HERE / PROTO}")
    grpc_module = out_dir / "reshard_pb2_grpc.py"
    text = re.sub(r"^import reshard_pb2 as", "from reshard.proto import reshard_pb2 as",
                  grpc_module.read_text(), flags=re.MULTILINE)
    grpc_module.write_text(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report whether the committed files are current")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        if args.check:
            stale = [n for n in OUTPUTS
                     if not (HERE / n).exists() or (Path(tmp) / n).read_text() != (HERE / n).read_text()]
            for n in stale:
                print(f"{n} is stale: run python proto/generate.py", file=sys.stderr)
            return 1 if stale else 0
        for n in OUTPUTS:
            (HERE / n).write_text((Path(tmp) / n).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
