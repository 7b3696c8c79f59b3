"""Where gdn_fused's time goes: the sm_90a kernel and copies of it with one role reduced to its barrier protocol.

Needs a Hopper GPU and triton 3.6.0 (this is a development tool: it JIT-compiles the checkout's kernels/, the same
source the build compiles ahead of time). Run from the repository root:
    python3 bench/fused_ablate.py [--check] [--cases 32x8192,1x65536]
Variants (textual edits of a temporary copy of kernels/fused_sm90.py, never of the checkout):
  fused       the kernel as it is
  fused_copy  the same source loaded a second time: the difference between the two is the method's noise
  aux_stub    the aux partition publishes every chunk's terms at once: what is left is the state and load roles
  state_stub  the state partition only waits and releases: what is left is the aux and load roles
  no_inverse  the aux partition skips (I + A)^-1 (Tc = the decayed k k^T): the inverse's share of the aux role
  unsynced    neither the aux nor the state partition waits for the other on the terms ring (wrong answer):
              what the hand-over between them costs, with all their work still done
  state_chain aux_stub with the state partition reduced to the recurrence's chain, S k^T -> v_new -> update (no
              S q^T, no output): what a program whose aux terms and outputs were computed elsewhere would take
--bv 64 runs every variant at BV = 64 (two programs a value head, each holding 64 value rows of the state in one
warpgroup, beside two aux warpgroups taking every other chunk); --check-rows only compares the kernel at BV = 64
with BV = 128, bit for bit.
--variants A.py,B.py adds whole replacements of kernels/fused_sm90.py (named by their file stems), for A/B tests of
a change before it is made in the checkout; --only fused,A times a subset.
--check first compares the kernel (and each --variants file) with the float64 token recurrence (small cases) and
the fp32 chunked reference (large ones; tests/reference.py), as max |out - ref| / max |ref|. Times: CUDA events
around each launch, the variants in alternation (timing.timed_alternating), median of --reps launches each after 2
warm-up ones, outputs preallocated; ms.
"""
import argparse
import importlib
import itertools
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from timing import timed_alternating  # noqa: E402  (bench/, the script's own folder)
K = V = 128
CASES = {"1x8192": ([8192], 32), "4x2048": ([2048] * 4, 32), "1x65536": ([65536], 32),
         "32x8192": ([8192] * 32, 32), "hv64-8x8192": ([8192] * 8, 64), "mixed": ([1000, 37, 4096, 511, 2900], 32),
         "64seqs": ([round(100 + 2900 * ((29 * i) % 64) / 63) for i in range(64)], 32),
         # the shapes of a sequence split of 1 x 65536 (docs/design.md, "Sequence split"), and HV = 64 singles
         "2x32768": ([32768] * 2, 32), "3x21845": ([21846, 21845, 21845], 32), "2x21846": ([21846, 21845], 32),
         "4x16384": ([16384] * 4, 32), "5x16384": ([16384] * 5, 32), "3x16384": ([16384] * 3, 32)}


def _cut(src, start, end, new):
    a = src.index(start)
    return src[:a] + new + src[src.index(end, a):]


# the state partition's release of the previous chunk's terms slot (the 64-row programs), kept by the cuts through it
RELEASE_PREVIOUS_TERMS = "        if o_in_terms:\n            _release_previous_terms(terms, c)\n"
# the aux partition's wait for its chunk's terms slot
CLAIM_TERMS_SLOT = "_claim_terms_slot(inputs, terms, c, o_in_terms, exchange, first, stride)\n"
VARIANTS = {
    "fused": lambda s: s,
    "fused_copy": lambda s: s,
    "aux_stub": lambda s: _cut(
        s, "        # --- k k^T, the gates", "        _hand_over_terms(",
        "        gates.bars.wait_ready(c)\n        " + CLAIM_TERMS_SLOT + "        fence_async_shared()\n"),
    "state_stub": lambda s: _cut(
        s, "        # kh = S k^T (critical path)", "        # o^T -> [BT, V] staging tile",
        RELEASE_PREVIOUS_TERMS + "        terms.bars.wait_ready(c)\n        terms.rq_bars.wait_ready(c)\n"
        "        inputs.bars.release(c)\n        o = gl.zeros([V, BT], gl.float32, acc_vt)\n"),
    "no_inverse": lambda s: _cut(s, "        tc = inverse.invert(", "        publish_inverse(", "        tc = kk * decay\n"),
    "unsynced": lambda s: _cut(_cut(s, "        terms.bars.wait_ready(c)\n        kh, qh", "        kh, qh", ""),
                               "        _claim_terms_slot(", "        gam_r", ""),
    "state_chain": lambda s: _state_chain(VARIANTS["aux_stub"](s)),
}


def _state_chain(s):
    """The state partition without S q^T and the output: kh, v_new and the update, then the chunk's releases."""
    s = _cut(s, "        qh = warpgroup_mma(", "        terms.bars.wait_ready(c)\n", RELEASE_PREVIOUS_TERMS)
    s = s.replace("        kh, qh = warpgroup_mma_wait(0, deps=[kh, qh])",
                  "        kh = warpgroup_mma_wait(0, deps=[kh])")
    s = _cut(s, "        o = qh * ", "        v_scale = ", "")
    return _cut(s, "        o = warpgroup_mma(", "        checkpoints.store_after(",
                "        state = warpgroup_mma_wait(0, deps=[state])\n        terms.rq_bars.wait_ready(c)\n"
                "        inputs.bars.release(c)\n")


def _replacement(path):
    """An edit that ignores the checkout's source and returns the file's."""
    with open(path) as f:
        text = f.read()
    return lambda _: text


def load(name, edit):
    """The checkout's kernels/ (with loader/, which it imports) as package gdn_<name>, fused_sm90.py edited."""
    root = os.path.join(tempfile.gettempdir(), "gdn_fused_ablate", name)
    pkg = os.path.join(root, f"gdn_{name}")
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(os.path.join(REPO, "kernels"), os.path.join(pkg, "kernels"))
    shutil.copytree(os.path.join(REPO, "loader"), os.path.join(pkg, "loader"))
    open(os.path.join(pkg, "__init__.py"), "w").close()
    path = os.path.join(pkg, "kernels", "fused_sm90.py")
    with open(path) as f:
        src = edit(f.read())
    with open(path, "w") as f:
        f.write(src)
    sys.path.insert(0, root)
    return importlib.import_module(f"gdn_{name}.kernels.fused_sm90").fused_kernel


def inputs(lens, HV=32, H=16, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q, k = (torch.randn(1, T, H, K, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    v = torch.randn(1, T, HV, V, device="cuda", dtype=dtype, generator=gen)
    g = -F.softplus(torch.randn(1, T, HV, device="cuda", generator=gen))
    beta = torch.rand(1, T, HV, device="cuda", generator=gen)
    cu = torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
    h0 = torch.randn(len(lens), HV, K, V, device="cuda", generator=gen)
    return q, k, v, g, beta, cu, h0


def launch(kernel, q, k, v, g, beta, cu, h0, o, ht, BV=V):
    """One launch on a (num_seqs, HV, V // BV) grid."""
    abi = importlib.import_module(kernel.fn.__module__.rsplit(".", 1)[0])  # the flag bits, from the kernel's copy
    T, H, HV = q.shape[1], q.shape[2], v.shape[2]
    flags = abi.FUSED_L2NORM | abi.FUSED_HAS_H0 | abi.FUSED_STORE_HT
    # as the build compiles it: the state's BV / 16 warps, a full register file for all the partitions' warps
    warps = abi.FUSED_WS_WARPS
    # g, g: the A_log, dt_bias a GATING=False kernel never reads; ht, 0, cu, 0: no checkpoints; o, g, cu: the
    # exchange regions only terms programs use
    kernel[(len(cu) - 1, HV, V // BV)](
        q, k, v, g, beta, g, g, cu, h0, ht, cu, o, K ** -0.5, T, H, HV, flags, ht, 0, cu, 0, o, g, cu, K=K, V=V,
        BT=64, BV=BV, IS_VARLEN=True, TRANSPOSE_STATE=False, GATING=False, CHECKPOINTS=False, TERMS_PROGRAM=False,
        num_warps=BV // 16, maxnreg=65536 // (32 * warps))


def check(kernel, BV):
    from reference import reference_outputs, rel_max_err

    for lens in ([1], [63], [65], [200], [5, 0, 64, 130, 0, 1], [1000, 37, 4096, 511, 2900]):
        q, k, v, g, beta, cu, h0 = inputs(lens)
        o, ht = torch.full_like(v, float("nan")), torch.full_like(h0, float("nan"))
        launch(kernel, q, k, v, g, beta, cu, h0, o, ht, BV)
        ro, rh = reference_outputs(q, k, v, g, beta, cu.tolist(), h0, True)
        print(f"  {str(lens):28s} o {rel_max_err(o[0].float().cpu(), ro):.2e}  ht {rel_max_err(ht.cpu(), rh):.2e}")


def check_rows():
    """gdn_fused at BV = 64 against BV = 128: bitwise equal outputs and final states are what lets a dispatch table
    send few-program batches to BV = 64 and stay batch invariant (docs/design.md, "Batch invariance")."""
    kernel = load("fused", VARIANTS["fused"])
    for lens in ([8192], [1000, 37, 4096, 511, 2900], [63, 65, 1, 0, 200]):
        q, k, v, g, beta, cu, h0 = inputs(lens)
        o, ht, o64, ht64 = torch.empty_like(v), torch.empty_like(h0), torch.empty_like(v), torch.empty_like(h0)
        launch(kernel, q, k, v, g, beta, cu, h0, o, ht, 128)
        launch(kernel, q, k, v, g, beta, cu, h0, o64, ht64, 64)
        print(f"  {str(lens):28s} o bitwise {torch.equal(o64, o)}, ht bitwise {torch.equal(ht64, ht)}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare the kernel with the references first")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--variants", default="", help="comma-separated replacement files for kernels/fused_sm90.py")
    ap.add_argument("--only", help="comma-separated names of the variants to time (default: all)")
    ap.add_argument("--reps", type=int, default=40, help="timed launches of each variant a case")
    ap.add_argument("--bv", type=int, choices=(64, 128), default=128, help="value rows of a program's state")
    ap.add_argument("--check-rows", action="store_true", help="only compare the kernel at BV 64 with BV 128")
    args = ap.parse_args()
    import triton

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    if args.check_rows:
        return check_rows()
    files = {os.path.splitext(os.path.basename(f))[0]: f for f in args.variants.split(",") if f}
    variants = dict(VARIANTS, **{name: _replacement(f) for name, f in files.items()})
    if args.only:
        variants = {name: variants[name] for name in args.only.split(",")}
    kernels = {name: load(name, edit) for name, edit in variants.items()}
    if args.check:  # the kernels that compute the answer (the stubs do not)
        for name in [n for n in kernels if n == "fused" or n in files]:
            print(f"{name}:")
            check(kernels[name], args.bv)
    widths = [max(12, len(n) + 2) for n in kernels]
    print("case".ljust(14) + "".join(n.rjust(w) for n, w in zip(kernels, widths)))
    for case in args.cases.split(","):
        lens, HV = CASES[case]
        q, k, v, g, beta, cu, h0 = inputs(lens, HV)
        o, ht = torch.empty_like(v), torch.empty_like(h0)
        row = timed_alternating([lambda kern=kern: launch(kern, q, k, v, g, beta, cu, h0, o, ht, args.bv)
                                 for kern in kernels.values()], args.reps)
        print(case.ljust(14) + "".join(f"{t:{w}.3f}" for t, w in zip(row, widths)), flush=True)


if __name__ == "__main__":
    main()
