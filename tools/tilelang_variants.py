"""Experimental variants of the TileLang forward, as source patches of the rendered module (the product
template stays as it is until a variant wins on the GPU; see tools/tilelang_probe.py --variant).

(pingpong, session 4's variant, is the product's `pingpong` tunable since session 10.)
precise   the product kernel compiled without nvcc's fast math (tilelang_backend.FAST_MATH), as before
          session 6: exp2f with its denormal range check.
static    without warp specialisation at every thread count (TileLang's cp.async pipeline), with a
          static loop extent: every list slot is a step, the steps past the list's sub-blocks fully
          masked. TileLang 0.1.15 generates no code for that pipeline with 2+ stages over the dynamic
          extent (session 8); with a static one it does. No setmaxnreg (there is no producer).
          Rejected (docs/PERF.md, session 8, call 6): 25-28% slower at 256 threads, and no gain at 128.
poly1     FlashAttention-4's exp2 on the FMA pipe: in the steps that need no mask, the scores of one
poly2     column group of 8 in every 4 (poly1) or 2 in 4 (poly2) take a degree-3 polynomial instead of
          MUFU's ex2 (which does 16 per clock per SM: as fast as D=64 gemms consume scores).
          2^x = 2^round(x) * P(x - round(x)); round(x) by adding 1.5 * 2^23, whose low mantissa bits
          then hold it, shifted into the exponent by an integer add. P's max relative error 7.5e-5.
          The column group (j // 8) of a wgmma accumulator element is fixed per register, so the choice
          costs nothing at run time. Masked steps keep ex2 (x = -inf there must give 0).
          Rejected (docs/PERF.md, session 9, calls 1 and 2): slower in every config.
lazy      FlashAttention-4's conditional rescaling: a row keeps its running max until a block's max
          exceeds it by more than 8 (log2 units; P then stays <= 256, exact in fp32 and as exact in
          bf16), so alpha is exactly 1 for most steps; a thread skips the O rescale (head_dim * rows /
          threads multiplies) when both its rows have alpha 1. Rejected (docs/PERF.md, session 9, call 7):
          within 1% of the product best against best; TileLang 0.1.15 does not compile it in the
          one-warpgroup cp.async loop.
"""

STATIC = {
    "            if threads == 256:\n                T.annotate_producer_reg_dealloc(24)":
        "            if False:\n                T.annotate_producer_reg_dealloc(24)",
    "needs_mask = (n_visit == 0) |": "needs_mask = (it >= n_visit) |",
    "visible = (n_visit > 0) &": "visible = (it < n_visit) &",
    "for it in T.Pipelined(n_steps + 1, num_stages=num_stages):": "for it in T.Pipelined(n_slots + 1, num_stages=num_stages):",
    "k_prev = kv_starts[T.max(it - 1, 0)]": "k_prev = kv_starts[T.min(T.max(it - 1, 0), n_steps - 1)]",
    # the overlapped loop's softmax and rescale run for every slot, then the drain
    "                    if it < n_steps:\n": "                    if it < n_slots:\n",
    "for it in T.Pipelined(n_steps, num_stages=num_stages):\n                    k0 = kv_starts[it]":
        "for it in T.Pipelined(n_slots, num_stages=num_stages):\n                    k0 = kv_starts[T.min(it, n_steps - 1)]",
}

EXP2_POLY = r"""
__device__ __forceinline__ float kg_exp2_poly(float x) {
  x = fmaxf(x, -126.0f);  // finite x only; the result is ~1e-38 below this, not 0
  float t = __fadd_rn(x, 12582912.0f);  // 1.5 * 2^23: round(x) in the low mantissa bits
  float f = __fsub_rn(x, __fsub_rn(t, 12582912.0f));  // in [-0.5, 0.5]
  float p = fmaf(fmaf(fmaf(0.0551716648042202f, f, 0.2426111251115799f), f, 0.6932609677314758f), f,
                 0.9999280571937561f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}
"""


def _poly(lanes: int) -> dict:
    exp2 = "acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - scores_shift[i])"
    x = "acc_s[i, j] * scale_log2 - scores_shift[i]"
    patches = {
        "LN2 = 0.6931471805599453\n": f"LN2 = 0.6931471805599453\nEXP2_POLY = {EXP2_POLY!r}\n",
        "threads=threads) as (bx, by, bz):": "threads=threads, prelude=EXP2_POLY) as (bx, by, bz):",
    }
    for indent in (20, 24):  # the softmax step in the plain and in the overlapped loop
        pad = " " * indent
        patches[f"{pad}for i, j in T.Parallel(block_M, block_N):\n{pad}    {exp2}\n"] = (
            f"{pad}if needs_mask:\n{pad}    for i, j in T.Parallel(block_M, block_N):\n{pad}        {exp2}\n"
            f"{pad}else:\n{pad}    for i, j in T.Parallel(block_M, block_N):\n"
            f"{pad}        acc_s[i, j] = T.if_then_else((j // 8) % 4 < {lanes}, "
            f"T.call_extern(\"float32\", \"kg_exp2_poly\", {x}), T.exp2({x}))\n")
    return patches


def _lazy() -> dict:
    rescale = "acc_o[i, d] *= scores_scale[i]"
    patches = {
        '            n_visit = T.alloc_var("int32")\n':
            '            n_visit = T.alloc_var("int32")\n            rescale = T.alloc_var("int32")\n',
        "scores_shift[i] = T.if_then_else(scores_max[i] == neg_inf, 0, scores_max[i] * scale_log2)":
            "scores_max[i] = T.if_then_else(scores_max[i] * scale_log2 > scores_max_prev[i] * scale_log2 + 8.0, "
            "scores_max[i], scores_max_prev[i]); "
            "scores_shift[i] = T.if_then_else(scores_max[i] == neg_inf, 0, scores_max[i] * scale_log2)",
    }
    for indent in (20, 24):  # the rescale in the plain and in the overlapped loop
        pad = " " * indent
        patches[f"{pad}for i, d in T.Parallel(block_M, head_dim):\n{pad}    {rescale}\n"] = (
            f"{pad}rescale = 0\n{pad}for i in T.Parallel(block_M):\n{pad}    if scores_scale[i] != 1.0:\n"
            f"{pad}        rescale = 1\n{pad}if rescale != 0:\n"
            f"{pad}    for i, d in T.Parallel(block_M, head_dim):\n{pad}        {rescale}\n")
    return patches


VARIANTS = {"precise": {}, "static": STATIC, "poly1": _poly(1), "poly2": _poly(2),
            "lazy": _lazy()}
# variants timed on the product's own configs (the others: their VARIANT_CONFIGS, else the overlapped
# two-warpgroup configs)
ON_PRODUCT_CONFIGS = {"poly1", "poly2", "lazy"}
# compile options of a variant (keyword arguments of tilelang_backend.compile_kernel)
COMPILE_OPTIONS = {"precise": {"pass_configs": {"tl.enable_fast_math": False}},
                   "static": {"pass_configs": {"tl.enable_fast_math": True, "tl.disable_warp_specialized": True}}}
# the configs a variant is timed with (default: the product's overlapped 256-thread ones)
VARIANT_CONFIGS = {"static": lambda rows, head_dim: [(rows, stages, 2 * rows, overlap) for stages in (1, 2, 3)
                                                     for overlap in (False, True) if head_dim > 64 or stages < 3]}


def patch(source: str, variant: str) -> str:
    """Every occurrence of each patch's text replaced (the softmax step appears in both loops)."""
    for old, new in VARIANTS[variant].items():
        if old not in source:
            raise ValueError(f"variant {variant!r}: the rendered forward changed, cannot patch {old[:60]!r}")
        source = source.replace(old, new)
    return source
