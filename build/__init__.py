"""The build step: spec -> compiled cubins, manifest, generated C launcher (needs triton; the loader does not).

Stages, one module each: spec (parse/validate YAML), toolchain (bundled ptxas/cuobjdump/nvdisasm, versions),
worker (compile ONE variant in a subprocess), compile (parallel + incremental orchestration), abi (kernel
parameter ABI, checked against the PTX .entry), sass (instruction-family summary, resource usage),
launcher (jinja2 -> C -> .so), manifest (atomic writes, schema), cli (the `gdn-aot` command).
"""
