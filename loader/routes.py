"""The dispatch table's rows on one device: what gdn_aot_forward launches for a batch.

A Route is one row (its route's variants, loaded) and packs the part of gdn_aot_forward_args_t that is the same
for every call of the row once; Routes are a configuration's rows with the device's SM count applied, so that
selecting the row of a batch is a comparison or two (loader/dispatch.py has the rule, which gdn_aot_select
in the launcher shares).
"""
from __future__ import annotations

from .abi import (DTYPE_BYTES, FAMILIES, FORWARD_ARG_FIELDS, FORWARD_ARGS, OPTION_BITS, REGIONS, ROUTE_ARGS,
                  ROUTES, V_TILED, WORKSPACE_ALIGN, region_bytes, z_programs)
from .binding import Launcher
from .dispatch import most_programs
from .errors import CorruptArtifact, DriverError
from .kernel import Kernel


class _NotLoaded:
    """A route's argument half before load(): using it raises instead of passing a short struct to C."""

    def __add__(self, other):
        raise RuntimeError("the route's kernels are not loaded (Routes.load() first)")


_NOT_LOADED = _NotLoaded()


class Route:
    """One dispatch row on one device: its kernels by family, and the workspace bound of a call."""

    def __init__(self, row: dict, kernels: dict[str, Kernel], elt: int):
        self.row, self.name, self.kernels = row, row["route"], kernels
        self.id = ROUTES[self.name].id
        first = next(iter(kernels.values()))
        self.BT = first.BT
        # the V tile of the kernel whose grid tiles V (gdn_scan, gdn_fused, gdn_fused_terms; abi.V_TILED)
        self.BV = next(k.BV for f, k in kernels.items() if FAMILIES[f].grid[2] in V_TILED)
        self.K, self.V, self.varlen, self.elt = row["K"], row["V"], row["varlen"], elt
        # workspace bytes per (row, value head) and per (sequence, value head) of the route's regions, and every
        # region's alignment slack
        sizes = {"K": self.K, "V": self.V, "BT": self.BT, "elt": elt}
        self.row_bytes = region_bytes(self.name, sizes, "row_head")
        self.seq_bytes = region_bytes(self.name, sizes, "seq_head")
        self.padding = (sum(self.name in r.routes for r in REGIONS) + 1) * (WORKSPACE_ALIGN - 1)
        self._slots_coef, self._programs_coef = self._scratch_coefs()
        self.prefix = _NOT_LOADED  # ROUTE_ARGS, packed by load() once the kernels have handles
        # the options gdn_aot_forward refuses on this route and arch (abi.Route.refuses), and why
        self.refusals = {OPTION_BITS[option]: why for arch, option, why in ROUTES[self.name].refuses
                         if arch == first.manifest.arch}
        self.refused_options = sum(self.refusals)

    def refuse(self, options: int):
        """Raise the ValueError of the first refused option set in `options`."""
        raise ValueError(next(why for bit, why in self.refusals.items() if options & bit))

    def __repr__(self):
        return f"Route({self.row['class']}: {', '.join(k.key for k in self.kernels.values())})"

    def _scratch_coefs(self) -> tuple[int, int]:
        """The global scratch of a call is the largest of its launches' scratch_size * grid; the grids of
        loader/abi.py are (slots, H, c) or (num_seqs, HV, c) with c constant for the route (1, ztiles or zterms),
        so it is max(a * slots * H, b * num_seqs * HV): returns (a, b)."""
        coefs = {("slots", "H"): 0, ("num_seqs", "HV"): 0}
        for name, kernel in self.kernels.items():
            pair, last = tuple(FAMILIES[name].grid[:2]), FAMILIES[name].grid[2]
            if pair not in coefs or not (last in V_TILED or isinstance(last, int)):
                raise ValueError(f"{name}'s grid {FAMILIES[name].grid} is not one Route.workspace_bytes knows")
            coefs[pair] = max(coefs[pair], kernel.scratch_size * z_programs(last, self.V, self.BV))
        return coefs[("slots", "H")], coefs[("num_seqs", "HV")]

    def load(self) -> None:
        for kernel in self.kernels.values():
            kernel.load()
        handles = {f.handle: self.kernels[f.name].handle if f.name in self.kernels else 0 for f in FAMILIES.values()}
        self.prefix = ROUTE_ARGS.pack(self.id, *handles.values(), self.K, self.V, self.BT, self.BV, self.elt)

    def workspace_bytes(self, B: int, T: int, num_seqs: int, H: int, HV: int) -> int:
        """Enough workspace for the call: the regions and scratch of gdn_aot_forward_plan, each padded to the full
        WORKSPACE_ALIGN (at most (the route's regions + 1) * 255 bytes more than the plan's exact workspace_bytes, which
        gdn_aot_forward checks it against; tests/test_abi.py compares the two)."""
        rows = B * T
        scratch = self._programs_coef * num_seqs * HV
        if self._slots_coef:
            slots = rows // self.BT + num_seqs if self.varlen else num_seqs * -(-T // self.BT)  # chunk slots
            scratch = max(scratch, self._slots_coef * slots * H)
        return rows * HV * self.row_bytes + num_seqs * HV * self.seq_bytes + scratch + self.padding


class Routes:
    """A configuration's dispatch rows on one device, its SM count applied: select(programs) is the Route of a
    batch of num_seqs * HV programs. load() loads every route's kernels and binds the launcher's
    gdn_aot_forward; then a forward is one ctypes call."""

    def __init__(self, rows: list[dict], kernel, manifest, device_index: int, sm_count: int):
        if not rows:
            raise ValueError("a configuration with no dispatch rows")
        elt = DTYPE_BYTES[rows[0]["dtype"]]
        self.routes = tuple(Route(r, {f: kernel(k) for f, k in r["kernels"].items()}, elt) for r in rows)
        # (the most num_seqs * HV the row takes on this device, its Route), in the table's order
        self.tiers = tuple((most_programs(route.row, sm_count), route) for route in self.routes)
        self.manifest, self.device_index, self.sm_count = manifest, device_index, sm_count
        self.launcher: Launcher | None = None  # set by load()

    @property
    def batch_invariant(self) -> bool:
        """Whether every row computes the same bits: the rows of one route differ in tiling only and round alike,
        and fused_terms computes fused's bits (abi.Route.same_bits_as; the GPU suite checks both bitwise), so a
        sequence's result cannot depend on its batch; a spec that sends some batches to another route (its
        dispatch's gdn_fused above_factor) gives up that guarantee."""
        return len({ROUTES[route.name].bits for route in self.routes}) == 1

    def select(self, programs: int) -> Route:
        """The route of a batch of `programs` = num_seqs * HV programs (the table's first row that takes it)."""
        for most, route in self.tiers:
            if programs <= most:
                return route
        raise LookupError(f"no dispatch row takes {programs} programs")  # the table ends with an unbounded row

    def load(self) -> None:
        """Load every route's kernels on the device (in its primary context, whatever device is current) and bind
        the launcher's gdn_aot_forward; idempotent."""
        import torch

        with torch.cuda.device(self.device_index):
            for route in self.routes:
                route.load()
        launcher = Launcher.open(self.manifest.launcher_path())
        if launcher.gdn_aot_forward is None:
            raise CorruptArtifact(f"{launcher.path} has no gdn_aot_forward (built from a spec without a route's "
                                  f"kernels?); rebuild with {self.manifest.build_command()}")
        self.launcher = launcher

    def failed(self, r: int, route: Route, call: bytes):
        """Raise the DriverError of a gdn_aot_forward that returned r, with its arguments."""
        keys = {k.handle: k.key for k in route.kernels.values() if k.handle}
        handles = {f.handle for f in FAMILIES.values()}
        values = ", ".join(f"{f.name}={keys.get(x, x) if f.name in handles else x}"
                           for f, x in zip(FORWARD_ARG_FIELDS, FORWARD_ARGS.unpack(route.prefix + call)))
        raise DriverError(f"gdn_aot_forward failed: CUresult {r} ({self.launcher.error_string(r)}); {values}", r)

