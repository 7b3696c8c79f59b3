"""The build step: spec -> compiled cubins, manifest, generated C launcher (needs triton; the loader does not).

Stages, one module each: spec (parse/validate YAML), toolchain (bundled ptxas/cuobjdump/nvdisasm, versions),
worker (compile ONE variant in a subprocess), compile (parallel + incremental orchestration), params (each
variant's parameter list from the launcher ABI, loader/abi.py, checked against the PTX .entry and the cubin),
sass (instruction-family summary, resource usage), launcher (jinja2 -> C -> .so, from loader/abi.py and the
dispatch table of loader/dispatch.py), manifest (atomic writes, schema), package (shipping), cli (`gdn-aot`).
"""
