/* The ends' cancellation check in C: the compiled twin of aioshmq/_cancel.py's common case
 * (and of aioshmq/_end.py's in_event_loop, the check that refuses a blocking call in a loop).
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
    PyModuleDef_HEAD_INIT, "aioshmq._cancel_c",
    "The ends' cancellation and event-loop checks in C: twins of aioshmq._cancel's common "
    "case and of aioshmq._end.in_event_loop.",
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
    return PyModule_Create(&module_def);
}
