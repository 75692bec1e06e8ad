/* The arguments both paged-attention kernels take from Python (kernels/cpu.py): the batch's
   tensors as integer pointers (data_ptr()), so the extensions need no torch headers, and
   the shapes and strides to walk them. One parser, so the two calls cannot drift apart. */
#ifndef KVROUTE_CPU_PAGED_H
#define KVROUTE_CPU_PAGED_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    float *out;
    const float *query;
    const float *k_cache;
    const float *v_cache;
    const int32_t *block_tables;
    const int32_t *seq_lens;
    const int32_t *query_start_loc;
    const int32_t *seqs; /* the sequences of the batch this call attends */
    Py_ssize_t num_selected;
    Py_ssize_t num_heads, num_kv_heads, head_dim, block_size;
    Py_ssize_t bt_stride, q_stride, out_stride;
    float scale;
    Py_ssize_t window; /* 0: none; else a query at p sees keys p - window + 1 .. p */
} PagedArgs;

/* Fills `a` from (out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
   seqs, num_selected, num_heads, num_kv_heads, head_dim, block_size, bt_stride, q_stride,
   out_stride, scale, window); 0 with a Python error set on bad input. */
static int parse_paged_args(PyObject *args, PagedArgs *a, Py_ssize_t head_dim_multiple) {
    unsigned long long out, query, k_cache, v_cache, tables, lens, starts, seqs;
    if (!PyArg_ParseTuple(args, "KKKKKKKKnnnnnnnnfn", &out, &query, &k_cache, &v_cache, &tables,
                          &lens, &starts, &seqs, &a->num_selected, &a->num_heads,
                          &a->num_kv_heads, &a->head_dim, &a->block_size, &a->bt_stride,
                          &a->q_stride, &a->out_stride, &a->scale, &a->window))
        return 0;
    if (a->num_kv_heads <= 0 || a->num_heads % a->num_kv_heads != 0 || a->head_dim <= 0 ||
        a->head_dim % head_dim_multiple != 0 || a->block_size <= 0 || a->window < 0) {
        PyErr_SetString(PyExc_ValueError, "bad head, block or window shape");
        return 0;
    }
    a->out = (float *)(uintptr_t)out;
    a->query = (const float *)(uintptr_t)query;
    a->k_cache = (const float *)(uintptr_t)k_cache;
    a->v_cache = (const float *)(uintptr_t)v_cache;
    a->block_tables = (const int32_t *)(uintptr_t)tables;
    a->seq_lens = (const int32_t *)(uintptr_t)lens;
    a->query_start_loc = (const int32_t *)(uintptr_t)starts;
    a->seqs = (const int32_t *)(uintptr_t)seqs;
    return 1;
}

#endif
