"""examples/cpp/gdn_forward.cpp on a GPU: the C++ forward on raw device pointers gives the same o and final
state (and state checkpoints, with --checkpoint-every) as gdn_aot.chunk_gated_delta_rule on the same inputs (written
from Python as raw files).

Both pick the route and variants from the same dispatch table (the C++ program through gdn_aot_select, with the
device's SM count) and run the same cubins with the same arguments and grids, and the kernels are deterministic,
so the results must be bitwise equal; the relative error is printed when they are not.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from reference import rel_max_err
from test_c_example import compile_cpp_example

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

K = V = 128


def _raw(x: torch.Tensor, path):
    x = x.contiguous().cpu()
    (x.view(torch.int16) if x.dtype == torch.bfloat16 else x).numpy().tofile(path)


@pytest.mark.parametrize("l2norm, with_h0, every_n", [(True, True, 0), (True, False, 0), (False, True, 0),
                                                      (False, False, 0), (True, True, 64), (True, False, 128)])
def test_cpp_forward_matches_python_api(device_build, tmp_path, l2norm, with_h0, every_n):
    import gdn_aot

    build, arch = device_build
    build.require(arch, "gdn_prepare")
    build.require(arch, "gdn_scan")
    exe = compile_cpp_example(build, arch, tmp_path)

    lens, H, HV = [100, 1, 0, 300, 64], 2, 4
    rows, n = sum(lens), len(lens)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, rows, H, K, device="cuda", generator=gen)
    k = torch.randn(1, rows, H, K, device="cuda", generator=gen)
    if not l2norm:  # the delta rule needs unit-norm keys when the kernel does not normalise them
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    v = torch.randn(1, rows, HV, V, device="cuda", generator=gen).to(torch.bfloat16)
    g = -torch.rand(1, rows, HV, device="cuda", generator=gen)
    beta = torch.rand(1, rows, HV, device="cuda", generator=gen)
    h0 = torch.randn(n, HV, K, V, device="cuda", generator=gen) if with_h0 else None
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], device="cuda", dtype=torch.int32)
    checkpoints = {}
    if every_n:
        starts = [0, *np.cumsum([n // every_n for n in lens]).tolist()]
        checkpoints = dict(state_checkpoints=torch.zeros(starts[-1], HV, K, V, device="cuda"),
                           checkpoint_cu_starts=torch.tensor(starts, device="cuda"), checkpoint_every_n_tokens=every_n)

    o_py, ht_py = gdn_aot.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
                                                 artifacts=str(build.out), **checkpoints)
    torch.cuda.synchronize()
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("h0", h0)):
        if x is not None:
            _raw(x, inputs / f"{name}.bin")
    cmd = [str(exe), str(build.out / arch), "--lens", ",".join(map(str, lens)), "--heads", f"{H},{HV}",
           "--inputs", str(inputs), "--out", str(out), "--checkpoint-every", str(every_n),
           *([] if l2norm else ["--no-l2norm"]), *([] if with_h0 else ["--no-h0"])]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"
    assert "ok" in r.stdout

    o_cpp = torch.from_numpy(np.fromfile(out / "o.bin", dtype=np.int16)).view(torch.bfloat16)
    ht_cpp = torch.from_numpy(np.fromfile(out / "ht.bin", dtype=np.float32))
    o_ref, ht_ref = o_py.cpu().reshape(-1), ht_py.cpu().reshape(-1)
    assert o_cpp.shape == o_ref.shape and ht_cpp.shape == ht_ref.shape
    assert torch.equal(o_cpp, o_ref), f"o differs: rel err {rel_max_err(o_cpp.float().numpy(), o_ref.float().numpy())}"
    assert torch.equal(ht_cpp, ht_ref), f"ht differs: rel err {rel_max_err(ht_cpp.numpy(), ht_ref.numpy())}"
    if every_n:
        ckpt_cpp = torch.from_numpy(np.fromfile(out / "ckpt.bin", dtype=np.float32))
        assert torch.equal(ckpt_cpp, checkpoints["state_checkpoints"].cpu().reshape(-1)), "checkpoints differ"
