"""The state's storage dtypes on a real GPU: initial state read and final state written in fp32, bf16, fp16, fp8
e4m3 or fp8 e5m2, the recurrence in fp32 on chip.

Each case runs the forward with the state in the dtype (a dense initial state with output_state of that dtype, or
a pool of it) and checks, against the fp64 token recurrence started from the *quantised* initial state (the
values the kernels read, widened exactly):
- o within TOL (test_gpu_forward.py's, as for an fp32 state: the kernels see the same fp32 values);
- the final state within TOL + (1 + TOL) 2^-p: the kernels round the fp32 state (within TOL, as for an fp32
  state) to nearest even as they write it, at most half an ulp, 2^-p of the value for a p-bit significand
  (STORAGE_ROUNDING: bf16 2^-8, fp16 2^-11, e4m3 2^-4, e5m2 2^-3), and the value is at most (1 + TOL) max|ref|
  (subnormals add at most half their spacing, 2^-10 absolute for e4m3, against a max|ref| of a few units);
- bitwise: o equals the fp32-state call's on the same quantised initial state (only the state's load and store
  differ), and the stored state equals that call's fp32 final state rounded by torch's .to(dtype) (round to
  nearest even; no value here comes near the fp8 ranges, where the kernels saturate);
- a pool in the dtype: used slots as above, slot -1 starts from zero and writes nothing, the other slots
  unchanged bitwise, an empty sequence writes back exactly what it read.
fp32 and bf16 states are built by specs/qwen35.yaml (the default artifacts: a missing variant is a failure);
fp16 and fp8 by specs/state-dtypes.yaml (varlen batches only): point GDN_AOT_ARTIFACTS at its build, e.g.
`gdn-aot build specs/state-dtypes.yaml --arch sm_90 --out artifacts-state`; without them those cases skip, naming
the spec.
"""
from __future__ import annotations

import pytest
import torch

from reference import reference_outputs, rel_max_err
from test_gpu_forward import K, TOL, V, make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}
STORAGE_ROUNDING = {"fp32": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp8e4m3": 2.0 ** -4, "fp8e5m2": 2.0 ** -3}
DEFAULT_SPEC_STATES = ("fp32", "bf16")  # what specs/qwen35.yaml builds
INPUT_DTYPE = torch.bfloat16
ODD_LENGTHS = [1, 63, 64, 65, 200, 0, 37]
# 80 short sequences: 320 programs at HV = 4, the default row on an H200 (132 SMs) and a B200 (148), and few
# enough tokens (< 8192 / HV) for the fp64 recurrence
MANY_LENGTHS = [int(x) for x in torch.randint(1, 24, (80,), generator=torch.Generator().manual_seed(3))]
RESULTS = []  # (case, o error, final state error, tolerance) for the report at the end


def forward(state: str, *args, **kw):
    """gdn_aot.chunk_gated_delta_rule; skips where the artifacts lack the state dtype, except where
    specs/qwen35.yaml's artifacts (which build it) are in use."""
    import gdn_aot
    from gdn_aot.loader import Artifacts, VariantNotBuilt

    try:
        return gdn_aot.chunk_gated_delta_rule(*args, **kw)
    except VariantNotBuilt as e:
        spec = Artifacts.for_device(torch.cuda.current_device()).manifest.spec_path or "?"
        if state in DEFAULT_SPEC_STATES and spec.endswith("qwen35.yaml"):
            raise
        pytest.skip(f"{state} state not built by these artifacts (spec {spec}): build specs/state-dtypes.yaml and "
                    f"point GDN_AOT_ARTIFACTS at it ({e})")


def quantised_state(shape, state: str, seed: int) -> torch.Tensor:
    """A random state in the storage dtype (the values the kernels read)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=gen).to(STATE_DTYPES[state])


def poisoned(shape, state: str) -> torch.Tensor:
    """NaN everywhere (every storage dtype has a NaN), so an element the kernels do not write fails the check."""
    return torch.full(shape, float("nan"), device="cuda").to(STATE_DTYPES[state])


def kv(x: torch.Tensor, transpose: bool) -> torch.Tensor:
    """A state as [.., K, V] (the reference's layout) from the call's layout."""
    return x.transpose(-1, -2) if transpose else x


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def check_against_reference(name, state, inputs, cu_list, h0_kv, o, ht_kv, used):
    """o and the final states of the sequences `used` (indices into the batch) against the fp64 recurrence from
    h0_kv (the quantised initial states, [N, HV, K, V]); records the errors."""
    q, k, v, g, beta = inputs
    ref_o, ref_ht = reference_outputs(q, k, v, g, beta, cu_list, h0_kv.float(), True)
    o_err = rel_max_err(o.float().reshape(ref_o.shape).cpu(), ref_o)
    ht_err = rel_max_err(ht_kv.float().cpu(), ref_ht[used])
    tol_ht = TOL[INPUT_DTYPE] + (1 + TOL[INPUT_DTYPE]) * STORAGE_ROUNDING[state]
    RESULTS.append((name, o_err, ht_err, tol_ht))
    assert o_err <= TOL[INPUT_DTYPE], f"{name}: o error {o_err:.3e} > {TOL[INPUT_DTYPE]}"
    assert ht_err <= tol_ht, f"{name}: final state error {ht_err:.3e} > {tol_ht:.3e}"


def check_against_fp32_state(name, state, inputs, kw, h0, o, ht):
    """The same call with the quantised initial state widened to fp32 and an fp32 final state: o bitwise equal,
    and ht equal to its final state rounded to the storage dtype."""
    o32, ht32 = forward("fp32", *inputs, initial_state=h0.float(),
                        output_state=torch.empty_like(ht, dtype=torch.float32), **kw)
    torch.cuda.synchronize()
    assert torch.equal(o, o32), f"{name}: o differs from the fp32-state call's (the recurrence is the same)"
    assert torch.equal(bits(ht), bits(ht32.to(ht.dtype))), \
        f"{name}: the stored state is not the fp32 state rounded to nearest even"


def run_dense(name, state, lens, batch=None, transpose=False, H=2, HV=4, seed=0):
    """A dense initial state of the dtype and output_state of the dtype (the call's state dtype)."""
    q, k, v, g, beta, cu = make_inputs(lens, H, HV, INPUT_DTYPE, batch=batch, seed=seed)
    n = batch or len(lens)
    cu_list = [i * lens[0] for i in range(batch + 1)] if batch else cu.tolist()
    shape = (n, HV, V, K) if transpose else (n, HV, K, V)
    h0 = quantised_state(shape, state, seed + 1)
    h0_before = bits(h0).clone()
    out_state = poisoned(shape, state)
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, transpose_state=transpose)
    o, ht = forward(state, q, k, v, g, beta, initial_state=h0, output_state=out_state, **kw)
    torch.cuda.synchronize()
    assert ht is out_state and ht.dtype == STATE_DTYPES[state]
    assert torch.equal(bits(h0), h0_before), f"{name}: the initial state was modified"
    assert torch.isfinite(o).all() and torch.isfinite(ht.float()).all(), f"{name}: NaN/Inf or unwritten elements"
    check_against_reference(name, state, (q, k, v, g, beta), cu_list, kv(h0, transpose), o, kv(ht, transpose),
                            list(range(n)))
    check_against_fp32_state(name, state, (q, k, v, g, beta), kw, h0, o, ht)


@pytest.mark.parametrize("transpose", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("lens", [ODD_LENGTHS, MANY_LENGTHS], ids=["odd lengths", "80 sequences"])
@pytest.mark.parametrize("state", list(STATE_DTYPES))
def test_varlen(state, lens, transpose):
    """Odd lengths and an empty sequence (28 programs: the single-wave row), and 80 sequences (320 programs: the
    default row), GVA (HV = 2 H)."""
    run_dense(f"{state} varlen {len(lens)} seqs {'vk' if transpose else 'kv'}", state, lens, transpose=transpose)


@pytest.mark.parametrize("transpose", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("state", list(STATE_DTYPES))
def test_fixed_length(state, T, transpose):
    """Fixed-length batches of odd lengths (8 programs: the small-batch row, no warp-specialised scan)."""
    run_dense(f"{state} fixed 2x{T} {'vk' if transpose else 'kv'}", state, [T], batch=2, transpose=transpose,
              seed=T)


@pytest.mark.parametrize("transpose", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "fixed"])
@pytest.mark.parametrize("state", list(STATE_DTYPES))
def test_pool_in_place(state, varlen, transpose):
    """A pool in the dtype, read and written in place through state_indices: slot -1 starts from zero and writes
    nothing, an empty sequence writes back what it read, the slots no sequence names keep their bits."""
    lens, idx = ([70, 1, 0, 130], [4, -1, 2, 0]) if varlen else ([65], [2, -1, 0])
    H, HV = 2, 8
    q, k, v, g, beta, cu = make_inputs(lens, H, HV, INPUT_DTYPE, batch=None if varlen else len(idx), seed=7)
    cu_list = cu.tolist() if varlen else [i * lens[0] for i in range(len(idx) + 1)]
    pool = quantised_state((6, HV, V, K) if transpose else (6, HV, K, V), state, seed=8)
    before = pool.clone()
    indices = torch.tensor(idx, device="cuda", dtype=torch.int32)
    o, ht = forward(state, q, k, v, g, beta, initial_state=pool, state_indices=indices, cu_seqlens=cu,
                    use_qk_l2norm_in_kernel=True, transpose_state=transpose)
    torch.cuda.synchronize()
    assert ht is pool
    h0 = torch.stack([kv(before[i], transpose) if i >= 0 else torch.zeros_like(kv(before[0], transpose))
                      for i in idx])
    used = [n for n, i in enumerate(idx) if i >= 0]
    name = f"{state} pool {'varlen' if varlen else 'fixed'} {'vk' if transpose else 'kv'}"
    check_against_reference(name, state, (q, k, v, g, beta), cu_list, h0, o,
                            torch.stack([kv(pool[idx[n]], transpose) for n in used]), used)
    untouched = [s for s in range(pool.shape[0]) if s not in idx]
    assert torch.equal(bits(pool[untouched]), bits(before[untouched])), f"{name}: a slot no sequence names changed"
    for n, length in enumerate(lens if varlen else []):
        if length == 0:
            assert torch.equal(bits(pool[idx[n]]), bits(before[idx[n]])), f"{name}: an empty sequence's slot changed"


@pytest.mark.parametrize("state", [s for s in STATE_DTYPES if s != "fp32"])
def test_initial_state_converted_to_the_state_dtype(state):
    """An fp32 initial state with output_state in the dtype: converted once to the dtype, so the result equals the
    call given the converted initial state, bit for bit."""
    q, k, v, g, beta, cu = make_inputs([100, 3], 2, 4, INPUT_DTYPE, seed=11)
    h0 = torch.randn(2, 4, K, V, device="cuda")
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    o1, ht1 = forward(state, q, k, v, g, beta, initial_state=h0, output_state=poisoned(h0.shape, state), **kw)
    o2, ht2 = forward(state, q, k, v, g, beta, initial_state=h0.to(STATE_DTYPES[state]),
                      output_state=poisoned(h0.shape, state), **kw)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(bits(ht1), bits(ht2))


def test_zz_report():
    """Prints every case's errors (read by the notes); runs last by name."""
    print("\nGPU state dtype cases: max|err|/max|ref| vs the fp64 recurrence from the quantised initial state")
    for name, o_err, ht_err, tol in RESULTS:
        print(f"  {name:<36} o {o_err:.2e}  ht {ht_err:.2e}  (ht tolerance {tol:.2e})")
