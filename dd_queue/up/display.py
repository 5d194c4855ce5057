"""``ddq up``'s progress in the terminal: a live panel on a TTY, one plain line at a time elsewhere.

On a terminal (``rich``): elapsed time against ``--duration``, rounds, global versions, held-out
loss, tokens, goodput, the synchronizer's state, and one row per learner (state, step, tokens,
contributions merged), redrawn in place. ``ddq up``'s own notes (restarts, chaos) print above
it. Piped or in CI: the same numbers as one line every ``every_s`` seconds, so logs stay
readable and greppable.
"""

from __future__ import annotations

import sys
from types import TracebackType

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dd_queue.up.progress import RunWatch

__all__ = ["Display"]

_STATE_STYLE = {
    "active": "green",
    "straggling": "yellow",
    "stalled": "yellow",
    "dead": "red",
    "left": "dim",
}


class Display:
    """Shows a :class:`RunWatch`'s numbers while a run goes on.

    Args:
        watch: What to show.
        duration_s: The run's planned length (0: until Ctrl-C).
        every_s: Seconds between plain lines (not on a TTY).
        live: Force the live panel on or off (default: when stdout is a terminal).
        console: Where to draw (default: stdout).
    """

    def __init__(
        self,
        watch: RunWatch,
        *,
        duration_s: float,
        every_s: float,
        live: bool | None = None,
        console: Console | None = None,
    ) -> None:
        self.watch, self.duration_s, self.every_s = watch, duration_s, every_s
        self.console = console or Console(file=sys.stdout)
        use_live = self.console.is_terminal if live is None else live
        self._live = Live(console=self.console, auto_refresh=False) if use_live else None
        self._next_line_s = 0.0

    def __enter__(self) -> Display:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
            self._live.stop()

    def note(self, text: str) -> None:
        """A line of ``ddq up``'s own (printed above the live panel)."""
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def update(self) -> None:
        """Redraw the panel, or print a line when one is due."""
        if self._live is not None:
            self._live.update(self.render(), refresh=True)
            return
        wall_s = self.watch.summary.wall_s
        if wall_s >= self._next_line_s:
            self._next_line_s = wall_s + self.every_s
            self.note(self.watch.line())

    def render(self) -> Group:
        """The panel: a header, a progress bar when the duration is known, the learners."""
        s, watch = self.watch.summary, self.watch
        versions = sorted(s.versions.values())
        span = f"v{versions[0]}–v{versions[-1]}" if versions else "-"
        loss = "-"
        if s.eval_loss_end is not None:
            loss = f"{s.eval_loss_start:.3f} → {s.eval_loss_end:.3f}"
        goodput = "-" if s.goodput is None else f"{s.goodput:.1%}"
        sync = watch.sync_state()
        header = Text.assemble(
            (f"run {s.run_id} ", "bold"),
            f"{s.wall_s:.0f} s",
            f" / {self.duration_s:.0f} s" if self.duration_s else " (Ctrl-C stops)",
            "   rounds ",
            (str(s.rounds_merged), "bold"),
            f" (abandoned {s.rounds_abandoned})   versions {span}   eval loss ",
            (loss, "bold"),
            f"   tokens {s.tokens_trained:,}   goodput ",
            (goodput, "bold"),
            "   sync ",
            (sync, "green" if sync == "up" else "red"),
            f"   faults {s.faults_injected}",
        )
        table = Table(box=None, pad_edge=False, header_style="bold")
        for column in ("learner", "state", "step", "tokens", "merged", "why"):
            table.add_column(column, justify="right" if column in ("step", "tokens") else "left")
        for obs in watch.members.learners:
            style = _STATE_STYLE.get(obs.state, "")
            table.add_row(
                obs.learner_id,
                Text(obs.state, style=style),
                f"{obs.beat.step:,}",
                f"{obs.beat.n_tokens:,}",
                str(s.contributions.get(obs.learner_id, 0)),
                Text(obs.reason, style="dim"),
            )
        parts: list[Text | ProgressBar | Table] = [header]
        if self.duration_s:
            parts.append(
                ProgressBar(total=self.duration_s, completed=min(s.wall_s, self.duration_s))
            )
        parts.append(table if watch.members.learners else Text("learners joining…", style="dim"))
        return Group(*parts)
