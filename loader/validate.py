"""The checks of gdn_aot.chunk_gated_delta_rule's arguments, on the host: a bad argument raises TypeError or
ValueError naming it (tests/test_api_validation.py lists them all).

Structure (types, ranks, shapes, dtypes) is checked before devices, so those errors are the same on every machine.
No check reads device memory, except the values of cu_seqlens, state_indices and checkpoint_cu_starts with
validate=True (one copy each). The per-call path reads each property once and calls a helper that raises only where
a condition fails.
"""
from __future__ import annotations

import math
import operator

import torch

_Tensor = torch.Tensor
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # input dtype -> the variants' dtype axis
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what g, beta, A_log and dt_bias may be
# how a state may be stored (an initial state, a pool, output_state) -> the variants' state_dtype axis
STATE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
                torch.float8_e4m3fn: "fp8e4m3", torch.float8_e5m2: "fp8e5m2"}
_STATE_DTYPE_NAMES = ", ".join(map(str, STATE_DTYPES))
INDEX_DTYPES = (torch.int32, torch.int64)
CHUNK = 64  # the kernels' chunk length: checkpoints fall on chunk ends
INT32_MAX = 2 ** 31 - 1
_FP32 = torch.float32
_grad_enabled = torch._C.is_grad_enabled  # torch.is_grad_enabled, without its Python layer


class Call:
    """One call's tensors and sizes, as checked (the API converts the tensors the kernels need in another form)."""

    __slots__ = ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state", "state_indices", "output",
                 "output_state", "output_final_state", "dtype", "B", "T", "H", "HV", "K", "V", "num_seqs", "scale",
                 "l2norm", "transpose", "state_shape", "state_dtype", "index", "A_log", "dt_bias", "gate_in_kernel",
                 "beta_sigmoid", "neg_eigval", "state_checkpoints", "checkpoint_cu_starts", "checkpoint_every_n_tokens")

    @property
    def gating(self) -> bool:
        """Either gating option is on: the call needs a gating variant (the configuration's `gating` axis)."""
        return self.gate_in_kernel or self.beta_sigmoid


def check_call(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
               transpose_state, state_indices, output, output_state, validate, head_first, use_gate_in_kernel=False,
               A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
               state_checkpoints=None, checkpoint_cu_starts=None, checkpoint_every_n_tokens=0) -> Call:
    """The public arguments (gdn_aot.chunk_gated_delta_rule's, in its order), checked; returns the Call."""
    if head_first:
        raise ValueError("head_first=True is not supported: pass q, k, v as [B, T, H, D] (fla's default layout)")
    c = Call()
    _check_qkv(c, q, k, v)
    gate_shape = (c.B, c.T, c.HV)
    if not isinstance(g, _Tensor) or g.shape != gate_shape or g.dtype not in FLOAT_DTYPES:
        _check_gate("g", g, gate_shape)
    if not isinstance(beta, _Tensor) or beta.shape != gate_shape or beta.dtype not in FLOAT_DTYPES:
        _check_gate("beta", beta, gate_shape)
    c.g, c.beta, c.cu_seqlens, c.state_indices, c.initial_state = g, beta, cu_seqlens, state_indices, initial_state
    c.output, c.output_state, c.output_final_state = output, output_state, output_final_state
    c.l2norm, c.transpose = use_qk_l2norm_in_kernel, transpose_state
    c.A_log = c.dt_bias = None
    c.gate_in_kernel = c.beta_sigmoid = c.neg_eigval = False
    if (use_gate_in_kernel or use_beta_sigmoid_in_kernel or allow_neg_eigval or A_log is not None
            or dt_bias is not None):
        _check_gating(c, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    c.scale = c.K ** -0.5 if scale is None else float(scale)
    if not math.isfinite(c.scale):
        raise ValueError(f"scale must be a finite number, got {c.scale}")
    c.num_seqs, cu_host = c.B, None
    if cu_seqlens is not None:
        c.num_seqs, cu_host = _check_cu_seqlens(cu_seqlens, c.B, c.T, validate)
    _check_states(c, validate)
    c.state_checkpoints = c.checkpoint_cu_starts = None
    c.checkpoint_every_n_tokens = 0
    if checkpoint_every_n_tokens or state_checkpoints is not None or checkpoint_cu_starts is not None:
        _check_checkpoints(c, state_checkpoints, checkpoint_cu_starts, checkpoint_every_n_tokens, cu_host, validate)
    if output is not None:
        _check_output(output, v)
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or g.requires_grad
                            or beta.requires_grad or (initial_state is not None and initial_state.requires_grad)
                            or (A_log is not None and A_log.requires_grad)
                            or (dt_bias is not None and dt_bias.requires_grad)):
        _refuse_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    c.index = _check_devices(c)
    return c


def _check_qkv(c: Call, q, k, v) -> None:
    """q, k [B, T, H, K] and v [B, T, HV, V] of one 16-bit float dtype, HV a multiple of H."""
    c.q, c.k, c.v = q, k, v
    if not isinstance(q, _Tensor) or len(qshape := q.shape) != 4:
        _check_tensor("q", q, dims=4)
    qdtype = q.dtype
    c.dtype = DTYPES.get(qdtype)
    if c.dtype is None:
        raise TypeError(f"q must be torch.bfloat16 or torch.float16, got {qdtype}")
    if not isinstance(k, _Tensor) or k.dim() != 4 or k.dtype != qdtype:
        _check_tensor("k", k, dims=4, dtype=qdtype)
    if not isinstance(v, _Tensor) or len(vshape := v.shape) != 4 or v.dtype != qdtype:
        _check_tensor("v", v, dims=4, dtype=qdtype)
    B, T, H, K = qshape
    c.B, c.T, c.H, c.K = B, T, H, K
    if k.shape != qshape:
        raise ValueError(f"k must have q's shape {tuple(qshape)}, got {tuple(k.shape)}")
    if vshape[0] != B or vshape[1] != T:
        raise ValueError(f"v must be [B, T, HV, V] = [{B}, {T}, HV, V] like q, got {tuple(vshape)}")
    HV = c.HV = vshape[2]
    c.V = vshape[3]
    if H == 0 or HV % H:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H}")


def _check_tensor(name, x, dims, dtype=None):
    if not isinstance(x, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} must have q's dtype {dtype}, got {x.dtype}")


def _check_gate(name, x, shape) -> None:
    """g and beta: [B, T, HV] of a float dtype (the API converts them to contiguous fp32 for the kernels). Raises."""
    if not isinstance(x, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape [B, T, HV] = {list(shape)}, got {list(x.shape)}")
    _check_float(name, x)


def _check_float(name, x) -> None:
    """g, beta, A_log, dt_bias: any of FLOAT_DTYPES (the API converts them to fp32 for the kernels)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_cu_seqlens(cu, B, T, validate) -> tuple[int, list | None]:
    """Format checks; with validate, also the values (one device-to-host copy). Returns N and, with validate, the
    values (a host list)."""
    if not isinstance(cu, _Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in INDEX_DTYPES:
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu.dtype}")
    shape = cu.shape
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {tuple(shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs sequences along T, so q must have B = 1, got B = {B}")
    host = None
    if validate:
        host = cu.tolist()
        check_bounds(host, T)
    return shape[0] - 1, host


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


def _check_states(c: Call, validate: bool) -> None:
    """initial_state, output_state and state_indices; sets c.state_shape: [N, HV, K, V] or [N, HV, V, K], N None
    for a state pool (any number of slots), and c.state_dtype, the torch dtype the kernels read and write states
    in: the pool's (read and written in place), else output_state's, else fp32 (a new final state is fp32, as
    fla's is)."""
    pool = c.state_indices is not None
    h0, ht = c.initial_state, c.output_state
    c.state_shape = (None if pool else c.num_seqs, *((c.HV, c.V, c.K) if c.transpose else (c.HV, c.K, c.V)))
    if pool:
        if h0 is None:
            raise ValueError("state_indices needs initial_state: the state pool [slots, HV, ...] it indexes")
        slots = h0.shape[0] if isinstance(h0, _Tensor) and h0.dim() else 0
        _check_indices(c.state_indices, c.num_seqs, slots, validate)
    if h0 is not None:  # read once (converted to the state dtype, contiguous, where it is not), or a pool
        _check_state("initial_state", h0, c.state_shape, c.transpose, written=pool)
    if ht is not None:
        _check_state("output_state", ht, c.state_shape, c.transpose, written=True)
        if pool and ht.dtype != h0.dtype:
            raise TypeError(f"output_state must have the state pool's dtype {h0.dtype} (the kernels read and write "
                            f"states in one dtype), got {ht.dtype}")
    c.state_dtype = h0.dtype if pool else _FP32 if ht is None else ht.dtype


def _check_indices(idx, num_seqs, slots, validate):
    if not isinstance(idx, _Tensor):
        raise TypeError(f"state_indices must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype not in INDEX_DTYPES:
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


def _check_state(name, x, shape, transpose, written: bool):
    """A state tensor of `shape` (N None: any number of slots) in a state dtype (STATE_DTYPES). One the kernels
    write (output_state, a pool) must be contiguous; an initial state they only read may be in any layout (the API
    converts it)."""
    if not isinstance(x, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in STATE_DTYPES:
        raise TypeError(f"{name} must be stored in one of the state dtypes {_STATE_DTYPE_NAMES}, got {x.dtype}")
    got = x.shape
    if got != shape if shape[0] is not None else len(got) != 4 or got[1:] != shape[1:]:
        layout = "[N, HV, V, K] (transpose_state=True)" if transpose else "[N, HV, K, V]"
        n = shape[0] if shape[0] is not None else "slots"
        raise ValueError(f"{name} must be {layout} = [{n}, {', '.join(map(str, shape[1:]))}], got {list(got)}")
    if written and not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels write it in place), got strides {x.stride()}")


def _check_checkpoints(c: Call, buffer, starts, every_n, cu_host: list | None, validate: bool) -> None:
    """The prefix-cache checkpoints (FlashInfer's prefill convention): every_n = N a positive multiple of the chunk
    length, the buffer [rows, HV, K, V] ([rows, HV, V, K] transposed) in the state dtype, contiguous, and
    checkpoint_cu_starts [N_seqs + 1] int32 / int64; all three or none (N = 0). With validate, also the starts'
    values: sequence i has seq_len_i // N rows, from checkpoint_cu_starts[i], and they fill the buffer."""
    if isinstance(every_n, bool) or not hasattr(every_n, "__index__"):
        raise TypeError(f"checkpoint_every_n_tokens must be an int, got {type(every_n).__name__}")
    every_n = operator.index(every_n)
    if every_n == 0:
        raise ValueError("state_checkpoints and checkpoint_cu_starts must be None when checkpoint_every_n_tokens "
                         "is 0 (checkpoints off)")
    if every_n < 0 or every_n % CHUNK or every_n > INT32_MAX:
        raise ValueError(f"checkpoint_every_n_tokens must be a positive multiple of the chunk size ({CHUNK}) below "
                         f"2**31, got {every_n}")
    if buffer is None or starts is None:
        raise ValueError("state_checkpoints and checkpoint_cu_starts must both be given when "
                         "checkpoint_every_n_tokens > 0")
    if not isinstance(buffer, _Tensor):
        raise TypeError(f"state_checkpoints must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype is not c.state_dtype:
        raise TypeError(f"state_checkpoints must be in the call's state dtype {c.state_dtype} (a pool's, else "
                        f"output_state's, else float32), got {buffer.dtype}")
    shape = c.state_shape[1:]
    if buffer.dim() != 4 or buffer.shape[1:] != shape:
        layout = "[rows, HV, V, K] (transpose_state=True)" if c.transpose else "[rows, HV, K, V]"
        raise ValueError(f"state_checkpoints must be {layout} = [rows, {', '.join(map(str, shape))}], got "
                         f"{list(buffer.shape)}")
    if not buffer.is_contiguous() or buffer.data_ptr() % 16:
        raise ValueError("state_checkpoints must be contiguous and 16-byte aligned (the kernels write it in place), "
                         f"got strides {buffer.stride()} at address {buffer.data_ptr():#x}")
    if not isinstance(starts, _Tensor):
        raise TypeError(f"checkpoint_cu_starts must be a torch.Tensor, got {type(starts).__name__}")
    if starts.dtype not in INDEX_DTYPES:
        raise TypeError(f"checkpoint_cu_starts must be int32 or int64, got {starts.dtype}")
    if tuple(starts.shape) != (c.num_seqs + 1,):
        raise ValueError(f"checkpoint_cu_starts must have one entry per sequence and one more, shape "
                         f"[{c.num_seqs + 1}], got {list(starts.shape)}")
    if validate:  # (cu_host: cu_seqlens' values, copied by its own check)
        lengths = [b - a for a, b in zip(cu_host, cu_host[1:])] if cu_host is not None else [c.T] * c.num_seqs
        check_checkpoint_starts(starts.tolist(), lengths, every_n, buffer.shape[0])
    c.state_checkpoints, c.checkpoint_cu_starts, c.checkpoint_every_n_tokens = buffer, starts, every_n


def check_checkpoint_starts(host: list[int], lengths: list[int], every_n: int, rows: int) -> None:
    """checkpoint_cu_starts values (a host list) for sequences of `lengths`: from 0, seq_len // every_n rows a
    sequence, ending at the buffer's `rows`."""
    if host[0] != 0:
        raise ValueError(f"checkpoint_cu_starts must start at 0, got {host[0]}")
    bad = next((i for i, n in enumerate(lengths) if host[i + 1] - host[i] != n // every_n), None)
    if bad is not None:
        raise ValueError(f"checkpoint_cu_starts[{bad + 1}] - checkpoint_cu_starts[{bad}] must be sequence {bad}'s "
                         f"length {lengths[bad]} // {every_n} = {lengths[bad] // every_n}, got "
                         f"{host[bad + 1] - host[bad]}")
    if host[-1] != rows:
        raise ValueError(f"checkpoint_cu_starts must end at state_checkpoints' {rows} rows, got {host[-1]}")


def _check_gating(c: Call, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval) -> None:
    """fla's gating options: with use_gate_in_kernel, g is the raw a and A_log (and optionally dt_bias) are [HV]
    float tensors; A_log and dt_bias without it are a mistake (they would be ignored); allow_neg_eigval doubles
    the in-kernel sigmoid of beta, so it needs use_beta_sigmoid_in_kernel (as in fla)."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True: beta is then the raw b and "
                         "the kernels compute beta = 2 * sigmoid(b), in (0, 2)")
    if use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is None and name == "dt_bias":
                continue
            _check_tensor(name, x, dims=1)
            _check_float(name, x)
            if x.shape[0] != c.HV:
                raise ValueError(f"{name} must have shape [HV] = [{c.HV}] (one value a value head), got "
                                 f"{tuple(x.shape)}")
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are read only with use_gate_in_kernel=True (g is then the raw gate "
                         "input a); pass use_gate_in_kernel=True, or drop them and pass g = -exp(A_log) * "
                         "softplus(a + dt_bias)")
    c.gate_in_kernel, c.beta_sigmoid = bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel)
    c.neg_eigval = bool(allow_neg_eigval)
    c.A_log, c.dt_bias = (A_log, dt_bias) if use_gate_in_kernel else (None, None)


def _check_output(output, v):
    _check_tensor("output", output, dims=4, dtype=v.dtype)
    if output.shape != v.shape or not output.is_contiguous():
        raise ValueError(f"output must be a contiguous {tuple(v.shape)} tensor like v, got "
                         f"{tuple(output.shape)} with strides {output.stride()}")


def _refuse_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
    name = next(n for n, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                               ("initial_state", initial_state), ("A_log", A_log), ("dt_bias", dt_bias))
                if x is not None and x.requires_grad)
    raise RuntimeError(
        f"gdn_aot.chunk_gated_delta_rule is a forward-only (inference) kernel, but {name} requires grad while torch "
        "grad mode is on, and no backward exists. Call it under torch.no_grad() or torch.inference_mode(), or pass "
        "detached tensors (x.detach()); to train, use fla's chunk_gated_delta_rule.")


def _check_devices(c: Call) -> int:
    """Everything on one CUDA device; returns its index. x.get_device() is a CUDA tensor's device index and -1 on
    the CPU (and on meta): comparing it costs a third of comparing x.device (a non-CUDA accelerator tensor with the
    same index would pass; such devices do not share a process with CUDA ones in practice)."""
    q = c.q
    if not q.is_cuda:
        raise ValueError(f"q must be on a CUDA device, got {q.device}")
    index = q.get_device()
    cu, idx, h0, ht, o = c.cu_seqlens, c.state_indices, c.initial_state, c.output_state, c.output
    a_log, dt_bias, ckpt, starts = c.A_log, c.dt_bias, c.state_checkpoints, c.checkpoint_cu_starts
    if (c.k.get_device() != index or c.v.get_device() != index or c.g.get_device() != index
            or c.beta.get_device() != index or (cu is not None and cu.get_device() != index)
            or (idx is not None and idx.get_device() != index) or (h0 is not None and h0.get_device() != index)
            or (ht is not None and ht.get_device() != index) or (o is not None and o.get_device() != index)
            or (a_log is not None and a_log.get_device() != index)
            or (dt_bias is not None and dt_bias.get_device() != index)
            or (ckpt is not None and (ckpt.get_device() != index or starts.get_device() != index))):
        name, x = next((n, x) for n, x in (
            ("k", c.k), ("v", c.v), ("g", c.g), ("beta", c.beta), ("cu_seqlens", cu), ("state_indices", idx),
            ("initial_state", h0), ("output_state", ht), ("output", o), ("A_log", a_log), ("dt_bias", dt_bias),
            ("state_checkpoints", ckpt), ("checkpoint_cu_starts", starts))
            if x is not None and x.device != q.device)
        raise ValueError(f"{name} is on {x.device} but q is on {q.device}: all tensors must be on one device")
    return index
