"""Regenerate the Python modules of protos/ from the .proto files.

    python -m protos.generate          # rewrite protos/*_pb2*.py
    python -m protos.generate --check  # exit 1 when the checked-in modules are stale

Protos are compiled from the repository root (`-I .`), so generated modules import each
other as `from protos import common_pb2` and the package is importable as `protos`.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Compile every .proto into `out_root/protos/`; return the generated files."""
    from grpc_tools import protoc  # build-time dependency only

    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    rels = [str(p.relative_to(ROOT)) for p in proto_files()]
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *rels]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_root / "protos").iterdir() if "_pb2" in p.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, do not write")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [f.name for f in fresh
                 if not (PROTO_DIR / f.name).exists()
                 or not filecmp.cmp(f, PROTO_DIR / f.name, shallow=False)]
        extra = {p.name for p in PROTO_DIR.glob("*_pb2*.py*")} - {f.name for f in fresh}
        if args.check:
            for name in stale + sorted(extra):
                print(f"stale: protos/{name}", file=sys.stderr)
            return 1 if stale or extra else 0
        for f in fresh:
            shutil.copyfile(f, PROTO_DIR / f.name)
        for name in extra:
            (PROTO_DIR / name).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
