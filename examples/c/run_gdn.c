/* run_gdn.c: use gdn-aot artifacts from C with nothing but the generated header and launcher library.
 *
 * Finds the bf16 gdn_l2norm variant in ARTIFACTS/<arch>/kernels.tsv, loads its cubin with gdn_aot_kernel_load,
 * launches it on 1000 rows x 128 through gdn_aot_launch_gdn_l2norm and checks every output row has unit norm.
 * The driver is reached only through the launcher (gdn_aot_driver()), which dlopens libcuda.so.1.
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

#define D 128
#define ROWS 1000

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
    char key[256], kernel[64], entry[128], cubin[256];
    unsigned num_warps, shared, scratch_size, scratch_align;
} tsv_row_t;

/* The first kernels.tsv row of `kernel` whose key contains `want`. */
static int find_row(const char *dir, const char *kernel, const char *want, tsv_row_t *row) {
    char path[1024], line[2048];
    snprintf(path, sizeof path, "%s/kernels.tsv", dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        perror(path);
        return -1;
    }
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#') continue;
        if (sscanf(line, "%255[^\t]\t%63[^\t]\t%127[^\t]\t%255[^\t]\t%u\t%u\t%u\t%u", row->key, row->kernel,
                   row->entry, row->cubin, &row->num_warps, &row->shared, &row->scratch_size,
                   &row->scratch_align) == 8 &&
            strcmp(row->kernel, kernel) == 0 && strstr(row->key, want)) {
            fclose(f);
            return 0;
        }
    }
    fclose(f);
    fprintf(stderr, "no %s variant matching '%s' in %s\n", kernel, want, path);
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

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "artifacts/sm_90a";
    tsv_row_t row;
    char path[1024];
    if (find_row(dir, "gdn_l2norm", ".bf16.", &row)) return 1;
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

    static uint16_t hx[ROWS * D], hy[ROWS * D];
    for (int i = 0; i < ROWS * D; i++) hx[i] = to_bf16((float)((i * 7919) % 201 - 100) / 37.0f);
    CUdeviceptr x, y;
    CHECK(d->MemAlloc(&x, sizeof hx));
    CHECK(d->MemAlloc(&y, sizeof hy));
    CHECK(d->MemcpyHtoD(x, hx, sizeof hx));
    CHECK(gdn_aot_launch_gdn_l2norm(&kern, NULL, (ROWS + 63) / 64, 1, 1, x, y, ROWS, 0));
    CHECK(d->CtxSynchronize());
    CHECK(d->MemcpyDtoH(hy, y, sizeof hy));

    double worst = 0;
    for (int r = 0; r < ROWS; r++) {
        double s = 0;
        for (int c = 0; c < D; c++) s += (double)from_bf16(hy[r * D + c]) * from_bf16(hy[r * D + c]);
        worst = fmax(worst, fabs(sqrt(s) - 1.0));
    }
    printf("%s: %d rows, worst |norm - 1| = %.3g\n", row.key, ROWS, worst);
    CHECK(gdn_aot_kernel_unload(&kern));
    d->MemFree(x);
    d->MemFree(y);
    d->DevicePrimaryCtxRelease(dev);
    free(image);
    if (worst > 2e-2) {
        fprintf(stderr, "FAILED: output rows are not unit norm\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
