"""Bad input to chunk_gated_delta_rule raises a clear TypeError/ValueError naming the argument.

Structure is checked before devices, so every error here is reproducible on a CPU-only machine (CI); the
device-dependent checks (tensors on two devices, cu_seqlens values on the GPU) run in test_gpu_forward.py.
"""
import pytest
import torch

from gdn_aot.loader.api import chunk_gated_delta_rule


def inputs(B=1, T=8, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, K, dtype=dtype)
    return dict(q=q, k=torch.randn_like(q), v=torch.randn(B, T, HV, V, dtype=dtype),
                g=-torch.rand(B, T, HV), beta=torch.rand(B, T, HV))


def call(**over):
    args = inputs()
    args.update(over)
    return chunk_gated_delta_rule(**args)


CASES = [
    (dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.randn(1, 8, 2, 128)), TypeError, "q must be torch.bfloat16 or torch.float16"),
    (dict(q=torch.randn(8, 2, 128, dtype=torch.bfloat16)), ValueError, "q must have 4 dimensions"),
    (dict(k=torch.randn(1, 8, 2, 128, dtype=torch.float16)), TypeError, "k must have q's dtype"),
    (dict(k=torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)), ValueError, "k must have q's shape"),
    (dict(v=torch.randn(1, 7, 4, 128, dtype=torch.bfloat16)), ValueError, "v must be \\[B, T, HV, V\\]"),
    (dict(v=torch.randn(1, 8, 3, 128, dtype=torch.bfloat16), g=-torch.rand(1, 8, 3), beta=torch.rand(1, 8, 3)),
     ValueError, "HV=3 must be a multiple of q/k's H=2"),
    (dict(q=torch.randn(1, 2, 8, 128, dtype=torch.bfloat16).transpose(1, 2)), ValueError, "q must be contiguous"),
    (dict(g=-torch.rand(1, 8, 2)), ValueError, "g must have shape \\[B, T, HV\\]"),
    (dict(beta=torch.rand(1, 8, 4).to(torch.int32)), TypeError, "beta must be float32, bfloat16 or float16"),
    (dict(cu_seqlens=torch.tensor([0, 8.0])), TypeError, "cu_seqlens must be int32 or int64"),
    (dict(cu_seqlens=torch.tensor([[0, 8]])), ValueError, "cu_seqlens must be 1-D"),
    (dict(cu_seqlens=torch.tensor([1, 8]), validate=True), ValueError, "cu_seqlens must start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 8]), validate=True), ValueError, "cu_seqlens must be non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0, 7]), validate=True), ValueError, "cu_seqlens must end at T = 8"),
    (dict(initial_state=torch.zeros(1, 4, 128, 128, dtype=torch.bfloat16)), TypeError,
     "initial_state must be float32"),
    (dict(initial_state=torch.zeros(2, 4, 128, 128)), ValueError, "initial_state must be \\[N, HV, K, V\\]"),
    (dict(initial_state=torch.zeros(1, 4, 128, 128), transpose_state=True, output_state=torch.zeros(1, 4, 64, 128)),
     ValueError, "output_state must be \\[N, HV, V, K\\] \\(transpose_state=True\\)"),
    (dict(state_indices=torch.tensor([0], dtype=torch.int32)), ValueError, "state_indices needs initial_state"),
    (dict(initial_state=torch.zeros(3, 4, 128, 128), state_indices=torch.tensor([0.0])), TypeError,
     "state_indices must be int32 or int64"),
    (dict(initial_state=torch.zeros(3, 4, 128, 128), state_indices=torch.tensor([5]), validate=True), ValueError,
     "state_indices must lie in \\[-1, 2\\]"),
    (dict(initial_state=torch.zeros(3, 4, 128, 128), state_indices=torch.tensor([1, -1, 1]), validate=True,
          cu_seqlens=torch.tensor([0, 4, 4, 8])), ValueError, "same slot"),
    (dict(output=torch.empty(1, 8, 4, 64, dtype=torch.bfloat16)), ValueError, "output must be a contiguous"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    (dict(head_first=True), ValueError, "head_first=True is not supported"),
    (dict(), ValueError, "q must be on a CUDA device"),
]


@pytest.mark.parametrize("over,exc,msg", CASES, ids=[c[2][:40] for c in CASES])
def test_bad_input_is_named(over, exc, msg):
    with pytest.raises(exc, match=msg):
        call(**over)


def test_batch_with_cu_seqlens_is_refused():
    args = inputs(B=2)
    with pytest.raises(ValueError, match="q must have B = 1, got B = 2"):
        chunk_gated_delta_rule(**args, cu_seqlens=torch.tensor([0, 4, 8]))


def test_inputs_not_modified_by_rejected_call():
    args = inputs()
    before = {k: v.clone() for k, v in args.items()}
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(**args)
    assert all(torch.equal(before[k], args[k]) for k in args)


def test_fla_compat_takes_vllms_keywords():
    """vLLM calls fla's function with head_first=False: accepted (head_first=True is refused like the native API)."""
    from gdn_aot.loader.fla_compat import chunk_gated_delta_rule as fla_style

    args = inputs()
    with pytest.raises(ValueError, match="q must be on a CUDA device"):  # got past the keyword handling
        fla_style(**args, initial_state=None, output_final_state=True, cu_seqlens=None, head_first=False,
                  use_qk_l2norm_in_kernel=True)
    with pytest.raises(ValueError, match="head_first=True is not supported"):
        fla_style(**args, head_first=True)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        fla_style(**args, no_such_option=1)
