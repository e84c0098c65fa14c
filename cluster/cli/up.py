"""`specserve up`: start (or join) Ray, deploy the specserve application, serve until Ctrl-C / SIGTERM.

Prints, once every replica is up, exactly:

    grpc: HOST:PORT
    http: http://HOST:PORT          (https:// with --tls-cert-file)
    dashboard: http://HOST:PORT

With --once "PROMPT" it streams one generation through gRPC instead of serving (text to stdout as
it arrives, then one line of statistics as JSON; cluster/cli/up_once.py) and exits 0 after shutting
down; --json makes stdout one JSON object (addresses, text, token ids, statistics).

Without --address it starts an embedded local Ray: its node address 127.0.0.1 with the default --host and the
dashboard on 127.0.0.1, but not all of it on loopback (each Serve replica's own gRPC server listens on all
interfaces, Ray's replica.py; docs/security.md lists every listener). Ray's default for a local cluster stays:
token authentication on, its token file created 0600 (cluster/cli/ray_access.py); a log line says where the token
is. With RAY_AUTH_MODE=disabled it starts only in a loopback-only network namespace (scripts/in-netns.sh: the
tests') or with --allow-unauthenticated-ray, whose warning names every listener; elsewhere it exits 2 with one
line before anything starts, as does a configuration the replicas could not start with (an API key under 16
characters, an unreadable key file, TLS files that are not a pair, a port that cannot be bound:
cluster/serving/start_checks.py). With --address it joins that cluster. Access to the front doors (--api-key-file,
--tls-cert-file/--tls-key-file, the SPECSERVE_API_KEYS variable): docs/security.md. On exit it shuts down Serve,
then Ray (a joined cluster keeps running; only this driver disconnects).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TextIO

from cluster.cli.client_flags import refuse_key_flag
from cluster.cli.generate import parse_k
from cluster.cli.ray_access import ALLOW_FLAG, LOOPBACK_HOSTS, ray_auth_gate, secure_token_file
from cluster.cli.tracing_flags import add_tracing_flags, tracing_fields
from cluster.serving.config import ClusterConfig, ConfigError, load_config
from cluster.serving.start_checks import start_problems
from specserve_types.api import TARGET_AUTO, TARGET_DTYPES, SpecServeError

log = logging.getLogger("specserve.up")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("up", help="run the Ray Serve cluster (gRPC + OpenAI HTTP) in the foreground")
    p.add_argument("--config", default=None, help="cluster config file (YAML or JSON; see cluster/serving/config.py)")
    p.add_argument("--model", default=None, help="target model name or HF dir (overrides the config)")
    p.add_argument("--draft", default=None, help="draft model name/dir, or 'ngram' (overrides the config)")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    p.add_argument("--host", default=None, help="address the proxies bind (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--dashboard-port", type=int, default=None)
    p.add_argument("--tp", type=int, default=None, dest="tensor_parallel_size", help="verifier TP ranks")
    p.add_argument("--dtype", choices=TARGET_DTYPES, default=None,
                   help=f"target model precision (overrides the config; auto: {TARGET_AUTO})")
    refuse_key_flag(p)
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="API keys the front doors accept, one a line (also: api_key_file in the config, the "
                        "SPECSERVE_API_KEYS variable); none = open")
    p.add_argument("--tls-cert-file", default=None, metavar="PATH", help="PEM certificate: gRPC and HTTP serve TLS")
    p.add_argument("--tls-key-file", default=None, metavar="PATH", help="PEM private key of --tls-cert-file")
    p.add_argument("--once", default=None, metavar="PROMPT",
                   help="generate for PROMPT through gRPC, print its statistics, shut down and exit")
    p.add_argument("--json", action="store_true", help="with --once: stdout is one JSON object")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="with --once (default: until the model ends the answer, at most what the context leaves)")
    p.add_argument("--temperature", type=float, default=0.0, help="with --once (default 0: greedy)")
    p.add_argument("--k", type=parse_k, default=None, help="with --once: draft tokens per round, N or auto")
    p.add_argument("--seed", type=int, default=None, help="with --once")
    p.add_argument("--chat", action="store_true", help="with --once: apply the model's chat template")
    p.add_argument(ALLOW_FLAG, action="store_true",
                   help="with RAY_AUTH_MODE=disabled outside a loopback-only network namespace: start anyway (a "
                        "warning names every listener anyone who reaches the machine may then use to run code; "
                        "docs/security.md)")
    p.add_argument("-v", "--verbose", action="store_true")
    add_tracing_flags(p)
    return p


def init_ray(config: ClusterConfig) -> str:
    """Start or join Ray; returns the dashboard's host:port ("" if it has none)."""
    import ray

    if config.ray_address:
        log.info("joining Ray cluster at %s", config.ray_address)
        context = ray.init(address=config.ray_address)
    else:
        log.info("starting a local Ray (dashboard on 127.0.0.1:%d)", config.dashboard_port)
        node_ip = {"_node_ip_address": "127.0.0.1"} if config.host in LOOPBACK_HOSTS else {}
        config.local_ray_env()
        secure_token_file(create=True)  # before Ray would write it 0644
        context = ray.init(include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=config.dashboard_port,
                           num_cpus=config.ray_num_cpus, **node_ip)
    secure_token_file()  # a lax file Ray found, or one it wrote after all
    log.info("Ray authentication: %s", ray_auth_note())
    return context.dashboard_url or ""


def ray_auth_note(environ: Mapping[str, str] = os.environ) -> str:
    """Where this process's Ray token is (Ray's own order: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token),
    or that Ray runs without one. Read after ray.init, which turns token mode on for a new local cluster."""
    mode = environ.get("RAY_AUTH_MODE", "disabled").lower()
    if mode != "token":
        return (f"off (RAY_AUTH_MODE={mode}): anyone who reaches the GCS, the dashboard, a raylet, a worker or a Serve "
                "replica's own gRPC port can run code")
    if environ.get("RAY_AUTH_TOKEN"):
        return "token, from the RAY_AUTH_TOKEN variable"
    path = environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return f"token in {path} (`ray get-auth-token` prints it; the dashboard asks for it)"


def preflight(config: ClusterConfig) -> None:
    """Local run: prepare the models and check the pair here, so a bad pair fails with its reason
    before any replica starts (a joined cluster's nodes prepare their own copies)."""
    from cluster.engine.factory import check_draft_compatible, load_tokenizer, model_dir
    from model_runtime.config import ModelConfig

    target_dir = model_dir(config.model)
    if config.uses_draft_model:
        draft_dir = model_dir(config.draft)
        check_draft_compatible(ModelConfig.from_dir(target_dir), load_tokenizer(target_dir),
                               ModelConfig.from_dir(draft_dir), load_tokenizer(draft_dir))


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = load_config(args.config, model=args.model, draft=args.draft, ray_address=args.address,
                             host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                             dashboard_port=args.dashboard_port, tensor_parallel_size=args.tensor_parallel_size,
                             dtype=args.dtype, api_key_file=args.api_key_file, tls_cert_file=args.tls_cert_file,
                             tls_key_file=args.tls_key_file, **tracing_fields(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if problems := start_problems(config):  # what the replicas would fail to start on, read here first
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if (refusal := ray_auth_gate(config, args.allow_unauthenticated_ray)) is not None:
        print(refusal, file=sys.stderr)  # before anything starts
        return 2
    if args.once is None:
        if args.json:
            print("error: --json needs --once", file=sys.stderr)
            return 2
        return _up(config, args, sys.stdout)
    from cluster.cli.up_once import reserved_stdout

    with reserved_stdout() as out:  # Ray's own lines cannot land between the text and its statistics
        return _up(config, args, out)


def _up(config: ClusterConfig, args: argparse.Namespace, out: TextIO) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()
        raise KeyboardInterrupt  # also interrupts a deploy still waiting for replicas

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    import ray
    from ray import serve

    try:
        if not config.ray_address:
            log.info("checking models %s / %s", config.model, config.draft)
            preflight(config)
        # a local node's CPUs (cluster/serving/cpu_binding.py): this process and the Ray it starts on the service
        # CPUs, the model processes' compute threads on their own
        plan = None if config.ray_address else config.cpu_plan()
        if plan is not None:
            log.info("CPU binding: %s", plan.describe())
            os.sched_setaffinity(0, set(plan.service))
        dashboard = init_ray(config)
        for sig in previous:  # Ray's core worker installs its own SIGTERM handler: ours goes back on top
            signal.signal(sig, on_signal)
        from cluster.serving.app import APP_NAME, deploy

        log.info("deploying %s: model %s, draft %s, TP %d, %d KV blocks of %d", APP_NAME, config.model, config.draft,
                 config.tensor_parallel_size, config.kv_pool_blocks, config.block_size)
        deploy(config, cpu_plan=plan)
        scheme = "https" if config.uses_tls else "http"
        addresses = {"grpc": f"{config.host}:{config.grpc_port}", "http": f"{scheme}://{config.host}:{config.http_port}",
                     "dashboard": f"http://{dashboard}" if dashboard else "(none)"}
        if args.once is not None:
            return run_once(config, args, addresses, out)
        print_addresses(addresses, out)
        log.info("serving; Ctrl-C or SIGTERM to stop")
        while not stop.wait(0.5):
            pass
        return 0
    except KeyboardInterrupt:
        return 0
    except SpecServeError as exc:  # bad model names, missing weights, an incompatible pair
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        log.exception("specserve up failed")
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            log.info("shutting down Serve")
            try:
                serve.shutdown()
            except Exception:
                log.exception("serve.shutdown failed")
            log.info("shutting down Ray")
            ray.shutdown()


def print_addresses(addresses: dict[str, str], out: TextIO) -> None:
    for name, address in addresses.items():
        print(f"{name}: {address}", file=out)
    out.flush()


def run_once(config: ClusterConfig, args: argparse.Namespace, addresses: dict[str, str], out: TextIO) -> int:
    """`up --once`: one generation through gRPC; the caller's `finally` shuts Serve and Ray down."""
    from cluster.cli.up_once import generate_once

    fields = {"max_tokens": args.max_tokens, "temperature": args.temperature, "k": args.k, "seed": args.seed,
              "chat": args.chat or None}
    if not args.json:
        print_addresses(addresses, out)
    log.info("generating once (max_tokens %s)", "unset" if args.max_tokens is None else args.max_tokens)
    result = generate_once(config, args.once, fields, out=None if args.json else out)
    if args.json:
        print(json.dumps({**addresses, "prompt": args.once, **result}), file=out)
    else:
        print(file=out)
        print(json.dumps(result["stats"]), file=out)
    out.flush()
    return 0
