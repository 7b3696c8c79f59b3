"""Gluon sources of the GDN prefill kernels and their registry (no triton import here).

A forward is one of two routes (docs/algorithm.md has the math, docs/design.md the kernels):
  gdn_prepare  chunk-parallel, one program per (chunk, key head) serving the HV / H value heads that share
               its k (and q): cumsum of g, A = beta k k^T with decay, (I + A)^-1, w and u, and the log row
               scalings of q and k for gdn_scan (gam plus the log inverse L2 norms with
               use_qk_l2norm_in_kernel: k is normalised here, q and k in gdn_scan through these scalings, so no
               normalised copy reaches HBM; sm_90a and sm_100a also have a warp-specialised, persistent
               variant, PREPARE_WS_WARPS warps; sm_100a's, like every sm_100a kernel, is compiled and checked
               in SASS, never run)
  gdn_scan     one program per (sequence, value head, V tile): walks the chunks with the state on chip and
               writes the output of every chunk as it goes, so no per-chunk state or v_new reaches HBM
               (both arches also have a warp-specialised variant, SCAN_WS_WARPS warps, for batches of one wave)
or
  gdn_fused    one program per (sequence, value head, V tile): the whole forward in one warp-specialised kernel
               (sm_90a tiles V by BV = 64 or 128, sm_100a takes BV = V)
  gdn_fused_terms  (sm_90a) gdn_fused's 64-row programs beside TERMS_PROGRAMS terms programs a (sequence, value
               head) that compute its chunks' terms once for both, all four running at once; for batches of few heads
gdn_scan and gdn_fused also write the prefix-cache state checkpoints (the state after every N tokens of each
sequence) in their `checkpoints` variants (the CHECKPOINTS constexpr; common.Checkpoints); the others have none of
that code.
The parameters of each family, and the bits of its `flags`, are the launcher ABI's (loader/abi.py); the flag
bits are re-exported here for the kernels (common.py, fused_*.py read them as constexprs).
"""
import dataclasses

from ..loader import abi
from .registry import KernelDef, Variant

# A gdn_scan variant with this many warps is the warp-specialised scan (scan_sm90_ws.py, scan_sm100_ws.py): a 4-warp
# state partition (the kernel's num_warps), two 4-warp output partitions and a load warp, which takes a warpgroup's
# registers, at 128 registers a thread on average (setmaxnreg moves them between the partitions).
SCAN_WS_WARPS = 16
# gdn_fused is always warp-specialised, FUSED_WS_WARPS warps: its default partition, the state, is a warpgroup per 64
# value rows of its V tile (BV / 16 warps, the kernel's num_warps), beside 128 / BV aux warpgroups and the load and
# norms warps (2 + 2); 65536 / (32 * 16) = 128 registers a thread on average (setmaxnreg moves them).
FUSED_WS_WARPS = 16
# A gdn_prepare variant with this many warps is the warp-specialised prepare (prepare_sm90_ws.py, prepare_sm100_ws.py):
# an 8-warp writer partition (the kernel's num_warps, PREPARE_WS_DEFAULT), a 4-warp aux and a 4-warp load partition.
PREPARE_WS_WARPS = 16
PREPARE_WS_DEFAULT = 8


@dataclasses.dataclass(frozen=True)
class WarpSpecialization:
    """A family's warp-specialised variants: those of `warps` warps compile with their default partition's
    `default_warps` and the register budget of all `warps` (setmaxnreg moves registers between the partitions);
    the cubin's metadata then reports all of its warps, which is what the launcher starts."""

    warps: int
    default_warps: int

    def applies(self, v: Variant) -> bool:
        return v.num_warps == self.warps

    def compile_warps(self, v: Variant) -> int:
        """The kernel's num_warps constexpr: the default partition's warps, or all of a plain variant's."""
        return self.default_warps if self.applies(v) else v.num_warps

    def options(self, v: Variant) -> dict:
        """KernelDef.options: triton.compile's num_warps, num_stages and, warp-specialised, maxnreg."""
        if not self.applies(v):
            return {"num_warps": v.num_warps, "num_stages": v.num_stages}
        return {"num_warps": self.default_warps, "num_stages": v.num_stages,
                "maxnreg": 65536 // (32 * v.num_warps)}


_PREPARE_WS = WarpSpecialization(PREPARE_WS_WARPS, PREPARE_WS_DEFAULT)
_SCAN_WS = WarpSpecialization(SCAN_WS_WARPS, 4)


def _fused_ws(v: Variant) -> WarpSpecialization:
    ws = WarpSpecialization(FUSED_WS_WARPS, v.BV // 16)
    if not ws.applies(v):
        raise ValueError(f"gdn_fused runs {FUSED_WS_WARPS} warps (the state's BV / 16 and the other roles'), not "
                         f"num_warps = {v.num_warps}")
    return ws


GDN_PREPARE = KernelDef(
    name="gdn_prepare",
    params=abi.FAMILIES["gdn_prepare"].kernel_params,
    constexprs=lambda v: {"K": v.K, "V": v.V, "BT": v.BT, "IS_VARLEN": v.varlen, "GATING": v.gating,
                          "WARP_SPECIALIZE": _PREPARE_WS.applies(v), "num_warps": _PREPARE_WS.compile_warps(v)},
    options=_PREPARE_WS.options,
    sources={"sm90": ".prepare_sm90:prepare_kernel", "sm100": ".prepare_sm100:prepare_kernel"},
    grid=abi.FAMILIES["gdn_prepare"].grid_doc,
    uses_axes=frozenset({"dtype", "K", "V", "BT", "varlen", "gating"}),
    doc="per chunk and key head, for each of its value heads: gam = cumsum(g); Tc = (I + A)^-1; "
    "w = Tc (beta e^gam k); u = Tc (beta v); "
    "qg = gam + ln rq, kg = gam - ln rk per row, where rq, rk = "
    "1 / |q|, 1 / |k| with flags & PREPARE_L2NORM (k rows are then normalised first) and 1 without",
)

GDN_SCAN = KernelDef(
    name="gdn_scan",
    params=abi.FAMILIES["gdn_scan"].kernel_params,
    constexprs=lambda v: {
        "K": v.K, "V": v.V, "BT": v.BT, "BV": v.BV, "IS_VARLEN": v.varlen, "TRANSPOSE_STATE": v.transpose,
        "WARP_SPECIALIZE": _SCAN_WS.applies(v), "CHECKPOINTS": v.checkpoints,
        "num_warps": _SCAN_WS.compile_warps(v),
    },
    options=_SCAN_WS.options,
    sources={"sm90": ".scan_sm90:scan_kernel", "sm100": ".scan_sm100:scan_kernel"},
    grid=abi.FAMILIES["gdn_scan"].grid_doc,
    uses_axes=frozenset({"dtype", "K", "V", "BT", "BV", "varlen", "transpose", "state_dtype", "checkpoints"}),
    doc="per (sequence, value head, V tile): v_new = u - w h; o = scale (e^gam q h + (q k^T . M) v_new); "
    "h = e^gam_last h + k^T (e^(gam_last - gam) v_new)",
)

def _fused_constexprs(terms_program: bool):
    def constexprs(v: Variant) -> dict:
        return {"K": v.K, "V": v.V, "BT": v.BT, "BV": v.BV, "IS_VARLEN": v.varlen, "TRANSPOSE_STATE": v.transpose,
                "GATING": v.gating, "CHECKPOINTS": v.checkpoints, "TERMS_PROGRAM": terms_program,
                "num_warps": _fused_ws(v).compile_warps(v)}
    return constexprs


def _fused_options(v: Variant) -> dict:
    return _fused_ws(v).options(v)


_FUSED_AXES = frozenset({"dtype", "K", "V", "BT", "BV", "varlen", "transpose", "state_dtype", "gating", "checkpoints"})
GDN_FUSED = KernelDef(
    name="gdn_fused",
    params=abi.FAMILIES["gdn_fused"].kernel_params,
    constexprs=_fused_constexprs(False),
    options=_fused_options,
    sources={"sm90": ".fused_sm90:fused_kernel", "sm100": ".fused_sm100:fused_kernel"},
    grid=abi.FAMILIES["gdn_fused"].grid_doc,
    uses_axes=_FUSED_AXES,
    doc="per (sequence, value head, V tile): the whole forward, prepare and scan of every chunk in one program",
)
# gdn_fused's source with its terms programs (fused_sm90.py; sm_90a only, BV = 64): per (sequence, value head), the
# two 64-row state programs and TERMS_PROGRAMS programs computing the chunks' terms for both, running at once
GDN_FUSED_TERMS = KernelDef(
    name="gdn_fused_terms",
    params=abi.FAMILIES["gdn_fused_terms"].kernel_params,
    constexprs=_fused_constexprs(True),
    options=_fused_options,
    sources={"sm90": ".fused_sm90:fused_kernel"},
    grid=abi.FAMILIES["gdn_fused_terms"].grid_doc,
    uses_axes=_FUSED_AXES,
    doc="per (sequence, value head): gdn_fused's 64-row state programs, their chunk terms computed once by the "
    "terms programs beside them and handed over through the exchange regions (exchange_counters zero at launch)",
)

KERNELS: dict[str, KernelDef] = {kd.name: kd for kd in (GDN_PREPARE, GDN_SCAN, GDN_FUSED, GDN_FUSED_TERMS)}

# the terms hand-over's shape (loader/abi.py), for fused_sm90.py
TERMS_PROGRAMS, EXCHANGE_SLOTS, EXCHANGE_SCALINGS = abi.TERMS_PROGRAMS, abi.EXCHANGE_SLOTS, abi.EXCHANGE_SCALINGS

# bits of the kernels' `flags` argument (the launcher ABI's, loader/abi.py): PREPARE_L2NORM, SCAN_HAS_H0, ...
globals().update(abi.FLAGS)

__all__ = ["KERNELS", "KernelDef", "Variant", "SCAN_WS_WARPS", "FUSED_WS_WARPS", "PREPARE_WS_WARPS", *abi.FLAGS]
