"""The compiled extension end to end, its loader's fallback, and `python -m rag_fast.info`."""
from __future__ import annotations

import os
import re

import torch

from utils import requires_ext, run_python


@requires_ext
def test_row_stats_through_python():
    from rag_fast import _ext
    from rag_fast.ops.rag_losses import cpp as _cpp

    C = _ext.get()
    assert C.simd_level() in {"generic", "avx2", "avx512"}
    assert C.num_threads() >= 1
    x = torch.randn(2, 3, 4, 37)
    y = torch.randint(0, 37, (2, 4))
    y[0, 1] = -100
    lse, x_tgt, x_sum = _cpp.row_stats(x, y, -100)
    assert lse.dtype == torch.float64  # max + log(sum), never rounded at the logits' size
    torch.testing.assert_close(lse, torch.logsumexp(x.double(), -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x_sum, x.sum(-1))
    expected = x.gather(-1, y.clamp(min=0)[:, None, :, None].expand(-1, 3, -1, 1)).squeeze(-1)
    expected[0, :, 1] = 0  # ignored target
    torch.testing.assert_close(x_tgt, expected)


_MISSING_EXTENSION = """
import sys, warnings
sys.modules["rag_fast._C"] = None  # makes `import rag_fast._C` fail like a missing build
import torch
with warnings.catch_warnings(record=True) as caught:  # at import (from a checkout) or first use
    warnings.simplefilter("always")
    import rag_fast
    from rag_fast import _ext
    x = torch.randn(2, 3, 4, 5); s = torch.randn(2, 3); y = torch.randint(0, 5, (2, 4))
    for _ in range(3):
        loss = rag_fast.rag_token_nll(x, s, y)  # impl="auto" falls back to the reference
    ref = rag_fast.reference.rag_token_nll(x, s, y)
assert torch.equal(loss, ref)
messages = [str(w.message) for w in caught if "extension unavailable" in str(w.message)]
assert len(messages) == 1, messages  # reported once
assert "pip install" in messages[0]  # with the fix
try:
    rag_fast.rag_token_nll(x, s, y, impl="cpp")
except _ext.ExtensionUnavailableError as e:
    assert "pip install" in str(e)
else:
    raise AssertionError("impl='cpp' must raise without the extension")
print("fallback ok")
"""


def test_missing_extension_warns_once_and_falls_back():
    out = run_python(["-c", _MISSING_EXTENSION], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "fallback ok" in out.stdout


@requires_ext
def test_info_reports_backends():
    out = run_python(["-m", "rag_fast.info"], timeout=120)
    assert out.returncode == 0, out.stderr
    # Each line is "key<two or more spaces>value".
    lines = dict(re.match(r"^(.+?)\s{2,}(.*)$", line).groups() for line in out.stdout.splitlines())
    for key in ("rag_fast", "torch", "transformers", "faiss", "triton", "C++ SIMD level",
                "Triton kernels", "CUDA", "faiss GPU"):
        assert key in lines, f"{key!r} missing from rag_fast.info output"
    assert lines["C++ extension"] == "available"


@requires_ext
def test_simd_cap_selects_generic_variant():
    variant = "generic"
    code = "import rag_fast._C as C; print(C.simd_level())"
    out = run_python(["-c", code], env={**os.environ, "RAG_FAST_SIMD": variant}, timeout=60)
    assert out.stdout.strip() == variant, out.stderr
