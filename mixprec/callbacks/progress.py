"""The :class:`ProgressBar`: a live bar over each epoch's batches and fastai's results table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec.callbacks.core import Callback

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

__all__ = ["ProgressBar"]


def _fmt_time(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


class ProgressBar(Callback):
    """A rich progress bar over each epoch's batches (on a terminal) and fastai's results table, one row per
    epoch (epoch, train_loss, valid_loss, metrics, time), printed as each epoch ends."""

    order = -5  # after the Recorder, whose epoch result it prints

    def __init__(self, console: Console | None = None) -> None:
        self.console = console

    def on_train_begin(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.out = self.console or Console(highlight=False)
        self.columns = ["epoch", "train_loss", "valid_loss", *self.learn.metric_names, "time"]
        self.widths = [max(len(c), 10) for c in self.columns]
        self.bar: Progress | None = None
        if self.out.is_terminal:  # a live bar only where it can redraw; logs get the rows alone
            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                console=self.out, transient=True,
            )
            self.bar.start()
        self._print(self.columns, style="bold")

    def _print(self, cells: list[str], style: str = "") -> None:
        line = "  ".join(c.ljust(w) for c, w in zip(cells, self.widths, strict=True)).rstrip()
        self.out.print(line, style=style, highlight=False)

    def on_epoch_begin(self) -> None:
        if self.bar is not None:
            description = f"epoch {self.epoch + 1}/{self.n_epochs}"
            self.task: TaskID = self.bar.add_task(description, total=len(self.data.train))

    def on_batch_end(self) -> None:
        if self.training and self.bar is not None:
            self.bar.advance(self.task)

    def on_epoch_end(self) -> None:
        if self.bar is not None:
            self.bar.remove_task(self.task)
        r = self.learn.recorder.epochs[-1]
        values = [f"{v:.6f}" for v in (r.train_loss, r.valid_loss, *(m for _, m in r.metrics))]
        self._print([str(r.epoch), *values, _fmt_time(r.seconds)])

    def on_train_end(self) -> None:
        bar = self.__dict__.get("bar")
        if bar is not None:
            bar.stop()


