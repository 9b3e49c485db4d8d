/* Generated from rankscope/ccl_plugin/layout.py by c_header(); do not edit.
 * tests/integration/test_ccl_layout.py checks this file matches the Python layout.
 * Seqlock: writer makes seq odd, stores fields, makes seq even; readers retry
 * while seq is odd or changed across their copy. */
#ifndef RANKSCOPE_LAYOUT_H
#define RANKSCOPE_LAYOUT_H
#include <stdint.h>

#define RS_MAGIC "RSCCLCTR"
#define RS_VERSION 2
#define RS_JOB_ID_LEN 64
#define RS_COMM_ID_LEN 64
#define RS_BACKEND_LEN 16
#define RS_DESC_LEN 88
#define RS_OP_NAME_LEN 32
#define RS_RING_LEN 5
#define RS_MAX_OPEN_PEERS 8
#define RS_MAX_COMMS 128
#define RS_MAX_OPS 512
#define RS_MEMBER_POOL 65536
#define RS_WRITER_PYTHON 1
#define RS_WRITER_NCCL 2
#define RS_FLAG_CLEAN_EXIT 1
#define RS_HEADER_SIZE 256
#define RS_COMM_SIZE 192
#define RS_OP_SIZE 208
#define RS_COMM_TABLE_OFFSET 256
#define RS_OP_TABLE_OFFSET 24832
#define RS_MEMBER_POOL_OFFSET 131328
#define RS_FILE_SIZE 393472
#define RS_ENV_ENABLE "RANKSCOPE_CCL"
#define RS_ENV_DIR "RANKSCOPE_CCL_DIR"
#define RS_ENV_JOB_ID "RANKSCOPE_JOB_ID"
#define RS_DEFAULT_DIR "/dev/shm/rankscope"

typedef struct rs_header {
  char magic[8];
  uint32_t version;
  uint32_t header_size;
  uint64_t file_size;
  uint64_t seq;
  int64_t pid;
  uint64_t pid_start_ticks;
  int32_t rank;
  int32_t world_size;
  uint32_t writer_kind;
  uint32_t flags;
  double created_wall;
  double heartbeat_wall;
  uint64_t steps;
  double last_step_duration;
  double last_step_wall;
  uint32_t n_comms;
  uint32_t n_ops;
  uint32_t max_comms;
  uint32_t max_ops;
  uint32_t member_pool_size;
  uint32_t members_used;
  uint64_t comm_table_offset;
  uint64_t op_table_offset;
  uint64_t member_pool_offset;
  char job_id[64];
  char reserved[40];
} rs_header;
_Static_assert(sizeof(rs_header) == 256, "rs_header size differs from layout.py");

typedef struct rs_comm {
  uint64_t seq;
  uint32_t member_offset;
  uint32_t n_members;
  char comm_id[64];
  char backend[16];
  char description[88];
  int32_t comm_nranks;
  int32_t comm_rank;
} rs_comm;
_Static_assert(sizeof(rs_comm) == 192, "rs_comm size differs from layout.py");

typedef struct rs_op {
  uint64_t seq;
  uint32_t comm_index;
  uint32_t reserved0;
  char op[32];
  uint64_t cl;
  uint64_t wr;
  uint64_t wc;
  uint64_t last_launched_seq;
  uint64_t last_completed_seq;
  uint64_t bytes_total;
  double last_duration;
  double last_launch_wall;
  double last_complete_wall;
  double ring[5];
  uint32_t ring_next;
  uint32_t ring_count;
  uint32_t n_open_peers;
  uint32_t reserved1;
  int32_t open_peers[8];
} rs_op;
_Static_assert(sizeof(rs_op) == 208, "rs_op size differs from layout.py");

#endif
