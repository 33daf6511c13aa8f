"""The routes of ``rag-fast serve`` (Starlette's in-process client; no socket): answers and
passages, health, Prometheus metrics, the OpenAPI description, every bad input as one JSON
error line, the queue's 503, the timeout's 504, the admin token, and index swaps under
concurrent requests (every response names one index and its passages come from it)."""
from __future__ import annotations

import json
import threading

import pytest
from serving_fixtures import QUESTIONS
from starlette.testclient import TestClient

from rag_fast.serving import Answerer
from rag_fast.serving.answerer import index_checksum
from rag_fast.serving.app import FIELDS, create_app

pytestmark = pytest.mark.usefixtures("one_thread")
TOKEN = "t" * 24


@pytest.fixture
def answerer(serving_world):
    return Answerer.load(str(serving_world["bart"]), device="cpu", max_batch=8)


@pytest.fixture
def client(answerer, serving_world):
    app = create_app(answerer, max_wait_ms=50, admin_token=TOKEN,
                     index_root=str(serving_world["root"] / "indexes"))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _error(response, status: int, *words: str) -> str:
    """The one-line JSON error of ``response`` (asserted: status, shape, words)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and "\n" not in body["error"], body
    assert "Traceback" not in response.text
    for word in words:
        assert word in body["error"], body["error"]
    return body["error"]


def test_answer_retrieve_health(client, answerer):
    r = client.post("/v1/answer", json={"question": QUESTIONS[0], "num_beams": 1,
                                         "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    [record] = body["answers"]
    assert body["index"] == answerer.index.checksum == record["index"]
    assert record["question"] == QUESTIONS[0] and isinstance(record["answer"], str)
    assert [set(p) for p in record["passages"]] == [{"title", "id", "score", "text"}] * 2
    alone = answerer.answer([QUESTIONS[0]], answerer.settings(num_beams=1, max_new_tokens=4))
    assert record["answer"] == alone[0]["answer"]

    r = client.post("/v1/retrieve", json={"question": QUESTIONS[:3], "n_docs": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["question"] for x in results] == QUESTIONS[:3]
    assert all(len(x["passages"]) == 3 and "answer" not in x for x in results)

    r = client.post("/v1/answer", json={"question": QUESTIONS[:2], "mode": "sequence",
                                         "num_beams": 2, "max_new_tokens": 3})
    assert r.status_code == 200 and [a["decoding"]["rag_mode"] for a in r.json()["answers"]] \
        == ["sequence"] * 2

    health = client.get("/v1/health")
    assert health.status_code == 200 and health.json()["status"] == "ready"
    assert health.json()["index"]["checksum"] == answerer.index.checksum


def test_metrics_and_openapi(client):
    client.post("/v1/answer", json={"question": ["a", "b"], "num_beams": 1, "max_new_tokens": 2})
    client.post("/v1/answer", json={"question": "a", "bogus": 1})
    text = client.get("/metrics").text
    assert 'rag_fast_requests_total{outcome="ok",route="answer"} 1.0' in text
    assert 'rag_fast_requests_total{outcome="422",route="answer"} 1.0' in text
    assert "rag_fast_batch_questions_sum 2.0" in text
    assert 'rag_fast_stage_seconds_count{stage="decode"} 1.0' in text
    assert "rag_fast_queue_questions 0.0" in text
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    for route, path in (("answer", "/v1/answer"), ("retrieve", "/v1/retrieve"),
                        ("admin_index", "/v1/admin/index")):
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == set(FIELDS[route])
        assert schema["additionalProperties"] is False
    assert spec["paths"]["/v1/answer"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]["num_beams"]["maximum"] == 8


@pytest.mark.parametrize("body,status,words", [
    (b'{"question": "a"', 400, ["malformed JSON"]),
    (b'{"question": NaN}', 400, ["NaN"]),
    (b"[" * 100_000 + b"]" * 100_000, 400, ["malformed JSON"]),
    (b'"just a string"', 422, ["JSON object"]),
    (b'{"question": "a", "n_doc": 2}', 422, ["unknown field 'n_doc'"]),
    (b'{"n_docs": 2}', 422, ["question is required"]),
    (b'{"question": 5}', 422, ["question", "an integer"]),
    (b'{"question": ["a", 5]}', 422, ["question[1]"]),
    (b'{"question": []}', 422, ["at least one"]),
    (b'{"question": "a", "num_beams": "4"}', 422, ["num_beams must be an integer"]),
    (b'{"question": "a", "num_beams": true}', 422, ["num_beams must be an integer"]),
    (b'{"question": "a", "num_beams": 1000}', 422, ["num_beams", "limit"]),
    (b'{"question": "a", "n_docs": 0}', 422, ["n_docs"]),
    (b'{"question": "a", "n_docs": 99999999999999999999999}', 422, ["n_docs", "23 digits"]),
    (b'{"question": "a", "n_docs": ' + b"9" * 4000 + b"}", 422, ["n_docs", "4000 digits"]),
    (b'{"question": "a", "max_new_tokens": -1}', 422, ["max_new_tokens"]),
    (b'{"question": "a", "mode": "both"}', 422, ["mode"]),
    (json.dumps({"question": ["q"] * 65}).encode(), 422, ["at most 64"]),
    (json.dumps({"question": "q" * 2001}).encode(), 422, ["2000"]),
])
def test_bad_input_is_one_json_line(client, body, status, words):
    _error(client.post("/v1/answer", content=body), status, *words)


def test_body_size_routes_and_methods(client):
    big = json.dumps({"question": "q" * (1 << 20)}).encode()
    _error(client.post("/v1/answer", content=big), 413, "1048576")

    def chunks():  # no Content-Length: counted while read
        for _ in range(40):
            yield b" " * 32768
    _error(client.post("/v1/answer", content=chunks()), 413)
    _error(client.post("/v1/answer", content=b"{}", headers={"content-length": "x"}), 413)
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/answer"), 405)


def test_admin_routes_need_the_token_and_a_path_under_the_root(client, serving_world):
    url, b = "/v1/admin/index", str(serving_world["kb_b"])
    _error(client.post(url, json={"path": b}), 401, "Bearer")
    _error(client.post(url, json={"path": b}, headers={"Authorization": "Bearer wrong"}), 401)
    _error(client.post(url, json={"path": b}, headers={"Authorization": TOKEN}), 401)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _error(client.post(url, json={"path": str(serving_world["bart"])}, headers=auth), 422,
           "not under the server's --index-root")
    _error(client.post(url, json={"path": b + "/../../bart"}, headers=auth), 422, "--index-root")
    _error(client.post(url, json={"path": b, "force": True}, headers=auth), 422, "unknown field")
    for bad in ("", "kb\x00", "k" * 5000):
        _error(client.post(url, json={"path": bad}, headers=auth), 422, "path must be")
    _error(client.post(url, json={"path": 5}, headers=auth), 422, "path must be a string")
    missing = str(serving_world["root"] / "indexes" / "nope")
    error = _error(client.post(url, json={"path": missing}, headers=auth), 422, "not swapped")
    assert index_checksum(serving_world["kb_a"])[:12] in error
    r = client.post(url, json={"path": b}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["index"] == index_checksum(b)
    assert r.json()["previous"] == index_checksum(serving_world["kb_a"])
    answers = client.post("/v1/answer", json={"question": "a", "num_beams": 1,
                                              "max_new_tokens": 2}).json()
    assert answers["index"] == index_checksum(b)
    assert all(p["id"].startswith("b") for p in answers["answers"][0]["passages"])


def test_admin_routes_are_off_without_a_token(answerer):
    with TestClient(create_app(answerer)) as client:
        _error(client.post("/v1/admin/index", json={"path": "x"},
                           headers={"Authorization": f"Bearer {TOKEN}"}), 403,
               "--admin-token-file")
    with pytest.raises(ValueError, match="index_root"):
        create_app(answerer, admin_token=TOKEN)


def test_full_queue_is_503_with_retry_after_and_timeouts_are_504(answerer):
    gate = threading.Event()
    real = answerer.run_batch

    def slow(*args, **kwargs):
        gate.wait(20)
        return real(*args, **kwargs)

    answerer.run_batch = slow
    app = create_app(answerer, max_wait_ms=0, max_queue=2, timeout_s=1.0)
    with TestClient(app) as client:
        results = {}

        def ask(name, questions):
            results[name] = client.post("/v1/answer", json={
                "question": questions, "num_beams": 1, "max_new_tokens": 2})

        first = threading.Thread(target=ask, args=("first", ["a"]))
        first.start()
        for _ in range(200):  # until the worker holds the first batch
            if app.state.batcher.queued == 0 and app.state.metrics.batch._sum.get() >= 1:
                break
            threading.Event().wait(0.01)
        second = threading.Thread(target=ask, args=("second", ["b", "c"]))
        second.start()
        for _ in range(200):
            if app.state.batcher.queued == 2:
                break
            threading.Event().wait(0.01)
        r = client.post("/v1/answer", json={"question": "d", "num_beams": 1})
        _error(r, 503, "busy")
        assert r.headers["retry-after"] == "1"
        second.join()
        _error(results["second"], 504, "timeout")  # waited past 1 s behind the gate
        first.join()
        _error(results["first"], 504)
        gate.set()
        # the worker answered the started batch, dropped the timed-out queued one
        for _ in range(200):
            if app.state.batcher.queued == 0:
                break
            threading.Event().wait(0.01)
        assert app.state.metrics.batch._sum.get() == 1
        r = client.post("/v1/answer", json={"question": "e", "num_beams": 1, "max_new_tokens": 2})
        assert r.status_code == 200
        # more questions than the queue could ever hold: 422 (not a 503 "retry later")
        r = client.post("/v1/answer", json={"question": ["f", "g", "h"], "num_beams": 1})
        _error(r, 422, "question: at most 2 questions per request (the server's queue")
        spec = client.get("/openapi.json").json()["paths"]["/v1/answer"]["post"]
        question = spec["requestBody"]["content"]["application/json"]["schema"]["properties"][
            "question"]
        assert question["oneOf"][1]["maxItems"] == 2


def test_concurrent_requests_share_batches_and_equal_their_answers_alone(answerer):
    settings = answerer.settings(num_beams=2, max_new_tokens=4)
    alone = {q: answerer.answer([q], settings)[0]["answer"] for q in QUESTIONS}
    app = create_app(answerer, max_wait_ms=400)
    results = {}
    with TestClient(app) as client:
        def ask(q):
            results[q] = client.post("/v1/answer", json={"question": q, "num_beams": 2,
                                                         "max_new_tokens": 4})
        threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = client.get("/metrics").text
    assert {q: r.json()["answers"][0]["answer"] for q, r in results.items()} == alone
    batches = float(metrics.split("rag_fast_batch_questions_count ")[1].split()[0])
    assert batches < len(QUESTIONS)  # some requests shared a batch


def test_swaps_under_concurrent_requests_never_mix_indexes(answerer, serving_world):
    a, b = str(serving_world["kb_a"]), str(serving_world["kb_b"])
    prefix = {index_checksum(a): "a", index_checksum(b): "b"}
    app = create_app(answerer, max_wait_ms=5, admin_token=TOKEN,
                     index_root=str(serving_world["root"] / "indexes"))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    responses, failures = [], []
    stop = threading.Event()
    with TestClient(app) as client:
        def hammer(i):
            while not stop.is_set() and len(responses) < 400:
                r = client.post("/v1/answer" if i % 2 else "/v1/retrieve", json={
                    "question": QUESTIONS[i % len(QUESTIONS):][:2], "num_beams": 1,
                    "max_new_tokens": 2} if i % 2 else {"question": QUESTIONS[i]})
                (responses if r.status_code == 200 else failures).append(r)
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        swaps = []
        for n in range(6):
            r = client.post("/v1/admin/index", json={"path": b if n % 2 == 0 else a},
                            headers=auth)
            swaps.append(r.status_code)
        stop.set()
        for t in threads:
            t.join()
    assert swaps == [200] * 6 and not failures, [f.text for f in failures]
    seen = set()
    for r in responses:
        body = r.json()
        rows = body.get("answers") or body["results"]
        assert {row["index"] for row in rows} == {body["index"]}
        want = prefix[body["index"]]
        seen.add(want)
        assert all(p["id"].startswith(want) for row in rows for p in row["passages"]), body
    assert seen == {"a", "b"}


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_a_decoder_only_model_answers_over_http(serving_world, mode):
    answerer = Answerer.load(str(serving_world["qwen2"]), device="cpu", max_batch=8)
    settings = answerer.settings(num_beams=2, max_new_tokens=4, mode=mode)
    alone = [answerer.answer([q], settings)[0]["answer"] for q in QUESTIONS[:3]]
    with TestClient(create_app(answerer, max_wait_ms=300)) as client:
        r = client.post("/v1/answer", json={"question": QUESTIONS[:3], "num_beams": 2,
                                             "max_new_tokens": 4, "mode": mode})
        health = client.get("/v1/health").json()
    assert r.status_code == 200, r.text
    assert [a["answer"] for a in r.json()["answers"]] == alone
    assert health["family"] == "decoder-only"


def test_a_question_that_is_not_unicode_is_422_and_spares_its_batch(answerer):
    """Seventh pass S35, S37: a lone surrogate (a legal JSON escape) gave 500, and so did every
    request batched with it."""
    app = create_app(answerer, max_wait_ms=300)
    results = {}
    with TestClient(app) as client:
        def ask(name, q):  # (json.dumps escapes the surrogate: "\ud800", legal JSON)
            results[name] = client.post("/v1/answer", content=json.dumps(
                {"question": q, "num_beams": 1, "max_new_tokens": 2}).encode())
        threads = [threading.Thread(target=ask, args=("good", "where is paris")),
                   threading.Thread(target=ask, args=("bad", ["fine", "\ud800 where"]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    _error(results["bad"], 422, "question[1]", "lone surrogate")
    assert results["good"].status_code == 200, results["good"].text


def test_a_swap_to_an_index_without_its_encoder_record_is_refused(answerer, serving_world,
                                                                 tmp_path):
    """Seventh pass S55, S59: an index whose manifest.json is a link to /dev/zero, or was
    deleted, was swapped in (the encoder check skipped)."""
    import shutil

    root = serving_world["root"] / "indexes"
    for name, plant in (("no-manifest", None), ("zero-manifest", "/dev/zero")):
        kb = root / name
        shutil.rmtree(kb, ignore_errors=True)
        shutil.copytree(serving_world["kb_b"], kb)
        (kb / "manifest.json").unlink()
        if plant:
            (kb / "manifest.json").symlink_to(plant)
        app = create_app(answerer, admin_token=TOKEN, index_root=str(root))
        with TestClient(app) as client:
            error = _error(client.post("/v1/admin/index", json={"path": str(kb)},
                                       headers={"Authorization": f"Bearer {TOKEN}"}), 422,
                           "not swapped")
        assert ("has no manifest.json binding its parts" in error) if plant is None else (
            "symbolic link" in error)
        shutil.rmtree(kb)
    assert answerer.index.checksum == index_checksum(serving_world["kb_a"])
