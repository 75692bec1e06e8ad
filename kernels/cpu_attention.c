/* Paged decode attention for the CPU, reading K/V where they lie in the block cache.

Why C: the torch path gathers every decoding sequence's blocks into a contiguous copy each
layer, then runs SDPA with the GQA group (often 2-8 rows) as the query length, a shape its
kernels are slow at. Here each sequence walks its block table once, slot by slot: every
query head's score against the slot's K, a softmax per head, then the V rows weighted into
the output.
No copy, no padding, no mask; a sliding window simply starts the walk later.

Contract (checked by kvroute.kernels.cpu_decode before the call): float32 everywhere;
query/out rows are [num_heads, head_dim] contiguous with a row stride; caches are
contiguous [num_blocks, block_size, num_kv_heads, head_dim]; block tables int32 with a row
stride; seq_lens and query_start_loc int32. Pointers arrive as integers (data_ptr()), so
this module needs no torch headers and builds with the plain C compiler at install time.

The hot loops are compiled for AVX-512, AVX2+FMA and baseline x86-64 (target_clones), and
the loader picks the best the CPU has: one build works on every machine of a cluster.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_paged.h"
#include "cpu_simd.h"

typedef PagedArgs DecodeArgs;

#define TILE 16 /* slots whose V rows are weighted in per pass over the accumulators */
#define PREFETCH 8 /* slots ahead whose K and V rows are fetched while this one is scored */

/* The first 16 scores, or fewer repeated from the first (n >= 1): a start for the max. */
INLINE v16 load16_or(const float *p, Py_ssize_t n) {
    if (n >= 16) return load16(p);
    v16 x;
    for (int j = 0; j < 16; j++) x[j] = p[j < n ? j : 0];
    return x;
}

INLINE float dot(const float *a, const float *b, Py_ssize_t n) {
    v16 acc = {0};
    Py_ssize_t d = 0;
    for (; d + 16 <= n; d += 16) acc += load16(a + d) * load16(b + d);
    float s = hsum16(acc);
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* One sequence, every head. Scores: the walk goes slot by slot (a slot's heads are
   contiguous), so each cached K row is read once, in address order within its block.
   Values: TILE slots at a time; for each query head its output row is loaded once per
   tile, the tile's V rows (a few KiB, in L1) weighted in, and stored back. */
KV_CLONES
static void attend_seq(const DecodeArgs *a, Py_ssize_t seq, float *scores, float *acc,
                       const float **rows) {
    const Py_ssize_t D = a->head_dim, H = a->num_heads, Hk = a->num_kv_heads, G = H / Hk;
    const Py_ssize_t BS = a->block_size;
    const Py_ssize_t len = a->seq_lens[seq];
    const Py_ssize_t lo = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const Py_ssize_t n = len - lo;
    const Py_ssize_t row = a->query_start_loc[seq];
    const int32_t *table = a->block_tables + seq * a->bt_stride;
    const float *q = a->query + row * a->q_stride;

    const Py_ssize_t row_floats = Hk * D;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t p = lo + i;
        const Py_ssize_t slot = (Py_ssize_t)table[p / BS] * BS + p % BS;
        const float *k = a->k_cache + slot * row_floats;
        rows[i] = a->v_cache + slot * row_floats;
        if (i + PREFETCH < n) {
            const Py_ssize_t pp = p + PREFETCH;
            const Py_ssize_t ahead = (Py_ssize_t)table[pp / BS] * BS + pp % BS;
            const char *kn = (const char *)(a->k_cache + ahead * row_floats);
            const char *vn = (const char *)(a->v_cache + ahead * row_floats);
            /* Into L2, not L1 (locality 1): a slot's rows are 24 lines, more than L1's
               miss buffers hold, and requests that wait for an L1 buffer stall the walk
               (30 layers at 8 x 370 tokens: 155 -> ~120 ns a slot on the VM). */
            for (Py_ssize_t b = 0; b < row_floats * 4; b += 64) {
                __builtin_prefetch(kn + b, 0, 1);
                __builtin_prefetch(vn + b, 0, 1);
            }
        }
        for (Py_ssize_t qh = 0; qh < H; qh++)
            scores[qh * n + i] = dot(q + qh * D, k + (qh / G) * D, D) * a->scale;
    }
    for (Py_ssize_t qh = 0; qh < H; qh++) {
        float *sq = scores + qh * n;
        v16 mv = load16_or(sq, n);
        Py_ssize_t i = 16;
        for (; i + 16 <= n; i += 16) {
            v16 x = load16(sq + i);
            v16i gt = x > mv;
            mv = (v16)(((v16i)x & gt) | ((v16i)mv & ~gt));
        }
        float m = mv[0];
        for (int j = 1; j < 16; j++) m = mv[j] > m ? mv[j] : m;
        for (; i < n; i++) m = sq[i] > m ? sq[i] : m;
        v16 acc = {0};
        i = 0;
        for (; i + 16 <= n; i += 16) {
            v16 e = exp16(load16(sq + i) - m);
            memcpy(sq + i, &e, sizeof e);
            acc += e;
        }
        float sum = hsum16(acc);
        for (; i < n; i++) {
            sq[i] = expf(sq[i] - m);
            sum += sq[i];
        }
        const float inv = 1.0f / sum;
        for (i = 0; i < n; i++) sq[i] *= inv;
    }
    memset(acc, 0, sizeof(float) * H * D);
    for (Py_ssize_t t0 = 0; t0 < n; t0 += TILE) {
        const Py_ssize_t t1 = t0 + TILE < n ? t0 + TILE : n;
        for (Py_ssize_t qh = 0; qh < H; qh++) {
            const float *w = scores + qh * n;
            const Py_ssize_t off = (qh / G) * D;
            float *o = acc + qh * D;
            Py_ssize_t d = 0;
            for (; d + 64 <= D; d += 64) { /* four registers of the row at a time */
                v16 r0 = load16(o + d), r1 = load16(o + d + 16);
                v16 r2 = load16(o + d + 32), r3 = load16(o + d + 48);
                for (Py_ssize_t i = t0; i < t1; i++) {
                    const float *v = rows[i] + off + d;
                    r0 += w[i] * load16(v);
                    r1 += w[i] * load16(v + 16);
                    r2 += w[i] * load16(v + 32);
                    r3 += w[i] * load16(v + 48);
                }
                memcpy(o + d, &r0, sizeof r0);
                memcpy(o + d + 16, &r1, sizeof r1);
                memcpy(o + d + 32, &r2, sizeof r2);
                memcpy(o + d + 48, &r3, sizeof r3);
            }
            for (; d + 16 <= D; d += 16) {
                v16 r = load16(o + d);
                for (Py_ssize_t i = t0; i < t1; i++) r += w[i] * load16(rows[i] + off + d);
                memcpy(o + d, &r, sizeof r);
            }
            for (; d < D; d++)
                for (Py_ssize_t i = t0; i < t1; i++) o[d] += w[i] * rows[i][off + d];
        }
    }
    memcpy(a->out + row * a->out_stride, acc, sizeof(float) * H * D);
}

static int run_decode(const DecodeArgs *a) {
    Py_ssize_t longest = 1;
    for (Py_ssize_t j = 0; j < a->num_selected; j++) {
        Py_ssize_t len = a->seq_lens[a->seqs[j]];
        if (a->window > 0 && len > a->window) len = a->window;
        longest = len > longest ? len : longest;
    }
    float *scores = malloc(sizeof(float) * (size_t)(a->num_heads * longest));
    float *acc = malloc(sizeof(float) * (size_t)(a->num_heads * a->head_dim));
    const float **rows = malloc(sizeof(float *) * (size_t)longest);
    if (scores == NULL || acc == NULL || rows == NULL) {
        free(scores);
        free(acc);
        free(rows);
        return -1;
    }
    for (Py_ssize_t j = 0; j < a->num_selected; j++)
        attend_seq(a, a->seqs[j], scores, acc, rows);
    free(scores);
    free(acc);
    free(rows);
    return 0;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    DecodeArgs a;
    if (!parse_paged_args(args, &a, 1)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = run_decode(&a);
    Py_END_ALLOW_THREADS if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "Paged decode attention over float32 caches, in place (see kvroute.kernels.cpu_decode)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_attention(void) { return PyModule_Create(&module); }
