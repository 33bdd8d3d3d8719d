/* Body of the paged attention item kernel, included once per (path, pool
 * dtype) by attention_kernels.c. Not a header of its own: no include guard.
 *
 * The including file defines:
 *   PKV_TARGET   function attributes of the path (empty for portable C)
 *   PKV_SUFFIX   name suffix, e.g. avx2_f16
 *   KV_T         pool element type (float or uint16_t)
 *   KV_TO_F(x)   one pool element -> float
 * and optionally, for rows that are not D plain elements (page_formats.h):
 *   KV_ROW(D)    pool elements (KV_T) per head row; default D
 *   KV_LOAD(row, d) KV_SLOAD(row, d)  VW (SW) float values d, d + 1, ... of
 *                the head row at row (d a multiple of the width), decoded
 *                with their scale; may read the variable dim (head_dim)
 *   KV_GET(row, d)  value d of the row as float, decoded the same way
 *   KV_ADDR(row, d) address holding value d (prefetch)
 *   KV_VSCALE(row)  optional: the one scale of a V row, folded into p; then
 *                KV_VLOAD(row, d) and KV_VGET(row, d) read V values without it
 *   KV_LINE_ELEMS   values per 64-byte line
 *   KV_ROTATED   1: rows hold R x (page_formats.h): q is rotated once and
 *                the output rotated back; default 0
 *   KV_INT_DOT   1: int8 rows scored with integer dot products against the
 *                query quantized per row (pkv_quantize_query), with
 *                KV_INT_DOT_4X4(qb, q_stride, k, pf, dim, s, s_stride) and
 *                KV_INT_DOT_1X4(qb, k, dim, s): exact integer sums, as float,
 *                of 4 (or 1) quantized rows against the 4 key rows k[0..3];
 *                KV_KSCALE(row) the key row's scale; default 0
 *   KV_CHUNK     tokens per chunk (<= PKV_CHUNK_TOKENS, a multiple of 16):
 *                smaller for float32, whose rows are twice as many bytes
 *   KV_TOUCH_AHEAD 1: decode items read the next chunk's rows with plain
 *                loads (see PKV_TOUCH_MAX_BYTES); default 0: prefetch hints
 *   vf, VW       vector type of VW float32 lanes
 *   VZERO() VSET1(x) VLOAD(p) VSTORE(p, v) VLOAD_KV(p)
 *   VADD VSUB VMAX VFMA(a, b, c) = a * b + c, VMULS(v, x) = v * x
 *   VEXP2(x)     2**x lane-wise for x <= 0, exactly 0 where x < -126 or -inf,
 *                NaN where x is NaN
 *   VTANH(x)     tanh lane-wise (the softcap), NaN where x is NaN, +-1 at +-inf
 *   VHSUM(v) VHMAX(v)   horizontal sum / max, fixed order
 *   VHSUM8(a0, ..., a7, out)  out[i] = horizontal sum of ai, fixed order
 *   VHSUM4X4(a00, ..., a33, s, stride)  (with PKV_DOT_WIDE) s[i * stride + j]
 *                = horizontal sum of aij, the order of VHSUM8
 *   sf, SW, SZERO SLOAD SLOAD_KV SFMA SKEEP SHSUM4X4  optional (with
 *                PKV_DOT_WIDE): the vectors of the 4x4 score block, if not
 *                vf and its macros (see dot_4x4); undefined at the end
 *   PKV_PV_WIDE  1: the V accumulation keeps 16 vectors in registers
 *   PKV_DOT_WIDE 1: scores 4 rows x 4 tokens at once (16 accumulators)
 *   VKEEP(v)     keeps a loaded vector in a register (not refolded into
 *                every FMA as a memory operand), or nothing
 *
 * Algorithm: one pass over the pages with the online softmax of
 * FlashAttention (Dao et al. 2022; Milakov & Gimelshein 2018): tokens are
 * scored in chunks of KV_CHUNK tokens, each chunk updates every row's running
 * max m and running sum l, rescales its accumulator once, then adds the
 * chunk's probability-weighted V rows. Scores live in the log2 domain (q is
 * pre-scaled by scale * log2(e)) so that the exponentials are exp2.
 *
 * Softcap (Gemma 2): q is pre-scaled by scale / softcap instead, and each
 * chunk's scores x become softcap * log2(e) * tanh(x) before the mask.
 * Sink logits (gpt-oss) join the denominator once, when a row is finished.
 *
 * Non-finite values give what dense softmax attention over the admitted keys
 * gives: a NaN or +inf score among a row's admitted keys makes its output and
 * LSE NaN, -inf scores weigh 0, and inf or NaN in V reach the output through
 * the weighted sum. Keys the mask excludes take no part, whatever they hold.
 * The softcap's tanh makes +-inf scores finite (only NaN stays); a finite
 * sink logit keeps a row with no positive sum finite (its keys weigh 0).
 */

#ifndef KV_ROW
#define KV_ROW(D) (D)
#endif
#ifndef KV_LOAD
#define KV_LOAD(row, d) VLOAD_KV((row) + (d))
#define KV_GET(row, d) KV_TO_F((row)[d])
#define KV_ADDR(row, d) ((row) + (d))
#endif
/* V rows for p @ V: values without the row's scale, the scale folded into p */
#ifndef KV_VSCALE
#define KV_VLOAD(row, d) KV_LOAD(row, d)
#define KV_VGET(row, d) KV_GET(row, d)
#endif
/* prefetch of the end of a row that holds its scale, past the values */
#ifndef KV_PF_TAIL
#define KV_PF_TAIL(row) ((void)(row))
#endif
#ifndef KV_LINE_ELEMS
#define KV_LINE_ELEMS (64 / (int64_t)sizeof(KV_T))
#endif
#ifndef KV_ROTATED
#define KV_ROTATED 0
#endif
#ifndef KV_INT_DOT
#define KV_INT_DOT 0
#endif
#ifndef KV_TOUCH_AHEAD
#define KV_TOUCH_AHEAD 0
#endif

#define PKV_CAT2_(a, b) a##_##b
#define PKV_CAT_(a, b) PKV_CAT2_(a, b)
#define FN(name) PKV_CAT_(name, PKV_SUFFIX)

/* 1 if element d of a row (d a multiple of the vector width) is a multiple
 * of 64 bytes from the row start: prefetches go out once per 64 bytes, not
 * once per vector. Rows that are not line-aligned, or whose scalar tail
 * spills into one more line, leave that line to a demand miss. */
#define PF_AT(d) (((d) & (KV_LINE_ELEMS - 1)) == 0)

/* Scores of 4 query rows (stride q_stride) against 2 key rows k[0..1];
 * prefetches the rows pf[0..1] (of a later chunk) unless pf is NULL. */
PKV_TARGET static inline void FN(dot_4x2)(const float *q, int64_t q_stride,
                                          const KV_T *const *k, const KV_T *const *pf,
                                          int64_t dim, int64_t dim_vec,
                                          float *s, int64_t s_stride)
{
    vf a00 = VZERO(), a01 = VZERO(), a10 = VZERO(), a11 = VZERO();
    vf a20 = VZERO(), a21 = VZERO(), a30 = VZERO(), a31 = VZERO();
    const float *q0 = q, *q1 = q + q_stride, *q2 = q + 2 * q_stride, *q3 = q + 3 * q_stride;
    const KV_T *k0 = k[0], *k1 = k[1];
    float r[8];
    int64_t d;
    for (d = 0; d < dim_vec; d += VW) {
        if (pf != NULL && PF_AT(d)) {
            PKV_PREFETCH(KV_ADDR(pf[0], d));
            PKV_PREFETCH(KV_ADDR(pf[1], d));
        }
        const vf x0 = KV_LOAD(k0, d);
        const vf x1 = KV_LOAD(k1, d);
        vf w = VLOAD(q0 + d);
        VKEEP(w);
        a00 = VFMA(w, x0, a00);
        a01 = VFMA(w, x1, a01);
        w = VLOAD(q1 + d);
        VKEEP(w);
        a10 = VFMA(w, x0, a10);
        a11 = VFMA(w, x1, a11);
        w = VLOAD(q2 + d);
        VKEEP(w);
        a20 = VFMA(w, x0, a20);
        a21 = VFMA(w, x1, a21);
        w = VLOAD(q3 + d);
        VKEEP(w);
        a30 = VFMA(w, x0, a30);
        a31 = VFMA(w, x1, a31);
    }
    if (pf != NULL) {
        KV_PF_TAIL(pf[0]);
        KV_PF_TAIL(pf[1]);
    }
    VHSUM8(a00, a01, a10, a11, a20, a21, a30, a31, r);
    for (; d < dim; d++) {
        const float x0 = KV_GET(k0, d), x1 = KV_GET(k1, d);
        r[0] += q0[d] * x0; r[1] += q0[d] * x1;
        r[2] += q1[d] * x0; r[3] += q1[d] * x1;
        r[4] += q2[d] * x0; r[5] += q2[d] * x1;
        r[6] += q3[d] * x0; r[7] += q3[d] * x1;
    }
    s[0] = r[0]; s[1] = r[1];
    s[s_stride] = r[2]; s[s_stride + 1] = r[3];
    s[2 * s_stride] = r[4]; s[2 * s_stride + 1] = r[5];
    s[3 * s_stride] = r[6]; s[3 * s_stride + 1] = r[7];
}

#if PKV_DOT_WIDE
/* Score vectors: the main vectors unless the including file chose others. */
#ifndef SW
#define PKV_SCORE_VECTORS_DEFAULT 1
#define sf vf
#define SW VW
#define SZERO() VZERO()
#define SLOAD(p) VLOAD(p)
#define KV_SLOAD(row, d) KV_LOAD(row, d)
#define SFMA(a, b, c) VFMA(a, b, c)
#define SKEEP(v) VKEEP(v)
#define SHSUM4X4 VHSUM4X4
#endif

/* Scores of 4 query rows against 4 key rows: 16 accumulators, so each q and
 * K load feeds 4 FMAs (needs 32 vector registers). The vectors are the score
 * vectors sf of SW lanes; dim_vec is a multiple of SW. Prefetches the rows
 * pf[0..3] (of a later chunk) unless pf is NULL. */
PKV_TARGET static inline void FN(dot_4x4)(const float *q, int64_t q_stride,
                                          const KV_T *const *k, const KV_T *const *pf,
                                          int64_t dim, int64_t dim_vec,
                                          float *s, int64_t s_stride)
{
    sf a00 = SZERO(), a01 = SZERO(), a02 = SZERO(), a03 = SZERO();
    sf a10 = SZERO(), a11 = SZERO(), a12 = SZERO(), a13 = SZERO();
    sf a20 = SZERO(), a21 = SZERO(), a22 = SZERO(), a23 = SZERO();
    sf a30 = SZERO(), a31 = SZERO(), a32 = SZERO(), a33 = SZERO();
    const float *q0 = q, *q1 = q + q_stride, *q2 = q + 2 * q_stride, *q3 = q + 3 * q_stride;
    const KV_T *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
    int64_t d, i;
    for (d = 0; d < dim_vec; d += SW) {
        if (pf != NULL && PF_AT(d)) {
            PKV_PREFETCH(KV_ADDR(pf[0], d)); PKV_PREFETCH(KV_ADDR(pf[1], d));
            PKV_PREFETCH(KV_ADDR(pf[2], d)); PKV_PREFETCH(KV_ADDR(pf[3], d));
        }
        const sf x0 = KV_SLOAD(k0, d), x1 = KV_SLOAD(k1, d);
        const sf x2 = KV_SLOAD(k2, d), x3 = KV_SLOAD(k3, d);
        sf w = SLOAD(q0 + d);
        SKEEP(w);
        a00 = SFMA(w, x0, a00); a01 = SFMA(w, x1, a01); a02 = SFMA(w, x2, a02); a03 = SFMA(w, x3, a03);
        w = SLOAD(q1 + d);
        SKEEP(w);
        a10 = SFMA(w, x0, a10); a11 = SFMA(w, x1, a11); a12 = SFMA(w, x2, a12); a13 = SFMA(w, x3, a13);
        w = SLOAD(q2 + d);
        SKEEP(w);
        a20 = SFMA(w, x0, a20); a21 = SFMA(w, x1, a21); a22 = SFMA(w, x2, a22); a23 = SFMA(w, x3, a23);
        w = SLOAD(q3 + d);
        SKEEP(w);
        a30 = SFMA(w, x0, a30); a31 = SFMA(w, x1, a31); a32 = SFMA(w, x2, a32); a33 = SFMA(w, x3, a33);
    }
    if (pf != NULL)
        for (i = 0; i < 4; i++)
            KV_PF_TAIL(pf[i]);
    SHSUM4X4(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33,
             s, s_stride);
    for (; d < dim; d++) {
        for (i = 0; i < 4; i++) {
            const float x = KV_GET(k[i], d);
            s[i] += q0[d] * x;
            s[s_stride + i] += q1[d] * x;
            s[2 * s_stride + i] += q2[d] * x;
            s[3 * s_stride + i] += q3[d] * x;
        }
    }
}
#endif

/* Scores of 1 query row against 8 key rows k[0..7]; prefetches the rows
 * pf[0..7] unless pf is NULL. */
PKV_TARGET static inline void FN(dot_1x8)(const float *q, const KV_T *const *k,
                                          const KV_T *const *pf,
                                          int64_t dim, int64_t dim_vec, float *s)
{
    vf a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
    vf a4 = VZERO(), a5 = VZERO(), a6 = VZERO(), a7 = VZERO();
    int64_t d, i;
    for (d = 0; d < dim_vec; d += VW) {
        if (pf != NULL && PF_AT(d))
            for (i = 0; i < 8; i++)
                PKV_PREFETCH(KV_ADDR(pf[i], d));
        const vf w = VLOAD(q + d);
        a0 = VFMA(w, KV_LOAD(k[0], d), a0);
        a1 = VFMA(w, KV_LOAD(k[1], d), a1);
        a2 = VFMA(w, KV_LOAD(k[2], d), a2);
        a3 = VFMA(w, KV_LOAD(k[3], d), a3);
        a4 = VFMA(w, KV_LOAD(k[4], d), a4);
        a5 = VFMA(w, KV_LOAD(k[5], d), a5);
        a6 = VFMA(w, KV_LOAD(k[6], d), a6);
        a7 = VFMA(w, KV_LOAD(k[7], d), a7);
    }
    if (pf != NULL)
        for (i = 0; i < 8; i++)
            KV_PF_TAIL(pf[i]);
    VHSUM8(a0, a1, a2, a3, a4, a5, a6, a7, s);
    for (; d < dim; d++)
        for (i = 0; i < 8; i++)
            s[i] += q[d] * KV_GET(k[i], d);
}

/* Prefetch of the part [d, d + width) of a later chunk's V row for token t,
 * one hint per 64-byte line, when pf_rows is not NULL. */
#define PF_V(pf_rows, t, head_offset, d, width)                                   \
    do {                                                                        \
        if ((pf_rows) != NULL) {                                                \
            const KV_T *pv_ = (pf_rows)[t] + (head_offset);                     \
            int64_t o_;                                                         \
            for (o_ = (d); o_ < (d) + (width); o_ += VW)                        \
                if (PF_AT(o_))                                                  \
                    PKV_PREFETCH(KV_ADDR(pv_, o_));                             \
            if ((d) == 0)                                                       \
                KV_PF_TAIL(pv_);                                                \
        }                                                                       \
    } while (0)

/* acc[4 rows] += sum_t p[row][t] * v_t, rows at stride acc_stride / p_stride;
 * prefetches the V rows pf_rows[t] (of a later chunk) unless pf_rows is NULL. */
PKV_TARGET static inline void FN(pv_4rows)(float *acc, int64_t acc_stride,
                                           const float *p, int64_t p_stride,
                                           const KV_T *const *v_rows,
                                           const KV_T *const *pf_rows, int64_t head_offset,
                                           int64_t num_tokens, int64_t dim, int64_t dim_vec)
{
    float *c0 = acc, *c1 = acc + acc_stride, *c2 = acc + 2 * acc_stride, *c3 = acc + 3 * acc_stride;
    const float *p0 = p, *p1 = p + p_stride, *p2 = p + 2 * p_stride, *p3 = p + 3 * p_stride;
    int64_t d = 0, t;
#if PKV_PV_WIDE
    /* 16 accumulators: 4 rows x 4 vectors, each V load feeds 4 FMAs. */
    for (; d + 4 * VW <= dim_vec; d += 4 * VW) {
        vf a00 = VLOAD(c0 + d), a01 = VLOAD(c0 + d + VW), a02 = VLOAD(c0 + d + 2 * VW), a03 = VLOAD(c0 + d + 3 * VW);
        vf a10 = VLOAD(c1 + d), a11 = VLOAD(c1 + d + VW), a12 = VLOAD(c1 + d + 2 * VW), a13 = VLOAD(c1 + d + 3 * VW);
        vf a20 = VLOAD(c2 + d), a21 = VLOAD(c2 + d + VW), a22 = VLOAD(c2 + d + 2 * VW), a23 = VLOAD(c2 + d + 3 * VW);
        vf a30 = VLOAD(c3 + d), a31 = VLOAD(c3 + d + VW), a32 = VLOAD(c3 + d + 2 * VW), a33 = VLOAD(c3 + d + 3 * VW);
        for (t = 0; t < num_tokens; t++) {
            const KV_T *v = v_rows[t] + head_offset;
            PF_V(pf_rows, t, head_offset, d, 4 * VW);
            const vf x0 = KV_VLOAD(v, d), x1 = KV_VLOAD(v, d + VW);
            const vf x2 = KV_VLOAD(v, d + 2 * VW), x3 = KV_VLOAD(v, d + 3 * VW);
            vf w = VSET1(p0[t]);
            a00 = VFMA(w, x0, a00); a01 = VFMA(w, x1, a01); a02 = VFMA(w, x2, a02); a03 = VFMA(w, x3, a03);
            w = VSET1(p1[t]);
            a10 = VFMA(w, x0, a10); a11 = VFMA(w, x1, a11); a12 = VFMA(w, x2, a12); a13 = VFMA(w, x3, a13);
            w = VSET1(p2[t]);
            a20 = VFMA(w, x0, a20); a21 = VFMA(w, x1, a21); a22 = VFMA(w, x2, a22); a23 = VFMA(w, x3, a23);
            w = VSET1(p3[t]);
            a30 = VFMA(w, x0, a30); a31 = VFMA(w, x1, a31); a32 = VFMA(w, x2, a32); a33 = VFMA(w, x3, a33);
        }
        VSTORE(c0 + d, a00); VSTORE(c0 + d + VW, a01); VSTORE(c0 + d + 2 * VW, a02); VSTORE(c0 + d + 3 * VW, a03);
        VSTORE(c1 + d, a10); VSTORE(c1 + d + VW, a11); VSTORE(c1 + d + 2 * VW, a12); VSTORE(c1 + d + 3 * VW, a13);
        VSTORE(c2 + d, a20); VSTORE(c2 + d + VW, a21); VSTORE(c2 + d + 2 * VW, a22); VSTORE(c2 + d + 3 * VW, a23);
        VSTORE(c3 + d, a30); VSTORE(c3 + d + VW, a31); VSTORE(c3 + d + 2 * VW, a32); VSTORE(c3 + d + 3 * VW, a33);
    }
#endif
    for (; d + 2 * VW <= dim_vec; d += 2 * VW) {
        vf a00 = VLOAD(c0 + d), a01 = VLOAD(c0 + d + VW);
        vf a10 = VLOAD(c1 + d), a11 = VLOAD(c1 + d + VW);
        vf a20 = VLOAD(c2 + d), a21 = VLOAD(c2 + d + VW);
        vf a30 = VLOAD(c3 + d), a31 = VLOAD(c3 + d + VW);
        for (t = 0; t < num_tokens; t++) {
            PF_V(pf_rows, t, head_offset, d, 2 * VW);
            vf x0 = KV_VLOAD(v_rows[t] + head_offset, d);
            vf x1 = KV_VLOAD(v_rows[t] + head_offset, d + VW);
            vf w = VSET1(p0[t]);
            a00 = VFMA(w, x0, a00); a01 = VFMA(w, x1, a01);
            w = VSET1(p1[t]);
            a10 = VFMA(w, x0, a10); a11 = VFMA(w, x1, a11);
            w = VSET1(p2[t]);
            a20 = VFMA(w, x0, a20); a21 = VFMA(w, x1, a21);
            w = VSET1(p3[t]);
            a30 = VFMA(w, x0, a30); a31 = VFMA(w, x1, a31);
        }
        VSTORE(c0 + d, a00); VSTORE(c0 + d + VW, a01);
        VSTORE(c1 + d, a10); VSTORE(c1 + d + VW, a11);
        VSTORE(c2 + d, a20); VSTORE(c2 + d + VW, a21);
        VSTORE(c3 + d, a30); VSTORE(c3 + d + VW, a31);
    }
    for (; d < dim_vec; d += VW) {
        vf a0 = VLOAD(c0 + d), a1 = VLOAD(c1 + d), a2 = VLOAD(c2 + d), a3 = VLOAD(c3 + d);
        for (t = 0; t < num_tokens; t++) {
            PF_V(pf_rows, t, head_offset, d, VW);
            vf x = KV_VLOAD(v_rows[t] + head_offset, d);
            a0 = VFMA(VSET1(p0[t]), x, a0);
            a1 = VFMA(VSET1(p1[t]), x, a1);
            a2 = VFMA(VSET1(p2[t]), x, a2);
            a3 = VFMA(VSET1(p3[t]), x, a3);
        }
        VSTORE(c0 + d, a0); VSTORE(c1 + d, a1); VSTORE(c2 + d, a2); VSTORE(c3 + d, a3);
    }
    for (; d < dim; d++) {
        for (t = 0; t < num_tokens; t++) {
            float x = KV_VGET(v_rows[t] + head_offset, d);
            c0[d] += p0[t] * x; c1[d] += p1[t] * x; c2[d] += p2[t] * x; c3[d] += p3[t] * x;
        }
    }
}

/* acc[1 row] += sum_t p[t] * v_t; prefetches the V rows pf_rows[t] unless
 * pf_rows is NULL. */
PKV_TARGET static inline void FN(pv_1row)(float *acc, const float *p,
                                          const KV_T *const *v_rows,
                                          const KV_T *const *pf_rows, int64_t head_offset,
                                          int64_t num_tokens, int64_t dim, int64_t dim_vec)
{
    int64_t d = 0, t;
    for (; d + 4 * VW <= dim_vec; d += 4 * VW) {
        vf a0 = VLOAD(acc + d), a1 = VLOAD(acc + d + VW);
        vf a2 = VLOAD(acc + d + 2 * VW), a3 = VLOAD(acc + d + 3 * VW);
        for (t = 0; t < num_tokens; t++) {
            const KV_T *v = v_rows[t] + head_offset;
            PF_V(pf_rows, t, head_offset, d, 4 * VW);
            vf w = VSET1(p[t]);
            a0 = VFMA(w, KV_VLOAD(v, d), a0);
            a1 = VFMA(w, KV_VLOAD(v, d + VW), a1);
            a2 = VFMA(w, KV_VLOAD(v, d + 2 * VW), a2);
            a3 = VFMA(w, KV_VLOAD(v, d + 3 * VW), a3);
        }
        VSTORE(acc + d, a0); VSTORE(acc + d + VW, a1);
        VSTORE(acc + d + 2 * VW, a2); VSTORE(acc + d + 3 * VW, a3);
    }
    for (; d < dim_vec; d += VW) {
        vf a0 = VLOAD(acc + d);
        for (t = 0; t < num_tokens; t++) {
            PF_V(pf_rows, t, head_offset, d, VW);
            a0 = VFMA(VSET1(p[t]), KV_VLOAD(v_rows[t] + head_offset, d), a0);
        }
        VSTORE(acc + d, a0);
    }
    for (; d < dim; d++)
        for (t = 0; t < num_tokens; t++)
            acc[d] += p[t] * KV_VGET(v_rows[t] + head_offset, d);
}

/* State of one KV head of a work item, updated chunk by chunk. */
typedef struct {
    int64_t rows;            /* (query, head) rows: num_tokens * group_size */
    int64_t group_size;
    int64_t dim, dim_vec, dim_pad;
    int64_t first_position;  /* position of the item's first query */
    int64_t window, sink_tokens;
    int64_t chunk_size;      /* <= 0: no chunk mask */
    float softcap2;          /* softcap * log2(e), or 0: no softcap */
    float *qs;               /* [rows, dim_pad] q * scale * log2(e) (with a softcap:
                                q * scale / softcap) */
    uint8_t *qi, *qi_sink;   /* [rows, dim_pad] q (q_sink) quantized to int8, stored
                                + 128 (KV_INT_DOT), or NULL: float scores */
    float *qf, *qf_sink;     /* [rows] the score factor of each quantized row */
    float *qs_sink;          /* [rows, dim_pad] q_sink scaled as qs, for the keys
                                below sink_tokens, or NULL: qs for all */
    float *acc;              /* [rows, dim_pad] running sum of p * v */
    float *s;                /* [rows, PKV_CHUNK_TOKENS] scores, then probabilities */
    float *m;                /* [rows] running max (log2 domain) */
    float *l;                /* [rows] running sum of 2**(s - m); NaN once the row
                                met a NaN or +inf score; -0.0 while it has admitted
                                keys but all scored -inf, +0.0 before any key */
} FN(pkv_state);

/* 1 if the query at position p attends to the key at position k (the mask
 * of attention_kernels.h). */
static inline int FN(admits)(const FN(pkv_state) *st, int64_t p, int64_t k)
{
    return k <= p && (st->window <= 0 || k >= p - st->window + 1 || k < st->sink_tokens) &&
           (st->chunk_size <= 0 || k >= p - p % st->chunk_size);
}

/* 1 if a token of the chunk that some row's mask excludes has an inf or NaN
 * in its V row (at v_rows[t] + head_offset). */
PKV_TARGET static int FN(masked_v_nonfinite)(const FN(pkv_state) *st, const KV_T *const *v_rows,
                                             const int64_t *positions, int64_t n,
                                             int64_t head_offset)
{
    const int64_t pmin = st->first_position;
    const int64_t pmax = st->first_position + st->rows / st->group_size - 1;
    const vf zero = VZERO();
    const int64_t dim = st->dim;
    int64_t t, d;
    for (t = 0; t < n; t++) {
        /* admitted by the first and the last row: admitted by every row */
        if (FN(admits)(st, pmin, positions[t]) && FN(admits)(st, pmax, positions[t]))
            continue;
        const KV_T *v = v_rows[t] + head_offset;
        vf acc = zero; /* 0 * x is 0, or NaN for an inf or NaN x */
        for (d = 0; d < st->dim_vec; d += VW)
            acc = VFMA(zero, KV_LOAD(v, d), acc);
        float sum = VHSUM(acc);
        for (; d < dim; d++)
            sum += 0.0f * KV_GET(v, d);
        if (isnan(sum))
            return 1;
    }
    return 0;
}

/* acc += p @ V, each row over the tokens it admits only. A function of its
 * own: it runs rarely, and its arrays would enlarge finish_chunk's frame. */
PKV_TARGET static void FN(pv_admitted)(const FN(pkv_state) *st, const KV_T *const *v_rows,
                                       const int64_t *positions, int64_t n, int64_t head_offset)
{
    const KV_T *kept_v[PKV_CHUNK_TOKENS];
    float kept_p[PKV_CHUNK_TOKENS];
    int64_t r, t;
    for (r = 0; r < st->rows; r++) {
        const int64_t p = st->first_position + r / st->group_size;
        const float *pr = st->s + r * PKV_CHUNK_TOKENS;
        int64_t kept = 0;
        for (t = 0; t < n; t++) {
            if (FN(admits)(st, p, positions[t])) {
                kept_v[kept] = v_rows[t];
                kept_p[kept] = pr[t];
                kept++;
            }
        }
        FN(pv_1row)(st->acc + r * st->dim_pad, kept_p, kept_v, NULL, head_offset, kept, st->dim,
                    st->dim_vec);
    }
}

/* Scores of tokens t .. t+7 of a chunk of n (tokens past n repeat token t and
 * fill padding slots) for every row of one KV head, with the scaled queries
 * qs ([rows, dim_pad]); its rows start at k_rows[u] + head_offset. The first
 * block of rows also prefetches the rows pf_rows[u] + head_offset (of a later
 * chunk) unless pf_rows is NULL. */
PKV_TARGET static inline void FN(score_tokens)(const FN(pkv_state) *st, int sinks,
                                               const KV_T *const *k_rows,
                                               const KV_T *const *pf_rows, int64_t t, int64_t n,
                                               int64_t head_offset)
{
    const float *qs = sinks ? st->qs_sink : st->qs;
    const int64_t rows = st->rows, dim = st->dim, dim_vec = st->dim_vec, dim_pad = st->dim_pad;
    const int64_t ch = PKV_CHUNK_TOKENS;
    const KV_T *k8[8], *p8[8];
    const KV_T *const *pf = NULL;
    int64_t r;
    int u;
    for (u = 0; u < 8; u++)
        k8[u] = (t + u < n ? k_rows[t + u] : k_rows[t]) + head_offset;
    if (pf_rows != NULL) {
        for (u = 0; u < 8; u++)
            p8[u] = (t + u < n ? pf_rows[t + u] : pf_rows[t]) + head_offset;
        pf = p8;
    }
#if KV_INT_DOT
    if (st->qi != NULL) {
        /* integer sums, then times the query row's and the key row's factors */
        const uint8_t *qi = sinks ? st->qi_sink : st->qi;
        const float *qf = sinks ? st->qf_sink : st->qf;
        float ks[8];
        for (u = 0; u < 8; u++)
            ks[u] = KV_KSCALE(k8[u]);
        for (r = 0; r + 4 <= rows; r += 4) {
            float *s = st->s + r * ch + t;
            KV_INT_DOT_4X4(qi + r * dim_pad, dim_pad, k8, pf, dim, s, ch);
            KV_INT_DOT_4X4(qi + r * dim_pad, dim_pad, k8 + 4, pf == NULL ? NULL : pf + 4, dim, s + 4, ch);
            pf = NULL;
        }
        for (; r < rows; r++) {
            KV_INT_DOT_1X4(qi + r * dim_pad, k8, dim, st->s + r * ch + t);
            KV_INT_DOT_1X4(qi + r * dim_pad, k8 + 4, dim, st->s + r * ch + t + 4);
        }
        for (r = 0; r < rows; r++) {
            float *s = st->s + r * ch + t;
            if (isnan(qf[r])) {
                /* a row that could not be quantized (non-finite) scores in float */
                FN(dot_1x8)(qs + r * dim_pad, k8, NULL, dim, dim_vec, s);
                continue;
            }
            for (u = 0; u < 8; u++)
                s[u] = s[u] * qf[r] * ks[u];
        }
        return;
    }
#endif
    for (r = 0; r + 4 <= rows; r += 4) {
        const float *q = qs + r * dim_pad;
        float *s = st->s + r * ch + t;
#if PKV_DOT_WIDE
        FN(dot_4x4)(q, dim_pad, k8, pf, dim, dim / SW * SW, s, ch);
        FN(dot_4x4)(q, dim_pad, k8 + 4, pf == NULL ? NULL : pf + 4, dim, dim / SW * SW, s + 4, ch);
#else
        for (u = 0; u < 8; u += 2)
            FN(dot_4x2)(q, dim_pad, k8 + u, pf == NULL ? NULL : pf + u, dim, dim_vec, s + u, ch);
#endif
        pf = NULL; /* once per chunk: later row blocks read the same rows */
    }
    for (; r < rows; r++) {
        FN(dot_1x8)(qs + r * dim_pad, k8, pf, dim, dim_vec, st->s + r * ch + t);
        pf = NULL;
    }
}

/* After scoring a chunk of n tokens for one KV head: mask, update the online
 * softmax, accumulate the V rows (at v_rows[t] + head_offset) while
 * prefetching the V rows pf_rows[t] + head_offset of a later chunk, unless
 * pf_rows is NULL. */
PKV_TARGET static void FN(finish_chunk)(const FN(pkv_state) *st, const KV_T *const *v_rows,
                                        const KV_T *const *pf_rows,
                                        const int64_t *positions, int64_t n, int64_t head_offset)
{
    const int64_t rows = st->rows, dim = st->dim, dim_vec = st->dim_vec, dim_pad = st->dim_pad;
    const int64_t ch = PKV_CHUNK_TOKENS;
    const int64_t n_pad = (n + VW - 1) / VW * VW;
    int64_t r, t;

    /* softcap: before the mask, which sets -inf (tanh would make it finite) */
    if (st->softcap2 > 0.0f) {
        for (r = 0; r < rows; r++) {
            float *s = st->s + r * ch;
            for (t = 0; t < n_pad; t += VW)
                VSTORE(s + t, VMULS(VTANH(VLOAD(s + t)), st->softcap2));
        }
    }

    /* mask, only where some token may fall outside some row's range */
    const int64_t pmin = st->first_position;
    const int64_t pmax = st->first_position + rows / st->group_size - 1;
    const int64_t first = positions[0], last = positions[n - 1];
    const int all_valid = last <= pmin && (st->window <= 0 || first >= pmax - st->window + 1 ||
                                           last < st->sink_tokens) &&
                          (st->chunk_size <= 0 || first >= pmax - pmax % st->chunk_size);
    if (!all_valid) {
        for (r = 0; r < rows; r++) {
            const int64_t p = st->first_position + r / st->group_size;
            float *s = st->s + r * ch;
            for (t = 0; t < n; t++) {
                if (!FN(admits)(st, p, positions[t]))
                    s[t] = -INFINITY;
            }
        }
    }

    /* online softmax update per row */
    for (r = 0; r < rows; r++) {
        float *s = st->s + r * ch;
        for (t = n; t < n_pad; t++)
            s[t] = -INFINITY;
        vf vmax = VSET1(-INFINITY);
        for (t = 0; t < n_pad; t += VW)
            vmax = VMAX(vmax, VLOAD(s + t));
        const float chunk_max = VHMAX(vmax);
        if (chunk_max == -INFINITY) {
            /* No finite score: the row takes nothing from the chunk. Max may
             * have hidden a NaN score (x86 max returns its second operand when
             * either is NaN), so sum the scores: NaN if any is. */
            const vf zero = VZERO();
            vf vsum = zero;
            for (t = 0; t < n_pad; t += VW) {
                vsum = VADD(vsum, VLOAD(s + t));
                VSTORE(s + t, zero);
            }
            if (isnan(VHSUM(vsum))) {
                st->l[r] = NAN;
            } else if (st->l[r] == 0.0f) {
                /* Admitted keys that all score -inf: 0/0 in dense softmax
                 * unless a later chunk brings a finite score. */
                const int64_t p = st->first_position + r / st->group_size;
                for (t = 0; t < n; t++) {
                    if (all_valid || FN(admits)(st, p, positions[t])) {
                        st->l[r] = -0.0f;
                        break;
                    }
                }
            }
            continue;
        }
        const float m_old = st->m[r];
        const float m_new = m_old > chunk_max ? m_old : chunk_max;
        const vf vm = VSET1(m_new);
        vf vsum = VZERO();
        /* s - m is NaN for a NaN score and for a +inf one (inf - inf), where
         * dense softmax is NaN: VEXP2 keeps the NaN, so l becomes NaN and
         * stays NaN through later rescaling and sums. */
        for (t = 0; t < n_pad; t += VW) {
            const vf e = VEXP2(VSUB(VLOAD(s + t), vm));
            VSTORE(s + t, e);
            vsum = VADD(vsum, e);
        }
        if (m_new != m_old) {
            const float alpha = exp2f(m_old - m_new); /* 0 for the first chunk */
            float *acc = st->acc + r * dim_pad;
            int64_t d;
            for (d = 0; d < dim_pad; d += VW)
                VSTORE(acc + d, VMULS(VLOAD(acc + d), alpha));
            st->l[r] *= alpha;
        }
        st->l[r] += VHSUM(vsum);
        st->m[r] = m_new;
    }

    /* acc += p @ V. A token the mask excludes for a row has p = 0 there,
     * which adds exactly nothing unless its V row holds an inf or NaN
     * (0 * inf is NaN): then each row takes only the tokens it admits. */
#ifdef KV_VSCALE
    {
        /* p * scale, once per chunk: the V rows are read unscaled */
        float vscale[PKV_CHUNK_TOKENS];
        for (t = 0; t < n; t++)
            vscale[t] = KV_VSCALE(v_rows[t] + head_offset);
        for (r = 0; r < rows; r++) {
            float *p = st->s + r * ch;
            for (t = 0; t < n; t++)
                p[t] *= vscale[t];
        }
    }
#endif
    if (!all_valid && FN(masked_v_nonfinite)(st, v_rows, positions, n, head_offset)) {
        FN(pv_admitted)(st, v_rows, positions, n, head_offset);
        return;
    }
    r = 0;
    for (; r + 4 <= rows; r += 4) {
        FN(pv_4rows)(st->acc + r * dim_pad, dim_pad, st->s + r * ch, ch, v_rows, pf_rows,
                     head_offset, n, dim, dim_vec);
        pf_rows = NULL;
    }
    for (; r < rows; r++) {
        FN(pv_1row)(st->acc + r * dim_pad, st->s + r * ch, v_rows, pf_rows, head_offset, n, dim,
                    dim_vec);
        pf_rows = NULL;
    }
}

/* Run every KV head of the item over one chunk of n tokens while the rows
 * pf_k[0 .. pf_count), pf_v[0 .. pf_count) (of a later chunk, or of the next
 * item) are prefetched: row t along with token t, by the loops that read
 * token t, so that the prefetches spread evenly over the arithmetic.
 * Scoring goes token-major (8 tokens, all heads, then the next 8), so K is
 * read as one sequential stream; V is then read head by head from cache.
 * sinks: 1 if the chunk holds only keys below sink_tokens and the heads have
 * sink queries (scored with qs_sink), else 0. */
PKV_TARGET static void FN(process_heads)(const FN(pkv_state) *heads, int64_t num_heads,
                                         int64_t head_dim, int sinks, const KV_T *const *k_rows,
                                         const KV_T *const *v_rows, const int64_t *positions,
                                         int64_t n, const KV_T *const *pf_k,
                                         const KV_T *const *pf_v, int64_t pf_count)
{
    const KV_T *pk[KV_CHUNK], *pv[KV_CHUNK];
    const int prefetch = PKV_PREFETCH_CHUNKS && pf_count > 0;
    int64_t hh, t;
    if (prefetch) {
        /* rows past the list end repeat this chunk's own (cached) rows */
        for (t = 0; t < n; t++) {
            pk[t] = t < pf_count ? pf_k[t] : k_rows[t];
            pv[t] = t < pf_count ? pf_v[t] : v_rows[t];
        }
    }
    for (t = 0; t < n; t += 8)
        for (hh = 0; hh < num_heads; hh++)
            FN(score_tokens)(&heads[hh], sinks, k_rows,
                             prefetch ? pk : NULL, t, n, hh * KV_ROW(head_dim));
    for (hh = 0; hh < num_heads; hh++)
        FN(finish_chunk)(&heads[hh], v_rows, prefetch ? pv : NULL, positions, n,
                         hh * KV_ROW(head_dim));
}

/* Where the listing of an item's key rows stands: listed page j (of
 * first_page .. end_page), next position pos. */
typedef struct {
    int64_t j, j_end, pos;
    int64_t last;      /* last position any query of the item may attend to */
    int64_t lo;        /* first window or chunk position of the item's first query (0: none) */
    int64_t sink_end;  /* positions below it are sinks (0 without a window) */
    const KV_T *base;  /* pool + the item's first KV head */
} FN(pkv_cursor);

PKV_TARGET static void FN(cursor_init)(FN(pkv_cursor) *c, const pkv_attention_args *a,
                                       const pkv_work_item *item)
{
    const int64_t pmax = item->first_position + item->num_tokens - 1;
    const int64_t seq_len = a->seq_lens[item->seq];
    c->j = item->first_page;
    c->j_end = item->end_page;
    c->pos = 0;
    c->last = pmax < seq_len - 1 ? pmax : seq_len - 1;
    c->lo = a->window > 0       ? item->first_position - a->window + 1
            : a->chunk_size > 0 ? item->first_position - item->first_position % a->chunk_size
                                : 0;
    c->sink_end = a->window > 0 ? a->sink_tokens : 0;
    c->base = (const KV_T *)a->pool + item->kv_head * KV_ROW(a->head_dim);
}

/* Append the item's next key rows, in position order, to k_rows / v_rows /
 * positions (positions may be NULL) from index n up to cap; returns the new
 * count. Keys any query of the item may need: position <= last and (>= lo
 * or < sink_end). Rows point at the item's first KV head. */
PKV_TARGET static int64_t FN(list_rows)(FN(pkv_cursor) *c, const pkv_attention_args *a,
                                        const KV_T **k_rows, const KV_T **v_rows,
                                        int64_t *positions, int64_t n, int64_t cap)
{
    const int64_t ps = a->page_size;
    const int64_t token_stride = a->num_kv_heads * KV_ROW(a->head_dim); /* elements between tokens */
    const int64_t v_offset = ps * token_stride;                /* K half -> V half of a page */
    while (n < cap && c->j < c->j_end) {
        const int64_t page_start = a->page_positions[c->j];
        int64_t end = page_start + ps;
        if (end > c->last + 1) end = c->last + 1;
        if (c->pos < page_start) c->pos = page_start;
        if (c->pos >= c->sink_end && c->pos < c->lo) c->pos = c->lo;
        if (c->pos >= end) {
            c->j++;
            continue;
        }
        /* a run of listed positions: the sinks stop short of a later window */
        int64_t run_end = end;
        if (c->pos < c->sink_end && c->sink_end < c->lo && c->sink_end < run_end)
            run_end = c->sink_end;
        if (run_end - c->pos > cap - n) run_end = c->pos + (cap - n);
        const KV_T *k = c->base + (int64_t)a->indices[c->j] * 2 * v_offset +
                        (c->pos - page_start) * token_stride;
        for (; c->pos < run_end; c->pos++, n++, k += token_stride) {
            k_rows[n] = k;
            v_rows[n] = k + v_offset;
            if (positions != NULL) positions[n] = c->pos;
        }
    }
    return n;
}

#if KV_TOUCH_AHEAD
/* Load one byte of every 64-byte line of the rows k[0..n) and v[0..n), each
 * row_bytes long, so that they are in cache when their chunk comes (see
 * PKV_TOUCH_MAX_BYTES). */
PKV_TARGET static void FN(touch_rows)(const KV_T *const *k, const KV_T *const *v, int64_t n,
                                      int64_t row_bytes)
{
    /* byte sums: one add with a memory operand per line */
    unsigned char sum_k = 0, sum_v = 0;
    int64_t t, o;
    for (t = 0; t < n; t++) {
        const unsigned char *kb = (const unsigned char *)k[t], *vb = (const unsigned char *)v[t];
        for (o = 0; o < row_bytes; o += 64) {
            sum_k += kb[o];
            sum_v += vb[o];
        }
        sum_k += kb[row_bytes - 1]; /* a row that ends past its last line start */
        sum_v += vb[row_bytes - 1];
    }
    __asm__ volatile("" : : "r"((unsigned)sum_k + sum_v)); /* keeps the loads */
}
#endif

/* The item kernel: see pkv_item_kernel in attention_kernels.h. */
PKV_TARGET static void FN(attend_item)(const pkv_attention_args *a, const pkv_work_item *item,
                                       const pkv_work_item *next, float *scratch)
{
    const int64_t G = a->group_size, D = a->head_dim, Hkv = a->num_kv_heads;
    const int64_t Hq = Hkv * G;
    const int64_t num_heads = item->num_kv_heads;
    const int64_t rows = item->num_tokens * G; /* per KV head */
    const int64_t dim_pad = (D + 15) / 16 * 16;
    /* log2(e) goes into the scores' factor: with a softcap it follows the tanh */
    const float qscale = a->softcap > 0.0f ? (float)((double)a->scale / a->softcap)
                                           : a->scale * 1.4426950408889634f;
    const float softcap2 = a->softcap > 0.0f ? a->softcap * 1.4426950408889634f : 0.0f;
    int64_t r, d, hh;

    /* Per-head state; heads[] lives at the end of the scratch block. */
    float *next_free = scratch;
    FN(pkv_state) heads[PKV_MAX_ITEM_HEADS];
    for (hh = 0; hh < num_heads; hh++) {
        FN(pkv_state) *st = &heads[hh];
        const int64_t kv_head = item->kv_head + hh;
        st->rows = rows;
        st->group_size = G;
        st->dim = D;
        st->dim_vec = D / VW * VW;
        st->dim_pad = dim_pad;
        st->first_position = item->first_position;
        st->window = a->window;
        st->sink_tokens = a->window > 0 ? a->sink_tokens : 0;
        st->chunk_size = a->chunk_size;
        st->softcap2 = softcap2;
        st->qs = next_free;
        st->acc = st->qs + rows * dim_pad;
        st->s = st->acc + rows * dim_pad;
        st->m = st->s + rows * PKV_CHUNK_TOKENS;
        st->l = st->m + rows;
        next_free = st->l + rows;
        st->qs_sink = NULL;
        if (a->q_sink != NULL && st->sink_tokens > 0) {
            st->qs_sink = next_free;
            next_free += rows * dim_pad;
        }
        st->qi = st->qi_sink = NULL;
        st->qf = st->qf_sink = NULL;
#if KV_INT_DOT
        /* rows * dim_pad bytes (dim_pad a multiple of 16), then the factors */
        st->qi = (uint8_t *)next_free;
        st->qf = next_free + rows * dim_pad / 4;
        next_free = st->qf + rows;
        if (st->qs_sink != NULL) {
            st->qi_sink = (uint8_t *)next_free;
            st->qf_sink = next_free + rows * dim_pad / 4;
            next_free = st->qf_sink + rows;
        }
#endif
        for (r = 0; r < rows; r++) {
            const int64_t i = r / G, g = r % G;
            const int64_t q_offset = (item->first_token + i) * Hq * D + (kv_head * G + g) * D;
            const float *q = a->q + q_offset;
            float *qs = st->qs + r * dim_pad;
            float *acc = st->acc + r * dim_pad;
            for (d = 0; d < D; d++)
                qs[d] = q[d] * qscale;
            for (; d < dim_pad; d++)
                qs[d] = 0.0f;
            if (st->qs_sink != NULL) {
                const float *q_sink = a->q_sink + q_offset;
                float *qs_sink = st->qs_sink + r * dim_pad;
                for (d = 0; d < D; d++)
                    qs_sink[d] = q_sink[d] * qscale;
                for (; d < dim_pad; d++)
                    qs_sink[d] = 0.0f;
            }
#if KV_ROTATED
            /* (R q).(R k) = q.k: the rows hold R k */
            pkv_rotate(qs, D);
            if (st->qs_sink != NULL)
                pkv_rotate(st->qs_sink + r * dim_pad, D);
#endif
#if KV_INT_DOT
            {
                /* score factor d_q * qscale; NaN: the row scores in float. A rotated
                 * format quantizes R q (its rows hold R k). */
                const float *qq = q, *qq_sink = a->q_sink != NULL ? a->q_sink + q_offset : NULL;
#if KV_ROTATED
                float rq[PKV_MAX_HEAD_DIM], rq_sink[PKV_MAX_HEAD_DIM];
                memcpy(rq, q, (size_t)D * sizeof(float));
                pkv_rotate(rq, D);
                qq = rq;
                if (st->qi_sink != NULL) {
                    memcpy(rq_sink, qq_sink, (size_t)D * sizeof(float));
                    pkv_rotate(rq_sink, D);
                    qq_sink = rq_sink;
                }
#endif
                float f = pkv_quantize_query(qq, D, dim_pad, st->qi + r * dim_pad) * qscale;
                st->qf[r] = isfinite(f) ? f : NAN;
                if (st->qi_sink != NULL) {
                    f = pkv_quantize_query(qq_sink, D, dim_pad, st->qi_sink + r * dim_pad) * qscale;
                    st->qf_sink[r] = isfinite(f) ? f : NAN;
                }
            }
#endif
            for (d = 0; d < dim_pad; d++)
                acc[d] = 0.0f;
            st->m[r] = -INFINITY;
            st->l[r] = 0.0f;
        }
    }

    /* The rows of PKV_PREFETCH_AHEAD chunks past the one being processed are
     * listed and prefetched while it is computed; during the item's last
     * chunk, the first rows of the next item are. */
    enum { CH = KV_CHUNK, CAP = (PKV_PREFETCH_AHEAD + 1) * KV_CHUNK };
    const KV_T *k_rows[CAP];
    const KV_T *v_rows[CAP];
    int64_t positions[CAP];
    FN(pkv_cursor) cursor;
    FN(cursor_init)(&cursor, a, item);
    int64_t n = FN(list_rows)(&cursor, a, k_rows, v_rows, positions, 0, CAP);
    const KV_T *next_k[CH], *next_v[CH];
    const int64_t sink_end = heads[0].qs_sink != NULL ? heads[0].sink_tokens : 0;
#if KV_TOUCH_AHEAD
    /* rows a chunk ahead read with loads (see PKV_TOUCH_MAX_BYTES), else hinted */
    const int64_t touch_row_bytes = num_heads * KV_ROW(D) * (int64_t)sizeof(KV_T);
    const int touch = rows <= PKV_TOUCH_MAX_ROWS && 2 * CH * touch_row_bytes <= PKV_TOUCH_MAX_BYTES;
#endif
    while (n > 0) {
        int64_t m = n < CH ? n : CH;
        /* With sink queries a chunk holds sink keys only or none: the sinks
         * come first in position order, so it ends at the first non-sink. */
        const int sinks = positions[0] < sink_end;
        if (sinks) {
            int64_t u = 1;
            while (u < m && positions[u] < sink_end) u++;
            m = u;
        }
        const KV_T *const *pf_k = k_rows + (CAP - CH), *const *pf_v = v_rows + (CAP - CH);
        int64_t pf_count = n - (CAP - CH);
        if (pf_count <= 0 && next != NULL && next->num_kv_heads >= num_heads && PKV_PREFETCH_CHUNKS) {
            /* rows of the next item's first num_heads heads: all of them
             * exist when it has at least as many */
            FN(pkv_cursor) next_cursor;
            FN(cursor_init)(&next_cursor, a, next);
            pf_count = FN(list_rows)(&next_cursor, a, next_k, next_v, NULL, 0, m);
            pf_k = next_k;
            pf_v = next_v;
        }
#if KV_TOUCH_AHEAD
        if (touch && pf_count > 0) {
            FN(touch_rows)(pf_k, pf_v, pf_count, touch_row_bytes);
            pf_count = 0;
        }
#endif
        FN(process_heads)(heads, num_heads, D, sinks, k_rows, v_rows, positions, m, pf_k, pf_v,
                          pf_count);
        memmove(k_rows, k_rows + m, (n - m) * sizeof k_rows[0]);
        memmove(v_rows, v_rows + m, (n - m) * sizeof v_rows[0]);
        memmove(positions, positions + m, (n - m) * sizeof positions[0]);
        n = FN(list_rows)(&cursor, a, k_rows, v_rows, positions, n - m, CAP);
    }

    for (hh = 0; hh < num_heads; hh++) {
        const FN(pkv_state) *st = &heads[hh];
        const int64_t kv_head = item->kv_head + hh;
        for (r = 0; r < rows; r++) {
            const int64_t i = r / G, g = r % G;
            const float *acc = st->acc + r * dim_pad;
            const float l = st->l[r];
            if (item->partial >= 0) {
                /* one partition of a split decode: its raw state, merged later */
                const int64_t row = (item->partial + i) * Hq + kv_head * G + g;
                memcpy(a->part_acc + row * D, acc, (size_t)D * sizeof(float));
                a->part_max[row] = st->m[r];
                a->part_sum[row] = l;
                continue;
            }
            float *out = a->out + (item->first_token + i) * Hq * D + (kv_head * G + g) * D;
            /* the sink logit in the log2 domain; -inf: no sink term */
            const float sink = a->sink_logits == NULL
                                   ? -INFINITY
                                   : a->sink_logits[kv_head * G + g] * 1.4426950408889634f;
            float row_lse;
            if (sink != -INFINITY && !isnan(l)) {
                /* M = max(m, sink), L = l 2**(m - M) + 2**(sink - M); a row
                 * without a positive sum (l = +-0: no key, or only -inf
                 * scores) weighs its keys 0, and 0 * (inf or NaN in V) is NaN */
                const float m = st->m[r];
                const float top = l > 0.0f && m > sink ? m : sink;
                const float alpha = l > 0.0f ? exp2f(m - top) : 0.0f;
                const float total = l * alpha + exp2f(sink - top);
                const float w = alpha / total;
                for (d = 0; d < D; d++)
                    out[d] = acc[d] * w;
                row_lse = (top + log2f(total)) * 0.6931471805599453f;
            } else if (l > 0.0f) {
                const float inv = 1.0f / l;
                for (d = 0; d < D; d++)
                    out[d] = acc[d] * inv;
                row_lse = (st->m[r] + log2f(l)) * 0.6931471805599453f;
            } else if (l == 0.0f && !signbit(l)) {
                /* no key admitted */
                for (d = 0; d < D; d++)
                    out[d] = 0.0f;
                row_lse = -INFINITY;
            } else {
                /* a NaN or +inf score, or every admitted score -inf */
                for (d = 0; d < D; d++)
                    out[d] = NAN;
                row_lse = NAN;
            }
#if KV_ROTATED
            pkv_rotate(out, D); /* sum w R v = R (sum w v) */
#endif
            if (a->lse != NULL)
                a->lse[(item->first_token + i) * Hq + kv_head * G + g] = row_lse;
        }
    }
}

#undef FN
#undef PKV_CAT_
#undef PKV_CAT2_
/* The score-vector macros end here, whoever defined them. */
#undef PKV_SCORE_VECTORS_DEFAULT
#undef sf
#undef SW
#undef SZERO
#undef SLOAD
#undef KV_SLOAD
/* So are the row-layout macros. */
#undef KV_ROW
#undef KV_LOAD
#undef KV_GET
#undef KV_ADDR
#undef KV_LINE_ELEMS
#undef KV_ROTATED
#undef KV_INT_DOT
#undef KV_TOUCH_AHEAD
#undef KV_VSCALE
#undef KV_VLOAD
#undef KV_VGET
#undef KV_PF_TAIL
#undef SFMA
#undef SKEEP
#undef SHSUM4X4
