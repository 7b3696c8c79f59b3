"""The public forward: ``gdn_aot.chunk_gated_delta_rule``, a drop-in for fla's function of the same name.

A call is four steps, each a function below: check the arguments on the host (validate.py: shapes, dtypes,
devices; no device-to-host copy) -> select the dispatch table's route for the batch (loader/dispatch.py) ->
allocate (the inputs in the form the kernels read, the outputs, one workspace) -> launch the route's kernels on
the caller's current stream through one call into the generated launcher (gdn_aot_forward: grids and workspace
layout computed in C). No triton import, no compiler, and no device-to-host synchronisation: cu_seqlens stays on
the GPU and every grid is sized from an upper bound (T // 64 + N chunk slots), so the call can be captured in a
CUDA graph. The per-call path is kept short (launch-bound calls are common in serving): configurations and their
routes are cached (routes.Routes), the route's half of the launcher's argument struct is packed once, and there
are three allocations (o, the final state, one workspace) plus a copy of each input the kernels cannot read as
given (docs/integration.md).
"""
from __future__ import annotations

import torch

from .abi import CALL_ARGS, OPTION_BITS, WORKSPACE_ALIGN
from .artifact_sets import Artifacts
from .routes import Route, Routes
from .validate import STATE_DTYPES, Call, check_call

_FP32, _I32, _I64, _U8 = torch.float32, torch.int32, torch.int64, torch.uint8
_CONTIGUOUS = torch.contiguous_format
_ALIGN_MASK = WORKSPACE_ALIGN - 1
_L2NORM, _HAS_H0 = OPTION_BITS["L2NORM"], OPTION_BITS["HAS_H0"]
_STORE_HT, _USE_INDICES = OPTION_BITS["STORE_HT"], OPTION_BITS["USE_INDICES"]
_GATE_IN_KERNEL, _GATE_BIAS = OPTION_BITS["GATE_IN_KERNEL"], OPTION_BITS["GATE_BIAS"]
_BETA_SIGMOID, _BETA_NEG_EIGVAL = OPTION_BITS["BETA_SIGMOID"], OPTION_BITS["BETA_NEG_EIGVAL"]
_pack_call = CALL_ARGS.pack
# torch's C entry points behind torch.cuda.current_device() and current_stream(i).cuda_stream, without their
# Python layers; bound by _bind_cuda() on the first forward
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
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_checkpoints: torch.Tensor | None = None,
    checkpoint_cu_starts: torch.Tensor | None = None,
    checkpoint_every_n_tokens: int = 0,
):
    """Gated DeltaNet prefill forward (inference only); returns ``(o, final_state or None)``.

    The leading parameters match fla 0.6.0's ``chunk_gated_delta_rule`` in name and position (its
    ``state_v_first`` is ``transpose_state`` here; gdn_aot.loader.fla_compat takes fla's exact keywords).

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV a multiple of H (value head i reads key head i // (HV // H));
    bf16 or fp16. g: [B, T, HV] per-token log decay (<= 0, not cumsummed); beta: [B, T, HV] (fp32, or the input
    dtype). Inputs that are not contiguous are copied once (docs/integration.md). scale defaults to K ** -0.5.
    cu_seqlens: [N + 1] int32/int64 on the same GPU, for packed varlen batches (then B must be 1); adjacent equal
    values are empty sequences.

    State: [N, HV, K, V], or [N, HV, V, K] with transpose_state (the layout decode kernels read), stored in
    float32, bfloat16, float16, float8_e4m3fn or float8_e5m2 (the recurrence runs in fp32 on chip; the kernels
    widen the initial state as they read it and round the final state, to nearest even, as they write it).
    The call's state dtype is the pool's with state_indices, else output_state's when given, else float32.
    initial_state=None starts from zero; one in another dtype than the call's (or strided) is converted once.
    output_final_state=True returns the final state (a new one in float32, as fla's). With state_indices ([N]
    int32/int64, on the GPU) initial_state is a state pool [slots, HV, ...] (contiguous): sequence n starts from
    slot state_indices[n] (-1: from zero) and its final state is written back into that slot in place (the pool
    is returned as final_state); no gather/scatter copies. output / output_state: preallocated results
    (contiguous; output_state in the pool's dtype with a pool). fp16 and fp8 states need the artifacts of
    specs/state-dtypes.yaml.

    validate=True additionally checks cu_seqlens' values (starts at 0, non-decreasing, ends at T) and
    state_indices' range, at the cost of one device-to-host copy; without it the kernels clamp every
    sequence bound to [0, T], so malformed values give wrong rows but never touch memory out of bounds.
    artifacts: artifact root (default: $GDN_AOT_ARTIFACTS, package data, ./artifacts).

    The gating in the kernels (fla's options): use_gate_in_kernel=True makes g the raw gate input a [B, T, HV]
    and the kernels compute g = -exp(A_log) * softplus(a + dt_bias) per value head (A_log, dt_bias: [HV], any
    float dtype; dt_bias optional); use_beta_sigmoid_in_kernel=True makes beta the raw b, beta = sigmoid(b), and
    with allow_neg_eigval=True beta = 2 * sigmoid(b), in (0, 2). These run in their own (gating) variants.

    State checkpoints for a prefix cache (FlashInfer's prefill convention): with checkpoint_every_n_tokens = N > 0
    (a multiple of 64), the state after every N tokens of each sequence is written into state_checkpoints
    [rows, HV, K, V] ([rows, HV, V, K] with transpose_state; contiguous, in the call's state dtype): sequence i's
    checkpoints are rows checkpoint_cu_starts[i] .. checkpoint_cu_starts[i + 1] - 1 (checkpoint_cu_starts:
    [N_seqs + 1] int64 or int32, on the GPU; sequence i has seq_len_i // N of them), row checkpoint_cu_starts[i] + j
    holding the state after (j + 1) N tokens, so a sequence whose length is a multiple of N ends on its final
    state. Checkpoints belong to sequences, not to state_indices' slots. validate=True also checks
    checkpoint_cu_starts' values (one more device-to-host copy). Needs artifacts built with the `checkpoints` axis
    (specs/qwen35.yaml: varlen batches).

    Raises TypeError/ValueError naming the bad argument; RuntimeError when an input requires grad under grad
    mode (there is no backward: call it under torch.no_grad() / torch.inference_mode(), or detach the inputs);
    gdn_aot.loader.errors types for missing or corrupt artifacts and unsupported devices. Inputs are never
    modified (except the state pool, as documented).
    """
    call = check_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                      cu_seqlens, transpose_state, state_indices, output, output_state, validate, head_first,
                      use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                      state_checkpoints, checkpoint_cu_starts, checkpoint_every_n_tokens)
    routes, route = select(call, artifacts)
    work, address, size = allocate(call, route)  # `work` stays referenced until the launches are enqueued
    launch(call, routes, route, address, size)
    return call.output, call.output_state


def select(call: Call, artifacts) -> tuple[Routes, Route]:
    """The configuration's routes on the call's device (loaded on first use) and the one serving the batch."""
    arts = Artifacts.for_device(call.index, root=artifacts)
    config = (call.dtype, call.K, call.V, call.cu_seqlens is not None, call.transpose,
              STATE_DTYPES[call.state_dtype], call.gating,
              call.checkpoint_every_n_tokens > 0)
    routes = arts.loaded.get(config)
    if routes is None:
        routes = _load_routes(arts, config)
    return routes, routes.select(call.num_seqs * call.HV)


def _load_routes(arts, config: tuple) -> Routes:
    """The first call of a configuration (dispatch.CONFIG_AXES) on a device: its routes, loaded."""
    K, V = config[1:3]
    if (K, V) not in arts.head_dims:
        raise ValueError(f"head dims K={K}, V={V} are not built for {arts.arch}; built (K, V): "
                         f"{sorted(arts.head_dims)}. Add them to a spec's K/V and rebuild (gdn-aot build SPEC).")
    routes = arts.routes(*config)
    routes.load()
    arts.loaded[config] = routes
    return routes


def allocate(c: Call, route: Route) -> tuple[torch.Tensor, int, int]:
    """The inputs as the kernels read them; o, and the final state (the pool itself with state_indices, else
    output_state, else a new tensor in the call's state dtype, fp32, when asked for); one uint8 workspace tensor:
    returns (it, its WORKSPACE_ALIGN-aligned address, the bytes the route needs). The caller keeps the workspace
    tensor until the launches are enqueued (torch's caching allocator then reuses its memory only in the stream's
    order)."""
    _kernel_inputs(c)
    device = c.q.device
    if c.state_indices is not None:
        if c.output_state is None:
            c.output_state = c.initial_state  # the pool is updated in place
    elif c.output_final_state and c.output_state is None:
        c.output_state = torch.empty(c.state_shape, device=device, dtype=c.state_dtype)
    if c.output is None:
        c.output = torch.empty_like(c.v)
    size = route.workspace_bytes(c.B, c.T, c.num_seqs, c.H, c.HV)
    work = torch.empty(size, device=device, dtype=_U8)
    ws = work.data_ptr()
    if ws & _ALIGN_MASK:  # torch's caching allocator hands out 512-byte aligned blocks; another allocator may not
        work = torch.empty(size + _ALIGN_MASK, device=device, dtype=_U8)
        ws = (work.data_ptr() + _ALIGN_MASK) & ~_ALIGN_MASK
    return work, ws, size


def _kernel_inputs(c: Call) -> None:
    """Contiguous q, k, v; g, beta, A_log and dt_bias fp32; the initial state contiguous in the call's state dtype;
    cu_seqlens and state_indices int32, checkpoint_cu_starts int64. Each is converted (one device copy) only where
    it is not already so."""
    if not c.q.is_contiguous():
        c.q = c.q.contiguous()
    if not c.k.is_contiguous():
        c.k = c.k.contiguous()
    if not c.v.is_contiguous():
        c.v = c.v.contiguous()
    g, beta, cu, h0 = c.g, c.beta, c.cu_seqlens, c.initial_state
    if g.dtype is not _FP32 or not g.is_contiguous():
        c.g = g.to(_FP32).contiguous()
    if beta.dtype is not _FP32 or not beta.is_contiguous():
        c.beta = beta.to(_FP32).contiguous()
    if c.gate_in_kernel:
        c.A_log = c.A_log.to(_FP32).contiguous()
        if c.dt_bias is not None:
            c.dt_bias = c.dt_bias.to(_FP32).contiguous()
    if cu is not None and (cu.dtype is not _I32 or not cu.is_contiguous()):
        c.cu_seqlens = cu.to(_I32).contiguous()
    if c.state_indices is not None:
        c.state_indices = c.state_indices.to(_I32).contiguous()
    elif h0 is not None and (h0.dtype is not c.state_dtype or not h0.is_contiguous()):  # a pool is read in place
        # one copy either way: .to(dtype, memory_format=...) hands back a tensor already in the dtype as it is
        c.initial_state = (h0.contiguous() if h0.dtype is c.state_dtype
                           else h0.to(c.state_dtype, memory_format=_CONTIGUOUS))
    starts = c.checkpoint_cu_starts
    if starts is not None and (starts.dtype is not _I64 or not starts.is_contiguous()):
        c.checkpoint_cu_starts = starts.to(_I64).contiguous()


def launch(c: Call, routes: Routes, route: Route, workspace: int, size: int) -> None:
    """The route's kernels on the current stream of the call's device: one gdn_aot_forward call."""
    if _current_device is None:
        _bind_cuda()
    h0, ht, idx, cu = c.initial_state, c.output_state, c.state_indices, c.cu_seqlens
    options = ((_L2NORM if c.l2norm else 0) | (0 if h0 is None else _HAS_H0) | (0 if ht is None else _STORE_HT)
               | (0 if idx is None else _USE_INDICES))
    a_log = dt_bias = 0
    if c.gating:
        options |= ((_GATE_IN_KERNEL if c.gate_in_kernel else 0) | (_BETA_SIGMOID if c.beta_sigmoid else 0)
                    | (_BETA_NEG_EIGVAL if c.neg_eigval else 0))
        if c.gate_in_kernel:
            a_log = c.A_log.data_ptr()
            if c.dt_bias is not None:
                options |= _GATE_BIAS
                dt_bias = c.dt_bias.data_ptr()
    if options & route.refused_options:
        route.refuse(options)
    checkpoints = rows = starts = 0
    if c.checkpoint_every_n_tokens:
        buffer = c.state_checkpoints
        checkpoints, rows, starts = buffer.data_ptr(), buffer.shape[0], c.checkpoint_cu_starts.data_ptr()
    index = c.index
    call_args = _pack_call(
        _raw_stream(index), c.q.data_ptr(), c.k.data_ptr(), c.v.data_ptr(), c.g.data_ptr(), c.beta.data_ptr(), a_log,
        dt_bias,
        0 if cu is None else cu.data_ptr(), 0 if h0 is None else h0.data_ptr(), 0 if ht is None else ht.data_ptr(),
        0 if idx is None else idx.data_ptr(), c.output.data_ptr(), checkpoints, rows, starts,
        c.checkpoint_every_n_tokens, workspace, size, c.B, c.T, c.num_seqs, c.H, c.HV, options,
        c.scale)  # CALL_FIELDS' order (loader/abi.py)
    if _current_device() == index:
        r = routes.launcher.gdn_aot_forward(route.prefix + call_args)
    else:  # launches go to the tensors' device whatever the current device is
        with torch.cuda.device(index):
            r = routes.launcher.gdn_aot_forward(route.prefix + call_args)
    if r:
        routes.failed(r, route, call_args)


def _bind_cuda() -> None:
    global _current_device, _raw_stream
    torch.cuda.init()
    _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
        lambda i: torch.cuda.current_stream(i).cuda_stream)
    _current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
