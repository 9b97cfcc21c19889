#!/usr/bin/env bash
# Regenerates refitd/_proto from protos/ (needs grpcio-tools, pinned in pyproject's dev extra).
# With --check, generates into a temporary folder and fails if the committed code differs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=refitd/_proto
if [ "${1:-}" = "--check" ]; then out=$(mktemp -d)/_proto; fi
mkdir -p "$out"
tmp=$(mktemp -d)
python -m grpc_tools.protoc -Iprotos --python_out="$tmp" --grpc_python_out="$tmp" --pyi_out="$tmp" protos/refitd/v1/refitd.proto
# Generated modules import "refitd.v1.refitd_pb2"; rewrite to our package path.
sed -i 's/^from refitd\.v1 import refitd_pb2/from refitd._proto import refitd_pb2/' "$tmp/refitd/v1/refitd_pb2_grpc.py"
cp "$tmp"/refitd/v1/refitd_pb2.py "$tmp"/refitd/v1/refitd_pb2.pyi "$tmp"/refitd/v1/refitd_pb2_grpc.py "$out"/
[ -f "$out/__init__.py" ] || echo '"""Generated gRPC code for protos/refitd/v1 (scripts/gen_protos.sh)."""' > "$out/__init__.py"
if [ "${1:-}" = "--check" ]; then
  for f in refitd_pb2.py refitd_pb2.pyi refitd_pb2_grpc.py; do
    diff -q "$out/$f" "refitd/_proto/$f" || { echo "refitd/_proto/$f is stale: run scripts/gen_protos.sh"; exit 1; }
  done
  echo "generated proto code matches protos/"
fi
