"""Command-line parsing shared by the scripts: usage errors in one line, naming the closest
flag; a reader that goes away ending a command quietly.

:class:`FlagParser` is an ``argparse.ArgumentParser`` (no prefix abbreviations) whose usage
errors raise :class:`UsageError` instead of printing the usage block and exiting, so the
caller decides who prints the message (the pretrain scripts: one rank of the job) and exits
with status 2 (:data:`USAGE_EXIT_STATUS`, argparse's). An unknown flag is reported with the
closest known one (``--pipeline-schedual`` -> ``--pipeline-schedule``). Pure Python: the
scripts parse before they import torch or megatron-core.

:func:`quiet_on_broken_pipe` makes a command end quietly when the reader of its output goes
away (``... | head -2``): the rest of the output goes to ``/dev/null``, no ``BrokenPipeError``
traceback, exit status 0. :func:`reader_gone` tells a process whether that has happened to its
standard output without writing to it (the pretrain scripts' ranks other than rank 0, which
never print, learn so when rank 0 has ended). :func:`hand_to_torchrun` puts a failure's one
line at the end of torchrun's failure report.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import functools
import json
import os
import select
import stat
import sys
import time
from typing import Callable, Iterable, List, Optional, Sequence

__all__ = [
    "USAGE_EXIT_STATUS", "DefaultsHelpFormatter", "FlagParser", "UsageError", "closest_flag", "hand_to_torchrun",
    "quiet_on_broken_pipe", "reader_gone",
]  # fmt: skip

#: exit status of a command line that cannot be parsed or breaks a rule (argparse's)
USAGE_EXIT_STATUS = 2


class UsageError(ValueError):
    """A command line the parser rejects; the message is argparse's, without the usage block,
    with the closest known flag for an unknown one."""


def closest_flag(token: str, flags: Iterable[str]) -> Optional[str]:
    """The known flag nearest to ``token`` (``--name`` or ``--name=value``), None if none is close."""
    name = token.split("=", 1)[0]
    matches = difflib.get_close_matches(name, sorted(set(flags)), n=1, cutoff=0.75)
    return matches[0] if matches else None


def _states_default(action: argparse.Action) -> bool:
    """Whether ``--help`` should name ``action``'s default: an option with a value (not a
    switch, not a sub-command) whose default is set (not None, not suppressed)."""
    return (
        bool(action.option_strings) and action.nargs != 0 and action.default is not None
        and action.default is not argparse.SUPPRESS and not isinstance(action.default, bool)
    )


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` naming each option's default, ``(default: X)`` after its help, where the
    option has one (see :func:`_states_default`) and its help does not already speak of its
    default; switches and options without a default stay as they are. Megatron-LM's own
    parser keeps its formatter: this is only for :class:`FlagParser`."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if _states_default(action) and "default" not in text.lower():
            text = f"{text} (default: %(default)s)".lstrip()
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.help is not argparse.SUPPRESS and _states_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class FlagParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` raising :class:`UsageError` for usage errors (see the module
    docstring); ``allow_abbrev`` is off unless given; ``--help`` names the defaults
    (:class:`DefaultsHelpFormatter`) unless another ``formatter_class`` is given."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's hook for every usage error
        raise UsageError(f"{self.prog}: error: {message}")

    def _known_flags(self) -> List[str]:
        """Every option string of this parser and of its sub-commands' parsers."""
        flags = [flag for flag in self._option_string_actions if flag.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += [flag for flag in sub._option_string_actions if flag.startswith("--")]
        return flags

    def _unrecognized(self, tokens: Sequence[str]) -> str:
        """argparse's message for unknown ``tokens``, with the closest flags."""
        known = self._known_flags()
        hints = [(token.split("=", 1)[0], closest_flag(token, known)) for token in tokens if token.startswith("--")]
        hints = [(token, flag) for token, flag in hints if flag]
        if len(hints) == 1:
            hint = f" (did you mean {hints[0][1]}?)"
        elif hints:
            hint = f" (did you mean {', '.join(f'{flag} for {token}' for token, flag in hints)}?)"
        else:
            hint = f" ({self.prog} --help lists the flags)"
        return f"unrecognized arguments: {' '.join(tokens)}{hint}"

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        try:
            parsed, extras = self.parse_known_args(argv, namespace)
        except UsageError as error:  # e.g. a required flag missing because it was misspelled
            known = set(self._known_flags())
            unknown = [token for token in argv if token.startswith("--") and token.split("=", 1)[0] not in known]
            if not unknown:
                raise
            reason = str(error).split(": error: ", 1)[-1]
            raise UsageError(f"{self.prog}: error: {self._unrecognized(unknown)}; {reason}") from None
        if extras:
            self.error(self._unrecognized(extras))
        return parsed


def reader_gone(stream=None) -> bool:
    """Whether ``stream`` (default ``sys.stdout``) is a pipe whose reading end is closed, asked
    of the operating system without writing (``poll`` reports an error condition on such a
    pipe); False for anything else (a terminal, a file, a pipe still read)."""
    stream = sys.stdout if stream is None else stream
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
    except (AttributeError, OSError, ValueError):  # no descriptor (replaced, closed)
        return False
    poller = select.poll()
    poller.register(fd, 0)  # error and hang-up conditions are always reported
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _silence_stdout() -> None:
    """Standard output to ``/dev/null``, so that the interpreter's flush at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def quiet_on_broken_pipe(command: Callable[..., int]) -> Callable[..., int]:
    """``command`` (returning an exit status) ending quietly, with status 0, when its reader
    goes away, as in ``... | head -1``: the rest of the output goes to ``/dev/null``, no
    traceback."""

    @functools.wraps(command)
    def wrapped(*args, **kwargs) -> int:
        try:
            status = command(*args, **kwargs)
            sys.stdout.flush()  # a broken pipe shows here, not at interpreter exit
            return status
        except BrokenPipeError:
            _silence_stdout()
            return 0

    return wrapped


def hand_to_torchrun(message: str) -> None:
    """Under torchrun, ``message`` for the last lines of its failure report: the "traceback"
    entry of the root cause, which torchrun reads from the error file it names in
    ``TORCHELASTIC_ERROR_FILE`` (its ``record`` format, without a Python call stack);
    otherwise that entry is a link to torch's documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, handle)
    except OSError:
        pass  # the line on stderr above is the report then
