"""The speculative-decoding system around the workers.

    engine/   the round (plain Python, no Ray): plan -> reserve -> propose -> verify -> accept -> commit -> emit
    serving/  the Ray Serve application: ingress (gRPC + OpenAI HTTP), scheduler, remote backends, config
    cli/      the `specserve` command line
    bench/    benchmarks
    client.py the gRPC client library
"""
