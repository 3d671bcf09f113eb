"""The parts of :mod:`kda.torch`, one job each: :mod:`~kda._torch.convert` (tensors to arrays and
back), :mod:`~kda._torch.ops` (the ``torch.ops.kda`` custom ops, their fake implementations and
the autograd formula), :mod:`~kda._torch.cp` (context parallelism over ``torch.distributed``).
:mod:`kda.torch` itself is the fla-style front (``chunk_kda``, ``fused_recurrent_kda``)."""
