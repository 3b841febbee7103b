/*
 * The TCP transport's reader side, shared by its two files: tcp_read.c
 * (peers, connections, the request pump, aborts) and tcp_reply.c (reading
 * the replies: headers, payloads, scattered payloads).  Not installed.
 * Everything runs on the agent's loop thread.
 */
#ifndef SX_TCP_READ_INT_H
#define SX_TCP_READ_INT_H

#include <stdatomic.h>
#include <sys/uio.h>

#include "tcp_int.h"
#include "transport/conn/xpool.h"

typedef struct cconn cconn;

enum { C_IDLE, C_CONNECTING, C_HELLO, C_READY, C_CLOSING, C_WAUTH };

/* Push: a ring entry that carries an op's notice instead of an xfer. */
#define NOTICE_IDX SIZE_MAX

typedef struct treq {
  sx_op *op;
  size_t idx;
  uint32_t n;   /* xfers idx .. idx + n - 1 (a READV when n > 1) */
  uint64_t id;
  uint64_t len; /* payload bytes: their sum */
  int aborted; /* the op gave up on it: drain its payload */
  uint64_t wseq; /* push: the cwrite carrying it (its payload is read
                  * from the source until that write completes) */
} treq;

/* A READV gathers ranges of one op, each at most READV_RANGE bytes,
 * READV_BYTES at most in all (which ranges: c_ranges() in tcp_read.c):
 * small enough that its reply is
 * received on the loop (below TCP_THREAD_BYTES), large enough that a
 * reply's fixed costs (a request, a header, a system call each side) stop
 * counting for 16 KiB blocks.  Larger ranges go one per READ. */
#define READV_RANGE (64u << 10)
#define READV_BYTES (256u << 10)
/* The most bytes of requests one pump writes on a connection. */
#define CWRITE_BYTES (WINDOW_REQS * (SX__FRAME_HDR + SX__READV_MAX * SX__READV_ENTRY))

typedef struct cwrite {
  uv_write_t req;
  uint32_t used; /* bytes of data */
  uint8_t data[CWRITE_BYTES];
  /* Push: WRITE headers alternate with their payload; a NOTICE owns its
   * header and body in `owned`. */
  uint32_t nb;
  uv_buf_t bufs[2 * WINDOW_REQS];
  uint8_t *owned;
} cwrite;

struct cconn {
  uv_tcp_t h;
  uv_timer_t timer; /* connect + hello deadline */
  uv_connect_t creq;
  uv_write_t hello_wr;
  tpeer *p;
  int state;
  int readv;     /* the target serves READV (said in HELLO_REPLY), */
  int readv_gpu; /* of GPU memory too */
  treq ring[WINDOW_REQS];
  uint32_t head, count;
  uint64_t inflight_bytes;
  uint64_t next_id;
  uint8_t hdr[SX__FRAME_HDR];
  size_t hgot;
  int in_payload;
  uint64_t pgot;
  uint32_t vi;   /* the payload's piece being filled (sx__tcp_r_piece) */
  uint64_t voff; /* and the bytes of it that arrived */
  uint8_t hello[SX__FRAME_HDR + SX__HELLO_MAX + SX__FRAME_HDR + SX__WAUTH_BODY];
  cwrite *w; /* requests gathered by the current pump */
  uint64_t wseq, wseq_done; /* push: cwrites issued and completed */
  /* The receive side lent to a data-mover thread (tcp_rx.c).  While
   * rx_away, the worker alone reads the socket and uses hdr, hgot,
   * in_payload, pgot, vi, voff and rx_pos; the loop still sends requests
   * (adding to rx_left) and settles what the worker finished (rx_done). */
  sx__xjob rx;
  int rx_away;
  int rx_fd;
  uint32_t rx_pos;       /* worker: the ring entry it receives */
  atomic_uint rx_left;   /* entries from rx_pos the worker may receive */
  atomic_uint rx_done;   /* entries it received whole, not settled yet */
  uint32_t rx_ready;     /* loop: taken from rx_done, not settled yet */
  int rx_errno;          /* worker: why it returned: 0, -1 (end of stream), errno */
  uint32_t rx_quiet_n;   /* worker: received since the loop was last woken */
  uint64_t rx_quiet_bytes;
};

typedef struct pend {
  struct pend *next;
  sx_op *op;
  size_t next_idx;
  uint8_t *notice; /* push: the op's notice (header room + body), or NULL */
  size_t nlen;
} pend;

struct tpeer {
  sx_tpeer base;
  tcp_t *t;
  const sx_desc *remote;
  tpeer *next, *prev;
  tpeer *pnext;
  int in_pump;
  char label[160]; /* "name at host:port", for messages */
  char host[SX_ADDR_MAX + 1];
  uint16_t port;
  struct sockaddr_storage sa;
  int have_sa, resolving;
  uv_getaddrinfo_t gai;
  cconn *conns;
  uint32_t n_conns;
  pend *q, **q_tail;
  int closing;
  int handles;
  int write; /* push: connections authorize as producer and carry writes */
};

/* The pieces r's payload lands in, in order: a scattered range's, a
 * READV's ranges, or the one range. */
static inline uint32_t sx__tcp_r_pieces(const treq *r) {
  const sx_xfer *x = &r->op->xfers[r->idx];
  return x->iov != NULL ? x->n_iov : r->n;
}

static inline struct iovec sx__tcp_r_piece(const treq *r, uint32_t i) {
  const sx_xfer *x = &r->op->xfers[r->idx];
  if (x->iov != NULL)
    return x->iov[i];
  return (struct iovec){x[i].local, (size_t)x[i].length};
}

/* tcp_read.c: fail everything in flight on c (and, with no live connection
 * left, what its peer has queued); settle the oldest request in flight;
 * act on the target's answer to HELLO (or WAUTH). */
void sx__tcp_c_fail(cconn *c, int err, const char *msg);
void sx__tcp_c_complete_head(cconn *c, int status, const char *msg);
void sx__tcp_c_hello_reply(cconn *c, const sx__frame *f);
/* tcp_read.c: a reply landed on c: ask for more at once where half of its
 * window is free (see there). */
void sx__tcp_c_refill(cconn *c);

/* tcp_reply.c: the connection's libuv read callbacks; n more bytes of the
 * head's payload arrived (move to the piece they end in); the
 * loop has the receive side back from a worker: act on a header it left
 * (one it does not take), then read on. */
void sx__tcp_c_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
void sx__tcp_c_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
void sx__tcp_c_advance(cconn *c, const treq *r, uint64_t n);
void sx__tcp_c_resume(cconn *c);

/* tcp_rx.c: lend c's receive side to a data-mover thread when the payload
 * starting now is large (1: lent, the read callbacks stop); a request was
 * added to c's ring; take the receive side back now (abort, failure,
 * closing): returns once no worker touches c, 1 if it was lent (then
 * sx__tcp_rx_back() settles what the worker finished and reads on, unless
 * the connection fails); settle what the worker finished so far. */
int sx__tcp_rx_lend(cconn *c);
void sx__tcp_rx_added(cconn *c);
int sx__tcp_rx_take(cconn *c);
void sx__tcp_rx_back(cconn *c);
void sx__tcp_rx_settle(cconn *c);

#endif
