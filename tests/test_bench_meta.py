"""bench/bench.py's JSON names the artifacts its gdn_aot calls ran (the manifest's source, spec and build-code
hashes), so that a result identifies its kernels even where the GPU host's copy of the checkout is another commit;
bench/rows.py says how far apart two dispatch rows' results are."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import bench  # noqa: E402


def test_artifacts_identity_is_the_manifest_s(tiny_build):
    from gdn_aot.loader import Artifacts

    arts = Artifacts.for_device(0, capability=(9, 0), root=tiny_build.out)
    ident = bench.artifacts_identity(arts)
    data = arts.manifest.data
    assert ident == {"dir": str(tiny_build.out / "sm_90a"), "kernels_source_sha256": data["kernels_source_sha256"],
                     "spec_sha256": data["spec"]["sha256"], "build_code_version": data["build_code_version"]}
    assert len(ident["kernels_source_sha256"]) == 64 and len(ident["spec_sha256"]) == 64


def test_rows_reports_bits_or_the_distance():
    """bench/rows.py's comparison column: "True" only for the same bits, else how far o and the state are apart
    (what tells a rounding difference, 1e-5, from a wrong hand-over, 1e-1)."""
    import torch
    import rows

    o, state = torch.tensor([1.0, 2.0, 3.0]), torch.zeros(2, 2)
    assert rows.bitwise_or_distance((o, state), (o.clone(), state.clone())) == "True"
    near = o.clone()
    near[1] = torch.nextafter(near[1], torch.tensor(3.0))
    assert rows.bitwise_or_distance((near, state), (o, state)) == "2.4e-07/0.0e+00"
    assert rows.bitwise_or_distance((o, state + 0.5), (o, state)) == "0.0e+00/5.0e-01"
