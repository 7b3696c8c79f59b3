"""Gated DeltaNet prefill: gdn_aot.chunk_gated_delta_rule against fla's chunk_gated_delta_rule (Triton path).

Run on a CUDA GPU, with gdn_aot importable (installed, or on PYTHONPATH) and fla installed
(else ./.whl/fla_core-*.whl is put on sys.path):
    python3 bench/bench.py [--out results.json] [--quick]      (or: make bench)
--quick times 20 calls per case instead of 100. About 2-3 minutes on an H200, most of it fla's JIT + autotune.

Shape: H=16, HV=32 (64 where named), K=V=128, bf16 q/k/v, fp32 g/beta, fp32 initial and final state, the
varlen API (B=1, cu_seqlens: int32 for gdn_aot, int64 for fla as it documents), use_qk_l2norm_in_kernel=True.
Random inputs: q,k,v ~ randn, g = -softplus(randn), beta = sigmoid(randn), h0 ~ randn.
Each call is timed with CUDA events around it, calls back to back; inputs rotate among 3 sets when one set
(inputs + outputs) is under 512 MB, so L2 (60 MB) never holds them. Columns of the case table:
  floor ms     max(183 kFLOP/token/value head at 790 TFLOP/s, unavoidable bytes at 4.3 TB/s); bytes = q,k,v,o,
               g,beta once + h0 read + final state written (~0.8 KB/token/value head at HV=32)
  med / min    median / minimum ms of the timed calls (after warm-up)
  fla/gdn      fla median / gdn_aot median (> 1: gdn_aot is faster)
  TF/s         achieved TFLOP/s = 183e3 * tokens * HV / median time
  %roof        floor ms / median ms
  xMB          peak extra device memory of one call: max_memory_allocated during it - memory_allocated before,
               minus the returned o and final state (i.e. the workspace)
  err o / ht   max|gdn - fla| / max|fla| of the output and of the final state (reported, never checked)
  1st s        the library's first call on this case in this process (fla: JIT + autotune on a new key)
Then: host time per call at T=64 (host_time(): loops of N=200 calls without synchronising, one sync after each:
host us = median loop time / N, dev-incl us = median time until the sync returns / N; it also times calls one by
one; bench/host_time.py runs only this), and a fresh process's time to its first result (child: from
before `import torch` to after the first call's synchronize; parent: wall time of the subprocess; fla's child
gets an empty TRITON_CACHE_DIR, so it compiles and autotunes from scratch).
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

H, K, V = 16, 128, 128
FLOP_PER_TOKEN_HEAD, PEAK_FLOPS, PEAK_BYTES = 183e3, 790e12, 4.3e12
ROTATE_BELOW = 512e6
CASES = [("1x2048", [2048], 32), ("1x8192", [8192], 32), ("4096+4096", [4096, 4096], 32),
         ("4x2048", [2048] * 4, 32), ("1x65536", [65536], 32), ("32x8192", [8192] * 32, 32),
         ("1000+37+4096+511+2900", [1000, 37, 4096, 511, 2900], 32),
         ("1x8192 HV=64", [8192], 64), ("8x8192 HV=64", [8192] * 8, 64)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLA_FLASH_QLA", "0")  # fla's Triton kernels, not an optional TileLang backend

FRESH = r"""
import sys, os; sys.path = [p for p in sys.path if p not in ('', os.getcwd())]
import time; t0 = time.perf_counter()
import json, torch, torch.nn.functional as F
from {mod} import chunk_gated_delta_rule as f
t1 = time.perf_counter()
T, H, HV, D = 8192, 16, 32, 128
q, k = (torch.randn(1, T, H, D, device='cuda', dtype=torch.bfloat16) for _ in range(2))
v = torch.randn(1, T, HV, D, device='cuda', dtype=torch.bfloat16)
g, beta = -F.softplus(torch.randn(1, T, HV, device='cuda')), torch.randn(1, T, HV, device='cuda').sigmoid()
h0, cu = torch.randn(1, HV, D, D, device='cuda'), torch.tensor([0, T], device='cuda', dtype=torch.{cu})
torch.cuda.synchronize(); t2 = time.perf_counter()
o, ht = f(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
torch.cuda.synchronize(); t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, setup_s=t2 - t1, first_call_s=t3 - t2, total_s=t3 - t0)))
"""


def log(*a):
    print(*a, flush=True)


def load_libs():
    """{name: (function, cu_seqlens dtype, module to import in a fresh process)}."""
    import gdn_aot
    libs = {"gdn_aot": (gdn_aot.chunk_gated_delta_rule, "int32", "gdn_aot")}
    try:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
        except ImportError:
            wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "fla_core-*.whl")))
            if not wheels:
                raise
            sys.path.insert(0, wheels[-1])
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [wheels[-1], os.environ.get("PYTHONPATH")]))
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
        import fla as fla_pkg
        log(f"fla {getattr(fla_pkg, '__version__', '?')} from {os.path.dirname(fla_pkg.__file__)}")
        libs["fla"] = (fla, "int64", "fla.ops.gated_delta_rule")
    except Exception as e:
        log(f"fla unavailable, timing gdn_aot alone: {type(e).__name__}: {e}")
    return libs


def make_inputs(lens, HV, seed, cu):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T, N = sum(lens), len(lens)
    randn = lambda *shape, dtype=torch.float32: torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
    return dict(q=randn(1, T, H, K, dtype=torch.bfloat16), k=randn(1, T, H, K, dtype=torch.bfloat16),
                v=randn(1, T, HV, V, dtype=torch.bfloat16), g=-F.softplus(randn(1, T, HV)),
                beta=randn(1, T, HV).sigmoid(), h0=randn(N, HV, K, V), cu=cu)


def caller(fn, cu_dtype):
    def run(x):
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                  cu_seqlens=x["cu"][cu_dtype], use_qk_l2norm_in_kernel=True)
    return run


def floor_s(lens, HV):
    T, N = sum(lens), len(lens)
    flop = FLOP_PER_TOKEN_HEAD * T * HV
    nbytes = T * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4) + 2 * N * HV * K * V * 4
    return max(flop / PEAK_FLOPS, nbytes / PEAK_BYTES), flop


def time_calls(run, sets, reps):
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda.synchronize()
    for i, (start, end) in enumerate(events):
        start.record()
        run(sets[i % len(sets)])
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)


def extra_mb(run, x):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o, ht = run(x)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before - o.nbytes - ht.nbytes) / 2**20


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def bench_case(name, lens, HV, libs, reps):
    T = sum(lens)
    cu32 = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    cu = {"int32": cu32, "int64": cu32.long()}  # one tensor per case: fla caches its chunk indices per tensor
    set_bytes = T * (2 * H * K * 2 + 2 * HV * V * 2 + 2 * HV * 4) + 2 * len(lens) * HV * K * V * 4
    sets = [make_inputs(lens, HV, seed, cu) for seed in range(3 if set_bytes < ROTATE_BELOW else 1)]
    floor, flop = floor_s(lens, HV)
    row = dict(case=name, tokens=T, seqs=len(lens), HV=HV, floor_ms=floor * 1e3, input_sets=len(sets))
    outs = {}
    for lib, (fn, cu_dtype, _) in libs.items():
        try:
            run = caller(fn, cu_dtype)
            t0 = time.perf_counter()
            outs[lib] = run(sets[0])
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            for _ in range(2):
                for x in sets:
                    run(x)
            ms = time_calls(run, sets, reps)
            med = ms[len(ms) // 2]
            row[lib] = dict(median_ms=med, min_ms=ms[0], first_call_s=first, extra_mb=extra_mb(run, sets[0]),
                            tflops=flop / med * 1e-9, roofline=floor * 1e3 / med)
            log(f"  {name:>24} {lib:>7}: median {med:.3f} ms, min {ms[0]:.3f} ms, first call {first:.2f} s, "
                f"extra {row[lib]['extra_mb']:.1f} MB")
        except Exception as e:
            log(f"  {name:>24} {lib:>7}: FAILED {type(e).__name__}: {e}")
    try:
        if "median_ms" in row.get("gdn_aot", {}) and "median_ms" in row.get("fla", {}):
            row["fla_over_gdn"] = row["fla"]["median_ms"] / row["gdn_aot"]["median_ms"]
        if len(outs) == 2:
            (o, ht), (o_ref, ht_ref) = outs["gdn_aot"], outs["fla"]
            row["err_o"], row["err_ht"] = rel_err(o, o_ref), rel_err(ht, ht_ref)
            log(f"  {name:>24} max|o_gdn-o_fla|/max|o_fla| = {row['err_o']:.2e}, final state {row['err_ht']:.2e}")
    except Exception as e:
        log(f"  {name:>24} comparison FAILED {type(e).__name__}: {e}")
    return row


def host_time(fn, cu_dtype, calls=200, rounds=5, warmup=20):
    """Host time per call at T=64 (1 x 64 tokens, HV=32, varlen, l2norm, initial + final state; launch-bound).
    Call by call: each call timed alone after a synchronize (an empty launch queue). Back to back: `rounds` loops of
    `calls` calls without synchronising, loop time / calls each (host_us: their median; device_incl_us: the median
    of each loop until its closing synchronize returns, / calls). Medians and minima in us."""
    cu32 = torch.tensor([0, 64], device="cuda", dtype=torch.int32)
    x = make_inputs([64], 32, 0, {"int32": cu32, "int64": cu32.long()})
    run = caller(fn, cu_dtype)
    for _ in range(warmup):
        run(x)
    single = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(x)
        single.append(time.perf_counter() - t0)
    loops, incl = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            run(x)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        loops.append((t1 - t0) / calls)
        incl.append((time.perf_counter() - t0) / calls)
    us = lambda t: t * 1e6  # noqa: E731
    return dict(host_us=us(statistics.median(loops)), device_incl_us=us(statistics.median(incl)),
                b2b_min_us=us(min(loops)), call_median_us=us(statistics.median(single)), call_min_us=us(min(single)),
                calls=calls, rounds=rounds)


def fresh_process(mod, cu_dtype, cold_triton):
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if cold_triton:
            env["TRITON_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", FRESH.format(mod=mod, cu=cu_dtype)], env=env, capture_output=True,
                           text=True, timeout=240)
        wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"child exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]), parent_wall_s=wall)


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def table(rows, libs):
    cols = ["case", "floor ms"] + [f"{lib} {c}" for lib in libs for c in ("med", "min", "TF/s", "%roof", "xMB")]
    cols += ["fla/gdn", "err o", "err ht"] + [f"{lib} 1st s" for lib in libs]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["case"], fmt(r["floor_ms"])]
        for lib in libs:
            d = r.get(lib, {})
            cells += [fmt(d.get("median_ms")), fmt(d.get("min_ms")), fmt(d.get("tflops"), ".0f"),
                      fmt(d.get("roofline") and 100 * d["roofline"], ".1f"), fmt(d.get("extra_mb"), ".1f")]
        cells += [fmt(r.get("fla_over_gdn"), ".2f"), fmt(r.get("err_o"), ".1e"), fmt(r.get("err_ht"), ".1e")]
        cells += [fmt(r.get(lib, {}).get("first_call_s"), ".2f") for lib in libs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write all results as JSON here")
    ap.add_argument("--quick", action="store_true", help="20 timed calls per case instead of 100")
    ap.add_argument("--fresh", default="all", choices=("all", "gdn_aot", "none"),
                    help="which libraries get the fresh-process first-result measurement (fla's takes ~1 min)")
    ap.add_argument("--keep-triton-cache", action="store_true",
                    help="let fla reuse autotune results cached on disk (by default it gets an empty "
                    "TRITON_CACHE_DIR: results a test suite cached for its small shapes made fla 1.1-1.7x slower)")
    args = ap.parse_args()
    if not args.keep_triton_cache:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gdn_bench_triton_")
    start = time.perf_counter()
    reps = 20 if args.quick else 100
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {reps} timed calls per case")
    libs = load_libs()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, reps=reps, cases=[], host={},
                   fresh={})

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    for name, lens, HV in CASES:
        try:
            results["cases"].append(bench_case(name, lens, HV, libs, reps))
        except Exception as e:
            log(f"  {name}: FAILED {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
        log(f"  [{time.perf_counter() - start:.0f} s elapsed]")
        save()
    for lib, (fn, cu_dtype, mod) in libs.items():
        try:
            results["host"][lib] = h = host_time(fn, cu_dtype)
            log(f"  T=64 {lib}: host {h['host_us']:.1f} us/call back to back (min {h['b2b_min_us']:.1f}), "
                f"{h['call_median_us']:.1f} call by call (min {h['call_min_us']:.1f}), device-inclusive "
                f"{h['device_incl_us']:.1f} us/call")
        except Exception as e:
            log(f"  T=64 {lib}: FAILED {type(e).__name__}: {e}")
    save()
    torch.cuda.empty_cache()
    for lib, (fn, cu_dtype, mod) in libs.items():
        if args.fresh not in ("all", lib):
            continue
        try:
            results["fresh"][lib] = r = fresh_process(mod, cu_dtype, cold_triton=lib == "fla")
            log(f"  fresh process {lib}: {r}")
        except Exception as e:
            log(f"  fresh process {lib}: FAILED {type(e).__name__}: {e}")
        save()
    results["total_s"] = time.perf_counter() - start
    save()

    names = list(libs)
    log("\n## Prefill, H=16, K=V=128, bf16, fp32 state, varlen, l2norm in kernel (times in ms)\n")
    log(table(results["cases"], names))
    log("\n| library | host us/call at T=64 | device-incl. us/call | fresh process: child s (import / first call)"
        " | parent wall s |\n|---|---|---|---|---|")
    for lib in names:
        h, r = results["host"].get(lib, {}), results["fresh"].get(lib, {})
        child = f"{fmt(r.get('total_s'), '.2f')} ({fmt(r.get('import_s'), '.2f')} / {fmt(r.get('first_call_s'), '.2f')})"
        log(f"| {lib} | {fmt(h.get('host_us'), '.1f')} | {fmt(h.get('device_incl_us'), '.1f')} | {child} | "
            f"{fmt(r.get('parent_wall_s'), '.2f')} |")
    log(f"\ntotal {results['total_s']:.0f} s" + (f"; JSON in {args.out}" if args.out else ""))


if __name__ == "__main__":
    main()
