/* Drives the rankscope NCCL profiler plugin the way NCCL does, with no NCCL.
 *
 *   harness LIB counts  : a scripted set of collectives, p2p and proxy steps
 *                         (see tests/integration/test_ccl_nccl_plugin.py for the expected
 *                         counters), prints "ready", waits for a line on stdin
 *                         so a reader can check the live file, then finalizes;
 *   harness LIB bench N : N rounds of one collective (its kernel channel, one proxy op
 *                         with one step) in NCCL's order, prints the cost per plugin call in ns.
 * RS_HARNESS_ABI=4 (or 6) drives the ncclProfiler_v4 (v6) entry points instead of v5.
 * Order of calls per NCCL: init per communicator; Coll/P2p start; ProxyOp
 * start (parent: the Coll/P2p); ProxyStep start (parent: the ProxyOp), its
 * state transitions, stop; ProxyOp stop; Coll/P2p stop; finalize. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness_common.h"

/* one network step: request, (flush for receives), completion */
static void step(void* ctx, void* op, int is_send, size_t trans, int finish) {
  void* s = child(ctx, RS_EV_PROXY_STEP, op, is_send, -1);
  state(s, is_send ? RS_ST_STEP_SEND_WAIT : RS_ST_STEP_RECV_WAIT, trans);
  if (!finish) return; /* left open: a request stuck on the wire */
  if (!is_send) state(s, RS_ST_STEP_RECV_FLUSH_WAIT, trans);
  P->stopEvent(s);
}

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s LIB counts|bench [N]\n", argv[0]);
    return 2;
  }
  int rc = load_plugin(argv[1]);
  if (rc) return rc;
  void *net = NULL, *local = NULL;
  int mask = 0;
  init(&net, 0xA1A1ULL, &mask, "PIPELINE_MODEL_PARALLEL_GROUP", 2, 4, 1);
  if (!net || !(mask & RS_EV_PROXY_STEP)) {
    fprintf(stderr, "init gave no context / mask %d\n", mask);
    return 1;
  }
  init(&local, 0xB2B2ULL, &mask, "TENSOR_MODEL_PARALLEL_GROUP", 1, 2, 0);
  if (strcmp(argv[2], "bench") == 0) {
    long n = argc > 3 ? atol(argv[3]) : 1000000;
    double t0 = now_ns();
    for (long i = 0; i < n; i++) { /* NCCL's order: the host stops the task before its proxy work starts */
      void* c = coll(net, "AllReduce", (uint64_t)i, 1024);
      P->stopEvent(c);
      void* k = child(net, RS_EV_KERNEL_CH, c, 0, -1);
      void* op = child(net, RS_EV_PROXY_OP, c, 1, 2);
      void* s = child(net, RS_EV_PROXY_STEP, op, 1, -1);
      state(s, RS_ST_STEP_SEND_WAIT, 4096);
      P->stopEvent(s);
      P->stopEvent(op);
      P->recordEventState(k, RS_ST_KERNEL_CH_STOP, NULL);
      P->stopEvent(k);
    }
    double per = (now_ns() - t0) / ((double)n * 10.0); /* 10 plugin calls per round */
    printf("ns_per_call %.1f\n", per);
    P->finalize(net);
    P->finalize(local);
    return 0;
  }
  /* comm A (two nodes): 5 AllReduce, each a send and a receive op of two steps */
  for (int i = 1; i <= 5; i++) {
    void* c = coll(net, "AllReduce", (uint64_t)i - 1, 1024); /* NCCL's seqNumber counts from 0 */
    for (int is_send = 0; is_send < 2; is_send++) {
      void* op = child(net, RS_EV_PROXY_OP, c, is_send, is_send ? 2 : 0);
      step(net, op, is_send, 1 << 20, 1);
      step(net, op, is_send, 1 << 20, 1);
      P->stopEvent(op);
    }
    P->stopEvent(c);
  }
  /* a sixth AllReduce whose receive never arrives */
  void* stuck = coll(net, "AllReduce", 5, 1024);
  void* stuck_op = child(net, RS_EV_PROXY_OP, stuck, 0, 0);
  step(net, stuck_op, 0, 1 << 20, 0);
  /* p2p: three sends to rank 2, one receive from rank 3 left open */
  for (int i = 0; i < 3; i++) {
    void* s = p2p(net, "Send", 2, 256);
    void* op = child(net, RS_EV_PROXY_OP, s, 1, 2);
    step(net, op, 1, 256, 1);
    P->stopEvent(op);
    P->stopEvent(s);
  }
  void* r = p2p(net, "Recv", 3, 256);
  void* rop = child(net, RS_EV_PROXY_OP, r, 0, 3);
  step(net, rop, 0, 256, 0);
  /* comm B (one node): two AllGather over two kernel channels each */
  for (int i = 1; i <= 2; i++) {
    void* c = coll(local, "AllGather", (uint64_t)i - 1, 64);
    for (int ch = 0; ch < 2; ch++) {
      void* k = child(local, RS_EV_KERNEL_CH, c, 0, -1);
      P->recordEventState(k, RS_ST_KERNEL_CH_STOP, NULL);
      P->stopEvent(k);
    }
    P->stopEvent(c);
  }
  printf("ready\n");
  fflush(stdout);
  char line[16];
  if (!fgets(line, sizeof(line), stdin)) return 1;
  P->finalize(net);
  P->finalize(local);
  printf("finalized\n");
  return 0;
}
