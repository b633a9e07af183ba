/*
 * The factorized first layer's vector kernels (backend_cpu.c, "The factorized first layer"),
 * written once over a vector of 16 floats, `v16`, and included by backend_cpu.c once per
 * instruction set: AVX-512 (a v16 is one register) and AVX2 with FMA (two). Private to
 * backend_cpu.c, which defines before each inclusion:
 *   FV(name)    the instruction set's name for a kernel or helper (name_avx512, name_avx2)
 *   FV_TARGET   its target attribute
 *   FV_AVX512   1 for AVX-512, 0 for AVX2
 *   FV_NU_P     units a forward step of P interleaves
 *   FV_NU_G     units a backward step takes (their G columns, row gradients and dW_f terms)
 *   FV_ROWS     rows of dW_f a backward step keeps in registers
 *   FV_GCH      v16 accumulators of G a unit's gather fills at a time
 * The counts differ (AVX2 has 16 registers of 8 floats, AVX-512 32 of 16) but not what is
 * computed: every output element is the same chain of fused multiply-adds in the same order as
 * in the portable kernels, which only ever spread one chain's lanes over more or fewer
 * registers, so the three give the same bits (tests/train/threads_test.c runs them all).
 * The parameters are undefined at the end, ready for the next inclusion.
 * Without AVX2 kernels a CPU lacking AVX-512 (AMD Zen 1-3, most desktop Intel parts) ran the
 * portable kernels, whose fmaf is a libm call per multiply-add: ~50x slower steps.
 */

#if FV_AVX512
typedef __m512 FV(v16);

FV_TARGET static FACT_INLINE FV(v16) FV(vzero)(void)
{
    return _mm512_setzero_ps();
}
FV_TARGET static FACT_INLINE FV(v16) FV(vload)(const float *p)
{
    return _mm512_loadu_ps(p);
}
FV_TARGET static FACT_INLINE FV(v16) FV(vload_a)(const float *p)
{
    return _mm512_load_ps(p);
}
FV_TARGET static FACT_INLINE void FV(vstore)(float *p, FV(v16) a)
{
    _mm512_storeu_ps(p, a);
}
FV_TARGET static FACT_INLINE void FV(vstore_a)(float *p, FV(v16) a)
{
    _mm512_store_ps(p, a);
}
FV_TARGET static FACT_INLINE FV(v16) FV(vset1)(float f)
{
    return _mm512_set1_ps(f);
}
FV_TARGET static FACT_INLINE FV(v16) FV(vfma)(FV(v16) a, FV(v16) b, FV(v16) c)
{
    return _mm512_fmadd_ps(a, b, c);
}
/* a < 0 ? 0 : a, lane by lane (NaN passes, as in the portable kernel) */
FV_TARGET static FACT_INLINE FV(v16) FV(vrelu)(FV(v16) a)
{
    const __m512 zero = _mm512_setzero_ps();
    return _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), zero);
}
#else
typedef struct FV(v16) {
    __m256 lo, hi;
} FV(v16);

FV_TARGET static FACT_INLINE FV(v16) FV(vzero)(void)
{
    return (FV(v16)){_mm256_setzero_ps(), _mm256_setzero_ps()};
}
FV_TARGET static FACT_INLINE FV(v16) FV(vload)(const float *p)
{
    return (FV(v16)){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
FV_TARGET static FACT_INLINE FV(v16) FV(vload_a)(const float *p)
{
    return (FV(v16)){_mm256_load_ps(p), _mm256_load_ps(p + 8)};
}
FV_TARGET static FACT_INLINE void FV(vstore)(float *p, FV(v16) a)
{
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
FV_TARGET static FACT_INLINE void FV(vstore_a)(float *p, FV(v16) a)
{
    _mm256_store_ps(p, a.lo);
    _mm256_store_ps(p + 8, a.hi);
}
FV_TARGET static FACT_INLINE FV(v16) FV(vset1)(float f)
{
    const __m256 b = _mm256_set1_ps(f);
    return (FV(v16)){b, b};
}
FV_TARGET static FACT_INLINE FV(v16) FV(vfma)(FV(v16) a, FV(v16) b, FV(v16) c)
{
    return (FV(v16)){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
FV_TARGET static FACT_INLINE FV(v16) FV(vrelu)(FV(v16) a)
{
    const __m256 zero = _mm256_setzero_ps();
    return (FV(v16)){_mm256_blendv_ps(a.lo, zero, _mm256_cmp_ps(a.lo, zero, _CMP_LT_OQ)),
                     _mm256_blendv_ps(a.hi, zero, _mm256_cmp_ps(a.hi, zero, _CMP_LT_OQ))};
}
#endif

/* Units i..i+nu of field f's, all FACT_COLS columns of P's block: the units' chains
 * interleaved (one unit's 16 dependent FMAs at a time left the FMA units idle), and each
 * broadcast element of a unit's row serving all the block's columns. With one 16-column
 * vector at a time, W_f's 16 x 16 in registers, every FMA had a broadcast of its own and the
 * loads bound it; here W_f's rows come from L1, a load per FV_NU_P units (~30% less time
 * alone, AVX-512). */
FV_TARGET static FACT_INLINE void FV(fact_p_units)(const fact *x, const float *E, const float *w,
                                                   float *Pb, uint32_t i, const int nu)
{
    const float *e[FV_NU_P];
    FV(v16) a[FV_NU_P][FACT_NV];
#pragma GCC unroll 16
    for (int t = 0; t < nu; t++) {
        if (i + t + FACT_P_AHEAD < x->n_units)
            _mm_prefetch((const char *)(E + (size_t)x->unit_key[i + t + FACT_P_AHEAD] * 16),
                         _MM_HINT_T0);
        e[t] = E + (size_t)x->unit_key[i + t] * 16;
#pragma GCC unroll 4
        for (int v = 0; v < FACT_NV; v++)
            a[t][v] = FV(vzero)();
    }
#pragma GCC unroll 16
    for (int q = 0; q < 16; q++) {
        FV(v16) wq[FACT_NV];
#pragma GCC unroll 4
        for (int v = 0; v < FACT_NV; v++)
            wq[v] = FV(vload)(w + (size_t)q * FACT_COLS + 16 * v);
#pragma GCC unroll 16
        for (int t = 0; t < nu; t++) {
            FV(v16) eq = FV(vset1)(e[t][q]);
#pragma GCC unroll 4
            for (int v = 0; v < FACT_NV; v++)
                a[t][v] = FV(vfma)(eq, wq[v], a[t][v]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < nu; t++)
#pragma GCC unroll 4
        for (int v = 0; v < FACT_NV; v++)
            FV(vstore)(Pb + (size_t)(i + t) * FACT_COLS + 16 * v, a[t][v]);
}

/* fact_p_scalar for d 16 and wb FACT_COLS: field by field, FV_NU_P units at a time. */
FV_TARGET static void FV(fact_p)(const fact *x, const float *E, const float *w, float *Pb)
{
    for (uint32_t f = 0; f < x->F; f++) {
        const float *wf = w + (size_t)f * 16 * FACT_COLS;
        uint32_t i = x->field_ptr[f];
        for (; i + FV_NU_P <= x->field_ptr[f + 1]; i += FV_NU_P)
            FV(fact_p_units)(x, E, wf, Pb, i, FV_NU_P);
        for (; i < x->field_ptr[f + 1]; i++)
            FV(fact_p_units)(x, E, wf, Pb, i, 1);
    }
}

/* fact_y_scalar for d 16 and wb FACT_COLS. */
FV_TARGET static void FV(fact_y)(const fact *x, const model_batch *b, const float *bias,
                                 const float *w, const float *Pb, float *Y, uint32_t col0)
{
    const uint32_t F = x->F, D = x->D;
    const float *wd = w + (size_t)F * 16 * FACT_COLS;
    for (uint32_t s = 0; s < b->B; s++) {
        FV(v16) a[FACT_NV];
#pragma GCC unroll 16
        for (int v = 0; v < FACT_NV; v++)
            a[v] = FV(vload)(bias + col0 + 16 * v);
        for (uint32_t j = 0; j < D; j++) {
            FV(v16) xj = FV(vset1)(b->dense[(size_t)s * D + j]);
#pragma GCC unroll 16
            for (int v = 0; v < FACT_NV; v++)
                a[v] = FV(vfma)(xj, FV(vload)(wd + (size_t)j * FACT_COLS + 16 * v), a[v]);
        }
        for (uint32_t k = b->row_ptr[(size_t)s * F]; k < b->row_ptr[(size_t)(s + 1) * F]; k++) {
            FV(v16) vk = FV(vset1)(b->val[k]);
            const float *p = Pb + (size_t)x->ent_unit[k] * FACT_COLS;
#pragma GCC unroll 16
            for (int v = 0; v < FACT_NV; v++)
                a[v] = FV(vfma)(vk, FV(vload)(p + 16 * v), a[v]);
        }
        float *y = Y + (size_t)s * x->H + col0;
#pragma GCC unroll 16
        for (int v = 0; v < FACT_NV; v++)
            FV(vstore)(y + 16 * v, FV(vrelu)(a[v]));
    }
}

/* Unit un's G columns c0..c0+16 nv into gl (16 nv floats), FV_GCH x 16 columns at a time
 * (their accumulators fill the registers). A block of dY's columns stays in L2 while the units
 * gather from it; its rows, which the units' entries take from anywhere, are asked for
 * FACT_AHEAD entries ahead (entries of consecutive units follow each other, to eend). */
FV_TARGET static FACT_INLINE void FV(fact_g_unit)(const fact *x, const float *dY, uint32_t un,
                                                  uint32_t c0, uint32_t eend, float *gl,
                                                  const int nv)
{
    const uint32_t H = x->H;
#pragma GCC unroll 8
    for (int c = 0; c < nv; c += FV_GCH) {
        const int cv = nv - c < FV_GCH ? nv - c : FV_GCH;
        FV(v16) a[FV_GCH];
#pragma GCC unroll 8
        for (int v = 0; v < cv; v++)
            a[v] = FV(vzero)();
        for (uint32_t e = x->unit_ptr[un]; e < x->unit_ptr[un + 1]; e++) {
            if (e + FACT_AHEAD < eend) {
                const float *n = dY + (size_t)x->ue_s[e + FACT_AHEAD] * H + c0 + 16 * c;
#pragma GCC unroll 8
                for (int v = 0; v < cv; v++)
                    _mm_prefetch((const char *)(n + 16 * v), _MM_HINT_T0);
            }
            FV(v16) ve = FV(vset1)(x->ue_v[e]);
            const float *g = dY + (size_t)x->ue_s[e] * H + c0 + 16 * c;
#pragma GCC unroll 8
            for (int v = 0; v < cv; v++)
                a[v] = FV(vfma)(ve, FV(vload)(g + 16 * v), a[v]);
        }
#pragma GCC unroll 8
        for (int v = 0; v < cv; v++)
            FV(vstore_a)(gl + 16 * (c + v), a[v]);
    }
}

/* Units i..i+nu of field f: their G columns of block b (in L1 only, never stored), the block's
 * parts of their row gradients as a small GEMM, G (nu x gb) times W_f's rows (gb x 16): a row
 * of W_f, one v16, serves the nu units' chains; and their terms of dW_f's block rows, dw
 * (gb x 16, in L1), each row's chain taking the units in order. */
FV_TARGET static FACT_INLINE void FV(fact_gblk_units)(const fact *x, const float *dY,
                                                      const float *E, float *dw, uint32_t i,
                                                      uint32_t f, uint32_t b, uint32_t eend,
                                                      const int nu, const int nv)
{
    const uint32_t c0 = b * x->gb;
    _Alignas(64) float gl[FV_NU_G][256];
    /* The units' embedding rows, read after the gathers of G: asked for now, they arrive
     * meanwhile (they are anywhere in E; waiting for them was ~15% of this kernel). */
#pragma GCC unroll 8
    for (int t = 0; t < nu; t++)
        _mm_prefetch((const char *)(E + (size_t)x->unit_key[i + t] * 16), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int t = 0; t < nu; t++)
        FV(fact_g_unit)(x, dY, i + (uint32_t)t, c0, eend, gl[t], nv);
    FV(v16) acc[FV_NU_G], e[FV_NU_G];
#pragma GCC unroll 8
    for (int t = 0; t < nu; t++) {
        acc[t] = FV(vzero)();
        e[t] = FV(vload)(E + (size_t)x->unit_key[i + t] * 16);
    }
    const float *w = x->wf + ((size_t)f * x->H + c0) * 16;
    /* FV_ROWS rows of dW_f at a time: each row's chain is nu FMAs long, and rows side by side
     * keep the FMA units fed where one waited on its chain. */
    for (int h = 0; h < 16 * nv; h += FV_ROWS) {
        FV(v16) wh[FV_ROWS], dh[FV_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < FV_ROWS; r++) {
            wh[r] = FV(vload_a)(w + (size_t)(h + r) * 16);
            dh[r] = FV(vload_a)(dw + (size_t)(h + r) * 16);
        }
#pragma GCC unroll 8
        for (int t = 0; t < nu; t++)
#pragma GCC unroll 4
            for (int r = 0; r < FV_ROWS; r++) {
                FV(v16) g = FV(vset1)(gl[t][h + r]);
                acc[t] = FV(vfma)(g, wh[r], acc[t]);
                dh[r] = FV(vfma)(g, e[t], dh[r]);
            }
#pragma GCC unroll 4
        for (int r = 0; r < FV_ROWS; r++)
            FV(vstore_a)(dw + (size_t)(h + r) * 16, dh[r]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < nu; t++)
        FV(vstore)(x->dep + ((size_t)b * x->n_units + i + t) * 16, acc[t]);
}

/* fact_gblk_scalar for d 16, gb 16 nv (at most 256) and units u0..u1, all of field f: FV_NU_G
 * units at a time, dW_f's block rows summed in dw and then stored into W. */
FV_TARGET static FACT_INLINE void FV(fact_gblk_run)(const fact *x, const float *dY, const float *E,
                                                    float *W, uint32_t f, uint32_t b, const int nv)
{
    const uint32_t u0 = x->field_ptr[f], u1 = x->field_ptr[f + 1], eend = x->unit_ptr[u1];
    _Alignas(64) float dw[256 * 16];
#pragma GCC unroll 4
    for (int h = 0; h < 16 * nv; h++)
        FV(vstore_a)(dw + h * 16, FV(vzero)());
    uint32_t i = u0;
    for (; i + FV_NU_G <= u1; i += FV_NU_G)
        FV(fact_gblk_units)(x, dY, E, dw, i, f, b, eend, FV_NU_G, nv);
    for (; i < u1; i++)
        FV(fact_gblk_units)(x, dY, E, dw, i, f, b, eend, 1, nv);
    float *o = W + (size_t)b * x->gb * x->in + (size_t)f * 16;
#pragma GCC unroll 4
    for (int h = 0; h < 16 * nv; h++)
        FV(vstore)(o + (size_t)h * x->in, FV(vload_a)(dw + h * 16));
}

FV_TARGET static void FV(fact_gblk)(const fact *x, const float *dY, const float *E, float *W,
                                    uint32_t f, uint32_t b)
{
    switch (x->gb) { /* constant widths: the accumulators stay in registers */
    case 256:
        FV(fact_gblk_run)(x, dY, E, W, f, b, 16);
        break;
    case 128:
        FV(fact_gblk_run)(x, dY, E, W, f, b, 8);
        break;
    case 64:
        FV(fact_gblk_run)(x, dY, E, W, f, b, 4);
        break;
    default:
        FV(fact_gblk_run)(x, dY, E, W, f, b, FACT_NV);
        break;
    }
}

#undef FV
#undef FV_TARGET
#undef FV_AVX512
#undef FV_NU_P
#undef FV_NU_G
#undef FV_ROWS
#undef FV_GCH
