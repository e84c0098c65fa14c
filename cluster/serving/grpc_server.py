"""The ingress replica's own `grpc.aio` server: SpecServe, gRPC health checking and server reflection.

It binds `host:grpc_port` with SO_REUSEPORT, so several ingress replicas on one node share the port (the
kernel spreads connections over them). `grpc.health.v1.Health` answers SERVING for the overall server and
for `specserve.v1.SpecServe` while the scheduler reports healthy (the ingress's Serve health check keeps it
current); reflection lets `grpcurl` and friends list and call the service without the .proto.

With a certificate and key (ClusterConfig tls_cert_file / tls_key_file) the port speaks TLS only
(`grpc.ssl_server_credentials`): a plaintext client's handshake fails and its call never reaches a handler.

Owner: the ingress replica's event loop (start, status updates, stop).
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.serving.grpc_service import SERVICE_NAME, SpecServeService

logger = logging.getLogger("ray.serve")

MAX_MESSAGE_BYTES = 8 << 20  # a 1M-character prompt in UTF-8 fits; larger messages get RESOURCE_EXHAUSTED


def read_tls_pair(cert_file: str, key_file: str) -> tuple[bytes, bytes]:
    """(private key, certificate chain) PEM bytes, as grpc.ssl_server_credentials takes them."""
    try:
        return Path(key_file).read_bytes(), Path(cert_file).read_bytes()
    except OSError as exc:
        raise RuntimeError(f"gRPC TLS: cannot read {exc.filename}: {exc.strerror}") from None


class GrpcServer:
    def __init__(self, service: SpecServeService, host: str, port: int,
                 tls: tuple[bytes, bytes] | None = None) -> None:
        self._server = grpc.aio.server(options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ])
        self._server.add_generic_rpc_handlers((service.handler(),))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is None:
                bound = self._server.add_insecure_port(address)
            else:
                bound = self._server.add_secure_port(address, grpc.ssl_server_credentials([tls]))
        except RuntimeError as exc:
            raise RuntimeError(f"gRPC server cannot bind {address}: {exc}") from exc
        if bound == 0:
            raise RuntimeError(f"gRPC server cannot bind {address}")
        self.port = bound
        self.address = address.rsplit(":", 1)[0] + f":{bound}"
        self.serving = False
        self.tls = tls is not None

    async def start(self) -> None:
        await self._server.start()
        await self.set_serving(True)
        logger.info("gRPC server (SpecServe, health, reflection) listening on %s (%s)", self.address,
                    "TLS" if self.tls else "plaintext")

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if serving != self.serving:
            logger.info("gRPC health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))
        self.serving = serving
        for name in ("", SERVICE_NAME):  # "" = the whole server
            await self._health.set(name, status)

    async def stop(self, grace_s: float | None) -> None:
        """Refuse new calls, let running ones end within `grace_s`, then cancel them (their requests abort)."""
        await self.set_serving(False)
        await self._server.stop(grace_s)
        logger.info("gRPC server on %s stopped", self.address)
