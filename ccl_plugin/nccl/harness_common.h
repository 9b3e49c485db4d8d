/* What both C drivers of the plugin share (harness.c, replay.c): loading it through dlopen/dlsym as NCCL
 * does, picking the interface version (RS_HARNESS_ABI=4, 5 (default) or 6) and building the descriptors
 * each version hands over. Included once per program. */
#ifndef RANKSCOPE_HARNESS_COMMON_H
#define RANKSCOPE_HARNESS_COMMON_H
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nccl_profiler_abi.h"

#define RS_UNUSED __attribute__((unused)) /* each driver uses its own subset */

static rs_nccl_profiler_v5* P;
static rs_nccl_profiler_v4* P4; /* set when driving the v4 entry points */
static rs_nccl_profiler_v6* P6; /* set when driving the v6 entry points */

RS_UNUSED static void* start(void* ctx, rs_nccl_descr_v5 d) {
  void* h = NULL;
  if (P4) { /* what an older NCCL hands over: the v4 union behind a one-byte type */
    rs_nccl_descr_v4 d4;
    memset(&d4, 0xAB, sizeof(d4)); /* garbage in the padding, as a real caller may leave */
    d4.type = (uint8_t)d.type;
    d4.parentObj = d.parentObj;
    d4.rank = d.rank;
    if (d.type == RS_EV_COLL) {
      d4.u.coll.seqNumber = d.u.coll.seqNumber;
      d4.u.coll.func = d.u.coll.func;
      d4.u.coll.count = d.u.coll.count;
      d4.u.coll.datatype = d.u.coll.datatype;
      d4.u.coll.nChannels = d.u.coll.nChannels;
    } else if (d.type == RS_EV_P2P) {
      d4.u.p2p.func = d.u.p2p.func;
      d4.u.p2p.count = d.u.p2p.count;
      d4.u.p2p.datatype = d.u.p2p.datatype;
      d4.u.p2p.peer = d.u.p2p.peer;
      d4.u.p2p.nChannels = d.u.p2p.nChannels;
    } else if (d.type == RS_EV_PROXY_OP) {
      d4.u.proxyOp.pid = d.u.proxyOp.pid;
      d4.u.proxyOp.peer = d.u.proxyOp.peer;
      d4.u.proxyOp.isSend = d.u.proxyOp.isSend;
    } else if (d.type == RS_EV_KERNEL_CH) {
      d4.u.kernelCh.channelId = d.u.kernelCh.channelId;
      d4.u.kernelCh.pTimer = d.u.kernelCh.pTimer;
    }
    P4->startEvent(ctx, &h, &d4);
  } else if (P6) { /* the v5 members sit at the same offsets of the larger v6 union */
    rs_nccl_descr_v6 d6;
    memset(&d6, 0xAB, sizeof(d6));
    d6.type = d.type;
    d6.parentObj = d.parentObj;
    d6.rank = d.rank;
    memcpy(&d6.u, &d.u, sizeof(d.u));
    P6->startEvent(ctx, &h, &d6);
  } else {
    P->startEvent(ctx, &h, &d);
  }
  return h;
}

/* NCCL's logger, as the plugin sees it: one line on stderr per message */
static void nccl_log(int level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags, (void)file, (void)line;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "NCCL %s ", level == 2 ? "WARN" : "INFO");
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

RS_UNUSED static void init(void** ctx, uint64_t id, int* mask, const char* name, int nNodes, int nranks, int rank) {
  if (P4) P4->init(ctx, mask, name, id, nNodes, nranks, rank, nccl_log);
  else P->init(ctx, id, mask, name, nNodes, nranks, rank, nccl_log);
}

RS_UNUSED static void* coll(void* ctx, const char* func, uint64_t seq, size_t count) {
  rs_nccl_descr_v5 d;
  memset(&d, 0, sizeof(d));
  d.type = RS_EV_COLL;
  d.u.coll.func = func;
  d.u.coll.seqNumber = seq;
  d.u.coll.count = count;
  d.u.coll.datatype = "ncclFloat32";
  return start(ctx, d);
}

RS_UNUSED static void* p2p(void* ctx, const char* func, int peer, size_t count) {
  rs_nccl_descr_v5 d;
  memset(&d, 0, sizeof(d));
  d.type = RS_EV_P2P;
  d.u.p2p.func = func;
  d.u.p2p.peer = peer;
  d.u.p2p.count = count;
  d.u.p2p.datatype = "ncclInt8";
  return start(ctx, d);
}

RS_UNUSED static void* child(void* ctx, uint64_t type, void* parent, int is_send, int peer) {
  rs_nccl_descr_v5 d;
  memset(&d, 0, sizeof(d));
  d.type = type;
  d.parentObj = parent;
  if (type == RS_EV_PROXY_OP) {
    d.u.proxyOp.pid = getpid();
    d.u.proxyOp.isSend = is_send;
    d.u.proxyOp.peer = peer;
  }
  return start(ctx, d);
}

RS_UNUSED static void state(void* h, int st, size_t trans) {
  rs_nccl_state_args a;
  memset(&a, 0, sizeof(a));
  a.proxyStep.transSize = trans;
  P->recordEventState(h, st, &a);
}

/* dlopen LIB and pick the table RS_HARNESS_ABI names; 0 on success, 2 with a message otherwise */
static int load_plugin(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  const char* version = getenv("RS_HARNESS_ABI");
  P = (rs_nccl_profiler_v5*)dlsym(lib, "ncclProfiler_v5");
  if (version && strcmp(version, "4") == 0) {
    P4 = (rs_nccl_profiler_v4*)dlsym(lib, "ncclProfiler_v4");
    /* stop/state/finalize have the same signatures in every version */
    P = P4 ? (rs_nccl_profiler_v5*)P4 : NULL;
  } else if (version && strcmp(version, "6") == 0) {
    P6 = (rs_nccl_profiler_v6*)dlsym(lib, "ncclProfiler_v6");
    P = P6 ? (rs_nccl_profiler_v5*)P6 : NULL;
  }
  if (!P) {
    fprintf(stderr, "no ncclProfiler_v%s symbol\n", version ? version : "5");
    return 2;
  }
  return 0;
}

#endif
