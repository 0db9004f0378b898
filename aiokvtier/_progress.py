"""Where a long command is: a rich bar on a terminal, plain lines elsewhere, always on stderr.

stdout keeps the command's output (the benchmarks' JSON), so progress never
mixes into it. A command runs named steps (a benchmark's sections); with a
cost for each (seconds on some reference machine, any unit will do), the
time left is estimated from the time the finished steps took against their
cost. Deep inside a step, ``note`` says what runs now ("repeat 2 of 3")
without the step knowing who shows it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from contextvars import ContextVar
from types import TracebackType
from typing import IO, Any

__all__ = ["Steps", "note"]

_current: ContextVar[Steps | None] = ContextVar("aiokvtier_progress", default=None)


def note(text: str) -> None:
    """Say what the current step is doing now (nothing when no ``Steps`` is shown)."""
    steps = _current.get()
    if steps is not None:
        steps.note(text)


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"
    return f"{int(value // 60)} min {int(value % 60):02d} s"


class Steps:
    """A command's steps, shown as they start, with the time so far and, given costs, the time left.

    ``with Steps("bench host", names) as steps: steps.begin(name) ...``;
    on a terminal (and with rich installed) one live line, elsewhere one plain
    line per step and at most one per ``interval`` seconds for notes.

    :param costs: each step's expected cost, for the estimate of the time
        left (None: no estimate).
    :param bar: force the bar (True) or plain lines (False); None: a bar on a terminal.
    """

    def __init__(
        self,
        title: str,
        names: Iterable[str],
        *,
        costs: Mapping[str, float] | None = None,
        out: IO[str] | None = None,
        interval: float = 2.0,
        bar: bool | None = None,
    ) -> None:
        self.title = title
        self.names = list(names)
        self._costs = {name: max(1e-9, float(costs.get(name, 0.0))) for name in self.names} if costs else None
        self._out = out if out is not None else sys.stderr
        self._interval = interval
        self._index = -1
        self._done_cost = 0.0
        self._started = 0.0
        self._last_line = 0.0
        self._bar: Any = None
        self._task: Any = None
        use_bar = self._out.isatty() if bar is None else bar
        if use_bar:
            try:
                self._bar = self._make_bar()
            except ImportError:
                pass  # rich is the demo extra's: plain lines do without it
        self._token: Any = None
        self._step = self._left_text = ""

    def _make_bar(self) -> Any:
        from rich.console import Console

        class KeepCursor(Console):
            # Ctrl-C ends a benchmark at once (SIG_DFL): nothing would show a hidden cursor again.
            def show_cursor(self, show: bool = True) -> bool:
                return False

        from rich.markup import escape
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.table import Column

        # One flexible column, last: on a narrow terminal the note is cut, not the bar or the step.
        return Progress(
            SpinnerColumn(),
            TextColumn(f"[bold]{escape(self.title)}[/]"),
            BarColumn(bar_width=20),
            TimeElapsedColumn(),
            TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
            console=KeepCursor(file=self._out),
            expand=True,
        )

    # -- lifetime -------------------------------------------------------------------------------

    def __enter__(self) -> Steps:
        self._started = time.monotonic()
        self._token = _current.set(self)
        if self._bar is not None:
            self._bar.start()
            total = sum(self._costs.values()) if self._costs else len(self.names)
            self._task = self._bar.add_task("", total=total)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        _current.reset(self._token)
        elapsed = time.monotonic() - self._started
        if self._bar is not None:
            if kind is None:
                self._bar.update(self._task, completed=self._bar.tasks[0].total, description="done")
            self._bar.stop()
        elif kind is None:
            self._line(f"{self.title}: done in {_seconds(elapsed)}")

    # -- steps and notes ------------------------------------------------------------------------

    def begin(self, name: str) -> None:
        """The next step starts (steps run in the order given)."""
        if self._index >= 0 and self._costs:
            self._done_cost += self._costs[self.names[self._index]]
        self._index = self.names.index(name, self._index + 1)
        step = f"[{self._index + 1}/{len(self.names)}] {name}"
        if self._bar is not None:
            self._step, self._left_text = step, self._left()
            completed = self._done_cost if self._costs else self._index
            self._bar.update(self._task, completed=completed, description=self._description(""))
            return
        elapsed = time.monotonic() - self._started
        parts = [f"{_seconds(elapsed)} so far"] if self._index else []
        if left := self._left():
            parts.append(left)
        self._line(f"{self.title} {step}" + (f" ({', '.join(parts)})" if parts else ""))

    def note(self, text: str) -> None:
        """What the current step does now; plain lines show one per ``interval`` at most."""
        if self._bar is not None:
            self._bar.update(self._task, description=self._description(text))
            return
        now = time.monotonic()
        if now - self._last_line >= self._interval and self._index >= 0:
            name = self.names[self._index]
            self._line(f"{self.title} [{self._index + 1}/{len(self.names)}] {name}: {text}")

    def _description(self, text: str) -> str:
        from rich.markup import escape

        return escape(" · ".join(part for part in (self._step, self._left_text, text) if part))

    def _left(self) -> str:
        if not self._costs or self._done_cost <= 0:
            return ""
        elapsed = time.monotonic() - self._started
        remaining = sum(self._costs.values()) - self._done_cost
        return f"about {_seconds(elapsed * remaining / self._done_cost)} left"

    def _line(self, text: str) -> None:
        self._last_line = time.monotonic()
        print(text, file=self._out, flush=True)
