/* y = x @ W.T + b on the CPU, for the few-row products of a decode step.

Why C: a decode step multiplies a handful of rows by every weight of the model, so it is
bound by reading the weights, once per step. oneDNN's prepacked linear reaches about half
of one core's memory bandwidth at 1-8 rows; this kernel streams a layout made for the
case at close to all of it, and at hundreds of rows (prefills) it is as fast as oneDNN.
BENCHMARKS.md has the figures.

The layout (made once at load by kvroute.kernels.cpu_linear.pack): W's N outputs in tiles
of NT = 32, each tile stored k-major, [ceil(N / 32)][K][32], the last tile zero-padded.
For one tile the kernel walks k once, loading the tile's 32 weights at k (two vectors) and
adding x[r, k] times them into the accumulators of R rows at a time (R = 8 with AVX-512:
16 accumulators, in registers). The weights stream in address order; x's rows, a few KiB,
stay in L1. More rows than R re-read the tile from L2.

Contract (checked by kvroute.kernels.cpu_linear before the call): float32, x's and y's
rows contiguous with the given row strides, pointers as integers (data_ptr()), so no torch
headers are needed. Summation runs in k order per output in fp32, like a plain dot product.

One thread: the caller uses it where the engine runs one torch thread (a CPU replica's
usual share); with more threads oneDNN's parallel GEMM is used instead.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

#define NT 32 /* outputs per tile: two 16-float vectors */

typedef struct {
    float *y;
    const float *x;
    const float *packed;
    const float *bias;
    Py_ssize_t rows, k, n, x_stride, y_stride;
} LinearArgs;

/* The kernel, once per instruction set, as a macro of its vector type: V is a vector of
   W floats (16 for AVX-512, 8 for AVX2, 4 for SSE), so a tile is NT / W vectors, and MR
   rows of accumulators fit the registers: AVX-512's 32 hold 8 x 2 (+2 weights), AVX2's
   16 hold 2 x 4 (+4), SSE's 16 hold 1 x 8 (+8). TILE_ROWS does R rows (a constant after
   inlining) against one tile; LINEAR does every tile, rows in chunks of MR, then 4, 2, 1. */
#define DEFINE_LINEAR(NAME, ATTR, V, W, MR)                                                   \
    ATTR INLINE void NAME##_rows(const LinearArgs *a, const float *tile, Py_ssize_t row,      \
                                 Py_ssize_t n0, const int R) {                               \
        enum { NV = NT / W };                                                                \
        const Py_ssize_t K = a->k, xs = a->x_stride;                                         \
        const float *x = a->x + row * xs;                                                    \
        V acc[MR][NV];                                                                       \
        for (int r = 0; r < R; r++)                                                          \
            for (int j = 0; j < NV; j++) acc[r][j] = (V){0};                                 \
        for (Py_ssize_t k = 0; k < K; k++) {                                                 \
            V w[NV];                                                                         \
            _Pragma("GCC unroll 8") for (int j = 0; j < NV; j++)                             \
                memcpy(&w[j], tile + k * NT + j * W, sizeof(V));                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                            \
                const float xr = x[r * xs + k];                                              \
                _Pragma("GCC unroll 8") for (int j = 0; j < NV; j++) acc[r][j] += xr * w[j]; \
            }                                                                                \
        }                                                                                    \
        const Py_ssize_t width = a->n - n0 < NT ? a->n - n0 : NT;                            \
        for (int r = 0; r < R; r++) {                                                        \
            float buf[NT];                                                                   \
            memcpy(buf, acc[r], sizeof buf);                                                 \
            float *y = a->y + (row + r) * a->y_stride + n0;                                  \
            if (a->bias != NULL)                                                             \
                for (Py_ssize_t j = 0; j < width; j++) y[j] = buf[j] + a->bias[n0 + j];      \
            else                                                                             \
                memcpy(y, buf, sizeof(float) * (size_t)width);                               \
        }                                                                                    \
    }                                                                                        \
    ATTR static void NAME(const LinearArgs *a) {                                             \
        const Py_ssize_t tiles = (a->n + NT - 1) / NT;                                       \
        for (Py_ssize_t t = 0; t < tiles; t++) {                                             \
            const float *tile = a->packed + t * a->k * NT;                                   \
            Py_ssize_t row = 0;                                                              \
            for (; MR >= 8 && row + 8 <= a->rows; row += 8) NAME##_rows(a, tile, row, t * NT, 8); \
            for (; MR >= 4 && row + 4 <= a->rows; row += 4) NAME##_rows(a, tile, row, t * NT, 4); \
            for (; MR >= 2 && row + 2 <= a->rows; row += 2) NAME##_rows(a, tile, row, t * NT, 2); \
            for (; row < a->rows; row++) NAME##_rows(a, tile, row, t * NT, 1);                \
        }                                                                                    \
    }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
DEFINE_LINEAR(linear_avx512, __attribute__((target("avx512f"))), v16, 16, 8)
DEFINE_LINEAR(linear_avx2, __attribute__((target("avx2,fma"))), v8, 8, 2)
DEFINE_LINEAR(linear_baseline, , v4, 4, 1)

static void (*linear_impl)(const LinearArgs *) = linear_baseline;

/* The best the CPU has, or a lower one named by KVROUTE_CPU_ISA ("avx2", "baseline"):
   how the tests run every variant on one machine. */
static void choose_impl(void) {
    const char *cap = getenv("KVROUTE_CPU_ISA");
    const int avx2_ok = cap == NULL || strcmp(cap, "baseline") != 0;
    const int avx512_ok = avx2_ok && (cap == NULL || strcmp(cap, "avx2") != 0);
    __builtin_cpu_init();
    if (avx512_ok && __builtin_cpu_supports("avx512f"))
        linear_impl = linear_avx512;
    else if (avx2_ok && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        linear_impl = linear_avx2;
}
#else
DEFINE_LINEAR(linear_generic, , v4, 4, 2)
static void (*linear_impl)(const LinearArgs *) = linear_generic;
static void choose_impl(void) {}
#endif

static PyObject *linear(PyObject *self, PyObject *args) {
    unsigned long long y, x, packed, bias;
    LinearArgs a;
    if (!PyArg_ParseTuple(args, "KKKKnnnnn", &y, &x, &packed, &bias, &a.rows, &a.k, &a.n,
                          &a.x_stride, &a.y_stride))
        return NULL;
    if (a.rows < 0 || a.k <= 0 || a.n <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad shape");
        return NULL;
    }
    a.y = (float *)(uintptr_t)y;
    a.x = (const float *)(uintptr_t)x;
    a.packed = (const float *)(uintptr_t)packed;
    a.bias = bias ? (const float *)(uintptr_t)bias : NULL;
    Py_BEGIN_ALLOW_THREADS linear_impl(&a);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *isa(PyObject *self, PyObject *unused) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    return PyUnicode_FromString(linear_impl == linear_avx512  ? "avx512"
                                : linear_impl == linear_avx2 ? "avx2"
                                                             : "baseline");
#else
    return PyUnicode_FromString("generic");
#endif
}

static PyMethodDef methods[] = {
    {"linear", linear, METH_VARARGS,
     "y = x @ W.T + b from W packed in 32-output tiles (see kvroute.kernels.cpu_linear)."},
    {"isa", isa, METH_NOARGS, "The instruction set the kernel runs with on this CPU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_linear", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_linear(void) {
    choose_impl();
    return PyModule_Create(&module);
}
