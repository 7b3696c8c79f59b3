"""The sm_90a inverse's diagonal blocks (kernels/fused_sm90.py: FORWARD_SUBSTITUTION, the inline PTX that each aux
warp runs on its 16 x 16 block of the wgmma accumulator), run on the CPU: the PTX interpreted one warp in lockstep,
its 8 operands a lane placed by BLOCK_REGISTERS' own bases, the result checked against the inverse. The shuffles,
the transposes (movmatrix) and the tensor-core products (mma.sync m16n8k8) move values between lanes as the PTX
ISA's fragment layouts say; fp16 operands are rounded as the hardware rounds them. The GPU suite checks the same
code inside the kernel; this proves the algorithm and its lane arithmetic alone."""
import re

import numpy as np
import pytest

fused = pytest.importorskip("gdn_aot.kernels.fused_sm90")

BLOCK = 16
LANES = 32
QUARTER = BLOCK // 2
MMA = "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32"
INTERPRETED = {"mov.b32", "and.b32", "or.b32", "shfl.sync.idx.b32", "fma.rn.f32", "cvt.rn.f16x2.f32",
               "movmatrix.sync.aligned.m8n8.trans.b16", MMA}


def _entry_of(layout, lane, register):
    """(row, column) of a thread's register in one warp's block: the XOR of the layout's bases for the set bits."""
    row = col = 0
    for bases, index in ((layout.lane_bases, lane), (layout.reg_bases, register)):
        for bit, (_, r, c) in enumerate(bases):
            if index >> bit & 1:
                row ^= r
                col ^= c
    return row, col


def _operands(text):
    """The comma-separated operands of an instruction; a {a, b} vector becomes a list."""
    return [[v.strip() for v in a.strip()[1:-1].split(",")] if a.strip().startswith("{") else a.strip()
            for a in re.findall(r"\s*(\{[^}]*\}|[^,{]+)", text)]


def _fragment(lane):
    """m8n8 / m16n8 fragments (PTX ISA): lane holds row lane // 4 (and + 8) in columns 2 (lane % 4) + {0, 1}."""
    return lane // 4, 2 * (lane % 4)


def _run_warp(ptx, operands):
    """Interprets the PTX for 32 lanes in lockstep; operands[lane] maps "$i" to a value, an fp16 pair is a tuple
    (low half, high half). Returns the outputs $0-$7 of every lane."""
    regs = [dict(ops) for ops in operands]

    def value(lane, name):
        if name in regs[lane]:
            return regs[lane][name]
        if name.startswith("0f"):
            return float(np.frombuffer(bytes.fromhex(name[2:]), ">f4")[0])
        return int(name)

    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        args = _operands(rest)
        if op == "shfl.sync.idx.b32":
            dst, src, lane_of, _, _ = args
            pulled = [regs[int(value(lane, lane_of))][src] for lane in range(LANES)]
            for lane in range(LANES):
                regs[lane][dst] = pulled[lane]
        elif op == "movmatrix.sync.aligned.m8n8.trans.b16":
            dst, src = args
            m = np.zeros((QUARTER, QUARTER))
            for lane in range(LANES):
                row, col = _fragment(lane)
                m[row, col:col + 2] = regs[lane][src]
            for lane in range(LANES):
                row, col = _fragment(lane)
                regs[lane][dst] = (m[col, row], m[col + 1, row])
        elif op == MMA:  # D [16, 8] = A [16, 8] B [8, 8] + C, A and B fp16 pairs
            d, a, b, c = args
            A, B, C = np.zeros((BLOCK, QUARTER)), np.zeros((QUARTER, QUARTER)), np.zeros((BLOCK, QUARTER))
            for lane in range(LANES):
                row, col = _fragment(lane)
                for half in (0, 1):
                    pair = value(lane, a[half])
                    A[row + 8 * half, col:col + 2] = (0.0, 0.0) if pair == 0 else pair
                    C[row + 8 * half, col:col + 2] = value(lane, c[2 * half]), value(lane, c[2 * half + 1])
                B[col:col + 2, row] = regs[lane][b[0]]
            D = A @ B + C
            for lane in range(LANES):
                row, col = _fragment(lane)
                for i in range(4):
                    regs[lane][d[i]] = D[row + 8 * (i // 2), col + i % 2]
        else:
            for lane in range(LANES):
                if op == "mov.b32":
                    regs[lane][args[0]] = value(lane, args[1])
                elif op == "and.b32":
                    regs[lane][args[0]] = int(value(lane, args[1])) & int(value(lane, args[2]))
                elif op == "or.b32":
                    regs[lane][args[0]] = int(value(lane, args[1])) | int(value(lane, args[2]))
                elif op == "fma.rn.f32":
                    regs[lane][args[0]] = value(lane, args[1]) * value(lane, args[2]) + value(lane, args[3])
                elif op == "cvt.rn.f16x2.f32":  # the second source into the low half
                    regs[lane][args[0]] = (float(np.float16(value(lane, args[2]))),
                                           float(np.float16(value(lane, args[1]))))
                else:
                    raise AssertionError(f"no interpretation for {op}")
    return [[regs[lane][f"${r}"] for r in range(8)] for lane in range(LANES)]


@pytest.mark.parametrize("seed", range(4))
def test_diagonal_block_inverse(seed):
    layout = fused.BLOCK_REGISTERS.value
    ptx = fused.FORWARD_SUBSTITUTION.value
    assert set(re.findall(r"^\s*([a-z][\w.]*)", ptx, re.M)) <= INTERPRETED
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
    ref = np.linalg.inv(np.eye(BLOCK) - strict)
    low, high = slice(0, QUARTER), slice(QUARTER, BLOCK)
    # the diagonal quarters by substitution: exact up to the order of the sums
    np.testing.assert_allclose(x[low, low], ref[low, low], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(x[high, high], ref[high, high], rtol=1e-12, atol=1e-12)
    assert not x[low, high].any()
    # the lower-left one from fp16 operands (N21, X11, N21 X11 and X22 each rounded once, 2^-11 relative)
    err = np.abs(x[high, low] - ref[high, low]).max() / np.abs(ref).max()
    assert err < 2e-3
