"""Experimental variants of the TileLang forward, as source patches of the rendered module (the product
template stays as it is until a variant wins on the GPU; see tools/tilelang_probe.py --variant).

pingpong  FlashAttention-3's inter-warpgroup schedule on top of `overlap`: the two consumer warpgroups
          take turns issuing their gemms (named barriers 8 and 9), so one's softmax runs while the
          other's gemms own the tensor cores.
precise   the product kernel compiled without nvcc's fast math (tilelang_backend.FAST_MATH), as before
          session 6: exp2f with its denormal range check.
"""

PINGPONG = {
    # the consumer warpgroup of each thread; warpgroup 1 lets warpgroup 0 issue first
    """            n_steps = T.max(n_visit, 1)
""": """            n_steps = T.max(n_visit, 1)
            wg = T.get_thread_binding(0) // 128
""",
    """                    T.wgmma_gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                                 clear_accum=True)
                    T.wgmma_gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)
""": """                    if threads == 256:
                        if (wg == 1) & (it == 0):
                            T.named_barrier_arrive(8, 256)  # warpgroup 0 goes first
                        # my turn (an extern call: the pipeline pass leaves it in the consumer's loop)
                        T.call_extern("handle", "tl::__sync_thread_partial", 8 + wg, 256)
                    T.wgmma_gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                                 clear_accum=True)
                    T.wgmma_gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)
                    if threads == 256:
                        if (wg == 0) | (it < n_steps):  # the other's turn (warpgroup 1's last one is unmatched)
                            T.named_barrier_arrive(9 - wg, 256)
""",
}

VARIANTS = {"pingpong": PINGPONG, "precise": {}}
# compile options of a variant (keyword arguments of tilelang_backend.compile_kernel)
COMPILE_OPTIONS = {"precise": {"pass_configs": {"tl.enable_fast_math": False}}}


def patch(source: str, variant: str) -> str:
    for old, new in VARIANTS[variant].items():
        if source.count(old) != 1:
            raise ValueError(f"variant {variant!r}: the rendered forward changed, cannot patch {old[:60]!r}")
        source = source.replace(old, new)
    return source
