/* The sparse delta's two passes in C: `encode_sparse` and `apply_sparse` (see reshard/delta.py, which owns the
 * format and keeps the same work in numpy for where this module is not built).
 *
 * Why: at RL change rates a delta's CPU is its hosts' cost, and numpy does a sparse encode in six passes (compare,
 * index search, gaps, varint lengths, varint bytes, gather) and a decode in as many, each a Python call. Here each
 * is one pass: encode compares 64 bytes at a time and, where they differ, writes each changed element's gap and
 * value; apply copies the base, then reads each gap and writes its value. Both release the GIL.
 *
 * A sender's boxes are often strided regions of its tiles (a row-parallel weight's columns): encode and `digest`
 * read any strided buffer (the buffer protocol's shape and strides) run by run, so neither end packs a box first.
 * `digest` is XXH3-64 (seed 0) over a buffer's bytes in C order, the same number `xxhash.xxh3_64_intdigest` gives
 * the packed bytes (xxHash's own header and x86 dispatch, vendored in _vendor/ under its BSD-2-Clause license).
 *
 * `pair_runs` cuts one NIXL WRITE's two descriptor lists in one pass (reshard.server.transport.nixl_memory's
 * `pair_descs`, which keeps numpy's way for where this module is not built): numpy's takes about 20 calls.
 *
 * Only plain C and the buffer protocol: no numpy headers, so it builds wherever pip finds a C compiler.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "reshard._delta_kernel reads elements as little-endian words; reshard.delta's numpy path serves other hosts"
#endif

#if defined(__x86_64__) || defined(_M_X64)
/* xxHash's runtime dispatch: its AVX-512, AVX2 or SSE2 code, whichever this CPU runs (a build for the baseline
 * alone hashes at about half xxhash's speed). It includes _vendor/xxhash.h itself, inline. */
#include "_vendor/xxh_x86dispatch.c"
#define XXH3_UPDATE XXH3_64bits_update_dispatch
#else
#define XXH_INLINE_ALL
#include "_vendor/xxhash.h"
#define XXH3_UPDATE XXH3_64bits_update
#endif

#define MAX_VARINT_NBYTES 9 /* as reshard.delta._MAX_VARINT_NBYTES: 63 bits */

/* A buffer as runs of contiguous bytes in C order: `run` bytes at `base`, then at each step of the `nouter` outer
 * dimensions (their `shape` and `strides`). A C-contiguous buffer is one run. */
typedef struct {
    const uint8_t *base;
    Py_ssize_t run, nruns;
    int nouter;
    Py_ssize_t shape[64], strides[64];
} Runs;

/* How many trailing dimensions of a strided buffer lie contiguous: each dimension's stride is the bytes of all
 * those inside it. */
static int contiguous_tail(const Py_buffer *v) {
    Py_ssize_t run = v->itemsize;
    int t = 0;
    for (int d = v->ndim - 1; d >= 0 && (v->shape[d] == 1 || v->strides[d] == run); d--, t++) run *= v->shape[d];
    return t;
}

/* `v` as runs of its last `tail` dimensions (all of them contiguous). */
static void runs_of(const Py_buffer *v, int tail, Runs *r) {
    r->base = (const uint8_t *)v->buf;
    if (v->ndim == 0 || v->strides == NULL) { /* a C-contiguous buffer the exporter gave no strides for */
        r->run = v->len;
        r->nruns = v->len ? 1 : 0;
        r->nouter = 0;
        return;
    }
    r->nouter = v->ndim - tail;
    r->run = v->itemsize;
    for (int d = r->nouter; d < v->ndim; d++) r->run *= v->shape[d];
    r->nruns = 1;
    for (int d = 0; d < r->nouter; d++) {
        r->shape[d] = v->shape[d];
        r->strides[d] = v->strides[d];
        r->nruns *= v->shape[d];
    }
    if (!r->run) r->nruns = 0;
}

/* Step `at` (run r's address, with its outer index `idx`) to the next run. */
static inline const uint8_t *next_run(const Runs *r, Py_ssize_t *idx, const uint8_t *at) {
    for (int d = r->nouter - 1; d >= 0; d--) {
        at += r->strides[d];
        if (++idx[d] < r->shape[d]) return at;
        at -= r->strides[d] * r->shape[d];
        idx[d] = 0;
    }
    return at;
}

/* A strided buffer (any layout numpy makes) with its shape and strides, or a NULL-strides contiguous one. */
static int get_strided(PyObject *obj, Py_buffer *v, int writable) {
    if (PyObject_GetBuffer(obj, v, (writable ? PyBUF_WRITABLE : 0) | PyBUF_STRIDES) < 0) return -1;
    if (v->ndim > 64) {
        PyBuffer_Release(v);
        PyErr_SetString(PyExc_ValueError, "a buffer of more than 64 dimensions");
        return -1;
    }
    return 0;
}

/* Emit element i: its gap as LEB128 into varints (capacity vcap; -1 when it runs out) and its value, at value. */
static inline int emit(Py_ssize_t i, Py_ssize_t *prev, const uint8_t *value, int s, uint8_t *varints,
                       Py_ssize_t vcap, Py_ssize_t *nv, uint8_t *values, Py_ssize_t *k) {
    uint64_t gap = (uint64_t)(i - *prev - 1);
    *prev = i;
    Py_ssize_t at = *nv;
    while (gap >= 0x80) {
        if (at >= vcap) return -1;
        varints[at++] = (uint8_t)((gap & 0x7F) | 0x80);
        gap >>= 7;
    }
    if (at >= vcap) return -1;
    varints[at++] = (uint8_t)gap;
    *nv = at;
    memcpy(values + (*k) * s, value, (size_t)s);
    (*k)++;
    return 0;
}

#if defined(__SSE2__) /* every x86-64: sixteen bytes a compare */
#include <emmintrin.h>

/* A bit per byte of the 64 at a and b: set where they differ. */
static inline uint64_t differ64(const uint8_t *a, const uint8_t *b) {
    uint64_t same = 0;
    for (int j = 0; j < 4; j++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(a + 16 * j));
        __m128i y = _mm_loadu_si128((const __m128i *)(b + 16 * j));
        same |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)) << (16 * j);
    }
    return ~same;
}
#else
static inline uint64_t differ64(const uint8_t *a, const uint8_t *b) {
    uint64_t differ = 0;
    for (int j = 0; j < 64; j++) differ |= (uint64_t)(a[j] != b[j]) << j;
    return differ;
}
#endif

/* Returns 0 with *k and *nv set, or -1 where the varints reach vcap (a bitmap is then at least as small).
 * Old and new are compared 64 bytes at a time, run by run (runs of one length, in step); in a block where any byte
 * differs, each changed element is found by the trailing zeros of the block's mask, and its bits cleared, so a
 * block without a change costs a compare. */
static inline __attribute__((always_inline)) int encode_core(const Runs *ra, const Runs *rb, int s,
                                                             uint8_t *restrict varints, Py_ssize_t vcap,
                                                             uint8_t *restrict values, Py_ssize_t *k,
                                                             Py_ssize_t *nv) {
    Py_ssize_t prev = -1, ia[64] = {0}, ib[64] = {0};
    *k = 0;
    *nv = 0;
    const int shift = s == 1 ? 0 : s == 2 ? 1 : s == 4 ? 2 : 3; /* log2 of the itemsize */
    const uint64_t element = s == 8 ? 0xFF : (((uint64_t)1 << s) - 1); /* one element's bits in a mask */
    const Py_ssize_t per = 64 / s, blocks = ra->run / 64, n = ra->run / s;
    const uint8_t *a = ra->base, *b = rb->base;
    for (Py_ssize_t r = 0; r < ra->nruns; r++) {
        const Py_ssize_t first = r * n;
        for (Py_ssize_t blk = 0; blk < blocks; blk++) {
            uint64_t d = differ64(a + blk * 64, b + blk * 64);
            while (d) {
                int j = __builtin_ctzll(d) >> shift;
                d &= ~(element << (j << shift));
                Py_ssize_t i = blk * per + j;
                if (emit(first + i, &prev, b + i * s, s, varints, vcap, nv, values, k)) return -1;
            }
        }
        for (Py_ssize_t i = blocks * per; i < n; i++) {
            if (memcmp(a + i * s, b + i * s, (size_t)s) &&
                emit(first + i, &prev, b + i * s, s, varints, vcap, nv, values, k)) return -1;
        }
        a = next_run(ra, ia, a);
        b = next_run(rb, ib, b);
    }
    return 0;
}

#define SAMPLE_EVERY 16 /* blocks */

/* Whether one element in eight or more changed, by a sample of every SAMPLE_EVERY-th 64-byte block: a sparse delta
 * is then no smaller than a bitmap (every gap costs a byte), so the encode would emit that many elements and give
 * up. Where most changed, that was slower than numpy's whole bitmap encode; the sample costs a sixteenth of a
 * compare. Small boxes are not sampled. */
static int mostly_changed(const Runs *ra, const Runs *rb, int s) {
    const int shift = s == 1 ? 0 : s == 2 ? 1 : s == 4 ? 2 : 3;
    const uint64_t element = s == 8 ? 0xFF : (((uint64_t)1 << s) - 1);
    const Py_ssize_t blocks = ra->run / 64;
    Py_ssize_t sampled = 0, changed = 0, ia[64] = {0}, ib[64] = {0};
    const uint8_t *a = ra->base, *b = rb->base;
    for (Py_ssize_t r = 0; r < ra->nruns; r++) {
        for (Py_ssize_t blk = 0; blk < blocks; blk += SAMPLE_EVERY) {
            uint64_t d = differ64(a + blk * 64, b + blk * 64);
            while (d) {
                int j = __builtin_ctzll(d) >> shift;
                d &= ~(element << (j << shift));
                changed++;
            }
            sampled += 64 >> shift;
        }
        a = next_run(ra, ia, a);
        b = next_run(rb, ib, b);
    }
    return sampled >= 4096 && changed * 8 >= sampled;
}

/* Each pass once per itemsize, the size a constant there: a value's copy is then one load and one store, not a call
 * into the C library's memcpy per changed element. */
static int encode_sized(const Runs *a, const Runs *b, int s, uint8_t *varints, Py_ssize_t vcap, uint8_t *values,
                        Py_ssize_t *k, Py_ssize_t *nv) {
    switch (s) {
    case 1: return encode_core(a, b, 1, varints, vcap, values, k, nv);
    case 2: return encode_core(a, b, 2, varints, vcap, values, k, nv);
    case 4: return encode_core(a, b, 4, varints, vcap, values, k, nv);
    default: return encode_core(a, b, 8, varints, vcap, values, k, nv);
    }
}

static int unit_size(int s) { return s == 1 || s == 2 || s == 4 || s == 8; }

PyDoc_STRVAR(encode_sparse_doc,
"encode_sparse(old, new, itemsize, out) -> (k, nvarint) or None\n\n"
"The sparse delta of two buffers of one shape (any strides; or both C-contiguous, of one length), elements of\n"
"itemsize (1, 2, 4 or 8) bytes in C order, written into out (writable, at least vcap * (1 + itemsize) bytes,\n"
"vcap = ceil(n / 8)): the varint gaps at out[:nvarint], the k changed values right after them. None where the\n"
"gaps would take vcap bytes or more: a bitmap is then as small.");

static PyObject *encode_sparse(PyObject *self, PyObject *args) {
    PyObject *old_obj, *new_obj;
    Py_buffer old, new_, out;
    int s;
    if (!PyArg_ParseTuple(args, "OOiw*", &old_obj, &new_obj, &s, &out)) return NULL;
    if (get_strided(old_obj, &old, 0) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    if (get_strided(new_obj, &new_, 0) < 0) {
        PyBuffer_Release(&old);
        PyBuffer_Release(&out);
        return NULL;
    }
    PyObject *result = NULL;
    Runs ra, rb;
    int both_packed = PyBuffer_IsContiguous(&old, 'C') && PyBuffer_IsContiguous(&new_, 'C');
    int same_shape = old.ndim == new_.ndim && old.itemsize == new_.itemsize;
    for (int d = 0; same_shape && d < old.ndim; d++) same_shape = old.shape[d] == new_.shape[d];
    if (!unit_size(s) || old.len != new_.len || old.len % s || !(both_packed || same_shape)) {
        PyErr_Format(PyExc_ValueError, "encode_sparse takes two buffers of one length in elements of 1, 2, 4 or 8 "
                     "bytes, of one shape unless both are C-contiguous; got %zd and %zd bytes of itemsize %d",
                     old.len, new_.len, s);
        goto done;
    }
    if (both_packed) {
        ra.base = (const uint8_t *)old.buf, rb.base = (const uint8_t *)new_.buf;
        ra.run = rb.run = old.len, ra.nruns = rb.nruns = old.len ? 1 : 0, ra.nouter = rb.nouter = 0;
    } else {
        int ta = contiguous_tail(&old), tb = contiguous_tail(&new_), t = ta < tb ? ta : tb;
        runs_of(&old, t, &ra);
        runs_of(&new_, t, &rb);
        if (ra.run % s) {
            PyErr_Format(PyExc_ValueError, "encode_sparse reads whole elements of %d bytes; the buffers' contiguous "
                         "runs are %zd bytes", s, ra.run);
            goto done;
        }
    }
    Py_ssize_t n = old.len / s, vcap = (n + 7) / 8;
    if (out.len < vcap * (1 + s)) {
        PyErr_Format(PyExc_ValueError, "encode_sparse needs an out of %zd bytes for %zd elements of %d; got %zd",
                     vcap * (1 + s), n, s, out.len);
        goto done;
    }
    Py_ssize_t k = 0, nv = 0;
    int rc;
    uint8_t *o = (uint8_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    /* fewer gap bytes than vcap, for sparse to be smaller than the bitmap: none at all for an empty box */
    rc = n && !mostly_changed(&ra, &rb, s) ? encode_sized(&ra, &rb, s, o, vcap - 1, o + vcap, &k, &nv) : -1;
    if (!rc) memmove(o + nv, o + vcap, (size_t)(k * s));
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        result = Py_BuildValue("nn", k, nv);
    }
done:
    PyBuffer_Release(&old);
    PyBuffer_Release(&new_);
    PyBuffer_Release(&out);
    return result;
}

#define APPLY_CHUNK (64 * 1024) /* bytes copied, patched and hashed while they are in cache */

/* Returns 0, or -1 where the stream is not k well-formed gaps inside n elements (the caller's numpy path names why).
 * The base is copied chunk by chunk; each chunk gets the values whose indices fall in it, then goes to ``state``
 * (NULL: no digest), so the result is hashed as it is made, not read again. */
static inline __attribute__((always_inline)) int apply_core(const uint8_t *old, const uint8_t *stream,
                                                            Py_ssize_t len, const uint8_t *values, Py_ssize_t k,
                                                            Py_ssize_t n, int s, uint8_t *out, XXH3_state_t *state) {
    Py_ssize_t pos = 0, decoded = 0;
    uint64_t next = 0, index = 0; /* the first index the next gap may name; the last one decoded */
    int pending = 0;              /* index decoded, its value not yet written (it lies in a later chunk) */
    const Py_ssize_t total = n * s;
    for (Py_ssize_t c0 = 0; c0 < total; c0 += APPLY_CHUNK) {
        const Py_ssize_t c1 = total - c0 > APPLY_CHUNK ? c0 + APPLY_CHUNK : total;
        memcpy(out + c0, old + c0, (size_t)(c1 - c0));
        for (;;) {
            if (!pending) {
                if (decoded == k) break;
                uint64_t gap = 0;
                int shift = 0, nbytes = 0;
                for (;;) {
                    if (pos >= len || nbytes == MAX_VARINT_NBYTES) return -1;
                    uint8_t byte = stream[pos++];
                    gap |= (uint64_t)(byte & 0x7F) << shift;
                    shift += 7;
                    nbytes++;
                    if (!(byte & 0x80)) break;
                }
                if (gap >= (uint64_t)n - next) return -1; /* next <= n: no wrap */
                index = next + gap;
                next = index + 1;
                decoded++;
                pending = 1;
            }
            if ((Py_ssize_t)index * s >= c1) break;
            memcpy(out + index * s, values + (decoded - 1) * s, (size_t)s);
            pending = 0;
        }
        if (state) XXH3_UPDATE(state, out + c0, (size_t)(c1 - c0));
    }
    return decoded == k && !pending && pos == len ? 0 : -1;
}

static int apply_sized(const uint8_t *old, const uint8_t *stream, Py_ssize_t len, const uint8_t *values, Py_ssize_t k,
                       Py_ssize_t n, int s, uint8_t *out, XXH3_state_t *state) {
    switch (s) {
    case 1: return apply_core(old, stream, len, values, k, n, 1, out, state);
    case 2: return apply_core(old, stream, len, values, k, n, 2, out, state);
    case 4: return apply_core(old, stream, len, values, k, n, 4, out, state);
    default: return apply_core(old, stream, len, values, k, n, 8, out, state);
    }
}

/* A running XXH3-64 (seed 0) of bytes fed in order: what `digest` gives them joined. */
typedef struct {
    PyObject_HEAD
    XXH3_state_t *state;
} Hasher;

static PyTypeObject HasherType;

/* Feed the bytes of each buffer in ``views`` (any strides) to ``state``, in C order. */
static int update_views(XXH3_state_t *state, PyObject *views) {
    Py_ssize_t m = PyTuple_GET_SIZE(views);
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_buffer v;
        if (get_strided(PyTuple_GET_ITEM(views, j), &v, 0) < 0) return -1;
        Runs r;
        if (PyBuffer_IsContiguous(&v, 'C')) {
            r.base = (const uint8_t *)v.buf, r.run = v.len, r.nruns = v.len ? 1 : 0, r.nouter = 0;
        } else {
            runs_of(&v, contiguous_tail(&v), &r);
        }
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t idx[64] = {0};
        const uint8_t *at = r.base;
        for (Py_ssize_t i = 0; i < r.nruns; i++) {
            XXH3_UPDATE(state, at, (size_t)r.run);
            at = next_run(&r, idx, at);
        }
        Py_END_ALLOW_THREADS
        PyBuffer_Release(&v);
    }
    return 0;
}

static PyObject *Hasher_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Hasher() takes no arguments");
        return NULL;
    }
    Hasher *self = (Hasher *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->state = XXH3_createState();
    if (!self->state) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    XXH3_64bits_reset(self->state);
    return (PyObject *)self;
}

static void Hasher_dealloc(Hasher *self) {
    if (self->state) XXH3_freeState(self->state);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Hasher_update(Hasher *self, PyObject *args) {
    if (update_views(self->state, args) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Hasher_intdigest(Hasher *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong((unsigned long long)XXH3_64bits_digest(self->state));
}

static PyMethodDef Hasher_methods[] = {
    {"update", (PyCFunction)Hasher_update, METH_VARARGS, "update(*buffers): feed their bytes (any strides), in order"},
    {"intdigest", (PyCFunction)Hasher_intdigest, METH_NOARGS, "intdigest() -> int: the XXH3-64 of all fed so far"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HasherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reshard._delta_kernel.Hasher",
    .tp_basicsize = sizeof(Hasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Hasher(): a running XXH3-64 (seed 0); apply_sparse feeds it the bytes it makes",
    .tp_new = Hasher_new,
    .tp_dealloc = (destructor)Hasher_dealloc,
    .tp_methods = Hasher_methods,
};

PyDoc_STRVAR(apply_sparse_doc,
"apply_sparse(old, out, stream, values, k, itemsize, hasher=None) -> bool\n\n"
"old copied into out (one length, not overlapping), then the k values written where the varint gaps of stream\n"
"name; out's bytes fed to hasher (a Hasher) as they are made. False, with out partly written and hasher partly\n"
"fed, where stream is not k well-formed gaps inside the buffer.");

static PyObject *apply_sparse(PyObject *self, PyObject *args) {
    Py_buffer old, out, stream, values;
    Py_ssize_t k;
    int s;
    PyObject *hasher = Py_None;
    if (!PyArg_ParseTuple(args, "y*w*y*y*ni|O", &old, &out, &stream, &values, &k, &s, &hasher)) return NULL;
    PyObject *result = NULL;
    if (!unit_size(s) || old.len != out.len || old.len % s || k < 0 || values.len != k * s) {
        PyErr_Format(PyExc_ValueError, "apply_sparse takes old and out of one length in elements of 1, 2, 4 or 8 "
                     "bytes and k values; got %zd and %zd bytes of itemsize %d, %zd values in %zd bytes",
                     old.len, out.len, s, k, values.len);
        goto done;
    }
    if (hasher != Py_None && !PyObject_TypeCheck(hasher, &HasherType)) {
        PyErr_Format(PyExc_TypeError, "apply_sparse's hasher is a Hasher or None; got %s", Py_TYPE(hasher)->tp_name);
        goto done;
    }
    XXH3_state_t *state = hasher == Py_None ? NULL : ((Hasher *)hasher)->state;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = apply_sized((const uint8_t *)old.buf, (const uint8_t *)stream.buf, stream.len, (const uint8_t *)values.buf,
                     k, old.len / s, s, (uint8_t *)out.buf, state);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(rc == 0);
done:
    PyBuffer_Release(&old);
    PyBuffer_Release(&out);
    PyBuffer_Release(&stream);
    PyBuffer_Release(&values);
    return result;
}

PyDoc_STRVAR(digest_doc,
"digest(*buffers) -> int\n\n"
"XXH3-64 (seed 0) of the buffers' bytes in C order, one after another: what xxhash.xxh3_64_intdigest gives their\n"
"bytes packed and joined. Each buffer any strides.");

static PyObject *digest(PyObject *self, PyObject *args) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    if (update_views(&state, args) < 0) return NULL;
    return PyLong_FromUnsignedLongLong((unsigned long long)XXH3_64bits_digest(&state));
}

PyDoc_STRVAR(pair_runs_doc,
"pair_runs(local_addrs, local_cum, remote_addrs, remote_cum, off, n, local_out, remote_out, local_dev, remote_dev)"
" -> int\n\n"
"The pieces of one WRITE (reshard.server.transport.nixl_memory.pair_runs): bytes [0, n) of the local runs into bytes\n"
"[off, off + n) of the remote ones, cut wherever a run on either side ends. Each side is its runs' addresses and\n"
"the offsets of their starts and its end (C-contiguous buffers of 8-byte integers, cum one longer than addrs).\n"
"Writes piece i as the rows (address, length, device) of local_out and remote_out (writable buffers of 8-byte\n"
"integers, 3 per row, room for at least len(local_addrs) + len(remote_addrs) rows) and returns how many.");

/* An 8-byte integer buffer's words; -1 (an exception set) where it is not one. */
static Py_ssize_t words(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != 8 || view->len % 8) {
        PyErr_Format(PyExc_ValueError, "pair_runs' %s is a buffer of 8-byte integers; got items of %zd bytes",
                     what, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return view->len / 8;
}

static PyObject *pair_runs(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    long long off, n, ldev, rdev;
    if (!PyArg_ParseTuple(args, "OOOOLLOOLL", &objs[0], &objs[1], &objs[2], &objs[3], &off, &n, &objs[4], &objs[5],
                          &ldev, &rdev))
        return NULL;
    static const char *names[6] = {"local_addrs", "local_cum", "remote_addrs", "remote_cum", "local_out",
                                   "remote_out"};
    Py_buffer v[6];
    Py_ssize_t len[6];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 6; got++)
        if ((len[got] = words(objs[got], &v[got], got >= 4, names[got])) < 0) goto done;
    const int64_t *la = v[0].buf, *lc = v[1].buf, *ra = v[2].buf, *rc = v[3].buf;
    int64_t *lo = v[4].buf, *ro = v[5].buf;
    Py_ssize_t nl = len[0], nr = len[2], room = (len[4] < len[5] ? len[4] : len[5]) / 3;
    if (len[1] != nl + 1 || len[3] != nr + 1 || off < 0 || n < 0 || lc[nl] < n || rc[nr] < off + n ||
        room < nl + nr) {
        PyErr_Format(PyExc_ValueError, "pair_runs takes runs with one more offset than addresses, a local side of at "
                     "least n bytes, a remote one of at least off + n and room for every piece; got %zd local runs "
                     "of %lld bytes, %zd remote runs of %lld, off %lld, n %lld, room for %zd pieces",
                     nl, (long long)lc[nl], nr, (long long)rc[nr], off, n, room);
        goto done;
    }
    /* the remote run that holds byte off: the last whose start is at or before it (bisection) */
    Py_ssize_t i = 0, j = 0, hi = nr;
    while (j < hi) {
        Py_ssize_t mid = (j + hi) / 2;
        if (rc[mid + 1] <= off) j = mid + 1; else hi = mid;
    }
    Py_ssize_t k = 0;
    int64_t p = 0;
    while (p < n) {
        while (lc[i + 1] <= p) i++;  /* empty runs and those behind p */
        while (rc[j + 1] <= off + p) j++;
        int64_t end = lc[i + 1] < n ? lc[i + 1] : n;
        if (rc[j + 1] - off < end) end = rc[j + 1] - off;
        lo[3 * k] = la[i] + p - lc[i];
        lo[3 * k + 1] = end - p;
        lo[3 * k + 2] = ldev;
        ro[3 * k] = ra[j] + off + p - rc[j];
        ro[3 * k + 1] = end - p;
        ro[3 * k + 2] = rdev;
        k++;
        p = end;
    }
    result = PyLong_FromSsize_t(k);
done:
    while (got-- > 0) PyBuffer_Release(&v[got]);
    return result;
}

PyDoc_STRVAR(segment_runs_doc,
"segment_runs(parts, ndarray, most) -> (owners, keys, runs, firsts) or None\n\n"
"nixl_runs.segment_runs' pass over a bucket's member regions: each part (of type ndarray exactly, C-contiguous) in\n"
"the buffer that owns its memory (its .base, followed while that is an ndarray), each such buffer once with its\n"
"(address, bytes), the runs (address, length; parts adjacent in one buffer are one run) and per run the index of\n"
"its part, or where parts merged -1 - the index of their buffer. None where a part or its buffer is not so, or there\n"
"would be more than most runs.");

/* The buffer that owns ``obj``'s memory: its .base while that is an ``ndarray`` (a new reference), or NULL with an
   exception set. */
static PyObject *base_name;  /* "base", interned at import */

static PyObject *root_of(PyObject *obj, PyTypeObject *ndarray) {
    Py_INCREF(obj);
    for (;;) {
        PyObject *base = PyObject_GetAttr(obj, base_name);
        if (!base) { Py_DECREF(obj); return NULL; }
        if (!PyObject_TypeCheck(base, ndarray)) { Py_DECREF(base); return obj; }
        Py_DECREF(obj);
        obj = base;
    }
}

/* Address and bytes of a C-contiguous buffer; 0 where ``obj`` has none (the error cleared), -1 on another error. */
static int span_of(PyObject *obj, int64_t *addr, int64_t *nbytes) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_C_CONTIGUOUS) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
        PyErr_Clear();
        return 0;
    }
    *addr = (int64_t)(intptr_t)v.buf;
    *nbytes = (int64_t)v.len;
    PyBuffer_Release(&v);
    return 1;
}

static PyObject *segment_runs(PyObject *self, PyObject *args) {
    PyObject *parts, *type;
    Py_ssize_t most;
    if (!PyArg_ParseTuple(args, "OOn", &parts, &type, &most)) return NULL;
    if (!PyType_Check(type)) { PyErr_SetString(PyExc_TypeError, "segment_runs takes the ndarray type"); return NULL; }
    PyTypeObject *ndarray = (PyTypeObject *)type;
    PyObject *seq = PySequence_Fast(parts, "segment_runs takes a sequence of parts");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *owners = PyList_New(0), *keys = PyList_New(0), *runs = PyList_New(0), *firsts = PyList_New(0);
    PyObject *result = NULL;
    int64_t *starts = PyMem_Malloc(sizeof(int64_t) * 2 * (n + 1));  /* per owner: start, end */
    int64_t ra = 0, rn = 0, rowner = -1, rfirst = -1;  /* the run being built */
    Py_ssize_t nowners = 0, nruns = 0, last = -1;
    if (!owners || !keys || !runs || !firsts || !starts) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *part = items[k];
        int64_t addr, len;
        if (Py_TYPE(part) != ndarray) goto none;
        int got = span_of(part, &addr, &len);
        if (got < 0) goto fail;
        if (!got) goto none;
        if (!len) continue;
        PyObject *root = root_of(part, ndarray);
        if (!root) goto fail;
        Py_ssize_t o = -1;
        if (last >= 0 && PyList_GET_ITEM(owners, last) == root) o = last;
        for (Py_ssize_t i = 0; o < 0 && i < nowners; i++)
            if (PyList_GET_ITEM(owners, i) == root) o = i;
        if (o < 0) {
            int64_t start, size;
            got = span_of(root, &start, &size);
            if (got <= 0 || !size) { Py_DECREF(root); if (got < 0) goto fail; goto none; }
            PyObject *key = Py_BuildValue("(LL)", (long long)start, (long long)size);
            if (!key || PyList_Append(owners, root) < 0 || PyList_Append(keys, key) < 0) {
                Py_XDECREF(key); Py_DECREF(root); goto fail;
            }
            Py_DECREF(key);
            starts[2 * nowners] = start;
            starts[2 * nowners + 1] = start + size;
            o = nowners++;
        }
        Py_DECREF(root);
        last = o;
        if (addr < starts[2 * o] || addr + len > starts[2 * o + 1]) goto none;
        if (nruns && rowner == o && ra + rn == addr) {
            rn += len;
            rfirst = -1 - o;
            continue;
        }
        if (nruns) {
            PyObject *run = Py_BuildValue("(LL)", (long long)ra, (long long)rn), *first = PyLong_FromSsize_t(rfirst);
            if (!run || !first || PyList_Append(runs, run) < 0 || PyList_Append(firsts, first) < 0) {
                Py_XDECREF(run); Py_XDECREF(first); goto fail;
            }
            Py_DECREF(run); Py_DECREF(first);
        }
        if (nruns == most) goto none;
        nruns++;
        ra = addr; rn = len; rowner = o; rfirst = k;
    }
    if (nruns) {
        PyObject *run = Py_BuildValue("(LL)", (long long)ra, (long long)rn), *first = PyLong_FromSsize_t(rfirst);
        if (!run || !first || PyList_Append(runs, run) < 0 || PyList_Append(firsts, first) < 0) {
            Py_XDECREF(run); Py_XDECREF(first); goto fail;
        }
        Py_DECREF(run); Py_DECREF(first);
    }
    result = PyTuple_Pack(4, owners, keys, runs, firsts);
    goto fail;  /* releases what is not returned */
none:
    result = Py_None;
    Py_INCREF(result);
fail:
    PyMem_Free(starts);
    Py_XDECREF(owners); Py_XDECREF(keys); Py_XDECREF(runs); Py_XDECREF(firsts);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"digest", digest, METH_VARARGS, digest_doc},
    {"encode_sparse", encode_sparse, METH_VARARGS, encode_sparse_doc},
    {"apply_sparse", apply_sparse, METH_VARARGS, apply_sparse_doc},
    {"pair_runs", pair_runs, METH_VARARGS, pair_runs_doc},
    {"segment_runs", segment_runs, METH_VARARGS, segment_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "reshard._delta_kernel",
    "The sparse delta's encode and apply in one pass each (reshard.delta uses them where built).", -1, methods,
};

PyMODINIT_FUNC PyInit__delta_kernel(void) {
    if (PyType_Ready(&HasherType) < 0) return NULL;
    if (!base_name && !(base_name = PyUnicode_InternFromString("base"))) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&HasherType);
    if (PyModule_AddObject(m, "Hasher", (PyObject *)&HasherType) < 0) {
        Py_DECREF(&HasherType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
