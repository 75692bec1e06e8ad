/*
 * kvroute.events._chain -- the xxh3_128 block-hash chain loop in C.
 *
 * Why: in pure Python the chain costs ~0.3 us per block (slice, concatenation, one call)
 * plus ~8 ns per token to turn a list into uint32 bytes; this does both in one C call.
 *
 * What it does NOT define: the byte layout. Python (events/hashing.py) passes the parent
 * digest, the per-block header and the extra-key tails; each block's message here is
 *
 *     digest of the previous block (16) | header | block tokens (uint32 LE) | tail
 *
 * with tail0 for the first block of this call and tail for every later one. The digest is
 * XXH3-128 in canonical form (high64 then low64, each big-endian), as xxhash's
 * xxh3_128_digest returns it.
 *
 * XXH3-128 itself is not compiled in: bind() resolves XXH3_128bits at run time with
 * dlopen/dlsym from a shared object Python names (the xxhash wheel's own extension), so
 * there is no link-time dependency and the pure-Python and C paths share one hash
 * implementation. Python self-checks the result against xxhash before using it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

/* xxHash's public ABI (xxhash.h >= 0.8): a 128-bit result returned by value. */
typedef struct {
    unsigned long long low64;
    unsigned long long high64;
} XXH128_hash_t;
typedef XXH128_hash_t (*xxh3_128_fn)(const void *data, size_t len);

/* One process, one XXH3: set by bind(); NULL until then. */
static xxh3_128_fn xxh3_128 = NULL;

/* Blocks below this are hashed without releasing the GIL (the release costs more). */
#define NOGIL_MIN_BLOCKS 64

static PyObject *
chain_bind(PyObject *module, PyObject *arg)
{
    (void)module;
    PyObject *path_bytes = NULL;
    if (!PyUnicode_FSConverter(arg, &path_bytes)) {
        return NULL;
    }
    void *handle = dlopen(PyBytes_AS_STRING(path_bytes), RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) {
        const char *err = dlerror();
        PyErr_Format(PyExc_OSError, "dlopen(%R) failed: %s", arg, err ? err : "unknown error");
        Py_DECREF(path_bytes);
        return NULL;
    }
    Py_DECREF(path_bytes);
    dlerror();
    void *sym = dlsym(handle, "XXH3_128bits");
    if (sym == NULL) {
        const char *err = dlerror();
        PyErr_Format(PyExc_OSError, "%R has no symbol XXH3_128bits: %s", arg,
                     err ? err : "unknown error");
        dlclose(handle);
        return NULL;
    }
    /* The handle is never closed: the function may be in use by another thread.
       memcpy: ISO C has no object-to-function pointer cast; POSIX guarantees it works. */
    memcpy(&xxh3_128, &sym, sizeof xxh3_128);
    Py_RETURN_NONE;
}

static inline void
store_canonical(unsigned char *out, XXH128_hash_t h)
{
    for (int i = 0; i < 8; i++) {
        out[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
    }
}

/*
 * Tokens of a list or tuple as uint32 little-endian into `out`. Returns 1 on success, 0 when
 * an item is not an exact int in [0, 2**32 - 1] (no exception set: Python then converts the
 * input itself, raising the same errors as the pure path).
 */
static int
fill_from_sequence(PyObject *seq, Py_ssize_t n, unsigned char *out)
{
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            return 0;
        }
        unsigned long v = PyLong_AsUnsignedLong(item);
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (v > 0xFFFFFFFFUL) {
            return 0;
        }
        unsigned char *p = out + 4 * i;
        p[0] = (unsigned char)v;
        p[1] = (unsigned char)(v >> 8);
        p[2] = (unsigned char)(v >> 16);
        p[3] = (unsigned char)(v >> 24);
    }
    return 1;
}

static void
run_chain(const unsigned char *tokens, Py_ssize_t n_blocks, Py_ssize_t block_bytes,
          unsigned char *msg, Py_ssize_t prefix_len, const char *tail0, Py_ssize_t tail0_len,
          const char *tail, Py_ssize_t tail_len, unsigned char *digests)
{
    /* msg already holds the parent digest and the header; prefix_len covers both. */
    unsigned char *body = msg + prefix_len;
    for (Py_ssize_t i = 0; i < n_blocks; i++) {
        memcpy(body, tokens + i * block_bytes, (size_t)block_bytes);
        const char *t = i == 0 ? tail0 : tail;
        Py_ssize_t t_len = i == 0 ? tail0_len : tail_len;
        if (t_len) {
            memcpy(body + block_bytes, t, (size_t)t_len);
        }
        XXH128_hash_t h = xxh3_128(msg, (size_t)(prefix_len + block_bytes + t_len));
        unsigned char *d = digests + 16 * i;
        store_canonical(d, h);
        memcpy(msg, d, 16);
    }
}

/*
 * xxh3_chain(tokens, n_tokens, block_size, parent, header, tail0, tail) -> list[bytes] | None
 *
 * tokens: a list or tuple of ints, or any buffer of n_tokens uint32 little-endian values.
 * Returns None (no exception) when a list/tuple item is not an exact int in uint32 range.
 */
static PyObject *
chain_xxh3_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "xxh3_chain() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    if (xxh3_128 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvroute.events._chain: bind() was not called");
        return NULL;
    }
    PyObject *tokens = args[0];
    Py_ssize_t n_tokens = PyLong_AsSsize_t(args[1]);
    if (n_tokens == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    for (int i = 3; i < 7; i++) {
        if (!PyBytes_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "xxh3_chain() argument %d must be bytes, not %.100s",
                         i + 1, Py_TYPE(args[i])->tp_name);
            return NULL;
        }
    }
    if (PyBytes_GET_SIZE(args[3]) != 16) {
        PyErr_SetString(PyExc_ValueError, "parent digest must be 16 bytes");
        return NULL;
    }
    if (block_size <= 0 || n_tokens < 0 || n_tokens % block_size != 0 ||
        block_size > PY_SSIZE_T_MAX / 4) {
        PyErr_SetString(PyExc_ValueError,
                        "n_tokens must be a non-negative multiple of a positive block_size");
        return NULL;
    }
    Py_ssize_t n_blocks = n_tokens / block_size;
    if (n_blocks > PY_SSIZE_T_MAX / 16 || n_tokens > PY_SSIZE_T_MAX / 4) {
        return PyErr_NoMemory();
    }
    Py_ssize_t block_bytes = 4 * block_size;
    Py_ssize_t header_len = PyBytes_GET_SIZE(args[4]);
    Py_ssize_t tail0_len = PyBytes_GET_SIZE(args[5]);
    Py_ssize_t tail_len = PyBytes_GET_SIZE(args[6]);
    Py_ssize_t prefix_len = 16 + header_len;
    Py_ssize_t max_tail = tail0_len > tail_len ? tail0_len : tail_len;

    PyObject *result = NULL;
    unsigned char *owned_tokens = NULL;
    unsigned char *digests = NULL;
    unsigned char *msg = NULL;
    Py_buffer view = {0};
    int have_view = 0;
    const unsigned char *tok_bytes;
    /* The bytes arguments are immutable and referenced by the caller for the whole call. */
    const char *tail0 = PyBytes_AS_STRING(args[5]);
    const char *tail = PyBytes_AS_STRING(args[6]);

    if (PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) {
        if (PySequence_Fast_GET_SIZE(tokens) < n_tokens) {
            PyErr_SetString(PyExc_ValueError, "fewer tokens than n_tokens");
            return NULL;
        }
        owned_tokens = PyMem_Malloc(n_tokens > 0 ? (size_t)(4 * n_tokens) : 1);
        if (owned_tokens == NULL) {
            return PyErr_NoMemory();
        }
        /* No Python code runs while reading exact ints, so the list cannot change. */
        if (!fill_from_sequence(tokens, n_tokens, owned_tokens)) {
            PyMem_Free(owned_tokens);
            Py_RETURN_NONE;
        }
        tok_bytes = owned_tokens;
    }
    else {
        if (PyObject_GetBuffer(tokens, &view, PyBUF_SIMPLE) < 0) {
            return NULL;
        }
        have_view = 1;
        if (view.len < 4 * n_tokens) {
            PyErr_SetString(PyExc_ValueError, "token buffer shorter than 4 * n_tokens bytes");
            goto done;
        }
        tok_bytes = view.buf;
    }

    digests = PyMem_Malloc(n_blocks > 0 ? (size_t)(16 * n_blocks) : 1);
    msg = PyMem_Malloc((size_t)(prefix_len + block_bytes + max_tail));
    if (digests == NULL || msg == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(msg, PyBytes_AS_STRING(args[3]), 16);
    memcpy(msg + 16, PyBytes_AS_STRING(args[4]), (size_t)header_len);
    if (n_blocks >= NOGIL_MIN_BLOCKS) {
        Py_BEGIN_ALLOW_THREADS
        run_chain(tok_bytes, n_blocks, block_bytes, msg, prefix_len, tail0, tail0_len, tail,
                  tail_len, digests);
        Py_END_ALLOW_THREADS
    }
    else {
        run_chain(tok_bytes, n_blocks, block_bytes, msg, prefix_len, tail0, tail0_len, tail,
                  tail_len, digests);
    }

    result = PyList_New(n_blocks);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_blocks; i++) {
        PyObject *d = PyBytes_FromStringAndSize((const char *)digests + 16 * i, 16);
        if (d == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, d);
    }

done:
    if (have_view) {
        PyBuffer_Release(&view);
    }
    PyMem_Free(owned_tokens);
    PyMem_Free(digests);
    PyMem_Free(msg);
    return result;
}

static PyMethodDef chain_methods[] = {
    {"bind", (PyCFunction)chain_bind, METH_O,
     "bind(path) -> None\n\nResolve XXH3_128bits from the shared object at path (dlopen)."},
    {"xxh3_chain", (PyCFunction)(void (*)(void))chain_xxh3_chain, METH_FASTCALL,
     "xxh3_chain(tokens, n_tokens, block_size, parent, header, tail0, tail)"
     " -> list[bytes] | None\n\n"
     "Chained XXH3-128 digests of n_tokens // block_size blocks; None when a list/tuple\n"
     "item is not an exact int in uint32 range (the caller converts and retries)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT,
    "kvroute.events._chain",
    "The xxh3_128 block-hash chain loop in C (optional accelerator for events.hashing).",
    -1,
    chain_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    return PyModule_Create(&chain_module);
}
