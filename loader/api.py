"""The public forward: ``gdn_aot.chunk_gated_delta_rule``, a drop-in for fla's function of the same name.

It checks its arguments on the host (shapes, dtypes, devices: no device-to-host copy), then runs the two
AOT-built kernels through the generated launcher on the caller's current stream: gdn_prepare -> gdn_scan
No triton import, no compiler, and no device-to-host synchronisation: cu_seqlens stays on the GPU and every
grid is sized from an upper bound (T // 64 + N chunk slots), so the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
import math

import torch

from gdn_aot.kernels import PREPARE_L2NORM, SCAN_HAS_H0, SCAN_L2NORM, SCAN_STORE_HT, SCAN_USE_INDICES
from gdn_aot.loader.runtime import Artifacts

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_BT = 64
_sm_count: dict[int, int] = {}


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
    cu_seqlens: torch.Tensor | None = None,
    transpose_state: bool = False,
    state_indices: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
    output_state: torch.Tensor | None = None,
    validate: bool = False,
    artifacts: str | None = None,
    head_first: bool = False,
):
    """Gated DeltaNet prefill forward; returns ``(o, final_state or None)``.

    The leading parameters match fla 0.6.0's ``chunk_gated_delta_rule`` in name and position (its
    ``state_v_first`` is ``transpose_state`` here; gdn_aot.loader.fla_compat takes fla's exact keywords).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head i reads key head i // (HV // H));
    bf16 or fp16, contiguous. g: [B, T, HV] per-token log decay (<= 0, not cumsummed); beta: [B, T, HV]
    (fp32, or the input dtype). scale defaults to K ** -0.5. cu_seqlens: [N + 1] int32/int64 on the same GPU,
    for packed varlen batches (then B must be 1); adjacent equal values are empty sequences.

    State: fp32 [N, HV, K, V], or [N, HV, V, K] with transpose_state (the layout decode kernels read).
    initial_state=None starts from zero; output_final_state=True returns the final state. With state_indices
    ([N] int32/int64, on the GPU) initial_state is a state pool [slots, HV, ...]: sequence n starts from
    slot state_indices[n] (-1: from zero) and its final state is written back into that slot in place (the
    pool is returned as final_state); no gather/scatter copies. output / output_state: preallocated results.

    validate=True additionally checks cu_seqlens' values (starts at 0, non-decreasing, ends at T) and
    state_indices' range, at the cost of one device-to-host copy; without it the kernels clamp every
    sequence bound to [0, T], so malformed values give wrong rows but never touch memory out of bounds.
    artifacts: artifact root (default: $GDN_AOT_ARTIFACTS, package data, ./artifacts).

    Raises TypeError/ValueError naming the bad argument; gdn_aot.loader.errors types for missing or corrupt
    artifacts and unsupported devices. Inputs are never modified (except the state pool, as documented).
    """
    if head_first:
        raise ValueError("head_first=True is not supported: pass q, k, v as [B, T, H, D] (fla's default layout)")
    # 1. structure: types, ranks, shapes, dtypes (no device needed, so these errors are the same everywhere)
    _check_tensor("q", q, dims=4)
    dtype = _DTYPES.get(q.dtype)
    if dtype is None:
        raise TypeError(f"q must be torch.bfloat16 or torch.float16, got {q.dtype}")
    B, T, H, K = q.shape
    for name, x in (("k", k), ("v", v)):
        _check_tensor(name, x, dims=4, dtype=q.dtype)
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] = [{B}, {T}, HV, V] like q, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {x.stride()} for shape {tuple(x.shape)})")
    for name, x in (("g", g), ("beta", beta)):
        _check_gate(name, x, (B, T, HV))
    scale = K ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    varlen = cu_seqlens is not None
    num_seqs = _check_cu_seqlens(cu_seqlens, B, T, validate) if varlen else B
    state_shape = (HV, V, K) if transpose_state else (HV, K, V)
    pool = state_indices is not None
    if pool:
        if initial_state is None:
            raise ValueError("state_indices needs initial_state: the state pool [slots, HV, ...] it indexes")
        _check_indices(state_indices, num_seqs, initial_state.shape[0] if initial_state.dim() else 0, validate)
    for name, x in (("initial_state", initial_state), ("output_state", output_state)):
        if x is not None:
            _check_state(name, x, state_shape, None if pool else num_seqs, transpose_state)
    if output is not None:
        _check_tensor("output", output, dims=4, dtype=q.dtype)
        if output.shape != v.shape or not output.is_contiguous():
            raise ValueError(f"output must be a contiguous {tuple(v.shape)} tensor like v, got "
                             f"{tuple(output.shape)} with strides {output.stride()}")

    # 2. devices: everything on one CUDA device
    device = q.device
    if device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {device}")
    named = (("k", k), ("v", v), ("g", g), ("beta", beta), ("cu_seqlens", cu_seqlens),
             ("state_indices", state_indices), ("initial_state", initial_state), ("output_state", output_state),
             ("output", output))
    for name, x in named:
        if x is not None and x.device != device:
            raise ValueError(f"{name} is on {x.device} but q is on {device}: all tensors must be on one device")

    # 3. artifacts for this device's arch
    index = device.index if device.index is not None else torch.cuda.current_device()
    arts = Artifacts.for_device(index, root=artifacts)
    if (K, V) not in arts.head_dims:
        raise ValueError(f"head dims K={K}, V={V} are not built for {arts.arch}; built (K, V): "
                         f"{sorted(arts.head_dims)}. Add them to a spec's K/V and rebuild (gdn-aot build SPEC).")

    g = g.to(torch.float32).contiguous()
    beta = beta.to(torch.float32).contiguous()
    cu_ptr = 0
    if varlen:
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
        cu_ptr = cu_seqlens.data_ptr()
    rows = B * T
    flags = 0
    if pool:
        state_indices = state_indices.to(torch.int32).contiguous()
        flags |= SCAN_USE_INDICES
        if output_state is None:
            output_state = initial_state  # the pool is updated in place
    elif output_final_state and output_state is None:
        output_state = torch.empty((num_seqs, *state_shape), device=device, dtype=torch.float32)
    if initial_state is not None:
        flags |= SCAN_HAS_H0
    if output_state is not None:
        flags |= SCAN_STORE_HT
    if output is None:
        output = torch.empty_like(v)

    # launches go to the tensors' device whatever the current device is
    on_device = torch.cuda.device(index) if index != torch.cuda.current_device() else contextlib.nullcontext()
    with on_device:
        return _forward(arts, index, q, k, v, g, beta, scale, cu_ptr, num_seqs, rows, T, H, HV, K, V, dtype, varlen,
                        transpose_state, use_qk_l2norm_in_kernel, initial_state, output_state, state_indices, flags,
                        output)


def _forward(arts, index, q, k, v, g, beta, scale, cu_ptr, num_seqs, rows, T, H, HV, K, V, dtype, varlen,
             transpose_state, l2norm, initial_state, output_state, state_indices, flags, output):
    stream = torch.cuda.current_stream(index).cuda_stream
    dev = q.device
    # workspace, one allocation carved into views: w, u (input dtype), gam (fp32), and with l2norm rq, rk (fp32)
    elt = q.element_size()
    sizes = [rows * HV * K * elt, rows * HV * V * elt, rows * HV * 4] + [rows * HV * 4] * (2 if l2norm else 0)
    work = torch.empty(sum(sizes), device=dev, dtype=torch.uint8)
    ptrs, offset = [], work.data_ptr()
    for size in sizes:
        ptrs.append(offset)
        offset += size
    w, u, gam = ptrs[:3]
    rq, rk = ptrs[3:] if l2norm else (0, 0)

    T_arg = rows if varlen else T
    prepare = arts.pick("gdn_prepare", dtype=dtype, K=K, V=V, varlen=varlen)
    slots = rows // _BT + num_seqs if varlen else num_seqs * _cdiv(T, _BT)
    _launch(prepare, (slots, HV, 1), stream, dev, q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(),
            beta.data_ptr(), cu_ptr, w, u, gam, rq, rk, T_arg, num_seqs, H, HV, PREPARE_L2NORM if l2norm else 0)

    BV = arts.choose_BV("gdn_scan", num_seqs * HV, _sms(index))
    scan = arts.pick("gdn_scan", dtype=dtype, K=K, V=V, varlen=varlen, transpose=transpose_state, BV=BV)
    _launch(scan, (num_seqs, HV, V // scan.axes["BV"]), stream, dev, q.data_ptr(), k.data_ptr(), w, u, gam, rq, rk,
            cu_ptr, _ptr(initial_state), _ptr(output_state), _ptr(state_indices), output.data_ptr(), scale, T_arg,
            H, HV, flags | (SCAN_L2NORM if l2norm else 0))
    return output, output_state


def _launch(kernel, grid, stream, device, *args):
    """Launch with the global scratch the kernel's device-built TMA descriptors need (128 B each per CTA)."""
    size = kernel.scratch_bytes(grid)
    scratch = torch.empty(size, device=device, dtype=torch.uint8) if size else None
    kernel.launch(grid, stream, *args, scratch_ptr=scratch.data_ptr() if size else 0)


def _ptr(x) -> int:
    return x.data_ptr() if x is not None else 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sms(index: int) -> int:
    n = _sm_count.get(index)
    if n is None:
        n = _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def _check_tensor(name, x, dims, dtype=None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must have q's dtype {dtype}, got {x.dtype}")


def _check_gate(name, x, shape):
    """g and beta: [B, T, HV] of a float dtype (converted to contiguous fp32 for the kernels)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape [B, T, HV] = {list(shape)}, got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_cu_seqlens(cu, B, T, validate) -> int:
    """Format checks; with validate, also the values (one device-to-host copy). Returns N."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs sequences along T, so q must have B = 1, got B = {B}")
    if validate:
        check_bounds(cu.tolist(), T)
    return cu.shape[0] - 1


def check_bounds(host: list[int], T: int) -> None:
    """cu_seqlens values (a host list): start at 0, non-decreasing, end at T."""
    if host[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {host[0]}")
    bad = next((i for i in range(len(host) - 1) if host[i + 1] < host[i]), None)
    if bad is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing, but cu_seqlens[{bad + 1}] = {host[bad + 1]} < "
                         f"cu_seqlens[{bad}] = {host[bad]}")
    if host[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T} (q's length), got {host[-1]}")


def _check_indices(idx, num_seqs, slots, validate):
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"state_indices must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"state_indices must be int32 or int64, got {idx.dtype}")
    if tuple(idx.shape) != (num_seqs,):
        raise ValueError(f"state_indices must have one slot per sequence, shape [{num_seqs}], got {list(idx.shape)}")
    if validate:
        host = idx.tolist()
        if min(host) < -1 or max(host) >= slots:
            raise ValueError(f"state_indices must lie in [-1, {slots - 1}] (the pool has {slots} slots), "
                             f"got values in [{min(host)}, {max(host)}]")
        used = [i for i in host if i >= 0]
        if len(set(used)) != len(used):
            raise ValueError("state_indices must not give two sequences the same slot (both would write it), "
                             f"got {sorted(i for i in set(used) if used.count(i) > 1)} more than once")


def _check_state(name, x, state_shape, num_seqs, transpose_state):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    layout = "[N, HV, V, K] (transpose_state=True)" if transpose_state else "[N, HV, K, V]"
    if x.dim() != 4 or tuple(x.shape[1:]) != state_shape or (num_seqs is not None and x.shape[0] != num_seqs):
        n = num_seqs if num_seqs is not None else "slots"
        raise ValueError(f"{name} must be {layout} = [{n}, {', '.join(map(str, state_shape))}], "
                         f"got {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {x.stride()}")
