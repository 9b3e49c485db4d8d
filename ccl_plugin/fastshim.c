/* The CCL shim's per-call work in C: the collective wrapper and the op slot's seqlocked stores.

   Why native: in Python the wrapper, the argument reads and the counter stores cost a few µs a call, more
   than a small collective. Here one call costs a few attribute reads and a dozen stores into the mapping.

   Built at first use by ccl_plugin/build.py (build_shim) and loaded by ccl_plugin/native.py; the Python
   wrapper and writer (wrappers.py, writer.py) stay the reference and the fallback. Semantics are theirs:
   CL/WR/WC, launched/completed comm seq, bytes, launch/complete wall, duration, the bandwidth ring and the
   open peers, under the slot's seqlock (layout.py).

   Atomicity: every function here runs with the GIL held and never releases it between the odd and the even
   seq, and when this module is loaded every store of a slot goes through it (CounterWriter calls Slot's
   methods), so a store is never interleaved with another of this process's threads; readers in other
   processes use the seqlock. An async call's Work goes into a WorkRing that the background thread polls (no
   work on the caller's thread after the call); with the NCCL profiler plugin loaded a CUDA call settles at
   return. Anything uncommon (a slot not cached yet, a payload that is not one tensor, a synchronous CUDA call
   without the plugin, a full ring) goes back to the Python helpers. Nothing here raises into the user's call:
   a surprise sends the call to the Python wrapper, which handles it or disables counting. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "rankscope_layout.h"

/* The user's exception, kept across our own attribute store. */
#if PY_VERSION_HEX >= 0x030C0000
#define SAVE_ERROR PyObject *saved_exc = PyErr_GetRaisedException()
#define RESTORE_ERROR PyErr_SetRaisedException(saved_exc)
#else
#define SAVE_ERROR                     \
  PyObject *saved_t, *saved_v, *saved_tb; \
  PyErr_Fetch(&saved_t, &saved_v, &saved_tb)
#define RESTORE_ERROR PyErr_Restore(saved_t, saved_v, saved_tb)
#endif

static PyObject *s_disabled, *s_depth, *s_group, *s_async_op, *s_native, *s_nbytes, *s_is_cuda, *s_polling,
    *s_is_completed;

/* The clock of time.perf_counter() on Linux (CLOCK_MONOTONIC): launch times taken here are completed by
   Python's writer and the other way round. */
static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- Slot: one op slot's bytes in the mapping ---------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  Py_buffer view;   /* the slot's bytes (keeps the mapping exported while held) */
  Py_buffer seqs;   /* uint64 per communicator: the last launched sequence number */
  rs_op *op;
  uint64_t *comm_seq;
  double wall_offset; /* wall = monotonic + offset, as the writer computes it */
  int live;
} SlotObject;

static PyTypeObject SlotType;

static void wbegin(rs_op *o) {
  __atomic_store_n(&o->seq, o->seq + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE); /* the odd seq is seen before any field */
}

static void wend(rs_op *o) { __atomic_store_n(&o->seq, o->seq + 1, __ATOMIC_RELEASE); }

/* Peers to store: -1 = leave them, else how many of ``out`` are set. */
static int peers_arg(PyObject *peers, int32_t out[RS_MAX_OPEN_PEERS]) {
  if (peers == NULL || peers == Py_None) return -1;
  if (!PyTuple_Check(peers) || PyTuple_GET_SIZE(peers) > RS_MAX_OPEN_PEERS) {
    PyErr_SetString(PyExc_ValueError, "peers: a tuple of at most 8 ranks");
    return -2;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(peers);
  for (Py_ssize_t i = 0; i < n; i++) {
    long v = PyLong_AsLong(PyTuple_GET_ITEM(peers, i));
    if (v == -1 && PyErr_Occurred()) return -2;
    out[i] = (int32_t)v;
  }
  return (int)n;
}

static void store_peers(rs_op *o, int n, const int32_t peers[RS_MAX_OPEN_PEERS]) {
  if (n < 0) return;
  o->n_open_peers = (uint32_t)n;
  o->reserved1 = 0;
  for (int i = 0; i < RS_MAX_OPEN_PEERS; i++) o->open_peers[i] = i < n ? peers[i] : 0;
}

static uint64_t slot_launch(SlotObject *s, uint64_t nbytes, int count_call, double mono, int npeers,
                            const int32_t *peers) {
  rs_op *o = s->op;
  wbegin(o);
  if (count_call) o->cl += 1;
  o->wr += 1;
  uint64_t seq = *s->comm_seq + 1;
  *s->comm_seq = seq;
  o->last_launched_seq = seq;
  o->bytes_total += nbytes;
  o->last_launch_wall = mono + s->wall_offset;
  store_peers(o, npeers, peers);
  wend(o);
  return seq;
}

/* WC; with ``timed`` also TD (mono - t0), the complete wall and N = bytes/TD into the ring. */
static void slot_complete(SlotObject *s, uint64_t seq, uint64_t nbytes, int timed, double t0, double mono,
                          int npeers, const int32_t *peers) {
  rs_op *o = s->op;
  wbegin(o);
  o->wc += 1;
  if (seq > o->last_completed_seq) o->last_completed_seq = seq;
  if (timed) {
    double dur = mono - t0;
    o->last_duration = dur;
    o->last_complete_wall = mono + s->wall_offset;
    if (nbytes > 0 && dur > 0) {
      uint32_t i = o->ring_next % RS_RING_LEN;
      o->ring[i] = (double)nbytes / dur;
      o->ring_next = (i + 1) % RS_RING_LEN;
      if (o->ring_count < RS_RING_LEN) o->ring_count += 1;
    }
  }
  store_peers(o, npeers, peers);
  wend(o);
}

static int slot_init(SlotObject *self, PyObject *args, PyObject *kwds) {
  PyObject *view, *seqs;
  Py_ssize_t comm_index;
  double wall_offset;
  static char *kwlist[] = {"view", "seqs", "comm_index", "wall_offset", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnd", kwlist, &view, &seqs, &comm_index, &wall_offset))
    return -1;
  if (self->live) {
    PyErr_SetString(PyExc_RuntimeError, "Slot is already set up");
    return -1;
  }
  if (PyObject_GetBuffer(view, &self->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) return -1;
  if (PyObject_GetBuffer(seqs, &self->seqs, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) {
    PyBuffer_Release(&self->view);
    return -1;
  }
  const char *why = NULL;
  if (self->view.len < (Py_ssize_t)sizeof(rs_op)) why = "view: shorter than an op slot";
  else if ((uintptr_t)self->view.buf % 8) why = "view: not 8-aligned";
  else if (comm_index < 0 || (comm_index + 1) * 8 > self->seqs.len) why = "comm_index: outside seqs";
  else if ((uintptr_t)self->seqs.buf % 8) why = "seqs: not 8-aligned";
  if (why) {
    PyBuffer_Release(&self->view);
    PyBuffer_Release(&self->seqs);
    PyErr_SetString(PyExc_ValueError, why);
    return -1;
  }
  self->op = (rs_op *)self->view.buf;
  self->comm_seq = (uint64_t *)self->seqs.buf + comm_index;
  self->wall_offset = wall_offset;
  self->live = 1;
  return 0;
}

static void slot_release_buffers(SlotObject *self) {
  if (self->live) {
    self->live = 0;
    self->op = NULL;
    self->comm_seq = NULL;
    PyBuffer_Release(&self->view);
    PyBuffer_Release(&self->seqs);
  }
}

static void slot_dealloc(SlotObject *self) {
  slot_release_buffers(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static int slot_check_live(SlotObject *self) {
  if (!self->live) {
    PyErr_SetString(PyExc_ValueError, "the counter file is closed");
    return 0;
  }
  return 1;
}

static PyObject *py_slot_launch(SlotObject *self, PyObject *args) {
  unsigned long long nbytes;
  int count_call;
  double mono;
  PyObject *peers = Py_None;
  if (!PyArg_ParseTuple(args, "Kpd|O", &nbytes, &count_call, &mono, &peers)) return NULL;
  int32_t p[RS_MAX_OPEN_PEERS];
  int np = peers_arg(peers, p);
  if (np == -2 || !slot_check_live(self)) return NULL;
  return PyLong_FromUnsignedLongLong(slot_launch(self, nbytes, count_call, mono, np, p));
}

static PyObject *py_slot_complete(SlotObject *self, PyObject *args) {
  unsigned long long seq, nbytes;
  double t0, mono;
  PyObject *peers = Py_None;
  if (!PyArg_ParseTuple(args, "KKdd|O", &seq, &nbytes, &t0, &mono, &peers)) return NULL;
  int32_t p[RS_MAX_OPEN_PEERS];
  int np = peers_arg(peers, p);
  if (np == -2 || !slot_check_live(self)) return NULL;
  slot_complete(self, seq, nbytes, 1, t0, mono, np, p);
  Py_RETURN_NONE;
}

static PyObject *py_slot_settle(SlotObject *self, PyObject *args) {
  unsigned long long seq;
  PyObject *peers = Py_None;
  if (!PyArg_ParseTuple(args, "K|O", &seq, &peers)) return NULL;
  int32_t p[RS_MAX_OPEN_PEERS];
  int np = peers_arg(peers, p);
  if (np == -2 || !slot_check_live(self)) return NULL;
  slot_complete(self, seq, 0, 0, 0.0, 0.0, np, p);
  Py_RETURN_NONE;
}

static PyObject *py_slot_release(SlotObject *self, PyObject *Py_UNUSED(ignored)) {
  slot_release_buffers(self);
  Py_RETURN_NONE;
}

static PyMethodDef slot_methods[] = {
    {"launch", (PyCFunction)py_slot_launch, METH_VARARGS,
     "launch(nbytes, count_call, mono, peers=None) -> comm seq: CL (if count_call), one WR"},
    {"complete", (PyCFunction)py_slot_complete, METH_VARARGS,
     "complete(seq, nbytes, t0, mono, peers=None): WC, TD = mono - t0, N into the ring"},
    {"settle", (PyCFunction)py_slot_settle, METH_VARARGS, "settle(seq, peers=None): WC without TD or N"},
    {"release", (PyCFunction)py_slot_release, METH_NOARGS, "let go of the mapping (the file is closing)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_rankscope_shim.Slot",
    .tp_basicsize = sizeof(SlotObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Slot(view, seqs, comm_index, wall_offset): seqlocked stores into one op slot of the mapping",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)slot_init,
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_methods = slot_methods,
};

/* ---- WorkRing: async Works waiting for their completion ------------------------------------------ */

/* Why: an async call's completion used to be learned on the caller's thread (a wrapped Work.wait, a Python
   table), several µs a call. Now the wrapper only stores the Work here (a few words); the background thread's
   poll asks each open Work ``is_completed()`` and stores WC. Since the poll sees that a Work is done but not
   when, such a completion carries no TD or N (the synchronous calls and the NCCL plugin time them).

   One producer side (wrappers, any thread, under the GIL: a push is never interleaved) and one poller at a time
   (a second concurrent poll returns at once). Entries never move: the poller clears finished ones in place and
   moves ``head`` past cleared ones; a push writes at ``tail`` only while fewer than RING_CAP are between, so
   even while the poller has released the GIL inside ``is_completed()`` no entry it may still read is
   overwritten. A full ring makes the wrapper hand the Work to the Python path instead. */
#define RING_CAP 4096

typedef struct {
  PyObject *work;   /* owned; NULL once settled */
  SlotObject *slot; /* owned */
  uint64_t seq;
} ring_entry;

typedef struct {
  PyObject_HEAD
  ring_entry *e;
  uint64_t head, tail; /* entries [head, tail) may be open */
  Py_ssize_t open;
  int busy;            /* a poll is running */
} RingObject;

static PyTypeObject RingType;

static int ring_init(RingObject *self, PyObject *args, PyObject *kwds) {
  static char *kwlist[] = {NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return -1;
  if (self->e != NULL) {
    PyErr_SetString(PyExc_RuntimeError, "WorkRing is already set up");
    return -1;
  }
  self->e = PyMem_Calloc(RING_CAP, sizeof(ring_entry));
  if (self->e == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  return 0;
}

/* 0: kept; -1: no room (or not set up): the caller keeps the Work some other way. */
static int ring_push(RingObject *r, PyObject *work, SlotObject *slot, uint64_t seq) {
  if (r->e == NULL || r->tail - r->head >= RING_CAP) return -1;
  ring_entry *e = &r->e[r->tail % RING_CAP];
  Py_INCREF(work);
  Py_INCREF(slot);
  e->work = work;
  e->slot = slot;
  e->seq = seq;
  r->tail += 1;
  r->open += 1;
  return 0;
}

static void ring_drop(RingObject *r, ring_entry *e, int settle) {
  PyObject *work = e->work;
  SlotObject *slot = e->slot;
  e->work = NULL;
  e->slot = NULL;
  r->open -= 1;
  if (settle && slot->live) slot_complete(slot, e->seq, 0, 0, 0.0, 0.0, -1, NULL);
  Py_DECREF(work); /* last: a Work's release may run other code */
  Py_DECREF(slot);
}

static void ring_advance(RingObject *r) {
  while (r->head < r->tail && r->e[r->head % RING_CAP].work == NULL) r->head += 1;
}

static PyObject *py_ring_poll(RingObject *r, PyObject *Py_UNUSED(ignored)) {
  if (r->e == NULL || r->busy) return PyLong_FromSsize_t(r->open);
  r->busy = 1;
  uint64_t end = r->tail; /* what is pushed meanwhile waits for the next pass */
  for (uint64_t i = r->head; i < end; i++) {
    ring_entry *e = &r->e[i % RING_CAP];
    PyObject *work = e->work;
    if (work == NULL) continue;
    Py_INCREF(work);
    PyObject *res = PyObject_CallMethodObjArgs(work, s_is_completed, NULL);
    int done = res == NULL ? 1 : PyObject_IsTrue(res); /* a failed Work is no longer in flight either way */
    Py_XDECREF(res);
    if (done < 0) done = 1;
    if (PyErr_Occurred()) PyErr_Clear();
    if (done && e->work == work) ring_drop(r, e, 1);
    Py_DECREF(work);
  }
  ring_advance(r);
  r->busy = 0;
  return PyLong_FromSsize_t(r->open);
}

static void ring_clear_all(RingObject *r) {
  if (r->e == NULL) return;
  for (uint64_t i = r->head; i < r->tail; i++) {
    ring_entry *e = &r->e[i % RING_CAP];
    if (e->work != NULL) ring_drop(r, e, 0);
  }
  r->head = r->tail;
}

static PyObject *py_ring_clear(RingObject *r, PyObject *Py_UNUSED(ignored)) {
  if (r->busy) {
    PyErr_SetString(PyExc_RuntimeError, "a poll is running");
    return NULL;
  }
  ring_clear_all(r);
  Py_RETURN_NONE;
}

static Py_ssize_t ring_len(RingObject *r) { return r->open; }

static void ring_dealloc(RingObject *r) {
  ring_clear_all(r);
  PyMem_Free(r->e);
  r->e = NULL;
  Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyMethodDef ring_methods[] = {
    {"poll", (PyCFunction)py_ring_poll, METH_NOARGS,
     "poll() -> open: WC (no TD or N) for every kept Work whose is_completed() is true; how many stay open"},
    {"clear", (PyCFunction)py_ring_clear, METH_NOARGS, "drop every kept Work without recording anything"},
    {NULL, NULL, 0, NULL}};

static PySequenceMethods ring_as_sequence = {.sq_length = (lenfunc)ring_len};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_rankscope_shim.WorkRing",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "WorkRing(): async Works the wrappers keep until the background poll sees them complete",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
    .tp_as_sequence = &ring_as_sequence,
};

static int truth_attr(PyObject *obj, PyObject *name) {
  PyObject *v = PyObject_GetAttr(obj, name);
  if (v == NULL) return -1;
  int t = v == Py_True ? 1 : v == Py_False || v == Py_None ? 0 : PyObject_IsTrue(v);
  Py_DECREF(v);
  return t;
}

/* ---- ThreadFlags: "inside a wrapped call", per thread ------------------------------------------------ */

/* A C thread-local read by this file directly and by Python through ThreadFlags().depth: a threading.local
   attribute costs several times a plain one, and both paths must see the one flag. One per process. */
static _Thread_local int in_call;

typedef struct {
  PyObject_HEAD
} FlagsObject;

static PyObject *flags_get_depth(PyObject *self, void *closure) { return PyBool_FromLong(in_call); }

static int flags_set_depth(PyObject *self, PyObject *value, void *closure) {
  int t = value == NULL ? 0 : PyObject_IsTrue(value);
  if (t < 0) return -1;
  in_call = t;
  return 0;
}

static PyGetSetDef flags_getset[] = {
    {"depth", flags_get_depth, flags_set_depth, "inside a wrapped call on this thread", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject FlagsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_rankscope_shim.ThreadFlags",
    .tp_basicsize = sizeof(FlagsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ThreadFlags().depth: this thread is inside a wrapped call (one flag per thread, process-wide)",
    .tp_new = PyType_GenericNew,
    .tp_getset = flags_getset,
};

static int get_depth(PyObject *tls) {
  if (Py_IS_TYPE(tls, &FlagsType)) return in_call;
  return truth_attr(tls, s_depth);
}

static int set_depth(PyObject *tls, int value) {
  if (Py_IS_TYPE(tls, &FlagsType)) {
    in_call = value;
    return 0;
  }
  return PyObject_SetAttr(tls, s_depth, value ? Py_True : Py_False);
}

/* ---- Wrapper: the collective's replacement ------------------------------------------------------- */

typedef struct {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject *orig;     /* torch's function */
  PyObject *fallback; /* the Python wrapper: every call this one does not take */
  PyObject *slots;    /* dict group -> (group, OpSlot, members), shared with the Python wrapper */
  PyObject *state;    /* hook_state.STATE: .disabled */
  PyObject *tls;      /* per-thread .depth: inside a wrapped call */
  PyObject *post;     /* post(result, request, on_cuda, is_async): what the C path does not take after a call */
  PyObject *ring;     /* the WorkRing async Works wait in (or None: every async Work goes to post) */
  PyObject *arm;      /* arm(): wake the background poll (called only when state.polling is false) */
  PyObject *gdef;     /* the group parameter's default */
  PyObject *payload_name; /* None for barrier */
  PyObject *dict;
  Py_ssize_t gi, pi, ai;
  int adef;
  int plugin; /* NCCL's profiler plugin is ours: it times device work, CUDA calls settle at return */
} WrapperObject;

static PyTypeObject WrapperType;

static int name_is(PyObject *key, PyObject *name) {
  return key == name || (name != Py_None && PyUnicode_Compare(key, name) == 0);
}

static PyObject *wrapper_vectorcall(WrapperObject *w, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  int t = truth_attr(w->state, s_disabled);
  if (t != 0) goto plain_clear;
  t = get_depth(w->tls);
  if (t != 0) goto plain_clear;

  PyObject *group = w->gi < n ? args[w->gi] : w->gdef;
  PyObject *payload = w->pi < n ? args[w->pi] : Py_None;
  PyObject *async_obj = w->ai < n ? args[w->ai] : NULL;
  if (kwnames != NULL) {
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nk; k++) {
      PyObject *key = PyTuple_GET_ITEM(kwnames, k);
      if (name_is(key, s_group)) group = args[n + k];
      else if (name_is(key, s_async_op)) async_obj = args[n + k];
      else if (name_is(key, w->payload_name)) payload = args[n + k];
    }
    if (PyErr_Occurred()) goto fallback_clear;
  }
  int is_async = w->adef;
  if (async_obj != NULL) {
    is_async = PyObject_IsTrue(async_obj);
    if (is_async < 0) goto fallback_clear;
  }
  PyObject *hit = PyDict_GetItemWithError(w->slots, group); /* borrowed */
  if (hit == NULL || !PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) < 2) goto fallback_clear;
  PyObject *pyslot = PyTuple_GET_ITEM(hit, 1);
  PyObject *native = PyObject_GetAttr(pyslot, s_native);
  if (native == NULL) goto fallback_clear;
  if (!Py_IS_TYPE(native, &SlotType) || !((SlotObject *)native)->live) goto fallback_native;
  PyObject *nb = PyObject_GetAttr(payload, s_nbytes); /* a tensor; anything else is the Python path's */
  if (nb == NULL) goto fallback_native;
  long long nbytes = PyLong_Check(nb) ? PyLong_AsLongLong(nb) : -1;
  Py_DECREF(nb);
  if (nbytes < 0) goto fallback_native;
  PyObject *cuda = PyObject_GetAttr(payload, s_is_cuda);
  if (cuda == NULL) goto fallback_native;
  int on_cuda = cuda == Py_True;
  Py_DECREF(cuda);

  SlotObject *s = (SlotObject *)native;
  Py_INCREF(pyslot); /* the request names it; the cache may be cleared during the call */
  double t0 = now();
  uint64_t seq = slot_launch(s, (uint64_t)nbytes, 1, t0, -1, NULL);
  if (set_depth(w->tls, 1) < 0) PyErr_Clear();
  PyObject *result = PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
  SAVE_ERROR;
  if (set_depth(w->tls, 0) < 0) PyErr_Clear();
  if (result == NULL) { /* the call failed: nothing stays in flight */
    if (s->live) slot_complete(s, seq, (uint64_t)nbytes, 1, t0, now(), -1, NULL);
    RESTORE_ERROR;
  } else if (!on_cuda && (!is_async || result == Py_None)) {
    /* a blocking call on the host has finished when it returns */
    if (s->live) slot_complete(s, seq, (uint64_t)nbytes, 1, t0, now(), -1, NULL);
  } else if (on_cuda && w->plugin) {
    /* the plugin times the device work: counted and settled here, no TD or N */
    if (s->live) slot_complete(s, seq, 0, 0, 0.0, 0.0, -1, NULL);
  } else if (is_async && result != Py_None && Py_IS_TYPE(w->ring, &RingType) &&
             ring_push((RingObject *)w->ring, result, s, seq) == 0) {
    /* WC when the background poll sees is_completed(); it must be polling */
    int polling = truth_attr(w->state, s_polling);
    if (polling != 1) {
      PyObject *r = polling == 0 ? PyObject_CallNoArgs(w->arm) : NULL;
      Py_XDECREF(r);
      PyErr_Clear();
    }
  } else {
    PyObject *req = Py_BuildValue("(OKKOd)", pyslot, (unsigned long long)seq, (unsigned long long)nbytes,
                                  Py_None, t0);
    PyObject *r = req == NULL ? NULL
                              : PyObject_CallFunctionObjArgs(w->post, result, req, on_cuda ? Py_True : Py_False,
                                                             is_async ? Py_True : Py_False, NULL);
    Py_XDECREF(req);
    if (r == NULL) PyErr_Clear(); /* post says its own errors; never the user's call */
    Py_XDECREF(r);
  }
  Py_DECREF(pyslot);
  Py_DECREF(native);
  return result;

fallback_native:
  Py_DECREF(native);
fallback_clear:
  PyErr_Clear();
  return PyObject_Vectorcall(w->fallback, args, nargsf, kwnames);
plain_clear:
  PyErr_Clear();
  return PyObject_Vectorcall(w->orig, args, nargsf, kwnames);
}

static int wrapper_init(WrapperObject *self, PyObject *args, PyObject *kwds) {
  PyObject *orig, *fallback, *slots, *state, *tls, *post, *gdef, *payload_name, *ring = Py_None, *arm = Py_None;
  Py_ssize_t gi, pi, ai;
  int adef, plugin = 0;
  static char *kwlist[] = {"orig", "fallback", "slots", "state", "tls", "post", "group_index", "group_default",
                           "payload_index", "payload_name", "async_index", "async_default", "ring", "arm",
                           "plugin", NULL};
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!OOOnOnOnp|OOp", kwlist, &orig, &fallback, &PyDict_Type, &slots,
                                   &state, &tls, &post, &gi, &gdef, &pi, &payload_name, &ai, &adef, &ring, &arm,
                                   &plugin))
    return -1;
  if (ring != Py_None && !(Py_IS_TYPE(ring, &RingType) && PyCallable_Check(arm))) {
    PyErr_SetString(PyExc_TypeError, "ring: a WorkRing (with arm: a callable) or None");
    return -1;
  }
  if (payload_name != Py_None && !PyUnicode_Check(payload_name)) {
    PyErr_SetString(PyExc_TypeError, "payload_name: a str or None");
    return -1;
  }
  PyObject *objs[] = {orig, fallback, slots, state, tls, post, gdef, payload_name, ring, arm};
  PyObject **fields[] = {&self->orig, &self->fallback, &self->slots, &self->state, &self->tls,
                         &self->post, &self->gdef, &self->payload_name, &self->ring, &self->arm};
  for (size_t i = 0; i < sizeof(objs) / sizeof(objs[0]); i++) {
    Py_INCREF(objs[i]);
    Py_XSETREF(*fields[i], objs[i]);
  }
  self->gi = gi;
  self->pi = pi;
  self->ai = ai;
  self->adef = adef;
  self->plugin = plugin;
  self->vectorcall = (vectorcallfunc)wrapper_vectorcall;
  return 0;
}

static int wrapper_traverse(WrapperObject *self, visitproc visit, void *arg) {
  Py_VISIT(self->orig);
  Py_VISIT(self->fallback);
  Py_VISIT(self->slots);
  Py_VISIT(self->state);
  Py_VISIT(self->tls);
  Py_VISIT(self->post);
  Py_VISIT(self->gdef);
  Py_VISIT(self->payload_name);
  Py_VISIT(self->ring);
  Py_VISIT(self->arm);
  Py_VISIT(self->dict);
  return 0;
}

static int wrapper_clear(WrapperObject *self) {
  Py_CLEAR(self->orig);
  Py_CLEAR(self->fallback);
  Py_CLEAR(self->slots);
  Py_CLEAR(self->state);
  Py_CLEAR(self->tls);
  Py_CLEAR(self->post);
  Py_CLEAR(self->gdef);
  Py_CLEAR(self->payload_name);
  Py_CLEAR(self->ring);
  Py_CLEAR(self->arm);
  Py_CLEAR(self->dict);
  return 0;
}

static void wrapper_dealloc(WrapperObject *self) {
  PyObject_GC_UnTrack(self);
  wrapper_clear(self);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Until __init__ ran, a call has nothing to call. */
static PyObject *wrapper_unset(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  PyErr_SetString(PyExc_RuntimeError, "Wrapper is not set up");
  return NULL;
}

static PyObject *wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  WrapperObject *self = (WrapperObject *)type->tp_alloc(type, 0);
  if (self != NULL) self->vectorcall = (vectorcallfunc)wrapper_unset;
  return (PyObject *)self;
}

static PyGetSetDef wrapper_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject WrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_rankscope_shim.Wrapper",
    .tp_basicsize = sizeof(WrapperObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A collective's counting wrapper (see wrappers._make_coll_wrapper)",
    .tp_new = wrapper_new,
    .tp_init = (initproc)wrapper_init,
    .tp_dealloc = (destructor)wrapper_dealloc,
    .tp_traverse = (traverseproc)wrapper_traverse,
    .tp_clear = (inquiry)wrapper_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(WrapperObject, vectorcall),
    .tp_dictoffset = offsetof(WrapperObject, dict),
    .tp_getset = wrapper_getset,
};

/* ---- module --------------------------------------------------------------------------------------- */

static PyObject *py_now(PyObject *self, PyObject *Py_UNUSED(ignored)) { return PyFloat_FromDouble(now()); }

static PyMethodDef module_methods[] = {
    {"now", py_now, METH_NOARGS, "the monotonic clock the stores use, in seconds (time.perf_counter's)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_rankscope_shim", "rankscope's CCL shim fast path (see fastshim.c)", -1,
    module_methods};

PyMODINIT_FUNC PyInit__rankscope_shim(void) {
  const char *names[] = {"disabled", "depth", "group", "async_op", "native", "nbytes", "is_cuda", "polling",
                         "is_completed"};
  PyObject **slots[] = {&s_disabled, &s_depth, &s_group, &s_async_op, &s_native, &s_nbytes, &s_is_cuda, &s_polling,
                        &s_is_completed};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    if (*slots[i] == NULL && (*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
  }
  if (PyType_Ready(&SlotType) < 0 || PyType_Ready(&WrapperType) < 0 || PyType_Ready(&FlagsType) < 0 ||
      PyType_Ready(&RingType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&module_def);
  if (m == NULL) return NULL;
  Py_INCREF(&SlotType);
  Py_INCREF(&WrapperType);
  Py_INCREF(&FlagsType);
  Py_INCREF(&RingType);
  if (PyModule_AddObject(m, "Slot", (PyObject *)&SlotType) < 0 ||
      PyModule_AddObject(m, "ThreadFlags", (PyObject *)&FlagsType) < 0 ||
      PyModule_AddObject(m, "Wrapper", (PyObject *)&WrapperType) < 0 ||
      PyModule_AddObject(m, "WorkRing", (PyObject *)&RingType) < 0 ||
      PyModule_AddIntConstant(m, "OP_SIZE", (long)sizeof(rs_op)) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
