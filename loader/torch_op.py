"""``torch.ops.gdn_aot.chunk_gated_delta_rule``: the forward as a registered torch custom op.

With its fake (meta) implementation, torch.compile traces through the call without a graph break; the op
itself launches with no host synchronisation, so it also captures into a torch.cuda.CUDAGraph. Importing
this module registers the op (gdn_aot.loader.torch_op). Returns (o, final_state), final_state being an empty
[0] tensor when output_final_state is False (custom ops return tensors, not None). Like the state pool, the
state checkpoints (written in place) are the native call's: an optional mutated argument left at its default
breaks torch's in-place bookkeeping of a custom op called positionally.
"""
from __future__ import annotations

import torch

from .api import chunk_gated_delta_rule


@torch.library.custom_op("gdn_aot::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None, transpose_state: bool = False,
    use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                   transpose_state=transpose_state, use_gate_in_kernel=use_gate_in_kernel,
                                   A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                   allow_neg_eigval=allow_neg_eigval)
    return o, ht if ht is not None else q.new_empty(0, dtype=torch.float32)


@chunk_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
      cu_seqlens=None, transpose_state=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
      use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    K, HV, V = q.shape[-1], v.shape[2], v.shape[3]
    n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    state = (n, HV, V, K) if transpose_state else (n, HV, K, V)
    ht = q.new_empty(state if output_final_state else (0,), dtype=torch.float32)
    return torch.empty_like(v), ht
