"""The fused RMSNorm: a written-out ``x·rsqrt(mean(x²) + eps)·scale``
(:mod:`.pattern`), run as one op with float32 statistics (:mod:`.rule`)."""
