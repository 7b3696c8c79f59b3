// gdn_forward.cpp: one gdn-aot forward from C++ on raw device pointers (gdn_aot_forward.hpp does the work).
//
// Asks the launcher's dispatch table which route and bf16 variants of an artifact directory serve the batch (the
// choice gdn_aot.chunk_gated_delta_rule makes), fills inputs (deterministic, or raw files written by Python), runs
// the forward on a stream, copies o and the final state (and the state checkpoints) back, prints checksums and
// optionally writes o and ht (and ckpt) to files. All device work goes through the generated launcher and its
// driver table (gdn_aot_driver()), so the program needs only libcuda.so.1 at run time, which the launcher
// dlopens: it does not link -lcuda.
//
// Build (cuda.h ships in the triton wheel: triton/backends/nvidia/include):
//   L=artifacts/sm_90a/launcher
//   g++ -std=c++17 -O2 -Wall -Wextra -Werror -I$L -I$TRITON/backends/nvidia/include -Iexamples/cpp
//       examples/cpp/gdn_forward.cpp -L$L -lgdn_aot_launch -Wl,-rpath,$L -o gdn_forward    (one line)
// Run:
//   ./gdn_forward artifacts/sm_90a                          # 3 sequences (100, 1, 300 tokens), H=2, HV=4
//   ./gdn_forward artifacts/sm_90a --lens 4096,4096 --heads 16,32 --out /tmp/o
//   ./gdn_forward artifacts/sm_90a --lens 4096,300 --checkpoint-every 1024 --out /tmp/o   # + the state every 1024
//   ./gdn_forward artifacts/sm_90a --dry-run --sms 132      # the row, variants, grids, workspace; no GPU needed
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gdn_aot_forward.hpp"

namespace {

const char USAGE[] =
    "usage: gdn_forward ARTIFACT_DIR [options]\n"
    "  ARTIFACT_DIR     one arch of a gdn-aot build, e.g. artifacts/sm_90a\n"
    "  --lens L1,L2,..  sequence lengths of the packed (varlen) batch      [100,1,300]\n"
    "  --heads H,HV     query/key heads and value heads                    [2,4]\n"
    "  --dims K,V       head dims                                          [128,128]\n"
    "  --sms N          SM count the dispatch table compares with          [the device's]\n"
    "  --transpose      state layout [N, HV, V, K]\n"
    "  --no-l2norm      use_qk_l2norm_in_kernel=False (generated k rows are then unit norm)\n"
    "  --no-h0          start from a zero state\n"
    "  --seed N         seed of the generated inputs                       [1]\n"
    "  --inputs DIR     read q.bin k.bin v.bin (bf16) g.bin beta.bin [h0.bin] (fp32), raw row-major\n"
    "  --checkpoint-every N  the state after every N tokens of each sequence (a multiple of 64; a variant with\n"
    "                   checkpoints), rows in sequence order: ckpt.bin (fp32) with --out\n"
    "  --out DIR        write o.bin (bf16) and ht.bin (fp32) there\n"
    "  --device N       CUDA device ordinal                                [0]\n"
    "  --dry-run        print the dispatch row, variants, grids and workspace size; touch no GPU\n"
    "                   (needs --sms)\n";

struct Args {
    std::string dir, inputs, out;
    std::vector<int> lens{100, 1, 300};
    int H = 2, HV = 4, K = 128, V = 128, sms = 0, device = 0, checkpoint_every = 0;
    unsigned seed = 1;
    bool transpose = false, l2norm = true, h0 = true, dry_run = false;
};

std::vector<int> ints(const std::string &s) {
    std::vector<int> out;
    size_t pos = 0;
    while (pos <= s.size()) {
        size_t comma = s.find(',', pos);
        if (comma == std::string::npos) comma = s.size();
        out.push_back(std::stoi(s.substr(pos, comma - pos)));
        pos = comma + 1;
    }
    return out;
}

Args parse(int argc, char **argv) {
    Args a;
    for (int i = 1; i < argc; i++) {
        std::string opt = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw gdn_aot::Error(opt + " needs a value\n" + USAGE);
            return argv[++i];
        };
        if (opt == "-h" || opt == "--help") {
            std::fputs(USAGE, stdout);
            std::exit(0);
        } else if (opt == "--lens") {
            a.lens = ints(value());
        } else if (opt == "--heads") {
            std::vector<int> h = ints(value());
            if (h.size() != 2) throw gdn_aot::Error("--heads takes H,HV");
            a.H = h[0], a.HV = h[1];
        } else if (opt == "--dims") {
            std::vector<int> d = ints(value());
            if (d.size() != 2) throw gdn_aot::Error("--dims takes K,V");
            a.K = d[0], a.V = d[1];
        } else if (opt == "--sms") {
            a.sms = std::stoi(value());
        } else if (opt == "--transpose") {
            a.transpose = true;
        } else if (opt == "--no-l2norm") {
            a.l2norm = false;
        } else if (opt == "--no-h0") {
            a.h0 = false;
        } else if (opt == "--seed") {
            a.seed = static_cast<unsigned>(std::stoul(value()));
        } else if (opt == "--inputs") {
            a.inputs = value();
        } else if (opt == "--checkpoint-every") {
            a.checkpoint_every = std::stoi(value());
        } else if (opt == "--out") {
            a.out = value();
        } else if (opt == "--device") {
            a.device = std::stoi(value());
        } else if (opt == "--dry-run") {
            a.dry_run = true;
        } else if (!opt.empty() && opt[0] != '-' && a.dir.empty()) {
            a.dir = opt;
        } else {
            throw gdn_aot::Error("unknown argument " + opt + "\n" + USAGE);
        }
    }
    if (a.dir.empty()) throw gdn_aot::Error(std::string("no ARTIFACT_DIR\n") + USAGE);
    for (int len : a.lens)
        if (len < 0) throw gdn_aot::Error("--lens: lengths must be >= 0");
    if (a.H <= 0 || a.HV % a.H) throw gdn_aot::Error("--heads: HV must be a multiple of H");
    if (a.checkpoint_every < 0 || a.checkpoint_every % 64)
        throw gdn_aot::Error("--checkpoint-every: a multiple of 64 (0: none)");
    if (a.dry_run && a.sms <= 0) throw gdn_aot::Error("--dry-run needs --sms N (the SM count of the target GPU)");
    return a;
}

uint16_t to_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float from_bf16(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

struct Lcg {  // deterministic values in [-1, 1)
    uint32_t s;
    float next() {
        s = s * 1664525u + 1013904223u;
        return static_cast<float>(s >> 8) / 8388608.0f - 1.0f;
    }
};

template <class T> void read_raw(const std::string &path, std::vector<T> &dst) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    if (!in) throw gdn_aot::Error("cannot open " + path);
    const size_t bytes = static_cast<size_t>(in.tellg());
    if (bytes != dst.size() * sizeof(T))
        throw gdn_aot::Error(path + " has " + std::to_string(bytes) + " bytes, expected " +
                             std::to_string(dst.size() * sizeof(T)));
    in.seekg(0);
    in.read(reinterpret_cast<char *>(dst.data()), static_cast<std::streamsize>(bytes));
}

template <class T> void write_raw(const std::string &path, const std::vector<T> &src) {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char *>(src.data()), static_cast<std::streamsize>(src.size() * sizeof(T)));
    if (!out) throw gdn_aot::Error("cannot write " + path);
}

// Device memory through the launcher's driver table, freed on scope exit.
struct Buffer {
    const gdn_aot_driver_t *d;
    CUdeviceptr ptr = 0;
    Buffer(const gdn_aot_driver_t *drv, size_t bytes) : d(drv) {
        if (bytes) gdn_aot::check(d->MemAlloc(&ptr, bytes), "cuMemAlloc(" + std::to_string(bytes) + ")");
    }
    template <class T>
    Buffer(const gdn_aot_driver_t *drv, const std::vector<T> &host) : Buffer(drv, host.size() * sizeof(T)) {
        if (ptr) gdn_aot::check(d->MemcpyHtoD(ptr, host.data(), host.size() * sizeof(T)), "cuMemcpyHtoD");
    }
    ~Buffer() {
        if (ptr) d->MemFree(ptr);
    }
    Buffer(const Buffer &) = delete;
    Buffer &operator=(const Buffer &) = delete;
};

struct HostInputs {
    std::vector<uint16_t> q, k, v;
    std::vector<float> g, beta, h0;
};

// q, k, v (bf16), g, beta, h0 (fp32): from --inputs, or deterministic values
HostInputs host_inputs(const Args &a, int rows, int N) {
    const size_t nq = static_cast<size_t>(rows) * a.H * a.K, nv = static_cast<size_t>(rows) * a.HV * a.V,
                 ng = static_cast<size_t>(rows) * a.HV, nh = static_cast<size_t>(N) * a.HV * a.K * a.V;
    HostInputs x{std::vector<uint16_t>(nq), std::vector<uint16_t>(nq), std::vector<uint16_t>(nv),
                 std::vector<float>(ng), std::vector<float>(ng), std::vector<float>(a.h0 ? nh : 0)};
    if (!a.inputs.empty()) {
        read_raw(a.inputs + "/q.bin", x.q), read_raw(a.inputs + "/k.bin", x.k), read_raw(a.inputs + "/v.bin", x.v);
        read_raw(a.inputs + "/g.bin", x.g), read_raw(a.inputs + "/beta.bin", x.beta);
        if (a.h0) read_raw(a.inputs + "/h0.bin", x.h0);
        return x;
    }
    Lcg rng{a.seed};
    for (auto *t : {&x.q, &x.k}) {
        for (size_t r = 0; r < nq / a.K; r++) {  // without l2norm in the kernel, rows must be unit norm
            std::vector<float> row(a.K);
            double ss = 0;
            for (float &e : row) e = rng.next(), ss += static_cast<double>(e) * e;
            const float inv = a.l2norm ? 1.0f : static_cast<float>(1.0 / std::sqrt(ss));
            for (int c = 0; c < a.K; c++) (*t)[r * a.K + c] = to_bf16(row[c] * inv);
        }
    }
    for (uint16_t &e : x.v) e = to_bf16(rng.next());
    for (float &e : x.g) e = 0.5f * (rng.next() - 1.0f);  // log decay in [-1, 0)
    for (float &e : x.beta) e = 0.5f * (rng.next() + 1.0f);
    for (float &e : x.h0) e = 0.1f * rng.next();
    return x;
}

void print_selection(const gdn_aot::Selection &sel, const gdn_aot::Plan &plan) {
    std::printf("route: %d\nclass: %s\n", sel.row->route, sel.row->shape_class);
    const unsigned *grids[] = {plan.prepare_grid, plan.scan_grid, plan.fused_grid, plan.fused_terms_grid};
    const char *names[] = {"prepare", "scan", "fused", "fused_terms"};
    const gdn_aot::Variant *variants[] = {&sel.prepare, &sel.scan, &sel.fused, &sel.fused_terms};
    for (int i = 0; i < 4; i++) {
        if (variants[i]->key.empty()) continue;
        std::printf("%s: %s\n%s_grid: %u %u %u\n", names[i], variants[i]->key.c_str(), names[i], grids[i][0],
                    grids[i][1], grids[i][2]);
    }
    std::printf("workspace_bytes: %zu\n", static_cast<size_t>(plan.workspace_bytes));
}

// the sequences' first checkpoint rows: seq_len / N each (FlashInfer's checkpoint_cu_starts), int64
std::vector<int64_t> checkpoint_starts(const std::vector<int> &lens, int every_n) {
    std::vector<int64_t> starts(1, 0);
    for (int len : lens) starts.push_back(starts.back() + (every_n ? len / every_n : 0));
    return starts;
}

// checksums of o, ht and the checkpoints; 0 when every value is finite
int report(const Args &a, int rows, int N, const std::vector<uint16_t> &o, const std::vector<float> &ht,
           const std::vector<float> &ckpt) {
    double o_sum = 0, o_abs = 0, h_sum = 0, h_abs = 0, c_sum = 0;
    size_t bad = 0;
    for (uint16_t e : o) {
        const double x = from_bf16(e);
        bad += !std::isfinite(x), o_sum += x, o_abs += std::fabs(x);
    }
    for (float e : ht) bad += !std::isfinite(e), h_sum += e, h_abs += std::fabs(e);
    for (float e : ckpt) bad += !std::isfinite(e), c_sum += e;
    std::printf("rows %d, sequences %d, H %d, HV %d, l2norm %d, h0 %d\n", rows, N, a.H, a.HV, a.l2norm, a.h0);
    std::printf("checksum o: sum %.6e abs %.6e\nchecksum ht: sum %.6e abs %.6e\n", o_sum, o_abs, h_sum, h_abs);
    if (a.checkpoint_every) std::printf("checkpoints: %zu states, sum %.6e\n", ckpt.size() / (a.HV * a.K * a.V), c_sum);
    if (!a.out.empty()) {
        write_raw(a.out + "/o.bin", o), write_raw(a.out + "/ht.bin", ht);
        if (a.checkpoint_every) write_raw(a.out + "/ckpt.bin", ckpt);
        std::printf("wrote %s/o.bin and %s/ht.bin\n", a.out.c_str(), a.out.c_str());
    }
    if (bad) {
        std::fprintf(stderr, "FAILED: %zu non-finite values in o / ht / the checkpoints\n", bad);
        return 1;
    }
    std::printf("ok\n");
    return 0;
}

// The forward on the current context's device: inputs up, gdn_forward, outputs down.
int run_on_device(const Args &a, const gdn_aot::ArtifactDir &dir, const gdn_aot::Selection &sel,
                  const gdn_aot::Shape &shape, const std::vector<int32_t> &cu) {
    const gdn_aot_driver_t *d = gdn_aot_driver();
    const int rows = cu.back(), N = static_cast<int>(cu.size()) - 1;
    const size_t nv = static_cast<size_t>(rows) * a.HV * a.V, nh = static_cast<size_t>(N) * a.HV * a.K * a.V;
    const HostInputs x = host_inputs(a, rows, N);
    const std::vector<int64_t> starts = checkpoint_starts(a.lens, a.checkpoint_every);
    const size_t nc = static_cast<size_t>(starts.back()) * a.HV * a.K * a.V;
    CUstream stream;
    gdn_aot::check(d->StreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    const gdn_aot::Forward fwd(dir, sel);  // loads the route's cubins into the current context
    Buffer dq(d, x.q), dk(d, x.k), dv(d, x.v), dg(d, x.g), dbeta(d, x.beta), dcu(d, cu), dh0(d, x.h0);
    Buffer dht(d, nh * 4), dout(d, nv * 2), work(d, fwd.workspace_bytes(shape)), dckpt(d, nc * 4), dstarts(d, starts);
    gdn_aot::Tensors t;
    t.q = dq.ptr, t.k = dk.ptr, t.v = dv.ptr, t.g = dg.ptr, t.beta = dbeta.ptr, t.cu_seqlens = dcu.ptr;
    t.h0 = dh0.ptr, t.ht = dht.ptr, t.o = dout.ptr;
    gdn_aot::Options opt;
    opt.l2norm = a.l2norm;
    if (a.checkpoint_every) {
        t.state_checkpoints = dckpt.ptr, t.checkpoint_rows = starts.back(), t.checkpoint_cu_starts = dstarts.ptr;
        opt.checkpoint_every_n_tokens = a.checkpoint_every;
    }
    gdn_aot::check(gdn_aot::gdn_forward(fwd, shape, t, opt, work.ptr, fwd.workspace_bytes(shape), stream),
                   "gdn_forward");
    gdn_aot::check(d->StreamSynchronize(stream), "cuStreamSynchronize (the forward's kernels)");
    std::vector<uint16_t> o(nv);
    std::vector<float> ht(nh);
    if (nv) gdn_aot::check(d->MemcpyDtoH(o.data(), dout.ptr, nv * 2), "cuMemcpyDtoH(o)");
    if (nh) gdn_aot::check(d->MemcpyDtoH(ht.data(), dht.ptr, nh * 4), "cuMemcpyDtoH(ht)");
    std::vector<float> ckpt(nc);
    if (nc) gdn_aot::check(d->MemcpyDtoH(ckpt.data(), dckpt.ptr, nc * 4), "cuMemcpyDtoH(checkpoints)");
    d->StreamDestroy(stream);
    return report(a, rows, N, o, ht, ckpt);
}

int run(const Args &a) {
    gdn_aot::ArtifactDir dir(a.dir);
    std::vector<int32_t> cu(1, 0);
    for (int len : a.lens) cu.push_back(cu.back() + len);
    const gdn_aot::Shape shape =
        gdn_aot::Shape::packed(cu.back(), static_cast<int32_t>(a.lens.size()), a.H, a.HV, a.K, a.V);
    const gdn_aot::Config config{"bf16", a.K, a.V, true, a.transpose, "fp32", false, a.checkpoint_every > 0};
    if (a.dry_run) {
        const gdn_aot::Selection sel = gdn_aot::Selection::select(dir, config, shape.programs(), a.sms);
        print_selection(sel, sel.plan(shape));
        return 0;
    }
    gdn_aot::check(gdn_aot_init(), "gdn_aot_init");
    const gdn_aot_driver_t *d = gdn_aot_driver();
    CUdevice dev;
    CUcontext ctx;
    gdn_aot::check(d->DeviceGet(&dev, a.device), "cuDeviceGet");
    int sms = a.sms;
    if (sms <= 0)
        gdn_aot::check(d->DeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
                       "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)");
    const gdn_aot::Selection sel = gdn_aot::Selection::select(dir, config, shape.programs(), sms);
    print_selection(sel, sel.plan(shape));
    gdn_aot::check(d->DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    int rc = 1;
    try {
        gdn_aot::check(d->CtxSetCurrent(ctx), "cuCtxSetCurrent");
        rc = run_on_device(a, dir, sel, shape, cu);
    } catch (...) {
        d->DevicePrimaryCtxRelease(dev);
        throw;
    }
    d->DevicePrimaryCtxRelease(dev);
    return rc;
}

}  // namespace

int main(int argc, char **argv) {
    try {
        return run(parse(argc, argv));
    } catch (const std::exception &e) {
        std::fprintf(stderr, "gdn_forward: %s\n", e.what());
        return 1;
    }
}
