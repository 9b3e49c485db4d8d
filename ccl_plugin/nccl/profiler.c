/* rankscope's NCCL profiler plugin: Aegis Phase-2 CL/WR/WC from inside NCCL.
 *
 * NCCL loads this library through NCCL_PROFILER_PLUGIN and calls the entry points of ncclProfiler_v6
 * (NCCL >= 2.29), ncclProfiler_v5 (2.28) or ncclProfiler_v4 (2.27); an older NCCL (v1-v3) finds no table
 * and runs without it. Events become the counter file the Python hooks also write (layout in
 * rankscope_layout.h, generated from layout.py), named <job>.rank<R>.nccl.ccl so both writers coexist:
 *   CL  Coll / P2p start, per (communicator, function);
 *   WR  a work request posted: on a communicator that spans nodes, a ProxyStep reaching SendWait (isend
 *       posted) or RecvWait (irecv posted); within a node (nNodes == 1), a KernelCh start (the GPU channel
 *       began the collective's work);
 *   WC  that request finished: a send step's stop, a receive step's RecvFlushWait (data arrived) or stop;
 *       a kernel channel's KernelChStop state or stop;
 *   N   bytes / (completion - request) of each finished request, into the ring (kernel channels: GPU time);
 *   TD  on the device where NCCL gives GPU times (Aegis §5.2's duration on the GPU): the first kernel channel's
 *       start to the last one's KernelChStop, so a rank whose GPU came late to the call (extra work queued
 *       before it) shows the short TD of a late arriver though its host enqueued the call early; without
 *       GPU times (the network path), Coll / P2p start to the moment it is stopped and its last started
 *       child has stopped, on the host.
 * A copy-engine collective (CeColl, v6) counts as a Coll whose own stop completes it (no children).
 * Init records per communicator NCCL's commHash (comm_id, hex), nranks and this rank's rank in it.
 *
 * Lifetimes. NCCL stops a Coll/P2p on the host right after posting its proxy work; the proxy thread then
 * starts ProxyOps / KernelChs whose parentObj is that stopped handle, records states and stops them. So
 * no handle we give NCCL is a pointer: every handle is an encoded (pool, index, generation) triple into
 * fixed pools allocated once, never freed while the library is loaded. A record carries one atomic word
 * {generation, live children, state}: a child attaches to its parent with a compare-and-swap that also
 * checks the generation, so a parent is reused only when it is stopped and has no live child, and a
 * handle whose record was reused since (stale), one that is not ours (a PXN pointer from another process,
 * garbage) or NULL is ignored. Task records are reused oldest first, so a stopped Coll stays attachable
 * for the next RS_TASK_POOL tasks (a ProxyOp from another process, PXN, is recognised by its pid and
 * ignored before its parentObj is looked at). No malloc, no mutex and no syscall on NCCL's event path
 * (a writer that finds a slot busy for long yields); op slots in the file are written under their
 * seqlock, taken with a compare-and-swap because the user thread and proxy threads write the same slot;
 * readers in other processes never see torn values. A mapping is never unmapped while the library is
 * loaded, so a late event cannot fault. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "nccl_profiler_abi.h"
#include "rankscope_layout.h"

#define EXPORT __attribute__((visibility("default")))
/* one process-wide mask (NCCL keeps the last init's): both paths' events */
#define MASK (RS_EV_COLL | RS_EV_P2P | RS_EV_PROXY_OP | RS_EV_PROXY_STEP | RS_EV_KERNEL_CH | RS_EV_CE_COLL)

_Static_assert(sizeof(void*) == 8, "handles encode 64 bits");

#ifndef RS_TASK_POOL
#define RS_TASK_POOL 8192 /* Coll/P2p records: a stopped task stays attachable this many tasks long */
#endif
#ifndef RS_CHILD_POOL
#define RS_CHILD_POOL 32768 /* ProxyOp / ProxyStep / KernelCh records */
#endif
#define ALLOC_TRIES 256 /* records skipped (still in use) before an event is dropped */
#define MAX_REFS 0xFFFF

enum { P_TASK = 1, P_CHILD = 2, P_CTX = 3 };
enum { K_COLL = 1, K_P2P, K_OP, K_STEP, K_KCH };
/* S_STOPPED: stopped, children may still come; S_DONE: stopped and its last child stopped */
enum { S_FREE = 0, S_INIT, S_OPEN, S_STOPPED, S_DONE };
#define F_CHILDREN 0x100 /* state flag: a child attached once */
enum { R_REQUESTED = 1, R_COMPLETED = 2 };
#define H_MAGIC 0xA0u

/* the atomic word: generation (32) | live children (16) | state (16) */
#define W_GEN(w) ((uint32_t)((w) >> 32))
#define W_REFS(w) ((uint32_t)(((w) >> 16) & 0xFFFF))
#define W_STATE(w) ((uint32_t)((w) & 0xFF))
#define W_FLAGS(w) ((uint32_t)((w) & 0xFF00))
#define W_MAKE(g, r, s) (((uint64_t)(g) << 32) | ((uint64_t)(r) << 16) | (uint64_t)(s))

typedef struct {
  uint64_t word;
  uint64_t parent; /* child: its parent's handle; task: its first kernel channel's GPU start (ns, 0 none; atomic) */
  uint64_t ctx;    /* its communicator's context handle: nothing counts once that is finalized */
  uint64_t aux;    /* task: 1-based sequence number of the call; kernel channel: GPU start time (ns) */
  double t0;       /* task: start; request: when it was posted (monotonic s) */
  uint64_t bytes;  /* task: bytes of the call; request: bytes it moved (atomic) */
  int32_t slot;    /* op slot in the file */
  int32_t peer;    /* P2p / ProxyOp peer (rank in the communicator), -1 none */
  uint8_t kind, is_send, net, n_channels;
  uint32_t req; /* request: atomic R_* bits, each request counts one WR and one WC at most; task: its span on
                 * the GPU so far in ns (first channel start to latest channel stop, saturating; 0 none; atomic) */
} rs_rec;
_Static_assert(sizeof(rs_rec) == 64, "one cache line per record");

typedef struct {
  uint64_t word;
  uint64_t p2p_seq;
  int32_t comm_index;
  int32_t net;
  uint64_t cache[8]; /* func name pointer << 16 | slot + 1: NCCL's names are constants */
} rs_ctx;

static rs_rec tasks[RS_TASK_POOL];
static rs_rec children[RS_CHILD_POOL];
static rs_ctx ctxs[RS_MAX_COMMS];
static uint64_t task_cursor, child_cursor;

static unsigned char* base; /* the mapped file, NULL until the first init; never unmapped while loaded */
static int create_lock;     /* init, finalize and first sight of a (communicator, function) */
static int n_comms, live_comms, n_ops_published;
static pid_t my_pid;
static char path[4096];
static double wall_offset;

static double mono(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static unsigned char* file(void) { return __atomic_load_n(&base, __ATOMIC_ACQUIRE); }
static rs_header* hdr(unsigned char* b) { return (rs_header*)b; }
static rs_comm* comm_at(unsigned char* b, int i) {
  return (rs_comm*)(b + RS_COMM_TABLE_OFFSET + (size_t)i * RS_COMM_SIZE);
}
static rs_op* op_at(unsigned char* b, int i) { return (rs_op*)(b + RS_OP_TABLE_OFFSET + (size_t)i * RS_OP_SIZE); }

static void spin_pause(unsigned n) {
  if (n > 64) sched_yield(); /* the holder was preempted: let it finish */
}
static void lock_create(void) {
  for (unsigned n = 0; __atomic_exchange_n(&create_lock, 1, __ATOMIC_ACQUIRE); n++) spin_pause(n);
}
static void unlock_create(void) { __atomic_store_n(&create_lock, 0, __ATOMIC_RELEASE); }

/* Seqlock with several writers: a writer takes the seq from even to odd with a compare-and-swap (which is
 * also its lock), stores the fields, and makes it even again. */
static void wbegin(uint64_t* seq) {
  for (unsigned n = 0;; n++) {
    uint64_t s = __atomic_load_n(seq, __ATOMIC_RELAXED);
    if (!(s & 1) && __atomic_compare_exchange_n(seq, &s, s + 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) break;
    spin_pause(n);
  }
  __atomic_thread_fence(__ATOMIC_RELEASE);
}
static void wend(uint64_t* seq) { __atomic_fetch_add(seq, 1, __ATOMIC_RELEASE); }

/* ---- handles -------------------------------------------------------------------------------------- */

static void* encode(unsigned pool, uint32_t index, uint32_t gen) {
  return (void*)(uintptr_t)(((uint64_t)gen << 32) | ((uint64_t)(H_MAGIC | pool) << 24) | index);
}

/* the record a handle names and the generation it was issued for; NULL if it is not one of ours */
static uint64_t* decode(const void* h, unsigned pool, uint32_t* gen, uint32_t* index) {
  uint64_t v = (uint64_t)(uintptr_t)h;
  if (((v >> 24) & 0xFF) != (H_MAGIC | pool) || W_GEN(v) == 0) return NULL;
  uint32_t i = (uint32_t)(v & 0xFFFFFF);
  *gen = W_GEN(v);
  *index = i;
  if (pool == P_TASK && i < RS_TASK_POOL) return &tasks[i].word;
  if (pool == P_CHILD && i < RS_CHILD_POOL) return &children[i].word;
  if (pool == P_CTX && i < RS_MAX_COMMS) return &ctxs[i].word;
  return NULL;
}

static rs_rec* record(const void* h, uint32_t* gen, int* pool) {
  uint32_t i;
  uint64_t* w = decode(h, P_TASK, gen, &i);
  *pool = P_TASK;
  if (!w) {
    w = decode(h, P_CHILD, gen, &i);
    *pool = P_CHILD;
  }
  return w ? (rs_rec*)w : NULL;
}

static uint32_t next_gen(uint32_t g) { return g + 1 ? g + 1 : 1; }

/* NCCL's logger (NCCL_DEBUG=WARN shows it): how a person learns the counters stopped being complete */
static ncclDebugLogger_t nccl_log;
static int warned_full;
#define RS_LOG_WARN 2 /* NCCL_LOG_WARN */
#define RS_LOG_INFO 3 /* NCCL_LOG_INFO */
#define RS_LOG_INIT 1UL /* NCCL_INIT subsystem */

static void warn_full(const char* what) {
  ncclDebugLogger_t log = __atomic_load_n(&nccl_log, __ATOMIC_ACQUIRE);
  if (!log || __atomic_exchange_n(&warned_full, 1, __ATOMIC_RELAXED)) return;
  log(RS_LOG_WARN, ~0UL, __FILE__, __LINE__,
      "rankscope profiler: no free %s record (more events in flight than its pool holds); events are dropped, "
      "so this rank's CL/WR/WC undercount from now on. Rebuild with a larger -DRS_TASK_POOL / -DRS_CHILD_POOL, "
      "or run without the plugin (rankscope run --no-nccl-plugin)", what);
}

/* A record no one uses any more, in state S_INIT with a new generation; -1 when the pool is full. */
static int alloc_rec(rs_rec* pool, uint32_t size, uint64_t* cursor, uint32_t* gen) {
  for (int t = 0; t < ALLOC_TRIES; t++) {
    uint32_t i = (uint32_t)(__atomic_fetch_add(cursor, 1, __ATOMIC_RELAXED) % size);
    uint64_t w = __atomic_load_n(&pool[i].word, __ATOMIC_ACQUIRE);
    uint32_t st = W_STATE(w);
    if (!(st == S_FREE || st == S_DONE || (st == S_STOPPED && W_REFS(w) == 0))) continue;
    uint32_t g = next_gen(W_GEN(w));
    if (__atomic_compare_exchange_n(&pool[i].word, &w, W_MAKE(g, 0, S_INIT), 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED)) {
      *gen = g;
      return (int)i;
    }
  }
  return -1;
}

/* the fields that do not change while the record is held (never the atomic word); a task's GPU span (req)
 * as far as its channels told it */
static void copy_fields(rs_rec* dst, const rs_rec* src) {
  dst->req = __atomic_load_n(&src->req, __ATOMIC_ACQUIRE);
  dst->parent = src->parent;
  dst->ctx = src->ctx;
  dst->aux = src->aux;
  dst->t0 = src->t0;
  dst->slot = src->slot;
  dst->peer = src->peer;
  dst->kind = src->kind;
  dst->is_send = src->is_send;
  dst->net = src->net;
  dst->n_channels = src->n_channels;
}

static void publish(rs_rec* r, uint32_t gen, uint32_t flags) {
  __atomic_store_n(&r->word, W_MAKE(gen, 0, S_OPEN | flags), __ATOMIC_RELEASE);
}

/* Take a reference on a live record of this generation (open, stopped, or done: a late child reopens
 * a done task). Returns the word before, 0 if the handle is stale. */
static uint64_t attach(rs_rec* r, uint32_t gen) {
  uint64_t w = __atomic_load_n(&r->word, __ATOMIC_ACQUIRE);
  for (;;) {
    uint32_t st = W_STATE(w);
    if (W_GEN(w) != gen || st < S_OPEN || W_REFS(w) >= MAX_REFS) return 0;
    uint64_t nw = W_MAKE(gen, W_REFS(w) + 1, (st == S_DONE ? S_STOPPED : st) | F_CHILDREN);
    if (__atomic_compare_exchange_n(&r->word, &w, nw, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return w;
  }
}

/* The record is live for this generation (the owner's own stop/state calls). */
static int owned(rs_rec* r, uint32_t gen) {
  uint64_t w = __atomic_load_n(&r->word, __ATOMIC_ACQUIRE);
  return W_GEN(w) == gen && W_STATE(w) == S_OPEN;
}


/* ---- the file ------------------------------------------------------------------------------------- */

static void publish_header(unsigned char* b) {
  rs_header* h = hdr(b);
  wbegin(&h->seq);
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  h->heartbeat_wall = (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
  h->n_comms = (uint32_t)n_comms;
  h->n_ops = (uint32_t)__atomic_load_n(&n_ops_published, __ATOMIC_RELAXED);
  wend(&h->seq);
}

static uint64_t start_ticks(void) {
  char buf[1024];
  FILE* f = fopen("/proc/self/stat", "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  char* p = strrchr(buf, ')');
  if (!p) return 0;
  p += 2;
  for (int field = 3; field < 22 && p; field++) { /* field 22 is starttime */
    p = strchr(p, ' ');
    if (p) p++;
  }
  return p ? strtoull(p, NULL, 10) : 0;
}

static void copy_str(char* dst, size_t size, const char* src) {
  memset(dst, 0, size);
  if (!src) return;
  size_t n = strnlen(src, size - 1);
  memcpy(dst, src, n);
}

/* The counter directory, opened and checked as the Python writer checks it (ccl_plugin/writer.py): made 0700 when
 * missing, tightened to 0700 when it is ours and others can write it, refused when it is a link, another user's
 * (root's excepted) or still writable by others; -1 (said once in NCCL's log) when refused. Everything after is
 * relative to this one descriptor, so no link at the directory's path or at either file name is followed. */
static int open_dir(const char* dir, ncclDebugLogger_t log) {
  mkdir(dir, 0700);
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  const char* why = NULL;
  if (dfd < 0 || fstat(dfd, &st) != 0) {
    why = "cannot be opened (or is a symbolic link)";
  } else {
    if (st.st_uid == geteuid() && (st.st_mode & 022) && fchmod(dfd, 0700) == 0) fstat(dfd, &st);
    if (st.st_uid != geteuid() && st.st_uid != 0)
      why = "belongs to another user";
    else if (st.st_mode & 022)
      why = "can be written by other users";
  }
  if (!why) return dfd;
  if (dfd >= 0) close(dfd);
  if (log)
    log(RS_LOG_WARN, ~0UL, __FILE__, __LINE__,
        "rankscope profiler: counter directory %s is refused: it %s; this rank's NCCL counters are off. Fix: remove "
        "it or set RANKSCOPE_CCL_DIR to a directory of this user that others cannot write", dir, why);
  return -1;
}

static unsigned char* open_file(int comm_rank, int comm_size, ncclDebugLogger_t log) {
  const char* dir = getenv(RS_ENV_DIR);
  const char* job = getenv(RS_ENV_JOB_ID);
  const char* r = getenv("RANK");
  const char* w = getenv("WORLD_SIZE");
  int rank = r ? atoi(r) : comm_rank;
  int world = w ? atoi(w) : comm_size;
  if (!dir || !*dir) dir = RS_DEFAULT_DIR;
  if (!job || !*job) job = getenv("TORCHELASTIC_RUN_ID");
  if (!job || !*job) job = "job";
  int dfd = open_dir(dir, log);
  if (dfd < 0) return NULL;
  char tmp[4200], name[4200];
  snprintf(path, sizeof(path), "%s/%s.rank%d.nccl.ccl", dir, job, rank);
  snprintf(name, sizeof(name), "%s.rank%d.nccl.ccl", job, rank);
  snprintf(tmp, sizeof(tmp), ".%s.rank%d.nccl.ccl.%d.tmp", job, rank, (int)getpid());
  /* O_EXCL: a name planted before us (a link, a file of another user) is removed, never written through */
  int fd = openat(dfd, tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0 && unlinkat(dfd, tmp, 0) == 0)
    fd = openat(dfd, tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    close(dfd);
    return NULL;
  }
  if (ftruncate(fd, RS_FILE_SIZE) != 0) {
    close(fd);
    unlinkat(dfd, tmp, 0);
    close(dfd);
    return NULL;
  }
  void* m = mmap(NULL, RS_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    unlinkat(dfd, tmp, 0);
    close(dfd);
    return NULL;
  }
  unsigned char* b = (unsigned char*)m;
  rs_header* h = hdr(b);
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  double now = (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
  wall_offset = now - mono();
  memcpy(h->magic, RS_MAGIC, 8);
  h->version = RS_VERSION;
  h->header_size = RS_HEADER_SIZE;
  h->file_size = RS_FILE_SIZE;
  h->pid = getpid();
  h->pid_start_ticks = start_ticks();
  h->rank = rank;
  h->world_size = world;
  h->writer_kind = RS_WRITER_NCCL;
  h->created_wall = h->heartbeat_wall = now;
  h->max_comms = RS_MAX_COMMS;
  h->max_ops = RS_MAX_OPS;
  h->member_pool_size = RS_MEMBER_POOL;
  h->comm_table_offset = RS_COMM_TABLE_OFFSET;
  h->op_table_offset = RS_OP_TABLE_OFFSET;
  h->member_pool_offset = RS_MEMBER_POOL_OFFSET;
  copy_str(h->job_id, RS_JOB_ID_LEN, job);
  int renamed = renameat(dfd, tmp, dfd, name);
  if (renamed != 0) unlinkat(dfd, tmp, 0);
  close(dfd);
  if (renamed != 0) {
    munmap(m, RS_FILE_SIZE);
    return NULL;
  }
  return b;
}

/* A file's mapping outlives every event; it goes when the library is unloaded (no thread is in it then). */
static unsigned char* old_maps[8];
static void keep_map(unsigned char* b) {
  for (int i = 0; i < 8; i++)
    if (!old_maps[i]) {
      old_maps[i] = b;
      return;
    }
}
__attribute__((destructor)) static void unload(void) {
  unsigned char* b = file();
  if (b) munmap(b, RS_FILE_SIZE);
  for (int i = 0; i < 8; i++)
    if (old_maps[i] && old_maps[i] != b) munmap(old_maps[i], RS_FILE_SIZE);
}

/* compared as stored: cut to the field, so a name too long for it still finds its one slot */
static int find_slot(unsigned char* b, int comm_index, const char* op) {
  char name[RS_OP_NAME_LEN];
  copy_str(name, RS_OP_NAME_LEN, op);
  int n = __atomic_load_n(&n_ops_published, __ATOMIC_ACQUIRE);
  for (int i = 0; i < n; i++) {
    rs_op* o = op_at(b, i);
    if ((int)o->comm_index == comm_index && memcmp(o->op, name, RS_OP_NAME_LEN) == 0) return i;
  }
  return -1;
}

static int slot_for(unsigned char* b, rs_ctx* ctx, const char* func) {
  const char* op = func ? func : "?";
  uint64_t key = (uint64_t)(uintptr_t)op;
  uint64_t* c = &ctx->cache[(key >> 3) & 7];
  uint64_t e = __atomic_load_n(c, __ATOMIC_ACQUIRE);
  if (e && (e >> 16) == key) { /* the same pointer; a caller's reused buffer would hold another name */
    int hit = (int)(e & 0xFFFF) - 1;
    if (strncmp(op_at(b, hit)->op, op, RS_OP_NAME_LEN - 1) == 0) return hit;
  }
  int slot = find_slot(b, ctx->comm_index, op);
  if (slot < 0) {
    lock_create();
    slot = find_slot(b, ctx->comm_index, op);
    int n = __atomic_load_n(&n_ops_published, __ATOMIC_RELAXED);
    if (slot < 0 && n < RS_MAX_OPS) {
      rs_op* o = op_at(b, n);
      wbegin(&o->seq);
      o->comm_index = (uint32_t)ctx->comm_index;
      copy_str(o->op, RS_OP_NAME_LEN, op);
      wend(&o->seq);
      __atomic_store_n(&n_ops_published, n + 1, __ATOMIC_RELEASE);
      publish_header(b);
      slot = n;
    }
    unlock_create();
  }
  if (slot >= 0 && key < (1ULL << 48)) __atomic_store_n(c, (key << 16) | (uint64_t)(slot + 1), __ATOMIC_RELEASE);
  return slot;
}

static size_t type_size(const char* dt) {
  if (!dt) return 1;
  if (strstr(dt, "64") || strstr(dt, "Double")) return 8;
  if (strstr(dt, "32")) return 4;
  if (strstr(dt, "16") || strstr(dt, "Half")) return 2;
  if (strstr(dt, "8") || strstr(dt, "Char")) return 1;
  if (strstr(dt, "Float") || strstr(dt, "Int")) return 4; /* ncclFloat, ncclInt are 32-bit */
  return 1;
}

/* open_peers holds one entry per open point-to-point call (so two open receives from one peer stay
 * visible until both finish); the reader folds duplicates */
static void open_peer(rs_op* o, int peer, int delta) {
  if (peer < 0) return;
  uint32_t n = o->n_open_peers < RS_MAX_OPEN_PEERS ? o->n_open_peers : RS_MAX_OPEN_PEERS;
  if (delta > 0) {
    if (n < RS_MAX_OPEN_PEERS) o->open_peers[n++] = peer;
  } else {
    for (uint32_t i = 0; i < n; i++)
      if (o->open_peers[i] == peer) {
        o->open_peers[i] = o->open_peers[n - 1];
        o->open_peers[--n] = 0;
        break;
      }
  }
  o->n_open_peers = n;
}

static void ring_add(rs_op* o, double throughput) {
  uint32_t at = o->ring_next < RS_RING_LEN ? o->ring_next : 0;
  o->ring[at] = throughput;
  o->ring_next = (at + 1) % RS_RING_LEN;
  if (o->ring_count < RS_RING_LEN) o->ring_count++;
}

/* ---- contexts ------------------------------------------------------------------------------------- */

static rs_ctx* context_of(const void* h) {
  uint32_t gen, i;
  uint64_t* w = decode(h, P_CTX, &gen, &i);
  if (!w) return NULL;
  uint64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
  return W_GEN(v) == gen && W_STATE(v) == S_OPEN ? &ctxs[i] : NULL;
}

static ncclResult_t rs_init(void** context, uint64_t commId, int* mask, const char* commName, int nNodes, int nranks,
                            int rank, ncclDebugLogger_t logfn) {
  if (!context || !mask) return RS_NCCL_SUCCESS;
  *context = NULL;
  *mask = 0;
  const char* enable = getenv(RS_ENV_ENABLE);
  if (enable && strcmp(enable, "0") == 0) return RS_NCCL_SUCCESS;
  lock_create();
  unsigned char* b = file();
  if (!b) {
    if (!(b = open_file(rank, nranks, logfn))) {
      unlock_create();
      return RS_NCCL_SUCCESS;
    }
    my_pid = getpid();
    keep_map(b);
    __atomic_store_n(&base, b, __ATOMIC_RELEASE);
  }
  int slot = -1;
  for (int i = 0; i < RS_MAX_COMMS && slot < 0; i++)
    if (W_STATE(__atomic_load_n(&ctxs[i].word, __ATOMIC_ACQUIRE)) == S_FREE) slot = i;
  if (slot < 0 || n_comms >= RS_MAX_COMMS) {
    unlock_create();
    return RS_NCCL_SUCCESS;
  }
  rs_ctx* ctx = &ctxs[slot];
  uint32_t gen = next_gen(W_GEN(ctx->word));
  ctx->comm_index = n_comms;
  ctx->net = nNodes > 1;
  ctx->p2p_seq = 0;
  memset(ctx->cache, 0, sizeof(ctx->cache));
  rs_comm* c = comm_at(b, n_comms);
  char id[RS_COMM_ID_LEN];
  snprintf(id, sizeof(id), "%016llx", (unsigned long long)commId);
  wbegin(&c->seq);
  copy_str(c->comm_id, RS_COMM_ID_LEN, id);
  copy_str(c->backend, RS_BACKEND_LEN, "nccl");
  copy_str(c->description, RS_DESC_LEN, commName);
  c->member_offset = 0;
  c->n_members = 0; /* NCCL does not tell a plugin its members' global ranks */
  c->comm_nranks = nranks > 0 ? nranks : 0;
  c->comm_rank = nranks > 0 && rank >= 0 && rank < nranks ? rank : -1;
  wend(&c->seq);
  n_comms++;
  live_comms++;
  publish_header(b);
  __atomic_store_n(&ctx->word, W_MAKE(gen, 0, S_OPEN), __ATOMIC_RELEASE);
  unlock_create();
  *context = encode(P_CTX, (uint32_t)slot, gen);
  *mask = MASK;
  if (logfn) {
    __atomic_store_n(&nccl_log, logfn, __ATOMIC_RELEASE);
    logfn(RS_LOG_INFO, RS_LOG_INIT, __FILE__, __LINE__, "rankscope profiler: communicator %016llx (%d ranks, rank %d) "
          "counted into %s", (unsigned long long)commId, nranks, rank, path);
  }
  return RS_NCCL_SUCCESS;
}

static ncclResult_t rs_finalize(void* context) {
  rs_ctx* ctx = context_of(context);
  if (!ctx) return RS_NCCL_SUCCESS;
  lock_create();
  uint64_t w = __atomic_load_n(&ctx->word, __ATOMIC_ACQUIRE);
  if (W_STATE(w) == S_OPEN) {
    __atomic_store_n(&ctx->word, W_MAKE(W_GEN(w), 0, S_FREE), __ATOMIC_RELEASE);
    unsigned char* b = file();
    if (b && --live_comms <= 0) {
      /* the last communicator: mark the file, unlink it unless kept; keep the mapping (see unload) */
      const char* keep = getenv("RANKSCOPE_CCL_KEEP");
      rs_header* h = hdr(b);
      wbegin(&h->seq);
      h->flags |= RS_FLAG_CLEAN_EXIT;
      wend(&h->seq);
      if (!keep || strcmp(keep, "1") != 0) unlink(path);
      __atomic_store_n(&base, NULL, __ATOMIC_RELEASE);
      n_comms = live_comms = 0;
      __atomic_store_n(&n_ops_published, 0, __ATOMIC_RELEASE);
    }
  }
  unlock_create();
  return RS_NCCL_SUCCESS;
}

/* ---- events --------------------------------------------------------------------------------------- */

/* what a descriptor says, whatever its version */
typedef struct {
  uint64_t type;
  void* parent;
  const char* func;
  const char* datatype;
  size_t count;
  uint64_t seq;
  int peer, is_send, n_channels;
  int ce; /* a copy-engine collective (v6): no kernel channel or proxy op follows, its stop completes it */
  pid_t pid;
  uint64_t ptimer;
} rs_descr;

static void count_launch(unsigned char* b, rs_rec* t, double now) {
  rs_op* o = op_at(b, t->slot);
  wbegin(&o->seq);
  o->cl++;
  o->bytes_total += t->bytes;
  if (t->aux > o->last_launched_seq) o->last_launched_seq = t->aux;
  o->last_launch_wall = now + wall_offset;
  if (t->kind == K_P2P) open_peer(o, t->peer, +1);
  wend(&o->seq);
}

/* The task is stopped and its last child stopped: complete, until a late child reopens it. NCCL stops a
 * task on the host before its proxy work starts, and with KernelCh subscribed every task gets children
 * (one kernel channel per channel it runs on), so a task completes when its last child stops, never at
 * its own stop. The caller copied the record before the compare-and-swap that let it go, since it may be
 * reused from then on. */
static void count_complete(const rs_rec* t) {
  unsigned char* b = file();
  if (!b || !context_of((void*)(uintptr_t)t->ctx)) return;
  double now = mono();
  rs_op* o = op_at(b, t->slot);
  wbegin(&o->seq);
  o->last_duration = t->req ? (double)t->req * 1e-9 : now - t->t0; /* on the GPU where it gave times */
  o->last_complete_wall = now + wall_offset;
  if (t->aux > o->last_completed_seq) o->last_completed_seq = t->aux;
  if (t->kind == K_P2P) open_peer(o, t->peer, -1);
  wend(&o->seq);
}

static void count_reopen(unsigned char* b, const rs_rec* t) {
  if (t->kind != K_P2P) return;
  rs_op* o = op_at(b, t->slot);
  wbegin(&o->seq);
  open_peer(o, t->peer, +1);
  wend(&o->seq);
}

/* WR: once per request */
static void request(rs_rec* e) {
  unsigned char* b = file();
  if (!b || !context_of((void*)(uintptr_t)e->ctx)) return;
  uint32_t r = 0;
  if (!__atomic_compare_exchange_n(&e->req, &r, R_REQUESTED, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) return;
  e->t0 = mono();
  rs_op* o = op_at(b, e->slot);
  wbegin(&o->seq);
  o->wr++;
  wend(&o->seq);
}

/* WC: once per request, only for one that was counted as requested; seconds < 0: since it was posted */
static void complete(rs_rec* e, double seconds) {
  unsigned char* b = file();
  if (!b || !context_of((void*)(uintptr_t)e->ctx)) return;
  uint32_t r = R_REQUESTED;
  if (!__atomic_compare_exchange_n(&e->req, &r, R_REQUESTED | R_COMPLETED, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
    return;
  if (seconds < 0) seconds = mono() - e->t0;
  uint64_t moved = __atomic_load_n(&e->bytes, __ATOMIC_RELAXED);
  rs_op* o = op_at(b, e->slot);
  wbegin(&o->seq);
  o->wc++;
  if (moved > 0 && seconds > 0) ring_add(o, (double)moved / seconds);
  wend(&o->seq);
}

/* Drop one reference on a record. A stopped record with no reference left is done: a task completes;
 * a proxy op is freed and lets go of its task. */
static void release(uint64_t handle) {
  uint32_t gen;
  int pool;
  rs_rec* r = record((void*)(uintptr_t)handle, &gen, &pool);
  if (!r) return;
  rs_rec copy;
  copy_fields(&copy, r); /* while we hold a reference; the record may be reused once we let go */
  uint64_t w = __atomic_load_n(&r->word, __ATOMIC_ACQUIRE);
  int done;
  for (;;) {
    if (W_GEN(w) != gen || W_REFS(w) == 0) return;
    uint64_t nw = w - (1u << 16);
    done = W_STATE(w) == S_STOPPED && W_REFS(nw) == 0;
    if (done) nw = pool == P_CHILD ? W_MAKE(gen, 0, S_FREE) : W_MAKE(gen, 0, S_DONE | W_FLAGS(w));
    if (__atomic_compare_exchange_n(&r->word, &w, nw, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) break;
  }
  if (!done) return;
  if (pool == P_TASK)
    count_complete(&copy);
  else
    release(copy.parent);
}

static ncclResult_t rs_start_any(void* context, void** handle, const rs_descr* d) {
  rs_ctx* ctx = context_of(context);
  unsigned char* b = file();
  if (!ctx || !b) return RS_NCCL_SUCCESS;
  uint32_t gen;
  if (d->type == RS_EV_COLL || d->type == RS_EV_P2P) {
    int slot = slot_for(b, ctx, d->func);
    if (slot < 0) return RS_NCCL_SUCCESS;
    int i = alloc_rec(tasks, RS_TASK_POOL, &task_cursor, &gen);
    if (i < 0) {
      warn_full("collective");
      return RS_NCCL_SUCCESS;
    }
    rs_rec* t = &tasks[i];
    int is_coll = d->type == RS_EV_COLL;
    t->kind = is_coll ? K_COLL : K_P2P;
    t->slot = slot;
    t->peer = is_coll ? -1 : d->peer;
    t->parent = 0;
    t->ctx = (uint64_t)(uintptr_t)context;
    t->net = (uint8_t)ctx->net;
    t->is_send = 0;
    t->n_channels = (uint8_t)(d->n_channels > 0 ? d->n_channels : 1);
    t->bytes = (uint64_t)d->count * type_size(d->datatype);
    t->aux = is_coll ? d->seq + 1 : __atomic_add_fetch(&ctx->p2p_seq, 1, __ATOMIC_RELAXED);
    t->t0 = mono();
    t->req = 0;
    count_launch(b, t, t->t0);
    publish(t, gen, d->ce ? F_CHILDREN : 0);
    *handle = encode(P_TASK, (uint32_t)i, gen);
    return RS_NCCL_SUCCESS;
  }
  if (d->type != RS_EV_PROXY_OP && d->type != RS_EV_PROXY_STEP && d->type != RS_EV_KERNEL_CH) return RS_NCCL_SUCCESS;
  /* with PXN a proxy op comes from another process: its parentObj is that process's handle */
  if (d->type == RS_EV_PROXY_OP && d->pid != my_pid) return RS_NCCL_SUCCESS;
  uint32_t pgen;
  int ppool;
  rs_rec* p = record(d->parent, &pgen, &ppool);
  int want = d->type == RS_EV_PROXY_STEP ? P_CHILD : P_TASK;
  if (!p || ppool != want) return RS_NCCL_SUCCESS;
  uint64_t before = attach(p, pgen);
  if (!before) return RS_NCCL_SUCCESS; /* stale: the parent's record was reused */
  uint64_t parent = (uint64_t)(uintptr_t)d->parent;
  if (want == P_CHILD && p->kind != K_OP) { /* a step's parent must be a proxy op */
    release(parent);
    return RS_NCCL_SUCCESS;
  }
  int i = alloc_rec(children, RS_CHILD_POOL, &child_cursor, &gen);
  if (i < 0) {
    warn_full("proxy/kernel-channel");
    release(parent);
    return RS_NCCL_SUCCESS;
  }
  if (want == P_TASK && W_STATE(before) == S_DONE) count_reopen(b, p);
  rs_rec* e = &children[i];
  e->parent = parent;
  e->ctx = p->ctx;
  e->slot = p->slot;
  e->net = p->net;
  e->n_channels = p->n_channels;
  e->aux = 0;
  e->bytes = 0;
  e->req = 0;
  e->t0 = 0;
  if (d->type == RS_EV_PROXY_OP) {
    e->kind = K_OP;
    e->is_send = (uint8_t)(d->is_send != 0);
    e->peer = d->peer;
  } else if (d->type == RS_EV_PROXY_STEP) {
    e->kind = K_STEP;
    e->is_send = p->is_send;
    e->peer = p->peer;
  } else {
    e->kind = K_KCH;
    e->is_send = 0;
    e->peer = p->peer;
    e->aux = d->ptimer;
    e->bytes = p->bytes / (p->n_channels ? p->n_channels : 1);
  }
  publish(e, gen, 0);
  if (e->kind == K_KCH && !e->net) request(e); /* within a node the channel is the request */
  *handle = encode(P_CHILD, (uint32_t)i, gen);
  return RS_NCCL_SUCCESS;
}

/* A kernel channel stopped at GPU time ``stop``: its task's span on the GPU grows to cover it (TD on the
 * device). The channel holds a reference on its task, so the task record is not reused meanwhile. */
static void device_span(const rs_rec* e, uint64_t stop) {
  uint32_t pgen;
  int ppool;
  rs_rec* t = record((void*)(uintptr_t)e->parent, &pgen, &ppool);
  if (!t || ppool != P_TASK || !e->aux || stop <= e->aux) return;
  uint64_t first = __atomic_load_n(&t->parent, __ATOMIC_RELAXED);
  while ((first == 0 || e->aux < first) &&
         !__atomic_compare_exchange_n(&t->parent, &first, e->aux, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  if (first == 0 || e->aux < first) first = e->aux;
  uint64_t span = stop > first ? stop - first : 0;
  uint32_t ns = span > UINT32_MAX ? UINT32_MAX : (uint32_t)span;
  uint32_t cur = __atomic_load_n(&t->req, __ATOMIC_RELAXED);
  while (ns > cur && !__atomic_compare_exchange_n(&t->req, &cur, ns, 1, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
  }
}

static ncclResult_t rs_state(void* handle, rs_nccl_state_t state, rs_nccl_state_args* args) {
  uint32_t gen;
  int pool;
  rs_rec* e = record(handle, &gen, &pool);
  if (!e || pool != P_CHILD || !owned(e, gen)) return RS_NCCL_SUCCESS;
  if (e->kind == K_STEP && e->net) {
    if (args && args->proxyStep.transSize)
      __atomic_store_n(&e->bytes, (uint64_t)args->proxyStep.transSize, __ATOMIC_RELAXED);
    if (state == RS_ST_STEP_SEND_WAIT || state == RS_ST_STEP_RECV_WAIT)
      request(e);
    else if (state == RS_ST_STEP_RECV_FLUSH_WAIT)
      complete(e, -1);
  } else if (e->kind == K_KCH && !e->net && state == RS_ST_KERNEL_CH_STOP) {
    uint64_t stop = args ? args->kernelCh.pTimer : 0;
    complete(e, e->aux && stop > e->aux ? (double)(stop - e->aux) * 1e-9 : -1);
    device_span(e, stop);
  }
  return RS_NCCL_SUCCESS;
}

static ncclResult_t rs_stop(void* handle) {
  uint32_t gen;
  int pool;
  rs_rec* e = record(handle, &gen, &pool);
  if (!e || !owned(e, gen)) return RS_NCCL_SUCCESS; /* not ours, stale, or stopped twice */
  rs_rec copy;
  copy_fields(&copy, e);
  /* a request still open at its stop finished now; counted while the record is surely ours */
  if (copy.kind == K_STEP || copy.kind == K_KCH) complete(e, -1);
  uint64_t w = __atomic_load_n(&e->word, __ATOMIC_ACQUIRE);
  int done;
  for (;;) { /* open -> stopped; a child no one holds goes back to the pool; a task whose children all
               * stopped already (they ran before the host stopped it) is done */
    if (W_GEN(w) != gen || W_STATE(w) != S_OPEN) return RS_NCCL_SUCCESS;
    uint64_t nw = W_MAKE(gen, W_REFS(w), S_STOPPED | W_FLAGS(w));
    done = W_REFS(w) == 0 && (pool == P_CHILD || (W_FLAGS(w) & F_CHILDREN));
    if (done) nw = pool == P_CHILD ? W_MAKE(gen, 0, S_FREE) : W_MAKE(gen, 0, S_DONE | W_FLAGS(w));
    if (__atomic_compare_exchange_n(&e->word, &w, nw, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) break;
  }
  if (!done) return RS_NCCL_SUCCESS;
  if (pool == P_TASK)
    count_complete(&copy);
  else
    release(copy.parent);
  return RS_NCCL_SUCCESS;
}

/* ---- version adapters ----------------------------------------------------------------------------- */

/* v5 and v6 share the members read here (same union offsets) */
#define FILL_V5(d, u)                                                                                               \
  do {                                                                                                              \
    if ((d).type == RS_EV_COLL) {                                                                                   \
      (d).func = (u).coll.func;                                                                                     \
      (d).datatype = (u).coll.datatype;                                                                             \
      (d).count = (u).coll.count;                                                                                   \
      (d).seq = (u).coll.seqNumber;                                                                                 \
      (d).n_channels = (u).coll.nChannels;                                                                          \
    } else if ((d).type == RS_EV_P2P) {                                                                             \
      (d).func = (u).p2p.func;                                                                                      \
      (d).datatype = (u).p2p.datatype;                                                                              \
      (d).count = (u).p2p.count;                                                                                    \
      (d).peer = (u).p2p.peer;                                                                                      \
      (d).n_channels = (u).p2p.nChannels;                                                                           \
    } else if ((d).type == RS_EV_PROXY_OP) {                                                                        \
      (d).pid = (u).proxyOp.pid;                                                                                    \
      (d).peer = (u).proxyOp.peer;                                                                                  \
      (d).is_send = (u).proxyOp.isSend;                                                                             \
    } else if ((d).type == RS_EV_KERNEL_CH) {                                                                       \
      (d).ptimer = (u).kernelCh.pTimer;                                                                             \
    }                                                                                                               \
  } while (0)

static ncclResult_t rs_start_v6(void* context, void** handle, rs_nccl_descr_v6* e) {
  if (!handle) return RS_NCCL_SUCCESS;
  *handle = NULL;
  if (!e) return RS_NCCL_SUCCESS;
  rs_descr d = {.type = e->type, .parent = e->parentObj, .peer = -1};
  FILL_V5(d, e->u);
  if (e->type == RS_EV_CE_COLL) { /* counted as the collective it is; NCCL >= 2.29 runs some on copy engines */
    d.type = RS_EV_COLL;
    d.ce = 1;
    d.func = e->u.ceColl.func;
    d.datatype = e->u.ceColl.datatype;
    d.count = e->u.ceColl.count;
    d.seq = e->u.ceColl.seqNumber;
    d.n_channels = 1;
  }
  return rs_start_any(context, handle, &d);
}

static ncclResult_t rs_start_v5(void* context, void** handle, rs_nccl_descr_v5* e) {
  if (!handle) return RS_NCCL_SUCCESS;
  *handle = NULL;
  if (!e) return RS_NCCL_SUCCESS;
  rs_descr d = {.type = e->type, .parent = e->parentObj, .peer = -1};
  FILL_V5(d, e->u);
  return rs_start_any(context, handle, &d);
}

static ncclResult_t rs_start_v4(void* context, void** handle, rs_nccl_descr_v4* e) {
  if (!handle) return RS_NCCL_SUCCESS;
  *handle = NULL;
  if (!e) return RS_NCCL_SUCCESS;
  rs_descr d = {.type = e->type, .parent = e->parentObj, .peer = -1};
  FILL_V5(d, e->u); /* the v4 members read here have the same names and order */
  return rs_start_any(context, handle, &d);
}

static ncclResult_t rs_init_v4(void** context, int* mask, const char* commName, uint64_t commHash, int nNodes,
                               int nranks, int rank, ncclDebugLogger_t logfn) {
  return rs_init(context, commHash, mask, commName, nNodes, nranks, rank, logfn);
}

EXPORT rs_nccl_profiler_v6 ncclProfiler_v6 = {"rankscope", rs_init, rs_start_v6, rs_stop, rs_state, rs_finalize};
EXPORT rs_nccl_profiler_v5 ncclProfiler_v5 = {"rankscope", rs_init, rs_start_v5, rs_stop, rs_state, rs_finalize};
EXPORT rs_nccl_profiler_v4 ncclProfiler_v4 = {"rankscope", rs_init_v4, rs_start_v4, rs_stop, rs_state, rs_finalize};
