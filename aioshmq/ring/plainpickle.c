/* Protocol-5 pickles of plain values, byte for byte as CPython's _pickle writes them.
 *
 * Most messages are dicts, lists and tuples of strings and numbers.  pickle.dumps spends
 * most of a small message's time on what does not depend on it: a Pickler object, its memo,
 * a 4 KiB output buffer allocated and shrunk at every call, and a dispatch per object.  The
 * writer's share of a broadcast's CPU is that time.  For plain values, this module writes the
 * same bytes into a buffer it keeps, with a memo it keeps, and never runs Python code, so
 * the values cannot change under it.  Readers need nothing: it is pickle.
 *
 * What "the same bytes" takes, from Modules/_pickle.c (save, save_* and batch_*_exact):
 * - PROTO 5, then one FRAME around the rest if the rest is at least 4 bytes; a pickle that
 *   stays under 64 KiB is one frame (_pickle commits a frame only at 64 KiB), so anything
 *   larger is left to pickle, as is any str or bytes that _pickle would write outside it;
 * - None, bools, ints and floats are never memoized; an int that fits 32 signed bits is
 *   BININT1, BININT2 or BININT by its bytes, a wider one LONG1 in two's complement;
 * - str and bytes are looked up in the memo, written (SHORT_ forms up to 255 bytes) and
 *   memoized (MEMOIZE); a repeat is BINGET (LONG_BINGET from index 256);
 * - a list or dict is memoized before its items, so a list that holds itself pickles as a
 *   BINGET of itself; one item goes with APPEND / SETITEM, more in batches of 1000 between
 *   MARK and APPENDS / SETITEMS, and a dict whose size is a multiple of 1000 ends with an
 *   empty batch;
 * - a tuple is memoized after its items (TUPLE1-3 up to three, else MARK ... TUPLE); the
 *   empty tuple is EMPTY_TUPLE and never memoized.  A tuple met again while its items are
 *   written holds itself through a list or dict: _pickle undoes what it wrote there, and
 *   this module leaves such a tuple to it.
 * tests/test_plainpickle.py holds the output to pickle.dumps on generated values.
 */
#include "plainpickle.h"

#include <string.h>

#define PROTO 0x80
#define FRAME 0x95
#define STOP '.'
#define NONE 'N'
#define NEWTRUE 0x88
#define NEWFALSE 0x89
#define BININT 'J'
#define BININT1 'K'
#define BININT2 'M'
#define LONG1 0x8a
#define BINFLOAT 'G'
#define SHORT_BINUNICODE 0x8c
#define BINUNICODE 'X'
#define SHORT_BINBYTES 'C'
#define BINBYTES 'B'
#define MEMOIZE 0x94
#define BINGET 'h'
#define LONG_BINGET 'j'
#define EMPTY_TUPLE ')'
#define TUPLE 't'
#define TUPLE1 0x85
#define MARK '('
#define EMPTY_LIST ']'
#define APPEND 'a'
#define APPENDS 'e'
#define EMPTY_DICT '}'
#define SETITEM 's'
#define SETITEMS 'u'

#define HEAD 11                  /* PROTO 5, then FRAME and its 8-byte length */
#define FRAME_MAX (65536 - 1)    /* below _pickle's FRAME_SIZE_TARGET: always one frame */
#define FRAME_MIN 4              /* _pickle's FRAME_SIZE_MIN */
#define BATCHSIZE 1000
#define DEPTH_MAX 100
#define MEMO_BITS_MIN 6
#define MEMO_BITS_KEPT 10        /* a memo grown past this is freed after the dump */

typedef PlainPickler P;

static inline int room(P *p, Py_ssize_t n) { return p->len + n <= HEAD + FRAME_MAX; }

static inline int put1(P *p, unsigned char c) {
    if (!room(p, 1)) return PLAIN_NOT;
    p->buf[p->len++] = c;
    return PLAIN_DONE;
}

static inline int put(P *p, const void *src, Py_ssize_t n) {
    if (!room(p, n)) return PLAIN_NOT;
    memcpy(p->buf + p->len, src, (size_t)n);
    p->len += n;
    return PLAIN_DONE;
}

static inline void le32(unsigned char *d, uint32_t v) {
    d[0] = (unsigned char)v;
    d[1] = (unsigned char)(v >> 8);
    d[2] = (unsigned char)(v >> 16);
    d[3] = (unsigned char)(v >> 24);
}

/* -- the memo: object -> index, open addressing on the address, cleared by a new gen ----- */

static inline size_t slot_of(P *p, PyObject *key) {
    uint64_t h = (uint64_t)(uintptr_t)key * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> (64 - p->memo_bits));
}

/* The entry of ``key``, or the free entry where it would go. */
static inline PlainMemoEntry *memo_slot(P *p, PyObject *key) {
    size_t mask = p->memo_limit * 2 - 1;
    for (size_t i = slot_of(p, key);; i = (i + 1) & mask) {
        PlainMemoEntry *e = &p->memo[i];
        if (e->gen != p->gen || e->key == key) return e;
    }
}

static int memo_grow(P *p) {
    size_t old_n = (size_t)1 << p->memo_bits;
    PlainMemoEntry *old = p->memo;
    PlainMemoEntry *fresh = PyMem_Calloc(old_n * 2, sizeof(PlainMemoEntry));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    p->memo = fresh;
    p->memo_bits++;
    p->memo_limit *= 2;
    for (size_t i = 0; i < old_n; i++)
        if (old[i].gen == p->gen) *memo_slot(p, old[i].key) = old[i];
    PyMem_Free(old);
    return 0;
}

/* Records ``key`` at ``index`` (-1: a tuple in progress) in ``e``, the free entry memo_slot
 * gave for it with nothing recorded since. */
static int memo_put_at(P *p, PlainMemoEntry *e, PyObject *key, Py_ssize_t index) {
    if (p->memo_used >= p->memo_limit) {
        if (memo_grow(p) < 0) return -1;
        e = memo_slot(p, key);
    }
    p->memo_used++;
    e->gen = p->gen;
    e->key = key;
    e->index = index;
    return 0;
}

/* memo_put: ``key``, met for the first time, gets the next index; MEMOIZE. */
static int memoize(P *p, PlainMemoEntry *e, PyObject *key) {
    if (memo_put_at(p, e, key, p->memo_next++) < 0) return -1;
    return put1(p, MEMOIZE);
}

static int memo_get(P *p, Py_ssize_t index) {
    unsigned char d[5];
    if (index < 256) {
        d[0] = BINGET;
        d[1] = (unsigned char)index;
        return put(p, d, 2);
    }
    if (index > 0xffffffffL) return PLAIN_NOT;
    d[0] = LONG_BINGET;
    le32(d + 1, (uint32_t)index);
    return put(p, d, 5);
}

/* -- values ---------------------------------------------------------------------------------- */

static int save(P *p, PyObject *obj, int depth);

static int save_long(P *p, PyObject *obj) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow) return PLAIN_NOT;
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return PLAIN_NOT;
    }
    unsigned char d[11];
    if (v >= -0x80000000LL && v <= 0x7fffffffLL) {
        uint32_t u = (uint32_t)v;
        le32(d + 1, u);
        if (d[3] != 0 || d[4] != 0) {
            d[0] = BININT;
            return put(p, d, 5);
        }
        if (d[2] != 0) {
            d[0] = BININT2;
            return put(p, d, 3);
        }
        d[0] = BININT1;
        return put(p, d, 2);
    }
    /* LONG1: (bits of |v|) / 8 + 1 bytes of two's complement, less one if a negative
     * number's top byte is nothing but sign */
    uint64_t mag = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    int nbytes = (64 - __builtin_clzll(mag)) / 8 + 1;
    for (int i = 0; i < 8; i++) d[2 + i] = (unsigned char)((uint64_t)v >> (8 * i));
    d[10] = v < 0 ? 0xff : 0x00;
    if (v < 0 && nbytes > 1 && d[2 + nbytes - 1] == 0xff && (d[2 + nbytes - 2] & 0x80))
        nbytes--;
    d[0] = LONG1;
    d[1] = (unsigned char)nbytes;
    return put(p, d, 2 + nbytes);
}

static int save_float(P *p, PyObject *obj) {
    unsigned char d[9];
    d[0] = BINFLOAT;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ \
    && defined(__FLOAT_WORD_ORDER__) && __FLOAT_WORD_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* the IEEE 754 bits, big-endian: what PyFloat_Pack8 writes on such a machine */
    double x = PyFloat_AS_DOUBLE(obj);
    uint64_t bits;
    memcpy(&bits, &x, 8);
    bits = __builtin_bswap64(bits);
    memcpy(d + 1, &bits, 8);
#else
    if (PyFloat_Pack8(PyFloat_AS_DOUBLE(obj), (char *)d + 1, 0) < 0) {
        PyErr_Clear();
        return PLAIN_NOT;
    }
#endif
    return put(p, d, 9);
}

/* str and bytes: a header of the SHORT_ form (one length byte) or the long one (four). */
static int save_data(P *p, PlainMemoEntry *e, PyObject *obj, unsigned char short_op,
                     unsigned char long_op, const char *data, Py_ssize_t n) {
    if (n > FRAME_MAX || !room(p, 5 + n)) return PLAIN_NOT;
    unsigned char *d = p->buf + p->len;
    if (n <= 0xff) {
        d[0] = short_op;
        d[1] = (unsigned char)n;
        d += 2;
    } else {
        d[0] = long_op;
        le32(d + 1, (uint32_t)n);
        d += 5;
    }
    memcpy(d, data, (size_t)n);
    p->len = (d - p->buf) + n;
    return memoize(p, e, obj);
}

static int save_str(P *p, PlainMemoEntry *e, PyObject *obj) {
    Py_ssize_t n;
    const char *data;
    if (PyUnicode_IS_COMPACT_ASCII(obj)) { /* its UTF-8 is its own bytes */
        data = (const char *)PyUnicode_DATA(obj);
        n = PyUnicode_GET_LENGTH(obj);
    } else if ((data = PyUnicode_AsUTF8AndSize(obj, &n)) == NULL) {
        PyErr_Clear(); /* lone surrogates: _pickle's "surrogatepass" is left to it */
        return PLAIN_NOT;
    }
    return save_data(p, e, obj, SHORT_BINUNICODE, BINUNICODE, data, n);
}

static int save_tuple(P *p, PlainMemoEntry *e, PyObject *obj, int depth) {
    Py_ssize_t n = PyTuple_GET_SIZE(obj);
    if (n == 0) return put1(p, EMPTY_TUPLE);
    int r;
    if (memo_put_at(p, e, obj, -1) < 0) return -1;
    if (n > 3 && (r = put1(p, MARK)) != PLAIN_DONE) return r;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((r = save(p, PyTuple_GET_ITEM(obj, i), depth + 1)) != PLAIN_DONE) return r;
    if ((r = put1(p, n > 3 ? TUPLE : (unsigned char)(TUPLE1 + n - 1))) != PLAIN_DONE) return r;
    memo_slot(p, obj)->index = p->memo_next++; /* in the memo since its items began */
    return put1(p, MEMOIZE);
}

static int save_list(P *p, PlainMemoEntry *e, PyObject *obj, int depth) {
    int r;
    if ((r = put1(p, EMPTY_LIST)) != PLAIN_DONE || (r = memoize(p, e, obj)) != PLAIN_DONE)
        return r;
    Py_ssize_t n = PyList_GET_SIZE(obj);
    if (n == 0) return PLAIN_DONE;
    if (n == 1) {
        if ((r = save(p, PyList_GET_ITEM(obj, 0), depth + 1)) != PLAIN_DONE) return r;
        return put1(p, APPEND);
    }
    for (Py_ssize_t i = 0; i < n;) {
        if ((r = put1(p, MARK)) != PLAIN_DONE) return r;
        for (Py_ssize_t batch = 0; batch < BATCHSIZE && i < n; batch++, i++)
            if ((r = save(p, PyList_GET_ITEM(obj, i), depth + 1)) != PLAIN_DONE) return r;
        if ((r = put1(p, APPENDS)) != PLAIN_DONE) return r;
    }
    return PLAIN_DONE;
}

/* An exact str: fetched from the memo if met before (never a tuple in progress), else
 * written and memoized. */
static inline int save_str_or_get(P *p, PyObject *obj) {
    PlainMemoEntry *e = memo_slot(p, obj);
    return e->gen == p->gen ? memo_get(p, e->index) : save_str(p, e, obj);
}

/* A dict's key: most are str, which skip save's dispatch. */
static inline int save_key(P *p, PyObject *key, int depth) {
    return PyUnicode_CheckExact(key) ? save_str_or_get(p, key) : save(p, key, depth);
}

static int save_dict(P *p, PlainMemoEntry *e, PyObject *obj, int depth) {
    int r;
    if ((r = put1(p, EMPTY_DICT)) != PLAIN_DONE || (r = memoize(p, e, obj)) != PLAIN_DONE)
        return r;
    Py_ssize_t n = PyDict_GET_SIZE(obj), pos = 0, batch;
    PyObject *key, *value;
    if (n == 0) return PLAIN_DONE;
    if (n == 1) {
        PyDict_Next(obj, &pos, &key, &value);
        if ((r = save_key(p, key, depth + 1)) != PLAIN_DONE
            || (r = save(p, value, depth + 1)) != PLAIN_DONE)
            return r;
        return put1(p, SETITEM);
    }
    do {
        if ((r = put1(p, MARK)) != PLAIN_DONE) return r;
        for (batch = 0; batch < BATCHSIZE && PyDict_Next(obj, &pos, &key, &value); batch++)
            if ((r = save_key(p, key, depth + 1)) != PLAIN_DONE
                || (r = save(p, value, depth + 1)) != PLAIN_DONE)
                return r;
        if ((r = put1(p, SETITEMS)) != PLAIN_DONE) return r;
    } while (batch == BATCHSIZE);
    return PLAIN_DONE;
}

static int save(P *p, PyObject *obj, int depth) {
    PyTypeObject *t = Py_TYPE(obj);
    if (obj == Py_None) return put1(p, NONE);
    if (obj == Py_True) return put1(p, NEWTRUE);
    if (obj == Py_False) return put1(p, NEWFALSE);
    if (t == &PyLong_Type) return save_long(p, obj);
    if (t == &PyFloat_Type) return save_float(p, obj);
    if (t == &PyUnicode_Type) return save_str_or_get(p, obj);
    if (t != &PyBytes_Type && t != &PyTuple_Type && t != &PyList_Type && t != &PyDict_Type)
        return PLAIN_NOT;
    PlainMemoEntry *e = memo_slot(p, obj);
    if (e->gen == p->gen) return e->index < 0 ? PLAIN_NOT : memo_get(p, e->index);
    if (t == &PyBytes_Type)
        return save_data(p, e, obj, SHORT_BINBYTES, BINBYTES, PyBytes_AS_STRING(obj),
                         PyBytes_GET_SIZE(obj));
    if (depth >= DEPTH_MAX) return PLAIN_NOT;
    if (t == &PyTuple_Type) return save_tuple(p, e, obj, depth);
    if (t == &PyList_Type) return save_list(p, e, obj, depth);
    return save_dict(p, e, obj, depth);
}

/* -- the pickler ------------------------------------------------------------------------------ */

static int start(P *p) {
    if (p->buf == NULL && (p->buf = PyMem_Malloc(HEAD + FRAME_MAX)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (p->memo == NULL) {
        p->memo = PyMem_Calloc((size_t)1 << MEMO_BITS_MIN, sizeof(PlainMemoEntry));
        if (p->memo == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        p->memo_bits = MEMO_BITS_MIN;
        p->memo_limit = (size_t)1 << (MEMO_BITS_MIN - 1);
        p->gen = 0;
    }
    if (++p->gen == 0) { /* every entry would look current again */
        memset(p->memo, 0, sizeof(PlainMemoEntry) << p->memo_bits);
        p->gen = 1;
    }
    p->memo_used = 0;
    p->memo_next = 0;
    p->buf[0] = PROTO;
    p->buf[1] = 5;
    p->len = HEAD;
    return 0;
}

int plain_dump(P *p, PyObject *obj) {
    if (start(p) < 0) return -1;
    int r = save(p, obj, 0);
    if (r == PLAIN_DONE) r = put1(p, STOP);
    if (p->memo_bits > MEMO_BITS_KEPT) { /* a large graph's memo is not kept for the next */
        PyMem_Free(p->memo);
        p->memo = NULL;
    }
    if (r != PLAIN_DONE) return r;
    Py_ssize_t frame = p->len - HEAD;
    if (frame >= FRAME_MIN) {
        uint64_t n = (uint64_t)frame;
        p->buf[2] = FRAME;
        for (int i = 0; i < 8; i++) p->buf[3 + i] = (unsigned char)(n >> (8 * i));
    } else {
        memmove(p->buf + 2, p->buf + HEAD, (size_t)frame);
        p->len = 2 + frame;
    }
    return PLAIN_DONE;
}

void plain_free(P *p) {
    PyMem_Free(p->buf);
    PyMem_Free(p->memo);
    p->buf = NULL;
    p->memo = NULL;
    p->len = 0;
}
