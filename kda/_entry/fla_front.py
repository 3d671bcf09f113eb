"""The docstrings of the fla-style functions of the adapters (:func:`kda.torch.chunk_kda`,
:func:`kda.torch.fused_recurrent_kda` and :mod:`kda.jax`'s), which write out fla 0.6's exact
signatures (:data:`kda._entry.fla.CHUNK_PARAMS`, :data:`~kda._entry.fla.RECURRENT_PARAMS`)."""

from __future__ import annotations

__all__ = ["CHUNK_DOC", "RECURRENT_DOC"]

CHUNK_DOC = """KDA, chunked, differentiable; fla 0.6's ``fla.ops.kda.chunk_kda`` signature and semantics
({framework}).

    Parameters
    ----------
    q, k : {array}, shape ``[B, T, H, K]``
    v : {array}, shape ``[B, T, HV, V]``
        ``HV`` a multiple of ``H``: value head ``i`` reads q/k head ``i // (HV // H)``.
    g : {array}, shape ``[B, T, HV, K]``
        Log decays (``<= 0``), or the raw gate with ``use_gate_in_kernel=True``.
    beta : {array}, shape ``[B, T, HV]``
        Step sizes, or their logits with ``use_beta_sigmoid_in_kernel=True``.
    scale : float, optional
        Query scale; ``K ** -0.5`` when None.
    initial_state : {array}, shape ``[N, HV, K, V]``, optional
        ``N = B``, or the number of sequences with ``cu_seqlens``; ``[N, HV, V, K]`` with
        ``state_v_first``.
    output_final_state : bool
        Return the final state (same shape as ``initial_state``), else None.
    use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound
        The model-level options, as in fla: see :data:`kda._entry.fla.KEYWORD_TABLE`.
    safe_gate, disable_recompute, cu_seqlens_cpu, use_graph, max_num_seqs
        Accepted; no effect on the result (they choose among fla's kernels).
    return_intermediate_states : bool
        Also return ``h [B, NT, HV, K, V]`` (``[B, NT, HV, V, K]`` with ``state_v_first``), the
        state at the start of every chunk (``h[:, 0]`` is the initial state; the final state is
        not in ``h``); with ``cu_seqlens``, ``B == 1`` and ``NT = sum(ceil(len_i / chunk_size))``
        in packed chunk order, as fla. dtype of ``k`` (as fla; the states are computed in
        float32). Differentiable (fla's is inference-only); also in inference mode.
    cp_context : KdaCPContext, optional
        Context parallelism (:func:`kda.torch.build_cp_context`; PyTorch only): this rank's slice
        of a packed ``B == 1`` batch; ``cu_seqlens`` is taken from the context.
    state_v_first : bool
        States as ``[N, HV, V, K]``.
    cu_seqlens : {array}, shape ``[N + 1]``, optional
        Offsets of packed sequences (``B == 1``).
    **kwargs
        ``A_log [HV]``, ``dt_bias`` (``HV * K`` elements), ``chunk_size`` (default 64) and the
        deprecated ``transpose_state_layout``; anything else raises ``TypeError``.

    Returns
    -------
    tuple
        ``(o [B, T, HV, V], final_state or None)``, and ``h`` with
        ``return_intermediate_states=True``; ``o`` has the dtype of ``q``, the state is float32
        (float64 for float64 inputs).
    """

RECURRENT_DOC = """KDA step by step (:func:`kda.recurrent_kda`), differentiable; fla 0.6's
    ``fla.ops.kda.fused_recurrent_kda`` signature (``A_log``, ``dt_bias`` are positional there).

    The arguments are those of :func:`chunk_kda`. ``**kwargs`` takes the deprecated
    ``transpose_state_layout`` and the keywords of ``chunk_kda`` that have no effect on a
    recurrence (``safe_gate, disable_recompute, cu_seqlens_cpu, use_graph, max_num_seqs,
    chunk_size``, and ``return_intermediate_states=False``, ``cp_context=None``), so that one
    keyword dict serves both ops; anything else raises ``TypeError``. ``A_log`` and ``dt_bias``
    are read by element count as in :func:`chunk_kda`. The output has the dtype of ``v`` (as
    fla's), the final state float32 (float64 for float64 inputs). Unlike fla's, this one has a
    backward (:func:`kda.recurrent_kda_backward`).
    """
