/* A profiler plugin that does nothing: the baseline benchmarks/bench_plugin.py times the rankscope plugin
 * against (what NCCL's call through a plugin table costs by itself, through the same harness). */
#include "nccl_profiler_abi.h"

#define EXPORT __attribute__((visibility("default")))

static int context_token, event_token;

static ncclResult_t noop_init(void** context, uint64_t commId, int* mask, const char* commName, int nNodes,
                              int nranks, int rank, ncclDebugLogger_t logfn) {
  (void)commId, (void)commName, (void)nNodes, (void)nranks, (void)rank, (void)logfn;
  *context = &context_token;
  *mask = RS_EV_COLL | RS_EV_P2P | RS_EV_PROXY_OP | RS_EV_PROXY_STEP | RS_EV_KERNEL_CH;
  return RS_NCCL_SUCCESS;
}
static ncclResult_t noop_start(void* context, void** handle, rs_nccl_descr_v5* d) {
  (void)context, (void)d;
  *handle = &event_token;
  return RS_NCCL_SUCCESS;
}
static ncclResult_t noop_stop(void* handle) {
  (void)handle;
  return RS_NCCL_SUCCESS;
}
static ncclResult_t noop_state(void* handle, rs_nccl_state_t state, rs_nccl_state_args* args) {
  (void)handle, (void)state, (void)args;
  return RS_NCCL_SUCCESS;
}
static ncclResult_t noop_finalize(void* context) {
  (void)context;
  return RS_NCCL_SUCCESS;
}

EXPORT rs_nccl_profiler_v5 ncclProfiler_v5 = {"noop", noop_init, noop_start, noop_stop, noop_state, noop_finalize};
