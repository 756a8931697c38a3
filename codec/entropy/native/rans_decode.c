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
 * Work items: (first stream, lanes) rows as codec.entropy.rans_cpu._work_items: 4 streams of one
 * (kv, layer, token block) and 4 consecutive full channel groups, decoded in lockstep, or
 * one stream. Workers (the calling thread plus n_workers - 1 pthreads) take items from
 * one atomic counter (dynamic scheduling: a thread slowed by other work holds no share).
 * The Python side merges two quads of one (kv, layer, token block) into one item of 8
 * lanes (streams i0 + k * n_blocks, k < 8: 8 independent dependency chains in flight).
 *
 * Symbol s of (kv, layer, t, c) is written as
 *   out[layer, t_off + t, c] = deq[layer, t * t_stride + c / hd, s]
 * with out [L, T_out, C] and deq [L, R, NS] of one element size (1, 2 or 4 bytes).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const uint16_t *words;   /* payload as u16, zero padded */
    const int64_t *w_off;    /* [n_streams + 1] word offsets */
    const uint32_t *packed;  /* [n_models, 256] freq | cum << 16 */
    const uint32_t *cum;     /* [n_models, 257] */
    const uint8_t *lut;      /* [n_models, 256] first candidate symbol per slot >> 8 */
    const uint16_t *mi;      /* [2, L, C] model of (kv, layer, channel) */
    const int64_t *items;    /* [n_items, 2] (first stream, lanes) */
    int64_t n_items, L, T, C, G, B, T_out, R[2], NS[2], t_stride, hd, t_off;
    void *out_k, *out_v;
    const void *deq_k, *deq_v;
    int64_t *err;            /* [n_streams] */
    int64_t counter;         /* next item (atomic) */
    int esize;               /* 1, 2 or 4 bytes per element */
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
static void NAME(job_t *j, int64_t it) {                                            \
    const int64_t C = j->C, G = j->G, B = j->B, T = j->T;                                   \
    const int64_t n_groups = (C + G - 1) / G, n_blocks = (T + B - 1) / B;                   \
    const int64_t i0 = j->items[2 * it], nl = j->items[2 * it + 1];                    \
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
        if (nl == 8) LANES_LOOP(TYPE, 8)                                                    \
        else if (nl == 4) LANES_LOOP(TYPE, 4)                                               \
        else LANES_LOOP(TYPE, 1)                                                            \
    }                                                                                       \
    for (int64_t k = 0; k < nl; k++) j->err[sid[k]] = final_err(&ln[k], j->w_off[sid[k] + 1]); \
}

DEFINE_DECODE(uint8_t, decode_item_u8)
DEFINE_DECODE(uint16_t, decode_item_u16)
DEFINE_DECODE(uint32_t, decode_item_u32)

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    for (;;) {
        int64_t it = __atomic_fetch_add(&j->counter, 1, __ATOMIC_RELAXED);
        if (it >= j->n_items) break;
        if (j->esize == 1) decode_item_u8(j, it);
        else if (j->esize == 2) decode_item_u16(j, it);
        else decode_item_u32(j, it);
    }
    return NULL;
}

/* Returns -1 on a bad element size (nothing written), else the number of worker threads
 * that could not start (0 normally; the calling thread and the others still do all the
 * work). */
int cg_rans_decode(const uint16_t *words, const int64_t *w_off, const uint32_t *packed,
                   const uint32_t *cum, const uint8_t *lut, const uint16_t *mi,
                   const int64_t *items, int64_t n_items, int64_t L, int64_t T, int64_t C,
                   int64_t G, int64_t B, void *out_k, void *out_v, const void *deq_k,
                   const void *deq_v, int64_t T_out, int64_t R_k, int64_t NS_k, int64_t R_v,
                   int64_t NS_v, int64_t t_stride,
                   int64_t hd, int64_t t_off, int esize, int64_t *err, int n_workers) {
    if (esize != 1 && esize != 2 && esize != 4) return -1;
    if (n_workers < 1) n_workers = 1;
    if (n_workers > 64) n_workers = 64;
    job_t j = {words, w_off, packed, cum, lut, mi, items, n_items, L, T, C, G, B, T_out,
               {R_k, R_v}, {NS_k, NS_v}, t_stride, hd, t_off, out_k, out_v, deq_k, deq_v, err, 0, esize};
    pthread_t th[64];
    int started = 0, failed = 0;
    for (int k = 1; k < n_workers; k++) {
        if (pthread_create(&th[started], NULL, worker, &j) == 0) started++;
        else failed++;
    }
    worker(&j);
    for (int k = 0; k < started; k++) pthread_join(th[k], NULL);
    return failed;
}

/* The source's interface version (checked by the loader). */
int cg_rans_abi(void) { return 1; }
