"""Generated gRPC code for specserve.v1 (scripts/gen_proto.sh regenerates it from specserve.proto)."""

from specserve_types.proto import specserve_pb2, specserve_pb2_grpc

__all__ = ["specserve_pb2", "specserve_pb2_grpc"]
