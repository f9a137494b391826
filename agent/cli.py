"""perfmon-agent: measure running PyTorch training jobs from outside, with no code change.

The parser tree, made of the commands' own declarations (each command's module has
its ``COMMAND``: perfmon.agent.argtypes.Command), and the one place where an error
becomes one line on stderr and an exit code (see perfmon.parsers.errors); a
traceback means a bug in the agent.
"""

from __future__ import annotations

import argparse
import sys

from perfmon.agent.argtypes import Command, OneLineParser
from perfmon.agent.console import PROG, printable, quiet_broken_pipe
from perfmon.agent.daemon import run, serve
from perfmon.agent.measure import attach
from perfmon.agent.record import summarize
from perfmon.agent.tools import doctor, flops, health, stacks
from perfmon.agent.views import incidents, merge, report, top, trace
from perfmon.parsers.errors import PerfmonError

COMMANDS: tuple[Command, ...] = (
    attach.COMMAND, summarize.COMMAND, flops.COMMAND, health.COMMAND, serve.COMMAND,
    run.COMMAND, report.COMMAND, trace.COMMAND, merge.COMMAND, top.COMMAND, stacks.COMMAND,
    incidents.COMMAND, doctor.COMMAND)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Measure running PyTorch/Megatron/FlagScale training jobs from outside.",
    )
    sub = parser.add_subparsers(parser_class=OneLineParser, dest="command", required=True,
                                metavar="COMMAND")
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(
            command.name, help=command.help, description=command.description,
            epilog=command.epilog, formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = next(c for c in COMMANDS if c.name == args.command)
    try:
        return command.main(args)
    except PerfmonError as err:
        print(f"{PROG}: error: {printable(str(err))}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        quiet_broken_pipe()  # stdout's reader went away: nothing more to say
        return 0


if __name__ == "__main__":
    sys.exit(main())
