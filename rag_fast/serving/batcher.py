"""Dynamic batching: requests from many clients joined into the batches of one worker.

A :class:`Batcher` keeps a bounded queue of jobs (a job: one request's questions, its
settings, and whether it wants answers or passages only). One worker thread owns the
:class:`~rag_fast.serving.answerer.Answerer`: it takes the oldest job, waits at most
``max_wait_ms`` for more jobs with the same settings until ``max_batch`` questions are there,
and answers them together; each job's ``future`` then holds its own records.

- A full queue (``max_queue`` questions waiting) refuses the job at once (:class:`Overloaded`).
- A job cancelled before its batch starts (its client went away, or it waited past its
  timeout) is dropped: ``future.cancel()`` succeeds only until the batch starts.
- An error of a batch (a value past what the index now serving holds, say) is every job's in
  it; the worker goes on with the next batch.
- ``stop()`` lets the queued jobs finish, then ends the worker.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from rag_fast.serving.answerer import AnswerSettings, Answerer


class Overloaded(Exception):
    """The queue is full: the request is refused (HTTP 503 with Retry-After)."""


class Stopped(Exception):
    """The batcher is stopping and takes no new jobs."""


@dataclass(eq=False)
class Job:
    """One request's questions and settings; ``future`` gets its records (or its error)."""

    questions: list[str]
    settings: AnswerSettings
    decode: bool
    arrived: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple:
        return (self.decode, self.settings)


class Batcher:
    """The queue and worker thread described in the module docstring.

    Args:
        answerer: what answers the batches.
        max_batch: questions per batch at most (a request with more is split by the answerer).
        max_wait_ms: how long the oldest job waits for others to join its batch.
        max_queue: questions waiting at most; more are refused (:class:`Overloaded`).
        on_batch: ``on_batch(questions, jobs)`` after each batch is taken (for metrics).
        on_stage: ``on_stage(stage, seconds)`` for each stage of each batch.
    """

    def __init__(self, answerer: Answerer, *, max_batch: int = 16, max_wait_ms: float = 5.0,
                 max_queue: int = 1024, on_batch: Callable[[int, int], None] | None = None,
                 on_stage: Callable[[str, float], None] | None = None) -> None:
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not 0 <= max_wait_ms <= 60_000:
            raise ValueError(f"max_wait_ms must be in [0, 60000], got {max_wait_ms!r}")
        self.answerer = answerer
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.on_batch, self.on_stage = on_batch, on_stage
        self._jobs: deque[Job] = deque()
        self._waiting = 0  # questions queued
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the front
    @property
    def queued(self) -> int:
        """Questions waiting for a batch."""
        return self._waiting

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, questions: list[str], settings: AnswerSettings, decode: bool = True) -> Job:
        """Queue a request's questions (checked already). Thread-safe.

        Raises:
            Overloaded: the queue holds ``max_queue`` questions already.
            Stopped: the batcher is stopping.
        """
        job = Job(list(questions), settings, decode)
        with self._cond:
            if self._stopping:
                raise Stopped("the server is stopping")
            if self._waiting + len(job.questions) > self.max_queue:
                raise Overloaded(f"{self._waiting} questions are waiting (the server's limit is "
                                 f"{self.max_queue})")
            self._jobs.append(job)
            self._waiting += len(job.questions)
            self._cond.notify_all()
        return job

    def start(self) -> None:
        """Start the worker thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="rag-fast-batcher",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new jobs; answer the queued ones, then end the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker
    def _take(self) -> list[Job] | None:
        """The next batch's jobs (all with the oldest live job's settings), or None when
        stopping with nothing queued."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self._jobs:
                    break
                if self._stopping:
                    return None
                self._cond.wait()
            first = self._jobs[0]
            deadline = first.arrived + self.max_wait
            while True:
                self._drop_cancelled()
                if not self._jobs:  # every job was cancelled while waiting
                    return []
                first = self._jobs[0]
                same = [j for j in self._jobs if j.key == first.key]
                count = sum(len(j.questions) for j in same)
                left = deadline - time.monotonic()
                if count >= self.max_batch or left <= 0 or self._stopping:
                    break
                self._cond.wait(left)
            taken, total = [], 0
            for job in same:
                if taken and total + len(job.questions) > self.max_batch:
                    break
                taken.append(job)
                total += len(job.questions)
            for job in taken:
                self._jobs.remove(job)
                self._waiting -= len(job.questions)
            return taken

    def _drop_cancelled(self) -> None:
        """Remove jobs whose future was cancelled (under the condition's lock)."""
        if any(j.future.cancelled() for j in self._jobs):
            kept = deque(j for j in self._jobs if not j.future.cancelled())
            self._waiting = sum(len(j.questions) for j in kept)
            self._jobs = kept

    def _work(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            # from here a job can no longer be cancelled; one cancelled just now is dropped
            jobs = [j for j in taken if j.future.set_running_or_notify_cancel()]
            if not jobs:
                continue
            questions = [q for j in jobs for q in j.questions]
            if self.on_batch is not None:
                self.on_batch(len(questions), len(jobs))
            try:
                records: list[dict] = []
                for start in range(0, len(questions), self.answerer.max_batch):
                    records.extend(self.answerer.run_batch(
                        questions[start:start + self.answerer.max_batch], jobs[0].settings,
                        jobs[0].decode, self.on_stage))
            except BaseException as e:  # noqa: BLE001  (each job gets the batch's error)
                for job in jobs:
                    job.future.set_exception(e)
                continue
            at = 0
            for job in jobs:
                job.future.set_result(records[at:at + len(job.questions)])
                at += len(job.questions)


__all__ = ["Batcher", "Job", "Overloaded", "Stopped"]
