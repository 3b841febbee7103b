/*
 * TCP with GPU memory on either side: staging through pinned host memory.
 * Not installed.  The code: tcp_stage.c (the pinned pool, streams and
 * lifetime), tcp_stage_serve.c (target side), tcp_stage_read.c (reader
 * side).  The design is in docs/gpu.md; in short:
 *
 * - Target: a READ of a GPU region is answered by device-to-host copies
 *   into pinned chunks, each written to the socket as soon as its copy
 *   finished, so the copy of chunk n+1 overlaps the send of chunk n.  READs
 *   of one GPU already received behind it (up to SX__STAGE_GROUP, one chunk
 *   in all) are answered with it: one gather launch fills one chunk, one
 *   write sends every reply (a READV of GPU memory is one such reply, of
 *   several ranges).  The connection parses no further request
 *   until every chunk of that reply is queued (replies go out in order),
 *   and the regions' `inflight` holds until the last chunk has left, so
 *   unregister waits for it.
 * - Reader: a batch with GPU destinations is cut into pieces of at most a
 *   chunk; small ranges share a piece (up to SX__STAGE_GROUP, one after the
 *   other in its chunk); each piece is read over the ordinary TCP path
 *   into a pinned chunk and copied to the device from there (one gather
 *   launch for a shared one) while the next pieces arrive.  A range settles only after its last device copy finished, so
 *   a batch is COMPLETED only then; an abort waits for copies in flight.
 * - Staging memory is bounded: sx_agent_params.staging_bytes per
 *   direction, allocated on first use, in chunks of at most 1 MiB; work
 *   waits for a free chunk when all are in use.
 *
 * Everything runs on the agent's loop thread; device copies complete
 * through sx__mem_notify (no polling).
 */
#ifndef SX_TCP_STAGE_H
#define SX_TCP_STAGE_H

#include <stdint.h>
#include <uv.h>

#include "mem/mem.h"
#include "transport/conn/conn.h"
#include "transport/transport.h"

typedef struct tcp_t tcp_t;
typedef struct sx__tcp_stage sx__tcp_stage;
typedef struct sx__tcp_sreply sx__tcp_sreply;

/* Reader side: the TCP ops table's post, abort and peer_close.  Ops with no
 * GPU destination go straight to the plain TCP path (tcp_read.c). */
int sx__tcp_stage_post(sx_tpeer *p, sx_op *op);
void sx__tcp_stage_abort(sx_tpeer *p, sx_op *op, int status);
void sx__tcp_stage_peer_close(sx_tpeer *p);

/* A range of GPU memory to send: [off, off+len) of region l, in a reply
 * to request id.  head: the first range of that reply (a READ's only one,
 * or a READV's first); the ranges that follow it up to the next head are
 * its. */
typedef struct sx__tcp_sread {
  uint64_t id;
  sx_lregion *l;
  uint64_t off, len;
  int head;
} sx__tcp_sread;

#define SX__STAGE_GROUP 64 /* ranges one staged reply may answer together */

/* Target side: answer the requests whose ranges rd are (n of them, in
 * order, rd[0] a head) on connection c, all of GPU memory of one device.
 * Several replies (that were waiting behind the first) fit one chunk in
 * all (sx__tcp_stage_group_bytes): one gather (the memory layer's kernel)
 * fills it and one write sends them.  One reply alone goes through as
 * many chunks as it takes.  *slot (c's SX__CONN_READ slot) is set to the
 * reply in progress; c parses no further request until
 * sx__conn_resume(c, SX__CONN_READ, ...), which runs when the reply is
 * queued, or at once (with an error) when staging is impossible. */
void sx__tcp_stage_reply(tcp_t *t, sx__conn *c, void **slot, const sx__tcp_sread *rd,
                         size_t n);
/* How many bytes READs answered together may have (one chunk), or 0
 * when no staging can be had. */
uint64_t sx__tcp_stage_group_bytes(tcp_t *t);
/* READVs of GPU memory answered through staging, in this process (tests
 * check that readers send them). */
uint64_t sx__tcp_stage_readvs(void);
/* c is closing: write nothing more for r, resume nothing. */
void sx__tcp_stage_detach(sx__tcp_sreply *r);

/* Consumer side of push mode (tcp_stage_write.c): WRITE f into GPU region
 * l on w's connection.  0: it took over w's body (w->ws, w->left, the
 * reply) and *used of the avail payload bytes that came with the header at
 * buf; else no staging (the caller drains the payload and answers with
 * that error).  While sx__tcp_wstage_holds(), the connection parses
 * nothing (it waits for staging, or for the device copies before the
 * reply). */
typedef struct sx__tcp_wconn sx__tcp_wconn;
typedef struct sx__tcp_wstage sx__tcp_wstage;
int sx__tcp_wstage_begin(sx__tcp_wconn *w, const sx__frame *f, sx_lregion *l,
                         const uint8_t *buf, size_t avail, size_t *used);
void sx__tcp_wstage_alloc(sx__tcp_wstage *ws, uv_buf_t *buf);
void sx__tcp_wstage_read(sx__tcp_wstage *ws, size_t n);
int sx__tcp_wstage_holds(const sx__tcp_wstage *ws);
/* The producer lost its grant: nothing more of this WRITE lands (the rest
 * is drained, the reply says SX_EACCESS); copies running hold the revoke. */
void sx__tcp_wstage_revoke(sx__tcp_wstage *ws);
/* The connection is gone: copies running end, then it is freed. */
void sx__tcp_wstage_detach(sx__tcp_wstage *ws);

/* tcp_close(), after every peer and reader connection was closed: wait for
 * device copies, free staging once the last chunk came back. */
void sx__tcp_stage_close(tcp_t *t);

/* ------------------------------------------------------ the three files */

enum { SX__STAGE_SERVE = 0, SX__STAGE_READ = 1 };

/* Someone waiting for a chunk: fn gets it (on the loop thread). */
typedef struct sx__stage_wait {
  struct sx__stage_wait *next;
  void (*fn)(struct sx__stage_wait *w, void *chunk);
} sx__stage_wait;

/* The staging state of a TCP transport, made on first GPU use. */
int sx__tcp_stage_get(tcp_t *t, sx__tcp_stage **out);
size_t sx__stage_chunk_size(const sx__tcp_stage *s);
/* A chunk of direction dir: 0 with *chunk, 1 when w was queued (w->fn runs
 * later with one), or an error (no pinned memory). */
int sx__stage_chunk_get(sx__tcp_stage *s, int dir, sx__stage_wait *w, void **chunk);
void sx__stage_chunk_put(sx__tcp_stage *s, int dir, void *chunk);
/* Take w out of dir's queue (it was waiting). */
void sx__stage_unwait(sx__tcp_stage *s, int dir, sx__stage_wait *w);
/* A stream for copies of direction dir on device (round-robin over a few). */
int sx__stage_stream(sx__tcp_stage *s, int dir, int device, sx__mem_stream **out);
sx__mem_notifier *sx__stage_notifier(const sx__tcp_stage *s);
/* Count something that must end before the staging state may be freed. */
void sx__stage_hold(sx__tcp_stage *s);
void sx__stage_release(sx__tcp_stage *s);
int sx__stage_closing(const sx__tcp_stage *s);
const sx_tctx *sx__stage_ctx(const sx__tcp_stage *s);

/* The head of tcp_stage_read.c's list of staged ops. */
void **sx__stage_sops(sx__tcp_stage *s);
/* tcp_stage_read.c: fail every staged op (peer NULL: of every peer). */
void sx__stage_read_abort_all(sx__tcp_stage *s, sx_tpeer *peer, int status);

#endif
