/* Replays NCCL's real event order against the plugin's dlsym'd entry points, with no NCCL and no GPU.
 *
 *   replay LIB ROUNDS
 *   replay LIB fuzz SEED STEPS   (any calls, any handles, any order; see fuzz())
 *
 * What NCCL 2.28-2.30 does (src/enqueue.cc hostStreamPlanTask, src/proxy.cc, src/transport/net.cc,
 * src/transport/profiler.cc) and this driver repeats:
 * - the host thread starts a Coll/P2p, posts its proxy work and STOPS it at once (so proxy threads start
 *   its children mostly after, sometimes while or before that stop);
 * - later, proxy threads start ProxyOps whose parent is that stopped handle, start ProxySteps under them,
 *   record their states (send: SendGPUWait, SendPeerWait_v4, SendWait; receive: RecvWait, RecvFlushWait,
 *   RecvGPUWait) and stop them, up to 8 steps in flight per op, then stop the op;
 * - the profiler proxy starts a KernelCh per channel under the stopped Coll/P2p, records KernelChStop with
 *   the GPU timer and stops it.
 * Here PROXY_THREADS threads run communicator A's (two nodes) channels at once and one more runs B's (one
 * node) kernel channels, fed through bounded queues as NCCL's proxy ops pool bounds the host. Per round:
 * A: one AllReduce over CHANNELS channels, each a kernel channel (not a request across nodes) and a send
 * and a receive op of STEPS steps; every 4th round a
 * Send to peer 2 and a Recv from peer 3 (one op, one step each); B: one AllGather over CHANNELS kernel
 * channels (and with v6 one copy-engine AlltoAll on B). Then, on the main thread: handles that are NULL, not the plugin's, stale (a parent whose record
 * was reused), of the wrong kind, a PXN proxy op from another process, stops of stopped handles, states
 * after stops; finally an AllReduce and a Recv whose receive never arrives. The counters the file must then
 * hold are asserted exactly by tests/integration/test_ccl_nccl_plugin.py; this program checks that the
 * plugin refused what it must refuse (exit 3) and prints "replayed" before finalizing. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "harness_common.h"

#define PROXY_THREADS 4
#define CHANNELS 2
#define STEPS 6
#define IN_FLIGHT 4 /* steps posted before the oldest completes (NCCL_STEPS is 8) */
#define QUEUE_CAP 16

enum { J_NET_COLL, J_SEND, J_RECV, J_KCH, J_QUIT };

typedef struct {
  int kind;
  void* ctx;
  void* parent;
  int channel;
} job;

typedef struct {
  job q[QUEUE_CAP];
  int head, tail, n;
  pthread_mutex_t mu;
  pthread_cond_t can_put, can_get;
} queue;

static queue queues[PROXY_THREADS + 1];
static int failures;

static void put(queue* q, job j) {
  pthread_mutex_lock(&q->mu);
  while (q->n == QUEUE_CAP) pthread_cond_wait(&q->can_put, &q->mu);
  q->q[q->tail] = j;
  q->tail = (q->tail + 1) % QUEUE_CAP;
  q->n++;
  pthread_cond_signal(&q->can_get);
  pthread_mutex_unlock(&q->mu);
}

static job get(queue* q) {
  pthread_mutex_lock(&q->mu);
  while (q->n == 0) pthread_cond_wait(&q->can_get, &q->mu);
  job j = q->q[q->head];
  q->head = (q->head + 1) % QUEUE_CAP;
  q->n--;
  pthread_cond_signal(&q->can_put);
  pthread_mutex_unlock(&q->mu);
  return j;
}

static void expect_refused(void* h, const char* what) {
  if (h) {
    fprintf(stderr, "the plugin accepted %s\n", what);
    failures++;
  }
}

static void* task(void* ctx, uint64_t type, const char* func, uint64_t seq, size_t count, const char* dtype, int peer,
                  int n_channels) {
  rs_nccl_descr_v5 d;
  memset(&d, 0, sizeof(d));
  d.type = type;
  if (type == RS_EV_COLL) {
    d.u.coll.func = func;
    d.u.coll.seqNumber = seq;
    d.u.coll.count = count;
    d.u.coll.datatype = dtype;
    d.u.coll.nChannels = (uint8_t)n_channels;
  } else {
    d.u.p2p.func = func;
    d.u.p2p.count = count;
    d.u.p2p.datatype = dtype;
    d.u.p2p.peer = peer;
    d.u.p2p.nChannels = (uint8_t)n_channels;
  }
  return start(ctx, d);
}

static void* kernel_ch(void* ctx, void* parent, int channel, uint64_t ptimer) {
  rs_nccl_descr_v5 d;
  memset(&d, 0, sizeof(d));
  d.type = RS_EV_KERNEL_CH;
  d.parentObj = parent;
  d.u.kernelCh.channelId = (uint8_t)channel;
  d.u.kernelCh.pTimer = ptimer;
  return start(ctx, d);
}

/* one proxy op: steps posted IN_FLIGHT ahead, each through NCCL's states, completed oldest first */
static void proxy_op(void* ctx, void* parent, int is_send, int peer, int steps, size_t trans) {
  void* op = child(ctx, RS_EV_PROXY_OP, parent, is_send, peer);
  void* live[STEPS];
  int posted = 0, done = 0;
  while (done < steps) {
    while (posted < steps && posted - done < IN_FLIGHT) {
      void* s = child(ctx, RS_EV_PROXY_STEP, op, is_send, -1);
      if (is_send) {
        state(s, RS_ST_STEP_SEND_GPU_WAIT, 0);
        state(s, RS_ST_STEP_SEND_PEER_WAIT_V4, trans);
        state(s, RS_ST_STEP_SEND_WAIT, trans);
      } else {
        state(s, RS_ST_STEP_RECV_WAIT, trans);
      }
      live[posted++ % STEPS] = s;
    }
    void* s = live[done++ % STEPS];
    if (!is_send) {
      state(s, RS_ST_STEP_RECV_FLUSH_WAIT, trans);
      state(s, RS_ST_STEP_RECV_GPU_WAIT, trans);
    }
    P->stopEvent(s);
  }
  P->stopEvent(op);
  /* NCCL never does this, but a stale handle must not count: the records may belong to another thread's
   * events by now */
  void* last = live[(steps - 1) % STEPS];
  state(last, is_send ? RS_ST_STEP_SEND_WAIT : RS_ST_STEP_RECV_WAIT, trans);
  P->stopEvent(last);
  P->stopEvent(op);
}

static void* proxy_thread(void* arg) {
  queue* q = (queue*)arg;
  for (;;) {
    job j = get(q);
    if (j.kind == J_QUIT) return NULL;
    if (j.kind == J_NET_COLL) { /* the mask is process-wide: kernel channels come on this path too */
      void* k = kernel_ch(j.ctx, j.parent, j.channel, 1000);
      proxy_op(j.ctx, j.parent, 1, 2, STEPS, 1 << 16);
      proxy_op(j.ctx, j.parent, 0, 0, STEPS, 1 << 16);
      P->recordEventState(k, RS_ST_KERNEL_CH_STOP, NULL);
      P->stopEvent(k);
    } else if (j.kind == J_SEND || j.kind == J_RECV) {
      proxy_op(j.ctx, j.parent, j.kind == J_SEND, j.kind == J_SEND ? 2 : 3, 1, 256);
    } else {
      void* k = kernel_ch(j.ctx, j.parent, j.channel, 1000);
      rs_nccl_state_args a;
      memset(&a, 0, sizeof(a));
      a.kernelCh.pTimer = 1000 + 4000; /* 4 us on the GPU */
      P->recordEventState(k, RS_ST_KERNEL_CH_STOP, &a);
      P->stopEvent(k);
    }
  }
}

/* ---- fuzz: any sequence of calls with any handles, in any order ------------------------------------ */

static uint64_t rng_state;
static uint64_t rnd(void) { /* xorshift64*: reproducible from the seed */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1DULL;
}

/* Handles the plugin gave, handles it gave long ago, NULL and garbage, used in any order and any number
 * of times; communicators finalized and initialized again in between. Nothing may fault; the test then
 * checks that no counter says more completions than requests. */
static int fuzz(uint64_t seed, long steps) {
  static const char* funcs[] = {"AllReduce", "Send", "Recv", "AllGather", NULL,
                                "AVeryLongCollectiveNameThatDoesNotFitTheSlotField"};
  static const char* types[] = {"ncclFloat32", "ncclInt8", "ncclBfloat16", NULL, "ncclFloat64"};
  rng_state = seed * 2 + 1;
  void* ctx[2] = {NULL, NULL};
  int mask = 0;
  init(&ctx[0], 0xAAAAULL, &mask, "A", 2, 4, 1);
  init(&ctx[1], 0xBBBBULL, &mask, "B", 1, 2, 0);
  void* handles[64] = {0};
  int local = 0;
  void* junk[] = {NULL, (void*)1, &local, (void*)(uintptr_t)0xA1000001ULL, (void*)(uintptr_t)0x12345678A2000003ULL};
  for (long i = 0; i < steps; i++) {
    uint64_t r = rnd();
    void* c = ctx[r & 1];
    void* h = (r >> 8) % 4 == 0 ? junk[(r >> 12) % 5] : handles[(r >> 16) % 64];
    rs_nccl_descr_v5 d;
    memset(&d, 0, sizeof(d));
    rs_nccl_state_args a;
    memset(&a, 0, sizeof(a));
    a.proxyStep.transSize = (r >> 20) % 100000;
    switch ((r >> 4) % 9) {
      case 0:
      case 1: /* a task */
        d.type = (r >> 30) & 1 ? RS_EV_COLL : RS_EV_P2P;
        d.u.coll.func = funcs[(r >> 32) % 6];
        d.u.coll.count = (r >> 36) % 5000;
        d.u.coll.datatype = types[(r >> 40) % 5];
        d.u.coll.nChannels = (uint8_t)((r >> 44) % 5);
        d.u.coll.seqNumber = (r >> 48) % 100;
        if (d.type == RS_EV_P2P) {
          d.u.p2p.func = funcs[(r >> 32) % 6];
          d.u.p2p.count = (r >> 36) % 5000;
          d.u.p2p.datatype = types[(r >> 40) % 5];
          d.u.p2p.peer = (int)((r >> 48) % 12) - 2;
        }
        handles[(r >> 52) % 64] = start(c, d);
        break;
      case 2:
      case 3: { /* a child under whatever handle came up */
        static const uint64_t kinds[] = {RS_EV_PROXY_OP, RS_EV_PROXY_STEP, RS_EV_KERNEL_CH, RS_EV_GROUP,
                                         RS_EV_PROXY_CTRL, RS_EV_NET_PLUGIN, 1ULL << 40};
        d.type = kinds[(r >> 30) % 7];
        d.parentObj = h;
        d.u.proxyOp.pid = (r >> 33) % 8 ? getpid() : getpid() + 1;
        d.u.proxyOp.isSend = (int)((r >> 36) & 1);
        d.u.proxyOp.peer = (int)((r >> 37) % 6) - 1;
        if (d.type == RS_EV_KERNEL_CH) d.u.kernelCh.pTimer = (r >> 40) % 2 ? r >> 24 : 0;
        handles[(r >> 52) % 64] = start(c, d);
        break;
      }
      case 4:
      case 5:
        P->recordEventState(h, (int)((r >> 24) % 32), (r >> 29) & 1 ? &a : NULL);
        break;
      case 6:
      case 7:
        P->stopEvent(h);
        break;
      default:
        if ((r >> 24) % 50 == 0) { /* a communicator goes and comes back (the last one takes the file along) */
          P->finalize(c);
          P->finalize(c);
          init(&ctx[r & 1], r & 1 ? 0xBBBBULL : 0xAAAAULL, &mask, r & 1 ? "B" : "A", (r & 1) ? 1 : 2, 4, 1);
        } else if ((r >> 24) % 50 == 1) {
          P->finalize(h);
        }
    }
  }
  printf("fuzzed\n");
  fflush(stdout);
  P->finalize(ctx[0]);
  P->finalize(ctx[1]);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s LIB ROUNDS | %s LIB fuzz SEED STEPS\n", argv[0], argv[0]);
    return 2;
  }
  int rc = load_plugin(argv[1]);
  if (rc) return rc;
  if (strcmp(argv[2], "fuzz") == 0 && argc >= 5) return fuzz(strtoull(argv[3], NULL, 10), atol(argv[4]));
  long rounds = atol(argv[2]);
  void *a = NULL, *b = NULL;
  int mask = 0;
  init(&a, 0x0123456789abcdefULL, &mask, "WORLD", 2, 4, 1);
  init(&b, 0xfedcba9876543210ULL, &mask, "TENSOR_MODEL_PARALLEL_GROUP", 1, 2, 0);
  if (!a || !b || !(mask & RS_EV_PROXY_STEP) || !(mask & RS_EV_KERNEL_CH)) {
    fprintf(stderr, "init gave no context or mask %d\n", mask);
    return 1;
  }
  pthread_t threads[PROXY_THREADS + 1];
  for (int t = 0; t <= PROXY_THREADS; t++) {
    pthread_mutex_init(&queues[t].mu, NULL);
    pthread_cond_init(&queues[t].can_put, NULL);
    pthread_cond_init(&queues[t].can_get, NULL);
    pthread_create(&threads[t], NULL, proxy_thread, &queues[t]);
  }
  queue* kq = &queues[PROXY_THREADS];
  void* first = NULL;
  for (long r = 0; r < rounds; r++) {
    void* c = task(a, RS_EV_COLL, "AllReduce", (uint64_t)r, 1024, "ncclFloat32", -1, CHANNELS);
    /* NCCL posts the proxy work (ncclProxyStart) before it stops the task, so the proxy threads may start
     * children before, while or after the host stops it: every other round here posts first */
    int post_first = r % 2;
    if (!post_first) P->stopEvent(c);
    if (!first) first = c;
    for (int ch = 0; ch < CHANNELS; ch++) put(&queues[ch % PROXY_THREADS], (job){J_NET_COLL, a, c, ch});
    if (post_first) P->stopEvent(c);
    if (r % 4 == 0) {
      void* s = task(a, RS_EV_P2P, "Send", 0, 256, "ncclInt8", 2, 1);
      void* v = task(a, RS_EV_P2P, "Recv", 0, 256, "ncclInt8", 3, 1);
      P->stopEvent(s);
      P->stopEvent(v);
      put(&queues[(r / 4) % PROXY_THREADS], (job){J_SEND, a, s, 0});
      put(&queues[(r / 4 + 1) % PROXY_THREADS], (job){J_RECV, a, v, 0});
    }
    void* g = task(b, RS_EV_COLL, "AllGather", (uint64_t)r, 64, "ncclFloat16", -1, CHANNELS);
    P->stopEvent(g);
    for (int ch = 0; ch < CHANNELS; ch++) put(kq, (job){J_KCH, b, g, ch});
  }
  for (int t = 0; t <= PROXY_THREADS; t++) put(&queues[t], (job){J_QUIT, NULL, NULL, 0});
  for (int t = 0; t <= PROXY_THREADS; t++) pthread_join(threads[t], NULL);

  /* what NCCL must never hand over, and what it may: none of it may count or fault */
  int local = 0;
  void* heap = malloc(64);
  memset(heap, 0x5A, 64);
  void* bogus[] = {NULL, (void*)1, &local, heap, (void*)(uintptr_t)0xA1000000ULL, (void*)(uintptr_t)0xFFFFFFF0A1000005ULL, (void*)(uintptr_t)~0ULL};
  rs_nccl_state_args args;
  memset(&args, 0, sizeof(args));
  args.proxyStep.transSize = 4096;
  for (size_t i = 0; i < sizeof(bogus) / sizeof(bogus[0]); i++) {
    P->stopEvent(bogus[i]);
    P->recordEventState(bogus[i], RS_ST_STEP_SEND_WAIT, &args);
    P->recordEventState(bogus[i], RS_ST_STEP_RECV_FLUSH_WAIT, NULL);
    expect_refused(child(a, RS_EV_PROXY_OP, bogus[i], 1, 2), "a proxy op under a bogus parent");
    expect_refused(child(a, RS_EV_PROXY_STEP, bogus[i], 1, -1), "a step under a bogus parent");
    expect_refused(kernel_ch(b, bogus[i], 0, 1), "a kernel channel under a bogus parent");
    expect_refused(task(bogus[i], RS_EV_COLL, "AllReduce", 0, 1, "ncclInt8", -1, 1), "a bogus context");
    if (bogus[i]) P->finalize(bogus[i]);
  }
  free(heap);
  P->finalize(NULL);
  expect_refused(child(a, RS_EV_PROXY_OP, first, 1, 2), "a proxy op under a stale parent");
  void* h = (void*)1;
  P->startEvent(a, NULL, NULL);
  if (P4) P4->startEvent(a, &h, NULL);
  else if (P6) P6->startEvent(a, &h, NULL);
  else P->startEvent(a, &h, NULL);
  expect_refused(h, "a NULL descriptor");
  /* a Broadcast whose proxy op comes from another process (PXN): its parentObj means nothing here */
  void* bc = task(a, RS_EV_COLL, "Broadcast", 0, 8, "ncclInt8", -1, 1);
  P->stopEvent(bc);
  rs_nccl_descr_v5 pxn;
  memset(&pxn, 0, sizeof(pxn));
  pxn.type = RS_EV_PROXY_OP;
  pxn.parentObj = bc;
  pxn.u.proxyOp.pid = getpid() + 1;
  pxn.u.proxyOp.isSend = 1;
  expect_refused(start(a, pxn), "a PXN proxy op from another process");
  expect_refused(child(a, RS_EV_PROXY_STEP, bc, 1, -1), "a step whose parent is a collective");
  P->stopEvent(bc); /* stopped twice */

  if (P6) { /* NCCL >= 2.29: a collective on copy engines, started and stopped by the host, no children */
    rs_nccl_descr_v6 ce;
    memset(&ce, 0, sizeof(ce));
    ce.type = RS_EV_CE_COLL;
    ce.u.ceColl.func = "AlltoAll";
    ce.u.ceColl.count = 32;
    ce.u.ceColl.datatype = "ncclFloat32";
    void* hc = NULL;
    P6->startEvent(b, &hc, &ce);
    if (!hc) {
      fprintf(stderr, "the plugin refused a copy-engine collective\n");
      failures++;
    }
    P->stopEvent(hc);
  }

  /* the hang: an AllReduce and a Recv whose receives never arrive (posted, never flushed or stopped) */
  void* stuck = task(a, RS_EV_COLL, "AllReduce", (uint64_t)rounds, 1024, "ncclFloat32", -1, 1);
  P->stopEvent(stuck);
  void* stuck_op = child(a, RS_EV_PROXY_OP, stuck, 0, 0);
  void* stuck_step = child(a, RS_EV_PROXY_STEP, stuck_op, 0, -1);
  state(stuck_step, RS_ST_STEP_RECV_WAIT, 1 << 16);
  void* rv = task(a, RS_EV_P2P, "Recv", 0, 256, "ncclInt8", 3, 1);
  P->stopEvent(rv);
  void* rv_op = child(a, RS_EV_PROXY_OP, rv, 0, 3);
  void* rv_step = child(a, RS_EV_PROXY_STEP, rv_op, 0, -1);
  state(rv_step, RS_ST_STEP_RECV_WAIT, 256);
  if (!stuck_step || !rv_step) {
    fprintf(stderr, "the plugin refused a live parent\n");
    failures++;
  }
  if (failures) return 3;
  printf("replayed\n");
  fflush(stdout);
  P->finalize(a);
  P->finalize(b);
  return 0;
}
