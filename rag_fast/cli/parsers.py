"""Every ``rag-fast`` command's parser, in a module that imports nothing heavy.

``rag-fast --help``, a command's ``--help`` and a mistyped flag are answered from these parsers
alone, without the seconds torch, transformers and faiss take to load: each command's function
(``func``) is a :class:`_Runs`, which imports the command's module (``rag_fast.cli.index``,
``rag_fast.cli.generate``, ...) only when the parsed command runs. ``train --help`` loads the
training config's schema when it is shown.
"""
from __future__ import annotations

import argparse
import importlib
import json

from rag_fast._defaults import (DEFAULT_BEAMS, DEFAULT_NEW_TOKENS, MAX_VOCAB_SIZE, MIN_VOCAB_SIZE,
                                PRESETS, RETRIEVAL_MODES)


class _Runs:
    """A parsed command's function, named by its module of ``rag_fast.cli`` and attribute:
    the module (which loads torch and the rest) is imported when the command runs."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = f"rag_fast.cli.{module}", name

    def load(self):
        """The function itself, its module imported (the runner does this before it takes
        the command's output lock: the seconds of importing are no window in which another
        command could slip in)."""
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, args: argparse.Namespace):
        return self.load()(args)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


SEARCH_TEXT_CHARS = 200  # characters of each passage's text in the JSON lines of a batch search


def add_index(subparsers: argparse._SubParsersAction) -> None:
    """Add ``index`` and its sub-commands to the ``rag-fast`` command's subparsers."""
    index = subparsers.add_parser("index", help="build, query and describe passage indexes")
    sub = index.add_subparsers(dest="index_command", required=True,
                               metavar="{build,search,eval,info}")

    build = sub.add_parser("build", help="encode passages and build an index directory")
    build.add_argument("--passages", required=True, metavar="FILE",
                       help="DPR .tsv (id, text, title; or id, text; header row optional), .jsonl, "
                            ".txt or a directory of .txt documents")
    build.add_argument("--encoder", required=True, metavar="NAME",
                       help="Hugging Face passage encoder (name or local folder)")
    build.add_argument("--query-encoder", metavar="NAME", default=None,
                       help="question encoder for `index search` (default: --encoder)")
    build.add_argument("--preset", default="ivfpq", metavar="PRESET",
                       help=f"one of {', '.join(PRESETS)} or a faiss factory string (default ivfpq)")
    build.add_argument("--on-disk", action="store_true",
                       help="keep the inverted lists on disk, memory-mapped when the index is opened "
                            "(for corpora larger than RAM): with ivfpq the lists hold 8-bit PQ codes "
                            "instead of fast-scan ones; a factory string must be an IVF without "
                            "fast-scan, e.g. 'IVF4096,SQ8'")
    build.add_argument("--out", required=True, metavar="DIR", help="output index directory")
    build.add_argument("--target-recall", type=float, default=0.95, metavar="R",
                       help="quality the stored search settings must reach against exact search: "
                            "recall@10, and the fraction of queries with exact search's top 5 "
                            "(default 0.95); measured on --queries, else on one sentence from each "
                            "of 1000 sampled passages encoded as a question (an exact index, which "
                            "small corpora get, is checked on its own stored vectors instead)")
    build.add_argument("--queries", default=None, metavar="FILE",
                       help="real questions to measure and tune the index on: .txt (one per line) "
                            "or .jsonl (objects with 'question'); fewer than the target needs to "
                            "be shown with 95%% confidence (59 for 0.95) are warned about")
    build.add_argument("--shard", default=None, metavar="i/n",
                       help="Only encode shard i of n (0-based) into DIR.staging/, where DIR is "
                            "--out. Once all n shards exist, training under torchrun with n "
                            "processes reads them there when the training config's index is "
                            "{\"path\": \"DIR.staging\", \"sharded\": true}, and the same "
                            "command without --shard merges them into the index directory DIR.")
    build.add_argument("--remove-staging", action="store_true",
                       help="After merging the staged shards into --out, remove DIR.staging/ "
                            "with them (only what the builds staged there: one holding anything "
                            "else is refused before the merge, naming it). Without it the "
                            "staging folder is kept, since training on a sharded index reads it.")
    build.add_argument("--split", type=int, default=None, metavar="WORDS",
                       help="split passages into WORDS-word chunks (raw .txt documents: 100)")
    build.add_argument("--pooling", default="auto", choices=["auto", "cls", "mean", "pooler"],
                       help="how token states become one vector (default auto: the "
                            "sentence-transformers setting of the encoder folder, DPR's pooler, "
                            "else the first token's state)")
    build.add_argument("--max-length", type=int, default=256,
                       help="encoder tokens per passage (default 256; longer ones are truncated)")
    build.add_argument("--batch-size", type=int, default=64,
                       help="passages per encoder batch (default 64)")
    build.add_argument("--device", default=None, help="encoder device (default: cuda if available)")
    build.add_argument("--overwrite", action="store_true",
                       help="replace an index directory at --out (never a folder of another "
                            "kind or one holding other files)")
    build.add_argument("--dedupe", action="store_true",
                       help="keep the first passage of each repeated id (default: an error)")
    build.add_argument("--bm25", action="store_true",
                       help="also index the passages' words for BM25 (bm25/, for `index search "
                            "--mode bm25|hybrid`)")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.set_defaults(func=_Runs("index", "run_build"))

    search = sub.add_parser(
        "search", help="retrieve passages for a question, or for a file of questions",
        description="Retrieve passages for one question (printed, or JSON lines with --json) "
                    "or for every question of --queries FILE (encoded in batches and searched "
                    "once): one JSON line per question, {\"question\", \"hits\": [{\"rank\", "
                    "\"row\", \"id\", \"title\", \"score\", \"text\"}]} with the first "
                    f"{SEARCH_TEXT_CHARS} characters of each text, written to --out or printed.")
    search.add_argument("dir", metavar="DIR", help="the index directory to search")
    search.add_argument("question", nargs="?", default=None,
                        help="one question (or give --queries FILE)")
    search.add_argument("--queries", metavar="FILE", default=None,
                        help="questions to search, one per line (.txt) or JSON lines with a "
                             "'question' (.jsonl)")
    search.add_argument("--out", metavar="FILE", default=None,
                        help="write the JSON lines here, atomically (a file it wrote before is "
                             "replaced, any other is refused); default: print them")
    search.add_argument("-k", type=int, default=5, help="passages per question (default 5)")
    search.add_argument("--mode", default="dense", choices=RETRIEVAL_MODES,
                        help="dense (the default), bm25, hybrid (both, by reciprocal rank "
                             "fusion) or weighted (both, by a weighted sum of scores, its weight "
                             "tuned at build); all but dense need an index built with --bm25")
    search.add_argument("--nprobe", type=int, default=None,
                        help="IVF lists searched (default: the index's tuned setting)")
    search.add_argument("--ef-search", type=int, default=None,
                        help="HNSW search breadth (default: the index's tuned setting)")
    search.add_argument("--json", action="store_true",
                        help="print one question's hits as JSON lines, each with its full text")
    search.add_argument("--device", default=None,
                        help="question encoder device: cpu, cuda or cuda:N (default: cuda if "
                             "available)")
    search.add_argument("--no-verify", action="store_true",
                        help="skip the SHA-256 check of the index files (sizes are still checked)")
    search.set_defaults(func=_Runs("index", "run_search"))

    evaluate = sub.add_parser(
        "eval", help="measure retrieval alone: recall@k against gold passage ids and answers",
        description="Measure an index's retrieval without a model: encode the questions of "
                    "--data with the question encoder the index records, search once at the "
                    "largest k, and report gold recall@k (the fraction of questions with gold "
                    "passage ids that have one among the top k) and answer recall@k (the "
                    "fraction of questions with answers that have one in a top-k passage), "
                    "beside what k random passages would score. The table is printed; --out "
                    "DIR also receives metrics.json and retrieval.jsonl (per question: gold "
                    "ids, retrieved ids, titles and scores, and the ranks that hit).")
    evaluate.add_argument("--data", required=True, metavar="FILE",
                          help="JSONL questions with 'answers' and/or gold passage ids "
                               "('positive_ids', 'gold' or 'passage_id': an id or a list of ids "
                               "as the passage file names its passages; or DPR's "
                               "'positive_ctxs' with 'passage_id'), or a TSV dataset (answers "
                               "only)")
    evaluate.add_argument("--index", required=True, metavar="DIR",
                          help="the index directory to evaluate")
    evaluate.add_argument("-k", default="1,5,20", metavar="K[,K...]",
                          help="the cut-offs, comma-separated (default 1,5,20); the index is "
                               "searched once at the largest")
    evaluate.add_argument("--out", metavar="DIR", default=None,
                          help="also write metrics.json and retrieval.jsonl here, atomically (a "
                               "new or empty folder, or one this command wrote before)")
    evaluate.add_argument("--mode", default="dense", metavar="MODE[,MODE...]",
                          help="dense (the default), bm25, hybrid or weighted (those three "
                               "need an index built with --bm25); several comma-separated, or "
                               "all (every mode the index can search), side by side")
    evaluate.add_argument("--nprobe", type=int, default=None,
                          help="IVF lists searched (default: the index's tuned setting)")
    evaluate.add_argument("--ef-search", type=int, default=None,
                          help="HNSW search breadth (default: the index's tuned setting)")
    evaluate.add_argument("--device", default=None,
                          help="question encoder device: cpu, cuda or cuda:N (default: cuda if "
                               "available)")
    evaluate.add_argument("--no-verify", action="store_true",
                          help="skip the SHA-256 check of the index files (sizes are still "
                               "checked)")
    evaluate.set_defaults(func=_Runs("index", "run_eval"))

    info = sub.add_parser(
        "info", help="describe an index directory",
        description="Describe an index directory: its passages, encoder, preset and search "
                    "settings, what a search of it runs here (on the CPU, as loaded) and what "
                    "DenseIndex.to('cuda') would run for CUDA queries with this faiss build.")
    info.add_argument("dir", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="check every file's SHA-256")
    info.set_defaults(func=_Runs("index", "run_info"))


def add_tokenizer(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tokenizer`` and its sub-command ``fit`` to the ``rag-fast`` command's subparsers."""
    tokenizer = subparsers.add_parser("tokenizer", help="fit a generator tokenizer to a corpus")
    sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="{fit}")
    fit = sub.add_parser(
        "fit", help="fit a byte-level BPE tokenizer to passages and QA files",
        description="Fit a byte-level BPE tokenizer to a corpus and save it as a folder that "
                    "`rag-fast init --generator-tokenizer` and transformers' AutoTokenizer "
                    "open. Decoding gives back exactly the text that was encoded (no "
                    "lower-casing, accents, spaces and punctuation kept, no unknown token), so "
                    "answers such as '3.7.15' or 'Saint-Étienne' survive. The special tokens "
                    "are BART's: <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> 4.")
    fit.add_argument("--passages", required=True, metavar="FILE",
                     help="The passages to fit on, as `rag-fast index build` reads them: a DPR "
                          ".tsv (id, text, title), a .jsonl, a .txt document or a folder of "
                          ".txt documents. Titles and texts are both used.")
    fit.add_argument("--data", action="append", default=[], metavar="QA.jsonl",
                     help="A QA file (JSONL with 'question' and 'answers', or TSV) whose "
                          "questions and answers are added to the text fitted on. Give the "
                          "option once per file.")
    fit.add_argument("--vocab-size", type=int, required=True, metavar="N",
                     help=f"The number of tokens, at least {MIN_VOCAB_SIZE} (the 256 byte "
                          f"values and 5 special tokens), at most {MAX_VOCAB_SIZE:,}. The tokenizer has fewer when the text "
                          "allows no more merges.")
    fit.add_argument("--out", required=True, metavar="DIR",
                     help="The folder to write. It must not exist, be empty, or (with "
                          "--overwrite) be a tokenizer folder this command wrote.")
    fit.add_argument("--overwrite", action="store_true",
                     help="Replace a tokenizer folder this command wrote at --out. A folder of "
                          "another kind, or one holding files the command did not write, is "
                          "never replaced.")
    fit.add_argument("--dedupe", action="store_true",
                     help="Keep the first passage of each repeated id, as `rag-fast index build "
                          "--dedupe` does (by default a repeated id is an error).")
    fit.add_argument("--no-progress", action="store_true",
                     help="Do not show the fitting's progress bars.")
    fit.set_defaults(func=_Runs("tokenizer", "run_fit"))


def add_reseal(subparsers: argparse._SubParsersAction) -> None:
    """Add ``reseal`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser(
        "reseal", help="accept hand edits of a model's rag_fast.json or an index's manifests",
        description="Every manifest rag_fast writes (an index directory's manifest.json and those "
        "of its passages/ and index/, a model directory's rag_fast.json) is sealed: an edit is "
        "refused on load. After editing one on purpose, reseal the folder to accept the edit. "
        "The other files must still match their recorded size and SHA-256: a corrupt data file "
        "is never sealed over.")
    p.add_argument("dir", metavar="DIR", help="an index directory, one of its parts, or a model "
                   "directory")
    p.set_defaults(func=_Runs("reseal", "run"))


def add_init(subparsers: argparse._SubParsersAction) -> None:
    """Add ``init`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser(
        "init", help="create a starting model directory from a question encoder and a generator",
        description="Create a model directory (a transformers RAG folder plus rag_fast.json) to "
                    "train from: a question encoder and a generator by Hugging Face name or "
                    "local folder; a generator JSON config file gives random weights.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--generator", metavar="NAME|DIR|FILE.json",
                        help="generator, seq2seq (BART, T5, ...) or decoder-only (Qwen2, Llama, "
                             "GPT-2, ...): name, folder, or a JSON config (random weights)")
    source.add_argument("--generator-from-encoder", metavar="NAME|DIR",
                        help="instead of --generator: warm-start an encoder-decoder from this "
                             "pretrained encoder (BERT, MiniLM, ...) on both sides, with its "
                             "tokenizer (docs/generators.md)")
    p.add_argument("--question-encoder", default=None, metavar="NAME|DIR",
                   help="question encoder (default: the --index's question encoder)")
    p.add_argument("--index", default=None, metavar="DIR",
                   help="index directory: its question encoder and pooling, recorded in the model")
    p.add_argument("--generator-tokenizer", default=None, metavar="NAME|DIR",
                   help="generator tokenizer (default: the generator's folder)")
    p.add_argument("--mode", choices=["token", "sequence"], default="token",
                   help="RAG-Token or RAG-Sequence (default token)")
    p.add_argument("--n-docs", type=int, default=5, help="passages per question (default 5)")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="epsilon (default 0)")
    p.add_argument("--max-context-length", type=int, default=128,
                   help="generator tokens per passage + question (default 128)")
    p.add_argument("--seed", type=int, default=0,
                   help="initialisation of a config generator, or of the weights a warm start "
                        "adds (cross-attention, LM head)")
    p.add_argument("--out", required=True, metavar="DIR", help="model directory to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a model directory at --out (never a folder of another kind or "
                        "one holding other files)")
    p.set_defaults(func=_Runs("init", "run"))


# the short flags: flag -> (the training config's dotted key, the value's type, its metavar)
SHORT_FLAGS = {"--max-steps": ("train.max_steps", int, "N"), "--lr": ("train.lr", float, "X"),
               "--micro-batch-size": ("train.micro_batch_size", int, "N"),
               "--seed": ("train.seed", int, "N"), "--threads": ("train.threads", int, "N")}


# what a short flag's help says beyond "the same as --set KEY=VALUE"
SHORT_HELP = {"--threads": " CPU threads for torch's ops and rag_fast's kernels, fixed (default: "
                           "RAG_FAST_THREADS if set, else adaptive: one per core, fewer while "
                           "other processes keep cores busy; docs/tuning.md)."}


def parse_value(text: str):
    """A --set value: JSON when it parses as JSON (numbers, true, false, null, lists,
    objects, quoted strings), else the text itself as a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text
    except RecursionError:
        raise ValueError(f"value {text[:40]!r}... is JSON nested too deeply") from None


class _Override(argparse.Action):
    """``--set KEY=VALUE`` and the short flags: each appends ``(key, value, option)`` to
    ``args.overrides`` in command-line order (a later one wins), ``option`` being how the
    command line said it (``--set train.lr=1e-4``, ``--lr 1e-4``), named in errors."""

    def __init__(self, option_strings, dest, key=None, kind=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.key, self.kind = key, kind

    def __call__(self, parser, namespace, values, option_string=None):
        if self.key is None:
            key, sep, text = values.partition("=")
            if not sep or not all(part.strip() == part and part for part in key.split(".")):
                raise argparse.ArgumentError(
                    self, f"expected KEY=VALUE with KEY a dotted path into the training config "
                          f"(such as train.lr=1e-4 or model.n_docs=3), got {values!r}")
            try:
                value = parse_value(text)
            except ValueError as e:  # JSON nested too deeply
                raise argparse.ArgumentError(self, str(e)) from None
            option = f"{option_string} {_shown(values)}"
        else:
            try:
                value = self.kind(values)
            except ValueError:
                raise argparse.ArgumentError(
                    self, f"invalid {self.kind.__name__} value: {values!r}") from None
            key, option = self.key, f"{option_string} {_shown(values)}"
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []),
                                       (key, value, option, [option_string, values])])


def _shown(value: str, most: int = 80) -> str:
    """An option's value as messages name it: a long one cut, its length said."""
    return value if len(value) <= most else f"{value[:most - 20]}...({len(value)} characters)"


def _schema_on_help(p: argparse.ArgumentParser) -> None:
    """``train --help`` ends with the config file's schema (TrainConfig's fields), made when
    the help is shown: TrainConfig loads torch, which building the parsers must not."""
    format_help = p.format_help

    def with_schema() -> str:
        if p.epilog is None:
            p.epilog = importlib.import_module("rag_fast.training.run").schema_help()
        return format_help()

    p.format_help = with_schema


def add_train(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser("train", help="train a model directory (JSON config)",
                              description="rag-fast train: train a model directory on "
                                          "question-answer data from a JSON config.",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _schema_on_help(p)
    p.add_argument("--config", required=True, metavar="FILE", help="JSON training configuration")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory to start from")
    p.add_argument("--index", default=None, metavar="DIR", help="index directory to retrieve from")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where checkpoints, metrics, plot and the trained model/ go")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK when CUDA is available)")
    p.add_argument("--set", action=_Override, dest="overrides", metavar="KEY=VALUE",
                   help="Set a value of the training config by its dotted key path, such as "
                        "train.lr=1e-4, model.n_docs=3, index.verify=false or data.train=FILE, "
                        "after the file is read and before it is checked; repeat it for more "
                        "values (a later one wins). The value is read as JSON when it parses "
                        "(numbers, true, false, null, lists, quoted strings), else taken as a "
                        "string. A path it gives is relative to the current folder, and an "
                        "error about its value names this option.")
    for flag, (key, kind, metavar) in SHORT_FLAGS.items():
        p.add_argument(flag, action=_Override, dest="overrides", key=key, kind=kind,
                       metavar=metavar,
                       help=f"The same as --set {key}={metavar}.{SHORT_HELP.get(flag, '')}")
    p.set_defaults(func=_Runs("train", "run"), overrides=[])


def add_decoding_options(p: argparse.ArgumentParser) -> None:
    """The decoding options ``eval`` and ``generate`` share, with their one default."""
    p.add_argument("--num-beams", type=int, default=DEFAULT_BEAMS,
                   help=f"beams (default {DEFAULT_BEAMS}, in eval and generate alike; 1: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                   help=f"longest answer in tokens (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--decoding", choices=["thorough", "fast"], default="thorough",
                   help="RAG-Sequence decoding (default thorough)")
    p.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample instead of searching; --no-do-sample searches (default: the "
                        "model's generation config)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k best (0: off)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1: off)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalise tokens already in the sequence (1: off; a decoder-only "
                        "generator counts the prompt's tokens too)")
    p.add_argument("--no-repeat-ngram-size", type=int, default=None,
                   help="never repeat an n-gram of this size (0: off)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling draws (default: torch's global generator)")


def add_eval(subparsers: argparse._SubParsersAction) -> None:
    """Add ``eval`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser("eval", help="evaluate a model or predictions (EM, F1, BLEU-1, "
                              "ROUGE-L, recall@K)", description="rag-fast eval: "
                              "score a model directory, or a file of predictions, on a QA dataset.")
    p.add_argument("--data", required=True, help="JSONL (question, answers) or TSV dataset")
    p.add_argument("--predictions", help="one predicted answer per line, in dataset order")
    p.add_argument("--model", metavar="DIR", help="model directory (or rag-fast train's output)")
    p.add_argument("--index", metavar="DIR", default=None,
                   help="index directory (default: the one the model records)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="with --model: where predictions.jsonl and metrics.json go (default "
                        "eval-<data name>)")
    p.add_argument("--n-docs", type=int, default=None, metavar="N",
                   help="passages retrieved and marginalised over per question (default: the "
                        "model's n_docs); at least 1 and at most the index's passage count")
    p.add_argument("--retrieval-mode", default="dense", choices=RETRIEVAL_MODES,
                   help="how passages are found: dense (the default), bm25, hybrid (both, by "
                        "reciprocal rank fusion) or weighted (by a tuned weighted sum); the "
                        "passage prior stays the dense score; all but dense need an index "
                        "built with --bm25")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--batch-size", type=int, default=16)
    add_decoding_options(p)  # the same options and default as `rag-fast generate`
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.set_defaults(func=_Runs("eval", "run"))


def add_generate(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` sub-command (sets ``func``)."""
    p = subparsers.add_parser("generate", help="answer questions with a model directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--question", help="one question")
    src.add_argument("--questions", metavar="FILE", help="JSONL file, one {'question': ...} a line")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model directory (rag-fast init/train, or a transformers RAG folder)")
    p.add_argument("--index", metavar="DIR", default=None,
                   help="index directory (default: the one the model records; else passages "
                        "from the JSONL)")
    p.add_argument("--n-docs", type=int, default=None, metavar="N",
                   help="passages retrieved (or read from a question's 'passages') and "
                        "marginalised over per question (default: the model's n_docs); at "
                        "least 1 and at most the index's passage count")
    p.add_argument("--retrieval-mode", default="dense", choices=RETRIEVAL_MODES,
                   help="how passages are found: dense (the default), bm25, hybrid (both, by "
                        "reciprocal rank fusion) or weighted (by a tuned weighted sum); the "
                        "passage prior stays the dense score; all but dense need an index "
                        "built with --bm25")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="generator tokenizer, when the model directory has none")
    add_decoding_options(p)  # the same options and default as `rag-fast eval`
    p.add_argument("--batch-size", type=int, default=8, help="questions decoded together")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--out", metavar="FILE", default=None, help="write JSONL here (default stdout)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timings", action="store_true",
                   help="say on stderr where the time went, stage by stage, from the process's "
                        "start (imports) to the answers written")
    p.set_defaults(func=_Runs("generate", "run"))


def add_serve(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` sub-command (sets ``func``)."""
    p = subparsers.add_parser("serve", help="answer questions over HTTP (docs/serving.md)")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model directory (rag-fast init/train, or a training run's folder)")
    p.add_argument("--index", metavar="DIR", default=None,
                   help="index directory (default: the one the model records)")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, metavar="N", default=8000,
                   help="port (default 8000; 0: any free one)")
    p.add_argument("--max-batch", type=int, metavar="N", default=16,
                   help="questions decoded together at most (default 16)")
    p.add_argument("--max-wait-ms", type=float, metavar="MS", default=5.0,
                   help="how long a request waits for others to join its batch (default 5)")
    p.add_argument("--max-queue", type=int, metavar="N", default=1024,
                   help="questions waiting at most; more get 503 (default 1024)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", default=60.0,
                   help="seconds a request may take before 504 (default 60)")
    p.add_argument("--max-n-docs", type=int, metavar="N", default=32,
                   help="largest n_docs a request may ask (default 32)")
    p.add_argument("--max-beams", type=int, metavar="N", default=8,
                   help="largest num_beams a request may ask (default 8)")
    p.add_argument("--max-new-tokens", type=int, metavar="N", default=128,
                   help="largest max_new_tokens a request may ask (default 128)")
    p.add_argument("--admin-token-file", metavar="FILE", default=None,
                   help="file whose first line is the token of the admin routes (index swap); "
                        "without it they are off")
    p.add_argument("--index-root", metavar="DIR", default=None,
                   help="the folder whose index directories the admin routes may load")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--retrieval-mode", default="dense", choices=RETRIEVAL_MODES,
                   help="how passages are found: dense (the default), bm25, hybrid or "
                        "weighted (an index built with --bm25; an index swapped in needs one "
                        "too)")
    p.add_argument("--log-requests", action="store_true", help="one log line per request")
    p.set_defaults(func=_Runs("serve", "run"))


# top-level command -> its registrar (the order of `rag-fast --help`)
COMMANDS = {"index": add_index, "tokenizer": add_tokenizer, "reseal": add_reseal, "init": add_init,
            "train": add_train, "eval": add_eval, "generate": add_generate, "serve": add_serve}

__all__ = ["COMMANDS", "SEARCH_TEXT_CHARS", "add_decoding_options", "parse_value"]
