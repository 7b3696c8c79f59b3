"""Tensor-parallel use: heads split across ranks, each rank runs gdn_aot on its heads (one process per GPU).

    torchrun --nproc-per-node 2 examples/tp/tensor_parallel.py      # NCCL_NVLS_ENABLE=0 on shared hosts

Every rank builds the same full inputs (same seed), keeps its slice of key heads H / world and the matching
value heads HV / world (value head i reads key head i // (HV // H), so contiguous slices stay consistent),
runs the forward, and the gathered outputs and final states are compared on rank 0 with a single-GPU run of
all heads. NOT YET RUN: it needs a host with two or more GPUs.
"""
import os

import torch
import torch.distributed as dist

import gdn_aot


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    H, HV, K, V, lens = 16, 32, 128, 128, [1000, 37, 4096]
    assert H % world == 0 and HV % world == 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    T = sum(lens)
    q = torch.randn(1, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, T, H, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, V, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = -torch.rand(1, T, HV, device="cuda", generator=gen)
    beta = torch.rand(1, T, HV, device="cuda", generator=gen)
    h0 = torch.randn(len(lens), HV, K, V, device="cuda", generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)

    hs, vs = slice(rank * H // world, (rank + 1) * H // world), slice(rank * HV // world, (rank + 1) * HV // world)
    o, ht = gdn_aot.chunk_gated_delta_rule(
        q[:, :, hs].contiguous(), k[:, :, hs].contiguous(), v[:, :, vs].contiguous(), g[:, :, vs].contiguous(),
        beta[:, :, vs].contiguous(), initial_state=h0[:, vs].contiguous(), output_final_state=True,
        cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    o_parts = [torch.empty_like(o) for _ in range(world)]
    ht_parts = [torch.empty_like(ht) for _ in range(world)]
    dist.all_gather(o_parts, o)
    dist.all_gather(ht_parts, ht)
    if rank == 0:
        o_ref, ht_ref = gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        # the same kernels per head; only the dispatch's V tile may differ with the head count
        for name, got, ref in (("output", torch.cat(o_parts, dim=2), o_ref), ("state", torch.cat(ht_parts, 1), ht_ref)):
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            assert err <= 1e-3, f"gathered {name} differs from the single-GPU run by {err:.2e}"
        print(f"tensor-parallel over {world} GPUs: output and final state match the single-GPU run")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
