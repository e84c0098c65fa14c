#!/usr/bin/env bash
# Regenerate specserve_types/proto/specserve_pb2*.py from specserve_types/proto/specserve.proto (run from anywhere).
# The generated files are committed; imports come out package-qualified (specserve_types.proto.specserve_pb2).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. specserve_types/proto/specserve.proto
echo "generated: $(ls specserve_types/proto/specserve_pb2*.py* | tr '\n' ' ')"
