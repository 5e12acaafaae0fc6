"""The `gramserve` command: run the system, talk to it, benchmark it.

Subcommands `up`, `gateway`, `generate`, `compile`, `bench`, `health`, and pass-throughs to
the other processes: `grammar-service`, `worker`, `worker-group`.
"""

from __future__ import annotations

import argparse
import os
import sys

from gateway import commands, launcher, loadgen

_COMMANDS = {
    "up": (launcher.up_parser, launcher.up_main,
           "start grammar service, worker groups and gateway on loopback"),
    "generate": (commands.generate_parser, commands.generate_main, "generate text"),
    "compile": (commands.compile_parser, commands.compile_main, "check and compile a constraint"),
    "bench": (loadgen.bench_parser, loadgen.bench_main, "load generator"),
    "health": (commands.health_parser, commands.health_main, "exit 0 when every service is SERVING"),
}
_PASS_THROUGH = {
    "gateway": "run the gateway server",
    "grammar-service": "run the grammar service",
    "worker": "run one worker rank (python -m gpu_worker)",
    "worker-group": "run a TP group of worker ranks (python -m gpu_worker.launch)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gramserve", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_args, _, help_text) in _COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text))
    for name, help_text in _PASS_THROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return p


def _pass_through(name: str, rest: list[str]) -> int:
    if name == "gateway":
        from gateway.server import main as gateway_main
        return gateway_main(rest)
    if name == "grammar-service":
        from grammar_service.server import main as grammar_main
        return grammar_main(rest)
    module = "gpu_worker" if name == "worker" else "gpu_worker.launch"
    os.execv(sys.executable, [sys.executable, "-m", module, *rest])
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `gramserve` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASS_THROUGH:
        return _pass_through(argv[0], argv[1:])
    ns = build_parser().parse_args(argv)
    return _COMMANDS[ns.command][1](ns)


if __name__ == "__main__":
    sys.exit(main())
