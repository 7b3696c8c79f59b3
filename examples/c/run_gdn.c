/* run_gdn.c: use gdn-aot artifacts from C with nothing but the generated header and launcher library.
 *
 * Finds the bf16 varlen gdn_prepare variant in ARTIFACTS/<arch>/kernels.tsv (columns read by the names in its
 * '#' header), loads its cubin with gdn_aot_kernel_load, launches it through gdn_aot_launch_gdn_prepare on a
 * packed batch of 3 sequences (70, 1 and 130 tokens) with flags = GDN_AOT_PREPARE_L2NORM, and checks three of its
 * outputs on the host, per token and value head (stored head-major, [HV, rows] fp32): gam (the cumulative sum of
 * g inside each 64-token chunk of each sequence), qg = gam + ln rq and kg = gam - ln rk, where rq, rk =
 * 1 / sqrt(sum x^2 + 1e-6) are the inverse L2 norms of the q and k rows. The driver is reached only through the
 * launcher (gdn_aot_driver()), which dlopens libcuda.so.1. examples/cpp/ runs a whole forward.
 *
 * Build (cuda.h ships in the triton wheel: triton/backends/nvidia/include):
 *   L=artifacts/sm_90a/launcher
 *   cc -O2 -Wall -Werror -I$L -I$TRITON/backends/nvidia/include examples/c/run_gdn.c -L$L -lgdn_aot_launch \
 *      -Wl,-rpath,$L -lm -o run_gdn
 * Run:  ./run_gdn artifacts/sm_90a
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdn_aot_launch.h"

#define H 2
#define HV 4
#define KD 128
#define VD 128
#define NSEQ 3

#define CHECK(call)                                                                              \
    do {                                                                                         \
        CUresult r_ = (call);                                                                    \
        if (r_ != CUDA_SUCCESS) {                                                                \
            fprintf(stderr, "%s:%d: %s -> %d (%s)\n", __FILE__, __LINE__, #call, (int)r_,        \
                    gdn_aot_error_string(r_));                                                   \
            return 1;                                                                            \
        }                                                                                        \
    } while (0)

typedef struct {
    char key[256], entry[128], cubin[256];
    unsigned num_warps, shared, scratch_size;
} tsv_row_t;

enum { C_KEY, C_KERNEL, C_ENTRY, C_CUBIN, C_WARPS, C_SHARED, C_SCRATCH, C_DTYPE, C_VARLEN, NCOLS };
static const char *const COLS[NCOLS] = {"key",   "kernel",  "entry", "cubin", "num_warps", "shared",
                                        "global_scratch_size", "dtype", "varlen"};

/* Split a line at tabs in place (the newline is dropped); returns the field count. */
static int split(char *line, char **fields, int max) {
    int n = 0;
    line[strcspn(line, "\r\n")] = 0;
    for (char *p = line; n < max;) {
        fields[n++] = p;
        p = strchr(p, '\t');
        if (!p) break;
        *p++ = 0;
    }
    return n;
}

/* The first variant of `kernel` with this dtype and varlen flag (the shipped specs build one gdn_prepare each). */
static int find_row(const char *dir, const char *kernel, const char *dtype, int varlen, tsv_row_t *row) {
    char path[1024], line[4096], *f[64];
    int col[NCOLS], n;
    snprintf(path, sizeof path, "%s/kernels.tsv", dir);
    FILE *fp = fopen(path, "r");
    if (!fp) {
        perror(path);
        return -1;
    }
    if (!fgets(line, sizeof line, fp) || line[0] != '#') {
        fprintf(stderr, "%s: no '#' header line\n", path);
        fclose(fp);
        return -1;
    }
    n = split(line + 1, f, 64);
    for (int c = 0; c < NCOLS; c++) {
        col[c] = -1;
        for (int i = 0; i < n; i++)
            if (strcmp(f[i], COLS[c]) == 0) col[c] = i;
        if (col[c] < 0) {
            fprintf(stderr, "%s: no column '%s' (artifacts from an older gdn-aot?)\n", path, COLS[c]);
            fclose(fp);
            return -1;
        }
    }
    while (fgets(line, sizeof line, fp)) {
        if (line[0] == '#' || split(line, f, 64) < n) continue;
        if (strcmp(f[col[C_KERNEL]], kernel) || strcmp(f[col[C_DTYPE]], dtype) || atoi(f[col[C_VARLEN]]) != varlen)
            continue;
        snprintf(row->key, sizeof row->key, "%s", f[col[C_KEY]]);
        snprintf(row->entry, sizeof row->entry, "%s", f[col[C_ENTRY]]);
        snprintf(row->cubin, sizeof row->cubin, "%s", f[col[C_CUBIN]]);
        row->num_warps = (unsigned)atoi(f[col[C_WARPS]]);
        row->shared = (unsigned)atoi(f[col[C_SHARED]]);
        row->scratch_size = (unsigned)atoi(f[col[C_SCRATCH]]);
        fclose(fp);
        return 0;
    }
    fclose(fp);
    fprintf(stderr, "no %s variant with dtype=%s varlen=%d in %s\n", kernel, dtype, varlen, path);
    return -1;
}

static void *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *buf = malloc((size_t)n);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    return buf;
}

static uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* deterministic values in [-1, 1) */
static float noise(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)(*s >> 8) / 8388608.0f - 1.0f;
}

/* The batch: host inputs, device buffers (q, k, v, g, beta, cu_seqlens in; w, u, gam, qg, kg out) and results. */
typedef struct {
    int cu[NSEQ + 1], rows;
    size_t nqk, nv, ng;
    uint16_t *hq, *hk, *hv;
    float *hg, *hb, *gam, *qg, *kg;
    CUdeviceptr q, k, v, g, beta, cu_dev, w, u, gam_dev, qg_dev, kg_dev, scratch;
} batch_t;

/* host inputs: q, k [rows, H, K] and v [rows, HV, V] bf16; g (<= 0), beta [rows, HV] fp32 */
static void make_inputs(batch_t *b) {
    const int lens[NSEQ] = {70, 1, 130};
    uint32_t seed = 12345;
    b->cu[0] = 0;
    for (int s = 0; s < NSEQ; s++) b->cu[s + 1] = b->cu[s] + lens[s];
    b->rows = b->cu[NSEQ];
    b->nqk = (size_t)b->rows * H * KD, b->nv = (size_t)b->rows * HV * VD, b->ng = (size_t)b->rows * HV;
    b->hq = malloc(b->nqk * 2), b->hk = malloc(b->nqk * 2), b->hv = malloc(b->nv * 2);
    b->hg = malloc(b->ng * 4), b->hb = malloc(b->ng * 4);
    b->gam = malloc(b->ng * 4), b->qg = malloc(b->ng * 4), b->kg = malloc(b->ng * 4);
    for (size_t i = 0; i < b->nqk; i++) b->hq[i] = to_bf16(noise(&seed));
    for (size_t i = 0; i < b->nqk; i++) b->hk[i] = to_bf16(noise(&seed));
    for (size_t i = 0; i < b->nv; i++) b->hv[i] = to_bf16(noise(&seed));
    for (size_t i = 0; i < b->ng; i++) b->hg[i] = -0.5f * (noise(&seed) + 1.0f);
    for (size_t i = 0; i < b->ng; i++) b->hb[i] = 0.5f * (noise(&seed) + 1.0f);
}

/* device buffers, inputs copied in */
static int upload(const gdn_aot_driver_t *d, batch_t *b) {
    CHECK(d->MemAlloc(&b->q, b->nqk * 2));
    CHECK(d->MemAlloc(&b->k, b->nqk * 2));
    CHECK(d->MemAlloc(&b->v, b->nv * 2));
    CHECK(d->MemAlloc(&b->g, b->ng * 4));
    CHECK(d->MemAlloc(&b->beta, b->ng * 4));
    CHECK(d->MemAlloc(&b->cu_dev, sizeof b->cu));
    CHECK(d->MemAlloc(&b->w, (size_t)b->rows * HV * KD * 2));
    CHECK(d->MemAlloc(&b->u, b->nv * 2));
    CHECK(d->MemAlloc(&b->gam_dev, b->ng * 4));
    CHECK(d->MemAlloc(&b->qg_dev, b->ng * 4));
    CHECK(d->MemAlloc(&b->kg_dev, b->ng * 4));
    CHECK(d->MemcpyHtoD(b->q, b->hq, b->nqk * 2));
    CHECK(d->MemcpyHtoD(b->k, b->hk, b->nqk * 2));
    CHECK(d->MemcpyHtoD(b->v, b->hv, b->nv * 2));
    CHECK(d->MemcpyHtoD(b->g, b->hg, b->ng * 4));
    CHECK(d->MemcpyHtoD(b->beta, b->hb, b->ng * 4));
    CHECK(d->MemcpyHtoD(b->cu_dev, b->cu, sizeof b->cu));
    return 0;
}

/* One gdn_prepare launch. Varlen grid: one program per (64-token chunk slot, key head), serving that key head's
 * HV / H value heads; rows / 64 + N slots bound the chunks. */
static int launch_and_download(const gdn_aot_driver_t *d, const gdn_aot_kernel_t *kern, batch_t *b) {
    unsigned gx = (unsigned)(b->rows / 64 + NSEQ), gy = H, gz = 1;
    if (kern->scratch_size) CHECK(d->MemAlloc(&b->scratch, (size_t)kern->scratch_size * gx * gy * gz));
    CHECK(gdn_aot_launch_gdn_prepare(kern, NULL, gx, gy, gz, b->q, b->k, b->v, b->g, b->beta,
                                     0 /* A_log */, 0 /* dt_bias: g and beta are given as is */, b->cu_dev, b->w,
                                     b->u, b->gam_dev, b->qg_dev, b->kg_dev, b->rows /* T = rows (varlen) */, NSEQ, H,
                                     HV, GDN_AOT_PREPARE_L2NORM, b->scratch));
    CHECK(d->CtxSynchronize());
    CHECK(d->MemcpyDtoH(b->gam, b->gam_dev, b->ng * 4));
    CHECK(d->MemcpyDtoH(b->qg, b->qg_dev, b->ng * 4));
    CHECK(d->MemcpyDtoH(b->kg, b->kg_dev, b->ng * 4));
    return 0;
}

/* where token t of value head h is in gam, qg, kg and ref: the row data is head-major, [HV, rows] */
static size_t row_data_at(const batch_t *b, int h, int t) { return (size_t)h * b->rows + t; }

/* gam on the host (chunks restart at every sequence start) into ref; returns the worst relative error of gam */
static double check_gam(const batch_t *b, double *ref) {
    double worst = 0;
    for (int s = 0; s < NSEQ; s++)
        for (int h = 0; h < HV; h++) {
            double acc = 0;
            for (int t = b->cu[s]; t < b->cu[s + 1]; t++) {
                if ((t - b->cu[s]) % 64 == 0) acc = 0;
                acc += b->hg[(size_t)t * HV + h];
                ref[row_data_at(b, h, t)] = acc;
                double e = fabs(b->gam[row_data_at(b, h, t)] - acc) / (1.0 + fabs(acc));
                if (e > worst || isnan(e)) worst = e;
            }
        }
    return worst;
}

/* qg = gam + ln rq, kg = gam - ln rk, rq and rk from the bf16 rows of the value head's key head; worst error */
static double check_qk(const batch_t *b, const double *ref_gam) {
    double worst = 0;
    for (int t = 0; t < b->rows; t++)
        for (int h = 0; h < HV; h++) {
            const uint16_t *src[2] = {b->hq, b->hk};
            const float *got[2] = {b->qg, b->kg};
            for (int which = 0; which < 2; which++) {
                const uint16_t *x = src[which] + ((size_t)t * H + h / (HV / H)) * KD;
                double ss = 0;
                for (int c = 0; c < KD; c++) ss += (double)from_bf16(x[c]) * from_bf16(x[c]);
                double ln_r = -0.5 * log(ss + 1e-6), base = ref_gam[row_data_at(b, h, t)];
                double want = which == 0 ? base + ln_r : base - ln_r;
                double e = fabs(got[which][row_data_at(b, h, t)] - want) / (1.0 + fabs(want));
                if (e > worst || isnan(e)) worst = e;
            }
        }
    return worst;
}

static void release(const gdn_aot_driver_t *d, batch_t *b) {
    CUdeviceptr bufs[] = {b->q, b->k, b->v, b->g, b->beta, b->cu_dev, b->w, b->u, b->gam_dev, b->qg_dev, b->kg_dev,
                          b->scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) d->MemFree(bufs[i]);
    void *host[] = {b->hq, b->hk, b->hv, b->hg, b->hb, b->gam, b->qg, b->kg};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++) free(host[i]);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "artifacts/sm_90a";
    tsv_row_t row;
    char path[1024];
    if (find_row(dir, "gdn_prepare", "bf16", 1, &row)) return 1;
    snprintf(path, sizeof path, "%s/%s", dir, row.cubin);
    void *image = read_file(path);
    if (!image) {
        perror(path);
        return 1;
    }
    CHECK(gdn_aot_init());
    const gdn_aot_driver_t *d = gdn_aot_driver();
    CUdevice dev;
    CUcontext ctx;
    CHECK(d->DeviceGet(&dev, 0));
    CHECK(d->DevicePrimaryCtxRetain(&ctx, dev));
    CHECK(d->CtxSetCurrent(ctx));
    gdn_aot_kernel_t kern;
    CHECK(gdn_aot_kernel_load(&kern, image, row.entry, row.num_warps, row.shared, row.scratch_size));

    batch_t b = {0};
    make_inputs(&b);
    if (upload(d, &b) || launch_and_download(d, &kern, &b)) return 1;
    double *ref_gam = malloc(b.ng * sizeof(double));
    double worst_gam = check_gam(&b, ref_gam), worst_qk = check_qk(&b, ref_gam);
    printf("%s: %d rows in %d sequences, worst gam error %.3g, worst qg / kg error %.3g\n", row.key, b.rows, NSEQ,
           worst_gam, worst_qk);

    CHECK(gdn_aot_kernel_unload(&kern));
    release(d, &b);
    d->DevicePrimaryCtxRelease(dev);
    free(ref_gam);
    free(image);
    if (!(worst_gam <= 1e-4) || !(worst_qk <= 1e-3)) {
        fprintf(stderr, "FAILED: gam, qg or kg do not match the host computation\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
