"""CPU self-test of bench.py's plumbing (no GPU, no peers needed): python3 bench/selftest.py

bench.py runs only on a GPU; this file checks the parts that can be checked without one:
- the pure helpers: case list and --cases parsing, the 64 lengths, system selection, GPU-name slug and default
  JSON path, tables, target checks, JSON writing, the fresh-process child scripts (they must compile);
- the whole timing and invariance flow (bench.main) on the CPU, against fake libraries, with torch.cuda replaced
  by a stand-in: events read the host clock, graphs run the call once at capture and do nothing on replay. The
  fakes compute the real forward (tests/reference.py's chunked_torch) with each library's calling convention, so
  the argument mapping (FlashInfer's alpha = exp(g), no batch dim, state [N,HV,V,K]; gdn_aot's transpose_state)
  and the comparisons in one layout are checked; one fake fails under capture, to check the n/a path.
Not checked here: anything a real GPU, gdn_aot's kernels, fla or FlashInfer do.
"""
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402

spec = importlib.util.spec_from_file_location("gdn_reference", os.path.join(HERE, "..", "tests", "reference.py"))
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)

CAPTURING = [False]


# ------------------------------------------------------------------------------------------------ torch.cuda stand-in
class Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class Stream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass


class CUDAGraph:
    def replay(self):
        pass


class graph:
    def __init__(self, g, **kw):
        pass

    def __enter__(self):
        CAPTURING[0] = True

    def __exit__(self, typ, *a):
        CAPTURING[0] = False
        if typ is not None:  # as torch's capture_end does after an invalidated capture
            raise RuntimeError("fake: capture invalidated")


STREAM = Stream()
STREAMS_SET = []


def install_fake_cuda():
    props = types.SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, major=9, minor=0,
                                  total_memory=140 * 2**30)
    fake = dict(Event=Event, Stream=Stream, CUDAGraph=CUDAGraph, graph=graph, is_available=lambda: True,
                synchronize=lambda *a: None, empty_cache=lambda: None, memory_allocated=lambda *a: 0,
                max_memory_allocated=lambda *a: 0, reset_peak_memory_stats=lambda *a: None,
                current_stream=lambda *a: STREAM, set_stream=STREAMS_SET.append,
                stream=lambda s: contextlib.nullcontext(), get_device_name=lambda *a: props.name,
                current_device=lambda: 0, get_device_properties=lambda *a: props,
                get_device_capability=lambda *a: (9, 0))
    for k, v in fake.items():
        setattr(torch.cuda, k, v)
    bench.DEVICE = "cpu"


# ------------------------------------------------------------------------------------------------ fake libraries
MEMO = {}


def memo(fn):
    """Calls on the same inputs (storage, shape, strides and sums) compute once: the timing loops stay cheap."""
    def tkey(x):
        return (x.data_ptr(), tuple(x.shape), x.stride(), float(x.double().sum()), float(x.double().abs().sum()))

    def wrapped(*a, **kw):
        key = (fn.__name__,) + tuple(tkey(x) if isinstance(x, torch.Tensor) else x
                                     for x in (*a, *sorted(kw.items())) for x in (x if isinstance(x, tuple) else (x,)))
        if key not in MEMO:
            MEMO[key] = fn(*a, **kw)
        return MEMO[key]
    wrapped.__name__ = fn.__name__
    return wrapped


def ref(q, k, v, g, beta, cu, h0):
    return reference.chunked_torch(q, k, v, g, beta, cu.tolist(), h0=h0, l2norm=True)


@memo
def fake_gdn(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
             use_qk_l2norm_in_kernel=False, transpose_state=False):
    assert q.dim() == 4 and q.shape[0] == 1 and use_qk_l2norm_in_kernel and output_final_state
    assert cu_seqlens.dtype == torch.int32
    h0 = initial_state.transpose(-1, -2) if transpose_state else initial_state
    o, ht = ref(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, h0)
    return o[None].to(q.dtype), (ht.transpose(-1, -2).contiguous() if transpose_state else ht)


def fake_fla(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
             use_qk_l2norm_in_kernel=False):
    assert cu_seqlens.dtype == torch.int64
    if CAPTURING[0]:
        raise RuntimeError("fake fla: operation not permitted when stream is capturing")
    return fake_fla_run(q, k, v, g, beta, initial_state, cu_seqlens)


@memo
def fake_fla_run(q, k, v, g, beta, initial_state, cu_seqlens):
    o, ht = ref(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, initial_state)
    return o[None].to(q.dtype), ht


@memo
def fake_fi(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
            use_qk_l2norm_in_kernel=False):
    # FlashInfer's convention: [T, heads, D] without the batch dim, g is alpha = exp(log decay) in (0, 1],
    # state [N, HV, V, K] in and out, output [T, max(H, HV), V]
    assert q.dim() == 3 and v.dim() == 3 and g.dim() == 2 and beta.dim() == 2
    assert bool((g > 0).all()) and bool((g <= 1).all()), "alpha must be exp(g)"
    o, ht = ref(q, k, v, torch.log(g), beta, cu_seqlens, initial_state.transpose(-1, -2))
    return o.to(q.dtype), ht.transpose(-1, -2).contiguous()


class FakeGdn(bench.GdnAot):
    def __init__(self, state_vk=False, noisy=False):
        self.fn, self.version, self.path, self.state_vk = fake_gdn, "fake", "-", state_vk
        if noisy:  # output depends on the batch: not batch-invariant
            self.fn = lambda q, *a, cu_seqlens=None, **kw: (
                lambda o, ht: (o + 0.01 * (cu_seqlens.numel() - 2), ht))(*fake_gdn(q, *a, cu_seqlens=cu_seqlens, **kw))


def fake_gdn_state(q, k, v, g, beta, initial_state=None, output_state=None, cu_seqlens=None,
                   use_qk_l2norm_in_kernel=False, transpose_state=False):
    """gdn_aot with the state stored in output_state's dtype: the fp32 forward from the widened initial state,
    rounded into output_state (what the kernels do)."""
    o, ht = fake_gdn(q, k, v, g, beta, initial_state=initial_state.float(), output_final_state=True,
                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     transpose_state=transpose_state)
    return o, output_state.copy_(ht)


class FakeGdnState(bench.GdnAotState):
    def __init__(self, state_dtype, state_vk=False):
        self.fn, self.version, self.path, self.state_vk = fake_gdn_state, "fake", "-", state_vk
        self.state_dtype = state_dtype


class FakeFla(bench.Fla):
    def __init__(self):
        self.fn, self.version, self.path = fake_fla, "fake", "-"


class FakeFI(bench.FlashInfer):
    def __init__(self):
        self.fn, self.version, self.path = fake_fi, "fake", "-"

    def route(self, N, HV, T):
        return "CP 1536" if N * HV * 2 < 132 else "plain"


def fake_load_systems(state_vk=False, noisy=False):
    def load(names=bench.SYSTEM_ORDER, gdn_state="kv"):
        s = {"gdn_aot": FakeGdn(state_vk=gdn_state == "vk", noisy=noisy)}
        if "flashinfer" in names:
            s["flashinfer"] = FakeFI()
        if "fla" in names:
            s["fla"] = FakeFla()
        return s
    return load


# ------------------------------------------------------------------------------------------------ checks
def check_helpers():
    assert len(bench.CASES) == 10 and len({c.id for c in bench.CASES}) == 10
    assert len(bench.LENS64) == 64 and min(bench.LENS64) == 100 and max(bench.LENS64) == 3000
    assert len(set(bench.LENS64)) == 64 and sum(bench.LENS64) == 99200, sum(bench.LENS64)
    assert bench.parse_cases("all") == bench.CASES
    c = bench.parse_cases("1x8192, HV=64 8x8192 ,mixed5,1000+37+4096+511+2900,2x64@64,100+28")
    assert [x.id for x in c] == ["1x8192", "hv64-8x8192", "mixed5", "mixed5", "2x64@64", "100+28"], c
    assert c[4].lens == [64, 64] and c[4].HV == 64 and c[5].lens == [100, 28] and c[5].HV == 32
    for bad in ("foo", "3x", "0x5", "64@24"):
        try:
            bench.parse_cases(bad)
            raise AssertionError(bad)
        except ValueError:
            pass
    assert bench.parse_systems("fla") == ("gdn_aot", "fla")
    assert bench.parse_systems("fla,flashinfer,gdn_aot") == bench.SYSTEM_ORDER
    assert bench.gpu_slug("NVIDIA H200") == "h200" and bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert bench.default_out("NVIDIA H200").endswith(os.path.join("bench", "results", "h200.json"))
    assert bench.default_out("NVIDIA A100-SXM4-80GB", "invariance").endswith("a100-sxm4-80gb-invariance.json")
    assert bench.parse_state_dtypes("bf16, fp8e4m3") == ["bf16", "fp8e4m3"]
    for bad in ("", "fp64", "bf16,int8"):
        try:
            bench.parse_state_dtypes(bad)
            raise AssertionError(bad)
        except ValueError:
            pass
    sc = bench.invariance_scenarios(65536, 7)
    assert [n for n, _ in sc] == ["alone", "[3000, T, 700]", "64 seqs (T 18th)", "beside 31 x 8192"]
    assert [len(m) for _, m in sc] == [1, 3, 64, 32] and all((65536, 7) in m for _, m in sc)
    assert len(bench.invariance_scenarios(5000, 7)) == 3
    for cls, vk in ((bench.GdnAot, False), (bench.GdnAot, True), (bench.Fla, False), (bench.FlashInfer, True)):
        obj = object.__new__(cls)  # the fresh-process child scripts must compile
        obj.state_vk = vk
        code = bench.FRESH.format(imp=obj.fresh_import, call=obj.fresh_call, cu=obj.cu_dtype)
        compile(code, cls.__name__, "exec")
        assert ("transpose(-1, -2)" in code) == vk and obj.fresh_import in code
    row = dict(case="x", id="1x8192", systems={"gdn_aot": {"graph": {"median_ms": 0.15}, "eager": {"median_ms": .25}},
                                                "flashinfer": {"graph": {"median_ms": 0.3}, "eager": {"median_ms": .3}},
                                                "fla": {"graph": {"error": "E"}, "eager": {"median_ms": .5}}})
    t = bench.target_check("1x8192", row)
    assert t["ms_met"] and abs(t["over_target"] - 0.75) < 1e-9
    assert t["speedup_met"] and abs(t["speedup_vs_flashinfer"] - 2) < 1e-9
    r = bench.ratios(row)
    assert r == {"flashinfer_over_gdn_aot": {"eager": 1.2, "graph": 2.0}, "fla_over_gdn_aot": {"eager": 2.0}}, r
    assert bench.target_check("1x2048", row)["ms_met"] is None
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "a", "b.json")
        bench.write_json(p, dict(x=float("nan"), y=[1.0, float("inf")], t=torch.zeros(1)))
        assert json.load(open(p)) == dict(x="nan", y=[1.0, "inf"], t=None)
    print("helpers: ok")


def run_main(argv, state_vk=False, noisy=False):
    bench.load_systems = fake_load_systems(state_vk, noisy)
    return bench.main(argv)


def check_bench(tmp):
    out = os.path.join(tmp, "bench.json")
    orig_host_time = bench.host_time
    bench.host_time = lambda s, **kw: orig_host_time(s, calls=3, rounds=2, warmup=1)
    rc = run_main(["--cases", "2x64,100+28,1x64@64", "--quick", "--fresh", "none", "--out", out])
    bench.host_time = orig_host_time
    assert rc == 0
    res = json.load(open(out))
    m = res["meta"]
    for key in ("date", "gdn_aot_version", "gdn_aot_commit", "torch", "triton", "flashinfer", "fla", "gpu", "sm_count",
                "eager_reps", "graph_reps", "total_s"):
        assert key in m, key
    assert m["gpu"] == "NVIDIA H200" and m["sm_count"] == 132 and m["eager_reps"] == 50 and m["graph_reps"] == 50
    assert [c["id"] for c in res["cases"]] == ["2x64", "100+28", "1x64@64"]
    for c in res["cases"]:
        g, fi, fla = c["systems"]["gdn_aot"], c["systems"]["flashinfer"], c["systems"]["fla"]
        assert g["eager"]["n"] == 50 and g["graph"]["n"] == 50 and g["graph"]["equals_eager"] is True, g
        assert fi["graph"]["n"] == 50 and fi["route"].startswith(("CP", "plain"))
        assert "median_ms" not in fla["graph"] and "capturing" in fla["graph"]["error"], fla["graph"]
        assert fla["basis"] == "eager" and g["basis"] == "graph"
        for peer in ("flashinfer", "fla"):  # same math, the mapping right: only bf16 rounding of o differs
            assert c["errors"][peer]["o"] < 1e-2 and c["errors"][peer]["ht"] < 1e-5, (c["case"], peer, c["errors"])
        assert set(c["ratios"]) == {"flashinfer_over_gdn_aot", "fla_over_gdn_aot"}
        assert set(c["ratios"]["fla_over_gdn_aot"]) == {"eager"}
        assert c["target"]["speedup_vs_flashinfer"] is not None
    assert set(res["host"]) == {"gdn_aot", "flashinfer", "fla"} and res["fresh"] == {}
    assert STREAMS_SET, "the stream was not restored after capture"
    # gdn_aot with state [N, HV, V, K]; peers not selected; no extras
    rc = run_main(["--cases", "3x64", "--systems", "flashinfer", "--gdn-state", "vk", "--no-extras", "--quick",
                   "--out", out])
    res = json.load(open(out))
    assert rc == 0 and list(res["cases"][0]["systems"]) == ["gdn_aot", "flashinfer"]
    assert res["meta"]["gdn_aot_state_layout"] == "[N,HV,V,K]" and res["host"] == {}
    assert res["cases"][0]["errors"]["flashinfer"]["ht"] < 1e-5
    print("bench flow (fake libraries, fake CUDA): ok")


def check_state_dtypes(tmp):
    out = os.path.join(tmp, "state.json")
    orig = bench.load_state_systems
    bench.load_state_systems = lambda dtypes, gdn_state="kv": orig(dtypes, gdn_state, system=FakeGdnState)
    rc = bench.main(["--state-dtypes", "bf16,fp8e4m3", "--cases", "2x64", "--quick", "--out", out])
    bench.load_state_systems = orig
    res = json.load(open(out))
    assert rc == 0 and res["meta"]["mode"] == "state-dtypes"
    (c,) = res["cases"]
    assert list(c["systems"]) == ["gdn_aot", "gdn_aot-bf16", "gdn_aot-fp8e4m3"]  # fp32, the baseline, first
    assert set(c["ratios"]) == {"gdn_aot-bf16_over_gdn_aot", "gdn_aot-fp8e4m3_over_gdn_aot"}
    # against the fp32 state: each dtype starts from h0 rounded to it and stores its final state rounded, so the
    # differences grow with the rounding (bf16 2^-8, e4m3 2^-4 of a value)
    errors = c["errors"]
    assert 0 < errors["gdn_aot-bf16"]["ht"] < errors["gdn_aot-fp8e4m3"]["ht"] < 2 ** -3, errors
    assert 0 < errors["gdn_aot-bf16"]["o"] < errors["gdn_aot-fp8e4m3"]["o"] < 2 ** -3, errors
    print("state dtypes flow (fake gdn_aot, fake CUDA): ok")


def check_invariance(tmp):
    bench.LENS64 = [16 + (7 * i) % 50 for i in range(64)]  # small, for the CPU
    out = os.path.join(tmp, "inv.json")
    rc = run_main(["--invariance", "--targets", "200", "--out", out])
    res = json.load(open(out))
    assert rc == 0 and res["gdn_aot_status"] == "ok", res["gdn_aot_status"]
    rows = res["invariance"]
    assert len(rows) == 3 * 3 and all(r["bitwise"] and r["deterministic"] for r in rows), rows
    rc = run_main(["--invariance", "--targets", "200", "--systems", "gdn_aot", "--out", "none"], noisy=True)
    assert rc == 1
    print("invariance flow (fake libraries, fake CUDA): ok")


def check_fresh_failure():
    try:
        bench.fresh_process(FakeGdn(), cold_triton=False)
        print("fresh process: the child ran (a GPU and gdn_aot are here?)")
    except RuntimeError as e:
        assert "child exited" in str(e)
        print("fresh process: a failing child is reported: ok")


if __name__ == "__main__":
    check_helpers()
    install_fake_cuda()
    with tempfile.TemporaryDirectory() as tmp:
        check_bench(tmp)
        check_state_dtypes(tmp)
        check_invariance(tmp)
    check_fresh_failure()
    print("selftest passed")
