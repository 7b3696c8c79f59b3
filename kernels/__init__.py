"""Gluon sources of the GDN prefill kernels and their registry (no triton import here).

The forward is two launches (docs/gdn-math.md has the math):
  gdn_prepare  chunk-parallel, one program per (chunk, key head) serving the HV / H value heads that share
               its k (and q): cumsum of g, A = beta k k^T with decay, (I + A)^-1, w and u, and the log row
               scalings of q and k for gdn_scan (gam plus the log inverse L2 norms with
               use_qk_l2norm_in_kernel: k is normalised here, q and k in gdn_scan through these scalings, so no
               normalised copy reaches HBM)
  gdn_scan     one program per (sequence, value head, V tile): walks the chunks with the state on chip and
               writes the output of every chunk as it goes, so no per-chunk state or v_new reaches HBM
               (sm_90a also has a warp-specialised variant, SCAN_WS_WARPS warps, for batches of one wave)
"""
from .registry import KernelDef, Variant

_PKG = __name__

GDN_PREPARE = KernelDef(
    name="gdn_prepare",
    params=(
        ("q", "*{dtype}"), ("k", "*{dtype}"), ("v", "*{dtype}"), ("g", "*fp32"), ("beta", "*fp32"),
        ("cu_seqlens", "*i32"), ("w", "*{dtype}"), ("u", "*{dtype}"), ("gam", "*fp32"), ("qg", "*fp32"),
        ("kg", "*fp32"), ("T", "i32"), ("num_seqs", "i32"), ("H", "i32"), ("HV", "i32"), ("flags", "i32"),
    ),
    constexprs=lambda v: {"K": v.K, "V": v.V, "BT": v.BT, "IS_VARLEN": v.varlen, "num_warps": v.num_warps},
    sources={"sm90": f"{_PKG}.prepare_sm90:prepare_kernel", "sm100": f"{_PKG}.prepare_sm100:prepare_kernel"},
    grid="varlen: (T // BT + num_seqs, H, 1); fixed: (num_seqs * cdiv(T, BT), H, 1)",
    uses_axes=frozenset({"dtype", "K", "V", "BT", "varlen"}),
    doc="per chunk and key head, for each of its value heads: gam = cumsum(g); Tc = (I + A)^-1; "
    "w = Tc (beta e^gam k); u = Tc (beta v); "
    "qg = gam + ln rq, kg = gam - ln rk per row, where rq, rk = "
    "1 / |q|, 1 / |k| with flags & PREPARE_L2NORM (k rows are then normalised first) and 1 without",
)

# A gdn_scan variant with this many warps is the warp-specialised sm_90a scan (scan_sm90_ws.py): a 4-warp state
# partition (the kernel's num_warps), two 4-warp output partitions and a load warp, which takes a warpgroup's
# registers, at 128 registers a thread on average (setmaxnreg moves them between the partitions).
SCAN_WS_WARPS = 16


def _scan_warp_specialized(v: Variant) -> bool:
    return v.num_warps == SCAN_WS_WARPS


GDN_SCAN = KernelDef(
    name="gdn_scan",
    params=(
        ("q", "*{dtype}"), ("k", "*{dtype}"), ("w", "*{dtype}"), ("u", "*{dtype}"), ("gam", "*fp32"),
        ("qg", "*fp32"), ("kg", "*fp32"), ("cu_seqlens", "*i32"), ("h0", "*fp32"), ("ht", "*fp32"),
        ("state_indices", "*i32"), ("o", "*{dtype}"),
        ("scale", "fp32"), ("T", "i32"), ("H", "i32"), ("HV", "i32"), ("flags", "i32"),
    ),
    constexprs=lambda v: {
        "K": v.K, "V": v.V, "BT": v.BT, "BV": v.BV, "IS_VARLEN": v.varlen, "TRANSPOSE_STATE": v.transpose,
        "WARP_SPECIALIZE": _scan_warp_specialized(v), "num_warps": 4 if _scan_warp_specialized(v) else v.num_warps,
    },
    options=lambda v: ({"num_warps": 4, "num_stages": v.num_stages, "maxnreg": 65536 // (32 * v.num_warps)}
                       if _scan_warp_specialized(v) else {"num_warps": v.num_warps, "num_stages": v.num_stages}),
    sources={"sm90": f"{_PKG}.scan_sm90:scan_kernel", "sm100": f"{_PKG}.scan_sm100:scan_kernel"},
    grid="(num_seqs, HV, V // BV)",
    uses_axes=frozenset({"dtype", "K", "V", "BT", "BV", "varlen", "transpose"}),
    doc="per (sequence, value head, V tile): v_new = u - w h; o = scale (e^gam q h + (q k^T . M) v_new); "
    "h = e^gam_last h + k^T (e^(gam_last - gam) v_new)",
)

KERNELS: dict[str, KernelDef] = {kd.name: kd for kd in (GDN_PREPARE, GDN_SCAN)}

# bits of the kernels' `flags` argument
PREPARE_L2NORM = 1  # gdn_prepare: normalise k, fold the q/k row norms into qg and kg
SCAN_HAS_H0 = 1  # gdn_scan: read the initial state
SCAN_STORE_HT = 2  # gdn_scan: write the final state
SCAN_USE_INDICES = 4  # gdn_scan: state slot = state_indices[sequence] (-1: zero state, not written)

__all__ = ["KERNELS", "KernelDef", "Variant", "PREPARE_L2NORM", "SCAN_HAS_H0", "SCAN_STORE_HT",
           "SCAN_USE_INDICES", "SCAN_WS_WARPS"]
