/* A fast chunked DCT for DisTrOAdamW's forward transform on the CPU (optional; distro_opt/native.py).
 *
 * For float32 matrices cut into 64 x 64 chunks it computes, in one pass per chunk,
 *     out = decay * old + scale * DCT2(g)   and the largest |out| of every run of 64 along a row,
 * where DCT2 is the orthonormal 2-D DCT-II of each chunk (scipy.fft.dctn(norm="ortho")), in the
 * tensor's own layout (coefficient (i mod 64, j mod 64) of chunk (i // 64, j // 64) at [i, j]).
 *
 * Why: as two dense 64 x 64 GEMMs the transform costs 2 x 64 multiply-adds per element, about as
 * long as torch's whole AdamW step on a CPU. Splitting each 1-D DCT-II(64) into its even and odd
 * halves (DCT-II(32) of x[n] + x[63-n], DCT-IV(32) of x[n] - x[63-n]), three times, leaves 22
 * multiply-adds per element per axis; each 1-D transform runs on 64 columns at once, so every
 * operation is a vector operation. The chunk stays in L1 between the axes (two transposes).
 *
 * Built by setup.py where a C compiler is found (it is optional: without it the library uses its
 * GEMM path). On x86-64 with GCC one copy is compiled per instruction set and the CPU picks one. */
#include <math.h>
#include <stddef.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define MULTIVERSION 1
#endif

#define C 64
#define ALIGNED __attribute__((aligned(64)))
typedef float v16 __attribute__((vector_size(64)));

static const float zeros[C];  /* the old momentum where there is none */
static struct {
    float c4_32[32][32], c4_16[16][16], c4_8[8][8], c2_8[8][8], scale[C];
} tables;

/* The DCT-IV / DCT-II matrices of the split, and the orthonormal scale of each coefficient */
static void init_tables(void) {
    const double pi = 3.14159265358979323846;
    for (int m = 0; m < 32; m++)
        for (int n = 0; n < 32; n++) tables.c4_32[m][n] = (float)cos(pi * (2 * n + 1) * (2 * m + 1) / 128.0);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) tables.c4_16[m][n] = (float)cos(pi * (2 * n + 1) * (2 * m + 1) / 64.0);
    for (int m = 0; m < 8; m++)
        for (int n = 0; n < 8; n++) {
            tables.c4_8[m][n] = (float)cos(pi * (2 * n + 1) * (2 * m + 1) / 32.0);
            tables.c2_8[m][n] = (float)cos(pi * (2 * n + 1) * m / 16.0);
        }
    for (int k = 0; k < C; k++) tables.scale[k] = (float)(sqrt(2.0 / C) * (k == 0 ? sqrt(0.5) : 1.0));
}

#ifdef MULTIVERSION
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw,avx2,fma")
#define NAME(x) x##_avx512
#include "fdct_body.h"
#undef NAME
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define NAME(x) x##_avx2
#include "fdct_body.h"
#undef NAME
#pragma GCC pop_options
#endif
#define NAME(x) x##_generic
#include "fdct_body.h"
#undef NAME

typedef void (*accumulate_fn)(const float *, const float *, float *, long, long, float, float, float *, int);
static accumulate_fn chosen;

/* Fill the tables and choose the copy to run: the best this CPU has, at most ``level`` (0 generic,
 * 1 AVX2, 2 AVX-512); returns the level chosen. Call it before the first fdct_accumulate. */
int fdct_init(int level) {
    init_tables();
    chosen = accumulate_generic;
#ifdef MULTIVERSION
    __builtin_cpu_init();
    if (level >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
        chosen = accumulate_avx512;
        return 2;
    }
    if (level >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        chosen = accumulate_avx2;
        return 1;
    }
#endif
    (void)level;
    return 0;
}

/* See the top of this file. rows and cols must be multiples of 64; peaks may be NULL. */
void fdct_accumulate(const float *g, const float *old, float *out, long rows, long cols, float decay,
                     float scale, float *peaks, int threads) {
    chosen(g, old, out, rows, cols, decay, scale, peaks, threads);
}
