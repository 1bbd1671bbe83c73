/* Protocol-5 pickles of plain values, written in C byte for byte as CPython's _pickle writes
 * them (see plainpickle.c). */
#ifndef AIOSHMQ_PLAINPICKLE_H
#define AIOSHMQ_PLAINPICKLE_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject *key;      /* an object already pickled (or a tuple being pickled) */
    Py_ssize_t index;   /* its memo index, or -1 for a tuple whose items are being pickled */
    uint32_t gen;       /* the entry holds only if this is the pickler's current gen */
} PlainMemoEntry;

typedef struct {
    unsigned char *buf; /* the pickle being written, NULL until the first dump */
    Py_ssize_t len;     /* bytes of it written */
    PlainMemoEntry *memo;
    size_t memo_bits, memo_used, memo_limit; /* 2 ** memo_bits entries, half of them usable */
    Py_ssize_t memo_next; /* the next memo index, as _pickle counts them */
    uint32_t gen;
} PlainPickler;

/* The outcomes of plain_dump besides -1 (an error set: memory ran out). */
#define PLAIN_DONE 0
#define PLAIN_NOT 1

/* pickle.dumps(obj, protocol=5) into p->buf[0:p->len] if ``obj`` is plain: None, a bool, an
 * int of 64 bits, a float, a str or bytes, or a tuple, list or dict of exactly those types,
 * nested at most 100 deep, whose pickle fits in one 64 KiB frame.  PLAIN_NOT
 * for anything else: the caller pickles it with pickle itself.  Runs no Python code. */
int plain_dump(PlainPickler *p, PyObject *obj);

/* Frees what the pickler holds; it may be used again. */
void plain_free(PlainPickler *p);

#endif
