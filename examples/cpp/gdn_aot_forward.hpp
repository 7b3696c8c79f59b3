// gdn_aot_forward.hpp: the gdn-aot forward from C++ on raw device pointers (header-only, C++17).
//
// Reads an artifact directory (ARTIFACTS/<arch>: kernels.tsv, cubins/, launcher/), asks the launcher's dispatch
// table (gdn_aot_select: the same table, built by `gdn-aot build`, that gdn_aot.chunk_gated_delta_rule reads from
// the manifest) which route and variants serve a batch, loads them through the generated launcher
// (gdn_aot_launch.h, libgdn_aot_launch.so.<ABI>) and runs the forward the Python API runs: the launcher's
// gdn_aot_forward (the route's launches, the grids and the workspace layout computed in C), with the same
// arguments and options. Needs only libcuda at run time, and only through the launcher (it dlopens libcuda.so.1).
//
//   gdn_aot::ArtifactDir dir("artifacts/sm_90a");
//   gdn_aot::Shape shape = gdn_aot::Shape::packed(rows, num_seqs, H, HV, 128, 128);
//   gdn_aot::Selection sel = gdn_aot::Selection::select(dir, {"bf16", 128, 128, /*varlen=*/true,
//                                                             /*transpose=*/false}, shape.programs(), sm_count);
//   gdn_aot::Forward fwd(dir, sel);                     // loads the route's kernels into the current context
//   size_t bytes = fwd.workspace_bytes(shape);          // allocate once, reuse for calls of that size
//   CUresult r = gdn_aot::gdn_forward(fwd, shape, tensors, options, workspace, bytes, stream);
//
// Tensors (device pointers, contiguous, the layouts of the Python API with B*T = rows):
//   q, k [rows, H, K] and v, o [rows, HV, V] in the variant's dtype; g, beta [rows, HV] fp32 (g: log decay <= 0);
//   cu_seqlens [N + 1] int32 (varlen; 0 for fixed-length batches); h0 / ht [N, HV, K, V] ([N, HV, V, K]
//   with transpose) or 0; state_indices [N] int32 or 0 (h0 is then a state pool [slots, HV, ...], sequence n
//   reads slot state_indices[n], -1 = zero state; pass ht = h0 to update the pool in place), stored in the
//   Config's state_dtype; A_log, dt_bias [HV] fp32 with Options::gate_in_kernel; with
//   Options::checkpoint_every_n_tokens = N > 0 (a multiple of 64; a Config::checkpoints variant), state_checkpoints
//   [checkpoint_rows, HV, K, V] ([.., V, K] with transpose) in the state_dtype receives sequence n's state after every
//   N of its tokens at rows checkpoint_cu_starts[n] ... (checkpoint_cu_starts [N + 1] int64: seq_len_n / N each).
// The workspace (the route's regions and the kernels' global scratch) holds nothing between calls.
// Loaded kernels belong to the context current when the Forward was made: make it current before gdn_forward.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
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
    std::string key, kernel, entry, cubin, dtype, state_dtype = "fp32";
    unsigned num_warps = 0, shared = 0, scratch_size = 0, scratch_align = 0;
    int K = 0, V = 0, BT = 0, BK = 0, BV = 0;
    bool varlen = false, transpose = false, gating = false, checkpoints = false;
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
                                 "global_scratch_align", "dtype", "K", "V", "BT", "BK", "BV", "varlen", "transpose",
                                 "state_dtype", "gating", "checkpoints"})
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
            v.varlen = i("varlen") != 0, v.transpose = i("transpose") != 0, v.state_dtype = s("state_dtype");
            v.gating = i("gating") != 0, v.checkpoints = i("checkpoints") != 0;
            variants_.push_back(v);
        }
    }

    const std::string &dir() const { return dir_; }
    const std::vector<Variant> &variants() const { return variants_; }

    // The variant of a kernels.tsv key (the dispatch table names variants by key).
    const Variant &find(const std::string &key) const {
        for (const Variant &v : variants_)
            if (v.key == key) return v;
        throw Error(key + " is not in " + dir_ + "/kernels.tsv (artifacts from another build? rebuild them)");
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
    int64_t programs() const { return static_cast<int64_t>(num_seqs) * HV; }  // what the dispatch table reads
};

// A configuration: the variant axes a forward needs (the dispatch table's key, with the batch's programs).
struct Config {
    std::string dtype;
    int K = 0, V = 0;
    bool varlen = true, transpose = false;
    std::string state_dtype = "fp32";  // how h0 / ht are stored: fp32 | bf16 | fp16 | fp8e4m3 | fp8e5m2
    bool gating = false;               // a variant that computes the gates in the kernel (Options::gate_in_kernel, ...)
    bool checkpoints = false;          // a variant that writes state checkpoints
};

struct Tensors {
    CUdeviceptr q = 0, k = 0, v = 0, g = 0, beta = 0, cu_seqlens = 0;
    CUdeviceptr A_log = 0, dt_bias = 0;  // [HV] fp32, with Options::gate_in_kernel (dt_bias optional)
    CUdeviceptr h0 = 0, ht = 0, state_indices = 0;
    CUdeviceptr o = 0;
    // with Options::checkpoint_every_n_tokens: the buffer, its rows (none past them is written) and the rows where
    // each sequence's checkpoints start
    CUdeviceptr state_checkpoints = 0;
    int64_t checkpoint_rows = 0;
    CUdeviceptr checkpoint_cu_starts = 0;
};

struct Options {
    float scale = 0.0f;  // 0: K ** -0.5, computed in double and rounded to float as the Python API does
    bool l2norm = true;  // use_qk_l2norm_in_kernel
    // fla's use_gate_in_kernel (g holds the raw a: g = -exp(A_log) softplus(a + dt_bias)) and
    // use_beta_sigmoid_in_kernel (beta holds the raw b: beta = sigmoid(b)); need a Config::gating variant
    bool gate_in_kernel = false, beta_sigmoid = false;
    // the state after every this many tokens of each sequence into Tensors::state_checkpoints (0: none; a multiple of
    // 64); needs a Config::checkpoints variant
    int64_t checkpoint_every_n_tokens = 0;
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

// Grids and workspace layout of one call (gdn_aot_forward_plan): a grid per kernel family, T_arg, the regions'
// byte offsets, scratch, and workspace_bytes.
using Plan = gdn_aot_forward_plan_t;

inline Plan plan_of(const gdn_aot_forward_args_t &a) {
    Plan p{};
    check(gdn_aot_forward_plan(&a, &p), "gdn_aot_forward_plan");
    return p;
}

// The dispatch row of a batch and its variants (nothing loaded: no driver needed). The row names the variants of
// its route by family (prepare, scan, fused or fused_terms); the others are left empty.
struct Selection {
    const gdn_aot_dispatch_row_t *row = nullptr;
    Variant prepare, scan, fused, fused_terms;

    static Selection select(const ArtifactDir &dir, const Config &c, int64_t programs, int64_t sm_count) {
        const gdn_aot_dispatch_row_t *r =
            gdn_aot_select(c.dtype.c_str(), c.K, c.V, c.varlen, c.transpose, c.state_dtype.c_str(), c.gating,
                           c.checkpoints, programs, sm_count);
        if (!r) {
            std::ostringstream msg;
            msg << "no dispatch row serves dtype=" << c.dtype << " K=" << c.K << " V=" << c.V << " varlen=" << c.varlen
                << " transpose=" << c.transpose << " state_dtype=" << c.state_dtype << " gating=" << c.gating
                << " checkpoints=" << c.checkpoints << " in " << dir.dir() << "; rows:";
            const gdn_aot_dispatch_row_t *rows = nullptr;
            for (unsigned i = 0, n = gdn_aot_dispatch_rows(&rows); i < n; i++)
                msg << " (" << rows[i].dtype << " K=" << rows[i].K << " V=" << rows[i].V << " varlen="
                    << rows[i].varlen << " transpose=" << rows[i].transpose << " state_dtype=" << rows[i].state_dtype
                    << " gating=" << rows[i].gating << " checkpoints=" << rows[i].checkpoints << ")";
            msg << ". Add it to a spec and rebuild (gdn-aot build SPEC).";
            throw Error(msg.str());
        }
        Selection s;
        s.row = r;
        if (r->prepare) s.prepare = dir.find(r->prepare);
        if (r->scan) s.scan = dir.find(r->scan);
        if (r->fused) s.fused = dir.find(r->fused);
        if (r->fused_terms) s.fused_terms = dir.find(r->fused_terms);
        return s;
    }

    // The variants of the route, in launch order.
    std::vector<const Variant *> variants() const {
        std::vector<const Variant *> out;
        for (const Variant *v : {&prepare, &scan, &fused, &fused_terms})
            if (!v->key.empty()) out.push_back(v);
        return out;
    }

    // The arguments of gdn_aot_forward for a shape, with these kernel handles (tensors, workspace, stream left 0).
    // The last variant of every route tiles V (gdn_scan, gdn_fused or gdn_fused_terms): its BV is the route's.
    gdn_aot_forward_args_t args(const Shape &s, const gdn_aot_kernel_t *p, const gdn_aot_kernel_t *k,
                                const gdn_aot_kernel_t *f, const gdn_aot_kernel_t *t) const {
        gdn_aot_forward_args_t a{};
        a.route = row->route, a.prepare = p, a.scan = k, a.fused = f, a.fused_terms = t;
        a.B = s.B, a.T = s.T, a.num_seqs = s.num_seqs, a.H = s.H, a.HV = s.HV, a.K = s.K, a.V = s.V;
        a.BT = variants().front()->BT, a.BV = variants().back()->BV, a.elt = 2;
        a.cu_seqlens = s.varlen ? 1 : 0;  // planning reads only whether it is set
        return a;
    }

    // The plan of a call of this shape (the launcher computes it; no GPU needed)
    Plan plan(const Shape &s) const {
        const gdn_aot_kernel_t p = Kernel::unloaded(prepare), k = Kernel::unloaded(scan), f = Kernel::unloaded(fused),
                               t = Kernel::unloaded(fused_terms);
        return plan_of(args(s, prepare.key.empty() ? nullptr : &p, scan.key.empty() ? nullptr : &k,
                            fused.key.empty() ? nullptr : &f, fused_terms.key.empty() ? nullptr : &t));
    }
};

// A Selection loaded into the context current at construction (unloaded on destruction).
class Forward {
  public:
    Forward(const ArtifactDir &dir, const Selection &sel) : sel_(sel) {
        if (!sel.prepare.key.empty()) prepare_.reset(new Kernel(dir, sel.prepare));
        if (!sel.scan.key.empty()) scan_.reset(new Kernel(dir, sel.scan));
        if (!sel.fused.key.empty()) fused_.reset(new Kernel(dir, sel.fused));
        if (!sel.fused_terms.key.empty()) fused_terms_.reset(new Kernel(dir, sel.fused_terms));
    }

    const Selection &selection() const { return sel_; }
    gdn_aot_forward_args_t args(const Shape &s) const {
        return sel_.args(s, prepare_ ? prepare_->get() : nullptr, scan_ ? scan_->get() : nullptr,
                         fused_ ? fused_->get() : nullptr, fused_terms_ ? fused_terms_->get() : nullptr);
    }
    Plan plan(const Shape &s) const { return plan_of(args(s)); }
    size_t workspace_bytes(const Shape &s) const { return plan(s).workspace_bytes; }

  private:
    Selection sel_;
    std::unique_ptr<Kernel> prepare_, scan_, fused_, fused_terms_;
};

// The forward: the route's launches on `stream`, no host synchronisation (capturable in a CUDA graph).
// workspace: workspace_bytes(shape) bytes of device memory, GDN_AOT_WORKSPACE_ALIGN-aligned (cuMemAlloc's are).
inline CUresult gdn_forward(const Forward &fwd, const Shape &s, const Tensors &t, const Options &opt,
                            CUdeviceptr workspace, size_t workspace_bytes, CUstream stream) {
    const Variant &v = *fwd.selection().variants().front();      // reads the gates: gdn_prepare or gdn_fused(_terms)
    const Variant &last = *fwd.selection().variants().back();    // writes the states: gdn_scan or gdn_fused(_terms)
    if (s.K != v.K || s.V != v.V || s.varlen != v.varlen || (s.varlen && !t.cu_seqlens) || (t.state_indices && !t.h0) ||
        (opt.gate_in_kernel && !t.A_log) || ((opt.gate_in_kernel || opt.beta_sigmoid) && !v.gating) ||
        (opt.checkpoint_every_n_tokens && !last.checkpoints))
        return CUDA_ERROR_INVALID_VALUE;
    gdn_aot_forward_args_t a = fwd.args(s);
    a.stream = stream;
    a.q = t.q, a.k = t.k, a.v = t.v, a.g = t.g, a.beta = t.beta, a.cu_seqlens = s.varlen ? t.cu_seqlens : 0;
    a.A_log = opt.gate_in_kernel ? t.A_log : 0, a.dt_bias = opt.gate_in_kernel ? t.dt_bias : 0;
    a.h0 = t.h0, a.ht = t.ht, a.state_indices = t.state_indices, a.o = t.o;
    a.state_checkpoints = t.state_checkpoints, a.checkpoint_rows = t.checkpoint_rows;
    a.checkpoint_cu_starts = t.checkpoint_cu_starts;
    a.checkpoint_every_n_tokens = opt.checkpoint_every_n_tokens;
    a.workspace = workspace, a.workspace_bytes = workspace_bytes;
    a.scale = opt.scale != 0.0f ? opt.scale : static_cast<float>(std::pow(static_cast<double>(s.K), -0.5));
    a.options = (opt.l2norm ? GDN_AOT_FORWARD_L2NORM : 0) | (t.h0 ? GDN_AOT_FORWARD_HAS_H0 : 0) |
                (t.ht ? GDN_AOT_FORWARD_STORE_HT : 0) | (t.state_indices ? GDN_AOT_FORWARD_USE_INDICES : 0) |
                (opt.gate_in_kernel ? GDN_AOT_FORWARD_GATE_IN_KERNEL : 0) |
                (opt.gate_in_kernel && t.dt_bias ? GDN_AOT_FORWARD_GATE_BIAS : 0) |
                (opt.beta_sigmoid ? GDN_AOT_FORWARD_BETA_SIGMOID : 0);
    return gdn_aot_forward(&a);  // checks the sizes, the workspace, the checkpoints' N, then launches the route
}

}  // namespace gdn_aot
