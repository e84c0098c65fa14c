"""What `specserve up` reads before anything starts (cluster/serving/start_checks.py): the API keys, the TLS pair, the
ports and the trace file, each problem one line naming the file or the field, never a key."""

from __future__ import annotations

import socket
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from cluster.serving.config import load_config
from cluster.serving.start_checks import port_problems, start_problems, tls_problems, trace_file_problem
from tests.cluster.serving.tls_certs import self_signed

KEY = "sk-start-0123456789abcdef"


def free_ports() -> dict[str, int]:
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return dict(zip(("grpc_port", "http_port", "dashboard_port"), ports, strict=True))


def problems(**fields: object) -> list[str]:
    config = load_config(None, model="smollm2-135m", draft="ngram", **{**free_ports(), **fields})
    return start_problems(config, environ={})


def test_a_config_the_replicas_can_start_with_has_none(tmp_path: Path) -> None:
    keys, tls = tmp_path / "keys", self_signed(tmp_path / "tls")
    keys.write_text(f"# rotated monthly\n{KEY}\n")
    assert problems() == []
    assert problems(api_key_file=str(keys), tls_cert_file=str(tls.cert), tls_key_file=str(tls.key),
                    trace_file=str(tmp_path / "traces" / "spans.jsonl")) == []


def test_the_keys_as_the_ingress_reads_them(tmp_path: Path) -> None:
    short, empty = tmp_path / "short", tmp_path / "empty"
    short.write_text(f"{KEY}\nshort-key-1234\n")
    empty.write_text("# nothing yet\n")
    (found,) = problems(api_key_file=str(short))
    assert found == f"API keys must have at least 16 characters; shorter ones in: ['{short}']"
    assert problems(api_key_file=str(empty)) == [f"api_key_file {empty}: holds no key"]
    assert problems(api_key_file=str(tmp_path / "missing")) == [
        f"api_key_file {tmp_path / 'missing'}: cannot read it (FileNotFoundError)"]
    config = load_config(None, model="smollm2-135m", draft="ngram", **free_ports())
    assert start_problems(config, environ={"SPECSERVE_API_KEYS": f"{KEY},tiny"}) == [
        "API keys must have at least 16 characters; shorter ones in: ['SPECSERVE_API_KEYS']"]
    assert "tiny" not in str(start_problems(config, environ={"SPECSERVE_API_KEYS": "tiny"}))


def test_a_joined_cluster_checks_only_the_keys_written_in_the_config(tmp_path: Path) -> None:
    """Its nodes read their own key file, TLS files and environment, and bind their own ports."""
    joined = {"ray_address": "ray://head:10001", "api_key_file": str(tmp_path / "on-the-nodes"),
              "tls_cert_file": "/on/the/nodes.crt", "tls_key_file": "/on/the/nodes.key"}
    config = load_config(None, model="smollm2-135m", draft="ngram", **joined)
    assert start_problems(config, environ={"SPECSERVE_API_KEYS": "tiny"}) == []
    assert start_problems(config.with_overrides(api_keys=("tiny",)), environ={}) == [
        "API keys must have at least 16 characters; shorter ones in: ['config']"]


def test_the_tls_files_readable_and_a_pair(tmp_path: Path) -> None:
    ours, theirs = self_signed(tmp_path / "ours", "ours"), self_signed(tmp_path / "theirs", "theirs")
    assert tls_problems(str(ours.cert), str(ours.key)) == []
    assert tls_problems(str(ours.cert), str(theirs.key)) == [
        f"tls_key_file {theirs.key} is not the key of tls_cert_file {ours.cert} ([X509: KEY_VALUES_MISMATCH] key "
        "values mismatch)"]
    (swapped,) = tls_problems(str(ours.key), str(ours.cert))
    assert swapped.startswith(f"tls_cert_file {ours.key} and tls_key_file {ours.cert} are not a PEM certificate and "
                              "its private key") and "_ssl.c" not in swapped
    assert tls_problems(str(tmp_path / "no.crt"), str(tmp_path / "no.key")) == [
        f"tls_cert_file {tmp_path / 'no.crt'}: cannot read it (No such file or directory)",
        f"tls_key_file {tmp_path / 'no.key'}: cannot read it (No such file or directory)"]
    locked = tmp_path / "locked.key"
    locked.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")))
    assert tls_problems(str(ours.cert), str(locked)) == [
        f"tls_key_file {locked}: the private key is under a passphrase: neither door can use it"]


def test_a_port_something_listens_on_is_named() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert port_problems("127.0.0.1", {"grpc_port": port}) == [
            f"grpc_port {port}: cannot bind 127.0.0.1:{port} (Address already in use)"]
        assert problems(http_port=port) == [f"http_port {port}: cannot bind 127.0.0.1:{port} (Address already in use)"]
    assert port_problems("127.0.0.1", {"grpc_port": port}) == []  # closed: free again
    (elsewhere,) = port_problems("192.0.2.1", {"http_port": port})  # TEST-NET-1: no machine's address here
    assert elsewhere.startswith(f"http_port {port}: cannot bind 192.0.2.1:{port} (")


def test_a_trace_file_that_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert trace_file_problem(str(tmp_path / "made" / "spans.jsonl")) is None
    assert (tmp_path / "made").is_dir()
    assert trace_file_problem(str(blocker / "spans.jsonl")) == (
        f"trace_file {blocker / 'spans.jsonl'}: cannot append to it (File exists)")


def test_every_problem_found_each_on_one_line(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        found = problems(api_keys=("tiny",), http_port=taken.getsockname()[1], trace_file=str(tmp_path))
    assert len(found) == 3 and all("\n" not in problem for problem in found)
