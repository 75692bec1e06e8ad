/* Paged causal prefill attention for the CPU: new tokens (a whole prompt, or a chunk over a
cached prefix) against every key they may see, reading K and V from the block cache.

Why C: torch's SDPA wants contiguous K/V, so the CPU path gathered each sequence's blocks
into a copy first, and below 512 tokens its flash kernel computes the whole score square
even when causal (chunks over a cached prefix even take an explicit mask). Here a tile of
query rows meets only the key tiles at or before its last row, and the one on the diagonal
is masked lane by lane.

Shape of the work, per sequence and KV head: the keys are transposed once into a
[head_dim][keys] buffer, so 16 keys' scores for one query row are one vector of FMAs with
the query element broadcast; a tile of ROWS query rows x 32 keys keeps its 16 score vectors
in registers. The softmax is online (running max and sum per row, as flash attention
does), and the value rows are read where they lie in the cache, two query rows at a time
so each V vector loaded feeds two accumulators.

Contract (kvroute.kernels.cpu checks it before the call): float32; query/out rows are
[num_heads, head_dim] contiguous with a row stride; caches contiguous [num_blocks,
block_size, num_kv_heads, head_dim]; head_dim a multiple of 16; block tables int32 with a
row stride; seq_lens and query_start_loc int32. No sliding window: windowed sequences take
the torch path. Query i of a sequence with q_len new tokens over seq_len - q_len cached
ones sits at position seq_len - q_len + i and sees keys 0 .. that position.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_paged.h"
#include "cpu_simd.h"

#define ROWS 8  /* query rows per tile */
#define KEYS 32 /* keys per tile: two score vectors per row */

typedef PagedArgs PrefillArgs; /* window: always 0 here */

typedef struct { /* per-call scratch, sized for the longest sequence */
    float *kt;          /* [head_dim][padded keys + 16]: one KV head's keys, transposed */
    const float **vrow; /* [padded keys]: each key's V row for the KV head */
    float *acc;         /* [ROWS][head_dim]: output rows being accumulated */
    float *probs;       /* [ROWS][KEYS] */
} Scratch;

/* Out rows r0, r0+1 (already rescaled) += probs[r] . V rows of keys j0 .. j0+n. */
INLINE void weigh_pair(float *o0, float *o1, const float *p0, const float *p1,
                       const float **v, Py_ssize_t n, Py_ssize_t D) {
    Py_ssize_t d = 0;
    for (; d + 32 <= D; d += 32) {
        v16 a0 = load16(o0 + d), a1 = load16(o0 + d + 16);
        v16 b0 = load16(o1 + d), b1 = load16(o1 + d + 16);
        for (Py_ssize_t j = 0; j < n; j++) {
            const v16 x0 = load16(v[j] + d), x1 = load16(v[j] + d + 16);
            a0 += p0[j] * x0;
            a1 += p0[j] * x1;
            b0 += p1[j] * x0;
            b1 += p1[j] * x1;
        }
        store16(o0 + d, a0);
        store16(o0 + d + 16, a1);
        store16(o1 + d, b0);
        store16(o1 + d + 16, b1);
    }
    for (; d < D; d += 16) {
        v16 a = load16(o0 + d), b = load16(o1 + d);
        for (Py_ssize_t j = 0; j < n; j++) {
            const v16 x = load16(v[j] + d);
            a += p0[j] * x;
            b += p1[j] * x;
        }
        store16(o0 + d, a);
        store16(o1 + d, b);
    }
}

/* One query head over one sequence: tiles of ROWS rows, each against the key tiles it
   may see. `kt` and `vrow` hold the head's KV head already. */
KV_CLONES
static void attend_head(const PrefillArgs *a, const Scratch *s, Py_ssize_t qh, Py_ssize_t start,
                        Py_ssize_t q_len, Py_ssize_t seq_len, Py_ssize_t ld) {
    const Py_ssize_t D = a->head_dim, cached = seq_len - q_len;
    const v16 minus_inf = (v16){0} - INFINITY;
    v16 lane_i;
    for (int j = 0; j < 16; j++) lane_i[j] = (float)j;
    for (Py_ssize_t i0 = 0; i0 < q_len; i0 += ROWS) {
        const Py_ssize_t rows = q_len - i0 < ROWS ? q_len - i0 : ROWS;
        const float *q[ROWS];
        float run_max[ROWS], run_sum[ROWS];
        for (Py_ssize_t r = 0; r < ROWS; r++) { /* short tiles repeat their last row */
            const Py_ssize_t i = i0 + (r < rows ? r : rows - 1);
            q[r] = a->query + (start + i) * a->q_stride + qh * D;
            run_max[r] = -INFINITY;
            run_sum[r] = 0.0f;
        }
        memset(s->acc, 0, sizeof(float) * ROWS * D);
        const Py_ssize_t last_key = cached + i0 + rows - 1; /* the tile's last row sees it */
        for (Py_ssize_t j0 = 0; j0 <= last_key; j0 += KEYS) {
            v16 lo[ROWS], hi[ROWS];
            for (int r = 0; r < ROWS; r++) lo[r] = hi[r] = (v16){0};
            const float *kt = s->kt + j0;
            for (Py_ssize_t d = 0; d < D; d++) {
                const v16 k0 = load16(kt + d * ld), k1 = load16(kt + d * ld + 16);
                for (int r = 0; r < ROWS; r++) {
                    lo[r] += q[r][d] * k0;
                    hi[r] += q[r][d] * k1;
                }
            }
            const Py_ssize_t n = last_key + 1 - j0 < KEYS ? last_key + 1 - j0 : KEYS;
            const int masked = j0 + KEYS - 1 > cached + i0; /* reaches past the first row */
            float rescale[ROWS];
            for (int r = 0; r < ROWS; r++) {
                v16 x0 = lo[r] * a->scale, x1 = hi[r] * a->scale;
                if (masked) { /* row i0 + r sees keys up to cached + i0 + r */
                    const float see = (float)(cached + i0 + r - j0);
                    x0 = select16(lane_i > see, minus_inf, x0);
                    x1 = select16(lane_i + 16.0f > see, minus_inf, x1);
                }
                const float m = fmaxf(run_max[r], fmaxf(hmax16(x0), hmax16(x1)));
                rescale[r] = expf(run_max[r] - m); /* 0 on the first tile */
                const v16 p0 = exp16(x0 - m), p1 = exp16(x1 - m);
                run_sum[r] = run_sum[r] * rescale[r] + hsum16(p0 + p1);
                run_max[r] = m;
                store16(s->probs + r * KEYS, p0);
                store16(s->probs + r * KEYS + 16, p1);
            }
            for (int r = 0; r < ROWS; r++) {
                float *o = s->acc + r * D;
                for (Py_ssize_t d = 0; d < D; d += 16) store16(o + d, load16(o + d) * rescale[r]);
            }
            for (int r = 0; r < ROWS; r += 2)
                weigh_pair(s->acc + r * D, s->acc + (r + 1) * D, s->probs + r * KEYS,
                           s->probs + (r + 1) * KEYS, s->vrow + j0, n, D);
        }
        for (Py_ssize_t r = 0; r < rows; r++) {
            float *out = a->out + (start + i0 + r) * a->out_stride + qh * D;
            const float inv = 1.0f / run_sum[r];
            for (Py_ssize_t d = 0; d < D; d++) out[d] = s->acc[r * D + d] * inv;
        }
    }
}

static void attend_seq(const PrefillArgs *a, const Scratch *s, Py_ssize_t seq) {
    const Py_ssize_t D = a->head_dim, Hk = a->num_kv_heads, G = a->num_heads / Hk;
    const Py_ssize_t BS = a->block_size, row_floats = Hk * D;
    const Py_ssize_t start = a->query_start_loc[seq];
    const Py_ssize_t q_len = a->query_start_loc[seq + 1] - start;
    const Py_ssize_t seq_len = a->seq_lens[seq];
    const Py_ssize_t padded = (seq_len + KEYS - 1) / KEYS * KEYS;
    const Py_ssize_t ld = padded + 16; /* kt's row stride: off 4 KiB multiples (aliasing) */
    const int32_t *table = a->block_tables + seq * a->bt_stride;
    for (Py_ssize_t kh = 0; kh < Hk; kh++) {
        for (Py_ssize_t j = 0; j < padded; j++) {
            if (j < seq_len) {
                const Py_ssize_t slot = (Py_ssize_t)table[j / BS] * BS + j % BS;
                const float *k = a->k_cache + slot * row_floats + kh * D;
                for (Py_ssize_t d = 0; d < D; d++) s->kt[d * ld + j] = k[d];
                s->vrow[j] = a->v_cache + slot * row_floats + kh * D;
            } else { /* padding keys: never weighed (masked), but must be finite */
                for (Py_ssize_t d = 0; d < D; d++) s->kt[d * ld + j] = 0.0f;
                s->vrow[j] = s->vrow[0];
            }
        }
        for (Py_ssize_t g = 0; g < G; g++) attend_head(a, s, kh * G + g, start, q_len, seq_len, ld);
    }
}

static int run_prefill(const PrefillArgs *a) {
    Py_ssize_t longest = KEYS;
    for (Py_ssize_t j = 0; j < a->num_selected; j++) {
        const Py_ssize_t len = a->seq_lens[a->seqs[j]];
        longest = len > longest ? len : longest;
    }
    const Py_ssize_t padded = (longest + KEYS - 1) / KEYS * KEYS;
    Scratch s;
    s.kt = malloc(sizeof(float) * (size_t)(a->head_dim * (padded + 16)));
    s.vrow = malloc(sizeof(float *) * (size_t)padded);
    s.acc = malloc(sizeof(float) * (size_t)(ROWS * a->head_dim));
    s.probs = malloc(sizeof(float) * ROWS * KEYS);
    int rc = 0;
    if (s.kt == NULL || s.vrow == NULL || s.acc == NULL || s.probs == NULL)
        rc = -1;
    else
        for (Py_ssize_t j = 0; j < a->num_selected; j++) attend_seq(a, &s, a->seqs[j]);
    free(s.kt);
    free(s.vrow);
    free(s.acc);
    free(s.probs);
    return rc;
}

static PyObject *prefill(PyObject *self, PyObject *args) {
    PrefillArgs a;
    if (!parse_paged_args(args, &a, 16)) return NULL;
    if (a.window != 0) {
        PyErr_SetString(PyExc_ValueError, "windowed prefills take the torch path");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = run_prefill(&a);
    Py_END_ALLOW_THREADS if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"prefill", prefill, METH_VARARGS,
     "Paged causal prefill attention over float32 caches (see kvroute.kernels.cpu)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_prefill", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_prefill(void) { return PyModule_Create(&module); }
