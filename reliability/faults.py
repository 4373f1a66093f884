"""A fault injected into Ray Train workers through `fit(..., on_step=TrainFault(...))`.

Kept in its own module with no imports beyond the standard library: every worker unpickles it,
so importing it there must be cheap and must not pull in the rest of the harness.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TrainFault:
    """Fires in worker `rank` before step `step` of epoch `epoch`: "kill" SIGKILLs the worker
    process (as an OOM kill or a lost node would), "raise" raises. With `once` (a marker file),
    only the first worker to claim the marker (O_EXCL) fires, so the restarted group trains on."""

    epoch: int
    step: int
    rank: int = 0
    action: Literal["kill", "raise"] = "kill"
    once: str | None = None

    def __call__(self, rank: int, epoch: int, step: int) -> None:
        if (rank, epoch, step) != (self.rank, self.epoch, self.step):
            return
        if self.once:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault (TrainFault) at epoch {epoch}, step {step}, rank {rank}")
