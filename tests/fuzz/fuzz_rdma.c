/*
 * Fuzz target: the RDMA transport's connection private data, which arrives
 * from any peer that can reach the rdma_cm port: the reader's connect
 * request (HELLO: name, expected incarnation, access token; or a producer's
 * write hello: its incarnation and token; or a stage hello) as the target
 * parses it, the accept and reject data as the reader parses them, and the
 * staged-RDMA messages of a stage QP (requests at the target, replies at
 * the reader).
 * Built only when the RDMA transport is (agent/transport/rdma/rdma.c exists).
 */
#include <stdlib.h>
#include <string.h>

#include "transport/rdma/rdma_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  sx__rdma_hello h;
  memset(&h, 0, sizeof(h));
  int rc = sx__rdma_hello_parse(data, size, &h);
  if (rc == 0) {
    /* The name goes into logs: it must be a terminated string. */
    if (memchr(h.name, '\0', sizeof(h.name)) == NULL)
      abort();
    /* What parses packs back to the same fields. */
    sx__rdma_hello_wire w;
    sx__rdma_hello back;
    if (h.flags & SX__RDMA_HELLO_WRITE) /* a producer's (push mode) */
      sx__rdma_whello_pack(&w, h.conn_index, h.incarnation, h.producer, h.token);
    else
      sx__rdma_hello_pack(&w, h.name, h.conn_index, h.incarnation, h.token);
    if (h.flags & SX__RDMA_HELLO_STAGE) /* a stage QP, a reader's or a producer's */
      w.flags |= SX__RDMA_HELLO_STAGE;
    if (sx__rdma_hello_parse(&w, sizeof(w), &back) != 0 || back.flags != h.flags ||
        back.conn_index != h.conn_index ||
        memcmp(back.producer, h.producer, SX_INCARNATION_LEN) != 0 ||
        memcmp(back.incarnation, h.incarnation, SX_INCARNATION_LEN) != 0 ||
        memcmp(back.token, h.token, SX_TOKEN_LEN) != 0)
      abort();
  } else if (rc != SX_EPROTO && rc != SX_EVERSION) {
    abort();
  }
  /* A stage request (a read's, or a staged write's): what parses stays
   * inside a slot, a write's slot holds exactly its ranges, and it packs
   * back to the same length. */
  for (int write = 0; write < 2; write++) {
    static sx__rdma_sreq q;
    char msg[160];
    rc = sx__rdma_sreq_parse(data, size, write, &q, msg, sizeof(msg));
    if (rc == 0) {
      uint64_t total = 0;
      uint8_t back[SX__RDMA_SMSG_BYTES];
      for (uint16_t i = 0; i < q.n; i++)
        total += q.r[i].len;
      if (q.slot >= SX__RDMA_STAGE_SLOTS || q.n == 0 || q.n > SX__RDMA_STAGE_MAX_RANGES ||
          total > SX__RDMA_STAGE_SLOT_BYTES || q.write != write ||
          (write && total != q.src.bytes) || sx__rdma_sreq_pack(back, &q) != size)
        abort();
    } else if (rc != SX_EPROTO || memchr(msg, '\0', sizeof(msg)) == NULL) {
      abort();
    }
  }
  uint8_t slot;
  uint32_t seq, rkey, bytes;
  uint64_t addr;
  int st;
  if (sx__rdma_sreply_parse(data, size, &slot, &seq, &st, &addr, &rkey, &bytes) == 0 &&
      (slot >= SX__RDMA_STAGE_SLOTS || st > 0 || bytes > SX__RDMA_STAGE_SLOT_BYTES))
    abort();
  uint8_t inc[SX_INCARNATION_LEN];
  (void)sx__rdma_accept_parse(data, size, inc);
  uint8_t reason = 0;
  if (sx__rdma_reject_parse(data, size, &reason) == 1) {
    (void)sx__rdma_reject_code(reason);
    if (sx__rdma_reject_text(reason) == NULL)
      abort();
  }
  return 0;
}
