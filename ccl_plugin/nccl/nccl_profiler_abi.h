/* The NCCL profiler plugin ABI, interface versions 6, 5 and 4, declared here in our own words so the
 * plugin builds with no NCCL headers present. Read from NVIDIA/nccl v2.30.7 (the plugin headers under
 * src/include/plugin/profiler/, the version adapters in src/plugin/profiler/ and plugins/profiler/README.md).
 *
 * What NCCL does with these (2.28 to 2.30):
 * - it dlsyms ncclProfiler_v6 first (NCCL >= 2.29), then v5 (2.28 loads v5 first), then v4 (2.27), and
 *   adapts every event to the version it found: a newer NCCL calls a v5 table with v5 descriptors;
 * - init's eActivationMask is ONE process-wide mask: the last communicator's init wins for all of them;
 * - handles are opaque to NCCL: it only hands them back (stop, state, and as a child's parentObj);
 * - Coll/P2p: parentObj is the CollApi/P2pApi handle (v5+; NULL when those are not subscribed), the Group
 *   handle sits in coll.parentGroup / p2p.parentGroup; v4 gets the Group as parentObj;
 * - ProxyOp: parentObj is the Coll/P2p handle, started by a proxy thread AFTER the host stopped the Coll/P2p
 *   (the host starts the task, posts the proxy ops, stops the task at once); proxyOp.pid is the pid of the
 *   process that started the task: with PXN it is another process and parentObj is that process's pointer;
 * - ProxyStep: parentObj is the ProxyOp handle; states SendGPUWait, SendPeerWait_v4, SendWait (isend
 *   posted), stop (send completed); RecvWait (irecv posted), RecvFlushWait (data arrived), RecvGPUWait, stop;
 * - KernelCh: parentObj is the Coll/P2p handle, started and stopped by the proxy thread when the GPU
 *   channel's work starts and ends; the stop is recorded as state KernelChStop (pTimer: GPU globaltimer ns)
 *   right before stopEvent. */
#ifndef RANKSCOPE_NCCL_PROFILER_ABI_H
#define RANKSCOPE_NCCL_PROFILER_ABI_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef int ncclResult_t; /* ncclSuccess == 0; a profiler must always return it */
#define RS_NCCL_SUCCESS 0
typedef void (*ncclDebugLogger_t)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);

/* event type bits (descriptor .type and the activation mask) */
#define RS_EV_GROUP (1 << 0)
#define RS_EV_COLL (1 << 1)
#define RS_EV_P2P (1 << 2)
#define RS_EV_PROXY_OP (1 << 3)
#define RS_EV_PROXY_STEP (1 << 4)
#define RS_EV_PROXY_CTRL (1 << 5)
#define RS_EV_KERNEL_CH (1 << 6)
#define RS_EV_NET_PLUGIN (1 << 7)
#define RS_EV_GROUP_API (1 << 8)
#define RS_EV_COLL_API (1 << 9)
#define RS_EV_P2P_API (1 << 10)
#define RS_EV_KERNEL_LAUNCH (1 << 11)
#define RS_EV_CE_COLL (1 << 12) /* v6 */
#define RS_EV_CE_SYNC (1 << 13)
#define RS_EV_CE_BATCH (1 << 14)

/* event states (one numbering for every version) */
#define RS_ST_STEP_SEND_GPU_WAIT 8
#define RS_ST_STEP_SEND_WAIT 9
#define RS_ST_STEP_RECV_WAIT 10
#define RS_ST_STEP_RECV_FLUSH_WAIT 11
#define RS_ST_STEP_RECV_GPU_WAIT 12
#define RS_ST_PROXY_OP_IN_PROGRESS_V4 19
#define RS_ST_STEP_SEND_PEER_WAIT_V4 20
#define RS_ST_KERNEL_CH_STOP 22
typedef int rs_nccl_state_t;

/* Union members of the v5 descriptor, in NCCL's order. v6 appends the CE members; every member starts at
 * the union's start, so the members v5 and v6 share have the same offsets. */
#define RS_NCCL_DESCR_V5_MEMBERS                                                                                    \
  struct { bool graphCaptured; int groupDepth; } groupApi;                                                          \
  struct { const char* func; size_t count; const char* datatype; int root; void* stream; bool graphCaptured; }      \
      collApi;                                                                                                      \
  struct { const char* func; size_t count; const char* datatype; void* stream; bool graphCaptured; } p2pApi;        \
  struct { void* stream; } kernelLaunch;                                                                            \
  struct {                                                                                                          \
    uint64_t seqNumber; const char* func; const void* sendBuff; void* recvBuff; size_t count; int root;             \
    const char* datatype; uint8_t nChannels; uint8_t nWarps; const char* algo; const char* proto;                   \
    void* parentGroup;                                                                                              \
  } coll;                                                                                                           \
  struct {                                                                                                          \
    const char* func; void* buff; const char* datatype; size_t count; int peer; uint8_t nChannels;                  \
    void* parentGroup;                                                                                              \
  } p2p;                                                                                                            \
  struct { pid_t pid; uint8_t channelId; int peer; int nSteps; int chunkSize; int isSend; } proxyOp;                \
  struct { int step; } proxyStep;                                                                                   \
  struct { uint8_t channelId; uint64_t pTimer; } kernelCh;                                                          \
  struct { int64_t id; void* data; } netPlugin;

typedef union { RS_NCCL_DESCR_V5_MEMBERS } rs_nccl_descr_union_v5;

typedef union {
  RS_NCCL_DESCR_V5_MEMBERS
  struct {
    uint64_t seqNumber; const char* func; const void* sendBuff; void* recvBuff; size_t count; int root;
    const char* datatype; const char* syncStrategy; bool intraBatchSync; uint32_t batchSize; uint32_t numBatches;
    uint32_t ceSeqNum; void* stream;
  } ceColl;
  struct { bool isComplete; int nRanks; } ceCollSync;
  struct { int numOps; size_t totalBytes; bool useIntraSync; } ceCollBatch;
} rs_nccl_descr_union_v6;

/* v4: no *Api / kernelLaunch members and no parentGroup; the Group handle is parentObj */
typedef union {
  struct {
    uint64_t seqNumber; const char* func; const void* sendBuff; void* recvBuff; size_t count; int root;
    const char* datatype; uint8_t nChannels; uint8_t nWarps; const char* algo; const char* proto;
  } coll;
  struct { const char* func; void* buff; const char* datatype; size_t count; int peer; uint8_t nChannels; } p2p;
  struct { pid_t pid; uint8_t channelId; int peer; int nSteps; int chunkSize; int isSend; } proxyOp;
  struct { int step; } proxyStep;
  struct { uint8_t channelId; uint64_t pTimer; } kernelCh;
  struct { int64_t id; void* data; } netPlugin;
} rs_nccl_descr_union_v4;

typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  rs_nccl_descr_union_v6 u;
} rs_nccl_descr_v6;

typedef struct {
  uint64_t type;
  void* parentObj;
  int rank;
  rs_nccl_descr_union_v5 u;
} rs_nccl_descr_v5;

typedef struct {
  uint8_t type; /* v4: one byte, then padding up to parentObj */
  void* parentObj;
  int rank;
  rs_nccl_descr_union_v4 u;
} rs_nccl_descr_v4;

/* state arguments: the same union in v4, v5 and v6 */
typedef union {
  struct { size_t transSize; } proxyStep;
  struct { int appendedProxyOps; } proxyCtrl;
  struct { void* data; } netPlugin;
  struct { uint64_t pTimer; } kernelCh;
} rs_nccl_state_args;

typedef ncclResult_t (*rs_nccl_stop_fn)(void* eHandle);
typedef ncclResult_t (*rs_nccl_state_fn)(void* eHandle, rs_nccl_state_t eState, rs_nccl_state_args* eStateArgs);
typedef ncclResult_t (*rs_nccl_finalize_fn)(void* context);
typedef ncclResult_t (*rs_nccl_init_v5_fn)(void** context, uint64_t commId, int* eActivationMask, const char* commName,
                                           int nNodes, int nranks, int rank, ncclDebugLogger_t logfn);

typedef struct {
  const char* name;
  rs_nccl_init_v5_fn init; /* v6 keeps v5's init */
  ncclResult_t (*startEvent)(void* context, void** eHandle, rs_nccl_descr_v6* eDescr);
  rs_nccl_stop_fn stopEvent;
  rs_nccl_state_fn recordEventState;
  rs_nccl_finalize_fn finalize;
} rs_nccl_profiler_v6;

typedef struct {
  const char* name;
  rs_nccl_init_v5_fn init;
  ncclResult_t (*startEvent)(void* context, void** eHandle, rs_nccl_descr_v5* eDescr);
  rs_nccl_stop_fn stopEvent;
  rs_nccl_state_fn recordEventState;
  rs_nccl_finalize_fn finalize;
} rs_nccl_profiler_v5;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** context, int* eActivationMask, const char* commName, uint64_t commHash, int nNodes,
                       int nranks, int rank, ncclDebugLogger_t logfn);
  ncclResult_t (*startEvent)(void* context, void** eHandle, rs_nccl_descr_v4* eDescr);
  rs_nccl_stop_fn stopEvent;
  rs_nccl_state_fn recordEventState;
  rs_nccl_finalize_fn finalize;
} rs_nccl_profiler_v4;

#endif
