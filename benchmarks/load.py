"""The machine's load while a benchmark runs: every bench that reports it samples it the same way."""

from __future__ import annotations

import os
import threading


class LoadSampler:
    """The machine's 1-minute load average, sampled every `every` seconds while a `with` block runs:
    other work on a shared machine inflates wall and work alike, and not the same for two runs."""

    def __init__(self, every: float = 5.0):
        self.every, self.samples = every, [os.getloadavg()[0]]
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        return {"before": round(self.samples[0], 2), "mean": round(sum(self.samples) / len(self.samples), 2),
                "max": round(max(self.samples), 2), "samples": len(self.samples)}
