"""Gated DeltaNet prefill: gdn_aot.chunk_gated_delta_rule against its peers, fla 0.6.0 (Triton) and FlashInfer
0.7.2.post1 (CuTe-DSL), timed eagerly and under CUDA graphs in one process.

    python3 bench/bench.py [--cases IDS] [--systems gdn_aot,flashinfer,fla] [--quick] [--no-extras] [--out F]
    python3 bench/bench.py --invariance [--targets 5000,65536]
    python3 bench/bench.py --state-dtypes fp32,bf16 [--cases 1x8192,32x8192]
    python3 bench/bench.py --list-cases

Needs a CUDA GPU and gdn_aot importable (installed, or on PYTHONPATH). fla and FlashInfer are optional: a peer
that does not import is skipped with one message (fla is also looked for as ./.whl/fla_core-*.whl).

Shape of every case: H=16, HV=32 (64 where named), K=V=128, bf16 q/k/v, fp32 g/beta, fp32 initial state given and
final state returned, varlen API (one packed batch + cu_seqlens), use_qk_l2norm_in_kernel=True. Random inputs:
q,k,v ~ randn, g = -softplus(randn), beta = sigmoid(randn), h0 ~ randn. The same tensors go to every library, in
the form each one takes (prepared outside the timed region):
  gdn_aot     q,k [1,T,H,K], v [1,T,HV,V], g (log decay), cu_seqlens int32, state [N,HV,K,V]
              (--gdn-state vk: transpose_state=True, state [N,HV,V,K])
  fla         the same, cu_seqlens int64 (as fla documents), state [N,HV,K,V]
  flashinfer  q,k,v without the batch dim, alpha = exp(g) [T,HV], beta [T,HV], cu_seqlens int32, state
              [N,HV,V,K] (h0 transposed); output [T,HV,V]
States and outputs are compared in one layout (o as [T,HV,V], state as [N,HV,K,V]). Cases: --list-cases; "64 seqs"
is LENS64 below (64 fixed lengths spread evenly over 100..3000, shuffled by a fixed rule; 99,200 tokens).
fla autotunes in this process: TRITON_CACHE_DIR points at an empty folder unless --keep-triton-cache.

Timing, per case and library (after the first call, which may JIT-compile, and `warm-up` rounds):
  eager   CUDA events around each call, calls issued back to back; inputs rotate among 3 input sets when one
          set (inputs + outputs) is under 512 MB, so the 60 MB L2 never holds them
  graph   after one more warm-up round on a side stream, one torch.cuda.CUDAGraph per input set, each capturing
          one call; CUDA events around each replay, replays back to back, rotating over the graphs. A library
          that fails to capture or replay is reported n/a with the reason.
  Medians and minima of the timed calls (default 100 eager + 100 graph; --quick: 50 + 50, 1 warm-up round).
Columns:
  floor ms      max(183 kFLOP per token per value head at 790 TFLOP/s, unavoidable bytes at 4.3 TB/s); bytes =
                q,k,v,o,g,beta once + h0 read + final state written (~0.8 KB per token per value head at HV=32)
  X/gdn         library X's median / gdn_aot's median, eager and graph (> 1: gdn_aot is faster)
  err o / ht    max|gdn_aot - X| / max|X| of the output and of the final state (first call, input set 0)
  TF/s, %roof   183e3 * tokens * HV / median, floor / median (graph median where there is one, else eager)
  xMB           extra device memory of one eager call: max_memory_allocated during it - memory_allocated before,
                minus the returned output and final state (the call's workspace)
  1st s         the library's first call on this case in this process (fla: JIT + autotune; FlashInfer: JIT)
  route         FlashInfer's kernel route: CP (sequences split, "context parallel"; split length) or plain;
                gdn_aot's dispatch row: its route (prepare_scan, fused, fused_terms), shape class and V tile
Targets (gdn_aot graph medians): 32x8192 <= 3.0 ms, 1x65536 <= 1.2 ms, 1x8192 <= 0.20 ms, 4x2048 <= 0.11 ms,
HV=64 8x8192 <= 1.4 ms; every case >= 1.2x faster than FlashInfer under graphs.

Extras (--no-extras skips both): host time per call at T=64 (host_time(): loops of N=200 calls without
synchronising, host us = median loop time / N, dev-incl us = median time until the closing synchronize returns / N,
plus calls timed one by one; bench/host_time.py runs only this), and a fresh process's time to its first result
(the child times itself from before `import torch` to the first call's synchronize; the parent times the
subprocess; fla's child gets an empty TRITON_CACHE_DIR, so it compiles and autotunes from scratch).

--state-dtypes runs gdn_aot alone with the initial and final state stored in each listed dtype (fp32, bf16, fp16,
fp8e4m3, fp8e5m2; fp32 always, as the baseline): h0 converted to the dtype and output_state preallocated in it
outside the timed region, so every call reads and writes the state in that dtype (the recurrence stays fp32 on
chip); default cases 1x8192 and 32x8192. Printed: the medians, each dtype's ratio to fp32 (< 1: faster) and its
final state's difference from fp32's. fp16 and fp8 states need the artifacts of specs/state-dtypes.yaml
(GDN_AOT_ARTIFACTS); JSON default <gpu-name>-state-dtypes.json.

--invariance runs the batch-invariance check instead (H=16, HV=32; --systems applies): each target sequence
(default 5000 and 65536 tokens; one seed per sequence, so its data never changes) alone, in [3000, T, 700], among
64 sequences, and for targets of 65536 tokens or more beside 31 x 8192; every scenario twice. The target's rows of
o and its final state are compared bitwise with the "alone" run. Exit status 1 when gdn_aot is not bitwise
invariant (or not run-to-run deterministic), 2 when gdn_aot failed to run a scenario, else 0; peers are reported,
never checked.

JSON (bench/README.md has the schema): --out, default bench/results/h200.json on an H200, else
bench/results/<gpu-name>.json (--invariance: <gpu-name>-invariance.json); --out none writes nothing.
"""
import argparse
import datetime
import glob
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import namedtuple

import torch
import torch.nn.functional as F

H, K, V = 16, 128, 128
FLOP_PER_TOKEN_HEAD, PEAK_FLOPS, PEAK_BYTES = 183e3, 790e12, 4.3e12
ROTATE_BELOW = 512e6
MIN_TIMED = 50
DEVICE = "cuda"  # bench/selftest.py sets "cpu" to run the plumbing against fake libraries
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
os.environ.setdefault("FLA_FLASH_QLA", "0")  # fla's Triton kernels, not an optional TileLang backend

# 64 lengths spread evenly over 100..3000 (100 + 2900 j / 63, rounded), in the fixed shuffled order j = 29 i mod 64
# (29 is coprime with 64, so every j appears once): deterministic without any random generator. 99,200 tokens.
LENS64 = [round(100 + 2900 * ((29 * i) % 64) / 63) for i in range(64)]

Case = namedtuple("Case", "id name lens HV")
CASES = [Case("1x2048", "1x2048", [2048], 32),
         Case("1x8192", "1x8192", [8192], 32),
         Case("4096+4096", "4096+4096", [4096, 4096], 32),
         Case("4x2048", "4x2048", [2048] * 4, 32),
         Case("1x65536", "1x65536", [65536], 32),
         Case("32x8192", "32x8192", [8192] * 32, 32),
         Case("mixed5", "1000+37+4096+511+2900", [1000, 37, 4096, 511, 2900], 32),
         Case("hv64-1x8192", "HV=64 1x8192", [8192], 64),
         Case("hv64-8x8192", "HV=64 8x8192", [8192] * 8, 64),
         Case("64seqs", "64 seqs 100..3000", LENS64, 32)]
TARGETS_MS = {"32x8192": 3.0, "1x65536": 1.2, "1x8192": 0.20, "4x2048": 0.11, "hv64-8x8192": 1.4}
MIN_SPEEDUP_VS_FLASHINFER = 1.2
SYSTEM_ORDER = ("gdn_aot", "flashinfer", "fla")  # fla last: a failed capture can only disturb what follows it
# --state-dtypes: the storage dtypes of the state (the variants' state_dtype axis) and the cases timed by default
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}
STATE_CASES = "1x8192,32x8192"
LABEL = {"gdn_aot": "gdn", "flashinfer": "FI", "fla": "fla"}

FRESH = r"""
import sys, os; sys.path = [p for p in sys.path if p not in ('', os.getcwd())]
import time; t0 = time.perf_counter()
import json, torch, torch.nn.functional as F
{imp}
t1 = time.perf_counter()
T, H, HV, D = 8192, 16, 32, 128
q, k = (torch.randn(1, T, H, D, device='cuda', dtype=torch.bfloat16) for _ in range(2))
v = torch.randn(1, T, HV, D, device='cuda', dtype=torch.bfloat16)
g, beta = -F.softplus(torch.randn(1, T, HV, device='cuda')), torch.randn(1, T, HV, device='cuda').sigmoid()
h0, cu = torch.randn(1, HV, D, D, device='cuda'), torch.tensor([0, T], device='cuda', dtype=torch.{cu})
torch.cuda.synchronize(); t2 = time.perf_counter()
{call}
torch.cuda.synchronize(); t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, setup_s=t2 - t1, first_call_s=t3 - t2, total_s=t3 - t0)))
"""


def log(*a):
    print(*a, flush=True)


def err_str(e, limit=300):
    """One line: the first error of a chain first (a failed capture raises again on leaving torch.cuda.graph)."""
    chain = [e]
    while (c := chain[-1].__cause__ or chain[-1].__context__) is not None and c not in chain and len(chain) < 4:
        chain.append(c)
    one = lambda x: " ".join(f"{type(x).__name__}: {x}".split())  # noqa: E731
    s = one(chain[-1]) + "".join(f" [then {one(x)}]" for x in reversed(chain[:-1]))
    return s if len(s) <= limit else s[:limit] + " ..."


# ------------------------------------------------------------------------------------------------ the libraries
class System:
    """One library: prepare() turns a canonical input set (make_inputs) into its own arguments (outside any timed
    region), calling the object runs one forward and returns (o, final state), canon() puts those in the common
    layout (o [T, HV, V], state [N, HV, K, V]) for comparisons."""
    name = cu_dtype = version = None
    state_vk = False  # state [N, HV, V, K]
    fresh_import = fresh_call = None

    def prepare(self, x):
        return dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu=x["cu"][self.cu_dtype],
                    h0=x["h0"].transpose(-1, -2).contiguous() if self.state_vk else x["h0"])

    def canon(self, out, T, HV):
        o, ht = out
        return o.reshape(T, HV, V), (ht.transpose(-1, -2) if self.state_vk else ht)

    def route(self, N, HV, T):
        return None


class GdnAot(System):
    name, cu_dtype = "gdn_aot", "int32"
    fresh_import = "from gdn_aot import chunk_gated_delta_rule as f"
    state_dtype = "fp32"

    def __init__(self, state_vk=False):
        import gdn_aot
        self.fn, self.version, self.path = gdn_aot.chunk_gated_delta_rule, gdn_aot.__version__, gdn_aot.__file__
        self.state_vk = state_vk

    @property
    def fresh_call(self):
        tr = ", transpose_state=True" if self.state_vk else ""
        h0 = "h0.transpose(-1, -2).contiguous()" if self.state_vk else "h0"
        return (f"o, ht = f(q, k, v, g, beta, initial_state={h0}, output_final_state=True, cu_seqlens=cu, "
                f"use_qk_l2norm_in_kernel=True{tr})")

    def __call__(self, a):
        return self.fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"], output_final_state=True,
                       cu_seqlens=a["cu"], use_qk_l2norm_in_kernel=True, transpose_state=self.state_vk)

    def route(self, N, HV, T):
        """The dispatch row serving the batch: its route, shape class and V tile (the artifacts' table)."""
        from gdn_aot.loader import Artifacts

        routes = Artifacts.for_device(torch.cuda.current_device()).routes("bf16", K, V, True, self.state_vk,
                                                                          self.state_dtype)
        row = routes.select(N * HV)
        return f"{row.name} ({row.row['class']}, BV {row.BV})"


class GdnAotState(GdnAot):
    """gdn_aot with the initial and final state stored in `state_dtype` (--state-dtypes): prepare() converts h0 and
    allocates output_state in it, so the call's state dtype is that one (the API takes output_state's)."""

    def __init__(self, state_dtype, state_vk=False):
        super().__init__(state_vk)
        self.state_dtype = state_dtype

    def prepare(self, x):
        a = super().prepare(x)
        a["h0"] = a["h0"].to(STATE_DTYPES[self.state_dtype])
        a["ht"] = torch.empty_like(a["h0"])
        return a

    def __call__(self, a):
        return self.fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"], output_state=a["ht"],
                       cu_seqlens=a["cu"], use_qk_l2norm_in_kernel=True, transpose_state=self.state_vk)


def state_system_name(state_dtype):
    """fp32 is the baseline "gdn_aot", so bench_case's ratios and errors are each dtype's against fp32."""
    return "gdn_aot" if state_dtype == "fp32" else f"gdn_aot-{state_dtype}"


def load_state_systems(state_dtypes, gdn_state="kv", system=GdnAotState):
    """{name: system(dtype)}: fp32 first, then the other dtypes asked for."""
    return {state_system_name(d): system(d, gdn_state == "vk")
            for d in ("fp32", *(d for d in state_dtypes if d != "fp32"))}


class Fla(System):
    name, cu_dtype = "fla", "int64"  # one int64 cu_seqlens tensor per case: fla caches its chunk indices per tensor
    fresh_import = "from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f"
    fresh_call = ("o, ht = f(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, "
                  "use_qk_l2norm_in_kernel=True)")

    def __init__(self):
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        except ImportError:
            wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "fla_core-*.whl")))
            if not wheels:
                raise
            sys.path.insert(0, wheels[-1])
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [wheels[-1], os.environ.get("PYTHONPATH")]))
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        import fla
        self.fn, self.version, self.path = fn, getattr(fla, "__version__", None), os.path.dirname(fla.__file__)

    def __call__(self, a):
        return self.fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"], output_final_state=True,
                       cu_seqlens=a["cu"], use_qk_l2norm_in_kernel=True)


class FlashInfer(System):
    name, cu_dtype, state_vk = "flashinfer", "int32", True  # each cu_seqlens dtype is a JIT compile of its own
    fresh_import = "from flashinfer.gdn_prefill import chunk_gated_delta_rule as f"
    fresh_call = ("o, ht = f(q[0], k[0], v[0], g[0].exp(), beta[0], initial_state=h0.transpose(-1, -2).contiguous(), "
                  "output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)")

    def __init__(self):
        from flashinfer.gdn_prefill import chunk_gated_delta_rule as fn
        import flashinfer
        import flashinfer.gdn_prefill as gp
        # flashinfer hides a failed import of its Hopper kernels (they turn into None and fail only when called):
        # import the module again here, so the real error surfaces now
        if torch.cuda.get_device_capability()[0] == 9 and (getattr(gp, "chunk_gated_delta_rule_sm90", 0) is None
                                                           or getattr(gp, "cp_delta_rule_dsl_sm90", 0) is None):
            import flashinfer.gdn_kernels.delta_rule_dsl  # noqa: F401  (raises the hidden error)
            raise ImportError("flashinfer's SM90 GDN prefill kernels are unavailable")
        self.fn, self.version = fn, getattr(flashinfer, "__version__", None)
        self.path = os.path.dirname(flashinfer.__file__)

    def prepare(self, x):
        return dict(q=x["q"][0], k=x["k"][0], v=x["v"][0], alpha=x["g"][0].exp().contiguous(),
                    beta=x["beta"][0].contiguous(), h0=x["h0"].transpose(-1, -2).contiguous(), cu=x["cu"]["int32"])

    def __call__(self, a):
        return self.fn(a["q"], a["k"], a["v"], a["alpha"], a["beta"], initial_state=a["h0"], output_final_state=True,
                       cu_seqlens=a["cu"], use_qk_l2norm_in_kernel=True)

    def route(self, N, HV, T):
        """The route FlashInfer's host heuristic picks (CP: sequences split into pieces), or None if unknown."""
        try:
            from flashinfer.gdn_kernels.delta_rule_dsl.varlen_helper import (choose_cp_chunk_len_host,
                                                                            should_use_cp_host)
            p = torch.cuda.get_device_properties(torch.cuda.current_device())
            cc = (p.major, p.minor)
            if not should_use_cp_host(N * HV, p.multi_processor_count, p.name, device_capability=cc):
                return "plain"
        except Exception:
            return None
        try:
            split = choose_cp_chunk_len_host(T, HV, p.multi_processor_count, device_capability=cc, total_seqlen=T,
                                             num_seqs=N, device_name=p.name)
            return f"CP {split}"
        except Exception:
            return "CP"


SYSTEM_CLASSES = {"gdn_aot": GdnAot, "flashinfer": FlashInfer, "fla": Fla}


def load_systems(names=SYSTEM_ORDER, gdn_state="kv"):
    """{name: System} for the named libraries that import, in SYSTEM_ORDER; gdn_aot always (its import error is
    fatal), each peer that fails to import skipped with one message."""
    systems = {"gdn_aot": GdnAot(state_vk=gdn_state == "vk")}
    for name in SYSTEM_ORDER[1:]:
        if name not in names:
            continue
        t0 = time.perf_counter()
        try:
            s = systems[name] = SYSTEM_CLASSES[name]()
            log(f"{name} {s.version} from {s.path} ({time.perf_counter() - t0:.1f} s to import)")
        except Exception as e:
            hint = {"flashinfer": "needs `from flashinfer.gdn_prefill import chunk_gated_delta_rule` (FlashInfer "
                                  "0.7.2.post1 and its CuTe-DSL runtime on PYTHONPATH)",
                    "fla": "needs fla-core 0.6.0 installed or ./.whl/fla_core-*.whl"}[name]
            log(f"SKIPPING {name}: not importable ({err_str(e)}); {hint}")
    return systems


# ------------------------------------------------------------------------------------------------ inputs
def cu_tensors(lens):
    cu32 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    return {"int32": cu32, "int64": cu32.long()}


def make_inputs(lens, HV, seed, cu):
    """One canonical input set (fla's layout, state [N, HV, K, V]) for the packed batch `lens`."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    T, N = sum(lens), len(lens)
    randn = lambda *shape, dtype=torch.float32: torch.randn(*shape, device=DEVICE, dtype=dtype, generator=gen)  # noqa
    return dict(q=randn(1, T, H, K, dtype=torch.bfloat16), k=randn(1, T, H, K, dtype=torch.bfloat16),
                v=randn(1, T, HV, V, dtype=torch.bfloat16), g=-F.softplus(randn(1, T, HV)),
                beta=randn(1, T, HV).sigmoid(), h0=randn(N, HV, K, V), cu=cu)


def seq_inputs(L, HV, seed):
    """One sequence's inputs from its own seed, so it is the same data in whatever batch it is packed."""
    x = make_inputs([L], HV, seed, None)
    return {key: t[0] for key, t in x.items() if key != "cu"}  # q [L, H, K], ..., h0 [HV, K, V]


def pack(seqs):
    x = {key: torch.cat([s[key] for s in seqs])[None].contiguous() for key in ("q", "k", "v", "g", "beta")}
    x["h0"] = torch.stack([s["h0"] for s in seqs]).contiguous()
    x["cu"] = cu_tensors([s["q"].shape[0] for s in seqs])
    return x


def set_bytes(lens, HV):
    T, N = sum(lens), len(lens)
    return T * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4) + 2 * N * HV * K * V * 4


def floor_s(lens, HV):
    flop = FLOP_PER_TOKEN_HEAD * sum(lens) * HV
    return max(flop / PEAK_FLOPS, set_bytes(lens, HV) / PEAK_BYTES), flop


# ------------------------------------------------------------------------------------------------ timing
def summarize(ms):
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), n=len(ms))


def time_eager(run, args, reps):
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for i, (start, end) in enumerate(events):
        start.record()
        run(args[i % len(args)])
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def time_graph(run, args, reps):
    """Warm up on a side stream, capture one call per input set (one graph each), time `reps` replays back to back
    rotating over the graphs. Returns (times in ms, the outputs graph 0 writes, the graphs)."""
    stream = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        for a in args:
            run(a)
    stream.wait_stream(side)
    torch.cuda.synchronize()
    graphs, outs = [], []
    try:
        for a in args:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs.append(run(a))
            graphs.append(g)
    finally:
        torch.cuda.set_stream(stream)  # a failed capture can leave the capture stream current
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events], outs[0], graphs


def extra_mb(run, a):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o, ht = run(a)
    torch.cuda.synchronize()
    returned = o.nbytes + (0 if ht is a.get("ht") else ht.nbytes)  # a preallocated final state is not the call's
    return (torch.cuda.max_memory_allocated() - before - returned) / 2**20


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def max_abs(a, b):
    return (a.float() - b.float()).abs().max().item()


def bench_case(case, systems, reps, graph_reps, warmup):
    lens, HV = case.lens, case.HV
    T, N = sum(lens), len(lens)
    cu = cu_tensors(lens)
    sets = [make_inputs(lens, HV, seed, cu) for seed in range(3 if set_bytes(lens, HV) < ROTATE_BELOW else 1)]
    floor, flop = floor_s(lens, HV)
    row = dict(case=case.name, id=case.id, lens=lens, tokens=T, seqs=N, HV=HV, floor_ms=floor * 1e3,
               input_sets=len(sets), systems={}, ratios={}, errors={})
    canon = {}
    for name, s in systems.items():
        d = row["systems"][name] = {}
        args = None
        try:
            args = [s.prepare(x) for x in sets]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = s(args[0])
            torch.cuda.synchronize()
            d["first_call_s"] = time.perf_counter() - t0
            canon[name] = s.canon(out, T, HV)
            # after the first call, whose time includes what finding the route loads (gdn_aot's artifacts)
            route = s.route(N, HV, T)
            if route:
                d["route"] = route
            for _ in range(warmup):
                for a in args:
                    s(a)
            d["eager"] = summarize(time_eager(s, args, reps))
            d["extra_mb"] = extra_mb(s, args[0])
        except Exception as e:
            d["error"] = err_str(e)
            log(f"  {case.name:>24} {name:>10}: FAILED {d['error']}")
            args = None
            torch.cuda.empty_cache()
            continue
        try:
            ms, gout, graphs = time_graph(s, args, graph_reps)
            d["graph"] = dict(summarize(ms), calls_per_replay=1, graphs=len(graphs),
                              equals_eager=bool(torch.equal(s.canon(gout, T, HV)[0], canon[name][0])))
            del gout, graphs
        except Exception as e:
            d["graph"] = dict(error=err_str(e))
            try:
                torch.cuda.synchronize()
            except Exception as e2:
                d["graph"]["after"] = err_str(e2)
        args = None
        torch.cuda.empty_cache()
        basis = "graph" if "median_ms" in d["graph"] else "eager"
        med = d[basis]["median_ms"]
        d.update(tflops=flop / med * 1e-9, roofline=floor * 1e3 / med, basis=basis)
        gtxt = (f"graph {d['graph']['median_ms']:.3f} ms (min {d['graph']['min_ms']:.3f})" if basis == "graph"
                else f"graph n/a ({d['graph']['error']})")
        log(f"  {case.name:>24} {name:>10}: eager {d['eager']['median_ms']:.3f} ms (min {d['eager']['min_ms']:.3f}), "
            f"{gtxt}, first call {d['first_call_s']:.2f} s, extra {d['extra_mb']:.1f} MB"
            + (f", route {d['route']}" if "route" in d else ""))
    if "gdn_aot" in canon:
        o_ref, ht_ref = canon["gdn_aot"]
        for name in canon:
            if name == "gdn_aot":
                continue
            try:
                o, ht = canon[name]
                row["errors"][name] = dict(o=rel_err(o_ref, o), ht=rel_err(ht_ref, ht))
                log(f"  {case.name:>24} gdn_aot vs {name}: max|diff|/max|{name}| o {row['errors'][name]['o']:.2e}, "
                    f"final state {row['errors'][name]['ht']:.2e}")
            except Exception as e:
                row["errors"][name] = dict(error=err_str(e))
    row["ratios"] = ratios(row)
    row["target"] = target_check(case.id, row)
    return row


def median_of(row, name, mode):
    return row["systems"].get(name, {}).get(mode, {}).get("median_ms")


def ratios(row):
    """{peer_over_gdn_aot: {eager, graph}}: the peer's median / gdn_aot's median, where both exist."""
    out = {}
    for name in row["systems"]:
        if name == "gdn_aot":
            continue
        r = {mode: median_of(row, name, mode) / median_of(row, "gdn_aot", mode) for mode in ("eager", "graph")
             if median_of(row, name, mode) and median_of(row, "gdn_aot", mode)}
        if r:
            out[f"{name}_over_gdn_aot"] = r
    return out


def target_check(case_id, row):
    """gdn_aot's graph median against the case's ms target (if any) and FlashInfer's graph median against
    MIN_SPEEDUP_VS_FLASHINFER x gdn_aot's. Missing numbers give None (not met, not failed)."""
    g = median_of(row, "gdn_aot", "graph")
    t = dict(target_ms=TARGETS_MS.get(case_id), gdn_aot_graph_ms=g, over_target=None, ms_met=None,
             min_speedup_vs_flashinfer=MIN_SPEEDUP_VS_FLASHINFER, speedup_vs_flashinfer=None, speedup_met=None)
    if t["target_ms"] and g:
        t["over_target"] = g / t["target_ms"]
        t["ms_met"] = g <= t["target_ms"]
    fi = median_of(row, "flashinfer", "graph")
    if fi and g:
        t["speedup_vs_flashinfer"] = fi / g
        t["speedup_met"] = fi / g >= MIN_SPEEDUP_VS_FLASHINFER
    return t


# ------------------------------------------------------------------------------------------------ extras
def host_time(system, calls=200, rounds=5, warmup=20):
    """Host time per call at T=64 (1 x 64 tokens, HV=32, varlen, l2norm, initial + final state; launch-bound) of a
    System. Call by call: each call timed alone after a synchronize (an empty launch queue). Back to back: `rounds`
    loops of `calls` calls without synchronising, loop time / calls each (host_us: their median; device_incl_us: the
    median of each loop until its closing synchronize returns, / calls). Medians and minima in us."""
    run, a = system, system.prepare(make_inputs([64], 32, 0, cu_tensors([64])))
    for _ in range(warmup):
        run(a)
    single = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(a)
        single.append(time.perf_counter() - t0)
    loops, incl = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            run(a)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        loops.append((t1 - t0) / calls)
        incl.append((time.perf_counter() - t0) / calls)
    us = lambda t: t * 1e6  # noqa: E731
    return dict(host_us=us(statistics.median(loops)), device_incl_us=us(statistics.median(incl)),
                b2b_min_us=us(min(loops)), call_median_us=us(statistics.median(single)), call_min_us=us(min(single)),
                calls=calls, rounds=rounds)


def fresh_process(system, cold_triton):
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if cold_triton:
            env["TRITON_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", FRESH.format(imp=system.fresh_import, call=system.fresh_call,
                                                               cu=system.cu_dtype)],
                           env=env, capture_output=True, text=True, timeout=240)
        wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"child exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]), parent_wall_s=wall)


# ------------------------------------------------------------------------------------------------ invariance
def invariance_scenarios(T, target_seed, HV=32):
    """[(scenario name, [(length, seed), ...])]: the target (T, target_seed) alone, in [3000, T, 700], as the 18th
    of 64 sequences (the other 63: LENS64[:63]) and, for T >= 65536, 6th of 32 with 31 x 8192."""
    tgt = (T, target_seed)
    others = [(L, 1000 + i) for i, L in enumerate(LENS64[:63])]
    sc = [("alone", [tgt]), ("[3000, T, 700]", [(3000, 101), tgt, (700, 102)]),
          ("64 seqs (T 18th)", others[:17] + [tgt] + others[17:])]
    if T >= 65536:
        sc.append(("beside 31 x 8192", [(8192, 2000 + i) for i in range(5)] + [tgt]
                   + [(8192, 2005 + i) for i in range(26)]))
    return sc


def run_invariance(systems, targets, HV=32):
    """Returns (table rows, gdn_aot status: 'ok' / 'not invariant' / 'failed')."""
    rows, status = [], "ok"
    for ti, T in enumerate(targets):
        seed = 100 + ti
        results = {name: [] for name in systems}
        for sname, members in invariance_scenarios(T, seed, HV):
            idx = next(i for i, m in enumerate(members) if m == (T, seed))
            x = pack([seq_inputs(L, HV, sd) for L, sd in members])
            lo = sum(L for L, _ in members[:idx])
            Ttot, N = sum(L for L, _ in members), len(members)
            for name, s in systems.items():
                r = dict(scenario=sname, seqs=N, tokens=Ttot, route=s.route(N, HV, Ttot))
                try:
                    a = s.prepare(x)
                    reps = []
                    for _ in range(2):
                        o, ht = s.canon(s(a), Ttot, HV)
                        torch.cuda.synchronize()
                        reps.append((o[lo:lo + T].clone(), ht[idx].clone()))
                        del o, ht
                    del a
                    r.update(o=reps[0][0], ht=reps[0][1], deterministic=bool(
                        torch.equal(reps[0][0], reps[1][0]) and torch.equal(reps[0][1], reps[1][1])))
                except Exception as e:
                    r["error"] = err_str(e)
                    if name == "gdn_aot":
                        status = "failed"
                results[name].append(r)
            del x
            torch.cuda.empty_cache()
            log(f"  invariance T={T}: ran {sname} (N={N}, {Ttot} tokens)")
        for name, rs in results.items():
            base = rs[0]
            for r in rs:
                row = dict(target=T, system=name, scenario=r["scenario"], seqs=r["seqs"], route=r["route"])
                if "error" in r or "error" in base:
                    row["error"] = r.get("error") or f"alone: {base['error']}"
                else:
                    row.update(bitwise=bool(torch.equal(r["o"], base["o"]) and torch.equal(r["ht"], base["ht"])),
                               max_do=max_abs(r["o"], base["o"]), max_dh=max_abs(r["ht"], base["ht"]),
                               deterministic=r["deterministic"])
                    if name == "gdn_aot" and not (row["bitwise"] and row["deterministic"]) and status == "ok":
                        status = "not invariant"
                rows.append(row)
        del results
        torch.cuda.empty_cache()
    return rows, status


def invariance_table(rows):
    lines = ["| target | system | scenario | N | route | bitwise vs alone | max abs do | max abs dh | run to run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            cells = [str(r["target"]), r["system"], r["scenario"], str(r["seqs"]), r.get("route") or "-",
                     f"FAILED: {r['error']}", "-", "-", "-"]
        else:
            cells = [str(r["target"]), r["system"], r["scenario"], str(r["seqs"]), r.get("route") or "-",
                     "yes" if r["bitwise"] else "NO", fmt(r["max_do"], ".1e"), fmt(r["max_dh"], ".1e"),
                     "bitwise" if r["deterministic"] else "DIFFERS"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ helpers
def parse_cases(spec):
    """Comma-separated case ids or names (--list-cases), 'all', or ad-hoc cases: NxL (N sequences of L tokens) or
    L1+L2+..., optionally followed by @HV (e.g. 2x16384@64). Returns [Case]."""
    if spec in (None, "", "all"):
        return list(CASES)
    known = {c.id.lower(): c for c in CASES}
    known.update({c.name.lower(): c for c in CASES})
    out = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        if tok.lower() in known:
            out.append(known[tok.lower()])
            continue
        m = re.fullmatch(r"(?:(\d+)x(\d+)|(\d+(?:\+\d+)*))(?:@(?:hv=?)?(\d+))?", tok.lower())
        if not m:
            raise ValueError(f"unknown case {tok!r}: one of {', '.join(c.id for c in CASES)}, or NxL / L1+L2 [@HV]")
        lens = [int(m[2])] * int(m[1]) if m[1] else [int(x) for x in m[3].split("+")]
        HV = int(m[4]) if m[4] else 32
        if not lens or min(lens) < 1 or HV % H:
            raise ValueError(f"bad case {tok!r}: lengths must be >= 1 and HV a multiple of {H}")
        out.append(Case(tok, tok if HV == 32 else f"HV={HV} {tok.split('@')[0]}", lens, HV))
    if not out:
        raise ValueError("no cases selected")
    return out


def parse_state_dtypes(spec):
    dtypes = [d.strip().lower() for d in spec.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in STATE_DTYPES]
    if not dtypes or bad:
        raise ValueError(f"--state-dtypes: comma-separated among {', '.join(STATE_DTYPES)}, got {spec!r}")
    return dtypes


def parse_systems(spec):
    names = [n.strip().lower() for n in (spec or "").split(",") if n.strip()]
    bad = [n for n in names if n not in SYSTEM_CLASSES]
    if bad:
        raise ValueError(f"unknown system(s) {bad}: choose from {', '.join(SYSTEM_ORDER)}")
    return tuple(n for n in SYSTEM_ORDER if n in names or n == "gdn_aot")


def gpu_slug(name):
    if "H200" in name.upper():
        return "h200"
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    s = re.sub(r"^nvidia-", "", s)
    return s or "gpu"


def default_out(gpu_name, mode="bench"):
    """bench/results/<gpu>.json, or <gpu>-<mode>.json for the other modes (invariance, state-dtypes)."""
    return os.path.join(BENCH_DIR, "results", gpu_slug(gpu_name) + ("" if mode == "bench" else f"-{mode}") + ".json")


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "nan" / "inf": strict JSON has no such numbers
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return None
    return x


def write_json(path, obj):
    """Atomically (temporary file + rename) write obj as JSON, creating the folder; non-finite floats as strings."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_jsonable(obj), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def git_commit():
    """(commit, source, dirty): $GDN_AOT_COMMIT if set, else `git rev-parse HEAD` of the checkout bench.py is in."""
    env = os.environ.get("GDN_AOT_COMMIT")
    if env:
        return env, "env GDN_AOT_COMMIT", None
    try:
        run = lambda *a: subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, timeout=10)  # noqa
        p = run("rev-parse", "HEAD")
        if p.returncode == 0 and p.stdout.strip():
            d = run("status", "--porcelain", "--untracked-files=no")
            return p.stdout.strip(), "git", bool(d.stdout.strip()) if d.returncode == 0 else None
    except Exception:
        pass
    return None, None, None


def artifacts_identity(arts):
    """What gdn_aot's calls run, from its ArtifactSet's manifest: the directory, and the hashes of the kernel sources,
    spec and build code it was built from (the commit of a device's copy of the checkout may not be the wheel's)."""
    data = arts.manifest.data
    return dict(dir=str(arts.manifest.dir), kernels_source_sha256=data.get("kernels_source_sha256"),
                spec_sha256=data.get("spec", {}).get("sha256"), build_code_version=data.get("build_code_version"))


def dist_version(dist):
    """An installed distribution's version, without importing it (None if absent)."""
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


def metadata(systems, extra=None):
    dev = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(dev)
    commit, source, dirty = git_commit()
    driver = None
    try:
        q = subprocess.run(["nvidia-smi", f"--id={dev}", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        driver = q.stdout.strip() or None
    except Exception:
        pass
    ver = lambda name, dist: systems[name].version if name in systems else dist_version(dist)  # noqa: E731
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gdn_aot_version=systems["gdn_aot"].version, gdn_aot_path=systems["gdn_aot"].path,
                gdn_aot_commit=commit, gdn_aot_commit_source=source, gdn_aot_checkout_dirty=dirty,
                gdn_aot_state_layout="[N,HV,V,K]" if systems["gdn_aot"].state_vk else "[N,HV,K,V]",
                torch=torch.__version__, cuda=torch.version.cuda, triton=dist_version("triton"),
                flashinfer=ver("flashinfer", "flashinfer-python"), fla=ver("fla", "fla-core"),
                gpu=p.name, sm_count=p.multi_processor_count, compute_capability=f"{p.major}.{p.minor}",
                gpu_memory_gib=round(p.total_memory / 2**30, 1), driver=driver, python=platform.python_version(),
                argv=sys.argv[1:], systems=list(systems), H=H, K=K, V=V)
    try:
        from gdn_aot.loader import Artifacts
        meta["gdn_aot_artifacts"] = artifacts_identity(Artifacts.for_device(dev))
    except Exception as e:  # the timings say which calls failed; the metadata says why it has no identity
        meta["gdn_aot_artifacts"] = dict(error=f"{type(e).__name__}: {e}")
    meta.update(extra or {})
    return meta


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _md(cols, body):
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(r) + " |" for r in body])


def _ms_cell(d, mode):
    m = d.get(mode)
    if m is None:
        return "-"
    return "n/a" if "median_ms" not in m else fmt(m["median_ms"])


def main_table(rows, names):
    """Per case: each library's eager and graph medians (ms), peer/gdn_aot ratios, gdn_aot's errors vs the peers."""
    peers = [n for n in names if n != "gdn_aot"]
    cols = ["case"] + [f"{LABEL.get(n, n)} {m}" for n in names for m in ("eager", "graph")]
    cols += [f"{LABEL.get(p, p)}/gdn {m}" for p in peers for m in ("eager", "graph")]
    cols += [f"err {w} vs {LABEL.get(p, p)}" for p in peers for w in ("o", "ht")]
    body = []
    for r in rows:
        cells = [r["case"]]
        for n in names:
            d = r["systems"].get(n, {})
            cells += ["FAILED", "-"] if "error" in d else [_ms_cell(d, "eager"), _ms_cell(d, "graph")]
        for p in peers:
            q = r.get("ratios", {}).get(f"{p}_over_gdn_aot", {})
            cells += [fmt(q.get("eager"), ".2f"), fmt(q.get("graph"), ".2f")]
        for p in peers:
            e = r.get("errors", {}).get(p, {})
            cells += [fmt(e.get("o"), ".1e"), fmt(e.get("ht"), ".1e")]
        body.append(cells)
    return _md(cols, body)


def failure_notes(rows, names):
    """One line per (library, reason) of a failed case or an n/a graph, naming the cases."""
    seen = {}
    for r in rows:
        for n in names:
            d = r["systems"].get(n, {})
            for what, reason in (("FAILED", d.get("error")), ("graph n/a", (d.get("graph") or {}).get("error"))):
                if reason:
                    seen.setdefault((n, what, reason), []).append(r["case"])
    return [f"{what}: {n} ({', '.join(cases)}): {reason}" for (n, what, reason), cases in seen.items()]


def state_dtypes_table(rows, names):
    """Per case and state dtype: medians, the ratio to the fp32 state's, and the final state's difference."""
    cols = ["case", "state", "eager ms", "graph ms", "/fp32 eager", "/fp32 graph", "ht vs fp32"]
    body = []
    for r in rows:
        for n in names:
            d = r["systems"].get(n, {})
            state = n.split("-", 1)[1] if "-" in n else "fp32"
            if "error" in d:
                body.append([r["case"], state, "FAILED", "-", "-", "-", d["error"][:80]])
                continue
            q = r.get("ratios", {}).get(f"{n}_over_gdn_aot", {})
            e = r.get("errors", {}).get(n, {})
            body.append([r["case"], state, _ms_cell(d, "eager"), _ms_cell(d, "graph"), fmt(q.get("eager"), ".3f"),
                         fmt(q.get("graph"), ".3f"), fmt(e.get("ht"), ".1e")])
    return _md(cols, body)


def targets_table(rows):
    cols = ["case", "gdn graph ms", "target ms", "gdn/target", "ms target", "FI graph ms", "FI/gdn graph",
            f">= {MIN_SPEEDUP_VS_FLASHINFER}x FI"]
    yn = lambda b: "-" if b is None else ("met" if b else "MISSED")  # noqa: E731
    body = []
    for r in rows:
        t = r.get("target") or target_check(r.get("id"), r)
        body.append([r["case"], fmt(t["gdn_aot_graph_ms"]), fmt(t["target_ms"], ".2f"), fmt(t["over_target"], ".2f"),
                     yn(t["ms_met"]), fmt(median_of(r, "flashinfer", "graph")), fmt(t["speedup_vs_flashinfer"], ".2f"),
                     yn(t["speedup_met"])])
    return _md(cols, body)


def targets_summary(rows):
    ts = [r.get("target") or {} for r in rows]
    ms = [t.get("ms_met") for t in ts if t.get("target_ms")]
    sp = [t.get("speedup_met") for t in ts]
    return (f"ms targets met: {sum(1 for b in ms if b)}/{len(ms)} (not measured: {sum(1 for b in ms if b is None)}); "
            f">= {MIN_SPEEDUP_VS_FLASHINFER}x FlashInfer under graphs: {sum(1 for b in sp if b)}/{len(sp)} "
            f"(not measured: {sum(1 for b in sp if b is None)})")


def details_table(rows, names):
    cols = ["case", "floor ms", "library", "eager med", "eager min", "graph med", "graph min", "TF/s", "%roof", "xMB",
            "1st s", "route / notes"]
    body = []
    for r in rows:
        for n in names:
            d = r["systems"].get(n)
            if d is None:
                continue
            e, g = d.get("eager") or {}, d.get("graph") or {}
            notes = [d["route"]] if d.get("route") else []
            if d.get("error"):
                notes.append("FAILED")
            if g.get("error"):
                notes.append("graph n/a")
            if g.get("equals_eager") is False:
                notes.append("graph output != eager")
            body.append([r["case"], fmt(r.get("floor_ms")), n, fmt(e.get("median_ms")), fmt(e.get("min_ms")),
                         fmt(g.get("median_ms")), fmt(g.get("min_ms")), fmt(d.get("tflops"), ".0f"),
                         fmt(d.get("roofline") and 100 * d["roofline"], ".1f"), fmt(d.get("extra_mb"), ".1f"),
                         fmt(d.get("first_call_s"), ".2f"), ", ".join(notes) or "-"])
    return _md(cols, body)


def extras_table(results, names):
    cols = ["library", "host us/call at T=64", "device-incl. us/call", "call by call us",
            "fresh process: child s (import / first call)", "parent wall s"]
    body = []
    for n in names:
        h, r = results["host"].get(n, {}), results["fresh"].get(n, {})
        child = (f"{fmt(r.get('total_s'), '.2f')} ({fmt(r.get('import_s'), '.2f')} / "
                 f"{fmt(r.get('first_call_s'), '.2f')})")
        body.append([n, fmt(h.get("host_us"), ".1f"), fmt(h.get("device_incl_us"), ".1f"),
                     fmt(h.get("call_median_us"), ".1f"), child if r else "-", fmt(r.get("parent_wall_s"), ".2f")])
    return _md(cols, body)


# ------------------------------------------------------------------------------------------------ main
def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] + " " + __doc__.splitlines()[1],
                                 epilog="Module docstring and bench/README.md: columns, method, JSON schema.")
    ap.add_argument("--cases", help="comma-separated case ids (--list-cases) or NxL / L1+L2 [@HV] ad-hoc cases; "
                    f"default all ({STATE_CASES} with --state-dtypes)")
    ap.add_argument("--systems", default=",".join(SYSTEM_ORDER),
                    help="comma-separated subset of gdn_aot,flashinfer,fla (gdn_aot is always run; a peer that "
                    "does not import is skipped); default all three")
    ap.add_argument("--quick", action="store_true", help="1 warm-up round instead of 2 and 50 timed calls (eager "
                    "and graph) instead of 100")
    ap.add_argument("--reps", type=int, help=f"timed eager calls per case and library (>= {MIN_TIMED})")
    ap.add_argument("--graph-reps", type=int, help=f"timed graph replays per case and library (>= {MIN_TIMED})")
    ap.add_argument("--gdn-state", choices=("kv", "vk"), default="kv",
                    help="gdn_aot's state layout: kv = [N,HV,K,V] (fla's, default), vk = [N,HV,V,K] "
                    "(transpose_state=True, FlashInfer's)")
    ap.add_argument("--no-extras", action="store_true", help="skip the host-time and fresh-process measurements")
    ap.add_argument("--fresh", default="all", help="libraries that get the fresh-process measurement: all, none, or "
                    "a comma-separated list (fla's takes ~1 min: it compiles and autotunes from scratch)")
    ap.add_argument("--keep-triton-cache", action="store_true",
                    help="let fla reuse autotune results cached on disk (by default it gets an empty "
                    "TRITON_CACHE_DIR: results a test suite cached for its small shapes made fla 1.1-1.7x slower)")
    ap.add_argument("--out", help="JSON path (default bench/results/h200.json on an H200, else "
                    "bench/results/<gpu-name>.json; with --invariance <gpu-name>-invariance.json); 'none': no JSON")
    ap.add_argument("--invariance", action="store_true",
                    help="run the batch-invariance check instead of the timing bench (exit 1 if gdn_aot is not "
                    "bitwise invariant, 2 if it failed to run)")
    ap.add_argument("--targets", default="5000,65536", help="--invariance: target sequence lengths")
    ap.add_argument("--state-dtypes", help="time gdn_aot alone with the state stored in each of these dtypes "
                    f"(among {', '.join(STATE_DTYPES)}; fp32 always, the baseline of the printed ratios)")
    ap.add_argument("--list-cases", action="store_true", help="print the case ids and exit (needs no GPU)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        cases = parse_cases(args.cases or (STATE_CASES if args.state_dtypes else "all"))
        names = parse_systems(args.systems)
        state_dtypes = parse_state_dtypes(args.state_dtypes) if args.state_dtypes else None
        targets = [int(t) for t in args.targets.split(",") if t.strip()]
        if not targets or min(targets) < 1:
            raise ValueError("--targets: positive sequence lengths, comma-separated")
    except ValueError as e:
        ap.error(str(e))
    if args.list_cases:
        for c in CASES:
            lens = c.lens if len(c.lens) <= 8 else f"{len(c.lens)} lengths, {sum(c.lens)} tokens"
            log(f"{c.id:>12}  {c.name:<24} HV={c.HV}  {lens}"
                + (f"  target <= {TARGETS_MS[c.id]} ms" if c.id in TARGETS_MS else ""))
        return 0
    reps = args.reps or (MIN_TIMED if args.quick else 100)
    graph_reps = args.graph_reps or (MIN_TIMED if args.quick else 100)
    if min(reps, graph_reps) < MIN_TIMED:
        ap.error(f"--reps and --graph-reps must be at least {MIN_TIMED}")
    warmup = 1 if args.quick else 2
    if not torch.cuda.is_available():
        log("no CUDA device: bench.py needs a GPU (--help and --list-cases work without one)")
        return 2
    if not args.keep_triton_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gdn_bench_triton_")
    start = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    mode = "invariance" if args.invariance else "state-dtypes" if state_dtypes else "bench"
    out = None if (args.out or "").lower() == "none" else (args.out or default_out(gpu, mode))
    log(f"{gpu}, torch {torch.__version__}" + ("" if args.invariance else
        f", {reps} eager calls + {graph_reps} graph replays per case and library, {warmup} warm-up round(s)"))
    try:
        systems = load_state_systems(state_dtypes, args.gdn_state) if state_dtypes else load_systems(names,
                                                                                                   args.gdn_state)
    except Exception as e:
        log(f"gdn_aot is not importable: {err_str(e, 2000)}")
        return 2
    names = list(systems)
    log(f"libraries: {', '.join(names)} ({time.perf_counter() - start:.0f} s elapsed)")

    if args.invariance:
        results = dict(meta=metadata(systems, dict(mode="invariance", targets=targets)), invariance=[])
        rows, status = run_invariance(systems, targets)
        results["invariance"], results["gdn_aot_status"] = rows, status
        results["meta"]["total_s"] = time.perf_counter() - start
        write_json(out, results)
        log("\n## Batch invariance: the target's rows of o and its final state, against the target alone "
            "(H=16, HV=32, K=V=128, bf16, fp32 state, l2norm in kernel)\n")
        log(invariance_table(rows))
        log(f"\ngdn_aot: {status}; total {time.perf_counter() - start:.0f} s" + (f"; JSON in {out}" if out else ""))
        return {"ok": 0, "not invariant": 1}.get(status, 2)

    if state_dtypes:
        return run_state_dtypes(systems, cases, reps, graph_reps, warmup, out, start)
    results = dict(meta=metadata(systems, dict(mode="bench", eager_reps=reps, graph_reps=graph_reps,
                                               warmup_rounds=warmup, rotate_below_bytes=ROTATE_BELOW)),
                   cases=[], host={}, fresh={})
    save = lambda: write_json(out, results)  # noqa: E731
    bench_cases(results, cases, systems, reps, graph_reps, warmup, start, save)
    if not args.no_extras:
        for name, s in systems.items():
            try:
                results["host"][name] = h = host_time(s)
                log(f"  T=64 {name}: host {h['host_us']:.1f} us/call back to back (min {h['b2b_min_us']:.1f}), "
                    f"{h['call_median_us']:.1f} call by call (min {h['call_min_us']:.1f}), device-inclusive "
                    f"{h['device_incl_us']:.1f} us/call")
            except Exception as e:
                log(f"  T=64 {name}: FAILED {err_str(e)}")
        save()
        torch.cuda.empty_cache()
        fresh = names if args.fresh == "all" else [n.strip() for n in args.fresh.split(",") if n.strip() != "none"]
        for name in (n for n in names if n in fresh):
            try:
                results["fresh"][name] = r = fresh_process(systems[name], cold_triton=name == "fla")
                log(f"  fresh process {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
            except Exception as e:
                log(f"  fresh process {name}: FAILED {err_str(e, 2000)}")
            save()
    results["meta"]["total_s"] = time.perf_counter() - start
    save()

    rows = results["cases"]
    log("\n## Prefill, H=16, K=V=128, bf16, fp32 state (h0 in, final state out), varlen, l2norm in kernel: "
        "median ms, eager and under CUDA graphs\n")
    log(main_table(rows, names))
    for line in failure_notes(rows, names):
        log(f"- {line}")
    log("\n## Targets (gdn_aot under CUDA graphs)\n")
    log(targets_table(rows))
    log("\n" + targets_summary(rows))
    log("\n## Details\n")
    log(details_table(rows, names))
    if not args.no_extras:
        log("\n## Host time and fresh process\n")
        log(extras_table(results, names))
    log(f"\ntotal {results['meta']['total_s']:.0f} s" + (f"; JSON in {out}" if out else ""))
    return 0


def bench_cases(results, cases, systems, reps, graph_reps, warmup, start, save):
    """Each case into results["cases"] (a failure logged and skipped), saving after each."""
    for case in cases:
        try:
            results["cases"].append(bench_case(case, systems, reps, graph_reps, warmup))
        except Exception as e:
            log(f"  {case.name}: FAILED {err_str(e)}")
        torch.cuda.empty_cache()
        log(f"  [{time.perf_counter() - start:.0f} s elapsed]")
        save()


def run_state_dtypes(systems, cases, reps, graph_reps, warmup, out, start):
    """--state-dtypes: each case with every state dtype (bench_case: fp32 is "gdn_aot", the others its peers)."""
    results = dict(meta=metadata(systems, dict(mode="state-dtypes", eager_reps=reps, graph_reps=graph_reps,
                                               warmup_rounds=warmup, rotate_below_bytes=ROTATE_BELOW)), cases=[])
    bench_cases(results, cases, systems, reps, graph_reps, warmup, start, lambda: write_json(out, results))
    results["meta"]["total_s"] = time.perf_counter() - start
    write_json(out, results)
    log("\n## gdn_aot with the initial and final state stored in each dtype (H=16, K=V=128, bf16 inputs, varlen, "
        "l2norm in kernel): median ms, ratio to the fp32 state, max|ht - fp32 ht| / max|fp32 ht|\n")
    log(state_dtypes_table(results["cases"], list(systems)))
    log(f"\ntotal {results['meta']['total_s']:.0f} s" + (f"; JSON in {out}" if out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
