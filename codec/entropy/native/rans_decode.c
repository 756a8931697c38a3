/* Native rANS decode + table dequantization of the codec's streams (docs/bitstream.md
 * sections 2-3), a C port of the numba kernel in codec/rans_kernels.py (`_decode_impl`).
 *
 * Built from source by codec/entropy/rans_native.py with the machine's C compiler (gcc -O3
 * -march=native -shared -pthread) into the cache folder and called through ctypes (which
 * releases the GIL). Same inputs, same outputs, same per-stream error codes as the numba
 * kernel; the Python wrapper validates every argument first (lengths, shapes, tables), and
 * the payload comes zero-padded so that no read leaves the buffer (a stream reads at most
 * one 16-bit word per symbol).
 *
 * Work items (built by codec.entropy.rans_native.native_items, NQ + 1 int64 each): up to
 * NQ quads (4 streams of one (kv, layer, token block) and 4 consecutive full channel
 * groups) of one kv and one token-block length, or one single-lane stream. With AVX2 a
 * quad item is decoded in NV vectors of 8 lanes (DEFINE_VEC: gathers over 8 * NV
 * independent rANS states, as htscodecs does); without it (or when the caller says the
 * offsets do not fit int32) each quad runs in the scalar loop (LANES_LOOP), two
 * neighbouring quads of one row merged into 8 lanes. Workers (the calling thread plus
 * n_workers - 1 pthreads) take items from one atomic counter (dynamic scheduling: a
 * thread slowed by other work holds no share).
 *
 * 2-byte outputs of the vector lanes go to a per-worker tile [channel in group][token][lane]
 * (one vector store of the 16 lanes per step) and, after the item, into the output in whole
 * 16-channel runs (transpose16); CACHEGEN_NATIVE_TILE=0 or a tile over 8 MiB: the lanes
 * store each value into the output directly (one 2-byte store per symbol, down a column).
 *
 * Symbol s of (kv, layer, t, c) is written as
 *   out[layer, t_off + t, c] = deq[layer, t * t_stride + c / hd, s]
 * with out [L, T_out, C] and deq [L, R, NS] of one element size (1, 2 or 4 bytes).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#ifndef NV
#define NV 2            /* vectors of 8 lanes in flight */
#endif
#define NL (8 * NV)     /* lanes (rANS states) of an item */
#define NQ (2 * NV)     /* quads of an item */
/* The vector lanes' fine LUT: one byte per 2^FINE_SHIFT slots (2 KiB per model), built per
 * call for at most FINE_LUT_MODELS models (8 MiB); measured against 16- and 64-slot buckets
 * and a 1024-model limit in docs/notes/2026-12-07-encode-ladder-and-groups.md. */
#ifndef FINE_LUT_MODELS
#define FINE_LUT_MODELS 4096
#endif
#ifndef FINE_SHIFT
#define FINE_SHIFT 5
#endif
#define FINE_ROW (65536 >> FINE_SHIFT)

typedef struct {
    const uint16_t *words;   /* payload as u16, zero padded */
    const int64_t *w_off;    /* [n_streams + 1] word offsets */
    const uint32_t *packed;  /* [n_models, 256] freq | cum << 16 */
    const uint32_t *cum;     /* [n_models, 257] */
    const uint8_t *lut;      /* [n_models, 256] first candidate symbol per slot >> 8 */
    const uint16_t *mi;      /* [2, L, C] model of (kv, layer, channel) */
    const int64_t *items;    /* [n_items, 5] (quads, first streams); see run_item */
    int64_t n_items, L, T, C, G, B, T_out, R[2], NS[2], t_stride, hd, t_off;
    void *out_k, *out_v;
    const void *deq_k, *deq_v;
    int64_t *err;            /* [n_streams] */
    int64_t counter;         /* next item (atomic) */
    int esize;               /* 1, 2 or 4 bytes per element */
    int vec;                 /* 1: the AVX2 lanes for quad items (offsets fit int32) */
    const uint8_t *vlut;     /* the vector lanes' LUT: [n_models, 65536 >> vshift] */
    int vshift;              /* FINE_SHIFT (fine LUT built here) or 8 (the caller's coarse LUT) */
    size_t tile_bytes;       /* per-worker tile of the 2-byte vector path (0: none) */
} job_t;

typedef struct {
    uint64_t x;
    int64_t q;
    const uint8_t *lu;
    const uint32_t *cu, *pk;
} lane_t;

static inline int64_t final_err(const lane_t *ln, int64_t end) {
    if (ln->q > end) return 3;
    if (ln->x != 65536) return 4;
    if (ln->q != end) return 5;
    return 0;
}

/* The hot loop over one channel's tokens for NL lanes: the lanes' states live in local
 * arrays that the full unroll turns into registers (no reloads after the output stores). */
#define LANES_LOOP(TYPE, NL)                                                                \
    {                                                                                       \
        uint64_t x[NL];                                                                     \
        int64_t q[NL];                                                                      \
        const uint8_t *lu[NL];                                                              \
        const uint32_t *cu[NL], *pk[NL];                                                    \
        for (int k = 0; k < NL; k++) {                                                      \
            x[k] = ln[k].x; q[k] = ln[k].q; lu[k] = ln[k].lu; cu[k] = ln[k].cu; pk[k] = ln[k].pk; \
        }                                                                                   \
        for (int64_t t = t0; t < t1; t++) {                                                 \
            TYPE *o = out + (t + j->t_off) * C;                                             \
            const int64_t ro = t * rs;                                                      \
            _Pragma("GCC unroll 8")                                                         \
            for (int k = 0; k < NL; k++) {                                                  \
                uint32_t slot = (uint32_t)(x[k] & 0xFFFF);                                  \
                uint32_t sy = lu[k][slot >> 8];                                             \
                while (cu[k][sy + 1] <= slot) sy++;                                         \
                uint32_t pv = pk[k][sy];                                                    \
                uint64_t y = (uint64_t)(pv & 0xFFFF) * (x[k] >> 16) + slot - (pv >> 16);    \
                uint64_t w = words[q[k]];                                                   \
                int small = y < 65536;                                                      \
                x[k] = small ? ((y << 16) | w) : y;                                         \
                q[k] += small;                                                              \
                o[c[k]] = row[k][ro + sy];                                                  \
            }                                                                               \
        }                                                                                   \
        for (int k = 0; k < NL; k++) { ln[k].x = x[k]; ln[k].q = q[k]; }                    \
    }


#define DEFINE_DECODE(TYPE, NAME)                                                           \
static void NAME(job_t *j, int64_t i0, int64_t nl) {                                       \
    const int64_t C = j->C, G = j->G, B = j->B, T = j->T;                                   \
    const int64_t n_groups = (C + G - 1) / G, n_blocks = (T + B - 1) / B;                   \
    const int64_t r = i0 / n_blocks, t0 = (i0 % n_blocks) * B;                              \
    const int64_t t1 = t0 + B < T ? t0 + B : T;                                             \
    const int64_t g = r % n_groups, layer = (r / n_groups) % j->L, kv = (r / n_groups) / j->L; \
    TYPE *out = (TYPE *)(kv == 0 ? j->out_k : j->out_v) + layer * j->T_out * C;             \
    const int64_t NS = j->NS[kv];                                                           \
    const TYPE *dq = (const TYPE *)(kv == 0 ? j->deq_k : j->deq_v) + layer * j->R[kv] * NS;  \
    const uint16_t *mi = j->mi + (kv * j->L + layer) * C;                                   \
    const uint16_t *words = j->words;                                                       \
    lane_t ln[8];                                                                           \
    int64_t sid[8];                                                                         \
    int bad = 0;                                                                            \
    for (int64_t k = 0; k < nl; k++) {                                                      \
        sid[k] = i0 + k * n_blocks;                                                         \
        int64_t q = j->w_off[sid[k]];                                                       \
        ln[k].x = (uint64_t)words[q] | ((uint64_t)words[q + 1] << 16);                      \
        ln[k].q = q + 2;                                                                    \
        if (ln[k].x < 65536) bad = 1;                                                       \
    }                                                                                       \
    if (bad) {                                                                              \
        for (int64_t k = 0; k < nl; k++) j->err[sid[k]] = ln[k].x < 65536 ? 2 : 0;          \
        return;                                                                             \
    }                                                                                       \
    const int64_t cw = nl == 1 ? (g * G + G < C ? G : C - g * G) : G;                       \
    for (int64_t kc = 0; kc < cw; kc++) {                                                   \
        int64_t c[8];                                                                       \
        const TYPE *row[8];                                                                 \
        for (int64_t k = 0; k < nl; k++) {                                                  \
            c[k] = g * G + kc + k * G;                                                      \
            int64_t m = mi[c[k]];                                                           \
            ln[k].lu = j->lut + m * 256;                                                    \
            ln[k].cu = j->cum + m * 257;                                                    \
            ln[k].pk = j->packed + m * 256;                                                 \
            row[k] = dq + (c[k] / j->hd) * NS;                                              \
        }                                                                                   \
        const int64_t rs = j->t_stride * NS;                                                \
        if (nl == 8) LANES_LOOP(TYPE, 8)                                               \
        else if (nl == 4) LANES_LOOP(TYPE, 4)                                               \
        else LANES_LOOP(TYPE, 1)                                                            \
    }                                                                                       \
    for (int64_t k = 0; k < nl; k++) j->err[sid[k]] = final_err(&ln[k], j->w_off[sid[k] + 1]); \
}

DEFINE_DECODE(uint8_t, decode_item_u8)
DEFINE_DECODE(uint16_t, decode_item_u16)
DEFINE_DECODE(uint32_t, decode_item_u32)


#ifdef __AVX2__
/* out[n][off + i] = src[i * stride + n] for i, n < 16: one token's 16 channels x 16 lanes of
 * the tile written as 16 contiguous runs (a 16 x 16 transpose of 16-bit values in four
 * rounds of unpacks: 16-, 32-, 64-bit, then 128-bit halves). */
static inline void transpose16(const uint16_t *src, int64_t stride, uint16_t *const *out,
                               int64_t off) {
    __m256i r[16], a[16], b[16];
    for (int i = 0; i < 16; i++) r[i] = _mm256_loadu_si256((const __m256i *)(src + i * stride));
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        b[4 * i] = _mm256_unpacklo_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm256_unpackhi_epi32(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm256_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm256_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m256i cl = _mm256_unpacklo_epi64(b[m], b[4 + m]);
        const __m256i ch = _mm256_unpackhi_epi64(b[m], b[4 + m]);
        const __m256i dl = _mm256_unpacklo_epi64(b[8 + m], b[12 + m]);
        const __m256i dh = _mm256_unpackhi_epi64(b[8 + m], b[12 + m]);
        _mm256_storeu_si256((__m256i *)(out[2 * m] + off), _mm256_permute2x128_si256(cl, dl, 0x20));
        _mm256_storeu_si256((__m256i *)(out[2 * m + 8] + off), _mm256_permute2x128_si256(cl, dl, 0x31));
        _mm256_storeu_si256((__m256i *)(out[2 * m + 1] + off), _mm256_permute2x128_si256(ch, dh, 0x20));
        _mm256_storeu_si256((__m256i *)(out[2 * m + 9] + off), _mm256_permute2x128_si256(ch, dh, 0x31));
    }
}

/* The hot loop in AVX2 lanes: up to NQ quads of one kv and one token-block length (any
 * layers, groups and blocks), lane 4u + k = stream qs[u] + k * n_blocks, in NV vectors of
 * 8 lanes (NL rANS states: NV independent chains of gathers in flight). 32 bits per lane are exact:
 * x < 2^32, freq < 2^16, and the slot's symbol has cum <= slot, so freq * (x >> 16) +
 * slot - cum < 2^32. Per token: the coarse LUT (a gather of the aligned 4 bytes holding
 * the slot's byte), the forward scan as a loop of cum gathers until no lane advances, the
 * packed freq | cum << 16 gather, the state update, the renormalisation (a gather of each
 * lane's next 16-bit word; a lane takes it and advances its word index only when its
 * state fell below 2^16), the table gather (the aligned 4 bytes holding the element) and
 * 16 stores (one vector store into the tile for 2-byte outputs, else 16 scalar stores). Every gather reads an aligned 32-bit word holding a valid element, or
 * (for the words) one word past an index the scalar loop reads, which the payload's zero
 * padding (max symbols per stream + 4 words) covers. A missing quad repeats quad 0 (same
 * values to the same places; its error codes are not written). A quad with a bad initial
 * state is reported as the scalar loop does (2 for the bad lanes, 0 for the others); its
 * lanes still run (reads stay bounded: symbols have cum <= slot < 2^16, one word each). */
#define DEFINE_VEC(TYPE, NAME)                                                              \
static void NAME(job_t *j, const int64_t *qs, int64_t nq, uint16_t *tile) {                 \
    const int64_t C = j->C, G = j->G, B = j->B, T = j->T, L = j->L;                         \
    const int64_t n_groups = (C + G - 1) / G, n_blocks = (T + B - 1) / B;                   \
    const int64_t kv = (qs[0] / n_blocks / n_groups) / L;                                   \
    const int64_t nt = (qs[0] % n_blocks) * B + B < T ? B : T - (qs[0] % n_blocks) * B;     \
    const int64_t NS = j->NS[kv], R = j->R[kv], rs = j->t_stride * NS;                      \
    TYPE *outb = (TYPE *)(kv == 0 ? j->out_k : j->out_v);                                   \
    /* 2-byte elements with a tile: each step's 16 values go to tile[kc][t][lane] in one  \
     * vector store, and the tile is copied out row by row after the item (the lanes     \
     * decode down columns of the token-major output) */                                  \
    const int tiled = sizeof(TYPE) == 2 && tile != NULL && NL == 16;                        \
    TYPE *obase[NL];                                                                        \
    const TYPE *dq = (const TYPE *)(kv == 0 ? j->deq_k : j->deq_v);                         \
    const uint8_t *lut4 = (const uint8_t *)((uintptr_t)j->vlut & ~(uintptr_t)3);            \
    const uint8_t *dq4 = (const uint8_t *)((uintptr_t)dq & ~(uintptr_t)3);                  \
    const int64_t lmis = (int64_t)((uintptr_t)j->vlut & 3), dmis = (int64_t)((uintptr_t)dq & 3); \
    const int vsh = j->vshift;                                                              \
    const int64_t lrow = (int64_t)65536 >> vsh;                                             \
    const uint16_t *words = j->words;                                                       \
    int64_t sid[NL], g0[NL], lay[NL], tb[NL];                                                 \
    int32_t xs[NL], qv[NL];                                                                 \
    int dead[NQ] = {0};                                                                    \
    for (int u = 0; u < NQ; u++) {                                                           \
        const int64_t uu = u < nq ? u : 0;                                                  \
        for (int k = 0; k < 4; k++) {                                                       \
            const int64_t s = qs[uu] + k * n_blocks, r = s / n_blocks, n = 4 * u + k;       \
            sid[n] = s; g0[n] = (r % n_groups) * G; lay[n] = (r / n_groups) % L;            \
            tb[n] = (s % n_blocks) * B;                                                     \
            const int64_t q = j->w_off[s];                                                  \
            const uint32_t x = (uint32_t)words[q] | ((uint32_t)words[q + 1] << 16);         \
            xs[n] = (int32_t)x; qv[n] = (int32_t)(q + 2);                                   \
            if (x < 65536) dead[u] = 1;                                                     \
        }                                                                                   \
    }                                                                                       \
    for (int u = 0; u < nq; u++)                                                            \
        if (dead[u])                                                                        \
            for (int k = 0; k < 4; k++)                                                     \
                j->err[sid[4 * u + k]] = (uint32_t)xs[4 * u + k] < 65536 ? 2 : 0;           \
    const int esh = sizeof(TYPE) == 1 ? 0 : (sizeof(TYPE) == 2 ? 1 : 2);                    \
    const __m128i vshc = _mm_cvtsi32_si128(vsh);                                            \
    const __m256i m16 = _mm256_set1_epi32(0xFFFF), m3 = _mm256_set1_epi32(3);               \
    const __m256i n3 = _mm256_set1_epi32(~3), one = _mm256_set1_epi32(1);                   \
    const __m256i m8 = _mm256_set1_epi32(0xFF), zero = _mm256_setzero_si256();              \
    const __m256i emask = _mm256_set1_epi32(sizeof(TYPE) == 4 ? -1 :                        \
                                            (int32_t)((1u << (8 * sizeof(TYPE))) - 1));     \
    __m256i vx[NV], vq[NV];                                                                   \
    for (int v = 0; v < NV; v++) {                                                           \
        vx[v] = _mm256_loadu_si256((const __m256i *)(xs + 8 * v));                          \
        vq[v] = _mm256_loadu_si256((const __m256i *)(qv + 8 * v));                          \
    }                                                                                       \
    for (int64_t kc = 0; kc < G; kc++) {                                                    \
        int32_t lo[NL], co[NL], po[NL], ro[NL];                                             \
        TYPE *ov[NL];                                                                       \
        for (int n = 0; n < NL; n++) {                                                      \
            const int64_t c = g0[n] + kc, m = j->mi[(kv * L + lay[n]) * C + c];             \
            lo[n] = (int32_t)(lmis + m * lrow); co[n] = (int32_t)(m * 257 + 1);             \
            po[n] = (int32_t)(m * 256);                                                     \
            ro[n] = (int32_t)(dmis + (lay[n] * R * NS + (c / j->hd) * NS + tb[n] * rs)      \
                              * (int64_t)sizeof(TYPE));                                     \
            ov[n] = outb + (lay[n] * j->T_out + j->t_off + tb[n]) * C + c;                  \
            if (kc == 0) obase[n] = ov[n];                                                  \
        }                                                                                   \
        __m256i vlo[NV], vco[NV], vpo[NV], vro[NV];                                             \
        for (int v = 0; v < NV; v++) {                                                       \
            vlo[v] = _mm256_loadu_si256((const __m256i *)(lo + 8 * v));                     \
            vco[v] = _mm256_loadu_si256((const __m256i *)(co + 8 * v));                     \
            vpo[v] = _mm256_loadu_si256((const __m256i *)(po + 8 * v));                     \
            vro[v] = _mm256_loadu_si256((const __m256i *)(ro + 8 * v));                     \
        }                                                                                   \
        for (int64_t t = 0; t < nt; t++) {                                                  \
            const int64_t orow = t * C;                                                     \
            const __m256i trs = _mm256_set1_epi32((int32_t)(t * rs));                       \
            __m256i slot[NV], slot1[NV], sy[NV];                                               \
            _Pragma("GCC unroll 4")                                                         \
            for (int v = 0; v < NV; v++) {                                                   \
                slot[v] = _mm256_and_si256(vx[v], m16);                                     \
                slot1[v] = _mm256_add_epi32(slot[v], one);                                  \
                const __m256i hb = _mm256_add_epi32(vlo[v], _mm256_srl_epi32(slot[v], vshc)); \
                const __m256i lw = _mm256_i32gather_epi32((const int *)lut4,                \
                                                          _mm256_and_si256(hb, n3), 1);     \
                sy[v] = _mm256_and_si256(_mm256_srlv_epi32(                                 \
                    lw, _mm256_slli_epi32(_mm256_and_si256(hb, m3), 3)), m8);               \
            }                                                                               \
            /* packed first: cum[sy] + freq[sy] = cum[sy + 1] (exact for reachable rows), so   \
             * when no lane's slot reaches it the LUT's symbol is the scan's result */       \
            __m256i pv[NV], over = _mm256_setzero_si256();                                  \
            _Pragma("GCC unroll 4")                                                         \
            for (int v = 0; v < NV; v++) {                                                  \
                pv[v] = _mm256_i32gather_epi32((const int *)j->packed,                      \
                                               _mm256_add_epi32(vpo[v], sy[v]), 4);         \
                const __m256i hi = _mm256_add_epi32(_mm256_srli_epi32(pv[v], 16),           \
                                                    _mm256_and_si256(pv[v], m16));          \
                over = _mm256_or_si256(over, _mm256_cmpgt_epi32(slot1[v], hi));             \
            }                                                                               \
            if (!_mm256_testz_si256(over, over)) {                                          \
                for (;;) {                                                                  \
                    __m256i adv[NV];                                                        \
                    _Pragma("GCC unroll 4")                                                 \
                    for (int v = 0; v < NV; v++) {                                          \
                        const __m256i nx = _mm256_i32gather_epi32(                          \
                            (const int *)j->cum, _mm256_add_epi32(vco[v], sy[v]), 4);       \
                        adv[v] = _mm256_cmpgt_epi32(slot1[v], nx);                          \
                    }                                                                       \
                    __m256i any = adv[0];                                                   \
                    for (int v = 1; v < NV; v++) any = _mm256_or_si256(any, adv[v]);        \
                    if (_mm256_testz_si256(any, any)) break;                                \
                    for (int v = 0; v < NV; v++) sy[v] = _mm256_sub_epi32(sy[v], adv[v]);  \
                }                                                                           \
                for (int v = 0; v < NV; v++)                                                \
                    pv[v] = _mm256_i32gather_epi32((const int *)j->packed,                  \
                                                   _mm256_add_epi32(vpo[v], sy[v]), 4);     \
            }                                                                               \
            uint32_t st[NL];                                                                \
            __m256i dvs[NV];                                                                \
            _Pragma("GCC unroll 4")                                                         \
            for (int v = 0; v < NV; v++) {                                                   \
                __m256i y = _mm256_mullo_epi32(_mm256_and_si256(pv[v], m16),                \
                                               _mm256_srli_epi32(vx[v], 16));               \
                y = _mm256_sub_epi32(_mm256_add_epi32(y, slot[v]), _mm256_srli_epi32(pv[v], 16)); \
                const __m256i small = _mm256_cmpeq_epi32(_mm256_srli_epi32(y, 16), zero);   \
                const __m256i w = _mm256_and_si256(                                         \
                    _mm256_i32gather_epi32((const int *)words, vq[v], 2), m16);             \
                vx[v] = _mm256_blendv_epi8(y, _mm256_or_si256(_mm256_slli_epi32(y, 16), w), small); \
                vq[v] = _mm256_sub_epi32(vq[v], small);                                     \
                const __m256i eb = _mm256_add_epi32(vro[v], _mm256_slli_epi32(              \
                    _mm256_add_epi32(trs, sy[v]), esh));                                    \
                __m256i dv = _mm256_i32gather_epi32((const int *)dq4,                       \
                                                    _mm256_and_si256(eb, n3), 1);           \
                dv = _mm256_and_si256(_mm256_srlv_epi32(                                    \
                    dv, _mm256_slli_epi32(_mm256_and_si256(eb, m3), 3)), emask);            \
                dvs[v] = dv;                                                                \
                if (!tiled) _mm256_storeu_si256((__m256i *)(st + 8 * v), dv);               \
            }                                                                               \
            if (tiled) {                                                                    \
                /* lanes 0-15 in order: packus interleaves the 128-bit halves, the permute \
                 * puts them back (values fit 16 bits, no saturation) */                    \
                _mm256_storeu_si256((__m256i *)(tile + (kc * nt + t) * 16),                 \
                    _mm256_permute4x64_epi64(_mm256_packus_epi32(dvs[0], dvs[NV - 1]), 0xD8)); \
            } else {                                                                        \
                _Pragma("GCC unroll 32")                                                    \
                for (int n = 0; n < NL; n++) ov[n][orow] = (TYPE)st[n];                     \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    if (tiled && G == 16)                                                                   \
        for (int64_t t = 0; t < nt; t++) transpose16(tile + t * 16, nt * 16,                \
                                                     (uint16_t **)obase, t * C);            \
    else if (tiled)                                                                         \
        for (int64_t t = 0; t < nt; t++)                                                    \
            for (int n = 0; n < NL; n++) {                                                  \
                TYPE *o = obase[n] + t * C;                                                 \
                const uint16_t *src = tile + t * 16 + n;                                    \
                for (int64_t kc = 0; kc < G; kc++) o[kc] = (TYPE)src[kc * nt * 16];         \
            }                                                                               \
    for (int v = 0; v < NV; v++) {                                                           \
        _mm256_storeu_si256((__m256i *)(xs + 8 * v), vx[v]);                                \
        _mm256_storeu_si256((__m256i *)(qv + 8 * v), vq[v]);                                \
    }                                                                                       \
    for (int u = 0; u < nq; u++) {                                                          \
        if (dead[u]) continue;                                                              \
        for (int k = 0; k < 4; k++) {                                                       \
            const int n = 4 * u + k;                                                        \
            lane_t ln = {(uint32_t)xs[n], qv[n], NULL, NULL, NULL};                         \
            j->err[sid[n]] = final_err(&ln, j->w_off[sid[n] + 1]);                          \
        }                                                                                   \
    }                                                                                       \
}

DEFINE_VEC(uint8_t, decode_vec_u8)
DEFINE_VEC(uint16_t, decode_vec_u16)
DEFINE_VEC(uint32_t, decode_vec_u32)
#endif

/* Item it: items[5 * it] = nq, the number of quads (0: one single-lane stream), then the
 * first streams of its quads (or the single stream). Vector lanes when j->vec, else each
 * quad (merged in pairs where they are consecutive groups of one row) in the scalar loop. */
static void run_item(job_t *j, int64_t it, uint16_t *tile) {
    const int64_t *e = j->items + (NQ + 1) * it, nq = e[0];
#ifdef __AVX2__
    if (j->vec && nq > 0) {
        if (j->esize == 1) decode_vec_u8(j, e + 1, nq, NULL);
        else if (j->esize == 2) decode_vec_u16(j, e + 1, nq, tile);
        else decode_vec_u32(j, e + 1, nq, NULL);
        return;
    }
#endif
    const int64_t n_blocks = (j->T + j->B - 1) / j->B;
    for (int64_t u = 0; u < (nq > 0 ? nq : 1); u++) {
        int64_t i0 = e[1 + u], nl = nq > 0 ? 4 : 1;
        if (nq > 0 && u + 1 < nq && e[2 + u] == i0 + 4 * n_blocks
            && (i0 / n_blocks) / ((j->C + j->G - 1) / j->G)
               == (e[2 + u] / n_blocks) / ((j->C + j->G - 1) / j->G)) {
            nl = 8;
            u++;
        }
        if (j->esize == 1) decode_item_u8(j, i0, nl);
        else if (j->esize == 2) decode_item_u16(j, i0, nl);
        else decode_item_u32(j, i0, nl);
    }
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    /* this worker's tile (2-byte outputs in vector lanes); none: scalar stores */
    uint16_t *tile = j->tile_bytes ? (uint16_t *)malloc(j->tile_bytes) : NULL;
    for (;;) {
        int64_t it = __atomic_fetch_add(&j->counter, 1, __ATOMIC_RELAXED);
        if (it >= j->n_items) break;
        run_item(j, it, tile);
    }
    free(tile);
    return NULL;
}

/* vec: 1 to decode 4- and 8-lane items in AVX2 lanes (where compiled in); the caller
 * passes 1 only when every word index, table index and table byte offset fits int32.
 * Returns -1 on a bad element size (nothing written), else the number of worker threads
 * that could not start (0 normally; the calling thread and the others still do all the
 * work). */
int cg_rans_decode(const uint16_t *words, const int64_t *w_off, const uint32_t *packed,
                   const uint32_t *cum, const uint8_t *lut, const uint16_t *mi,
                   const int64_t *items, int64_t n_items, int64_t L, int64_t T, int64_t C,
                   int64_t G, int64_t B, void *out_k, void *out_v, const void *deq_k,
                   const void *deq_v, int64_t T_out, int64_t R_k, int64_t NS_k, int64_t R_v,
                   int64_t NS_v, int64_t t_stride,
                   int64_t hd, int64_t t_off, int esize, int64_t *err, int n_workers, int vec,
                   int64_t n_models) {
    if (esize != 1 && esize != 2 && esize != 4) return -1;
    if (n_workers < 1) n_workers = 1;
    if (n_workers > 64) n_workers = 64;
    job_t j = {words, w_off, packed, cum, lut, mi, items, n_items, L, T, C, G, B, T_out,
               {R_k, R_v}, {NS_k, NS_v}, t_stride, hd, t_off, out_k, out_v, deq_k, deq_v, err, 0, esize, 0,
               lut, 8, 0};
    uint8_t *fine = NULL;
#ifdef __AVX2__
    j.vec = vec != 0;
    /* A tile of G channels x (one token block) x 16 lanes per worker for 2-byte outputs, at
     * most 8 MiB (else, and with CACHEGEN_NATIVE_TILE=0, the lanes store straight into the
     * output). */
    {
        const int64_t bt = B < T ? B : T;
        const size_t tb = (size_t)G * (size_t)bt * 16 * sizeof(uint16_t);
        const char *tv = getenv("CACHEGEN_NATIVE_TILE");
        if (j.vec && esize == 2 && NL == 16 && tb <= ((size_t)8 << 20) && !(tv && tv[0] == '0'))
            j.tile_bytes = tb;
    }
    /* The vector lanes' LUT at 2^FINE_SHIFT-slot resolution (bucket i: the first candidate
     * s with cum[s] <= i << FINE_SHIFT; the forward scan then rarely runs), 65536 >>
     * FINE_SHIFT bytes per model, built here for at most FINE_LUT_MODELS models; else the
     * caller's 256-slot LUT. */
    if (j.vec && n_models >= 1 && n_models <= FINE_LUT_MODELS
        && (fine = (uint8_t *)calloc((size_t)n_models, FINE_ROW)) != NULL) {
        for (int64_t m = 0; m < n_models; m++) {
            const uint32_t *cm = cum + m * 257;
            uint8_t *row = fine + m * FINE_ROW;
            for (int sy = 0; sy < 256; sy++) {
                uint32_t a = (cm[sy] + (1u << FINE_SHIFT) - 1) >> FINE_SHIFT;
                uint32_t b = (cm[sy + 1] + (1u << FINE_SHIFT) - 1) >> FINE_SHIFT;
                if (b > FINE_ROW) b = FINE_ROW;
                for (uint32_t i = a; i < b; i++) row[i] = (uint8_t)sy;
            }
        }
        j.vlut = fine;
        j.vshift = FINE_SHIFT;
    }
#else
    (void)vec; (void)n_models;
#endif
    pthread_t th[64];
    int started = 0, failed = 0;
    for (int k = 1; k < n_workers; k++) {
        if (pthread_create(&th[started], NULL, worker, &j) == 0) started++;
        else failed++;
    }
    worker(&j);
    for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
    free(fine);
    return failed;
}

/* The source's interface version (checked by the loader). */
int cg_rans_abi(void) { return 3; }

/* Quads per item (the items array has NQ + 1 columns). */
int cg_rans_quads(void) { return NQ; }

/* 1 when the AVX2 lanes are compiled in. */
int cg_rans_simd(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}
