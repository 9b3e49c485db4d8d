/* rankscope's NCCL profiler plugin: Aegis Phase-2 CL/WR/WC from inside NCCL.
 *
 * NCCL loads this library through NCCL_PROFILER_PLUGIN and calls the entry
 * points of `ncclProfiler_v5` (or `ncclProfiler_v4` on older NCCL). Events are turned into the same counter file
 * the Python hooks write (layout in rankscope_layout.h, generated from
 * layout.py), named <job>.rank<R>.nccl.ccl so both writers can coexist:
 *   CL  Coll / P2p start, per (communicator id given to init, function);
 *   WR  a ProxyStep entering SendWait / RecvWait (a network work request);
 *   WC  ProxyStep stop for sends, RecvFlushWait (or stop) for receives;
 *   N   transSize / (completion - request) of each step, into the ring;
 *   TD  Coll / P2p start to stop;
 * on communicators with no network (nNodes == 1) the kernel channels are the
 * progress signal: KernelCh start is a WR, its stop a WC.
 * One process-wide mutex makes this the file's single writer; stores follow
 * the seqlock protocol so readers in other processes never see torn values. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
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
#define MASK (RS_EV_COLL | RS_EV_P2P | RS_EV_PROXY_OP | RS_EV_PROXY_STEP | RS_EV_KERNEL_CH)

typedef struct {
  int comm_index;
  int net; /* communicator spans nodes: proxy steps carry the requests */
} rs_ctx;

enum { K_COLL = 1, K_P2P, K_OP, K_STEP, K_KCH };

typedef struct rs_event {
  int kind;
  int slot;    /* op slot (coll/p2p/op/step/kch inherit their parent's) */
  int is_send; /* proxy op/step direction */
  int peer;
  int requested; /* a WR was counted for this step/channel */
  int completed; /* its WC was counted */
  uint64_t seq;
  uint64_t bytes;
  double t0;  /* start (coll/p2p) or request time (step), monotonic seconds */
  size_t trans;
} rs_event;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned char* base; /* the mapped file, NULL until the first init */
static int n_comms, n_ops, refcount;
static uint64_t comm_seq[RS_MAX_COMMS];
static char path[4096];
static double wall_offset;

static double mono(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static rs_header* hdr(void) { return (rs_header*)base; }
static rs_comm* comm_at(int i) { return (rs_comm*)(base + RS_COMM_TABLE_OFFSET + (size_t)i * RS_COMM_SIZE); }
static rs_op* op_at(int i) { return (rs_op*)(base + RS_OP_TABLE_OFFSET + (size_t)i * RS_OP_SIZE); }

/* seqlock: odd, fence, fields..., fence, even */
static void wbegin(uint64_t* seq) {
  __atomic_store_n(seq, *seq + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
}
static void wend(uint64_t* seq) {
  __atomic_thread_fence(__ATOMIC_RELEASE);
  __atomic_store_n(seq, *seq + 1, __ATOMIC_RELAXED);
}

static void publish_header(void) {
  rs_header* h = hdr();
  wbegin(&h->seq);
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  h->heartbeat_wall = (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
  h->n_comms = (uint32_t)n_comms;
  h->n_ops = (uint32_t)n_ops;
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
  size_t n = strlen(src);
  if (n > size - 1) n = size - 1;
  memcpy(dst, src, n);
}

static int open_file(int comm_rank, int comm_size) {
  const char* dir = getenv(RS_ENV_DIR);
  const char* job = getenv(RS_ENV_JOB_ID);
  const char* r = getenv("RANK");
  const char* w = getenv("WORLD_SIZE");
  int rank = r ? atoi(r) : comm_rank;
  int world = w ? atoi(w) : comm_size;
  if (!dir || !*dir) dir = RS_DEFAULT_DIR;
  if (!job || !*job) job = getenv("TORCHELASTIC_RUN_ID");
  if (!job || !*job) job = "job";
  mkdir(dir, 0755);
  char tmp[4200];
  snprintf(path, sizeof(path), "%s/%s.rank%d.nccl.ccl", dir, job, rank);
  snprintf(tmp, sizeof(tmp), "%s/.%s.rank%d.nccl.ccl.%d.tmp", dir, job, rank, (int)getpid());
  int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return -1;
  if (ftruncate(fd, RS_FILE_SIZE) != 0) { close(fd); unlink(tmp); return -1; }
  void* m = mmap(NULL, RS_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) { unlink(tmp); return -1; }
  base = (unsigned char*)m;
  rs_header* h = hdr();
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
  if (rename(tmp, path) != 0) { munmap(m, RS_FILE_SIZE); base = NULL; unlink(tmp); return -1; }
  return 0;
}

static int slot_for(int comm_index, const char* op) {
  for (int i = 0; i < n_ops; i++) {
    rs_op* o = op_at(i);
    if ((int)o->comm_index == comm_index && strncmp(o->op, op, RS_OP_NAME_LEN) == 0) return i;
  }
  if (n_ops >= RS_MAX_OPS) return -1;
  rs_op* o = op_at(n_ops);
  wbegin(&o->seq);
  o->comm_index = (uint32_t)comm_index;
  copy_str(o->op, RS_OP_NAME_LEN, op);
  wend(&o->seq);
  n_ops++;
  publish_header();
  return n_ops - 1;
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

static void open_peer(rs_op* o, int peer, int delta) {
  if (peer < 0) return;
  for (uint32_t i = 0; i < o->n_open_peers; i++) {
    if (o->open_peers[i] == peer) {
      if (delta < 0) { /* drop it */
        o->open_peers[i] = o->open_peers[o->n_open_peers - 1];
        o->open_peers[--o->n_open_peers] = 0;
      }
      return;
    }
  }
  if (delta > 0 && o->n_open_peers < RS_MAX_OPEN_PEERS) o->open_peers[o->n_open_peers++] = peer;
}

/* ---- entry points ------------------------------------------------------- */

static ncclResult_t rs_init(void** context, uint64_t commId, int* mask, const char* commName, int nNodes, int nranks,
                            int rank, ncclDebugLogger_t logfn) {
  (void)logfn;
  *context = NULL;
  *mask = 0;
  if (getenv(RS_ENV_ENABLE) && strcmp(getenv(RS_ENV_ENABLE), "0") == 0) return RS_NCCL_SUCCESS;
  pthread_mutex_lock(&lock);
  if (!base && open_file(rank, nranks) != 0) { pthread_mutex_unlock(&lock); return RS_NCCL_SUCCESS; }
  if (n_comms >= RS_MAX_COMMS) { pthread_mutex_unlock(&lock); return RS_NCCL_SUCCESS; }
  rs_ctx* ctx = calloc(1, sizeof(rs_ctx));
  if (!ctx) { pthread_mutex_unlock(&lock); return RS_NCCL_SUCCESS; }
  ctx->comm_index = n_comms;
  ctx->net = nNodes > 1;
  rs_comm* c = comm_at(n_comms);
  char id[RS_COMM_ID_LEN];
  snprintf(id, sizeof(id), "%016llx", (unsigned long long)commId);
  wbegin(&c->seq);
  copy_str(c->comm_id, RS_COMM_ID_LEN, id);
  copy_str(c->backend, RS_BACKEND_LEN, "nccl");
  copy_str(c->description, RS_DESC_LEN, commName);
  c->member_offset = 0;
  c->n_members = 0; /* NCCL does not tell a plugin its members' global ranks */
  wend(&c->seq);
  n_comms++;
  refcount++;
  publish_header();
  pthread_mutex_unlock(&lock);
  *context = ctx;
  *mask = MASK;
  return RS_NCCL_SUCCESS;
}

static ncclResult_t rs_start_any(void* context, void** handle, uint64_t type, void* parent_obj,
                                 const rs_nccl_descr_union* u) {
  *handle = NULL;
  rs_ctx* ctx = (rs_ctx*)context;
  if (!ctx || !base) return RS_NCCL_SUCCESS;
  rs_event* parent = (rs_event*)parent_obj;
  rs_event* e = NULL;
  double now = mono();
  pthread_mutex_lock(&lock);
  if (type == RS_EV_COLL || type == RS_EV_P2P) {
    int is_coll = type == RS_EV_COLL;
    const char* func = is_coll ? u->coll.func : u->p2p.func;
    int slot = slot_for(ctx->comm_index, func ? func : "?");
    if (slot >= 0 && (e = calloc(1, sizeof(rs_event)))) {
      rs_op* o = op_at(slot);
      e->kind = is_coll ? K_COLL : K_P2P;
      e->slot = slot;
      e->peer = is_coll ? -1 : u->p2p.peer;
      e->bytes = (uint64_t)(is_coll ? u->coll.count * type_size(u->coll.datatype)
                                    : u->p2p.count * type_size(u->p2p.datatype));
      e->seq = is_coll ? u->coll.seqNumber : ++comm_seq[ctx->comm_index];
      e->t0 = now;
      wbegin(&o->seq);
      o->cl++;
      o->bytes_total += e->bytes;
      o->last_launched_seq = e->seq;
      o->last_launch_wall = now + wall_offset;
      if (!is_coll) open_peer(o, e->peer, +1);
      wend(&o->seq);
    }
  } else if ((type == RS_EV_PROXY_OP || type == RS_EV_PROXY_STEP || type == RS_EV_KERNEL_CH) && parent &&
             parent->slot >= 0) {
    if ((e = calloc(1, sizeof(rs_event)))) {
      e->slot = parent->slot;
      e->peer = parent->peer;
      if (type == RS_EV_PROXY_OP) {
        e->kind = K_OP;
        e->is_send = u->proxyOp.isSend;
        e->peer = u->proxyOp.peer;
      } else if (type == RS_EV_PROXY_STEP) {
        e->kind = K_STEP;
        e->is_send = parent->is_send;
      } else {
        e->kind = K_KCH;
        if (!ctx->net) { /* no network steps: the channel is the work request */
          rs_op* o = op_at(e->slot);
          wbegin(&o->seq);
          o->wr++;
          wend(&o->seq);
          e->requested = 1;
          e->t0 = now;
        }
      }
    }
  }
  pthread_mutex_unlock(&lock);
  *handle = e;
  return RS_NCCL_SUCCESS;
}

static ncclResult_t rs_start(void* context, void** handle, rs_nccl_descr_v5* d) {
  return rs_start_any(context, handle, d->type, d->parentObj, &d->u);
}

static ncclResult_t rs_start_v4(void* context, void** handle, rs_nccl_descr_v4* d) {
  return rs_start_any(context, handle, d->type, d->parentObj, &d->u);
}

static ncclResult_t rs_init_v4(void** context, int* mask, const char* commName, uint64_t commHash, int nNodes,
                               int nranks, int rank, ncclDebugLogger_t logfn) {
  return rs_init(context, commHash, mask, commName, nNodes, nranks, rank, logfn);
}

static void complete_request(rs_event* e, double now) {
  rs_op* o = op_at(e->slot);
  double dt = now - e->t0;
  wbegin(&o->seq);
  o->wc++;
  if (e->trans > 0 && dt > 0) {
    o->ring[o->ring_next] = (double)e->trans / dt;
    o->ring_next = (o->ring_next + 1) % RS_RING_LEN;
    if (o->ring_count < RS_RING_LEN) o->ring_count++;
  }
  wend(&o->seq);
  e->completed = 1;
}

static ncclResult_t rs_state(void* handle, rs_nccl_state_t state, rs_nccl_state_args_v5* args) {
  rs_event* e = (rs_event*)handle;
  if (!e || !base) return RS_NCCL_SUCCESS;
  double now = mono();
  pthread_mutex_lock(&lock);
  if (e->kind == K_STEP) {
    if (args) e->trans = args->proxyStep.transSize;
    if ((state == RS_ST_STEP_SEND_WAIT || state == RS_ST_STEP_RECV_WAIT) && !e->requested) {
      rs_op* o = op_at(e->slot);
      wbegin(&o->seq);
      o->wr++;
      wend(&o->seq);
      e->requested = 1;
      e->t0 = now;
    } else if (state == RS_ST_STEP_RECV_FLUSH_WAIT && e->requested && !e->completed) {
      complete_request(e, now);
    }
  } else if (e->kind == K_KCH && state == RS_ST_KERNEL_CH_STOP && e->requested && !e->completed) {
    complete_request(e, now);
  }
  pthread_mutex_unlock(&lock);
  return RS_NCCL_SUCCESS;
}

static ncclResult_t rs_stop(void* handle) {
  rs_event* e = (rs_event*)handle;
  if (!e) return RS_NCCL_SUCCESS;
  if (base) {
    double now = mono();
    pthread_mutex_lock(&lock);
    if ((e->kind == K_STEP || e->kind == K_KCH) && e->requested && !e->completed) {
      complete_request(e, now);
    } else if (e->kind == K_COLL || e->kind == K_P2P) {
      rs_op* o = op_at(e->slot);
      wbegin(&o->seq);
      o->last_duration = now - e->t0;
      o->last_complete_wall = now + wall_offset;
      if (e->seq > o->last_completed_seq) o->last_completed_seq = e->seq;
      if (e->kind == K_P2P) open_peer(o, e->peer, -1);
      wend(&o->seq);
    }
    pthread_mutex_unlock(&lock);
  }
  free(e);
  return RS_NCCL_SUCCESS;
}

static ncclResult_t rs_finalize(void* context) {
  free(context);
  pthread_mutex_lock(&lock);
  if (base && --refcount <= 0) {
    const char* keep = getenv("RANKSCOPE_CCL_KEEP");
    hdr()->flags |= RS_FLAG_CLEAN_EXIT;
    munmap(base, RS_FILE_SIZE);
    base = NULL;
    n_comms = n_ops = 0;
    if (!keep || strcmp(keep, "1") != 0) unlink(path);
  }
  pthread_mutex_unlock(&lock);
  return RS_NCCL_SUCCESS;
}

EXPORT rs_nccl_profiler_v5 ncclProfiler_v5 = {"rankscope", rs_init, rs_start, rs_stop, rs_state, rs_finalize};
/* NCCL 2.23-2.25 look for v4: same events and states, another init order and a one-byte type */
EXPORT rs_nccl_profiler_v4 ncclProfiler_v4 = {"rankscope", rs_init_v4, rs_start_v4, rs_stop, rs_state, rs_finalize};
