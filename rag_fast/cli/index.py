"""``rag-fast index build | search | eval | info``: build, query, evaluate and describe index
directories.

``build`` calls :func:`rag_fast.retrieval.bundle.build_index_bundle` (which writes the
directory atomically and stages sharded builds); ``search`` opens one with the question
encoder it records (:func:`~rag_fast.retrieval.search.open_bundle_search`) and answers one
question or a file of them (``--queries FILE [--out FILE]``: JSON lines, written atomically);
``eval`` searches the questions of a dataset the same way and reports recall@k against
gold passage ids and answer strings (:mod:`rag_fast.evaluation.retrieval`); ``info`` opens one
with :func:`~rag_fast.retrieval.bundle.load_index_bundle`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from pathlib import Path

from rag_fast.cli.common import (check_positive, check_text, resolve_device,
                                 said_on_interrupt, warn)
from rag_fast.cli.parsers import SEARCH_TEXT_CHARS
from rag_fast.evaluation.retrieval import (RETRIEVAL_FILES, format_modes, format_table,
                                           load_retrieval_data, retrieval_report,
                                           write_mode_reports)
from rag_fast.retrieval.bundle import (build_index_bundle, describe_quality, load_index_bundle,
                                       read_tuning_questions, staging_folder)
from rag_fast.retrieval.lexical import load_part
from rag_fast.retrieval.search import MODES, check_mode, open_bundle_search
from rag_fast.retrieval.weights import tuning_summary
from rag_fast.storage import (RETRIEVAL_EVAL_KIND, atomic_write_bytes, check_apart,
                              check_output_file, check_output_folder, shared_lock)


def _check_not_empty(*paths: tuple[str, str | None]) -> None:
    """Refuse a path given as an empty string, which the system would read as the current
    folder (and messages would then show as '.'): named as typed, with its flag.

    Raises:
        ValueError: naming the flag.
    """
    for flag, value in paths:
        if value == "":
            raise ValueError(f"{flag} '' is empty: give a path")


def run_build(args: argparse.Namespace) -> int:
    _check_not_empty(("--passages", args.passages), ("--encoder", args.encoder),
                     ("--query-encoder", args.query_encoder), ("--queries", args.queries))
    # --shard builds share their staging folder; a full build has it to itself (the library
    # refuses an --out that names no folder of its own, hence no staging folder: no lock)
    who = ("a full build of the same --out (index build without --shard)" if args.shard else
           "--shard builds of the same --out")
    lock = contextlib.nullcontext()
    if Path(args.out).name not in ("", ".."):
        lock = shared_lock(staging_folder(args.out), bool(args.shard), "--out's staging folder",
                           who)
        if not args.shard:  # a Ctrl-C after the swap: the index is whole, its staging may stay
            out = Path(args.out)
            args.on_interrupt = said_on_interrupt(
                [args.out], f"the index was written whole to {args.out}; what the build was "
                f"removing may be left behind: its staging folder {staging_folder(args.out)}, "
                f"or the index it replaced, as a hidden folder {out.parent / ('.' + out.name)}."
                "*-HEX beside it; the next build of the same --out removes either")
    try:
        with lock as alone:
            build_index_bundle(
                args.passages, args.encoder, args.out, query_encoder=args.query_encoder,
                preset=args.preset, on_disk=args.on_disk, target_recall=args.target_recall,
                queries=args.queries, shard=args.shard, split=args.split, pooling=args.pooling,
                max_length=args.max_length, batch_size=args.batch_size, device=args.device,
                overwrite=args.overwrite, dedupe=args.dedupe, bm25=args.bm25,
                progress=not args.no_progress,
                warn=warn, remove_staging=args.remove_staging, alone=alone)
    except (FileNotFoundError, ValueError) as e:  # the reader names it: say the flag
        if str(e).startswith("passages: "):
            raise type(e)("--passages: " + str(e).removeprefix("passages: ")) from None
        raise
    return 0


def _hit(store, rank: int, score: float, row: int, chars: int | None) -> dict:
    p = store[row]
    return {"rank": rank, "row": row, "id": p.id, "title": p.title, "score": round(score, 6),
            "text": p.text if chars is None else p.text[:chars]}


def _is_search_record(row: object) -> bool:
    """One line of an ``index search --out`` file: exactly "question" and "hits" (a list)."""
    return isinstance(row, dict) and set(row) == {"question", "hits"} and isinstance(
        row["hits"], list)


def _check_search_out(args: argparse.Namespace) -> None:
    """``--out`` apart from the inputs, and missing or a results file of ``index search``:
    nothing else is replaced."""
    check_apart(args.out, "--out", {"DIR": args.dir, "--queries": args.queries})
    check_output_file(args.out, "--out", _is_search_record,
                      "a results file of `rag-fast index search`")


def run_search(args: argparse.Namespace) -> int:
    _check_not_empty(("DIR", args.dir), ("--queries", args.queries), ("--out", args.out))
    check_positive(("-k", args.k))
    check_mode(args.mode)
    if (args.question is None) == (args.queries is None):
        raise ValueError("give one question, or --queries FILE (not both)")
    if args.out is not None:
        _check_search_out(args)
    if args.queries is not None:
        questions = read_tuning_questions(args.queries)
    else:
        if not args.question.strip():
            raise ValueError("question must not be empty")
        check_text("question", args.question)
        questions = [args.question]
    searcher = open_bundle_search(args.dir, device=args.device, verify=not args.no_verify)
    scores, rows = searcher.search(questions, args.k, mode=args.mode, nprobe=args.nprobe,
                                   ef_search=args.ef_search)
    if args.queries is None and args.out is None:  # one question, printed
        for rank, (score, row) in enumerate(zip(scores[0].tolist(), rows[0].tolist()), 1):
            if row < 0:
                continue
            hit = _hit(searcher.store, rank, score, row, None)
            if args.json:
                print(json.dumps({**hit, "score": score}))
            else:
                text = hit["text"] if len(hit["text"]) <= 200 else hit["text"][:197] + "..."
                print(f"{rank:>3}  {score:8.4f}  [{hit['id']}] {hit['title']}\n     {text}")
        if not (rows[0] >= 0).any():  # (BM25 finds only passages sharing a word with it)
            warn(f"no passage found: none shares a word with the question (--mode {args.mode})"
                 if args.mode == "bm25" else "no passage found")
        return 0
    lines = []
    for question, found, where in zip(questions, scores.tolist(), rows.tolist()):
        hits = [_hit(searcher.store, rank, score, row, SEARCH_TEXT_CHARS)
                for rank, (score, row) in enumerate(zip(found, where), 1) if row >= 0]
        lines.append(json.dumps({"question": question, "hits": hits}, ensure_ascii=False) + "\n")
    if args.out is None:
        sys.stdout.write("".join(lines))
        return 0
    args.on_interrupt = said_on_interrupt([args.out], f"the results were written whole to "
                                                      f"{args.out}")
    atomic_write_bytes(args.out, "".join(lines).encode("utf-8"))
    print(f"{len(lines)} questions, {args.k} passages each -> {args.out}", file=sys.stderr)
    return 0


def parse_ks(text: str, flag: str = "-k") -> list[int]:
    """``"1,5,20"`` -> ``[1, 5, 20]`` (sorted, unique), else a ValueError naming ``flag``."""
    try:
        ks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        ks = []
    if not ks or ks[0] < 1:
        raise ValueError(f"{flag} expects integers >= 1 separated by commas (e.g. 1,5,20), got "
                         f"{text!r}")
    return ks


def parse_modes(text: str) -> list[str]:
    """``index eval --mode``: one mode, several comma-separated, or ``all`` (``["all"]``,
    resolved once the index is open); else a ValueError naming ``--mode``."""
    if text.strip() == "all":
        return ["all"]
    modes = [m.strip() for m in text.split(",")]
    for mode in modes:
        check_mode(mode)
    if len(set(modes)) != len(modes):
        raise ValueError(f"--mode names a mode twice: {text!r}")
    return modes


def run_eval(args: argparse.Namespace) -> int:
    _check_not_empty(("--data", args.data), ("--index", args.index), ("--out", args.out))
    ks = parse_ks(args.k)
    modes = parse_modes(args.mode)
    for flag, value in (("--nprobe", args.nprobe), ("--ef-search", args.ef_search)):
        if value is not None:
            check_positive((flag, value))
    resolve_device(args.device, "--device")  # before anything is read
    if args.out is not None:
        check_apart(args.out, "--out", {"--data": args.data, "--index": args.index})
        check_output_folder(args.out, RETRIEVAL_EVAL_KIND, reuse=True, flag="--out",
                            files=RETRIEVAL_FILES)
    with warnings.catch_warnings(record=True) as said:  # the data's warnings: said at the end
        warnings.simplefilter("always")
        examples = load_retrieval_data(args.data)
    searcher = open_bundle_search(args.index, device=args.device, verify=not args.no_verify)
    if modes == ["all"]:  # every mode this index can search
        modes = list(MODES) if searcher.bm25 is not None else ["dense"]
    for mode in modes:
        searcher.check_mode(mode)
    if ks[-1] > len(searcher.index):
        raise ValueError(f"-k {ks[-1]} is more passages than the index {args.index!r} holds "
                         f"({len(searcher.index)}); use at most {len(searcher.index)}")
    store, reports = searcher.store, {}
    for mode in modes:
        scores, rows = searcher.search([e.question for e in examples], ks[-1], mode=mode,
                                       nprobe=args.nprobe, ef_search=args.ef_search)
        passages = [[store[r] for r in found if r >= 0] for found in rows.tolist()]
        scores = [[s for s, r in zip(sc, found) if r >= 0]
                  for sc, found in zip(scores.tolist(), rows.tolist())]
        reports[mode] = retrieval_report(examples, passages, scores, store, ks)
    report = reports[modes[0]]
    print(f"{len(examples)} questions, index {args.index} ({len(store)} passages), searched once "
          f"at k={ks[-1]} ({', '.join(modes)})")
    print(format_table(report) if len(modes) == 1 else format_modes(reports))
    if args.out is not None:
        args.on_interrupt = said_on_interrupt(  # in the order they are written
            [str(Path(args.out) / "retrieval.jsonl"), str(Path(args.out) / "metrics.json")],
            f"the evaluation was written whole to {args.out}")
        write_mode_reports(args.out, reports, data=args.data, index=args.index)
        print(f"metrics: {Path(args.out) / 'metrics.json'}; per question: "
              f"{Path(args.out) / 'retrieval.jsonl'}")
    # the data's warnings once the outputs are written, so that a failure is one line
    for message in [str(w.message) for w in said] + list(report.warnings):
        warn(message)
    return 0


def run_info(args: argparse.Namespace) -> int:
    _check_not_empty(("DIR", args.dir))
    manifest, store, index = load_index_bundle(args.dir, verify=args.verify)
    bm25 = load_part(args.dir, manifest, len(store), verify=args.verify)
    d = index.describe()
    lines = {
        "directory": str(Path(args.dir).resolve()),
        "passages": f"{len(store)} (from {manifest.get('passages_source')})",
        "encoder": f"{manifest['encoder']['name']} ({manifest['encoder']['pooling']} pooling, "
                   f"normalize={manifest['encoder']['normalize']})",
        "dimension": d["dim"],
        "metric": d["metric"],
        "preset": (f"{d['preset']} ({d['factory']})" if d["factory"] != "Flat" else
                   f"{d['preset']} (Flat: exact search)"),
        "search defaults": ", ".join(f"{k}={v}" for k, v in d["params"].items()
                                     if k != "rerank" or d["factory"] != "Flat") or "none",
        "measured": describe_quality(d.get("search_quality"), d["factory"]),
        "searched by": d["search"],
        "search on CUDA": f"after .to('cuda'): {index.cuda_search()}",
        "bytes/vector": f"{index.index_bytes() / len(index):.1f} (+{2 * d['dim']} fp16 vectors)",
        "faiss": f"{d['faiss_version']} (built with "
                 f"{json.loads((Path(args.dir) / 'index' / 'manifest.json').read_text())['faiss_version']})",
        "bm25": (f"yes: {len(bm25.model.vocab_dict):,} words (--mode bm25, hybrid or "
                 "weighted)" if bm25 else "no (`index build --bm25` adds it)"),
        **({"weighted fusion": tuning_summary(bm25.fusion)} if bm25 else {}),
        "checksums": "verified" if args.verify else "sizes checked (--verify for SHA-256)",
    }
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        print(f"{key:<{width}}  {value}")
    return 0
