"""The load of ``bench_serve.py``: locust users asking ``rag-fast serve`` questions, one at a
time each, with no pause (closed loop). Run by the bench as
``locust -f benchmarks/serve_locustfile.py --headless -u N ...``; the environment says what to
ask (``RAG_FAST_BENCH_QUESTIONS``: a JSON list of questions; ``RAG_FAST_BENCH_BODY``: the
other fields of the body) and, when set, ``RAG_FAST_BENCH_INDEXES`` names a JSON file
``{checksum: [passage ids]}``: a response whose records name two indexes, or a passage that is
not in the index the response names, is counted as a failure named ``mixed``."""
from __future__ import annotations

import json
import os
import random

from locust import HttpUser, constant, task

QUESTIONS = json.loads(os.environ["RAG_FAST_BENCH_QUESTIONS"])
BODY = json.loads(os.environ.get("RAG_FAST_BENCH_BODY", "{}"))
_indexes = os.environ.get("RAG_FAST_BENCH_INDEXES")
INDEXES = ({k: set(v) for k, v in json.load(open(_indexes)).items()} if _indexes else None)


class Asker(HttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self.rng = random.Random(id(self))

    @task
    def answer(self) -> None:
        body = {"question": self.rng.choice(QUESTIONS), **BODY}
        with self.client.post("/v1/answer", json=body, catch_response=True,
                              name="/v1/answer") as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}")
                return
            if INDEXES is not None:
                data = r.json()
                named = data["index"]
                ids = INDEXES.get(named)
                rows = data["answers"]
                if ids is None or any(row["index"] != named for row in rows) or any(
                        p["id"] not in ids for row in rows for p in row["passages"]):
                    r.failure("mixed")
                    return
            r.success()
