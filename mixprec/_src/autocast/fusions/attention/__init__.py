"""The fused attention: a written-out scaled ``q·kᵀ``, softmax and ``·v``
(:mod:`.pattern`), run as one kernel where the platform has one (:mod:`.rule`)."""
