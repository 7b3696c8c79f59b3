"""The sm_90a inverse's diagonal-block substitution (kernels/fused_sm90.py: FORWARD_SUBSTITUTION, the inline PTX
that each aux warp runs on its block of the wgmma accumulator), run on the CPU: the PTX interpreted one warp in
lockstep, its 8 operands a lane placed by BLOCK_REGISTERS' own bases, the result checked against the inverse.
The GPU suite checks the same code inside the kernel; this proves the algorithm and its lane arithmetic alone."""
import re

import numpy as np
import pytest

fused = pytest.importorskip("gdn_aot.kernels.fused_sm90")

BLOCK = 16
LANES = 32


def _entry_of(layout, lane, register):
    """(row, column) of a thread's register in one warp's block: the XOR of the layout's bases for the set bits."""
    row = col = 0
    for bases, index in ((layout.lane_bases, lane), (layout.reg_bases, register)):
        for bit, (_, r, c) in enumerate(bases):
            if index >> bit & 1:
                row ^= r
                col ^= c
    return row, col


def _run_warp(ptx, operands):
    """Interprets the PTX for 32 lanes in lockstep; operands[lane] maps "$i" to a value. Returns the outputs
    $0-$7 of every lane."""
    regs = [dict(ops) for ops in operands]

    def value(lane, name):
        return regs[lane][name] if name in regs[lane] else int(name)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in args.split(",")]
        if op == "shfl.sync.idx.b32":
            dst, src, lane_of, _, _ = args
            pulled = [regs[int(value(lane, lane_of))][src] for lane in range(LANES)]
            for lane in range(LANES):
                regs[lane][dst] = pulled[lane]
            continue
        for lane in range(LANES):
            if op in ("mov.b32", "mov.u32"):
                regs[lane][args[0]] = value(lane, args[1])
            elif op == "and.b32":
                regs[lane][args[0]] = int(value(lane, args[1])) & int(value(lane, args[2]))
            elif op == "or.b32":
                regs[lane][args[0]] = int(value(lane, args[1])) | int(value(lane, args[2]))
            elif op == "fma.rn.f32":
                regs[lane][args[0]] = value(lane, args[1]) * value(lane, args[2]) + value(lane, args[3])
            else:
                raise AssertionError(f"no interpretation for {op}")
    return [[regs[lane][f"${r}"] for r in range(8)] for lane in range(LANES)]


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_substitution_inverts_each_block(seed):
    layout = fused.BLOCK_REGISTERS.value
    ptx = fused.FORWARD_SUBSTITUTION.value
    assert set(re.findall(r"^\s*([a-z][\w.]*)", ptx, re.M)) <= {"mov.b32", "and.b32", "or.b32", "shfl.sync.idx.b32",
                                                              "fma.rn.f32"}
    rng = np.random.default_rng(seed)
    # a block of -A with its diagonal and upper entries zeroed, as _invert_diagonal_blocks hands it to the PTX
    strict = np.tril(rng.uniform(-0.9, 0.9, (BLOCK, BLOCK)), -1)
    operands = []
    for lane in range(LANES):
        ops = {}
        for r in range(8):
            row, col = _entry_of(layout, lane, r)
            ops[f"${8 + r}"] = strict[row, col]
            ops[f"${16 + r}"] = float(row == col)
            ops[f"${24 + r}"] = lane
        operands.append(ops)
    out = _run_warp(ptx, operands)
    x = np.full((BLOCK, BLOCK), np.nan)
    for lane in range(LANES):
        for r in range(8):
            x[_entry_of(layout, lane, r)] = out[lane][r]
    assert not np.isnan(x).any(), "every entry of the block is some lane's register"
    np.testing.assert_allclose(x, np.linalg.inv(np.eye(BLOCK) - strict), rtol=1e-12, atol=1e-12)
