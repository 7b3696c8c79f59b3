"""The public forward: ``gdn_aot.chunk_gated_delta_rule``, a drop-in for fla's function of the same name.

It checks its arguments on the host (shapes, dtypes, devices: no device-to-host copy), then runs the two
AOT-built kernels on the caller's current stream, gdn_prepare -> gdn_scan, through one call into the generated
launcher (gdn_aot_forward: grids and workspace layout computed in C).
No triton import, no compiler, and no device-to-host synchronisation: cu_seqlens stays on the GPU and every
grid is sized from an upper bound (T // 64 + N chunk slots), so the call can be captured in a CUDA graph.
The per-call path is kept short (launch-bound calls are common in serving): each check is an expression on
values read once, configurations are cached (runtime.Forward), and there are three allocations (o, the final
state, one workspace).
"""
from __future__ import annotations

import math

import torch

from gdn_aot.kernels import PREPARE_L2NORM, SCAN_HAS_H0, SCAN_STORE_HT, SCAN_USE_INDICES
from gdn_aot.loader.runtime import FORWARD_ARGS, WORKSPACE_ALIGN, Artifacts

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_Tensor = torch.Tensor
_FP32, _I32, _U8 = torch.float32, torch.int32, torch.uint8
_GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_ALIGN_MASK = WORKSPACE_ALIGN - 1
_pack = FORWARD_ARGS.pack
# torch's C entry points behind torch.cuda.current_device() and current_stream(i).cuda_stream, without their
# Python layers (several us a call); bound by _bind_cuda() on the first forward
_current_device = _raw_stream = None


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
    # 1. structure: types, ranks, shapes, dtypes (no device needed, so these errors are the same everywhere).
    # The per-call path reads each property once and calls a _check_* helper (which raises, naming the argument)
    # only where a condition fails.
    if not isinstance(q, _Tensor) or len(qshape := q.shape) != 4:
        _check_tensor("q", q, dims=4)
    qdtype = q.dtype
    dtype = _DTYPES.get(qdtype)
    if dtype is None:
        raise TypeError(f"q must be torch.bfloat16 or torch.float16, got {qdtype}")
    if not isinstance(k, _Tensor) or k.dim() != 4 or k.dtype != qdtype:
        _check_tensor("k", k, dims=4, dtype=qdtype)
    if not isinstance(v, _Tensor) or len(vshape := v.shape) != 4 or v.dtype != qdtype:
        _check_tensor("v", v, dims=4, dtype=qdtype)
    B, T, H, K = qshape
    if k.shape != qshape:
        raise ValueError(f"k must have q's shape {tuple(qshape)}, got {tuple(k.shape)}")
    if vshape[0] != B or vshape[1] != T:
        raise ValueError(f"v must be [B, T, HV, V] = [{B}, {T}, HV, V] like q, got {tuple(vshape)}")
    HV, V = vshape[2], vshape[3]
    if H == 0 or HV % H:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        name, x = next((n, x) for n, x in (("q", q), ("k", k), ("v", v)) if not x.is_contiguous())
        raise ValueError(f"{name} must be contiguous (strides {x.stride()} for shape {tuple(x.shape)})")
    gate_shape = (B, T, HV)
    g_dtype = _check_gate("g", g, gate_shape)
    beta_dtype = _check_gate("beta", beta, gate_shape)
    scale = K ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale}")
    varlen = cu_seqlens is not None
    num_seqs = _check_cu_seqlens(cu_seqlens, B, T, validate) if varlen else B
    pool = state_indices is not None
    # [N, HV, K, V] or [N, HV, V, K]; N is None for a state pool (any number of slots)
    state_shape = (None if pool else num_seqs, *((HV, V, K) if transpose_state else (HV, K, V)))
    if pool:
        if initial_state is None:
            raise ValueError("state_indices needs initial_state: the state pool [slots, HV, ...] it indexes")
        _check_indices(state_indices, num_seqs, initial_state.shape[0] if initial_state.dim() else 0, validate)
    if initial_state is not None:
        _check_state("initial_state", initial_state, state_shape, transpose_state)
    if output_state is not None:
        _check_state("output_state", output_state, state_shape, transpose_state)
    if output is not None:
        _check_tensor("output", output, dims=4, dtype=qdtype)
        if output.shape != vshape or not output.is_contiguous():
            raise ValueError(f"output must be a contiguous {tuple(vshape)} tensor like v, got "
                             f"{tuple(output.shape)} with strides {output.stride()}")

    # 2. devices: everything on one CUDA device. x.get_device() is a CUDA tensor's device index and -1 on the CPU
    # (and on meta): comparing it costs a third of comparing x.device (a non-CUDA accelerator tensor with the same
    # index would pass; such devices do not share a process with CUDA ones in practice)
    device = q.device
    if not q.is_cuda:
        raise ValueError(f"q must be on a CUDA device, got {device}")
    index = q.get_device()
    if (k.get_device() != index or v.get_device() != index or g.get_device() != index or beta.get_device() != index
            or (varlen and cu_seqlens.get_device() != index) or (pool and state_indices.get_device() != index)
            or (initial_state is not None and initial_state.get_device() != index)
            or (output_state is not None and output_state.get_device() != index)
            or (output is not None and output.get_device() != index)):
        name, x = next((n, x) for n, x in (
            ("k", k), ("v", v), ("g", g), ("beta", beta), ("cu_seqlens", cu_seqlens), ("state_indices", state_indices),
            ("initial_state", initial_state), ("output_state", output_state), ("output", output))
            if x is not None and x.device != device)
        raise ValueError(f"{name} is on {x.device} but q is on {device}: all tensors must be on one device")

    # 3. artifacts for this device's arch
    arts = Artifacts.for_device(index, root=artifacts)
    if (K, V) not in arts.head_dims:
        raise ValueError(f"head dims K={K}, V={V} are not built for {arts.arch}; built (K, V): "
                         f"{sorted(arts.head_dims)}. Add them to a spec's K/V and rebuild (gdn-aot build SPEC).")
    fwd = arts.forward(dtype, K, V, varlen, transpose_state)

    # 4. kernel inputs (converted only where needed), outputs, flags
    if g_dtype is not _FP32 or not g.is_contiguous():
        g = g.to(_FP32).contiguous()
    if beta_dtype is not _FP32 or not beta.is_contiguous():
        beta = beta.to(_FP32).contiguous()
    cu_ptr = 0
    if varlen:
        if cu_seqlens.dtype != _I32 or not cu_seqlens.is_contiguous():
            cu_seqlens = cu_seqlens.to(_I32).contiguous()
        cu_ptr = cu_seqlens.data_ptr()
    flags = 0
    if pool:
        state_indices = state_indices.to(_I32).contiguous()
        flags |= SCAN_USE_INDICES
        if output_state is None:
            output_state = initial_state  # the pool is updated in place
    elif output_final_state and output_state is None:
        output_state = torch.empty(state_shape, device=device, dtype=_FP32)
    if initial_state is not None:
        flags |= SCAN_HAS_H0
    if output_state is not None:
        flags |= SCAN_STORE_HT
    if output is None:
        output = torch.empty_like(v)

    # 5. one call into the launcher (gdn_aot_forward: grids and workspace layout in C) with one workspace
    if fwd.launcher is None:
        fwd.load()
    if _current_device is None:
        _bind_cuda()
    programs = num_seqs * HV
    if programs <= fwd.wave_upto:
        scan = fwd.scan_for(programs)
    else:  # fwd.scan_for(), inline
        scan = fwd.scan_small if programs < fwd.small_below else fwd.scan_large
    size = fwd.workspace_bytes(scan, B, T, num_seqs, H, HV)
    work = torch.empty(size, device=device, dtype=_U8)
    ws = work.data_ptr()
    if ws & _ALIGN_MASK:  # torch's caching allocator hands out 512-byte aligned blocks; another allocator may not
        work = torch.empty(size + _ALIGN_MASK, device=device, dtype=_U8)
        ws = (work.data_ptr() + _ALIGN_MASK) & ~_ALIGN_MASK
    args = _pack(fwd.prepare.handle, scan.handle, _raw_stream(index), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                 g.data_ptr(), beta.data_ptr(), cu_ptr, 0 if initial_state is None else initial_state.data_ptr(),
                 0 if output_state is None else output_state.data_ptr(), state_indices.data_ptr() if pool else 0,
                 output.data_ptr(), ws, size, B, T, num_seqs, H, HV, K, V, fwd.BT, scan.BV, fwd.elt,
                 PREPARE_L2NORM if use_qk_l2norm_in_kernel else 0, flags, scale)
    if _current_device() == index:
        r = fwd.launcher.forward(args)
    else:  # launches go to the tensors' device whatever the current device is
        with torch.cuda.device(index):
            r = fwd.launcher.forward(args)
    if r:
        fwd.failed(r, args)
    return output, output_state


def _bind_cuda() -> None:
    global _current_device, _raw_stream
    torch.cuda.init()
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
        lambda i: torch.cuda.current_stream(i).cuda_stream)
    _current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _check_tensor(name, x, dims, dtype=None):
    if not isinstance(x, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must have q's dtype {dtype}, got {x.dtype}")


def _check_gate(name, x, shape) -> torch.dtype:
    """g and beta: [B, T, HV] of a float dtype (converted to contiguous fp32 for the kernels). Returns the dtype."""
    if not isinstance(x, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape [B, T, HV] = {list(shape)}, got {list(x.shape)}")
    dtype = x.dtype
    if dtype not in _GATE_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {dtype}")
    return dtype


def _check_cu_seqlens(cu, B, T, validate) -> int:
    """Format checks; with validate, also the values (one device-to-host copy). Returns N."""
    if not isinstance(cu, _Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in _INDEX_DTYPES:
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu.dtype}")
    shape = cu.shape
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {tuple(shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs sequences along T, so q must have B = 1, got B = {B}")
    if validate:
        check_bounds(cu.tolist(), T)
    return shape[0] - 1


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
    if not isinstance(idx, _Tensor):
        raise TypeError(f"state_indices must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in _INDEX_DTYPES:
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


def _check_state(name, x, shape, transpose_state):
    """shape: (N, HV, K, V) or (N, HV, V, K); N None for a state pool (any number of slots)."""
    if not isinstance(x, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != _FP32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    got = x.shape
    if got != shape if shape[0] is not None else len(got) != 4 or got[1:] != shape[1:]:
        layout = "[N, HV, V, K] (transpose_state=True)" if transpose_state else "[N, HV, K, V]"
        n = shape[0] if shape[0] is not None else "slots"
        raise ValueError(f"{name} must be {layout} = [{n}, {', '.join(map(str, shape[1:]))}], got {list(got)}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {x.stride()}")
