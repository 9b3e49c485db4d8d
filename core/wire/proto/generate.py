"""Regenerate the committed gRPC code from rankscope.proto.

Run ``python -m rankscope.wire.proto.generate`` after editing the .proto. The same
function is used by tests/integration/test_proto.py to prove that the committed files are
exactly what regenerating gives, so the two can never drift apart.

protoc writes ``import rankscope_pb2`` into the gRPC module, which only works
when this folder is on sys.path; the one rewrite below turns it into the
installed name ``rankscope.wire.proto`` so the code imports from a wheel too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "rankscope.proto"
GENERATED = ("rankscope_pb2.py", "rankscope_pb2_grpc.py", "rankscope_pb2.pyi")

_BARE_IMPORT = re.compile(r"^import rankscope_pb2 as (\w+)$", re.MULTILINE)


def fix_imports(text: str) -> str:
    """Make protoc's bare sibling import an absolute one (the only edit made)."""
    return _BARE_IMPORT.sub(r"from rankscope.wire.proto import rankscope_pb2 as \1", text)


def generate(out_dir: Path, proto_dir: Path = HERE) -> dict[str, bytes]:
    """Run protoc (grpcio-tools with the mypy plugin) into out_dir; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    # protoc finds its plugins (protoc-gen-mypy) on PATH: look next to this interpreter first.
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        # Copy the source so the paths protoc embeds do not depend on where the checkout lives.
        shutil.copy(proto_dir / PROTO, Path(tmp) / PROTO)
        cmd = [
            sys.executable, "-m", "grpc_tools.protoc", "-I", ".",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", f"--mypy_out={out_dir}",
            PROTO,
        ]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"protoc failed ({proc.returncode}): {proc.stderr.strip()}")
    written: dict[str, bytes] = {}
    for name in GENERATED:
        path = out_dir / name
        text = fix_imports(path.read_text(encoding="utf-8"))
        path.write_text(text, encoding="utf-8")
        written[name] = text.encode("utf-8")
    return written


def main() -> int:
    generate(HERE)
    print(f"regenerated {', '.join(GENERATED)} in {HERE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
