/* The body of the fast chunked DCT, included once per instruction set by fdct.c with NAME(x)
 * defined to give that copy's function names. See fdct.c for what it computes and why. */

/* y[k][:] = sum_n M[k][n] x[n][:] for k < K (a multiple of 4), rows of 64 floats; row k of the
 * result goes to y + k * ostep * 64 (ostep spreads the rows of one parity class of the output). */
static void NAME(small_gemm)(int K, int Nn, const float *M, const float *x, float *y, int ostep) {
#if !defined(__AVX512F__)  /* 64-byte vectors would be split element by element: let GCC vectorize */
    for (int k = 0; k < K; k += 4) {
        float acc[4][C] ALIGNED = {{0}};
        for (int n = 0; n < Nn; n++) {
            const float *xr = x + n * C;
            float m0 = M[(k + 0) * Nn + n], m1 = M[(k + 1) * Nn + n];
            float m2 = M[(k + 2) * Nn + n], m3 = M[(k + 3) * Nn + n];
            for (int j = 0; j < C; j++) {
                float value = xr[j];
                acc[0][j] += m0 * value; acc[1][j] += m1 * value;
                acc[2][j] += m2 * value; acc[3][j] += m3 * value;
            }
        }
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < C; j++) y[(size_t)(k + r) * ostep * C + j] = acc[r][j];
    }
#else
    const v16 *X = (const v16 *)x;
    for (int k = 0; k < K; k += 4) {
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        v16 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, d0 = {0}, d1 = {0}, d2 = {0}, d3 = {0};
        for (int n = 0; n < Nn; n++) {
            v16 x0 = X[4 * n], x1 = X[4 * n + 1], x2 = X[4 * n + 2], x3 = X[4 * n + 3];
            float m0 = M[(k + 0) * Nn + n], m1 = M[(k + 1) * Nn + n];
            float m2 = M[(k + 2) * Nn + n], m3 = M[(k + 3) * Nn + n];
            a0 += m0 * x0; a1 += m0 * x1; a2 += m0 * x2; a3 += m0 * x3;
            b0 += m1 * x0; b1 += m1 * x1; b2 += m1 * x2; b3 += m1 * x3;
            c0 += m2 * x0; c1 += m2 * x1; c2 += m2 * x2; c3 += m2 * x3;
            d0 += m3 * x0; d1 += m3 * x1; d2 += m3 * x2; d3 += m3 * x3;
        }
        v16 *y0 = (v16 *)(y + (size_t)(k + 0) * ostep * C), *y1 = (v16 *)(y + (size_t)(k + 1) * ostep * C);
        v16 *y2 = (v16 *)(y + (size_t)(k + 2) * ostep * C), *y3 = (v16 *)(y + (size_t)(k + 3) * ostep * C);
        y0[0] = a0; y0[1] = a1; y0[2] = a2; y0[3] = a3; y1[0] = b0; y1[1] = b1; y1[2] = b2; y1[3] = b3;
        y2[0] = c0; y2[1] = c1; y2[2] = c2; y2[3] = c3; y3[0] = d0; y3[1] = d1; y3[2] = d2; y3[3] = d3;
    }
#endif
}

/* Unnormalized DCT-II along the first axis of a 64 x 64 block x (row stride ldx) into y (64 x 64):
 * X[2m] is the DCT-II(32) of u = x[n] + x[63-n], X[2m+1] the DCT-IV(32) of v = x[n] - x[63-n];
 * the DCT-II(32) splits again, down to DCT-II(8). */
static void NAME(dct64_cols)(const float *x, int ldx, float *y) {
    float u[32][C] ALIGNED, v[32][C] ALIGNED, u2[16][C] ALIGNED, v2[16][C] ALIGNED;
    float u3[8][C] ALIGNED, v3[8][C] ALIGNED;
    for (int n = 0; n < 32; n++) {
        const float *a = x + (size_t)n * ldx, *b = x + (size_t)(63 - n) * ldx;
        for (int j = 0; j < C; j++) { u[n][j] = a[j] + b[j]; v[n][j] = a[j] - b[j]; }
    }
    NAME(small_gemm)(32, 32, &tables.c4_32[0][0], &v[0][0], y + C, 2);          /* k = 2m + 1 */
    for (int n = 0; n < 16; n++)
        for (int j = 0; j < C; j++) { u2[n][j] = u[n][j] + u[31 - n][j]; v2[n][j] = u[n][j] - u[31 - n][j]; }
    NAME(small_gemm)(16, 16, &tables.c4_16[0][0], &v2[0][0], y + 2 * C, 4);     /* k = 4m + 2 */
    for (int n = 0; n < 8; n++)
        for (int j = 0; j < C; j++) {
            u3[n][j] = u2[n][j] + u2[15 - n][j];
            v3[n][j] = u2[n][j] - u2[15 - n][j];
        }
    NAME(small_gemm)(8, 8, &tables.c4_8[0][0], &v3[0][0], y + 4 * C, 8);        /* k = 8m + 4 */
    NAME(small_gemm)(8, 8, &tables.c2_8[0][0], &u3[0][0], y, 8);                /* k = 8m */
}

/* b = a^T for 64 x 64 blocks held contiguously */
static void NAME(transpose64)(const float *a, float *b) {
#if defined(__AVX512F__)
    for (int i = 0; i < C; i += 16)
        for (int j = 0; j < C; j += 16) {
            __m512 r[16], t[16];
            for (int q = 0; q < 16; q++) r[q] = _mm512_loadu_ps(a + (i + q) * C + j);
            for (int q = 0; q < 16; q += 2) {
                t[q] = _mm512_unpacklo_ps(r[q], r[q + 1]);
                t[q + 1] = _mm512_unpackhi_ps(r[q], r[q + 1]);
            }
            for (int q = 0; q < 16; q += 4) {
                __m512d e = _mm512_castps_pd(t[q]), f = _mm512_castps_pd(t[q + 2]);
                __m512d g = _mm512_castps_pd(t[q + 1]), h = _mm512_castps_pd(t[q + 3]);
                r[q] = _mm512_castpd_ps(_mm512_unpacklo_pd(e, f));
                r[q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(e, f));
                r[q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(g, h));
                r[q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(g, h));
            }
            for (int q = 0; q < 4; q += 2)
                for (int c = 0; c < 4; c++) {
                    t[4 * q + c] = _mm512_shuffle_f32x4(r[4 * q + c], r[4 * (q + 1) + c], 0x88);
                    t[4 * (q + 1) + c] = _mm512_shuffle_f32x4(r[4 * q + c], r[4 * (q + 1) + c], 0xdd);
                }
            for (int c = 0; c < 4; c++) {
                float *o = b + j * C + i;
                _mm512_storeu_ps(o + c * C, _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88));
                _mm512_storeu_ps(o + (c + 8) * C, _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd));
                _mm512_storeu_ps(o + (c + 4) * C, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88));
                _mm512_storeu_ps(o + (c + 12) * C, _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd));
            }
        }
#else
    for (int i = 0; i < C; i += 8)
        for (int j = 0; j < C; j += 8)
            for (int ii = i; ii < i + 8; ii++)
                for (int jj = j; jj < j + 8; jj++) b[jj * C + ii] = a[ii * C + jj];
#endif
}

/* out = decay * old + scale * DCT(g) for every 64 x 64 chunk of the rows x cols matrix g (row-major;
 * out and old in the same layout; old NULL: zeros), and the largest |out| of each run of 64 along a
 * row into peaks (one per run, in out's order; NULL: none; NaN where the run holds one). Chunks are
 * independent: any thread count gives the same bits. */
static void NAME(accumulate)(const float *g, const float *old, float *out, long rows, long cols,
                             float decay, float scale, float *peaks, int threads) {
    long br = rows / C, bc = cols / C;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads)
#endif
    for (long b = 0; b < br * bc; b++) {
        float t1[C * C] ALIGNED, t2[C * C] ALIGNED;
        long bi = b / bc, bj = b % bc;
        size_t base = (size_t)bi * C * cols + (size_t)bj * C;
        NAME(dct64_cols)(g + base, (int)cols, t1);   /* t1[k1][j] */
        NAME(transpose64)(t1, t2);                   /* t2[j][k1] */
        NAME(dct64_cols)(t2, C, t1);                 /* t1[k2][k1] */
        NAME(transpose64)(t1, t2);                   /* t2[k1][k2] */
        for (int k1 = 0; k1 < C; k1++) {
            const float *o = old ? old + base + (size_t)k1 * cols : zeros, *t = t2 + k1 * C;
            float *w = out + base + (size_t)k1 * cols, s1 = tables.scale[k1] * scale, m = 0.f;
            int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
            for (int k2 = 0; k2 < C; k2++) {
                float value = decay * o[k2] + s1 * tables.scale[k2] * t[k2];
                float a = fabsf(value);
                w[k2] = value;
                m = m > a ? m : a;
                nan |= value != value;
            }
            if (peaks) peaks[(size_t)(bi * C + k1) * bc + bj] = nan ? NAN : m;  /* the top-k must see a NaN */
        }
    }
    (void)threads;
}
