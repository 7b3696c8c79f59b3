"""Serving-stack integration on a GPU: CUDA graph capture/replay, torch.compile, the fla import swap."""
import pytest
import torch

from test_gpu_forward import TOL, make_inputs
from reference import reference_outputs, rel_max_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_graph_capture_and_replay_with_new_data():
    import gdn_aot

    lens = [100, 1, 300]
    q, k, v, g, beta, cu = make_inputs(lens, 2, 4, torch.bfloat16)
    h0 = torch.randn(3, 4, 128, 128, device="cuda")
    static = [q, k, v, g, beta, h0]
    call = lambda: gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up outside capture: loads the modules
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = call()
    for seed in (1, 2):
        fresh = list(make_inputs(lens, 2, 4, torch.bfloat16, seed=seed)[:5]) + [torch.randn_like(h0)]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_ht = reference_outputs(q, k, v, g, beta, cu.tolist(), h0, True)
        assert rel_max_err(o.float().reshape(ref_o.shape).cpu(), ref_o) <= TOL[torch.bfloat16]
        assert rel_max_err(ht.cpu(), ref_ht) <= TOL[torch.bfloat16]


def test_torch_compile_fullgraph_through_the_custom_op():
    import gdn_aot.loader.torch_op  # noqa: F401

    q, k, v, g, beta, cu = make_inputs([64, 77], 2, 4, torch.bfloat16)

    def layer(q, k, v, g, beta, cu):
        o, ht = torch.ops.gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, None, None, True, True, cu, False)
        return o.float().sum(-1), ht

    eager = layer(q, k, v, g, beta, cu)
    compiled = torch.compile(layer, fullgraph=True)(q, k, v, g, beta, cu)
    torch.cuda.synchronize()
    assert torch.allclose(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_fla_import_swap_matches_native_api():
    import gdn_aot
    from gdn_aot.loader.fla_compat import chunk_gated_delta_rule as fla_style

    q, k, v, g, beta, cu = make_inputs([50, 130], 2, 4, torch.bfloat16)
    h0 = torch.randn(2, 4, 128, 128, device="cuda")
    a = fla_style(q, k, v, g, beta, None, h0.transpose(-1, -2).contiguous(), True, True, state_v_first=True,
                  cu_seqlens=cu.long(), cu_seqlens_cpu=cu.cpu().long())
    b = gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(),
                                       output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                       transpose_state=True)
    torch.cuda.synchronize()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(NotImplementedError, match="context parallelism"):
        fla_style(q, k, v, g, beta, cp_context=object(), cu_seqlens=cu)
