/* The ring's per-message work in C: the compiled twin of aioshmq/ring/pure.py.
 *
 * Same byte layout, same primitives, same Python-visible state as the pure module: a ring
 * written by one is read by the other.  It calls no Python code of aioshmq's beyond the
 * exceptions it raises and the serializer's ``dumps`` and ``loads`` it is handed.  Shared counters are C11 atomics on the mapping
 * (see ARCHITECTURE.md, "Memory ordering"): the writer publishes its head with a release
 * store, a reader loads it with an acquire load before it reads a record, a reader stores
 * its tail with a release store after it read the record, and both sides of the sleep/wake
 * handshake put a sequentially consistent fence between "I sleep" (or "I moved") and the
 * load of the other side's word.  Every read of the data area is bounds-checked against
 * the capacity and the published head first: a scribbled ring raises CorruptedError (or
 * falls back to the pure code that raises it), it is never read outside the mapping.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "plainpickle.h"

#include "format.h" /* generated from format.py by setup.py: every constant below */

#if ATOMIC_LLONG_LOCK_FREE != 2
#error "aioshmq needs lock-free 64-bit atomics"
#endif
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "aioshmq's ring stores little-endian words with native stores"
#endif

typedef _Atomic uint64_t au64;

static PyObject *CorruptedError; /* aioshmq.base.errors.CorruptedError */
static PyObject *ReaderEvicted;  /* aioshmq.base.errors.ReaderEvicted */
static PyObject *str_numpy, *str_ndarray;
static PyTypeObject *ndarray_type; /* numpy.ndarray, once an object of that name was seen */
static PyObject *dumps_kwnames; /* ("protocol", "buffer_callback") */
static PyObject *five;
static PyObject *pickle_dumps, *pickle_pickler, *namespace_type, *empty_bytes;
static PyObject *str_dtype, *str_shape, *str_isbuiltin, *str_plain_as_pickle;
static PyObject *pickle_loads; /* pickle.loads, which mem_load hands the core itself */

static inline uint64_t ld(const uint64_t *p) {
    return atomic_load_explicit((au64 *)p, memory_order_relaxed);
}
static inline uint64_t ld_acquire(const uint64_t *p) {
    return atomic_load_explicit((au64 *)p, memory_order_acquire);
}
static inline void st(uint64_t *p, uint64_t v) {
    atomic_store_explicit((au64 *)p, v, memory_order_relaxed);
}
static inline void st_release(uint64_t *p, uint64_t v) {
    atomic_store_explicit((au64 *)p, v, memory_order_release);
}
static inline void full_fence(void) { atomic_thread_fence(memory_order_seq_cst); }

static inline uint64_t record_size(uint64_t n) {
    return HEADER_SIZE + ((n + RECORD_ALIGN - 1) & ~(uint64_t)(RECORD_ALIGN - 1));
}

/* -- the mapping, shared by both sides ---------------------------------------------------- */

typedef struct {
    Py_buffer view;      /* the whole segment, held while the core may touch it */
    int held;            /* view is held */
    int released;        /* release() was called: no method may touch the memory again */
    Py_ssize_t exports;  /* memoryviews of ring memory handed out and still alive */
    uint8_t *base;       /* NULL once released */
    uint8_t *data;
    uint64_t cap;
    uint64_t max_messages;
    uint64_t readers;
    const char *export_ptr; /* the region the next export covers */
    Py_ssize_t export_len;
} Mem;

static int mem_init(Mem *m, PyObject *buf, Py_ssize_t data_offset, uint64_t cap,
                    uint64_t max_messages, uint64_t readers) {
    if (m->held) {
        PyErr_SetString(PyExc_RuntimeError, "ring core initialised twice");
        return -1;
    }
    if (PyObject_GetBuffer(buf, &m->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    m->held = 1;
    Py_ssize_t len = m->view.len;
    if (cap < 4096 || cap % RECORD_ALIGN || max_messages < 1 || readers < 1 || data_offset < 0
        || data_offset % 8 || (uint64_t)data_offset < READER_LINES + readers * LINE
        || (uint64_t)len < (uint64_t)data_offset || cap > (uint64_t)(len - data_offset)
        || ((uintptr_t)m->view.buf) % 8) {
        PyErr_Format(CorruptedError,
                     "inconsistent layout: capacity=%llu readers=%llu data_offset=%zd "
                     "segment=%zd bytes",
                     (unsigned long long)cap, (unsigned long long)readers, data_offset, len);
        return -1;
    }
    m->base = (uint8_t *)m->view.buf;
    m->data = m->base + data_offset;
    m->cap = cap;
    m->max_messages = max_messages;
    m->readers = readers;
    return 0;
}

static inline uint64_t *wword(Mem *m, int field) {
    return (uint64_t *)(m->base + WRITER_LINE) + field;
}
static inline uint64_t *rword(Mem *m, uint64_t index, int field) {
    return (uint64_t *)(m->base + READER_LINES + index * LINE) + field;
}
static inline uint64_t *dword(Mem *m, uint64_t off) { return (uint64_t *)(m->data + off); }

static void mem_drop(Mem *m) {
    m->base = m->data = NULL;
    if (m->held && m->exports == 0) {
        PyBuffer_Release(&m->view);
        m->held = 0;
    }
}

static int mem_released(Mem *m) {
    if (m->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "operation on a ring whose memory was released");
        return 1;
    }
    return 0;
}

/* The buffer protocol: a core hands out views of ring memory; the mapping stays while any
 * of them lives, as it does for slices of the segment's own memoryview. */
static int mem_getbuffer(Mem *m, PyObject *owner, Py_buffer *view, int flags) {
    if (m->base == NULL || m->export_ptr == NULL) {
        PyErr_SetString(PyExc_BufferError, "a ring core exports only the message it reads");
        return -1;
    }
    if (PyBuffer_FillInfo(view, owner, (void *)m->export_ptr, m->export_len, 0, flags) < 0)
        return -1;
    m->exports++;
    return 0;
}

static void mem_releasebuffer(Mem *m) {
    if (--m->exports == 0 && m->base == NULL && m->held) {
        PyBuffer_Release(&m->view);
        m->held = 0;
    }
}

static PyObject *mem_view(Mem *m, PyObject *owner, const uint8_t *p, uint64_t n) {
    m->export_ptr = (const char *)p;
    m->export_len = (Py_ssize_t)n;
    PyObject *v = PyMemoryView_FromObject(owner);
    m->export_ptr = NULL;
    return v;
}

/* ``loads`` of the message at ``p``.  pickle.loads is handed the core itself as the buffer:
 * it takes one view before it runs any code of the stream's and keeps nothing of it once it
 * returns, so no memoryview need be made for it.  Any other ``loads`` gets a memoryview of
 * its own, which it may keep. */
static PyObject *mem_load(Mem *m, PyObject *owner, PyObject *loads, const uint8_t *p,
                          uint64_t n) {
    if (loads == pickle_loads) {
        m->export_ptr = (const char *)p;
        m->export_len = (Py_ssize_t)n;
        PyObject *obj = PyObject_Vectorcall(loads, &owner, 1, NULL);
        m->export_ptr = NULL;
        return obj;
    }
    PyObject *view = mem_view(m, owner, p, n);
    if (view == NULL) return NULL;
    PyObject *obj = PyObject_Vectorcall(loads, &view, 1, NULL);
    Py_DECREF(view);
    return obj;
}

/* One wake-up through an eventfd (8 bytes) or a pipe's write end (1 byte); a wake-up already
 * pending is enough (EAGAIN). */
static int notify(int fd, int eventfd) {
    static const uint64_t one = 1;
    static const char zero = 0;
    ssize_t r = eventfd ? write(fd, &one, 8) : write(fd, &zero, 1);
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static int u64_arg(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* -- the gate: each slot's state and the lock it changes under ---------------------------- */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    Py_ssize_t readers;
    unsigned char *states;
} Gate;

static PyTypeObject *Gate_type;

/* Take the gate's lock, letting the GIL go while another thread holds it (which may need
 * the GIL to let it go). */
static void gate_lock(Gate *g) {
    if (PyThread_acquire_lock(g->lock, NOWAIT_LOCK)) return;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(g->lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS
}

static int G_init(Gate *self, PyObject *args, PyObject *kwds) {
    Py_ssize_t readers;
    static char *kwlist[] = {"readers", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n:Gate", kwlist, &readers)) return -1;
    if (self->lock != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gate initialised twice");
        return -1;
    }
    if (readers < 1) {
        PyErr_Format(PyExc_ValueError, "a gate of %zd slots", readers);
        return -1;
    }
    self->states = PyMem_Calloc((size_t)readers, 1); /* PENDING is 0 */
    self->lock = PyThread_allocate_lock();
    if (self->states == NULL || self->lock == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->readers = readers;
    return 0;
}

static void G_dealloc(Gate *self) {
    if (self->lock != NULL) PyThread_free_lock(self->lock);
    PyMem_Free(self->states);
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int G_ready(Gate *self) {
    if (self->lock == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gate not initialised");
        return 0;
    }
    return 1;
}

static int G_index(Gate *self, PyObject *arg, Py_ssize_t *index) {
    Py_ssize_t i = PyNumber_AsSsize_t(arg, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || i >= self->readers) {
        PyErr_Format(PyExc_IndexError, "slot %zd of a gate of %zd slots", i, self->readers);
        return -1;
    }
    *index = i;
    return 0;
}

static PyObject *G_enter(Gate *self, PyObject *unused) {
    if (!G_ready(self)) return NULL;
    gate_lock(self);
    Py_RETURN_NONE;
}

static PyObject *G_exit(Gate *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!G_ready(self)) return NULL;
    PyThread_release_lock(self->lock);
    Py_RETURN_NONE;
}

static PyObject *G_state(Gate *self, PyObject *arg) {
    Py_ssize_t i;
    if (!G_ready(self) || G_index(self, arg, &i) < 0) return NULL;
    return PyLong_FromLong(self->states[i]);
}

static PyObject *G_set(Gate *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t i;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set(index, state)");
        return NULL;
    }
    if (!G_ready(self) || G_index(self, args[0], &i) < 0) return NULL;
    long state = PyLong_AsLong(args[1]);
    if (state == -1 && PyErr_Occurred()) return NULL;
    if (state < (long)PENDING || state > (long)EVICTED) {
        PyErr_Format(PyExc_ValueError, "no slot state %ld", state);
        return NULL;
    }
    self->states[i] = (unsigned char)state;
    Py_RETURN_NONE;
}

static PyObject *G_states(Gate *self, PyObject *unused) {
    if (!G_ready(self)) return NULL;
    PyObject *list = PyList_New(self->readers);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->readers; i++) {
        PyObject *s = PyLong_FromLong(self->states[i]);
        if (s == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, s);
    }
    return list;
}

static Py_ssize_t G_len(Gate *self) { return self->readers; }

static PyMethodDef G_methods[] = {
    {"__enter__", (PyCFunction)G_enter, METH_NOARGS, "Take the lock."},
    {"__exit__", (PyCFunction)(void (*)(void))G_exit, METH_FASTCALL, "Let the lock go."},
    {"state", (PyCFunction)G_state, METH_O, "Slot ``index``'s state."},
    {"set", (PyCFunction)(void (*)(void))G_set, METH_FASTCALL,
     "Give slot ``index`` a new state (the caller holds the lock)."},
    {"states", (PyCFunction)G_states, METH_NOARGS, "Every slot's state, as it is now."},
    {NULL}};

static PyType_Slot G_slots[] = {
    {Py_tp_doc, "Which reader slots the writer waits for: each slot's state and the lock it "
                "changes under, shared by the writer and its broker thread."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, G_init},
    {Py_tp_dealloc, G_dealloc},
    {Py_tp_methods, G_methods},
    {Py_sq_length, G_len},
    {0, NULL}};

static PyType_Spec G_spec = {
    .name = "aioshmq.ring.compiled.Gate",
    .basicsize = sizeof(Gate),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = G_slots,
};

/* -- the writer ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Mem m;
    unsigned long long pos, count, head, head_count, limit_pos, limit_count;
    unsigned long long need_span, need_count, wakeups, publishes, sent, sent_bytes;
    unsigned long long max_record, rewind_try;
    int *wake;             /* per reader: its wake-up fd */
    int eventfd;           /* the wake-up fds are eventfds (else pipes' write ends) */
    uint64_t *signalled;   /* per reader: the sleep episode already woken */
    Gate *gate;            /* the slots to wait for */
    PyObject *found;       /* list the pickler's buffer_callback appends to */
    PyObject *found_append;
    PyObject *arrays;      /* the serializer's array pickles by (dtype, shape), or NULL */
    PyObject *pickler;     /* own_pickler's Pickler, or NULL until it is needed */
    PyObject *pickler_dump, *pickler_clear, *pieces; /* its dump, clear_memo and output */
    PlainPickler plain;    /* pickles plain values in place of pickle.dumps */
    int in_dumps;
    char dumps_failed;     /* the last put_object's error came from dumps */
} WriterCore;

static int W_init(WriterCore *self, PyObject *args, PyObject *kwds) {
    PyObject *buf, *fds, *gate;
    Py_ssize_t data_offset;
    unsigned long long cap, max_messages, readers;
    int eventfd;
    static char *kwlist[] = {"mapping",  "data_offset", "capacity", "max_messages", "readers",
                             "wake_fds", "eventfd",     "gate",     NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnKKKOpO:WriterCore", kwlist, &buf,
                                     &data_offset, &cap, &max_messages, &readers, &fds,
                                     &eventfd, &gate))
        return -1;
    if (!PyObject_TypeCheck(gate, Gate_type) || ((Gate *)gate)->lock == NULL) {
        PyErr_SetString(PyExc_TypeError, "gate must be a Gate of this core");
        return -1;
    }
    if (mem_init(&self->m, buf, data_offset, cap, max_messages, readers) < 0) return -1;
    PyObject *t = PySequence_Tuple(fds);
    if (t == NULL) return -1;
    if ((uint64_t)PyTuple_GET_SIZE(t) != readers
        || (uint64_t)((Gate *)gate)->readers != readers) {
        Py_DECREF(t);
        PyErr_SetString(PyExc_ValueError, "one wake-up fd and one gate slot per reader are needed");
        return -1;
    }
    self->wake = PyMem_Calloc(readers, sizeof(int));
    self->signalled = PyMem_Calloc(readers, sizeof(uint64_t));
    if (self->wake == NULL || self->signalled == NULL) {
        Py_DECREF(t);
        PyErr_NoMemory();
        return -1;
    }
    for (uint64_t i = 0; i < readers; i++) {
        long fd = PyLong_AsLong(PyTuple_GET_ITEM(t, i));
        if ((fd == -1 && PyErr_Occurred()) || fd < 0 || fd > INT_MAX) {
            Py_DECREF(t);
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "no fd %ld", fd);
            return -1;
        }
        self->wake[i] = (int)fd;
    }
    Py_DECREF(t);
    self->eventfd = eventfd;
    self->gate = (Gate *)Py_NewRef(gate);
    self->found = PyList_New(0);
    if (self->found == NULL) return -1;
    self->found_append = PyObject_GetAttrString(self->found, "append");
    if (self->found_append == NULL) return -1;
    self->limit_pos = cap;
    self->limit_count = max_messages;
    self->max_record = cap / 2;
    self->rewind_try = 0;
    return 0;
}

static void drop_pickler(WriterCore *self) {
    Py_CLEAR(self->pickler_dump);
    Py_CLEAR(self->pickler_clear);
    Py_CLEAR(self->pieces);
    Py_CLEAR(self->pickler);
}

static int W_traverse(WriterCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->gate);
    Py_VISIT(self->found);
    Py_VISIT(self->found_append);
    Py_VISIT(self->arrays);
    Py_VISIT(self->pickler);
    Py_VISIT(self->pickler_dump);
    Py_VISIT(self->pickler_clear);
    Py_VISIT(self->pieces);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int W_clear(WriterCore *self) {
    Py_CLEAR(self->gate);
    Py_CLEAR(self->found);
    Py_CLEAR(self->found_append);
    Py_CLEAR(self->arrays);
    drop_pickler(self);
    return 0;
}

static void W_dealloc(WriterCore *self) {
    PyObject_GC_UnTrack(self);
    W_clear(self);
    self->m.exports = 0;
    mem_drop(&self->m);
    PyMem_Free(self->wake);
    PyMem_Free(self->signalled);
    plain_free(&self->plain);
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int W_wake_readers(WriterCore *self) {
    Mem *m = &self->m;
    for (uint64_t i = 0; i < m->readers; i++) {
        uint64_t s = ld(rword(m, i, R_SLEEP));
        if (s && s != self->signalled[i]) {
            self->signalled[i] = s;
            if (notify(self->wake[i], self->eventfd) < 0) return -1;
            self->wakeups++;
        }
    }
    return 0;
}

static int W_publish_(WriterCore *self) {
    if (self->pos == self->head) return 0;
    Mem *m = &self->m;
    st_release(wword(m, W_HEAD_COUNT), self->count);
    st_release(wword(m, W_HEAD), self->pos);
    self->head = self->pos;
    self->head_count = self->count;
    self->publishes++;
    full_fence();
    return W_wake_readers(self);
}

/* The slowest waited-for reader's tail and count, read under the gate's lock, into
 * ``*lo_pos`` and ``*lo_count``, and the limits set from them; -1 with CorruptedError if a
 * reader claims a position beyond the head.  Nothing here runs Python code. */
static int W_refresh_(WriterCore *self, uint64_t *lo_pos, uint64_t *lo_count) {
    Gate *gate = self->gate;
    Mem *m = &self->m;
    /* From the published head, not the cursor: a reader attaching now starts there. */
    uint64_t pos = self->head, count = self->head_count;
    gate_lock(gate);
    for (uint64_t i = 0; i < m->readers; i++) {
        if (!WAITED_FOR(gate->states[i])) continue;
        uint64_t t = ld(rword(m, i, R_TAIL)), c = ld(rword(m, i, R_TAIL_COUNT));
        if (t > self->head || c > self->head_count) {
            PyThread_release_lock(gate->lock);
            PyErr_Format(CorruptedError, "reader %llu claims position %llu/%llu beyond the head "
                         "%llu/%llu", (unsigned long long)i, (unsigned long long)t,
                         (unsigned long long)c, self->head, self->head_count);
            return -1;
        }
        if (t < pos) pos = t;
        if (c < count) count = c;
    }
    PyThread_release_lock(gate->lock);
    self->limit_pos = pos + m->cap;
    self->limit_count = count + m->max_messages;
    *lo_pos = pos;
    *lo_count = count;
    return 0;
}

static PyObject *W_refresh_limits(WriterCore *self, PyObject *unused) {
    if (mem_released(&self->m)) return NULL;
    uint64_t pos, count;
    if (W_refresh_(self, &pos, &count) < 0) return NULL;
    return Py_BuildValue("(KK)", (unsigned long long)pos, (unsigned long long)count);
}

/* Bytes a record of ``size`` takes at the cursor: ``size``, or that and a PAD up to the end
 * of the data area before it, which sends the record back to the start.  It goes back where
 * it would cross the end, and also (a rewind) where the cursor is a quarter of the area or
 * REWIND_AT in, whichever is more, and no unread byte lies in the record's way at the
 * start; format.py says why.  Whether anything unread is in the way is read afresh at most
 * once per that many bytes.  -1 on error. */
static int64_t W_span_(WriterCore *self, uint64_t size) {
    uint64_t cap = self->m.cap, pos = self->pos, off = pos % cap;
    uint64_t at = cap / 4 > REWIND_AT ? cap / 4 : REWIND_AT;
    if (off + size > cap) return (int64_t)(cap - off + size);
    if (off < at) return (int64_t)size;
    uint64_t back = cap - off + size, lo_pos, lo_count;
    if (pos + back > self->limit_pos) {
        if (pos < self->rewind_try) return (int64_t)size;
        if (W_refresh_(self, &lo_pos, &lo_count) < 0) return -1;
        if (pos + back > self->limit_pos) {
            self->rewind_try = pos + at;
            return (int64_t)size;
        }
    }
    return (int64_t)back;
}

/* Claim room for a record of ``size`` bytes holding ``messages`` messages at the cursor,
 * writing the PAD before it if it goes back to the start: its offset in the data area, or
 * -2 if there is no room now (need_* set) or it is too big, -1 on error. */
static int64_t W_claim_(WriterCore *self, uint64_t size, uint64_t messages) {
    Mem *m = &self->m;
    if (mem_released(m)) return -1;
    if (size > self->max_record) return -2;
    int64_t spanned = W_span_(self, size);
    if (spanned < 0) return -1;
    uint64_t cap = m->cap, pos = self->pos, off = pos % cap, span = (uint64_t)spanned;
    uint64_t lo_pos, lo_count;
    if (pos + span > self->limit_pos || self->count + messages > self->limit_count) {
        if (W_refresh_(self, &lo_pos, &lo_count) < 0) return -1;
        if (pos + span > self->limit_pos || self->count + messages > self->limit_count) {
            self->need_span = span;
            self->need_count = messages;
            return -2;
        }
    }
    if (span != size) {
        st(dword(m, off), ((cap - off - HEADER_SIZE) << 8) | PAD);
        self->pos = pos + cap - off;
        off = 0;
    }
    return (int64_t)off;
}

static PyObject *W_claim(WriterCore *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t size, messages;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "claim(size, count)");
        return NULL;
    }
    if (u64_arg(args[0], &size) < 0 || u64_arg(args[1], &messages) < 0) return NULL;
    int64_t off = W_claim_(self, size, messages);
    if (off == -1) return NULL;
    return PyLong_FromLongLong(off < 0 ? -1 : off);
}

/* The claimed record at ``off`` is written: account for it and publish (1, or -1). */
static int W_commit_(WriterCore *self, uint64_t size, uint64_t n, uint64_t messages) {
    self->pos += size;
    self->count += messages;
    self->sent += messages;
    self->sent_bytes += n;
    return W_publish_(self) < 0 ? -1 : 1;
}

/* 1 written and published, 0 no room now (need_* set) or too big, -1 error. */
static int W_put_plain_(WriterCore *self, const uint8_t *src, uint64_t n, uint64_t kind,
                        uint64_t messages) {
    uint64_t size = record_size(n);
    int64_t off = W_claim_(self, size, messages);
    if (off < 0) return off == -2 ? 0 : -1;
    Mem *m = &self->m;
    st(dword(m, off), (n << 8) | kind);
    st(dword(m, off + 8), messages > 1 ? messages : 0);
    memcpy(m->data + off + HEADER_SIZE, src, n);
    return W_commit_(self, size, n, messages);
}

/* The same for one message of ``main`` and one out-of-band buffer, laid out as ``Frame``
 * lays out a single buffer: the table (1, main's length, the buffer's length), main at 24,
 * the buffer at the next 16-byte boundary. */
static int W_put_buffer_(WriterCore *self, const uint8_t *main, uint64_t main_len,
                         const uint8_t *buf, uint64_t buf_len) {
    uint64_t at = (24 + main_len + RECORD_ALIGN - 1) & ~(uint64_t)(RECORD_ALIGN - 1);
    uint64_t n = at + buf_len, size = record_size(n);
    int64_t off = W_claim_(self, size, 1);
    if (off < 0) return off == -2 ? 0 : -1;
    Mem *m = &self->m;
    st(dword(m, off), (n << 8) | MSG | OOB);
    st(dword(m, off + 8), 0);
    uint8_t *payload = m->data + off + HEADER_SIZE;
    uint64_t table[3] = {1, main_len, buf_len};
    memcpy(payload, table, sizeof table);
    memcpy(payload + 24, main, main_len);
    memcpy(payload + at, buf, buf_len);
    return W_commit_(self, size, n, 1);
}

static PyObject *W_put_plain(WriterCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "put_plain(main, kind=MSG, count=1)");
        return NULL;
    }
    uint64_t kind = MSG, count = 1;
    if (nargs > 1 && u64_arg(args[1], &kind) < 0) return NULL;
    if (nargs > 2 && u64_arg(args[2], &count) < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int r = W_put_plain_(self, b.buf, (uint64_t)b.len, kind, count);
    PyBuffer_Release(&b);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

static PyObject *W_put_buffer(WriterCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put_buffer(main, buffer)");
        return NULL;
    }
    Py_buffer a, b;
    if (PyObject_GetBuffer(args[0], &a, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &b, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    int r = W_put_buffer_(self, a.buf, (uint64_t)a.len, b.buf, (uint64_t)b.len);
    PyBuffer_Release(&b);
    PyBuffer_Release(&a);
    if (r < 0) return NULL;
    return PyBool_FromLong(r);
}

/* Whether ``obj`` is exactly a numpy.ndarray: numpy's own type, looked up in sys.modules
 * the first time an object of that type name is seen (another type so named is not one). */
static int is_ndarray(PyObject *obj) {
    PyTypeObject *t = Py_TYPE(obj);
    if (t == ndarray_type) return 1;
    if (ndarray_type != NULL || strcmp(t->tp_name, "numpy.ndarray") != 0) return 0;
    PyObject *np = PyImport_GetModule(str_numpy);
    PyObject *cls = np == NULL ? NULL : PyObject_GetAttr(np, str_ndarray);
    Py_XDECREF(np);
    PyErr_Clear();
    if (cls != NULL && PyType_Check(cls))
        ndarray_type = (PyTypeObject *)cls; /* kept: numpy is never unloaded */
    else
        Py_XDECREF(cls);
    return t == ndarray_type;
}

/* The pickle (data aside) that ``arrays`` holds for ``arr``, a numpy.ndarray, as a new
 * reference; NULL (no error set) where the serializer's own way is needed: no such pickle
 * yet, or a dtype that is not a builtin one (its pickle would say more). */
static PyObject *array_main(WriterCore *self, PyObject *arr) {
    if (self->arrays == NULL || !PyDict_CheckExact(self->arrays)) return NULL;
    PyObject *main = NULL, *key = NULL, *builtin = NULL;
    PyObject *dtype = PyObject_GetAttr(arr, str_dtype);
    PyObject *shape = dtype == NULL ? NULL : PyObject_GetAttr(arr, str_shape);
    if (shape == NULL) goto done;
    builtin = PyObject_GetAttr(dtype, str_isbuiltin);
    if (builtin == NULL || !PyLong_CheckExact(builtin) || PyLong_AsLong(builtin) != 1) goto done;
    key = PyTuple_Pack(2, dtype, shape);
    if (key == NULL) goto done;
    main = PyDict_GetItemWithError(self->arrays, key);
    if (main != NULL && PyBytes_CheckExact(main))
        Py_INCREF(main);
    else
        main = NULL;
done:
    PyErr_Clear();
    Py_XDECREF(key);
    Py_XDECREF(builtin);
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    return main;
}

/* put_object's way with a numpy array: None if written now, else () for the serializer's
 * way (which a C-contiguous array with its pickle in ``arrays`` takes only to wait). */
static PyObject *W_put_array_(WriterCore *self, PyObject *arr) {
    PyObject *main = array_main(self, arr);
    if (main == NULL) return PyTuple_New(0);
    Py_buffer b;
    if (PyObject_GetBuffer(arr, &b, PyBUF_C_CONTIGUOUS) < 0) { /* not C-contiguous */
        PyErr_Clear();
        Py_DECREF(main);
        return PyTuple_New(0);
    }
    int r = W_put_buffer_(self, (const uint8_t *)PyBytes_AS_STRING(main),
                          (uint64_t)PyBytes_GET_SIZE(main), b.buf, (uint64_t)b.len);
    PyBuffer_Release(&b);
    Py_DECREF(main);
    if (r < 0) return NULL;
    return r ? Py_NewRef(Py_None) : PyTuple_New(0);
}

/* pickle.dumps keeps no state between calls, so each call makes a Pickler, its memo and a
 * 4 KiB output buffer, about a fifth of the cost of pickling a small object.  In its
 * place, put_object keeps a Pickler of its own (protocol 5, buffers to ``found``) writing
 * into ``pieces``, and clears its memo after every call, so that it holds nothing of the
 * object afterwards.  Its pickles are pickle.dumps's, byte for byte, save that data of 64 KiB
 * or more pickled in-band lies outside pickle's frames, as a Pickler writing to a file puts
 * it.  A Pickler keeps the largest output buffer it ever needed for every later call, so
 * one that made a large pickle is dropped for a new one. */
#define OWN_PICKLE_MAX (64 << 10)

/* 0 with the core's own Pickler ready, or -1 with an error set. */
static int own_pickler(WriterCore *self) {
    if (self->pickler != NULL) return 0;
    PyObject *pieces = PyList_New(0), *sink = NULL, *pickler = NULL;
    PyObject *append = pieces == NULL ? NULL : PyObject_GetAttrString(pieces, "append");
    if (append != NULL) sink = PyObject_CallNoArgs(namespace_type);
    if (sink != NULL && PyObject_SetAttrString(sink, "write", append) == 0) {
        PyObject *call[3] = {sink, five, self->found_append};
        pickler = PyObject_Vectorcall(pickle_pickler, call, 1, dumps_kwnames);
    }
    Py_XDECREF(sink);
    Py_XDECREF(append);
    if (pickler != NULL) {
        self->pickler = pickler;
        self->pieces = pieces;
        self->pickler_dump = PyObject_GetAttrString(pickler, "dump");
        self->pickler_clear = PyObject_GetAttrString(pickler, "clear_memo");
        if (self->pickler_dump != NULL && self->pickler_clear != NULL) return 0;
    } else {
        Py_XDECREF(pieces);
    }
    drop_pickler(self);
    return -1;
}

/* pickle.dumps(obj, protocol=5, buffer_callback=found.append) through the core's own
 * Pickler: the pickle as a new reference, or NULL with dump's error set. */
static PyObject *own_dumps(WriterCore *self, PyObject *obj) {
    /* held here: dump runs Python code, which must not free what this call still uses */
    PyObject *dump = Py_NewRef(self->pickler_dump), *clear = Py_NewRef(self->pickler_clear);
    PyObject *pieces = Py_NewRef(self->pieces), *main = NULL;
    PyObject *r = PyObject_CallOneArg(dump, obj);
    if (r != NULL) {
        Py_DECREF(r);
        if (PyList_GET_SIZE(pieces) == 1 && PyBytes_CheckExact(PyList_GET_ITEM(pieces, 0)))
            main = Py_NewRef(PyList_GET_ITEM(pieces, 0));
        else
            main = PyObject_CallMethod(empty_bytes, "join", "O", pieces);
    }
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    int cleared = PyList_SetSlice(pieces, 0, PyList_GET_SIZE(pieces), NULL);
    r = cleared < 0 ? NULL : PyObject_CallNoArgs(clear);
    if (r == NULL || (main != NULL && PyBytes_GET_SIZE(main) > OWN_PICKLE_MAX)) {
        PyErr_Clear(); /* a Pickler in doubt, or with a large buffer: a new one next time */
        if (self->pickler_dump == dump) drop_pickler(self);
    }
    Py_XDECREF(r);
    Py_DECREF(pieces);
    Py_DECREF(clear);
    Py_DECREF(dump);
    PyErr_Restore(type, exc, tb);
    return main;
}

/* Whether ``dumps`` writes plain values as pickle.dumps does: pickle.dumps itself, or a
 * callable whose type says so with a true ``plain_as_pickle`` (a Pickler with a dispatch
 * table or a reducer_override: _pickle consults neither for exact builtin types).  The
 * last type asked about is remembered; a type's attribute is read once. */
static PyTypeObject *asked_type;
static int asked_answer;

static int plain_as_pickle(PyObject *dumps) {
    if (dumps == pickle_dumps) return 1;
    PyTypeObject *t = Py_TYPE(dumps);
    if (t == asked_type) return asked_answer;
    PyObject *flag = PyObject_GetAttr((PyObject *)t, str_plain_as_pickle);
    int answer = flag != NULL && flag == Py_True;
    Py_XDECREF(flag);
    PyErr_Clear();
    Py_INCREF(t);
    Py_XSETREF(asked_type, t);
    asked_answer = answer;
    return answer;
}

/* put_object's way with the pickle plain_dump wrote: None if written now, else
 * (main, []).  Nothing that runs before the copy puts (the claim is not reentrant). */
static PyObject *W_put_plain_pickle_(WriterCore *self, uint64_t messages) {
    const uint8_t *src = self->plain.buf;
    uint64_t n = (uint64_t)self->plain.len;
    int r = W_put_plain_(self, src, n, messages > 1 ? MSG | BATCH : MSG, messages);
    if (r < 0) return NULL;
    if (r) Py_RETURN_NONE;
    PyObject *main = PyBytes_FromStringAndSize((const char *)src, (Py_ssize_t)n);
    PyObject *none = main == NULL ? NULL : PyList_New(0);
    PyObject *result = none == NULL ? NULL : PyTuple_Pack(2, main, none);
    Py_XDECREF(none);
    Py_XDECREF(main);
    return result;
}

/* put_object(obj, dumps): pickle ``obj`` with ``dumps`` (pickle's signature) and, if that
 * gives one plain record with room for it now, write and publish it: None.  Otherwise
 * nothing is written and it returns what the caller needs to go on: () for a numpy array
 * (the serializer has its own way with those), else (main, [PickleBuffer, ...]).  A numpy
 * array whose pickle is in ``arrays`` is written with it if it fits now (W_put_array_). */
static PyObject *W_put_object(WriterCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "put_object(obj, dumps, count=1)");
        return NULL;
    }
    uint64_t messages = 1;
    if (nargs > 2 && u64_arg(args[2], &messages) < 0) return NULL;
    if (messages < 1) {
        PyErr_SetString(PyExc_ValueError, "count must be at least 1");
        return NULL;
    }
    self->dumps_failed = 0;
    if (mem_released(&self->m)) return NULL;
    PyObject *obj = args[0];
    if (is_ndarray(obj)) return messages == 1 ? W_put_array_(self, obj) : PyTuple_New(0);
    int own = !self->in_dumps && args[1] == pickle_dumps;
    if (!self->in_dumps && plain_as_pickle(args[1])) {
        int plain = plain_dump(&self->plain, obj);
        if (plain < 0) {
            self->dumps_failed = 1;
            return NULL;
        }
        if (plain == PLAIN_DONE) return W_put_plain_pickle_(self, messages);
    }
    PyObject *found, *append;
    if (self->in_dumps) { /* a __reduce__ that puts: never share the buffer list */
        found = PyList_New(0);
        if (found == NULL) return NULL;
        append = PyObject_GetAttrString(found, "append");
        if (append == NULL) {
            Py_DECREF(found);
            return NULL;
        }
    } else {
        found = Py_NewRef(self->found);
        append = Py_NewRef(self->found_append);
    }
    PyObject *call[3] = {obj, five, append};
    if (own && own_pickler(self) < 0) {
        Py_DECREF(found);
        Py_DECREF(append);
        return NULL;
    }
    self->in_dumps++;
    PyObject *main =
        own ? own_dumps(self, obj) : PyObject_Vectorcall(args[1], call, 1, dumps_kwnames);
    self->in_dumps--;
    Py_DECREF(append);
    PyObject *result = NULL;
    Py_ssize_t nbuf = PyList_GET_SIZE(found);
    if (main == NULL) {
        self->dumps_failed = 1;
        goto done;
    }
    if (nbuf || !PyBytes_Check(main)) {
        PyObject *bufs = PyList_GetSlice(found, 0, nbuf);
        if (bufs != NULL) result = PyTuple_Pack(2, main, bufs);
        Py_XDECREF(bufs);
        goto done;
    }
    int r = W_put_plain_(self, (const uint8_t *)PyBytes_AS_STRING(main),
                         (uint64_t)PyBytes_GET_SIZE(main), messages > 1 ? MSG | BATCH : MSG,
                         messages);
    if (r < 0) goto done;
    if (r) {
        result = Py_NewRef(Py_None);
    } else {
        PyObject *none = PyList_New(0);
        if (none != NULL) result = PyTuple_Pack(2, main, none);
        Py_XDECREF(none);
    }
done:
    if (nbuf) PyList_SetSlice(found, 0, nbuf, NULL);
    Py_DECREF(found);
    Py_XDECREF(main);
    return result;
}

static PyObject *W_publish(WriterCore *self, PyObject *unused) {
    if (mem_released(&self->m)) return NULL;
    if (W_publish_(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *W_wake_readers_py(WriterCore *self, PyObject *unused) {
    if (mem_released(&self->m)) return NULL;
    if (W_wake_readers(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *W_release(WriterCore *self, PyObject *unused) {
    mem_drop(&self->m);
    Py_RETURN_NONE;
}

static int W_getbuffer(WriterCore *self, Py_buffer *view, int flags) {
    return mem_getbuffer(&self->m, (PyObject *)self, view, flags);
}
static void W_releasebuffer(WriterCore *self, Py_buffer *view) { mem_releasebuffer(&self->m); }

static PyObject *W_span(WriterCore *self, PyObject *arg) {
    if (mem_released(&self->m)) return NULL;
    unsigned long long size = PyLong_AsUnsignedLongLong(arg);
    if (size == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int64_t span = W_span_(self, size);
    return span < 0 ? NULL : PyLong_FromLongLong(span);
}

static PyMethodDef W_methods[] = {
    {"refresh_limits", (PyCFunction)W_refresh_limits, METH_NOARGS,
     "Re-read the tails of the readers the gate waits for, under its lock, and set the limits "
     "from the slowest: returns (min tail, min count)."},
    {"span", (PyCFunction)W_span, METH_O,
     "Bytes a record of this size takes at the cursor, with the PAD before it if any."},
    {"claim", (PyCFunction)(void (*)(void))W_claim, METH_FASTCALL,
     "The data-area offset of room for a record of ``size`` bytes holding ``count`` messages "
     "(its PAD written), or -1: no room now, or too big."},
    {"put_plain", (PyCFunction)(void (*)(void))W_put_plain, METH_FASTCALL,
     "Write and publish one record without buffers if there is room now: the hot path."},
    {"put_buffer", (PyCFunction)(void (*)(void))W_put_buffer, METH_FASTCALL,
     "Write and publish one message with one out-of-band buffer if there is room now."},
    {"put_object", (PyCFunction)(void (*)(void))W_put_object, METH_FASTCALL,
     "Pickle an object and put it as one plain record if it is one; else what is left."},
    {"publish", (PyCFunction)W_publish, METH_NOARGS,
     "Make what was written visible, and wake the readers that sleep."},
    {"wake_readers", (PyCFunction)W_wake_readers_py, METH_NOARGS,
     "Wake each reader that sleeps in an episode not woken yet."},
    {"release", (PyCFunction)W_release, METH_NOARGS,
     "Stop touching the ring's memory (the segment is being unmapped)."},
    {NULL}};

#define U64M(type, name, doc) {#name, T_ULONGLONG, offsetof(type, name), 0, doc}
#define U64RO(type, name, doc) {#name, T_ULONGLONG, offsetof(type, name), READONLY, doc}

static PyMemberDef W_members[] = {
    U64M(WriterCore, pos, "write cursor; beyond head while written records are unpublished"),
    U64M(WriterCore, count, "messages written"),
    U64M(WriterCore, head, "bytes published"),
    U64M(WriterCore, head_count, "messages published"),
    U64M(WriterCore, limit_pos, "the cursor may advance up to here without re-checking"),
    U64M(WriterCore, limit_count, "and the count up to here"),
    U64M(WriterCore, need_span, "bytes the last failed write waited for"),
    U64M(WriterCore, need_count, "messages the last failed write waited for"),
    U64M(WriterCore, wakeups, "wake-up syscalls made"),
    U64M(WriterCore, publishes, "publications"),
    U64M(WriterCore, sent, "messages put through put_plain and put_buffer"),
    U64M(WriterCore, sent_bytes, "their payload bytes"),
    U64RO(WriterCore, max_record, "largest record written whole"),
    {"dumps_failed", T_BOOL, offsetof(WriterCore, dumps_failed), 0,
     "the last put_object's error came from dumps"},
    {"arrays", T_OBJECT, offsetof(WriterCore, arrays), 0,
     "the stream pickles of numpy arrays by (dtype, shape), which put_object writes arrays with"},
    {NULL}};

static PyType_Slot W_slots[] = {
    {Py_tp_doc, "The writer's per-message work: claim room, write a record, publish, wake "
                "readers."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, W_init},
    {Py_tp_dealloc, W_dealloc},
    {Py_tp_traverse, W_traverse},
    {Py_tp_clear, W_clear},
    {Py_tp_methods, W_methods},
    {Py_tp_members, W_members},
    {Py_bf_getbuffer, W_getbuffer},
    {Py_bf_releasebuffer, W_releasebuffer},
    {0, NULL}};

static PyType_Spec W_spec = {
    .name = "aioshmq.ring.compiled.WriterCore",
    .basicsize = sizeof(WriterCore),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = W_slots,
};

/* -- a reader -------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Mem m;
    unsigned long long index, tail, count, head, shown_tail, shown_count, wakeups;
    unsigned long long taken, taken_bytes, episode;
    PyObject *pins;     /* list of (pos, count) of leased records, oldest first */
    PyObject *name;     /* the ring's name, for ReaderEvicted */
    char assembling;    /* a fragmented message is being put together: the fast paths pass */
    int wake_writer;    /* the writer's wake-up fd */
    int writer_eventfd;
} ReaderCore;

static int R_init(ReaderCore *self, PyObject *args, PyObject *kwds) {
    PyObject *buf, *name;
    Py_ssize_t data_offset;
    unsigned long long cap, max_messages, readers, index;
    int wake_fd, eventfd;
    static char *kwlist[] = {"mapping", "data_offset", "capacity", "max_messages", "readers",
                             "index",   "wake_fd",     "eventfd",  "name",         NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnKKKKipU:ReaderCore", kwlist, &buf,
                                     &data_offset, &cap, &max_messages, &readers, &index,
                                     &wake_fd, &eventfd, &name))
        return -1;
    if (index >= readers) {
        PyErr_Format(PyExc_ValueError, "reader %llu of a ring with %llu slots", index, readers);
        return -1;
    }
    if (wake_fd < 0) {
        PyErr_Format(PyExc_ValueError, "no fd %d", wake_fd);
        return -1;
    }
    if (mem_init(&self->m, buf, data_offset, cap, max_messages, readers) < 0) return -1;
    self->wake_writer = wake_fd;
    self->writer_eventfd = eventfd;
    self->name = Py_NewRef(name);
    self->index = index;
    self->tail = self->head = self->shown_tail = ld_acquire(rword(&self->m, index, R_TAIL));
    self->count = self->shown_count = ld(rword(&self->m, index, R_TAIL_COUNT));
    self->pins = PyList_New(0);
    if (self->pins == NULL) return -1;
    return 0;
}

static int R_traverse(ReaderCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->pins);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int R_clear(ReaderCore *self) {
    Py_CLEAR(self->pins);
    return 0;
}

static void R_dealloc(ReaderCore *self) {
    PyObject_GC_UnTrack(self);
    R_clear(self);
    Py_CLEAR(self->name);
    self->m.exports = 0;
    mem_drop(&self->m);
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* -1 with ReaderEvicted raised: the writer evicted this reader.  Any error already set
 * (from a load of a record the writer may have overwritten) is dropped: it means nothing
 * once the reader is evicted. */
static int R_raise_evicted(ReaderCore *self, uint64_t mark) {
    PyErr_Clear();
    PyObject *exc = PyObject_CallFunction(ReaderEvicted, "OKd", self->name, self->index,
                                          (double)mark / 1000.0);
    if (exc != NULL) {
        PyErr_SetObject(ReaderEvicted, exc);
        Py_DECREF(exc);
    }
    return -1;
}

/* Before reading a record: 0, or -1 if the writer evicted this reader. */
static inline int R_check_evicted_(ReaderCore *self) {
    uint64_t mark = ld(rword(&self->m, self->index, R_EVICTED));
    return mark ? R_raise_evicted(self, mark) : 0;
}

/* After reading a record (the seqlock's second look): the writer stores the mark, fences,
 * and only then reuses the reader's records; so a read that saw any overwritten byte sees
 * the mark here, behind the acquire fence.  0 if what was read is sound. */
static inline int R_recheck_evicted_(ReaderCore *self) {
    atomic_thread_fence(memory_order_acquire);
    return R_check_evicted_(self);
}

/* 1 if there is something past the tail, 0 if not, -1 on a corrupt head or an eviction
 * (looked at first: a writer that evicted this reader may have lapped it). */
static int R_refresh_(ReaderCore *self) {
    if (R_check_evicted_(self) < 0) return -1;
    uint64_t head = ld_acquire(wword(&self->m, W_HEAD));
    self->head = head;
    if ((head | self->tail) % RECORD_ALIGN) {
        self->head = self->tail;
        PyErr_Format(CorruptedError,
                     "head %llu or reader %llu's tail %llu is not a record boundary (a "
                     "multiple of %llu)",
                     (unsigned long long)head, self->index, self->tail, RECORD_ALIGN);
        return -1;
    }
    if (head - self->tail > self->m.cap || head < self->tail) {
        self->head = self->tail;
        PyErr_Format(CorruptedError, "head %llu is %s reader %llu's tail %llu",
                     (unsigned long long)head,
                     head < self->tail ? "behind" : "more than a ring ahead of", self->index,
                     self->tail);
        return -1;
    }
    return self->tail != head;
}

static inline int R_available_(ReaderCore *self) {
    return self->tail != self->head ? 1 : R_refresh_(self);
}

static int R_publish_(ReaderCore *self) {
    Mem *m = &self->m;
    uint64_t tail = self->tail, count = self->count;
    if (self->pins == NULL || !PyList_Check(self->pins)) {
        PyErr_SetString(PyExc_TypeError, "pins must be a list");
        return -1;
    }
    if (PyList_GET_SIZE(self->pins)) {
        PyObject *mark = PyList_GET_ITEM(self->pins, 0);
        if (!PyTuple_Check(mark) || PyTuple_GET_SIZE(mark) != 2
            || u64_arg(PyTuple_GET_ITEM(mark, 0), &tail) < 0
            || u64_arg(PyTuple_GET_ITEM(mark, 1), &count) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a pin is (pos, count)");
            return -1;
        }
    }
    st(rword(m, self->index, R_TAIL_COUNT), count);
    st_release(rword(m, self->index, R_TAIL), tail);
    full_fence();
    if (ld(wword(m, W_SLEEP))) {
        uint64_t want_pos = ld_acquire(wword(m, W_WANT_POS));
        uint64_t want_count = ld(wword(m, W_WANT_COUNT));
        if (tail >= want_pos && count >= want_count
            && !(self->shown_tail >= want_pos && self->shown_count >= want_count)) {
            self->wakeups++;
            if (notify(self->wake_writer, self->writer_eventfd) < 0) return -1;
        }
    }
    self->shown_tail = tail;
    self->shown_count = count;
    return 0;
}

static PyObject *R_refresh(ReaderCore *self, PyObject *unused) {
    if (mem_released(&self->m)) return NULL;
    int r = R_refresh_(self);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *R_available(ReaderCore *self, PyObject *unused) {
    if (mem_released(&self->m)) return NULL;
    int r = R_available_(self);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *R_publish(ReaderCore *self, PyObject *unused) {
    if (mem_released(&self->m)) return NULL;
    if (R_publish_(self) < 0) return NULL;
    Py_RETURN_NONE;
}

/* The next record if it holds whole messages without buffers (one, or with ``batches`` a
 * batch), loaded with ``loads`` and consumed even if ``loads`` raises: (object, messages),
 * ``empty`` for anything else (next() then handles it, or reports what is wrong with it:
 * every bound is checked here first), NULL with an error set. */
static PyObject *R_load_plain(ReaderCore *self, PyObject *loads, PyObject *empty, int batches,
                              uint64_t *messages) {
    Mem *m = &self->m;
    if (mem_released(m)) return NULL;
    if (R_check_evicted_(self) < 0) return NULL;
    uint64_t tail = self->tail;
    if (tail == self->head) {
        int r = R_refresh_(self);
        if (r < 0) return NULL;
        if (r == 0) return Py_NewRef(empty);
    }
    uint64_t cap = m->cap, off = tail % cap;
    uint64_t word = ld(dword(m, off));
    uint64_t kind = word & 0xFF, len = word >> 8;
    *messages = 1;
    if ((kind != MSG && !(batches && kind == (MSG | BATCH))) || self->assembling)
        return Py_NewRef(empty);
    if (len > cap || off + HEADER_SIZE + len > cap || HEADER_SIZE + len > self->head - tail)
        return Py_NewRef(empty);
    if (kind & BATCH) {
        *messages = ld(dword(m, off + 8));
        if (*messages < 2 || *messages > m->max_messages) return Py_NewRef(empty);
    }
    PyObject *obj = mem_load(m, (PyObject *)self, loads, m->data + off + HEADER_SIZE, len);
    if (m->base == NULL) { /* released while loading (closed from a __setstate__?) */
        Py_XDECREF(obj);
        mem_released(m);
        return NULL;
    }
    if (R_recheck_evicted_(self) < 0) {
        Py_XDECREF(obj);
        return NULL;
    }
    self->tail += record_size(len);
    self->count += *messages;
    self->taken += *messages;
    self->taken_bytes += len;
    if (R_publish_(self) < 0) {
        Py_XDECREF(obj);
        return NULL;
    }
    return obj;
}

/* get_plain(loads, empty): the next plain message loaded with ``loads`` and consumed, or
 * ``empty`` if the next record is anything else (or there is none). */
static PyObject *R_get_plain(ReaderCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get_plain(loads, empty)");
        return NULL;
    }
    uint64_t messages;
    return R_load_plain(self, args[0], args[1], 0, &messages);
}

/* get_record(loads, empty): the next record if it holds whole messages without buffers (one,
 * or a batch), loaded with ``loads`` and consumed (even if ``loads`` raises), as (object,
 * messages); ``empty`` for anything else, which next() then handles or reports. */
static PyObject *R_get_record(ReaderCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get_record(loads, empty)");
        return NULL;
    }
    uint64_t messages;
    PyObject *obj = R_load_plain(self, args[0], args[1], 1, &messages);
    if (obj == NULL || obj == args[1]) return obj;
    return Py_BuildValue("(NK)", obj, (unsigned long long)messages);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

/* spin(seconds): look at the head (and the closed flag) for up to ``seconds`` without the
 * GIL; True as soon as something is published past the tail or the writer closed. */
static PyObject *R_spin(ReaderCore *self, PyObject *arg) {
    Mem *m = &self->m;
    if (mem_released(m)) return NULL;
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (self->tail != self->head) Py_RETURN_TRUE;
    const uint64_t *head = wword(m, W_HEAD), *closed = wword(m, W_CLOSED);
    uint64_t tail = self->tail;
    int seen = 0;
    struct timespec t0, t;
    Py_BEGIN_ALLOW_THREADS
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned i = 1;; i++) {
        if (ld(head) != tail || ld(closed)) {
            seen = 1;
            break;
        }
        cpu_relax();
        if (i % 64 == 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((double)(t.tv_sec - t0.tv_sec) + (t.tv_nsec - t0.tv_nsec) * 1e-9 >= seconds) break;
        }
    }
    Py_END_ALLOW_THREADS
    if (!seen) Py_RETURN_FALSE;
    int r = R_available_(self);
    if (r < 0) return NULL;
    Py_RETURN_TRUE;
}

/* next(): the next record that is not padding as (payload, kind, ring bytes, aux), not
 * consumed (the PADs before it are); None if nothing is published past the tail.  The
 * record is checked as layout.check_record checks it: a known kind (KIND_KNOWN), within
 * the ring and the head, and a batch's count within the ring's bounds. */
static PyObject *R_next(ReaderCore *self, PyObject *unused) {
    Mem *m = &self->m;
    if (mem_released(m)) return NULL;
    uint64_t cap = m->cap;
    for (;;) {
        int r = R_available_(self);
        if (r < 0) return NULL;
        if (r == 0) Py_RETURN_NONE;
        if (R_check_evicted_(self) < 0) return NULL;
        uint64_t off = self->tail % cap;
        uint64_t word = ld(dword(m, off));
        uint64_t kind = word & 0xFF, length = word >> 8;
        if (!KIND_KNOWN[kind]) {
            PyErr_Format(CorruptedError, "unknown record kind 0x%x at position %llu",
                         (unsigned)kind, self->tail);
            return NULL;
        }
        if (length > cap || off + HEADER_SIZE + length > cap
            || HEADER_SIZE + length > self->head - self->tail) {
            int ring_end = length > cap || off + HEADER_SIZE + length > cap;
            if (ring_end)
                PyErr_Format(CorruptedError,
                             "record at position %llu (kind %llu) claims %llu bytes, past the "
                             "end of the ring",
                             self->tail, (unsigned long long)kind, (unsigned long long)length);
            else
                PyErr_Format(CorruptedError,
                             "record at position %llu (kind %llu) claims %llu bytes, past the "
                             "head %llu",
                             self->tail, (unsigned long long)kind, (unsigned long long)length,
                             self->head);
            return NULL;
        }
        if (kind == PAD) {
            if (off + HEADER_SIZE + length != cap) {
                PyErr_Format(CorruptedError,
                             "padding at position %llu of %llu bytes stops short of the end",
                             self->tail, (unsigned long long)length);
                return NULL;
            }
            self->tail += cap - off;
            continue;
        }
        uint64_t aux = 0;
        if ((kind & BATCH) || (kind & KIND_MASK) == FIRST) aux = ld(dword(m, off + 8));
        if ((kind & BATCH) && (aux < 2 || aux > m->max_messages)) {
            PyErr_Format(CorruptedError,
                         "batch at position %llu claims %llu messages (max_messages=%llu)",
                         self->tail, (unsigned long long)aux, (unsigned long long)m->max_messages);
            return NULL;
        }
        PyObject *view = mem_view(m, (PyObject *)self, m->data + off + HEADER_SIZE, length);
        if (view == NULL) return NULL;
        return Py_BuildValue("(NKKK)", view, (unsigned long long)kind,
                             (unsigned long long)record_size(length), (unsigned long long)aux);
    }
}

/* consume(size, messages): step past ``size`` ring bytes holding ``messages`` messages once
 * they were read (not published); ReaderEvicted instead if the writer evicted this reader
 * meanwhile, as what was read may then be torn. */
static PyObject *R_consume(ReaderCore *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t size, messages;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "consume(size, messages)");
        return NULL;
    }
    if (u64_arg(args[0], &size) < 0 || u64_arg(args[1], &messages) < 0) return NULL;
    if (mem_released(&self->m)) return NULL;
    if (R_recheck_evicted_(self) < 0) return NULL;
    self->tail += size;
    self->count += messages;
    Py_RETURN_NONE;
}

static PyObject *R_prepare_sleep(ReaderCore *self, PyObject *unused) {
    Mem *m = &self->m;
    if (mem_released(m)) return NULL;
    self->episode += 2;
    st(rword(m, self->index, R_SLEEP), self->episode);
    full_fence();
    int r = R_available_(self);
    if (r < 0) return NULL;
    if (r || ld(wword(m, W_CLOSED))) {
        st(rword(m, self->index, R_SLEEP), 0);
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *R_end_sleep(ReaderCore *self, PyObject *unused) {
    if (mem_released(&self->m)) return NULL;
    st(rword(&self->m, self->index, R_SLEEP), 0);
    Py_RETURN_NONE;
}

static PyObject *R_check_evicted(ReaderCore *self, PyObject *unused) {
    if (mem_released(&self->m)) return NULL;
    if (R_recheck_evicted_(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *R_release(ReaderCore *self, PyObject *unused) {
    mem_drop(&self->m);
    Py_RETURN_NONE;
}

static int R_getbuffer(ReaderCore *self, Py_buffer *view, int flags) {
    return mem_getbuffer(&self->m, (PyObject *)self, view, flags);
}
static void R_releasebuffer(ReaderCore *self, Py_buffer *view) { mem_releasebuffer(&self->m); }

static PyMethodDef R_methods[] = {
    {"refresh", (PyCFunction)R_refresh, METH_NOARGS,
     "Load the published head; True if there is something past this reader's tail."},
    {"available", (PyCFunction)R_available, METH_NOARGS,
     "Whether something is published past this reader's tail."},
    {"publish", (PyCFunction)R_publish, METH_NOARGS,
     "Store the tail; wake the writer if this step crossed the point it sleeps for."},
    {"get_plain", (PyCFunction)(void (*)(void))R_get_plain, METH_FASTCALL,
     "The next plain message, loaded and consumed; ``empty`` if the next is not plain."},
    {"get_record", (PyCFunction)(void (*)(void))R_get_record, METH_FASTCALL,
     "The next record of whole plain messages (one or a batch), loaded and consumed."},
    {"spin", (PyCFunction)R_spin, METH_O,
     "Watch the ring up to ``seconds`` without the GIL: True once there is news."},
    {"next", (PyCFunction)R_next, METH_NOARGS,
     "The next record that is not padding, as (payload, kind, ring bytes, aux), not consumed."},
    {"consume", (PyCFunction)(void (*)(void))R_consume, METH_FASTCALL,
     "Step past ``size`` ring bytes holding ``messages`` messages, once read."},
    {"prepare_sleep", (PyCFunction)R_prepare_sleep, METH_NOARGS,
     "Announce that this reader is about to sleep; False if data or the end arrived."},
    {"end_sleep", (PyCFunction)R_end_sleep, METH_NOARGS, "The reader is awake."},
    {"check_evicted", (PyCFunction)R_check_evicted, METH_NOARGS,
     "Raise ReaderEvicted if the writer evicted this reader (after reading a record)."},
    {"release", (PyCFunction)R_release, METH_NOARGS,
     "Stop touching the ring's memory (the segment is being unmapped)."},
    {NULL}};

static PyMemberDef R_members[] = {
    U64RO(ReaderCore, index, "this reader's slot"),
    U64M(ReaderCore, tail, "bytes consumed"),
    U64M(ReaderCore, count, "messages consumed"),
    U64M(ReaderCore, head, "the head last loaded"),
    U64M(ReaderCore, shown_tail, "the tail last published"),
    U64M(ReaderCore, shown_count, "the count last published"),
    U64M(ReaderCore, wakeups, "wake-up syscalls made to the writer"),
    U64M(ReaderCore, taken, "messages taken through the plain paths"),
    U64M(ReaderCore, taken_bytes, "their payload bytes"),
    U64M(ReaderCore, episode, "the current sleep episode id"),
    {"pins", T_OBJECT, offsetof(ReaderCore, pins), 0, "leased records, oldest first"},
    {"assembling", T_BOOL, offsetof(ReaderCore, assembling), 0,
     "a fragmented message is being put together: the fast paths leave every record to next()"},
    {NULL}};

static PyType_Slot R_slots[] = {
    {Py_tp_doc, "A reader's per-message work: read records, publish the tail, wake the writer."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, R_init},
    {Py_tp_dealloc, R_dealloc},
    {Py_tp_traverse, R_traverse},
    {Py_tp_clear, R_clear},
    {Py_tp_methods, R_methods},
    {Py_tp_members, R_members},
    {Py_bf_getbuffer, R_getbuffer},
    {Py_bf_releasebuffer, R_releasebuffer},
    {0, NULL}};

static PyType_Spec R_spec = {
    .name = "aioshmq.ring.compiled.ReaderCore",
    .basicsize = sizeof(ReaderCore),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = R_slots,
};

/* -- fences for the code that stays in Python ------------------------------------------------ */

static PyObject *py_fence(PyObject *mod, PyObject *unused) {
    full_fence();
    Py_RETURN_NONE;
}
static PyObject *py_release(PyObject *mod, PyObject *unused) {
    atomic_thread_fence(memory_order_release);
    Py_RETURN_NONE;
}
static PyObject *py_acquire(PyObject *mod, PyObject *unused) {
    atomic_thread_fence(memory_order_acquire);
    Py_RETURN_NONE;
}

/* plain_pickle(obj): plain_dump's pickle of ``obj`` as bytes, or None if it is not plain. */
static PyObject *py_plain_pickle(PyObject *mod, PyObject *obj) {
    PlainPickler p = {0};
    int r = plain_dump(&p, obj);
    PyObject *result = r < 0 ? NULL
                       : r == PLAIN_DONE ? PyBytes_FromStringAndSize((const char *)p.buf, p.len)
                                         : Py_NewRef(Py_None);
    plain_free(&p);
    return result;
}

static PyMethodDef module_methods[] = {
    {"plain_pickle", py_plain_pickle, METH_O,
     "pickle.dumps(obj, protocol=5) as the writer's put_object writes plain values; None if "
     "obj is not plain."},
    {"fence", py_fence, METH_NOARGS, "Full memory barrier (seq_cst)."},
    {"release", py_release, METH_NOARGS, "Release fence: earlier accesses before later stores."},
    {"acquire", py_acquire, METH_NOARGS, "Acquire fence: earlier loads before later accesses."},
    {NULL}};

static PyObject *add_type(PyObject *mod, PyType_Spec *spec, const char *name) {
    PyObject *t = PyType_FromModuleAndSpec(mod, spec, NULL);
    if (t == NULL || PyModule_AddObjectRef(mod, name, t) < 0) {
        Py_XDECREF(t);
        return NULL;
    }
    return t;
}

/* The constants this core was built with (format.h), by name: a test compares them with
 * format.py, so a core built from another format is found out. */
static int add_format(PyObject *mod) {
    PyObject *d = PyDict_New(), *v;
    if (d == NULL) return -1;
#define ADD(name)                                                                 \
    v = PyLong_FromUnsignedLongLong(name);                                        \
    if (v == NULL || PyDict_SetItemString(d, #name, v) < 0) {                     \
        Py_XDECREF(v);                                                            \
        Py_DECREF(d);                                                             \
        return -1;                                                                \
    }                                                                             \
    Py_DECREF(v);
    FORMAT_CONSTANTS(ADD)
#undef ADD
    int r = PyModule_AddObjectRef(mod, "FORMAT", d);
    Py_DECREF(d);
    return r;
}

static int module_exec(PyObject *mod) {
    PyObject *errors = PyImport_ImportModule("aioshmq.base.errors");
    if (errors == NULL) return -1;
    CorruptedError = PyObject_GetAttrString(errors, "CorruptedError");
    ReaderEvicted = PyObject_GetAttrString(errors, "ReaderEvicted");
    Py_DECREF(errors);
    if (CorruptedError == NULL || ReaderEvicted == NULL) return -1;
    str_numpy = PyUnicode_InternFromString("numpy");
    str_ndarray = PyUnicode_InternFromString("ndarray");
    dumps_kwnames = Py_BuildValue("(ss)", "protocol", "buffer_callback");
    five = PyLong_FromLong(5);
    str_dtype = PyUnicode_InternFromString("dtype");
    str_shape = PyUnicode_InternFromString("shape");
    str_isbuiltin = PyUnicode_InternFromString("isbuiltin");
    str_plain_as_pickle = PyUnicode_InternFromString("plain_as_pickle");
    PyObject *pickle = PyImport_ImportModule("pickle");
    if (pickle == NULL) return -1;
    pickle_loads = PyObject_GetAttrString(pickle, "loads");
    pickle_dumps = PyObject_GetAttrString(pickle, "dumps");
    pickle_pickler = PyObject_GetAttrString(pickle, "Pickler");
    Py_DECREF(pickle);
    PyObject *types = PyImport_ImportModule("types");
    if (types == NULL) return -1;
    namespace_type = PyObject_GetAttrString(types, "SimpleNamespace");
    Py_DECREF(types);
    empty_bytes = PyBytes_FromStringAndSize(NULL, 0);
    if (!str_numpy || !str_ndarray || !dumps_kwnames || !five || !pickle_loads
        || !str_plain_as_pickle || !str_dtype || !str_shape || !str_isbuiltin || !pickle_dumps
        || !pickle_pickler || !namespace_type || !empty_bytes)
        return -1;
    PyObject *gate = add_type(mod, &G_spec, "Gate");
    if (gate == NULL) return -1;
    Gate_type = (PyTypeObject *)gate; /* the module keeps it */
    Py_DECREF(gate);
    PyObject *w = add_type(mod, &W_spec, "WriterCore");
    if (w == NULL) return -1;
    Py_DECREF(w);
    PyObject *r = add_type(mod, &R_spec, "ReaderCore");
    if (r == NULL) return -1;
    Py_DECREF(r);
    return add_format(mod);
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, module_exec}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "aioshmq.ring.compiled",
    .m_doc = "The ring's per-message work in C: the compiled twin of aioshmq.ring.pure.",
    .m_size = 0,
    .m_methods = module_methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit_compiled(void) { return PyModuleDef_Init(&module_def); }
