"""Type stub for the raw-buffer C++ extension. Call rag_fast.ops, not this module."""

def simd_level() -> str: ...
def vector_bytes() -> int: ...
def num_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def bits_unmask(bits: int, elem_bytes: int, n: int, one: int, out: int) -> bool: ...
def bits_mask(src: int, elem_bytes: int, n: int, one: int, out: int) -> bool: ...
def row_stats(
    x: int, dtype: int, B: int, K: int, T: int, V: int, sb: int, sk: int, st: int,
    targets: int, ignore_index: int, lse: int, x_tgt: int, x_sum: int,
) -> None: ...
def row_grad(
    x: int, dtype: int, B: int, K: int, T: int, V: int, sb: int, sk: int, st: int,
    targets: int, ignore_index: int, lse: int, c_p: int, c_y: int, c_1: int,
    out: int, ob: int, ok: int, ot: int,
) -> None: ...
def token_smooth_forward(
    x: int, dtype: int, B: int, K: int, T: int, V: int, sb: int, sk: int, st: int,
    targets: int, ignore_index: int, a: int, lse: int, x_tgt: int, x_sum: int, sum_m: int,
    rho: int,
) -> None: ...
def token_smooth_stats(
    x: int, dtype: int, B: int, K: int, T: int, V: int, sb: int, sk: int, st: int,
    a: int, lse: int, sum_m: int, rho: int,
) -> None: ...
def token_smooth_grad(
    x: int, dtype: int, B: int, K: int, T: int, V: int, sb: int, sk: int, st: int,
    targets: int, ignore_index: int, a: int, lse: int, c_p: int, c_y: int, c_1: int, c_r: int,
    out: int, ob: int, ok: int, ot: int,
) -> None: ...
def token_marginal(
    x: int, dtype: int, B: int, K: int, T: int, V: int, sb: int, sk: int, st: int,
    a: int, lse: int, marginal: int,
) -> None: ...
def token_marginal_grad(
    x: int, dtype: int, B: int, K: int, T: int, V: int, sb: int, sk: int, st: int,
    a: int, lse: int, marginal: int, grad_marginal: int, c: int,
    out: int, ob: int, ok: int, ot: int,
) -> None: ...
def rag_token_beam_step(
    x: int, dtype: int, B: int, W: int, K: int, V: int, sb: int, sw: int, sk: int,
    log_prior: int, beam_scores: int, bias: int, n: int,
    out_scores: int, out_beams: int, out_tokens: int,
) -> None: ...
def inner_products(
    q: int, B: int, ldq: int, x: int, N: int, ldx: int, d: int, out: int, ldo: int,
) -> None: ...

INNER_PRODUCTS_PARALLEL_WORK: int
