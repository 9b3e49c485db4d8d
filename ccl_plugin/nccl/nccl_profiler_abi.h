/* The NCCL profiler plugin ABI (interface versions 5 and 4), declared from NVIDIA's
 * documented layout (ext-profiler/README and the v5 interface description) so
 * the plugin builds with no NCCL headers or sources present. Only what the
 * rankscope plugin reads is named; field order and types follow the ABI. */
#ifndef RANKSCOPE_NCCL_PROFILER_ABI_H
#define RANKSCOPE_NCCL_PROFILER_ABI_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef int ncclResult_t; /* ncclSuccess == 0 */
#define RS_NCCL_SUCCESS 0
typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);

/* event type bits */
#define RS_EV_GROUP (1 << 0)
#define RS_EV_COLL (1 << 1)
#define RS_EV_P2P (1 << 2)
#define RS_EV_PROXY_OP (1 << 3)
#define RS_EV_PROXY_STEP (1 << 4)
#define RS_EV_PROXY_CTRL (1 << 5)
#define RS_EV_KERNEL_CH (1 << 6)

/* event states used here */
#define RS_ST_STEP_SEND_GPU_WAIT 8
#define RS_ST_STEP_SEND_WAIT 9
#define RS_ST_STEP_RECV_WAIT 10
#define RS_ST_STEP_RECV_FLUSH_WAIT 11
#define RS_ST_STEP_RECV_GPU_WAIT 12
#define RS_ST_KERNEL_CH_STOP 22
typedef int rs_nccl_state_t;

/* The descriptor's union: in v5 it gained the *Api / kernelLaunch members and
 * a trailing parentGroup in coll and p2p; every member starts at the union's
 * start and keeps its v4 field order, so one declaration reads both. */
typedef union {
    struct { int graphCaptured; int groupDepth; } groupApi;
    struct { const char* func; size_t count; const char* datatype; int root; void* stream; bool graphCaptured; } collApi;
    struct { const char* func; size_t count; const char* datatype; void* stream; bool graphCaptured; } p2pApi;
    struct { void* stream; } kernelLaunch;
    struct {
      uint64_t seqNumber; const char* func; const void* sendBuff; void* recvBuff; size_t count; int root;
      const char* datatype; uint8_t nChannels; uint8_t nWarps; const char* algo; const char* proto; void* parentGroup;
    } coll;
    struct { const char* func; void* buff; const char* datatype; size_t count; int peer; uint8_t nChannels; void* parentGroup; } p2p;
    struct { pid_t pid; uint8_t channelId; int peer; int nSteps; int chunkSize; int isSend; } proxyOp;
    struct { int step; } proxyStep;
    struct { uint8_t channelId; uint64_t pTimer; } kernelCh;
    struct { int64_t id; void* data; } netPlugin;
} rs_nccl_descr_union;

typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  rs_nccl_descr_union u;
} rs_nccl_descr_v5;

typedef struct {
  uint8_t type; /* v4: one byte, then padding up to parentObj */
  void* parentObj;
  int rank;
  rs_nccl_descr_union u;
} rs_nccl_descr_v4;

typedef union {
  struct { size_t transSize; } proxyStep;
  struct { int appendedProxyOps; } proxyCtrl;
  struct { void* data; } netPlugin;
  struct { uint64_t pTimer; } kernelCh;
} rs_nccl_state_args_v5;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** context, uint64_t commId, int* eActivationMask, const char* commName, int nNodes,
                       int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, rs_nccl_descr_v5* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, rs_nccl_state_t eState, rs_nccl_state_args_v5* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} rs_nccl_profiler_v5;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** context, int* eActivationMask, const char* commName, uint64_t commHash, int nNodes,
                       int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, rs_nccl_descr_v4* eDescr);
  ncclResult_t (*stopEvent)(void* eHandle);
  ncclResult_t (*recordEventState)(void* eHandle, rs_nccl_state_t eState, rs_nccl_state_args_v5* eStateArgs);
  ncclResult_t (*finalize)(void* context);
} rs_nccl_profiler_v4;

#endif
