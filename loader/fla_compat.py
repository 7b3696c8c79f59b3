"""fla-compatible entry point: switch with one import line.

    - from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    + from gdn_aot.loader.fla_compat import chunk_gated_delta_rule

Same positional order and keywords as fla 0.6.0, including the gating in the kernels (use_gate_in_kernel with
A_log and dt_bias, use_beta_sigmoid_in_kernel). fla features that change the math and are not built here
(context parallel) raise NotImplementedError rather than computing something else;
chunk_indices and chunk_size=64 are accepted and unneeded. Other keyword arguments are ignored, as fla ignores
them (transformers' Qwen3.5 layer passes its own, such as use_cache).
"""
from __future__ import annotations

import torch

from .api import chunk_gated_delta_rule as _forward
from .validate import check_bounds


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context=None,
    **kwargs,
):
    """fla's chunk_gated_delta_rule, run by gdn_aot's AOT kernels. Returns (o, final_state or None).

    With cu_seqlens_cpu (fla's host copy) the sequence bounds are validated for free, without a device sync.
    """
    if cp_context is not None:
        raise NotImplementedError("gdn_aot does not implement fla's context parallelism (cp_context)")
    if kwargs.pop("chunk_size", 64) != 64:
        raise NotImplementedError("gdn_aot's kernels use chunk_size=64")
    state_v_first = kwargs.pop("transpose_state_layout", state_v_first)
    head_first = kwargs.pop("head_first", False)  # vLLM's vendored fla passes head_first=False
    use_gate_in_kernel = kwargs.pop("use_gate_in_kernel", False)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    if cu_seqlens_cpu is not None:
        check_bounds(cu_seqlens_cpu.tolist(), q.shape[1])
    return _forward(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    cu_seqlens=cu_seqlens, transpose_state=state_v_first, head_first=head_first,
                    use_gate_in_kernel=use_gate_in_kernel, A_log=A_log if use_gate_in_kernel else None,
                    dt_bias=dt_bias if use_gate_in_kernel else None,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)

