#!/usr/bin/env bash
# Regenerate cluster/proto/specserve_pb2*.py from cluster/proto/specserve.proto (run from anywhere).
# The generated files are committed; imports come out package-qualified (cluster.proto.specserve_pb2).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. cluster/proto/specserve.proto
echo "generated: $(ls cluster/proto/specserve_pb2*.py* | tr '\n' ' ')"
