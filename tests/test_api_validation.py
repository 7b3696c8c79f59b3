"""Bad input to chunk_gated_delta_rule raises a clear TypeError/ValueError naming the argument; inputs the kernels
cannot read as given (non-contiguous, an initial state in another dtype than the call's state dtype) are converted
once; the call's state dtype (the pool's, output_state's, else fp32) reaches the dispatch configuration and the
launch; grad mode is refused.

Structure is checked before devices, so every error here is reproducible on a CPU-only machine (CI); the
device-dependent checks (tensors on two devices, cu_seqlens values on the GPU) run in test_gpu_forward.py. The
conversions are checked on the CPU by running the call's steps up to the launch (loader/api.py).
"""
from types import SimpleNamespace

import pytest
import torch

from gdn_aot.loader import api, validate
from gdn_aot.loader.api import chunk_gated_delta_rule
from gdn_aot.loader.dispatch import CONFIG_AXES

_select = api.select  # the API's select step, before a test stubs it
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def inputs(B=1, T=8, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16):
    q = torch.randn(B, T, H, K, dtype=dtype)
    return dict(q=q, k=torch.randn_like(q), v=torch.randn(B, T, HV, V, dtype=dtype),
                g=-torch.rand(B, T, HV), beta=torch.rand(B, T, HV))


def call(**over):
    args = inputs()
    args.update(over)
    return chunk_gated_delta_rule(**args)


def checkpoints(rows=0, every_n=64, starts=(0, 0), **over):
    """The checkpoint arguments of a call of inputs(): T = 8 (below every N, so no checkpoint rows)."""
    return {"state_checkpoints": torch.zeros(rows, 4, 128, 128), "checkpoint_every_n_tokens": every_n,
            "checkpoint_cu_starts": torch.tensor(starts), **over}


def two_sequences(**over):
    """130 tokens in sequences of 64 and 66 (one checkpoint each at N = 64) and their checkpoint arguments."""
    return {**inputs(T=130), "cu_seqlens": torch.tensor([0, 64, 130]), **checkpoints(rows=2, starts=(0, 1, 2)),
            **over}


CASES = [
    (dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
    (dict(A_log=torch.zeros(4)), ValueError, "A_log and dt_bias are read only with use_gate_in_kernel=True"),
    (dict(allow_neg_eigval=True), ValueError, "allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True"),
    (dict(use_gate_in_kernel=True), TypeError, "A_log must be a torch.Tensor"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4, 1)), ValueError, "A_log must have 1 dimensions"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError, "A_log must have shape \\[HV\\] = \\[4\\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4, dtype=torch.int32)), TypeError,
     "dt_bias must be float32, bfloat16 or float16"),
    (dict(q=torch.randn(1, 8, 2, 128)), TypeError, "q must be torch.bfloat16 or torch.float16"),
    (dict(q=torch.randn(8, 2, 128, dtype=torch.bfloat16)), ValueError, "q must have 4 dimensions"),
    (dict(k=torch.randn(1, 8, 2, 128, dtype=torch.float16)), TypeError, "k must have q's dtype"),
    (dict(k=torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)), ValueError, "k must have q's shape"),
    (dict(v=torch.randn(1, 7, 4, 128, dtype=torch.bfloat16)), ValueError, "v must be \\[B, T, HV, V\\]"),
    (dict(v=torch.randn(1, 8, 3, 128, dtype=torch.bfloat16), g=-torch.rand(1, 8, 3), beta=torch.rand(1, 8, 3)),
     ValueError, "HV=3 must be a multiple of q/k's H=2"),
    (dict(g=-torch.rand(1, 8, 2)), ValueError, "g must have shape \\[B, T, HV\\]"),
    (dict(beta=torch.rand(1, 8, 4).to(torch.int32)), TypeError, "beta must be float32, bfloat16 or float16"),
    (dict(cu_seqlens=torch.tensor([0, 8.0])), TypeError, "cu_seqlens must be int32 or int64"),
    (dict(cu_seqlens=torch.tensor([[0, 8]])), ValueError, "cu_seqlens must be 1-D"),
    (dict(cu_seqlens=torch.tensor([1, 8]), validate=True), ValueError, "cu_seqlens must start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 8]), validate=True), ValueError, "cu_seqlens must be non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0, 7]), validate=True), ValueError, "cu_seqlens must end at T = 8"),
    (dict(initial_state=torch.zeros(1, 4, 128, 128, dtype=torch.int32)), TypeError,
     "initial_state must be stored in one of the state dtypes torch.float32, torch.bfloat16, torch.float16, "
     "torch.float8_e4m3fn, torch.float8_e5m2, got torch.int32"),
    (dict(initial_state=torch.zeros(3, 4, 128, 128, dtype=torch.float64), state_indices=torch.tensor([0])),
     TypeError, "initial_state must be stored in one of the state dtypes .*, got torch.float64"),
    (dict(output_state=torch.zeros(1, 4, 128, 128, dtype=torch.float64)), TypeError,
     "output_state must be stored in one of the state dtypes .*, got torch.float64"),
    (dict(initial_state=torch.zeros(3, 4, 128, 128, dtype=torch.bfloat16), state_indices=torch.tensor([0]),
          output_state=torch.zeros(3, 4, 128, 128)), TypeError,
     "output_state must have the state pool's dtype torch.bfloat16 .*, got torch.float32"),
    (dict(initial_state=torch.zeros(3, 4, 128, 128).transpose(2, 3), state_indices=torch.tensor([0])),
     ValueError, "initial_state must be contiguous \\(the kernels write it in place\\)"),
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
    (dict(checkpoint_every_n_tokens=64), ValueError, "state_checkpoints and checkpoint_cu_starts must both be given"),
    (dict(state_checkpoints=torch.zeros(0, 4, 128, 128)), ValueError,
     "must be None when checkpoint_every_n_tokens is 0"),
    (checkpoints(every_n=100), ValueError, "checkpoint_every_n_tokens must be a positive multiple of the chunk size"),
    (checkpoints(every_n=-64), ValueError, "checkpoint_every_n_tokens must be a positive multiple"),
    (checkpoints(every_n=1 << 31), ValueError, "checkpoint_every_n_tokens must be a positive multiple"),
    (checkpoints(every_n=64.0), TypeError, "checkpoint_every_n_tokens must be an int"),
    (checkpoints(state_checkpoints=[0]), TypeError, "state_checkpoints must be a torch.Tensor"),
    (checkpoints(state_checkpoints=torch.zeros(0, 4, 128, 128, dtype=torch.bfloat16)), TypeError,
     "state_checkpoints must be in the call's state dtype torch.float32"),
    (checkpoints(state_checkpoints=torch.zeros(0, 2, 128, 128)), ValueError,
     "state_checkpoints must be \\[rows, HV, K, V\\] = \\[rows, 4, 128, 128\\]"),
    (checkpoints(state_checkpoints=torch.zeros(0, 4, 128, 64), transpose_state=True), ValueError,
     "state_checkpoints must be \\[rows, HV, V, K\\] \\(transpose_state=True\\)"),
    (checkpoints(state_checkpoints=torch.zeros(2, 4, 128, 128).transpose(2, 3)), ValueError,
     "state_checkpoints must be contiguous"),
    (checkpoints(checkpoint_cu_starts=[0, 0]), TypeError, "checkpoint_cu_starts must be a torch.Tensor"),
    (checkpoints(checkpoint_cu_starts=torch.tensor([0.0, 0.0])), TypeError,
     "checkpoint_cu_starts must be int32 or int64"),
    (checkpoints(checkpoint_cu_starts=torch.tensor([0, 0, 0])), ValueError,
     "checkpoint_cu_starts must have one entry per sequence and one more, shape \\[2\\]"),
    (two_sequences(checkpoint_cu_starts=torch.tensor([1, 2, 3]), validate=True), ValueError,
     "checkpoint_cu_starts must start at 0"),
    (two_sequences(checkpoint_cu_starts=torch.tensor([0, 2, 2]), validate=True), ValueError,
     "checkpoint_cu_starts\\[1\\] - checkpoint_cu_starts\\[0\\] must be sequence 0's length 64 // 64 = 1, got 2"),
    (two_sequences(state_checkpoints=torch.zeros(3, 4, 128, 128), validate=True), ValueError,
     "checkpoint_cu_starts must end at state_checkpoints' 3 rows, got 2"),
    (two_sequences(), ValueError, "q must be on a CUDA device"),  # well-formed: through to the device check
    (checkpoints(validate=True), ValueError, "q must be on a CUDA device"),  # no rows, none needed
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
    """vLLM calls fla's function with head_first=False: accepted (head_first=True is refused like the native API);
    transformers passes use_cache: ignored, as fla ignores keywords it does not know."""
    from gdn_aot.loader.fla_compat import chunk_gated_delta_rule as fla_style

    args = inputs()
    with pytest.raises(ValueError, match="q must be on a CUDA device"):  # got past the keyword handling
        fla_style(**args, initial_state=None, output_final_state=True, cu_seqlens=None, head_first=False,
                  use_qk_l2norm_in_kernel=True)
    with pytest.raises(ValueError, match="head_first=True is not supported"):
        fla_style(**args, head_first=True)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):  # other keywords ignored, as fla does
        fla_style(**args, use_cache=True)


class _Stop(Exception):
    pass


def checked_call(monkeypatch, **over) -> validate.Call:
    """The Call the API's check step makes of these arguments, as on a GPU (the device check passes, the call stops
    before select)."""
    monkeypatch.setattr(validate, "_check_devices", lambda c: 0)
    seen = {}

    def stop(call, artifacts):
        seen["call"] = call
        raise _Stop

    monkeypatch.setattr(api, "select", stop)
    with pytest.raises(_Stop):
        call(**over)
    return seen["call"]


class _NoRoute:
    """A route's workspace bound without kernels (the allocate step on the CPU)."""

    def workspace_bytes(self, B, T, num_seqs, H, HV):
        return 256


def allocate(c):
    work, address, size = api.allocate(c, _NoRoute())
    assert size == 256 and address % 256 == 0 and work.numel() >= size


def test_non_contiguous_inputs_are_copied_once(monkeypatch):
    """q, k, v, g, beta in any layout: one contiguous copy each (in the dtype the kernels read), same values."""
    base = inputs()
    strided = {name: x.transpose(1, 2).contiguous().transpose(1, 2) for name, x in base.items()}
    assert not any(x.is_contiguous() for x in strided.values())
    c = checked_call(monkeypatch, **strided)
    allocate(c)
    for name in ("q", "k", "v", "g", "beta"):
        x = getattr(c, name)
        assert x.is_contiguous() and torch.equal(x, base[name]), name
        assert x.dtype == (torch.float32 if name in ("g", "beta") else torch.bfloat16)
    assert c.output.is_contiguous() and c.output.shape == base["v"].shape and c.output.dtype == torch.bfloat16
    for x in strided.values():  # the caller's tensors are left as they were
        assert not x.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, *FP8])
def test_initial_state_of_any_state_dtype(monkeypatch, dtype):
    """fla reads the initial state in any float dtype and returns a new final state in fp32; so does gdn_aot
    (one conversion to contiguous fp32, none when it already is), fp8 initial states included."""
    h0 = torch.randn(1, 4, 128, 128).to(dtype)
    c = checked_call(monkeypatch, initial_state=h0, output_final_state=True)
    allocate(c)
    assert c.initial_state.dtype == torch.float32 and c.initial_state.is_contiguous()
    assert torch.equal(c.initial_state, h0.float())
    assert (c.initial_state is h0) == (dtype == torch.float32)
    assert c.output_state.dtype == torch.float32 and c.output_state.shape == (1, 4, 128, 128)
    t = torch.randn(1, 4, 128, 128).to(dtype).transpose(2, 3)  # [N, HV, V, K] in a strided layout
    c = checked_call(monkeypatch, initial_state=t, transpose_state=True)
    allocate(c)
    assert c.initial_state.is_contiguous() and torch.equal(c.initial_state, t.float())


def test_state_pool_is_used_in_place(monkeypatch):
    pool = torch.randn(3, 4, 128, 128)
    c = checked_call(monkeypatch, initial_state=pool, state_indices=torch.tensor([2]))
    allocate(c)
    assert c.initial_state is pool and c.output_state is pool and c.state_indices.dtype == torch.int32


def _state(dtype, slots=1, strided=False):
    """A [slots, HV=4, 128, 128] state of the test's call in `dtype` (strided: a transposed view)."""
    x = torch.randn(slots, 4, 128, 128)
    return (x.transpose(2, 3) if strided else x).to(dtype)


# (case, the call's state arguments, its state dtype, whether the kernels read initial_state as given)
STATE_CASES = [
    ("no state", lambda: {}, "fp32", None),
    ("fp32 h0, new final state", lambda: dict(initial_state=_state(torch.float32), output_final_state=True),
     "fp32", True),
    ("bf16 h0, new fp32 final state", lambda: dict(initial_state=_state(torch.bfloat16), output_final_state=True),
     "fp32", False),
    ("fp8 e4m3 h0, no final state", lambda: dict(initial_state=_state(torch.float8_e4m3fn)), "fp32", False),
    ("bf16 pool", lambda: dict(initial_state=_state(torch.bfloat16, 3), state_indices=torch.tensor([2])),
     "bf16", True),
    ("fp8 e5m2 pool and output_state", lambda: dict(initial_state=_state(torch.float8_e5m2, 3),
                                                    state_indices=torch.tensor([-1]),
                                                    output_state=_state(torch.float8_e5m2, 3)), "fp8e5m2", True),
    ("fp32 h0, fp16 output_state", lambda: dict(initial_state=_state(torch.float32),
                                                output_state=_state(torch.float16)), "fp16", False),
    ("fp16 h0 and output_state", lambda: dict(initial_state=_state(torch.float16),
                                              output_state=_state(torch.float16)), "fp16", True),
    ("strided bf16 h0, bf16 output_state", lambda: dict(initial_state=_state(torch.bfloat16, strided=True),
                                                        output_state=_state(torch.bfloat16)), "bf16", False),
    ("fp8 e4m3 output_state alone", lambda: dict(output_state=_state(torch.float8_e4m3fn)), "fp8e4m3", None),
]


def selected_config(monkeypatch, c) -> dict:
    """The configuration the API's select step looks the call's routes up by (dispatch.CONFIG_AXES)."""
    configs = []

    class Loaded:
        def get(self, config):
            configs.append(config)
            return SimpleNamespace(select=lambda programs: None)

    monkeypatch.setattr(api.Artifacts, "for_device", staticmethod(lambda index, root=None: SimpleNamespace(
        loaded=Loaded())))
    _select(c, None)
    (config,) = configs
    return dict(zip(CONFIG_AXES, config))


@pytest.mark.parametrize("make,expected,as_given", [c[1:] for c in STATE_CASES], ids=[c[0] for c in STATE_CASES])
def test_the_state_dtype_of_a_call(monkeypatch, make, expected, as_given):
    """The pool's dtype, else output_state's, else fp32: in the configuration select() asks the artifacts for, and
    what the launcher gets (an initial state in another dtype or strided converted once, contiguous, to it)."""
    args = make()
    c = checked_call(monkeypatch, **args)
    allocate(c)
    assert validate.STATE_DTYPES[c.state_dtype] == expected
    assert selected_config(monkeypatch, c)["state_dtype"] == expected
    h0 = args.get("initial_state")
    if h0 is not None:
        assert (c.initial_state is h0) == as_given
        assert c.initial_state.dtype == c.state_dtype and c.initial_state.is_contiguous()
        assert torch.equal(c.initial_state.float(), h0.to(c.state_dtype).float())
    written = args.get("output_state", h0 if "state_indices" in args else None)  # the caller's, or the pool
    if written is not None:
        assert c.output_state is written
    if c.output_state is not None:
        assert c.output_state.dtype == c.state_dtype
    got = launched_args(monkeypatch, c)
    assert got["h0"] == (0 if h0 is None else c.initial_state.data_ptr())
    assert got["ht"] == (0 if c.output_state is None else c.output_state.data_ptr())


def test_the_configuration_of_a_plain_call(monkeypatch):
    """What select() asks the artifacts for, axis by axis (the state dtype fp32 without states)."""
    cu = torch.tensor([0, 8])
    c = checked_call(monkeypatch, cu_seqlens=cu, transpose_state=True)
    assert selected_config(monkeypatch, c) == dict(dtype="bf16", K=128, V=128, varlen=True, transpose=True,
                                                   state_dtype="fp32", gating=False, checkpoints=False)


def test_grad_mode_is_refused_with_a_way_out():
    """The forward has no backward: an input that requires grad under grad mode is refused, naming it and saying
    how to call it; under no_grad / inference_mode, or detached, the call goes on (to the CPU error here)."""
    for name in ("q", "v", "g", "beta", "initial_state"):
        args = inputs()
        args["initial_state"] = torch.zeros(1, 4, 128, 128)
        args[name] = args[name].clone().requires_grad_()
        with pytest.raises(RuntimeError, match=f"forward-only \\(inference\\) kernel, but {name} requires grad") as ei:
            chunk_gated_delta_rule(**args)
        assert "torch.no_grad()" in str(ei.value) and "torch.inference_mode()" in str(ei.value)
        assert ".detach()" in str(ei.value)
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx(), pytest.raises(ValueError, match="q must be on a CUDA device"):
                chunk_gated_delta_rule(**args)
        args[name] = args[name].detach()
        with pytest.raises(ValueError, match="q must be on a CUDA device"):
            chunk_gated_delta_rule(**args)


def launched_args(monkeypatch, c) -> dict:
    """The launch step's argument struct for Call c, as the launcher would receive it, by field name (the route's
    half packed as a route of prepare variant 11 and scan variant 12 would be; stream 77, a 256-byte workspace at
    4096)."""
    from types import SimpleNamespace

    from gdn_aot.loader.abi import FORWARD_ARG_FIELDS, FORWARD_ARGS, ROUTE_ARGS

    sent = []
    route = SimpleNamespace(prefix=ROUTE_ARGS.pack(0, 11, 12, 0, 0, 128, 128, 64, 64, 2), refused_options=0)
    routes = SimpleNamespace(launcher=SimpleNamespace(gdn_aot_forward=lambda args: sent.append(args) or 0))
    monkeypatch.setattr(api, "_current_device", lambda: 0)
    monkeypatch.setattr(api, "_raw_stream", lambda index: 77)
    api.launch(c, routes, route, 4096, 256)
    (args,) = sent
    return dict(zip([f.name for f in FORWARD_ARG_FIELDS], FORWARD_ARGS.unpack(args)))


def test_launch_packs_the_declared_fields(monkeypatch):
    """The launch step's argument struct, read back by the declared field names (loader/abi.py): each field holds
    what its name says (the route's half comes packed from the route)."""
    from gdn_aot.loader.abi import OPTION_BITS

    h0 = torch.randn(1, 4, 128, 128)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    c = checked_call(monkeypatch, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                     use_qk_l2norm_in_kernel=True, scale=0.25)
    allocate(c)
    got = launched_args(monkeypatch, c)
    names = ("route", "prepare", "scan", "fused", "fused_terms", "K", "V", "BT", "BV", "elt")
    assert {n: got[n] for n in names} == dict(
        route=0, prepare=11, scan=12, fused=0, fused_terms=0, K=128, V=128, BT=64, BV=64, elt=2)
    for name in ("q", "k", "v", "g", "beta", "cu_seqlens"):
        assert got[name] == getattr(c, name).data_ptr(), name
    assert got["h0"] == h0.data_ptr() and got["ht"] == c.output_state.data_ptr() and got["o"] == c.output.data_ptr()
    assert got["state_indices"] == 0 and got["stream"] == 77 and (got["workspace"], got["workspace_bytes"]) == (4096, 256)
    assert (got["B"], got["T"], got["num_seqs"], got["H"], got["HV"], got["scale"]) == (1, 8, 1, 2, 4, 0.25)
    assert got["options"] == OPTION_BITS["L2NORM"] | OPTION_BITS["HAS_H0"] | OPTION_BITS["STORE_HT"]
    assert got["A_log"] == got["dt_bias"] == 0  # no gating in the kernels asked for


@pytest.mark.parametrize("with_bias, neg_eigval", [(False, False), (True, False), (True, True)])
def test_launch_passes_the_gating_inputs(monkeypatch, with_bias, neg_eigval):
    """use_gate_in_kernel / use_beta_sigmoid_in_kernel / allow_neg_eigval: their option bits, and A_log and
    dt_bias as fp32 [HV] (converted once from another dtype), in the launch's argument struct."""
    from gdn_aot.loader.abi import OPTION_BITS

    a_log = torch.randn(4, dtype=torch.bfloat16)
    dt_bias = torch.randn(4) if with_bias else None
    c = checked_call(monkeypatch, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval)
    allocate(c)
    assert c.A_log.dtype == torch.float32 and torch.equal(c.A_log, a_log.float())
    got = launched_args(monkeypatch, c)
    bias_bit = OPTION_BITS["GATE_BIAS"] if with_bias else 0
    neg_bit = OPTION_BITS["BETA_NEG_EIGVAL"] if neg_eigval else 0
    assert got["options"] == OPTION_BITS["GATE_IN_KERNEL"] | OPTION_BITS["BETA_SIGMOID"] | bias_bit | neg_bit
    assert got["A_log"] == c.A_log.data_ptr()
    assert got["dt_bias"] == (dt_bias.data_ptr() if with_bias else 0)


@pytest.mark.parametrize("starts_dtype", [torch.int32, torch.int64])
def test_launch_passes_the_checkpoints(monkeypatch, starts_dtype):
    """The checkpoint buffer, its rows, checkpoint_cu_starts as int64 (an int32 one converted once, an int64 one
    passed as it is) and N in the launch's argument struct, beside the other conversions (a bf16 initial state);
    all 0 without checkpoints."""
    args = two_sequences(initial_state=torch.randn(2, 4, 128, 128, dtype=torch.bfloat16))
    args["checkpoint_cu_starts"] = args["checkpoint_cu_starts"].to(starts_dtype)
    c = checked_call(monkeypatch, **args)
    allocate(c)
    assert c.initial_state.dtype == torch.float32
    starts = c.checkpoint_cu_starts
    assert starts.dtype == torch.int64 and torch.equal(starts, args["checkpoint_cu_starts"].long())
    assert (starts is args["checkpoint_cu_starts"]) == (starts_dtype == torch.int64)
    got = launched_args(monkeypatch, c)
    assert got["state_checkpoints"] == args["state_checkpoints"].data_ptr() and got["checkpoint_rows"] == 2
    assert got["checkpoint_cu_starts"] == starts.data_ptr() and got["checkpoint_every_n_tokens"] == 64
    c = checked_call(monkeypatch)
    allocate(c)
    got = launched_args(monkeypatch, c)
    assert [got[n] for n in ("state_checkpoints", "checkpoint_rows", "checkpoint_cu_starts",
                             "checkpoint_every_n_tokens")] == [0, 0, 0, 0]


@pytest.mark.parametrize("with_checkpoints", [False, True])
def test_checkpoints_select_their_configuration(monkeypatch, with_checkpoints):
    """A call with checkpoint_every_n_tokens > 0 asks the dispatch table for the configuration with checkpoints
    (dispatch.CONFIG_AXES' last axis), whose variants write them; one without, for the plain variants."""
    from types import SimpleNamespace

    from gdn_aot.loader import dispatch

    seen = {}

    def load_routes(arts, config):
        seen["config"] = config
        raise _Stop

    monkeypatch.setattr(validate, "_check_devices", lambda c: 0)
    monkeypatch.setattr(api.Artifacts, "for_device", lambda index, root=None: SimpleNamespace(loaded={}))
    monkeypatch.setattr(api, "_load_routes", load_routes)
    args = two_sequences() if with_checkpoints else dict(inputs(T=130), cu_seqlens=torch.tensor([0, 64, 130]))
    with pytest.raises(_Stop):
        chunk_gated_delta_rule(**args)
    assert dict(zip(dispatch.CONFIG_AXES, seen["config"])) == dict(
        dtype="bf16", K=128, V=128, varlen=True, transpose=False, state_dtype="fp32", gating=False,
        checkpoints=with_checkpoints)
