"""`perfmon-agent stacks`: the Python stacks of every rank of a job, now.

The lead's CLI adds this as a sub-command with :func:`add_stacks_arguments` and
:func:`stacks_main`; ``python -m perfmon.agent.tools.stacks`` runs it stand-alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from perfmon.agent.argtypes import Command, pid, positive_float
from perfmon.agent.console import printable
from perfmon.parsers.pyspy import Frame, ThreadStack
from perfmon.parsers.stack_analysis import innermost_common_frame, main_thread
from perfmon.probes.procfs import TargetProcess, resolve_targets
from perfmon.probes.pyspy import dump_stacks

STACKS_EPILOG = """examples:
  sudo perfmon-agent stacks --pid 12345
  sudo perfmon-agent stacks --pid $(pgrep -f torchrun) --json > stacks.json
  sudo perfmon-agent stacks --pid 12345 --locals      # with each frame's local variables
  sudo perfmon-agent stacks --pid 12345 --native      # C/C++ frames too (pauses the job once)

A launcher pid (torchrun, deepspeed) expands to its ranks. Frames are listed
most recent call last, as in a Python traceback. With more than one rank, the
innermost frame all main threads share is printed last: where a hung job waits.
"""


def add_stacks_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the stacks command's options to a (sub-)parser."""
    parser.add_argument("--pid", type=pid, required=True, help="training (or launcher) pid")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument(
        "--native", action="store_true",
        help="include C/C++ frames (py-spy must pause the process for this)",
    )
    parser.add_argument("--locals", action="store_true", help="show each frame's local variables")
    parser.add_argument(
        "--timeout", type=positive_float, default=10.0, metavar="SECONDS",
        help="give up on a rank's dump after this long (default: %(default)s)",
    )


def _short(path: str) -> str:
    """'/venv/lib/python3.11/site-packages/torch/nn/functional.py' -> 'torch/nn/functional.py'."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    return path


def _frame_json(frame: Frame, local_vars: dict[str, str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "function": frame.function, "file": frame.file, "line": frame.line, "module": frame.module,
    }
    if local_vars is not None:
        out["locals"] = local_vars
    return out


def _process_json(target: TargetProcess, threads: list[ThreadStack], with_locals: bool) -> dict:
    return {
        "pid": target.pid,
        "rank": target.rank,
        "cmdline": target.cmdline,
        "threads": [
            {
                "tid": t.tid,
                "thread_name": t.thread_name,
                "active": t.active,
                "frames": [  # innermost first, as py-spy gives them
                    _frame_json(f, t.frame_locals[i] if with_locals and t.frame_locals else None)
                    for i, f in enumerate(t.frames)
                ],
            }
            for t in threads
        ],
    }


def _frame_text(frame: Frame) -> str:
    where = _short(frame.module) if frame.module else f"{_short(frame.file)}:{frame.line}"
    return f"{frame.function} ({where})"


def _print_text(dumps: list[tuple[TargetProcess, list[ThreadStack]]], with_locals: bool,
                common: Frame | None) -> None:
    for target, threads in dumps:
        rank = "" if target.rank is None else f" rank {target.rank}"
        print(printable(f"Process {target.pid}{rank}: {' '.join(target.cmdline)}"))
        for t in threads:
            state = "active" if t.active else "idle"
            print(printable(f"  Thread {t.tid} ({state}): {t.thread_name or '?'}, "
                            "most recent call last"))
            for i in reversed(range(len(t.frames))):
                print(printable(f"    {_frame_text(t.frames[i])}"))
                if with_locals and i < len(t.frame_locals):
                    for name, value in t.frame_locals[i].items():
                        print(printable(f"        {name} = {value}"))
        print()
    if common is not None:
        print(printable(
            f"Innermost frame shared by all ranks' main threads: {_frame_text(common)}"))


def stacks_main(args: argparse.Namespace) -> int:
    """Dump every rank's stacks; 0 on success. Raises PerfmonError subclasses."""
    targets = resolve_targets(args.pid)
    dumps = [
        (t, dump_stacks(t.pid, native=args.native, locals_=args.locals, timeout_s=args.timeout))
        for t in targets
    ]
    mains = [main_thread(threads) for _, threads in dumps]
    common = None
    if len(dumps) > 1 and all(m is not None for m in mains):
        common = innermost_common_frame([m.frames for m in mains if m is not None])
    if args.json:
        doc = {
            "pid": args.pid,
            "processes": [_process_json(t, threads, args.locals) for t, threads in dumps],
            "innermost_common_frame": None if common is None else _frame_json(common, None),
        }
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_text(dumps, args.locals, common)
    return 0


COMMAND = Command("stacks", "dump the Python stacks of a job's ranks (py-spy, non-blocking)",
                  add_stacks_arguments, stacks_main, epilog=STACKS_EPILOG)
