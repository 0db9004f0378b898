"""How a command of this package starts and ends: exit codes, one-line errors, Ctrl-C, a closed pipe.

One convention for ``aiokvtier`` (``demo``, ``doctor``, ``bench``) and the
examples:

===========  ===========================================================================
exit status  meaning
===========  ===========================================================================
0            done
1            a failure while running: one line, ``aiokvtier: error: ...``
2            a usage error, refused before anything runs: a bad value, or something this
             machine cannot do (``--device 0`` without CUDA): one line,
             ``aiokvtier: error: argument --quota: ...``
130          Ctrl-C: what the command opened is closed, then the process ends by SIGINT,
             as Python's own programs do (a shell shows 130, and a shell loop stops too)
141          the reader of stdout went away (``| head -1``): the process ends by SIGPIPE,
             quietly, as ``cat`` and ``grep`` do
===========  ===========================================================================

A traceback is a bug. Outside ``run_async``, Ctrl-C ends the process at
once: parsing, imports, the doctor and the benchmarks hold nothing that
outlives the process (the kernel takes back its memory, threads and child
pipes). Inside it, the first Ctrl-C cancels the command's task, which closes
what it opened; a second ends the process at once.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    import asyncio

__all__ = [
    "Formatter",
    "Parser",
    "UsageError",
    "check_quota_available",
    "end_by_sigint",
    "error",
    "force_option",
    "options_in_advice",
    "run",
    "run_async",
    "seconds",
    "size",
    "starting",
    "whole_number",
]

T = TypeVar("T")


class UsageError(Exception):
    """The command line asked for something invalid, or that this machine cannot do: exit 2."""


def options_in_advice(message: str, options: dict[str, str]) -> str:
    """A config's advice said on the command line: "set max_quota" is "set --max-quota" there."""
    return re.sub(
        r"\b(set|raise|lower) (\w+)", lambda m: f"{m.group(1)} {options.get(m.group(2), m.group(2))}", message
    )


# -- option types: every command says the same mistake in the same words ------------------------------

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*")


def size(name: str) -> Callable[[str], int]:
    """A size option: bytes, or a number and a unit (512MiB, 4GiB, 1GB), more than 0 and below 2**63.

    :param name: the config field it sets, as the config's own refusal names it (dropped from the message).
    """

    def parse(text: str) -> int:
        if text.lstrip().startswith("-"):
            raise argparse.ArgumentTypeError(f"{text!r} is negative: a size is more than 0 bytes")
        if not _SIZE.fullmatch(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a size: give bytes, or a number and a unit such as 512MiB, 4GiB or 1GB"
            )
        from ._config import _size_bytes

        try:
            return _size_bytes(int(text) if text.strip().isdigit() else text, name)
        except ValueError as exc:
            message = str(exc).removeprefix(f"{name} ")
            if "is not a size" in message:  # the unit (pydantic's words follow the colon)
                message = f"{text!r} is not a size: unknown unit; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
            raise argparse.ArgumentTypeError(message) from None

    parse.__name__ = "size"
    return parse


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An option's whole number from ``low`` to ``high`` (None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            bounds = f"{low} to {high}" if high is not None else f"{low} or more"
            raise argparse.ArgumentTypeError(f"{text!r} is not {bounds}")
        return value

    parse.__name__ = "count"
    return parse


def seconds(*, positive: bool = False, most: float | None = None) -> Callable[[str], float]:
    """An option's seconds: 0 or more (more than 0 with ``positive``), up to ``most``; never nan or infinity."""
    if most is None:
        bounds = "a positive number of seconds" if positive else "0 or more seconds"
    else:
        bounds = f"more than 0 and at most {most:g} seconds" if positive else f"0 to {most:g} seconds"
    high = float("inf") if most is None else most

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not ((value > 0 if positive else value >= 0) and value <= high and value != float("inf")):  # nan too
            raise argparse.ArgumentTypeError(f"{text!r} must be {bounds}")
        return abs(value)  # -0.0 prints as 0

    parse.__name__ = "seconds"
    return parse


def cuda_devices(needs: str) -> int:
    """How many CUDA devices this machine offers, for a command that needs one (checked before it runs).

    :param needs: what needs a device, to start the message ("argument --device", "bench cuda").
    :raises UsageError: no CUDA driver is usable, or it sees no device.
    """
    from ._cuda._driver import device_count
    from ._errors import CudaUnavailableError

    try:
        count = device_count()
    except CudaUnavailableError as exc:
        reason = str(exc).removeprefix("a CUDA device was requested but ")
        raise UsageError(f"{needs}: no CUDA device can be used here: {reason}") from None
    if count == 0:
        raise UsageError(f"{needs}: no CUDA device can be used here: the driver sees none")
    return count


def force_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--force``, the way past ``check_quota_available``, in the same words on every command."""
    parser.add_argument(
        "--force",
        action="store_true",
        help="open a quota larger than the memory available now (the kernel may OOM-kill the process)",
    )


def check_quota_available(quota: int, *, force: bool) -> None:
    """Refuse a quota larger than the memory this machine can make resident now, unless ``force``.

    Now is ``MemAvailable``, or the memory cgroup's limit less its usage where
    that is tighter (``_sysinfo.available_memory``, which tests replace). A
    quota between that and ``MemTotal`` passes the config's own check, and its
    fill would meet the OOM killer part-way: the command refuses it before
    anything runs. One check for every command that owns a tier (``demo``,
    ``pool``, ``serve``).

    :raises UsageError: ``quota`` is more than that, and not ``force``; the
        message names both figures and both ways out.
    """
    if force:
        return
    from . import _sysinfo
    from ._units import format_bytes

    available, bound = _sysinfo.available_memory()
    if quota > available:
        raise UsageError(
            f"argument --quota: {format_bytes(quota)} is more than this machine can make resident now "
            f"({format_bytes(available)} available: {bound}); the kernel would kill the process part-way: "
            f"lower --quota to {format_bytes(available)} or less, or pass --force to try anyway"
        )


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Help that ends each option with ``(default: X)`` (a list as ``4 8 16``), unless it says its own default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "(default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        if not action.option_strings:
            return text
        shown = " ".join(map(_show, default)) if isinstance(default, list | tuple) else _show(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def _show(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class Parser(argparse.ArgumentParser):
    """An argparse parser that refuses in one line and takes ``--quota -1GiB`` as a value to refuse.

    Its errors raise ``UsageError`` (``run`` prints it and exits 2).
    An argument that starts with ``-`` and a digit is a value, never an option
    (none of these parsers has an option like ``-1``), so ``--quota -1GiB``
    says what is wrong with the size, not "expected one argument".
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def error(message: str, name: str = "aiokvtier") -> None:
    """Print ``aiokvtier: error: message`` on stderr (nothing if stderr is gone)."""
    try:
        print(f"{name}: error: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr closed or a broken pipe: nobody is left to read it


@contextmanager
def starting() -> Iterator[None]:
    """Ctrl-C ends the process at once, without a traceback, inside the block (a program's imports).

    For a script whose imports take a while (numpy, the tier's modules) before
    ``run`` is reached; the handler found is put back after the block.
    """
    if not _in_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _end_by(sig: signal.Signals) -> NoReturn:
    """End the process as ``sig`` would have: the shell sees 128 + sig, and no Python shutdown speaks."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if sig == signal.SIGPIPE:
        try:  # a broken pipe keeps its unwritten bytes: send them nowhere if the signal does not end us
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.dup2(devnull, sys.stderr.fileno())
        except (OSError, ValueError):
            pass
    signal.signal(sig, signal.SIG_DFL)
    signal.raise_signal(sig)
    os._exit(128 + sig)  # the signal is blocked in this thread: end with the status a shell would show


def end_by_sigint() -> NoReturn:
    """End the process as Ctrl-C ends a command: by SIGINT, once what it opened is closed."""
    _end_by(signal.SIGINT)


def run(
    body: Callable[[], int | None],
    *,
    name: str = "aiokvtier",
    program: bool = True,
    failures: tuple[type[BaseException], ...] = (),
) -> NoReturn:
    """Run a command's ``body`` by the convention above and exit with its status.

    :param name: what error lines start with: ``aiokvtier`` however the
        command was started (``python -m`` too); an example's file name.
    :param program: this call is the process's program (the console script,
        ``python -m``): Ctrl-C stays at "end the process at once" to the
        end. False (a test calling ``main([...])``): the SIGINT handler found
        is put back before the ``SystemExit``.
    :param failures: exceptions that are failures while running (exit 1, one
        line), besides ``aiokvtier.AiokvtierError`` and ``OSError``.
    :raises SystemExit: always, with the exit status (0, 1 or 2).

    Ctrl-C and a closed stdout do not return: the process ends by the signal.
    Only the main thread may call it.
    """
    from ._errors import AiokvtierError

    expected: tuple[type[BaseException], ...] = (AiokvtierError, OSError, *failures)
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL) if _in_main_thread() else None
    try:
        try:
            try:
                status = body()
            except SystemExit as exc:  # --help and --version end here; stdout is flushed below
                if not isinstance(exc.code, int | None):
                    raise
                status = exc.code
            sys.stdout.flush()  # here, not at exit: a closed pipe must be seen while it can be handled
        except BrokenPipeError:
            _end_by(signal.SIGPIPE)
        except KeyboardInterrupt:
            _end_by(signal.SIGINT)
        except UsageError as exc:
            error(str(exc), name)
            status = 2
        except expected as exc:
            error(f"{type(exc).__name__}: {exc}" if isinstance(exc, AiokvtierError) else str(exc), name)
            status = 1
    finally:
        if previous is not None and not program:
            signal.signal(signal.SIGINT, previous)
    sys.exit(status or 0)


def run_async(
    main: Coroutine[Any, Any, T], *, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
) -> T:
    """Run ``main`` on a new event loop; the first Ctrl-C cancels it, a second ends the process at once.

    The cancellation lets ``main`` close what it opened (``async with``);
    ``asyncio.Runner``'s own handling would instead raise ``KeyboardInterrupt``
    into whatever runs at a second Ctrl-C, a tier's teardown included.

    :raises KeyboardInterrupt: after a Ctrl-C, once ``main`` has finished
        (its result, if it finished anyway, is dropped).
    """
    import asyncio  # here: the command's start, where a Ctrl-C ends it at once, stays short

    if not _in_main_thread():  # only the main thread receives SIGINT
        with asyncio.Runner(loop_factory=loop_factory) as plain:
            return plain.run(main)
    interrupted = False
    loop: asyncio.AbstractEventLoop | None = None
    task: asyncio.Task[Any] | None = None

    def on_sigint(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        if loop is not None and task is not None:
            loop.call_soon_threadsafe(task.cancel)

    async def guarded() -> T:
        nonlocal task
        task = asyncio.current_task()
        if interrupted:  # Ctrl-C between the loop's start and here: do not begin
            main.close()
            raise asyncio.CancelledError
        return await main

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            loop = runner.get_loop()
            try:
                result = runner.run(guarded())
            except asyncio.CancelledError:
                if not interrupted:
                    raise
    finally:
        if not interrupted:
            signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt
    return result
