"""Where an answer's time goes: a clock that tells each stage's seconds to a callback.

``RagModel.generate(on_stage=...)``, ``answer_questions(on_stage=...)``, the server's batches and
``rag-fast generate --timings`` report the stages of answering a batch of questions by name:
``encode`` (tokenising and encoding the questions), ``retrieve`` (the index search, the
passages fetched and scored), ``contexts`` (passage and question tokenised for the generator)
and ``decode`` (the search, and the answers turned back into text).
"""
from __future__ import annotations

import os
import time
from typing import Callable

# ``rag-fast generate --timings``: the stages' words, in the order they are said
STAGE_WORDS = {"start": "start, imports and options", "reading questions": "reading questions",
               "model and index load": "model and index load", "encode": "question encoding",
               "retrieve": "retrieval", "contexts": "contexts", "decode": "decoding",
               "writing": "writing"}

OnStage = Callable[[str, float], None]


class StageClock:
    """Laps of consecutive stages: :meth:`lap` tells ``on_stage`` the seconds since the previous
    lap (or the clock's start) under the stage's name; without ``on_stage`` it does nothing."""

    def __init__(self, on_stage: OnStage | None) -> None:
        self.on_stage = on_stage
        # without a callback the clock reads no time (it may run inside a compiled region)
        self.t = time.perf_counter() if on_stage is not None else 0.0

    def lap(self, stage: str) -> None:
        if self.on_stage is None:
            return
        now = time.perf_counter()
        self.on_stage(stage, now - self.t)
        self.t = now


def process_age() -> float | None:
    """Seconds since this process started (Linux: ``/proc``, to 10 ms), or None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Timings:
    """A command's stages, from its process's start, adding up to its wall time: :meth:`lap`
    gives a stage the time since the previous lap less what :meth:`add` gave other stages
    meanwhile (an answering call's own stages, ``on_stage=timings.add``); the first stage is
    the process's age when the Timings is made (``"start"``)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        age = process_age()
        self.stages: dict[str, float] = {} if age is None else {"start": age}
        self._added = 0.0

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds
        self._added += seconds

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.add(stage, max(0.0, now - self.t - self._added))
        self._added, self.t = 0.0, now

    @property
    def total(self) -> float:
        return sum(self.stages.values())

    def words(self) -> str:
        """``"start, imports and options 2.41 s, ..., writing 0.00 s; 4.42 s in all"``."""
        order = list(STAGE_WORDS) + [s for s in self.stages if s not in STAGE_WORDS]
        parts = [f"{STAGE_WORDS.get(s, s)} {self.stages[s]:.2f} s" for s in order
                 if s in self.stages]
        since = ("since the process started" if "start" in self.stages else
                 "since the command started (this system does not say when the process did)")
        return f"{', '.join(parts)}; {self.total:.2f} s in all {since}"


__all__ = ["OnStage", "STAGE_WORDS", "StageClock", "Timings", "process_age"]
