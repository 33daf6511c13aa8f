"""``rag-fast serve`` as a process on loopback: it binds 127.0.0.1 by default, says where in
one line, answers; SIGTERM answers the requests in flight and exits 0; a second SIGTERM exits
at once; Ctrl-C exits 130 with one line; a client that goes away before its batch starts is
dropped; bad options are one line. Every server here is started with --port 0 and stopped by
the test (bounded waits)."""
from __future__ import annotations

import http.client
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serving_fixtures import run_cli

TESTS = Path(__file__).resolve().parents[1]


def _start(*args) -> tuple[subprocess.Popen, int, str]:
    """``rag-fast serve ARGS --port 0``: the process, its port and its first line."""
    script = Path(sys.executable).parent / "rag-fast"
    proc = subprocess.Popen([str(script), "serve", *map(str, args), "--port", "0",
                             "--device", "cpu", "--threads", "1"],
                            cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = _read_line(proc, 120)
    m = re.search(r"on http://127\.0\.0\.1:(\d+) ", line)
    assert m, line
    return proc, int(m.group(1)), line


def _read_line(proc, timeout: float) -> str:
    out = []
    t = threading.Thread(target=lambda: out.append(proc.stderr.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not out:
        proc.kill()
        pytest.fail("the server said nothing in time")
    return out[0]


def _post(port: int, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _stop(proc, sig=signal.SIGTERM, timeout: float = 60) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the server did not stop in time")
    return proc.returncode, err


def test_serve_binds_loopback_answers_and_drains_on_sigterm(serving_world):
    proc, port, line = _start("--model", serving_world["bart"], "--max-wait-ms", "1500")
    try:
        assert "index " in line and "(16 passages)" in line
        status, body = _post(port, "/v1/answer", {"question": "cairo", "num_beams": 1,
                                                  "max_new_tokens": 3})
        assert status == 200 and body["answers"][0]["question"] == "cairo"
        # a request waiting for its batch (1.5 s) when SIGTERM comes is still answered
        got = {}
        asker = threading.Thread(target=lambda: got.update(r=_post(port, "/v1/answer", {
            "question": "paris", "num_beams": 1, "max_new_tokens": 3})))
        asker.start()
        time.sleep(0.5)
        code, err = _stop(proc)
        asker.join(30)
        assert got["r"][0] == 200, got
        assert code == 0, err
        lines = err.strip().splitlines()
        assert lines == ["rag-fast serve: SIGTERM: answered the requests in flight and stopped"]
        with pytest.raises(OSError):  # no longer listening
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_second_sigterm_exits_at_once(serving_world):
    proc, port, _ = _start("--model", serving_world["bart"], "--max-wait-ms", "20000",
                           "--timeout", "60")
    try:
        def ask():  # its connection is cut by the second SIGTERM
            try:
                _post(port, "/v1/answer", {"question": "x"}, 30)
            except (OSError, http.client.HTTPException):
                pass
        threading.Thread(target=ask, daemon=True).start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # drains: the request waits up to 20 s
        time.sleep(0.5)
        assert proc.poll() is None
        start = time.monotonic()
        code, err = _stop(proc, timeout=10)
        assert time.monotonic() - start < 5
        assert code == 128 + signal.SIGTERM
        assert err.strip().splitlines() == [
            "rag-fast serve: second SIGTERM: exiting now, requests in flight are dropped"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_client_gone_before_its_batch_is_dropped(serving_world):
    proc, port, _ = _start("--model", serving_world["bart"], "--max-wait-ms", "1500")
    try:
        body = json.dumps({"question": "gone", "num_beams": 1, "max_new_tokens": 2}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /v1/answer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)
        sock.close()  # before the 1.5 s wait ends: its batch never starts
        time.sleep(1.6)
        status, _ = _post(port, "/v1/answer", {"question": "here", "num_beams": 1,
                                               "max_new_tokens": 2})
        assert status == 200
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
        assert 'rag_fast_requests_total{outcome="499",route="answer"} 1.0' in metrics
        assert "rag_fast_batch_questions_sum 1.0" in metrics  # only "here" was decoded
    finally:
        code, err = _stop(proc, signal.SIGINT)  # Ctrl-C: drains too, exit 130, one line
    assert code == 130
    assert err.strip().splitlines() == [
        "rag-fast: interrupted; SIGINT: answered the requests in flight and stopped"]


@pytest.mark.parametrize("args,words", [
    (["--port", "70000"], ["--port"]),
    (["--max-batch", "0"], ["--max-batch"]),
    (["--max-wait-ms", "-1"], ["--max-wait-ms"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--max-beams", "100000"], ["--max-beams", "at most"]),
    (["--index-root", "."], ["--admin-token-file"]),
    (["--admin-token-file", "tok"], ["--index-root"]),
    (["--admin-token-file", "short", "--index-root", "."], ["--admin-token-file", "16"]),
    (["--admin-token-file", "missing", "--index-root", "."], ["--admin-token-file", "missing"]),
    (["--host", "no.such.host.invalid"], ["--host"]),
    (["--admin-token-file", "fifo", "--index-root", "."], ["--admin-token-file", "regular"]),
    (["--admin-token-file", "zero", "--index-root", "."], ["--admin-token-file", "regular"]),
    (["--admin-token-file", "nul", "--index-root", "."], ["--admin-token-file", "printable"]),
])
def test_bad_options_are_one_line(serving_world, tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok").write_text("x" * 20 + "\n")
    (tmp_path / "short").write_text("abc\n")
    os.mkfifo(tmp_path / "fifo")  # (seventh pass S88: open() blocked the start for ever)
    (tmp_path / "zero").symlink_to("/dev/zero")  # (S89: 4096 NULs became the token)
    (tmp_path / "nul").write_bytes(b"\0" * 20 + b"\n")
    code, err = run_cli("serve", "--model", serving_world["bart"], *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rag-fast: error: "), err
    for word in words:
        assert word in lines[0], lines[0]


def test_a_port_in_use_is_one_line(serving_world):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        code, err = run_cli("serve", "--model", serving_world["bart"], "--port", port,
                            "--device", "cpu")
    finally:
        busy.close()
    assert code == 2
    assert err.strip().splitlines() == [
        f"rag-fast: error: --host 127.0.0.1 --port {port}: cannot listen there (Address "
        "already in use)"]


def test_ctrl_c_while_loading_is_one_line_that_fits_serve(serving_world, monkeypatch):
    from rag_fast.serving import answerer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(answerer.Answerer, "load", interrupted)
    code, err = run_cli("serve", "--model", serving_world["bart"], "--device", "cpu")
    assert code == 130
    assert err.strip().splitlines() == [
        "rag-fast: interrupted; the server stopped before it was ready (it writes nothing)"]


def test_sigterm_while_loading_stops_with_one_line(serving_world, monkeypatch):
    """S64 (eighth hostile pass): SIGTERM while the model loaded killed the server by the
    default action (status 143, no line)."""
    from rag_fast.serving import answerer

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(answerer.Answerer, "load", terminated)
    before = signal.getsignal(signal.SIGTERM)
    code, err = run_cli("serve", "--model", serving_world["bart"], "--device", "cpu")
    assert code == 0
    assert err.strip().splitlines() == [
        "rag-fast serve: SIGTERM before the server was ready: stopped (nothing was answered, "
        "nothing written)"]
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is back


def test_serving_in_a_process_closes_no_handler_of_another_library(serving_world):
    """uvicorn's default logging config (logging.config.dictConfig) closed every handler of
    the process: absl's (rouge-score imports it), holding the standard error of when it was
    imported, then closed that stream, and the tests' own capture with it."""
    closed = []

    class Handler(logging.StreamHandler):
        def close(self):
            closed.append(self)
            super().close()

    other = logging.getLogger("another.library")
    handler = Handler(io.StringIO())
    other.addHandler(handler)
    try:
        code, err = run_cli("serve", "--model", serving_world["bart"], "--device", "cpu",
                            "--host", "no.such.host.invalid")
        assert code == 2 and "--host" in err, err
        assert closed == [] and other.handlers == [handler]
        # uvicorn's messages go out as its default config sends them, once however often
        run_cli("serve", "--model", serving_world["bart"], "--host", "no.such.host.invalid")
        assert len(logging.getLogger("uvicorn").handlers) == 1
        assert not logging.getLogger("uvicorn").propagate
    finally:
        other.removeHandler(handler)


def test_log_requests_writes_one_line_per_request_on_standard_output(serving_world):
    proc, port, _ = _start("--model", serving_world["bart"], "--log-requests")
    try:
        status, _ = _post(port, "/v1/answer", {"question": "cairo", "num_beams": 1,
                                               "max_new_tokens": 2})
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", "/no/such/route")
        missing = conn.getresponse().status
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert (status, missing, proc.returncode) == (200, 404, 0), err
    lines = out.splitlines()
    assert len(lines) == 2, out
    assert '"POST /v1/answer HTTP/1.1" 200' in lines[0] and "127.0.0.1:" in lines[0]
    assert '"GET /no/such/route HTTP/1.1" 404' in lines[1]
