"""bench/terms_program.py's CPU half: its diff still applies to kernels/fused_sm90.py hunk by hunk, and the
prototype it makes compiles for sm_90a with its partitions intact (no spills in a loop, the TMA export, the
spinning waits), so that the prototype measured in docs/design.md ("A terms program") stays runnable as the
kernel changes."""
import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import fused_ablate  # noqa: E402  (bench/, put on the path above)
import terms_program  # noqa: E402

KERNEL = (REPO / "kernels" / "fused_sm90.py").read_text()
DIFFS = {name: (REPO / "bench" / name).read_text() for name in ("terms_program.diff", "terms_program_two.diff")}


def test_hunks_split_a_unified_diff():
    diff = "--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n@@ -9,2 +9,3 @@\n x\n+y\n z\n"
    assert terms_program.hunks(diff) == [("a\nb\nc\n", "a\nB\nc\n"), ("x\nz\n", "x\ny\nz\n")]
    assert terms_program.apply("a\nb\nc\n-\nx\nz\n", diff) == "a\nB\nc\n-\nx\ny\nz\n"
    with pytest.raises(ValueError, match="no longer applies"):
        terms_program.apply("a\nb\nc\na\nb\nc\n", diff)


@pytest.mark.parametrize("name,programs", [("terms_program.diff", 1), ("terms_program_two.diff", 2)])
def test_the_diff_applies_to_the_kernel(name, programs):
    diff = DIFFS[name]
    proto = terms_program.Prototype(terms_program.apply(KERNEL, diff))
    ast.parse(proto.source)
    assert len(terms_program.hunks(diff)) == diff.count("\n@@ ")
    assert "TERMS_PROGRAM" not in KERNEL and "TERMS_PROGRAM: gl.constexpr" in proto.source
    # what the tool sizes the rings and the grid by
    assert (proto.programs, proto.slots) == (programs, 8)


@pytest.mark.parametrize("name", sorted(DIFFS))
def test_the_prototype_compiles_for_sm90a(tmp_path, name):
    pytest.importorskip("triton")
    import triton
    from gdn_aot.build.sass import disassemble, opcode_counts, summary
    from gdn_aot.kernels import KERNELS, Variant
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    # a package name of its own: fused_ablate.load imports the copy, and a second import of one name is cached
    fn = fused_ablate.load(name.removesuffix(".diff"), lambda kernel: terms_program.apply(kernel, DIFFS[name]))
    # gdn_fused's 64-row varlen variant as the build compiles it, plus the prototype's parameters and switch
    kd = KERNELS["gdn_fused"]
    variant = Variant("gdn_fused", "sm_90a", K=128, V=128, BT=64, BK=128, BV=64, dtype="bf16", varlen=True,
                      transpose=False, num_warps=16, num_stages=1)
    consts = {**kd.constexprs(variant), "TERMS_PROGRAM": True}
    types = {**kd.signature(variant), "exchange_tiles": "*bf16", "exchange_scalings": "*fp32",
             "exchange_counters": "*i32", "TERMS_PROGRAM": "constexpr"}
    names = list(fn.arg_names)
    signature = {a: types[a] for a in names}
    src = GluonASTSource(fn=fn, signature=signature, constexprs={(names.index(a),): v for a, v in consts.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                                if signature[a].startswith("*")})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=kd.compile_options(variant))
    cubin = tmp_path / "prototype.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = disassemble(cubin, "sm_90a")
    facts, ops = summary(cubin, "sm_90a", sass), opcode_counts(sass)
    # the terms program's three aux partitions reload one spilled value a chunk (one LDL each; the default
    # partition also stores it back): a prototype's tolerance, which a product kernel must not have (test_sass)
    assert facts["STL_in_loop"] <= 1 and facts["LDL_in_loop"] <= 3, facts
    assert ops["UTMASTG"] >= 3 and ops["NANOSLEEP"] >= 2 and ops["HGMMA"] > 0, ops
    assert compiled.metadata.shared <= 232448  # 227 KB, a CTA's most on sm_90a
