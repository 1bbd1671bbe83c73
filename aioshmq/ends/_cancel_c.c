/* The ends' checks in C: the compiled twin of aioshmq/_cancel.py's common case, of
 * aioshmq/_end.py's in_event_loop (the check that refuses a blocking call in a loop), and
 * of put, get, put_sync and get_sync up to their call of the ring core.
 *
 * pending_checkpoint() answers what aioshmq._cancel's pure function answers, reading the
 * same state: the thread's last loop (_cancel._seen), asyncio's current tasks, and the
 * cache of anyio task states (_cancel._cache).  It answers only where the pure function
 * would find everything in place (this thread's loop, a task whose state is cached, anyio's
 * attributes where it expects them); everywhere else it calls the pure function, which looks
 * things up the slow way, fills the cache, and gives the answer.  So both give the same
 * answer by construction, and the pure one stays the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>
#include <time.h>

#ifdef Py_T_OBJECT_EX
#define OBJECT_SLOT Py_T_OBJECT_EX
#else
#define OBJECT_SLOT T_OBJECT_EX
#endif

static PyObject *seen;          /* list: [(thread id, loop, whether loop._thread_id is set)] */
static PyObject *current_tasks; /* asyncio.tasks._current_tasks: loop -> task */
static PyObject *cache;         /* dict: id(task) -> (weakref to the task, anyio TaskState) */
static PyObject *fast;          /* list: [whether anyio's task state is usable] */
static PyObject *checkpoint;    /* anyio.lowlevel.checkpoint: what a cancelled task awaits */
static PyObject *slow;          /* the pure function */
static PyObject *s_thread_id, *s_cancel_scope, *s_cancel_called, *s_shield, *s_parent_scope;

/* anyio keeps what the walk reads in slots of its TaskState and CancelScope: their offsets,
 * from the types' member descriptors at setup, are read directly on objects of exactly
 * those types (a read by name costs several times more); anything else is read by name. */
typedef struct {
    PyTypeObject *type; /* a strong reference, or NULL: read by name */
    Py_ssize_t offset;
    PyObject **name;
    PyTypeObject *also[2]; /* strong references, or NULL: subclasses of ``type`` that slot()
                            * knows without walking their MRO */
} Field;
static Field f_cancel_scope = {NULL, 0, &s_cancel_scope};
static Field f_cancel_called = {NULL, 0, &s_cancel_called};
static Field f_shield = {NULL, 0, &s_shield};
static Field f_parent_scope = {NULL, 0, &s_parent_scope};

/* The task answered for last, as a weakref, and its anyio state: a task asks again and
 * again, and this spares the lookup in the shared cache (an int made per ask). */
static PyObject *last_ref, *last_state;

/* The referent of weakref ``ref`` as a new reference, or NULL (with no error) if dead. */
static PyObject *referent(PyObject *ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj;
    if (PyWeakref_GetRef(ref, &obj) < 0) {
        PyErr_Clear();
        return NULL;
    }
    return obj;
#else
    PyObject *obj = PyWeakref_GetObject(ref);
    if (obj == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (obj == Py_None) return NULL;
    Py_INCREF(obj);
    return obj;
#endif
}

/* Field ``f`` of ``obj`` as a new reference, or NULL if it is missing (no error set). */
static PyObject *field(PyObject *obj, const Field *f) {
    if (f->type != NULL && Py_TYPE(obj) == f->type) {
        PyObject *value = *(PyObject **)((char *)obj + f->offset);
        return value == NULL ? NULL : Py_NewRef(value);
    }
    PyObject *value = PyObject_GetAttr(obj, *f->name);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
    return value;
}

/* 1 if field ``f`` of ``obj`` is true, 0 if false, -1 if it is missing (no error set) or
 * its truth raised (error set). */
static int field_true(PyObject *obj, const Field *f) {
    PyObject *value = field(obj, f);
    if (value == NULL) return -1;
    int truth = value == Py_True ? 1 : value == Py_False ? 0 : PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* Where type ``tp`` keeps attribute ``name`` of its instances: ``f`` is set up to read the
 * slot if it is one of ``tp``'s own object slots, else left to read by name. */
static int find_slot(PyObject *tp, Field *f) {
    Py_CLEAR(f->type);
    Py_CLEAR(f->also[0]);
    Py_CLEAR(f->also[1]);
    if (tp == Py_None) return 0;
    if (!PyType_Check(tp)) {
        PyErr_SetString(PyExc_TypeError, "expected a type or None");
        return -1;
    }
    PyObject *descr = PyObject_GetAttr(tp, *f->name);
    if (descr == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDescrObject *member = (PyMemberDescrObject *)descr;
        if (member->d_common.d_type == (PyTypeObject *)tp && member->d_member->type == OBJECT_SLOT
            && member->d_member->offset > 0) {
            f->type = (PyTypeObject *)Py_NewRef(tp);
            f->offset = member->d_member->offset;
        }
    }
    Py_DECREF(descr);
    return 0;
}

/* The cancelled-scope walk of the pure function: 1 if a scope up to the first shield is
 * cancelled, 0 if none is, -1 if anyio's attributes are not where they should be. */
static int scope_cancelled(PyObject *state) {
    PyObject *scope = field(state, &f_cancel_scope);
    while (scope != NULL && scope != Py_None) {
        int called = field_true(scope, &f_cancel_called);
        if (called != 0) {
            Py_DECREF(scope);
            return called;
        }
        int shield = field_true(scope, &f_shield);
        if (shield != 0) {
            Py_DECREF(scope);
            return shield > 0 ? 0 : -1;
        }
        PyObject *parent = field(scope, &f_parent_scope);
        Py_DECREF(scope);
        scope = parent;
    }
    if (scope == NULL) return -1;
    Py_DECREF(scope);
    return 0;
}

/* The current task of this thread's last loop, as a new reference, or NULL with no error
 * where the pure function has to look (another thread's loop, no task, a stale entry). */
static PyObject *known_task(void) {
    PyObject *entry = PyList_GET_ITEM(seen, 0);
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3) return NULL;
    Py_INCREF(entry);
    PyObject *task = NULL;
    unsigned long tid = PyThread_get_thread_ident();
    unsigned long seen_tid = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(entry, 0));
    if (seen_tid == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        goto done;
    }
    if (seen_tid != tid) goto done;
    PyObject *loop = PyTuple_GET_ITEM(entry, 1);
    task = PyDict_GetItemWithError(current_tasks, loop);
    if (task == NULL) {
        PyErr_Clear();
        goto done;
    }
    Py_INCREF(task);
    if (PyTuple_GET_ITEM(entry, 2) == Py_True) { /* a stdlib loop: is it this thread's? */
        PyObject *owner = PyObject_GetAttr(loop, s_thread_id);
        unsigned long owner_tid = owner == NULL ? 0 : PyLong_AsUnsignedLong(owner);
        Py_XDECREF(owner);
        if (PyErr_Occurred()) PyErr_Clear();
        if (owner == NULL || owner_tid != tid) Py_CLEAR(task);
    }
done:
    Py_DECREF(entry);
    return task;
}

static PyObject *pending_checkpoint(PyObject *module, PyObject *unused) {
    if (slow == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aioshmq._cancel_c.setup() was not called");
        return NULL;
    }
    if (PyList_GET_ITEM(fast, 0) != Py_True) return PyObject_CallNoArgs(slow);
    PyObject *task = known_task();
    if (task == NULL) return PyObject_CallNoArgs(slow);
    PyObject *state = NULL;
    if (last_ref != NULL) {
        PyObject *target = referent(last_ref);
        if (target == task) state = Py_NewRef(last_state);
        Py_XDECREF(target);
    }
    if (state == NULL) {
        PyObject *key = PyLong_FromVoidPtr(task);
        if (key == NULL) {
            Py_DECREF(task);
            return NULL;
        }
        PyObject *entry = PyDict_GetItemWithError(cache, key); /* borrowed */
        Py_DECREF(key);
        if (entry != NULL && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2) {
            PyObject *ref = Py_NewRef(PyTuple_GET_ITEM(entry, 0));
            PyObject *target = referent(ref);
            if (target == task) {
                state = Py_NewRef(PyTuple_GET_ITEM(entry, 1));
                Py_XSETREF(last_state, Py_NewRef(state));
                Py_XSETREF(last_ref, Py_NewRef(ref));
            }
            Py_XDECREF(target);
            Py_DECREF(ref);
        }
        if (PyErr_Occurred()) PyErr_Clear();
    }
    Py_DECREF(task);
    if (state == NULL) return PyObject_CallNoArgs(slow);
    int cancelled = scope_cancelled(state);
    Py_DECREF(state);
    if (cancelled < 0) { /* anyio moved something: the pure function says what now */
        PyErr_Clear();
        return PyObject_CallNoArgs(slow);
    }
    if (cancelled) return Py_NewRef(checkpoint);
    Py_RETURN_NONE;
}

static PyObject *setup(PyObject *module, PyObject *args) {
    PyObject *a_seen, *a_tasks, *a_cache, *a_fast, *a_checkpoint, *a_slow;
    PyObject *a_state_type = Py_None, *a_scope_type = Py_None;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OO|OO:setup", &PyList_Type, &a_seen, &PyDict_Type,
                          &a_tasks, &PyDict_Type, &a_cache, &PyList_Type, &a_fast,
                          &a_checkpoint, &a_slow, &a_state_type, &a_scope_type))
        return NULL;
    if (PyList_GET_SIZE(a_seen) != 1 || PyList_GET_SIZE(a_fast) != 1) {
        PyErr_SetString(PyExc_ValueError, "seen and fast must be lists of one item");
        return NULL;
    }
    if (find_slot(a_state_type, &f_cancel_scope) < 0 || find_slot(a_scope_type, &f_cancel_called) < 0
        || find_slot(a_scope_type, &f_shield) < 0 || find_slot(a_scope_type, &f_parent_scope) < 0)
        return NULL;
    Py_CLEAR(last_ref);
    Py_CLEAR(last_state);
    Py_XSETREF(seen, Py_NewRef(a_seen));
    Py_XSETREF(current_tasks, Py_NewRef(a_tasks));
    Py_XSETREF(cache, Py_NewRef(a_cache));
    Py_XSETREF(fast, Py_NewRef(a_fast));
    Py_XSETREF(checkpoint, Py_NewRef(a_checkpoint));
    Py_XSETREF(slow, Py_NewRef(a_slow));
    Py_RETURN_NONE;
}

/* in_event_loop(): the twin of aioshmq._end's pure function, set up by setup_loop_check.
 * It answers itself where no trio is imported (most processes that call put_sync), and
 * calls the pure function wherever trio could be running. */
static PyObject *running_loop; /* asyncio.events._get_running_loop */
static PyObject *modules;      /* sys.modules */
static PyObject *slow_in_loop; /* the pure function */
static PyObject *s_trio;

static PyObject *in_event_loop(PyObject *module, PyObject *unused) {
    if (slow_in_loop == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "aioshmq._cancel_c.setup_loop_check() was not called");
        return NULL;
    }
    PyObject *loop = PyObject_CallNoArgs(running_loop);
    if (loop == NULL) return NULL;
    int running = loop != Py_None;
    Py_DECREF(loop);
    if (running) Py_RETURN_TRUE;
    if (!PyDict_CheckExact(modules)) return PyObject_CallNoArgs(slow_in_loop);
    PyObject *trio = PyDict_GetItemWithError(modules, s_trio); /* borrowed */
    if (trio != NULL) return PyObject_CallNoArgs(slow_in_loop);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_FALSE;
}

static PyObject *setup_loop_check(PyObject *module, PyObject *args) {
    PyObject *a_running, *a_modules, *a_slow;
    if (!PyArg_ParseTuple(args, "OOO:setup_loop_check", &a_running, &a_modules, &a_slow))
        return NULL;
    Py_XSETREF(running_loop, Py_NewRef(a_running));
    Py_XSETREF(modules, Py_NewRef(a_modules));
    Py_XSETREF(slow_in_loop, Py_NewRef(a_slow));
    Py_RETURN_NONE;
}

/* -- put_sync and get_sync ------------------------------------------------------------------
 *
 * The compiled twins of Writer.put_sync and Reader.get_sync, installed on the classes as
 * method descriptors by setup_sync.  Each does what the pure method does up to the ring
 * core's call and no further: it reads the end's state from its slots (see End.__slots__),
 * and wherever the pure method would do anything but check and call the core (an end that
 * is closed or halted, a loop running in this thread, the task lock held, pending messages,
 * no room, a message that is not plain) it calls the pure method, which has touched
 * nothing yet, or the pure method's own continuation.  So the two behave alike by
 * construction, and the pure ones stay the reference. */

static PyObject *s_closed, *s_lock, *s_ring, *s_halt, *s_pickles, *s_ser, *s_pending,
    *s_deferred, *s_loads_plain, *s_held, *s_current, *s_torch, *s_torch_module, *s_timeout,
    *s_put_object, *s_get_plain, *s_put_failed, *s_put_sync_rest, *s_closed_error;
static Field f_closed = {NULL, 0, &s_closed}, f_lock = {NULL, 0, &s_lock},
             f_ring = {NULL, 0, &s_ring}, f_halt = {NULL, 0, &s_halt},
             f_pickles = {NULL, 0, &s_pickles}, f_ser = {NULL, 0, &s_ser},
             f_pending = {NULL, 0, &s_pending}, f_deferred = {NULL, 0, &s_deferred},
             f_loads_plain = {NULL, 0, &s_loads_plain}, f_held = {NULL, 0, &s_held},
             f_current = {NULL, 0, &s_current}, f_torch = {NULL, 0, &s_torch};
static PyObject *pure_put, *pure_get, *empty; /* the pure methods; Reader's _EMPTY */
static PyObject *put_doc, *get_doc;            /* the docstrings the descriptors show */

/* Field ``f`` of ``obj`` (an instance of ``f->type`` or a subclass: slots are inherited) as a
 * borrowed reference, or NULL if the slot is empty or was not found at setup. */
static PyObject *slot(PyObject *obj, const Field *f) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (f->type == NULL) return NULL;
    if (tp != f->type && tp != f->also[0] && tp != f->also[1] && !PyType_IsSubtype(tp, f->type))
        return NULL;
    return *(PyObject **)((char *)obj + f->offset);
}

/* End's fields, read on every call from a Writer or a Reader: slot() knows those two types
 * (the types of f_halt and f_pending) as End's without walking their MRO. */
static void know_ends(Field *f) {
    PyTypeObject *ends[2] = {f_halt.type, f_pending.type};
    for (int i = 0; i < 2; i++) {
        int sub = f->type != NULL && ends[i] != NULL && PyType_IsSubtype(ends[i], f->type);
        Py_XSETREF(f->also[i], sub ? (PyTypeObject *)Py_NewRef(ends[i]) : NULL);
    }
}

/* Where a field of ``tp``'s instances lives, for slot(): a slot ``tp`` defines itself. */
static int find_own_slot(PyObject *tp, Field *f) {
    if (find_slot(tp, f) < 0) return -1;
    if (f->type == NULL) {
        PyErr_Format(PyExc_TypeError, "%R keeps no slot %R", tp, *f->name);
        return -1;
    }
    return 0;
}

/* The pure method ``pure`` called with ``end`` and the call's own arguments. */
static PyObject *call_pure(PyObject *pure, PyObject *end, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    Py_ssize_t n = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    PyObject *small[8];
    PyObject **stack = n < 8 ? small : PyMem_New(PyObject *, n + 1);
    if (stack == NULL) return PyErr_NoMemory();
    stack[0] = end;
    for (Py_ssize_t i = 0; i < n; i++) stack[i + 1] = args[i];
    PyObject *r = PyObject_Vectorcall(pure, stack, nargs + 1, kwnames);
    if (stack != small) PyMem_Free(stack);
    return r;
}

/* Whether a call is (obj, timeout=None), or (timeout=None) with ``positional`` 0: the pure
 * method, called with anything else, says what is wrong with it. */
static int plain_call(Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t positional) {
    if (kwnames == NULL) return nargs == positional || nargs == positional + 1;
    return nargs == positional && PyTuple_GET_SIZE(kwnames) == 1
           && PyTuple_GET_ITEM(kwnames, 0) == s_timeout;
}

/* 1 if true, 0 if false, -1 if absent (no error) or its truth raised (error set). */
static int truth(PyObject *value) {
    if (value == NULL) return -1;
    return value == Py_True ? 1 : value == Py_False ? 0 : PyObject_IsTrue(value);
}

/* A ring core's method as the ring's class defines it, looked up once for that class and
 * again whenever the class changes (its version tag moves on); the ring's own attributes
 * are still asked first, as a lookup by name asks them.  The full lookup on every call cost
 * about 400 instructions of a put or a get here (callgrind), some 5% of either. */
typedef struct {
    PyObject **name;
    PyTypeObject *type; /* a strong reference, or NULL */
    unsigned int tag;   /* type's version tag when ``method`` was looked up */
    PyObject *method;   /* a strong reference: a method descriptor of C code */
} CoreMethod;
static CoreMethod m_put_object = {&s_put_object}, m_get_plain = {&s_get_plain};

static int core_method_current(const CoreMethod *m, PyTypeObject *tp) {
    return tp == m->type && m->tag != 0 && tp->tp_version_tag == m->tag
           && PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG);
}

/* Remember what ``tp`` (the class of a ring the method was just called on) has under the
 * method's name, if that is C code found on a plain class: looking it up runs no Python. */
static void core_method_remember(CoreMethod *m, PyTypeObject *tp) {
    if (Py_TYPE(tp) != &PyType_Type || !PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG))
        return;
    PyObject *method = PyObject_GetAttr((PyObject *)tp, *m->name);
    if (method == NULL || !Py_IS_TYPE(method, &PyMethodDescr_Type)
        || !PyType_HasFeature(tp, Py_TPFLAGS_VALID_VERSION_TAG)) {
        PyErr_Clear();
        Py_XDECREF(method);
        return;
    }
    Py_XSETREF(m->type, (PyTypeObject *)Py_NewRef(tp));
    Py_XSETREF(m->method, method);
    m->tag = tp->tp_version_tag;
}

/* Whether ``ring``'s own attributes hold ``name``, which then comes before its class's method
 * (or cannot be told, which counts as yes). */
static int shadowed(PyObject *ring, PyObject *name) {
    if (Py_TYPE(ring)->tp_dictoffset == 0) return 0;
    PyObject *dict = PyObject_GenericGetDict(ring, NULL);
    int r = dict == NULL || !PyDict_CheckExact(dict) ? -1 : PyDict_Contains(dict, name);
    Py_XDECREF(dict);
    if (r < 0) PyErr_Clear();
    return r != 0;
}

/* ring.<name>(a, b), holding what it is given: a slot's value may be replaced meanwhile. */
static PyObject *call_core(CoreMethod *m, PyObject *ring, PyObject *a, PyObject *b) {
    PyObject *call[3] = {Py_NewRef(ring), Py_NewRef(a), Py_NewRef(b)};
    PyObject *r;
    if (core_method_current(m, Py_TYPE(ring)) && !shadowed(ring, *m->name)) {
        r = PyObject_Vectorcall(m->method, call, 3, NULL);
    } else {
        r = PyObject_VectorcallMethod(*m->name, call, 3, NULL);
        if (r != NULL) core_method_remember(m, Py_TYPE(ring));
    }
    for (int i = 0; i < 3; i++) Py_DECREF(call[i]);
    return r;
}

/* 1 if a loop runs in this thread, 0 if not, -1 on error. */
static int loop_running(void) {
    PyObject *r = in_event_loop(NULL, NULL);
    if (r == NULL) return -1;
    int running = r == Py_True;
    Py_DECREF(r);
    return running;
}

/* put_object raised: raise what the pure method raises (Writer._put_failed says, else the
 * error itself).  NULL, always. */
static PyObject *put_failed(PyObject *end, PyObject *obj) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL) PyException_SetTraceback(exc, tb);
    PyObject *r = PyObject_CallMethodObjArgs(end, s_put_failed, obj, exc, NULL);
    if (r == NULL) { /* what the failure means for the caller, raised from exc */
        Py_XDECREF(type);
        Py_XDECREF(exc);
        Py_XDECREF(tb);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_Restore(type, exc, tb);
    return NULL;
}

/* Whether ``end``'s state lets put take the one-call path: 1 yes, 0 no (no error set). */
static int put_ready(PyObject *end, PyObject **ring, PyObject **pickler) {
    PyObject *lock = slot(end, &f_lock), *ser = slot(end, &f_ser);
    *ring = slot(end, &f_ring);
    if (lock == NULL || ser == NULL || *ring == NULL || truth(slot(end, &f_halt)) != 0
        || slot(end, &f_pickles) != Py_True || truth(slot(lock, &f_held)) != 0
        || (slot(ser, &f_torch) != Py_True && PyDict_Contains(modules, s_torch_module) != 0)
        || (*pickler = slot(ser, &f_current)) == NULL) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* Whether ``end``'s state lets get take the one-call path: 1 yes, 0 no (no error set). */
static int get_ready(PyObject *end, PyObject **ring, PyObject **loads) {
    PyObject *lock = slot(end, &f_lock), *pending = slot(end, &f_pending);
    *ring = slot(end, &f_ring);
    *loads = slot(end, &f_loads_plain);
    Py_ssize_t waiting = pending == NULL ? -1 : PyObject_Length(pending);
    if (lock == NULL || *ring == NULL || *loads == NULL || waiting != 0
        || truth(slot(end, &f_closed)) != 0 || slot(end, &f_deferred) != Py_None
        || truth(slot(lock, &f_held)) != 0) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static PyObject *sync_put(PyObject *end, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    if (!plain_call(nargs, kwnames, 1))
        return call_pure(pure_put, end, args, nargs, kwnames);
    int running = loop_running(); /* first: it may run Python code */
    if (running != 0) {
        if (running < 0) return NULL;
        return call_pure(pure_put, end, args, nargs, kwnames);
    }
    PyObject *ring, *pickler;
    if (!put_ready(end, &ring, &pickler)) return call_pure(pure_put, end, args, nargs, kwnames);
    PyObject *obj = args[0];
    PyObject *rest = call_core(&m_put_object, ring, obj, pickler);
    if (rest == NULL) return put_failed(end, obj);
    if (rest == Py_None) return rest;
    PyObject *timeout = nargs > 1 || kwnames != NULL ? args[1] : Py_None;
    PyObject *r = PyObject_CallMethodObjArgs(end, s_put_sync_rest, obj, rest, timeout, NULL);
    Py_DECREF(rest);
    return r;
}

static PyObject *sync_get(PyObject *end, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames) {
    if (!plain_call(nargs, kwnames, 0))
        return call_pure(pure_get, end, args, nargs, kwnames);
    int running = loop_running(); /* first: it may run Python code */
    if (running != 0) {
        if (running < 0) return NULL;
        return call_pure(pure_get, end, args, nargs, kwnames);
    }
    PyObject *ring, *loads;
    if (!get_ready(end, &ring, &loads)) return call_pure(pure_get, end, args, nargs, kwnames);
    PyObject *obj = call_core(&m_get_plain, ring, loads, empty);
    if (obj == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError) || truth(slot(end, &f_closed)) != 1)
            return NULL;
        PyErr_Clear(); /* closed by another thread meanwhile */
        PyObject *closed = PyObject_CallMethodNoArgs(end, s_closed_error);
        if (closed == NULL) return NULL;
        PyException_SetCause(closed, NULL); /* raise ... from None */
        PyErr_SetObject((PyObject *)Py_TYPE(closed), closed);
        Py_DECREF(closed);
        return NULL;
    }
    if (obj != empty) return obj;
    Py_DECREF(obj);
    return call_pure(pure_get, end, args, nargs, kwnames); /* nothing there: it waits */
}

static PyMethodDef put_sync_def = {"put_sync", (PyCFunction)(void (*)(void))sync_put,
                                   METH_FASTCALL | METH_KEYWORDS, NULL};
static PyMethodDef get_sync_def = {"get_sync", (PyCFunction)(void (*)(void))sync_get,
                                   METH_FASTCALL | METH_KEYWORDS, NULL};

/* The docstring a descriptor shows: a text signature for inspect, then the pure one's. */
static int make_doc(PyMethodDef *def, PyObject **keep, const char *signature, PyObject *pure) {
    PyObject *doc = PyObject_GetAttrString(pure, "__doc__");
    if (doc == NULL) return -1;
    PyObject *text = doc == Py_None ? PyUnicode_FromFormat("%s\n--\n\n", signature)
                                    : PyUnicode_FromFormat("%s\n--\n\n%S", signature, doc);
    Py_DECREF(doc);
    if (text == NULL) return -1;
    const char *utf8 = PyUnicode_AsUTF8(text);
    if (utf8 == NULL) {
        Py_DECREF(text);
        return -1;
    }
    Py_XSETREF(*keep, text);
    def->ml_doc = utf8;
    return 0;
}

/* (put, get): ``put`` as a method descriptor of Writer, ``get`` of Reader (the types whose
 * own slots setup_sync found), for the caller to install on the classes. */
static PyObject *descriptors(PyMethodDef *put, PyMethodDef *get) {
    PyObject *p = PyDescr_NewMethod(f_halt.type, put);
    PyObject *g = p == NULL ? NULL : PyDescr_NewMethod(f_pending.type, get);
    if (g == NULL) {
        Py_XDECREF(p);
        return NULL;
    }
    return Py_BuildValue("(NN)", p, g);
}

static PyObject *setup_sync(PyObject *module, PyObject *args) {
    PyObject *end_t, *writer_t, *reader_t, *lock_t, *ser_t, *a_put, *a_get, *a_empty;
    if (!PyArg_ParseTuple(args, "OOOOOOOO:setup_sync", &end_t, &writer_t, &reader_t, &lock_t,
                          &ser_t, &a_put, &a_get, &a_empty))
        return NULL;
    if (modules == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "setup_loop_check() must come first");
        return NULL;
    }
    if (find_own_slot(end_t, &f_closed) < 0 || find_own_slot(end_t, &f_lock) < 0
        || find_own_slot(end_t, &f_ring) < 0 || find_own_slot(writer_t, &f_halt) < 0
        || find_own_slot(writer_t, &f_pickles) < 0 || find_own_slot(writer_t, &f_ser) < 0
        || find_own_slot(reader_t, &f_pending) < 0 || find_own_slot(reader_t, &f_deferred) < 0
        || find_own_slot(reader_t, &f_loads_plain) < 0 || find_own_slot(lock_t, &f_held) < 0
        || find_own_slot(ser_t, &f_current) < 0 || find_own_slot(ser_t, &f_torch) < 0)
        return NULL;
    know_ends(&f_closed);
    know_ends(&f_lock);
    know_ends(&f_ring);
    if (make_doc(&put_sync_def, &put_doc, "put_sync($self, /, obj, timeout=None)", a_put) < 0
        || make_doc(&get_sync_def, &get_doc, "get_sync($self, /, timeout=None)", a_get) < 0)
        return NULL;
    Py_XSETREF(pure_put, Py_NewRef(a_put));
    Py_XSETREF(pure_get, Py_NewRef(a_get));
    Py_XSETREF(empty, Py_NewRef(a_empty));
    return descriptors(&put_sync_def, &get_sync_def);
}

/* -- put and get ----------------------------------------------------------------------------
 *
 * The compiled twins of Writer.put and Reader.get, installed as method descriptors by
 * setup_async.  A call returns a Call: a coroutine (it has __await__, send, throw and close)
 * that does nothing until it is first sent to, as the pure coroutine does nothing until its
 * first step.  Its first step makes the pure method's checks and the ring core's call, in
 * the task that awaits it; wherever the pure method would do anything else (pace, raise a
 * pending cancellation, wait for room or for a message, a closed end, the task lock held)
 * it goes on as the pure coroutine, which has done nothing yet, or as put's continuation
 * (Writer._put_rest), and hands that coroutine every later send, throw and close.  What
 * costs the pure method most, making and running a Python frame, is what it spares. */

static PyObject *s_next_yield, *s_put_rest, *s_throw, *s_close, *s_yield_interval;
static PyObject *end_globals; /* aioshmq._end's namespace: YIELD_INTERVAL, read at each pace */
static Field f_next_yield = {NULL, 0, &s_next_yield};
static PyObject *pure_aput, *pure_aget; /* the pure coroutine functions */
static PyObject *aput_doc, *aget_doc;

/* time.monotonic(), computed as CPython computes it from the same clock. */
static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    if (ns % 1000000000 == 0) return (double)(ns / 1000000000);
    return (double)ns / 1e9;
}

/* Whether the pure method's first step would pace: 2 if it would (``*now`` the clock it
 * read), 1 if the pure method is to say (the state is not as expected), 0 if not, with
 * ``*cancelled`` then set to what it would await first for a pending cancellation (a new
 * reference) or NULL; -1 on error. */
static int pace_due(PyObject *end, PyObject **cancelled, double *now) {
    *cancelled = NULL;
    PyObject *next = slot(end, &f_next_yield);
    if (next == NULL || !PyFloat_CheckExact(next) || checkpoint == NULL || end_globals == NULL)
        return 1;
    *now = monotonic_now();
    if (*now >= PyFloat_AS_DOUBLE(next)) return 2;
    PyObject *c = pending_checkpoint(NULL, NULL);
    if (c == NULL) return -1;
    if (c == Py_None)
        Py_DECREF(c);
    else
        *cancelled = c;
    return 0;
}

/* The pace's checkpoint begun at ``at`` passed: the next one is due YIELD_INTERVAL later, as
 * the pure method's _pace sets it.  0, or -1 with an error set. */
static int pace_passed(PyObject *end, double at) {
    PyObject *interval = PyDict_GetItemWithError(end_globals, s_yield_interval); /* borrowed */
    if (interval == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "YIELD_INTERVAL is gone");
        return -1;
    }
    double dt = PyFloat_AsDouble(interval);
    if (dt == -1.0 && PyErr_Occurred()) return -1;
    PyObject *next = PyFloat_FromDouble(at + dt);
    if (next == NULL) return -1;
    int r = PyObject_SetAttr(end, s_next_yield, next);
    Py_DECREF(next);
    return r;
}

enum { DONE, FAILED, GO_ON, CHECKPOINT };

/* One step of put (``obj`` not NULL) or get, once the checkpoint it awaits first (if any) is
 * behind it (``checked``): DONE with ``*out`` the value it returns, FAILED with an error set,
 * GO_ON with ``*out`` the coroutine it goes on as, or CHECKPOINT with ``*out`` the coroutine
 * of the checkpoint to await before the next step: a pending cancellation's, or the pace's
 * (``*paced`` then the clock it read, for pace_passed once it is behind). */
static int step(PyObject *end, PyObject *obj, int checked, PyObject **out, double *paced) {
    PyObject *ring, *x;
    int ready = 1;
    if (!checked) {
        /* In the pure method's order: a closed (put: halted) end raises before the pace and
         * the cancellation check, and that is the pure method's to do. */
        int closed = truth(slot(end, obj != NULL ? &f_halt : &f_closed));
        if (closed < 0) PyErr_Clear();
        ready = closed == 0;
        PyObject *cancelled = NULL;
        double now = 0.0;
        int due = ready ? pace_due(end, &cancelled, &now) : 1;
        if (due < 0) return FAILED;
        if (cancelled != NULL) {
            *out = PyObject_CallNoArgs(cancelled);
            Py_DECREF(cancelled);
            return *out == NULL ? FAILED : CHECKPOINT;
        }
        if (due == 2) { /* the pure method's _pace: the loop runs once, then this goes on */
            *out = PyObject_CallNoArgs(checkpoint);
            *paced = now;
            return *out == NULL ? FAILED : CHECKPOINT;
        }
        ready = !due;
    }
    /* Read after the check, which may run Python code: a borrowed slot value read before it
     * would not be trusted. */
    if (ready) ready = obj != NULL ? put_ready(end, &ring, &x) : get_ready(end, &ring, &x);
    if (ready && obj != NULL) {
        PyObject *rest = call_core(&m_put_object, ring, obj, x);
        if (rest == NULL) return put_failed(end, obj), FAILED;
        if (rest == Py_None) return *out = rest, DONE;
        *out = PyObject_CallMethodObjArgs(end, s_put_rest, obj, rest, NULL);
        Py_DECREF(rest);
        return *out == NULL ? FAILED : GO_ON;
    }
    if (ready) {
        PyObject *got = call_core(&m_get_plain, ring, x, empty);
        if (got == NULL) return FAILED; /* what the pure get raises */
        if (got != empty) return *out = got, DONE;
        Py_DECREF(got);
    }
    if (obj != NULL) {
        PyObject *call[2] = {end, obj};
        *out = PyObject_Vectorcall(pure_aput, call, 2, NULL);
    } else {
        *out = PyObject_CallOneArg(pure_aget, end);
    }
    return *out == NULL ? FAILED : GO_ON;
}

typedef struct {
    PyObject_HEAD
    PyObject *end;   /* the Writer or Reader */
    PyObject *obj;   /* what put sends; NULL for get */
    PyObject *inner; /* the coroutine it awaits: a checkpoint, or the one it goes on as */
    int state;       /* 0: not started, 1: going on as inner, 2: finished, 3: checkpoint */
    double paced;    /* the checkpoint is the pace's, begun at this clock (0: it is not) */
} Call;

static PyTypeObject CallType;

static void call_finish(Call *self) {
    self->state = 2;
    Py_CLEAR(self->inner);
    Py_CLEAR(self->obj);
}

static PySendResult call_send(Call *self, PyObject *arg, PyObject **result);

/* Take the step that comes once the call's checkpoint is behind it (checked) or first. */
static PySendResult call_step(Call *self, int checked, PyObject **result) {
    PyObject *out = NULL;
    self->paced = 0.0;
    int r = step(self->end, self->obj, checked, &out, &self->paced);
    if (r == DONE || r == FAILED) {
        call_finish(self);
        *result = out;
        return r == DONE ? PYGEN_RETURN : PYGEN_ERROR;
    }
    self->inner = out;
    self->state = r == GO_ON ? 1 : 3;
    return call_send(self, Py_None, result);
}

/* The checkpoint the call awaited passed: the next pace is set if it was the pace's, then
 * the step that follows it is taken. */
static PySendResult call_passed(Call *self, PyObject **result) {
    Py_CLEAR(self->inner);
    if (self->paced != 0.0 && pace_passed(self->end, self->paced) < 0) {
        call_finish(self);
        *result = NULL;
        return PYGEN_ERROR;
    }
    return call_step(self, 1, result);
}

static PySendResult call_send(Call *self, PyObject *arg, PyObject **result) {
    *result = NULL;
    if (self->state == 1 || self->state == 3) {
        PySendResult r = PyIter_Send(self->inner, arg, result);
        if (r == PYGEN_NEXT) return r;
        if (self->state == 3 && r == PYGEN_RETURN) { /* the checkpoint passed: go on */
            Py_CLEAR(*result);
            return call_passed(self, result);
        }
        call_finish(self);
        return r;
    }
    if (self->state == 2) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return PYGEN_ERROR;
    }
    if (arg != Py_None) {
        PyErr_SetString(PyExc_TypeError, "can't send non-None value to a just-started coroutine");
        return PYGEN_ERROR;
    }
    return call_step(self, 0, result);
}

/* The iterator protocol's answer for a send: the value yielded, or NULL with StopIteration
 * (carrying the value returned) or the error raised. */
static PyObject *call_result(PySendResult r, PyObject *result) {
    if (r != PYGEN_RETURN) return result;
    if (result == Py_None) {
        Py_DECREF(result);
        PyErr_SetNone(PyExc_StopIteration);
        return NULL;
    }
    PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, result);
    Py_DECREF(result);
    if (stop != NULL) {
        PyErr_SetObject(PyExc_StopIteration, stop);
        Py_DECREF(stop);
    }
    return NULL;
}

static PyObject *call_iternext(Call *self) {
    PyObject *result;
    PySendResult r = call_send(self, Py_None, &result);
    if (r == PYGEN_RETURN && result == Py_None) { /* StopIteration, left implicit */
        Py_DECREF(result);
        return NULL;
    }
    return call_result(r, result);
}

static PyObject *call_send_method(Call *self, PyObject *arg) {
    PyObject *result;
    PySendResult r = call_send(self, arg, &result);
    return call_result(r, result);
}

static PyObject *call_throw(Call *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return NULL;
    }
    if (self->state == 1 || self->state == 3) {
        PyObject *inner = Py_NewRef(self->inner);
        PyObject *call[4] = {inner, args[0], nargs > 1 ? args[1] : NULL, nargs > 2 ? args[2] : NULL};
        PyObject *r = PyObject_VectorcallMethod(s_throw, call, 1 + nargs, NULL);
        Py_DECREF(inner);
        if (r != NULL) return r;
        if (self->state == 3 && PyErr_ExceptionMatches(PyExc_StopIteration)) {
            PyErr_Clear(); /* the checkpoint took the exception and passed: go on */
            PyObject *result;
            return call_result(call_passed(self, &result), result);
        }
        call_finish(self);
        return NULL;
    }
    /* Not started, or finished: the exception is raised here, as a coroutine raises it. */
    call_finish(self);
    PyObject *typ = args[0], *val = nargs > 1 ? args[1] : Py_None;
    PyObject *tb = nargs > 2 ? args[2] : Py_None;
    if (PyExceptionInstance_Check(typ)) {
        if (val != Py_None) {
            PyErr_SetString(PyExc_TypeError, "instance exception may not have a separate value");
            return NULL;
        }
        PyErr_SetObject((PyObject *)Py_TYPE(typ), typ);
    } else if (PyExceptionClass_Check(typ)) {
        PyErr_SetObject(typ, val);
    } else {
        PyErr_Format(PyExc_TypeError,
                     "exceptions must be classes or instances deriving from BaseException, not %s",
                     Py_TYPE(typ)->tp_name);
        return NULL;
    }
    if (tb != Py_None) {
        PyObject *type, *exc, *old;
        PyErr_Fetch(&type, &exc, &old);
        PyErr_NormalizeException(&type, &exc, &old);
        Py_XDECREF(old);
        PyErr_Restore(type, exc, Py_NewRef(tb));
    }
    return NULL;
}

static PyObject *call_close(Call *self, PyObject *unused) {
    if (self->state == 1 || self->state == 3) {
        PyObject *inner = Py_NewRef(self->inner);
        PyObject *r = PyObject_CallMethodNoArgs(inner, s_close);
        Py_DECREF(inner);
        call_finish(self);
        return r;
    }
    call_finish(self);
    Py_RETURN_NONE;
}

static PyObject *call_await(PyObject *self) { return Py_NewRef(self); }

/* As a coroutine never awaited: a RuntimeWarning when it is collected. */
static void call_finalize(Call *self) {
    if (self->state != 0) return;
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "coroutine '%s' was never awaited",
                         self->obj != NULL ? "Writer.put" : "Reader.get") < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(type, exc, tb);
}

static int call_traverse(Call *self, visitproc visit, void *arg) {
    Py_VISIT(self->end);
    Py_VISIT(self->obj);
    Py_VISIT(self->inner);
    return 0;
}

static int call_clear(Call *self) {
    Py_CLEAR(self->end);
    Py_CLEAR(self->obj);
    Py_CLEAR(self->inner);
    return 0;
}

static void call_dealloc(Call *self) {
    if (PyObject_CallFinalizerFromDealloc((PyObject *)self) < 0) return; /* resurrected */
    PyObject_GC_UnTrack(self);
    call_clear(self);
    PyObject_GC_Del(self);
}

static PyMethodDef call_methods[] = {
    {"send", (PyCFunction)call_send_method, METH_O, "Send a value into the coroutine."},
    {"throw", (PyCFunction)(void (*)(void))call_throw, METH_FASTCALL,
     "Raise an exception in the coroutine."},
    {"close", (PyCFunction)call_close, METH_NOARGS, "Close the coroutine."},
    {NULL}};

static PyAsyncMethods call_async = {
    .am_await = call_await,
    .am_send = (sendfunc)call_send,
};

static PyTypeObject CallType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "aioshmq.ends._cancel_c.Call",
    .tp_doc = "A compiled put or get, awaited as a coroutine.",
    .tp_basicsize = sizeof(Call),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)call_dealloc,
    .tp_finalize = (destructor)call_finalize,
    .tp_traverse = (traverseproc)call_traverse,
    .tp_clear = (inquiry)call_clear,
    .tp_as_async = &call_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)call_iternext,
    .tp_methods = call_methods,
};

static PyObject *new_call(PyObject *end, PyObject *obj) {
    Call *self = PyObject_GC_New(Call, &CallType);
    if (self == NULL) return NULL;
    self->end = Py_NewRef(end);
    self->obj = Py_XNewRef(obj);
    self->inner = NULL;
    self->state = 0;
    self->paced = 0.0;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyObject *async_put(PyObject *end, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    if (nargs != 1 || kwnames != NULL) return call_pure(pure_aput, end, args, nargs, kwnames);
    return new_call(end, args[0]);
}

static PyObject *async_get(PyObject *end, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    if (nargs != 0 || kwnames != NULL) return call_pure(pure_aget, end, args, nargs, kwnames);
    return new_call(end, NULL);
}

static PyMethodDef aput_def = {"put", (PyCFunction)(void (*)(void))async_put,
                               METH_FASTCALL | METH_KEYWORDS, NULL};
static PyMethodDef aget_def = {"get", (PyCFunction)(void (*)(void))async_get,
                               METH_FASTCALL | METH_KEYWORDS, NULL};

static PyObject *setup_async(PyObject *module, PyObject *args) {
    PyObject *end_t, *a_put, *a_get;
    if (!PyArg_ParseTuple(args, "OOO:setup_async", &end_t, &a_put, &a_get)) return NULL;
    if (pure_put == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "setup_sync() must come first");
        return NULL;
    }
    if (find_own_slot(end_t, &f_next_yield) < 0) return NULL;
    know_ends(&f_next_yield);
    PyObject *end_module = PyImport_ImportModule("aioshmq.ends.end");
    if (end_module == NULL) return NULL;
    PyObject *globals = PyModule_GetDict(end_module); /* borrowed: the module keeps it */
    Py_XSETREF(end_globals, Py_XNewRef(globals));
    Py_DECREF(end_module);
    if (end_globals == NULL) return NULL;
    if (make_doc(&aput_def, &aput_doc, "put($self, /, obj)", a_put) < 0
        || make_doc(&aget_def, &aget_doc, "get($self, /)", a_get) < 0)
        return NULL;
    Py_XSETREF(pure_aput, Py_NewRef(a_put));
    Py_XSETREF(pure_aget, Py_NewRef(a_get));
    return descriptors(&aput_def, &aget_def);
}

static PyObject *direct_fields(PyObject *module, PyObject *unused) {
    const Field *fields[] = {&f_cancel_scope, &f_cancel_called, &f_shield, &f_parent_scope};
    PyObject *names = PyList_New(0);
    for (size_t i = 0; names != NULL && i < sizeof fields / sizeof fields[0]; i++) {
        if (fields[i]->type != NULL && PyList_Append(names, *fields[i]->name) < 0) Py_CLEAR(names);
    }
    return names;
}

static PyMethodDef methods[] = {
    {"in_event_loop", in_event_loop, METH_NOARGS,
     "Whether this thread is running an asyncio or trio event loop right now."},
    {"setup_loop_check", setup_loop_check, METH_VARARGS,
     "setup_loop_check(get_running_loop, modules, slow): what in_event_loop() reads."},
    {"setup_sync", setup_sync, METH_VARARGS,
     "setup_sync(End, Writer, Reader, TaskLock, PickleSerializer, put_sync, get_sync, empty): "
     "the compiled put_sync and get_sync, as method descriptors of Writer and Reader."},
    {"setup_async", setup_async, METH_VARARGS,
     "setup_async(End, put, get): the compiled put and get, as method descriptors of the "
     "Writer and Reader given to setup_sync."},
    {"direct_fields", direct_fields, METH_NOARGS,
     "The names of the attributes read from their slots, not by name."},
    {"pending_checkpoint", pending_checkpoint, METH_NOARGS,
     "What to await so that a pending cancellation is raised now, or None if none is."},
    {"setup", setup, METH_VARARGS,
     "setup(seen, current_tasks, cache, fast, checkpoint, slow, state_type=None, "
     "scope_type=None): the state to read, and the types whose slots it reads directly."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "aioshmq.ends._cancel_c",
    "The ends' checks in C: twins of aioshmq._cancel's common case, of "
    "aioshmq._end.in_event_loop, and of put, get, put_sync and get_sync up to the ring core's "
    "call.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__cancel_c(void) {
    s_thread_id = PyUnicode_InternFromString("_thread_id");
    s_cancel_scope = PyUnicode_InternFromString("cancel_scope");
    s_cancel_called = PyUnicode_InternFromString("_cancel_called");
    s_shield = PyUnicode_InternFromString("_shield");
    s_parent_scope = PyUnicode_InternFromString("_parent_scope");
    s_trio = PyUnicode_InternFromString("trio");
    if (!s_thread_id || !s_cancel_scope || !s_cancel_called || !s_shield || !s_parent_scope
        || !s_trio)
        return NULL;
    struct {
        PyObject **s;
        const char *text;
    } names[] = {{&s_closed, "_closed"},       {&s_lock, "_lock"},
                 {&s_ring, "_ring"},           {&s_halt, "_halt"},
                 {&s_pickles, "_pickles"},     {&s_ser, "_ser"},
                 {&s_pending, "_pending"},     {&s_deferred, "_deferred"},
                 {&s_loads_plain, "_loads_plain"}, {&s_held, "held"},
                 {&s_current, "_current"},     {&s_torch, "_torch"},
                 {&s_torch_module, "torch"},   {&s_timeout, "timeout"},
                 {&s_put_object, "put_object"}, {&s_get_plain, "get_plain"},
                 {&s_put_failed, "_put_failed"}, {&s_put_sync_rest, "_put_sync_rest"},
                 {&s_closed_error, "_closed_error"}, {&s_next_yield, "_next_yield"},
                 {&s_put_rest, "_put_rest"},   {&s_throw, "throw"},
                 {&s_close, "close"},          {&s_yield_interval, "YIELD_INTERVAL"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].s = PyUnicode_InternFromString(names[i].text);
        if (*names[i].s == NULL) return NULL;
    }
    if (PyType_Ready(&CallType) < 0) return NULL;
    return PyModule_Create(&module_def);
}
