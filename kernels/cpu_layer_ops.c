/* A decoder layer's elementwise work on the CPU, each in one pass over its rows.

Why C: between its GEMMs a Llama-family layer runs a residual add, two RMSNorms (Qwen3: two more, per head, on q and k), the
rotary embedding of q and k, and SiLU(gate) * up. In torch that is ~20 small ops per
layer, each a dispatch and a fresh tensor; on a decode batch of a few rows they cost more
than their arithmetic. Here each is one call that reads its input once.

Contract (checked by kvroute.kernels.cpu_ops before any call): float32, rows contiguous
with the given row strides, pointers as integers (data_ptr()), so no torch headers are
needed. Numerics follow transformers' modules in fp32: RMSNorm sums squares in fp32 and
scales by the weight after normalizing; rotary is the half-split rotation.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

/* residual += x (when x is given); out = residual / rms(residual) * weight, per row. */
KV_CLONES
static void add_rms_norm_rows(float *residual, const float *x, const float *weight, float *out,
                              Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t res_stride,
                              Py_ssize_t x_stride, Py_ssize_t out_stride, float eps) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        float *h = residual + r * res_stride;
        float *o = out + r * out_stride;
        v16 sq = {0};
        float tail = 0.0f;
        Py_ssize_t c = 0;
        if (x != NULL) {
            const float *xr = x + r * x_stride;
            for (; c + 16 <= cols; c += 16) {
                v16 v = load16(h + c) + load16(xr + c);
                store16(h + c, v);
                sq += v * v;
            }
            for (; c < cols; c++) {
                h[c] += xr[c];
                tail += h[c] * h[c];
            }
        } else {
            for (; c + 16 <= cols; c += 16) {
                v16 v = load16(h + c);
                sq += v * v;
            }
            for (; c < cols; c++) tail += h[c] * h[c];
        }
        const float inv = 1.0f / sqrtf((hsum16(sq) + tail) / (float)cols + eps);
        for (c = 0; c + 16 <= cols; c += 16) store16(o + c, load16(weight + c) * (load16(h + c) * inv));
        for (; c < cols; c++) o[c] = weight[c] * (h[c] * inv);
    }
}

/* out = silu(gate) * up, with gate and up the two halves of each row of gate_up. */
KV_CLONES
static void silu_mul_rows(const float *gate_up, float *out, Py_ssize_t rows, Py_ssize_t inter,
                          Py_ssize_t in_stride, Py_ssize_t out_stride) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * in_stride, *u = g + inter;
        float *o = out + r * out_stride;
        Py_ssize_t c = 0;
        for (; c + 16 <= inter; c += 16) {
            v16 x = load16(g + c);
            store16(o + c, x / (1.0f + exp16((v16){0} - x)) * load16(u + c));
        }
        for (; c < inter; c++) o[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
    }
}

/* Rotates heads [0, heads) of each token row in place: x * cos + rotate_half(x) * sin. */
KV_CLONES
static void rotary_rows(float *x, const float *cos, const float *sin, Py_ssize_t tokens,
                        Py_ssize_t heads, Py_ssize_t dim, Py_ssize_t row_stride,
                        Py_ssize_t cs_stride) {
    const Py_ssize_t half = dim / 2;
    for (Py_ssize_t t = 0; t < tokens; t++) {
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (Py_ssize_t h = 0; h < heads; h++) {
            float *a = x + t * row_stride + h * dim, *b = a + half;
            Py_ssize_t d = 0;
            for (; d + 16 <= half; d += 16) {
                v16 x1 = load16(a + d), x2 = load16(b + d);
                store16(a + d, x1 * load16(c + d) - x2 * load16(s + d));
                store16(b + d, x2 * load16(c + half + d) + x1 * load16(s + half + d));
            }
            for (; d < half; d++) {
                const float x1 = a[d], x2 = b[d];
                a[d] = x1 * c[d] - x2 * s[d];
                b[d] = x2 * c[half + d] + x1 * s[half + d];
            }
        }
    }
}

static PyObject *add_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long residual, x, weight, out;
    Py_ssize_t rows, cols, res_stride, x_stride, out_stride;
    float eps;
    if (!PyArg_ParseTuple(args, "KKKKnnnnnf", &residual, &x, &weight, &out, &rows, &cols,
                          &res_stride, &x_stride, &out_stride, &eps))
        return NULL;
    Py_BEGIN_ALLOW_THREADS add_rms_norm_rows(
        (float *)(uintptr_t)residual, (const float *)(uintptr_t)x, (const float *)(uintptr_t)weight,
        (float *)(uintptr_t)out, rows, cols, res_stride, x_stride, out_stride, eps);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* Each of the first `heads` heads of each token's row normalized in place (Qwen3's q and k
   norms, one weight per head dim): the rows of one token's heads lie `dim` apart. */
static PyObject *rms_norm_heads(PyObject *self, PyObject *args) {
    unsigned long long x, weight;
    Py_ssize_t tokens, heads, dim, row_stride;
    float eps;
    if (!PyArg_ParseTuple(args, "KKnnnnf", &x, &weight, &tokens, &heads, &dim, &row_stride, &eps))
        return NULL;
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t t = 0; t < tokens; t++) {
        float *row = (float *)(uintptr_t)x + t * row_stride;
        add_rms_norm_rows(row, NULL, (const float *)(uintptr_t)weight, row, heads, dim, dim, 0,
                          dim, eps);
    }
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *silu_mul(PyObject *self, PyObject *args) {
    unsigned long long gate_up, out;
    Py_ssize_t rows, inter, in_stride, out_stride;
    if (!PyArg_ParseTuple(args, "KKnnnn", &gate_up, &out, &rows, &inter, &in_stride, &out_stride))
        return NULL;
    Py_BEGIN_ALLOW_THREADS silu_mul_rows((const float *)(uintptr_t)gate_up, (float *)(uintptr_t)out,
                                         rows, inter, in_stride, out_stride);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *rotary(PyObject *self, PyObject *args) {
    unsigned long long x, cos, sin;
    Py_ssize_t tokens, heads, dim, row_stride, cs_stride;
    if (!PyArg_ParseTuple(args, "KKKnnnnn", &x, &cos, &sin, &tokens, &heads, &dim, &row_stride,
                          &cs_stride))
        return NULL;
    if (dim % 2 != 0) {
        PyErr_SetString(PyExc_ValueError, "rotary needs an even head dim");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS rotary_rows((float *)(uintptr_t)x, (const float *)(uintptr_t)cos,
                                       (const float *)(uintptr_t)sin, tokens, heads, dim,
                                       row_stride, cs_stride);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"add_rms_norm", add_rms_norm, METH_VARARGS, "residual += x; out = rmsnorm(residual) * w"},
    {"rms_norm_heads", rms_norm_heads, METH_VARARGS, "per-head rmsnorm of each row, in place"},
    {"silu_mul", silu_mul, METH_VARARGS, "out = silu(gate) * up over rows of [gate | up]"},
    {"rotary", rotary, METH_VARARGS, "half-split rotary embedding, in place"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_layer_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_layer_ops(void) { return PyModule_Create(&module); }
