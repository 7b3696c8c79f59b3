"""bench/bench.py's JSON names the artifacts its gdn_aot calls ran (the manifest's source, spec and build-code
hashes), so that a result identifies its kernels even where the GPU host's copy of the checkout is another commit."""
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
