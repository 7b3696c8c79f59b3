// gdn_aot_forward.hpp: the gdn-aot forward from C++ on raw device pointers (header-only, C++17).
//
// Reads an artifact directory (ARTIFACTS/<arch>: kernels.tsv, cubins/, launcher/), picks the gdn_prepare and
// gdn_scan variants, loads them through the generated launcher (gdn_aot_launch.h, libgdn_aot_launch.so.<ABI>)
// and runs the forward gdn_aot.chunk_gated_delta_rule runs: the launcher's gdn_aot_forward (both launches, the
// grids and the workspace layout computed in C), with the same arguments and flags.
// Needs only libcuda at run time, and only through the launcher (it dlopens libcuda.so.1).
//
//   gdn_aot::ArtifactDir dir("artifacts/sm_90a");
//   gdn_aot::Forward fwd(dir, "bf16", /*K=*/128, /*V=*/128, /*varlen=*/true, /*transpose=*/false, /*BV=*/64);
//                                                       // (loads both kernels into the current context)
//   gdn_aot::Shape shape = gdn_aot::Shape::packed(rows, num_seqs, H, HV, 128, 128);
//   size_t bytes = fwd.workspace_bytes(shape);          // allocate once, reuse for calls of that size
//   CUresult r = gdn_aot::gdn_forward(fwd, shape, tensors, options, workspace, bytes, stream);
//
// Tensors (device pointers, contiguous, the layouts of the Python API with B*T = rows):
//   q, k [rows, H, K] and v, o [rows, HV, V] in the variant's dtype; g, beta [rows, HV] fp32 (g: log decay <= 0);
//   cu_seqlens [N + 1] int32 (varlen; 0 for fixed-length batches); h0 / ht fp32 [N, HV, K, V] ([N, HV, V, K]
//   with transpose) or 0; state_indices [N] int32 or 0 (h0 is then a state pool [slots, HV, ...], sequence n
//   reads slot state_indices[n], -1 = zero state; pass ht = h0 to update the pool in place).
// The workspace (w, u, gam, qg, kg and the kernels' global scratch) holds nothing between calls.
// Loaded kernels belong to the context current when the Forward was made: make it current before gdn_forward.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gdn_aot_launch.h"

namespace gdn_aot {

class Error : public std::runtime_error {
  public:
    explicit Error(const std::string &what, CUresult code = CUDA_SUCCESS) : std::runtime_error(what), code(code) {}
    CUresult code;
};

inline void check(CUresult r, const std::string &what) {
    if (r != CUDA_SUCCESS)
        throw Error(what + ": CUresult " + std::to_string(static_cast<int>(r)) + " (" + gdn_aot_error_string(r) + ")",
                    r);
}

// One line of kernels.tsv: a built variant.
struct Variant {
    std::string key, kernel, entry, cubin, dtype;
    unsigned num_warps = 0, shared = 0, scratch_size = 0, scratch_align = 0;
    int K = 0, V = 0, BT = 0, BK = 0, BV = 0;
    bool varlen = false, transpose = false;
};

// An arch directory of a gdn-aot build: ARTIFACTS/<arch>, e.g. artifacts/sm_90a.
class ArtifactDir {
  public:
    explicit ArtifactDir(std::string dir) : dir_(std::move(dir)) {
        const std::string path = dir_ + "/kernels.tsv";
        std::ifstream in(path);
        if (!in) throw Error("cannot open " + path + " (build artifacts with `gdn-aot build SPEC`)");
        std::string line;
        std::vector<std::string> head;
        if (!std::getline(in, line) || line.empty() || line[0] != '#')
            throw Error(path + ": no '#' header line");
        head = split(line.substr(1));
        std::map<std::string, size_t> col;
        for (size_t i = 0; i < head.size(); i++) col[head[i]] = i;
        for (const char *need : {"key", "kernel", "entry", "cubin", "num_warps", "shared", "global_scratch_size",
                                 "global_scratch_align", "dtype", "K", "V", "BT", "BK", "BV", "varlen", "transpose"})
            if (!col.count(need))
                throw Error(path + ": no column '" + need + "' (artifacts from an older gdn-aot: rebuild them)");
        while (std::getline(in, line)) {
            if (line.empty() || line[0] == '#') continue;
            std::vector<std::string> f = split(line);
            if (f.size() < head.size()) throw Error(path + ": short line: " + line);
            auto s = [&](const char *c) { return f[col[c]]; };
            auto u = [&](const char *c) { return static_cast<unsigned>(std::stoul(f[col[c]])); };
            auto i = [&](const char *c) { return std::stoi(f[col[c]]); };
            Variant v;
            v.key = s("key"), v.kernel = s("kernel"), v.entry = s("entry"), v.cubin = s("cubin"), v.dtype = s("dtype");
            v.num_warps = u("num_warps"), v.shared = u("shared"), v.scratch_size = u("global_scratch_size");
            v.scratch_align = u("global_scratch_align");
            v.K = i("K"), v.V = i("V"), v.BT = i("BT"), v.BK = i("BK"), v.BV = i("BV");
            v.varlen = i("varlen") != 0, v.transpose = i("transpose") != 0;
            variants_.push_back(v);
        }
    }

    const std::string &dir() const { return dir_; }
    const std::vector<Variant> &variants() const { return variants_; }

    // The variant gdn_aot.loader's ArtifactSet.pick returns for these axes when `BV` is built: among the matches,
    // the fewest warps, then the smallest key. transpose / BV < 0 match anything (gdn_prepare uses neither).
    const Variant &pick(const std::string &kernel, const std::string &dtype, int K, int V, bool varlen,
                        int transpose = -1, int BV = -1) const {
        const Variant *best = nullptr;
        std::vector<std::string> built;
        for (const Variant &v : variants_) {
            if (v.kernel != kernel) continue;
            built.push_back(v.key);
            if (v.dtype != dtype || v.K != K || v.V != V || v.varlen != varlen) continue;
            if ((transpose >= 0 && v.transpose != (transpose != 0)) || (BV >= 0 && v.BV != BV)) continue;
            if (!best || std::tie(v.num_warps, v.key) < std::tie(best->num_warps, best->key)) best = &v;
        }
        if (!best) {
            std::ostringstream msg;
            msg << kernel << " with dtype=" << dtype << " K=" << K << " V=" << V << " varlen=" << varlen;
            if (transpose >= 0) msg << " transpose=" << transpose;
            if (BV >= 0) msg << " BV=" << BV;
            msg << " is not built in " << dir_ << "; built:";
            for (const std::string &k : built) msg << ' ' << k;
            msg << ". Add it to a spec and rebuild (gdn-aot build SPEC).";
            throw Error(msg.str());
        }
        return *best;
    }

    std::vector<char> read_cubin(const Variant &v) const {
        const std::string path = dir_ + "/" + v.cubin;
        std::ifstream in(path, std::ios::binary);
        if (!in) throw Error("cannot read " + path);
        return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }

  private:
    static std::vector<std::string> split(const std::string &line) {
        std::vector<std::string> out;
        std::string field;
        std::istringstream in(line);
        while (std::getline(in, field, '\t')) out.push_back(field);
        return out;
    }

    std::string dir_;
    std::vector<Variant> variants_;
};

// Sizes of one call. rows = B * T tokens; varlen batches are packed (B = 1, T = rows, N from cu_seqlens).
struct Shape {
    int32_t B = 1, T = 0, num_seqs = 0, H = 0, HV = 0, K = 0, V = 0;
    bool varlen = true;

    static Shape packed(int32_t rows, int32_t num_seqs, int32_t H, int32_t HV, int32_t K, int32_t V) {
        return Shape{1, rows, num_seqs, H, HV, K, V, true};
    }
    static Shape fixed(int32_t B, int32_t T, int32_t H, int32_t HV, int32_t K, int32_t V) {
        return Shape{B, T, B, H, HV, K, V, false};
    }
    int64_t rows() const { return static_cast<int64_t>(B) * T; }
};

struct Tensors {
    CUdeviceptr q = 0, k = 0, v = 0, g = 0, beta = 0, cu_seqlens = 0;
    CUdeviceptr h0 = 0, ht = 0, state_indices = 0;
    CUdeviceptr o = 0;
};

struct Options {
    float scale = 0.0f;  // 0: K ** -0.5, computed in double and rounded to float as the Python API does
    bool l2norm = true;  // use_qk_l2norm_in_kernel
};

// A kernel handle: loaded (one module in the context current at construction, unloaded on destruction), or, for
// planning without a GPU, only the variant's numbers (Kernel::unloaded).
class Kernel {
  public:
    Kernel(const ArtifactDir &dir, const Variant &v) : variant_(v) {
        std::vector<char> image = dir.read_cubin(v);
        check(gdn_aot_kernel_load(&k_, image.data(), v.entry.c_str(), v.num_warps, v.shared, v.scratch_size),
              "loading " + v.key);
    }
    static gdn_aot_kernel_t unloaded(const Variant &v) {
        gdn_aot_kernel_t k{};
        k.num_warps = v.num_warps, k.shared = v.shared, k.scratch_size = v.scratch_size;
        return k;
    }
    ~Kernel() { gdn_aot_kernel_unload(&k_); }
    Kernel(const Kernel &) = delete;
    Kernel &operator=(const Kernel &) = delete;

    const gdn_aot_kernel_t *get() const { return &k_; }
    const Variant &variant() const { return variant_; }

  private:
    Variant variant_;
    gdn_aot_kernel_t k_{};
};

// Grids and workspace layout of one call (gdn_aot_forward_plan): prepare_grid, scan_grid, T_arg, the byte offsets
// w, u, gam, qg, kg, scratch, and workspace_bytes.
using Plan = gdn_aot_forward_plan_t;

// The arguments of gdn_aot_forward for a shape (tensors, workspace and stream left 0).
inline gdn_aot_forward_args_t forward_args(const gdn_aot_kernel_t *prepare, const gdn_aot_kernel_t *scan,
                                           const Variant &scan_variant, const Shape &s) {
    gdn_aot_forward_args_t a{};
    a.prepare = prepare, a.scan = scan;
    a.B = s.B, a.T = s.T, a.num_seqs = s.num_seqs, a.H = s.H, a.HV = s.HV, a.K = s.K, a.V = s.V;
    a.BT = scan_variant.BT, a.BV = scan_variant.BV, a.elt = 2;
    a.cu_seqlens = s.varlen ? 1 : 0;  // planning reads only whether it is set
    return a;
}

inline Plan plan_of(const gdn_aot_forward_args_t &a) {
    Plan p{};
    check(gdn_aot_forward_plan(&a, &p), "gdn_aot_forward_plan");
    return p;
}

// The gdn_prepare and gdn_scan variants of one forward configuration (nothing loaded: no driver needed).
struct Selection {
    Variant prepare, scan;

    static Selection pick(const ArtifactDir &dir, const std::string &dtype, int K, int V, bool varlen,
                          bool transpose, int BV) {
        return Selection{dir.pick("gdn_prepare", dtype, K, V, varlen),
                         dir.pick("gdn_scan", dtype, K, V, varlen, transpose ? 1 : 0, BV)};
    }

    // The plan of a call of this shape (the launcher computes it; no GPU needed)
    Plan plan(const Shape &s) const {
        const gdn_aot_kernel_t p = Kernel::unloaded(prepare), k = Kernel::unloaded(scan);
        return plan_of(forward_args(&p, &k, scan, s));
    }
};

// A Selection loaded into the context current at construction (unloaded on destruction).
class Forward {
  public:
    Forward(const ArtifactDir &dir, const Selection &sel)
        : sel_(sel), prepare_(dir, sel.prepare), scan_(dir, sel.scan) {}
    Forward(const ArtifactDir &dir, const std::string &dtype, int K, int V, bool varlen, bool transpose, int BV)
        : Forward(dir, Selection::pick(dir, dtype, K, V, varlen, transpose, BV)) {}

    const Selection &selection() const { return sel_; }
    const Kernel &prepare() const { return prepare_; }
    const Kernel &scan() const { return scan_; }
    gdn_aot_forward_args_t args(const Shape &s) const {
        return forward_args(prepare_.get(), scan_.get(), sel_.scan, s);
    }
    Plan plan(const Shape &s) const { return plan_of(args(s)); }
    size_t workspace_bytes(const Shape &s) const { return plan(s).workspace_bytes; }

  private:
    Selection sel_;
    Kernel prepare_, scan_;
};

// The forward: gdn_prepare then gdn_scan on `stream`, no host synchronisation (capturable in a CUDA graph).
// workspace: workspace_bytes(shape) bytes of device memory, GDN_AOT_WORKSPACE_ALIGN-aligned (cuMemAlloc's are).
inline CUresult gdn_forward(const Forward &fwd, const Shape &s, const Tensors &t, const Options &opt,
                            CUdeviceptr workspace, size_t workspace_bytes, CUstream stream) {
    const Variant &sv = fwd.selection().scan;
    if (s.K != sv.K || s.V != sv.V || s.varlen != sv.varlen || (s.varlen && !t.cu_seqlens) ||
        (t.state_indices && !t.h0))
        return CUDA_ERROR_INVALID_VALUE;
    gdn_aot_forward_args_t a = fwd.args(s);
    a.stream = stream;
    a.q = t.q, a.k = t.k, a.v = t.v, a.g = t.g, a.beta = t.beta, a.cu_seqlens = s.varlen ? t.cu_seqlens : 0;
    a.h0 = t.h0, a.ht = t.ht, a.state_indices = t.state_indices, a.o = t.o;
    a.workspace = workspace, a.workspace_bytes = workspace_bytes;
    a.scale = opt.scale != 0.0f ? opt.scale : static_cast<float>(std::pow(static_cast<double>(s.K), -0.5));
    a.prepare_flags = opt.l2norm ? GDN_AOT_PREPARE_L2NORM : 0;
    a.scan_flags = (t.h0 ? GDN_AOT_SCAN_HAS_H0 : 0) | (t.ht ? GDN_AOT_SCAN_STORE_HT : 0) |
                   (t.state_indices ? GDN_AOT_SCAN_USE_INDICES : 0);
    return gdn_aot_forward(&a);  // checks the sizes, the workspace's size and alignment, then launches both
}

}  // namespace gdn_aot
