"""The ``splitkv`` command. Thin by design: each subcommand is a module of this package with
``add_arguments(parser)`` and ``run(args) -> int`` that parses, calls the library and prints.
A subcommand's module is imported only when that subcommand runs, so ``splitkv demo`` works on a
machine without CuPy and one broken subcommand cannot break another. A bad argument is one line
on stderr and exit status 2 (``args.Parser``); output cut short by a closed pipe
(``splitkv plan | head -3``) ends the command quietly. The library's notices (records of the
``splitkv`` logger, INFO and above) are ``note:`` lines on stderr while a command runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from .._log import logger
from .._version import __version__
from ..planner.profile_files import ProfileError
from .args import Parser, one_line

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("splitkv.cli.demo", "plan and run a few decode batches, check them against the reference"),
    "plan": ("splitkv.cli.plan", "show the plan the planner chooses for a batch"),
    "calibrate": ("splitkv.cli.calibrate", "measure kernel latencies and fit the planner's cost model"),
    "bench": ("splitkv.cli.bench", "time decode attention over a grid of batch shapes"),
    "env": ("splitkv.cli.env", "print the versions, GPU, profile and cache folders splitkv "
                               "sees, to diagnose the GPU stack"),
    "cache": ("splitkv.cli.cache", "clear splitkv's cached profiles and first-use models "
                                   "(and the compiled kernels)"),
    "precompile": ("splitkv.cli.precompile", "compile the kernels a configuration runs, for "
                                             "named architectures, before serving (no GPU "
                                             "needed)"),
}


def build_parser(command: str | None = None, module=None) -> argparse.ArgumentParser:
    """The full parser; only ``command``'s subparser gets its module's arguments."""
    parser = Parser(
        prog="splitkv", description="Decode attention over a paged KV cache, split adaptively.")
    parser.add_argument("--version", action="version", version=f"splitkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    for name, (_, help_text) in COMMANDS.items():
        sub_parser = parser.commands[name] = sub.add_parser(name, help=help_text,
                                                            description=help_text)
        if name == command and module is not None:
            module.add_arguments(sub_parser)
    return parser


def load_command(name: str):
    """The subcommand's module, or None after printing one line on why it is not available."""
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"splitkv {name}: not available: {module_name} could not be imported ({exc})",
              file=sys.stderr)
        return None
    missing = [attr for attr in ("add_arguments", "run") if not callable(getattr(module, attr, None))]
    if missing:
        print(f"splitkv {name}: not available: {module_name} has no {' or '.join(missing)}()",
              file=sys.stderr)
        return None
    return module


class NoteHandler(logging.Handler):
    """The library's notices as ``note: <message>`` lines on stderr (the one of the moment, so
    a redirected or captured stderr gets them)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"note: {one_line(record.getMessage())}", file=sys.stderr, flush=True)
        except Exception:       # logging's rule: a handler never raises into the caller
            self.handleError(record)


def main(argv: list[str] | None = None) -> int:
    """Run ``splitkv <argv>``; the exit status (argparse's too: 0 after --help, 2 for a bad
    argument)."""
    handler, level = NoteHandler(logging.INFO), logger.level
    logger.addHandler(handler)
    if level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    try:
        return _main(argv)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _main(argv: list[str] | None) -> int:
    try:
        try:
            status = _dispatch(sys.argv[1:] if argv is None else list(argv))
        except SystemExit as exc:
            if exc.code is not None and not isinstance(exc.code, int):
                raise
            status = exc.code or 0
        sys.stdout.flush()      # a closed pipe raises here rather than at exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return 1                # as Python's docs do (signal module, "Note on SIGPIPE")
    except KeyboardInterrupt:
        print("splitkv: interrupted", file=sys.stderr)
        return 130
    except ImportError as exc:      # a dependency missing from a broken install: say which
        name = getattr(exc, "name", None) or str(exc)
        print(f"splitkv: needs {name.split('.')[0]}, which does not import ({exc}); "
              f"reinstall splitkv's dependencies (pip install splitkv)", file=sys.stderr)
        return 1
    except ProfileError as exc:     # a profile the caller named cannot be used
        print(f"splitkv: {exc}", file=sys.stderr)
        return 2
    return status


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that flushing what is left of it at exit, after the reader
    went away, raises no second BrokenPipeError."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # not a file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _dispatch(argv: list[str]) -> int:
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    module = None
    if command in COMMANDS:
        module = load_command(command)
        if module is None:
            return 2
    parser = build_parser(command, module)
    args, unknown = parser.parse_known_args(argv)
    if unknown:      # said by the (sub)command's parser, so its usage and --help are the ones named
        said_by = getattr(args, "action_parser", None) or parser.commands.get(args.command, parser)
        said_by.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return int(module.run(args))
