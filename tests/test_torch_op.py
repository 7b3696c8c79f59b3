"""The registered custom op's fake implementation gives the real op's shapes (CPU, meta tensors)."""
import torch

import gdn_aot.loader.torch_op  # noqa: F401  (registers torch.ops.gdn_aot.chunk_gated_delta_rule)


def test_fake_shapes_varlen_and_fixed():
    op = torch.ops.gdn_aot.chunk_gated_delta_rule
    q = torch.empty(1, 300, 16, 128, device="meta", dtype=torch.bfloat16)
    v = torch.empty(1, 300, 32, 128, device="meta", dtype=torch.bfloat16)
    g = torch.empty(1, 300, 32, device="meta")
    cu = torch.empty(4, device="meta", dtype=torch.int32)
    o, ht = op(q, q, v, g, g, None, None, True, True, cu, False)
    assert o.shape == v.shape and o.dtype == torch.bfloat16
    assert ht.shape == (3, 32, 128, 128) and ht.dtype == torch.float32
    o, ht = op(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), g.expand(2, -1, -1),
               g.expand(2, -1, -1), 0.1, None, True, False, None, True)
    assert ht.shape == (2, 32, 128, 128)
    _, ht = op(q, q, v, g, g, None, None, False, False, cu, False)
    assert ht.shape == (0,)


def test_fake_final_state_is_fp32_whatever_the_initial_state():
    """The op has no pool or output_state, so its final state is a new one, fp32 (as fla's and the API's are), for
    an initial state of any state dtype: the fake says the same."""
    op = torch.ops.gdn_aot.chunk_gated_delta_rule
    q = torch.empty(1, 64, 2, 128, device="meta", dtype=torch.bfloat16)
    v = torch.empty(1, 64, 4, 128, device="meta", dtype=torch.bfloat16)
    g = torch.empty(1, 64, 4, device="meta")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        h0 = torch.empty(1, 4, 128, 128, device="meta", dtype=dtype)
        _, ht = op(q, q, v, g, g, None, h0, True, True, None, False)
        assert ht.dtype == torch.float32 and ht.shape == (1, 4, 128, 128)
