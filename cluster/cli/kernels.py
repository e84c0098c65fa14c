"""`specserve kernels`: the CPU kernel registry for the CPU at hand (model_runtime/kernel_registry.py): each path,
whether this CPU has it and what of it was built (building what is not yet: about a minute a build, once per
machine), then what each op of a forward runs on in this process, the q4 build, huge pages and the heap."""

from __future__ import annotations

import argparse
import logging
import sys

EXIT_ERROR = 2


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return subparsers.add_parser("kernels", help="the CPU kernel paths for this CPU: what each op runs on, what was "
                                                 "built (SPECSERVE_CPU_KERNEL, SPECSERVE_CPU_FLAGS_OFF honoured)")


def lines() -> list[str]:
    from model_runtime import kernel_registry, quant_kernels
    from model_runtime.heap import describe as heap_describe
    from model_runtime.huge_pages import describe as pages_describe

    return [*kernel_registry.describe(), quant_kernels.describe(), pages_describe(), heap_describe()]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # a first build says so (it takes a while)
    from model_runtime.kernel_registry import requested

    try:
        requested()  # before anything builds
        table = lines()
    except ValueError as exc:  # SPECSERVE_CPU_KERNEL naming no path
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print("\n".join(table))
    return 0
