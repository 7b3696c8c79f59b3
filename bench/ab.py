"""A/B of one kernel family across artifact sets: the same variants (family, tiling, warps) built from two or more
checkouts, launched on the same inputs in one process; outputs compared with the first set's, device times taken
in alternation (timing.timed_alternating, so that clock drift reaches every set alike).

    python3 bench/ab.py ROOT_A ROOT_B [ROOT_C ...] --family gdn_scan --cases 1x8192,4096+4096,1x65536@32
    python3 bench/ab.py ROOT_A ROOT_B --family gdn_prepare --warps 16 --cases 1x8192,32x8192
    python3 bench/ab.py ROOT [ROOT_B ...] --family gdn_fused --reference --cases 1x8192,1x65536

A root is what `gdn-aot build SPEC --arch sm_90 --out ROOT` wrote; a spec with only the variants compared builds in
seconds (for gdn_scan, add a varlen bf16 gdn_prepare: the scan's inputs come from it). Compared are each root's
varlen bf16 variants of the family with --warps warps (all warps when not given); of gdn_scan those with an fp32
[K, V] state and no checkpoints, grouped by BV, their inputs (w, u, gam, qg, kg) made by the same root's gdn_prepare
with the most warps (roots may lay the workspace out differently). H = 16, K = V = 128, q and k L2-normed in the
kernel; cases as bench.py's (NxL, L1+L2+..., optionally @HV). Prints, per case and group: each root's median us and
the first root's time over it (> 1: faster than the first), and each output's max |diff| / max |first root's|,
whether all outputs are bitwise equal, and their NaN count; with --reference (gdn_scan), also each root's o and
final state against the reference forward (tests/reference.py: fp64 recurrence for small cases, fp32 chunked on the
GPU for large ones), as max |diff| / max |reference|. gdn_fused (its [K, V] fp32 variants without checkpoints, a
group per BV) compares every BV of every root with the first root's largest, in one line a case: whether its V tiles
compute the same bits (what lets a dispatch table mix them and stay batch invariant), and what each tile costs;
one root is enough, and --reference applies too. A kernel still running 30 s after its first launch is reported
by name and ends the run (timing.finish_or_exit: a broken mbarrier protocol hangs, and would hang every later call
too). Needs a CUDA GPU; select_variants and compare run anywhere.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import H, K, V, cu_tensors, make_inputs, parse_cases, rel_err  # noqa: E402
from timing import finish_or_exit, timed_alternating  # noqa: E402

FAMILIES = ("gdn_prepare", "gdn_scan", "gdn_fused")
WITH_STATE = ("gdn_scan", "gdn_fused")  # the families whose outputs are o and the final state
BT = 64
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def select_variants(variants: dict, family: str, warps: int | None, bv: int | None = None) -> dict:
    """{group: variant key} of a manifest's variants that the A/B compares: varlen bf16 variants of `family` with
    `warps` warps and gdn_scan's BV `bv` (any when None); gdn_scan's with an fp32 [K, V] state and no checkpoints,
    one per BV (group BV), gdn_prepare's one per warp count (group num_warps). Among variants of one group, the
    smallest key."""
    out = {}
    for key, e in sorted(variants.items()):
        a = e["axes"]
        if e["kernel"] != family or not a["varlen"] or a["dtype"] != "bf16" or a.get("gating"):
            continue
        if (warps is not None and e["num_warps"] != warps) or (bv is not None and a["BV"] != bv):
            continue
        if family in WITH_STATE and (a["transpose"] or a["state_dtype"] != "fp32" or a["checkpoints"]):
            continue
        out.setdefault(a["BV"] if family in WITH_STATE else e["num_warps"], key)
    return out


def root_names(roots: list) -> list[str]:
    """A name for each root: the part of its path that the roots do not share (two wheels' artifacts,
    old/gdn_aot/artifacts and new/gdn_aot/artifacts: old and new), its last folder for one root, rootN for roots
    that are the same path."""
    parts = [Path(os.path.abspath(r)).parts for r in roots]
    if len(parts) == 1:
        return [parts[0][-1]]
    head = len(os.path.commonprefix(parts))
    tail = len(os.path.commonprefix([p[::-1] for p in parts]))
    names = [os.path.join(*p[head:len(p) - tail]) if len(p) > head + tail else "" for p in parts]
    return [name if name and names.count(name) == 1 else f"root{i}" for i, name in enumerate(names)]


def fused_sets(names: list, chosen: list) -> list[tuple[str, int, int, str]]:
    """(label, root index, BV, key) of every gdn_fused variant to compare: each root's BVs, largest first, so that
    the first is the first root's largest BV, the reference of the comparison."""
    return [(f"{name}/BV{bv}", root, bv, keys[bv]) for root, (name, keys) in enumerate(zip(names, chosen))
            for bv in sorted(keys, reverse=True)]


def compare(outputs: list, first: list) -> tuple[list[float], bool, int]:
    """(max |diff| / max |first| of each output, whether all are bitwise equal, NaN count of `outputs`)."""
    rel = [rel_err(o, f) for o, f in zip(outputs, first)]
    same = all(torch.equal(o, f) for o, f in zip(outputs, first))
    return rel, same, sum(int(o.isnan().sum()) for o in outputs)


def reference_forward(x):
    """(o, final state) of the reference forward (tests/reference.py) for the inputs x, on the CPU, fp32."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from reference import reference_outputs

    o_ref, ht_ref = reference_outputs(x.q, x.k, x.v, x.g, x.beta, [int(c) for c in x.cu], x.h0, l2norm=True)
    return o_ref.reshape(x.v.shape).float(), ht_ref.float()


def reference_errors(ref, outputs: list) -> list[tuple[float, float]]:
    """(o, final state) max |diff| / max |reference| of each root's scan outputs [o, ht], ref = (o, ht)."""
    return [tuple(rel_err(a.cpu(), r) for a, r in zip((o, ht), ref)) for o, ht in outputs]


class Inputs:
    """One case's packed batch, and the gdn_prepare outputs the scan reads."""

    def __init__(self, lens, HV, seed=0):
        self.lens, self.HV, self.T, self.N = lens, HV, sum(lens), len(lens)
        self.cu = cu_tensors(lens)["int32"]
        x = make_inputs(lens, HV, seed, None)
        self.q, self.k, self.v, self.g, self.beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
        self.h0 = x["h0"] * 0.1

    def prepare_outputs(self):
        T, HV, dev = self.T, self.HV, self.q.device
        return [torch.full((T, HV, K), float("nan"), device=dev, dtype=torch.bfloat16),
                torch.full((T, HV, V), float("nan"), device=dev, dtype=torch.bfloat16),
                *(torch.full((T, HV), float("nan"), device=dev) for _ in range(3))]

    def prepare_call(self, kernel, outs, stream):
        """A no-argument launch of gdn_prepare `kernel` writing w, u, gam, qg, kg into `outs`."""
        from gdn_aot.kernels import PREPARE_L2NORM

        grid = (self.T // BT + self.N, H, 1)
        scratch = torch.empty(max(kernel.scratch_bytes(grid), 1), device=self.q.device, dtype=torch.uint8)
        ptrs = [t.data_ptr() for t in outs]

        def call():
            kernel.launch(grid, stream, self.q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(), self.g.data_ptr(),
                          self.beta.data_ptr(), 0, 0, self.cu.data_ptr(), *ptrs, self.T, self.N, H, self.HV,
                          PREPARE_L2NORM, scratch_ptr=scratch.data_ptr())
        return call

    def scan_call(self, kernel, BV, prepared, outs, stream):
        """A no-argument launch of gdn_scan `kernel` from `prepared` (w, u, gam, qg, kg) into outs (o, ht)."""
        from gdn_aot.kernels import SCAN_HAS_H0, SCAN_STORE_HT

        grid = (self.N, self.HV, V // BV)
        scratch = torch.empty(max(kernel.scratch_bytes(grid), 1), device=self.q.device, dtype=torch.uint8)
        w, u, gam, qg, kg = (t.data_ptr() for t in prepared)
        o, ht = outs

        def call():
            kernel.launch(grid, stream, self.q.data_ptr(), self.k.data_ptr(), w, u, gam, qg, kg, self.cu.data_ptr(),
                          self.h0.data_ptr(), ht.data_ptr(), 0, o.data_ptr(), K ** -0.5, self.T, H, self.HV,
                          SCAN_HAS_H0 | SCAN_STORE_HT, 0, 0, 0, 0, scratch_ptr=scratch.data_ptr())
        return call


def fused_call(x, kernel, BV, outs, stream):
    """A no-argument launch of gdn_fused `kernel` (V tiles of BV) on inputs x into outs (o, ht)."""
    from gdn_aot.kernels import FUSED_HAS_H0, FUSED_L2NORM, FUSED_STORE_HT

    grid = (x.N, x.HV, V // BV)
    scratch = torch.empty(max(kernel.scratch_bytes(grid), 1), device=x.q.device, dtype=torch.uint8)
    o, ht = outs

    def call():
        kernel.launch(grid, stream, x.q.data_ptr(), x.k.data_ptr(), x.v.data_ptr(), x.g.data_ptr(), x.beta.data_ptr(),
                      0, 0, x.cu.data_ptr(), x.h0.data_ptr(), ht.data_ptr(), 0, o.data_ptr(), K ** -0.5, x.T, H, x.HV,
                      FUSED_L2NORM | FUSED_HAS_H0 | FUSED_STORE_HT, 0, 0, 0, 0, scratch_ptr=scratch.data_ptr())
    return call


def _line(label, names, ms, checks):
    times = "  ".join(f"{n}: {m * 1e3:9.1f} us" for n, m in zip(names, ms))
    ratios = " ".join(f"{ms[0] / m:.3f}" for m in ms[1:])
    diffs = "; ".join(f"{n}: {' '.join(f'{r:.1e}' for r in rel)} bitwise {same} nan {nan}"
                      for n, (rel, same, nan) in zip(names[1:], checks))
    return f"{label:<24} {times}  first/other {ratios} | {diffs}"


def scan_inputs(x, artifacts, prep, label, stream):
    """w, u, gam, qg, kg of inputs x from the root's gdn_prepare with the most warps (prep: select_variants')."""
    prepared = x.prepare_outputs()
    x.prepare_call(artifacts.kernel(prep[max(prep)]), prepared, stream)()
    finish_or_exit(label)
    return prepared


def case_inputs(case, reps, reference):
    """(inputs, alternating rounds, reference (o, ht) or None) of a case: a third of the rounds for the largest."""
    x = Inputs(case.lens, case.HV)
    return x, max(5, reps // 3) if x.T * x.HV > 2 ** 21 else reps, reference_forward(x) if reference else None


def _reference_line(labels, ref, outs):
    return f"{'':<24} against the reference: " + "; ".join(
        f"{n}: o {eo:.2e} ht {eh:.2e}" for n, (eo, eh) in zip(labels, reference_errors(ref, outs)))


def run_fused(sets, names, chosen, cases, reps, reference, stream):
    """One line a case: every (root, BV) gdn_fused variant against the first (fused_sets)."""
    compared = fused_sets(names, chosen)
    labels = [label for label, *_ in compared]
    for case in cases:
        x, n_reps, ref = case_inputs(case, reps, reference)
        calls, outs = [], []
        for label, root, bv, key in compared:
            out = [torch.full_like(x.v, float("nan")), torch.full_like(x.h0, float("nan"))]
            calls.append(fused_call(x, sets[root].kernel(key), bv, out, stream))
            calls[-1]()
            finish_or_exit(f"{label} {key} on {case.id}")
            outs.append(out)
        ms = timed_alternating(calls, n_reps)
        print(_line(case.id, labels, ms, [compare(o, outs[0]) for o in outs[1:]]), flush=True)
        if ref is not None:
            print(_reference_line(labels, ref, outs), flush=True)


def run(roots, family, warps, cases, reps, reference=False, bv=None):
    from gdn_aot.loader.runtime import Artifacts

    dev = torch.device("cuda")
    stream = torch.cuda.current_stream().cuda_stream
    sets = [Artifacts.for_device(dev, root=r) for r in roots]
    names = root_names(roots)
    chosen = [select_variants(s.manifest.variants, family, warps, bv) for s in sets]
    groups = sorted(set().union(*chosen) if family == "gdn_fused" else set(chosen[0]).intersection(*chosen[1:]))
    if not groups:
        raise SystemExit(f"no {family} variant to compare: {[sorted(c) for c in chosen]} (groups per root)")
    if family == "gdn_fused":
        return run_fused(sets, names, chosen, cases, reps, reference, stream)
    preps = [select_variants(s.manifest.variants, "gdn_prepare", None) for s in sets]
    if family == "gdn_scan" and not all(preps):
        raise SystemExit(f"{roots[preps.index({})]} has no varlen bf16 gdn_prepare to make the scan's inputs")
    for case in cases:
        x, n_reps, ref = case_inputs(case, reps, reference and family == "gdn_scan")
        prepared = [scan_inputs(x, s, p, f"{n} {p[max(p)]} on {case.id}", stream)
                    for n, s, p in zip(names, sets, preps)] if family == "gdn_scan" else None
        for group in groups:
            calls, outs = [], []
            for i, (name, s, c) in enumerate(zip(names, sets, chosen)):
                kernel = s.kernel(c[group])
                if family == "gdn_scan":
                    out = [torch.full_like(x.v, float("nan")), torch.full_like(x.h0, float("nan"))]
                    calls.append(x.scan_call(kernel, group, prepared[i], out, stream))
                else:
                    out = x.prepare_outputs()
                    calls.append(x.prepare_call(kernel, out, stream))
                calls[-1]()
                finish_or_exit(f"{name} {c[group]} on {case.id}")
                outs.append(out)
            checks = [compare(o, outs[0]) for o in outs[1:]]
            ms = timed_alternating(calls, n_reps)
            label = f"{case.id} {'BV' if family == 'gdn_scan' else 'w'}{group}"
            print(_line(label, names, ms, checks), flush=True)
            if ref is not None:
                print(_reference_line(names, ref, outs), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("roots", nargs="+", help="artifact roots (gdn-aot build --out); the first is the reference")
    p.add_argument("--family", choices=FAMILIES, default="gdn_scan")
    p.add_argument("--warps", type=int, default=None, help="only variants with this num_warps")
    p.add_argument("--bv", type=int, default=None, help="gdn_scan: only variants with this BV (one launch a "
                   "round, e.g. for ncu)")
    p.add_argument("--cases", default="1x8192,4096+4096,1x8192@64,1x65536")
    p.add_argument("--reps", type=int, default=30, help="alternating rounds (a third for the largest cases)")
    p.add_argument("--reference", action="store_true", help="gdn_scan, gdn_fused: also each root's errors against "
                   "the reference forward")
    args = p.parse_args(argv)
    if len(args.roots) < 2 and args.family != "gdn_fused":
        p.error("give at least two artifact roots (gdn_fused: one, whose BVs are compared)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    run(args.roots, args.family, args.warps, parse_cases(args.cases), args.reps, args.reference, args.bv)


if __name__ == "__main__":
    main()
