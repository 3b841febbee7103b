/*
 * The TCP data-plane wire format.  Not installed.
 *
 * Every frame starts with one fixed 40-byte header; all integers are
 * big-endian (network order):
 *
 *   offset size  field
 *    0     4     magic     0x53584631 ("SXF1")
 *    4     1     version   1
 *    5     1     type      1 HELLO, 2 HELLO_REPLY, 3 READ, 4 READ_REPLY,
 *                          5 IPC, 6 IPC_REPLY (CUDA IPC handles, below)
 *    6     2     flags     0 (every other value is a protocol error)
 *    8     8     id        request id, echoed in the reply
 *   16     4     region    READ: region id in the target's descriptor
 *   20     4     status    replies: 0 or a negative SX_E* code (int32)
 *   24     8     offset    READ: byte offset in the region
 *   32     8     length    HELLO: body bytes that follow; READ: bytes asked;
 *                          READ_REPLY: payload bytes that follow (0 on error)
 *
 * A connection starts with HELLO (reader -> target), whose body is
 *
 *    0    16     incarnation the reader expects the target to have
 *   16    16     access token from the target's descriptor
 *   32     2     name length N (<= SX_NAME_MAX)
 *   34     N     the reader's segment name (printable ASCII, may be empty)
 *
 * answered by HELLO_REPLY with status 0, SX_ESTALE (another incarnation),
 * SX_EACCESS (bad token) or SX_EVERSION; on a failure the target closes.
 * Then the reader pipelines READs; the target answers each, in order, with a
 * READ_REPLY header followed by exactly `length` payload bytes.
 *
 * CUDA IPC handles (the cuda_ipc transport, docs/gpu.md) travel on this
 * connection after HELLO, never through the store.  IPC (reader -> target)
 * carries `length` bytes of big-endian u32 region ids (at most
 * SX__IPC_MAX_IDS): with id != 0 it asks for the handles of those regions,
 * answered by IPC_REPLY with the same id and one SX__IPC_RECORD-byte
 * record per region asked:
 *
 *    0     4     region    id
 *    4     4     status    0 or a negative SX_E* code (then the rest is 0)
 *    8     8     alloc     size of the CUDA allocation holding the region
 *   16     8     offset    of the region in that allocation
 *   24     8     base      the allocation's address in the target
 *   32    64     handle    cuIpcGetMemHandle() of the allocation
 *
 * A handle can write the whole allocation, so a record of an allocation
 * holding a writable region carries SX_EACCESS unless the connection passed
 * WAUTH (below) and a write grant covers it.
 *
 * An IPC_REPLY with id 0 comes unasked: the target wants the handles of
 * the regions listed (u32 ids) back, because they are being unregistered
 * or the write grant they were lent under was revoked;
 * the reader answers, once no copy reads them any more and it closed its
 * mappings of them, with an IPC of id 0 listing the same ids.
 *
 * Push mode (docs/push.md) adds, on a connection that said HELLO with the
 * producer's own segment name:
 *
 *   7 WAUTH         body (length 32): the producer's incarnation (16) and
 *                   its access token (16), checked against its descriptor
 *                   in the store and the target's write grants
 *   8 WAUTH_REPLY   status 0, SX_EACCESS (no grant, bad token, not
 *                   published) or a store error; a failure leaves the
 *                   connection open for reads
 *   9 WRITE         region, offset, length; `length` payload bytes follow
 *  10 WRITE_REPLY   status, sent once the payload landed (0) or was drained
 *                   untouched (SX_EACCESS, SX_EDENIED, SX_EBOUNDS, ...)
 *  11 NOTICE        body (length <= SX_NOTICE_MAX_BYTES): a WriteNotice
 *  12 NOTICE_REPLY  status: 0 once the target queued the notice
 *
 * Read notices (SX_BATCH_NOTIFY, docs/push.md) need no WAUTH: on any
 * connection past HELLO (which presented the target's incarnation and
 * token), once every READ_REPLY of the batch came in,
 *
 *  13 RNOTICE       body (length <= SX_NOTICE_MAX_BYTES): a WriteNotice of
 *                   kind 1 (read) naming the reader as it said in HELLO,
 *                   answered by NOTICE_REPLY
 *
 * A reader may gather ranges into one request (the target said it can:
 * HELLO_REPLY's `offset` has SX__FEAT_READV set; a target from before
 * sends 0 there, and a reader from before ignores it):
 *
 *  14 READV         body (length: n * SX__READV_ENTRY bytes, 1 <= n <=
 *                   SX__READV_MAX; region and offset 0): n ranges of
 *
 *                      0  4  region   id
 *                      4  4  zero
 *                      8  8  offset   in the region
 *                     16  8  length   bytes asked (> 0)
 *
 *                   answered by one READ_REPLY whose payload is the n
 *                   ranges' bytes in order (length their sum), or, when
 *                   the target refuses any of them, with that status, no
 *                   payload and `region` the index of the first range it
 *                   refused (a READ's refusal has 0 there)
 *
 * A READV's ranges are all of host memory, or (where the target also set
 * SX__FEAT_READV_GPU) all of GPU memory of one device, which its staging
 * sends; the target refuses with SX_EINVAL a range of other memory than
 * the first range's (and, before SX__FEAT_READV_GPU, any range of GPU
 * memory).
 *
 * Replies never carry a body.
 *
 * These are pure functions over byte buffers (no I/O, no allocation), so a
 * fuzz target can drive them directly.
 */
#ifndef SX_AGENT_TCP_FRAME_H
#define SX_AGENT_TCP_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/descriptor.h"

#define SX__FRAME_MAGIC 0x53584631u
#define SX__FRAME_VERSION 1
#define SX__FRAME_HDR 40
#define SX__HELLO_FIXED 34
#define SX__HELLO_MAX (SX__HELLO_FIXED + SX_NAME_MAX)

typedef enum sx__frame_type {
  SX__FRAME_HELLO = 1,
  SX__FRAME_HELLO_REPLY = 2,
  SX__FRAME_READ = 3,
  SX__FRAME_READ_REPLY = 4,
  SX__FRAME_IPC = 5,
  SX__FRAME_IPC_REPLY = 6,
  SX__FRAME_WAUTH = 7,
  SX__FRAME_WAUTH_REPLY = 8,
  SX__FRAME_WRITE = 9,
  SX__FRAME_WRITE_REPLY = 10,
  SX__FRAME_NOTICE = 11,
  SX__FRAME_NOTICE_REPLY = 12,
  SX__FRAME_RNOTICE = 13,
  SX__FRAME_READV = 14,
} sx__frame_type;

#define SX__FRAME_TYPE_MAX SX__FRAME_READV /* the highest type in use */

/* HELLO_REPLY's `offset` (status 0): what the target serves beyond the
 * frames every version does. */
#define SX__FEAT_READV 1u
#define SX__FEAT_READV_GPU 2u /* READVs of GPU memory (of one device) too */

#define SX__READV_MAX 16   /* ranges in one READV */
#define SX__READV_ENTRY 24 /* bytes per range in its body */

typedef struct sx__range {
  uint32_t region;
  uint64_t offset;
  uint64_t length;
} sx__range;

#define SX__IPC_MAX_IDS 1024 /* region ids in one IPC frame */
#define SX__IPC_RECORD 96    /* bytes per region in an IPC_REPLY */

#define SX__WAUTH_BODY (SX_INCARNATION_LEN + SX_TOKEN_LEN)

typedef struct sx__frame {
  uint8_t type;    /* sx__frame_type */
  uint64_t id;
  uint32_t region;
  int32_t status;
  uint64_t offset;
  uint64_t length;
} sx__frame;

typedef struct sx__hello {
  uint8_t incarnation[SX_INCARNATION_LEN];
  uint8_t token[SX_TOKEN_LEN];
  char name[SX_NAME_MAX + 1];
} sx__hello;

/* Write f's header (version SX__FRAME_VERSION, flags 0) into out. */
void sx__frame_encode(const sx__frame *f, uint8_t out[SX__FRAME_HDR]);

/*
 * Parse one header from the first len bytes of buf.  Returns SX__FRAME_HDR
 * when a whole valid header was read into *out, 0 when len is too short
 * (and the bytes so far begin a header: a wrong magic or version is
 * refused from its first byte on), SX_EPROTO for a bad magic, type, flags
 * or a field that breaks the type's
 * rules (HELLO body outside [SX__HELLO_FIXED, SX__HELLO_MAX], a request
 * carrying a status, a failed reply carrying payload, a positive status,
 * an IPC body that is no whole number of ids or records, or too long),
 * SX_EVERSION for another version.  *out is written only on success.
 */
int sx__frame_decode(const uint8_t *buf, size_t len, sx__frame *out);

/* 1 when the first len bytes (len > 0) do not begin with the frame magic:
 * a client of some other protocol, not a damaged frame. */
int sx__frame_foreign(const uint8_t *buf, size_t len);

/* Encode range r as READV body entry out. */
void sx__range_encode(const sx__range *r, uint8_t out[SX__READV_ENTRY]);
/* Parse READV body entry in: 0, or SX_EPROTO (the zero field is not 0, or
 * the length is 0). */
int sx__range_decode(const uint8_t in[SX__READV_ENTRY], sx__range *out);

/* Encode a HELLO body into out (SX__HELLO_MAX bytes suffice); returns its
 * length, or SX_ENAME when the name is too long. */
int sx__hello_encode(const sx__hello *h, uint8_t *out, size_t cap);

/* A target refused HELLO with status: the message for the reader (what
 * to do about it), and the code its ranges fail with. */
int sx__hello_refused(int32_t status, const char *label, const uint8_t *incarnation,
                      char *msg, size_t size);

/* A reader's connection to label ended: why NULL when the target closed
 * it, else the error's text.  The message its ranges fail with. */
void sx__conn_lost_msg(const char *label, const char *why, char *msg, size_t size);

/* Encode the HELLO a reader sends to the owner of a segment: its
 * incarnation and access token, and the reader's name (NULL: none).  As
 * sx__hello_encode. */
int sx__hello_build(const uint8_t *incarnation, const uint8_t *token, const char *name,
                    uint8_t *out, size_t cap);

/* Parse a HELLO body of exactly len bytes.  0, or SX_EPROTO (length does not
 * match the name length, name not printable). */
int sx__hello_decode(const uint8_t *buf, size_t len, sx__hello *out);

#endif
