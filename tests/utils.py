"""The one tolerance rule and the helpers the tests share.

Tolerance rule, per element i of a kernel's output ``actual`` against the float64 ``oracle``
and the ``plain`` PyTorch version of the same formula computed in the kernel's dtype:

    |actual_i - oracle_i| <= 2 |plain_i - oracle_i| + RTOL[dtype] (|oracle_i| + mean_j |oracle_j|)

The floor is scaled to each element plus the tensor's mean magnitude, never to its largest
value. The mean term covers entries that are sums cancelling to (almost) 0 (a target entry
-w (1 - P_y) at small V, a gradient with respect to the scores); at V = 50265 a logit
gradient's mean is about 2/V of its row's weight, far below a typical entry (about 1/V), so
every entry is checked relative to its own size and a kernel that zeroes or perturbs a small
fraction of them fails (tests/test_tolerance_rule.py plants such errors). A tensor that is 0
everywhere in float64 (every output at V = 1, where each element is a sum of O(1) terms that
cancel exactly) has no size of its own: its mean is taken as 1, the unit of the tests' inputs.
Matching infinities and NaNs count as equal; any other infinity or NaN fails.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Relative floor per dtype: about 80 units in the last place for float32 (exp and log of
# arguments near 100, long sums), two for bf16 and fp16 outputs (rounded once, possibly to the
# other neighbour than the plain version).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-9, torch.float64: 1e-12}
_ZERO = 1e-12  # a float64 mean below this is a sum of O(1) terms cancelling to 0


def elementwise_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` in float64, 0 where both are the same infinity or both NaN, inf where only
    one of them is NaN."""
    a, b = a.double(), b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return torch.where(same, torch.zeros_like(a), (a - b).abs().nan_to_num(nan=float("inf")))


def tolerance_violations(
    actual: torch.Tensor, plain: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype,
    atol: float = 0.0,
) -> torch.Tensor:
    """Boolean mask of the elements where ``actual`` breaks the tolerance rule (plus ``atol``)."""
    oracle_abs = oracle.double().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    mean_abs = float(oracle_abs.mean()) if oracle_abs.numel() else 0.0
    mean_abs = mean_abs if mean_abs > _ZERO else 1.0
    bound = 2 * elementwise_error(plain, oracle) + RTOL[dtype] * (oracle_abs + mean_abs) + atol
    return ~(elementwise_error(actual, oracle) <= bound)


def assert_close_rule(
    actual: torch.Tensor, plain: torch.Tensor, oracle: torch.Tensor, dtype: torch.dtype,
    what: str, atol: float = 0.0,
) -> None:
    """Assert the tolerance rule (module docstring) for every element; the message names the
    worst element. ``atol``: an absolute floor added to the bound, only for a tensor whose
    elements are O(1) terms cancelling to about 0 (the caller says which)."""
    assert actual.shape == oracle.shape, f"{what}: shape {actual.shape} != {oracle.shape}"
    assert plain.shape == oracle.shape, f"{what}: plain shape {plain.shape} != {oracle.shape}"
    bad = tolerance_violations(actual.cpu(), plain.cpu(), oracle.cpu(), dtype, atol)
    if bool(bad.any()):
        err = elementwise_error(actual.cpu(), oracle.cpu())
        i = int(torch.where(bad.flatten(), err.flatten(), -1.0).argmax())
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), oracle.shape))
        got, want = actual.flatten()[i].item(), oracle.flatten()[i].item()
        plain_i = plain.flatten()[i].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of tolerance; worst at "
            f"{idx}: got {got:.9g}, oracle {want:.9g}, plain {plain_i:.9g}"
        )


def ext_available() -> bool:
    from rag_fast import _ext

    return _ext.available()


def triton_cpu_available() -> bool:
    from rag_fast.kernels import triton_usable_for

    return triton_usable_for("cpu")


requires_ext = pytest.mark.requires_ext
requires_triton = pytest.mark.requires_triton
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def requires_cuda(test):
    """Decorator: the test needs a CUDA device. Skipped without one; ``-m requires_cuda``
    selects exactly these (the GPU lane, benchmarks/gpu_check.sh)."""
    return pytest.mark.requires_cuda(_NO_CUDA(test))

IN_CI = os.environ.get("CI") == "true"


def run_python(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` in the tests folder, so the child imports the installed rag_fast, not
    the source checkout (which has no compiled extension after a non-editable install)."""
    return subprocess.run([sys.executable, *args], cwd=os.path.dirname(os.path.abspath(__file__)),
                          capture_output=True, text=True, **kwargs)


# The C++ kernels' instruction-set variants, weakest first; a CPU runs the best one it supports
# (what rag_fast._C.simd_level() reports) and every weaker one (RAG_FAST_SIMD caps the choice).
SIMD_VARIANTS = ["generic", "avx2", "avx512"]


def run_in_simd_variant(variant: str, script: str, timeout: float = 600) -> None:
    """Run ``script`` (Python source; it must print ``ok`` last) in a child with
    ``RAG_FAST_SIMD=variant`` and the tests folder importable; skips when this CPU cannot run
    ``variant``, fails with the child's stderr otherwise unless it printed ``ok``."""
    import rag_fast._C as C

    if variant not in SIMD_VARIANTS[: SIMD_VARIANTS.index(C.simd_level()) + 1]:
        pytest.skip(f"this CPU cannot run the {variant} variant")
    here = os.path.dirname(os.path.abspath(__file__))
    prelude = ("import sys, rag_fast._C as C\n"
               "assert C.simd_level() == sys.argv[1], C.simd_level()\n")
    env = dict(os.environ, RAG_FAST_SIMD=variant,
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    proc = run_python(["-c", prelude + script, variant], env=env, timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def save_tiny_bert(root, words=()) -> str:
    """A tiny random BERT encoder and its word-level tokenizer saved in the folder ``root``
    (what ``--encoder`` takes), knowing ``words`` (and its 5 special tokens and "."); returns
    the folder as a string. (The vocabulary is given as ``vocab=``: transformers 5 ignores
    ``vocab_file=``, and its tokenizer would hold the special tokens alone, which every
    encoder and generator path refuses.)"""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    vocab = Path(root) / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *words]) + "\n")
    tok = BertTokenizerFast(vocab=str(vocab))
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32))
    model.save_pretrained(str(root))
    tok.save_pretrained(str(root))
    return str(root)

