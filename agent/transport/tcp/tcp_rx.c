/*
 * The TCP transport, reader side: replies received on a data-mover thread
 * (transport/conn/xpool.h), so that several connections receive on
 * several cores instead of the loop's one.
 *
 * When a reply's payload of at least the agent's threshold begins (its
 * header parsed on the loop, tcp_reply.c), the loop stops reading the
 * socket and lends the receive side to the pool.  The worker receives that
 * payload straight into its destination (pieces, for a scattered range or
 * a READV's ranges), and goes on with the replies behind it while requests
 * are in flight:
 * each header is checked against the ring entry it answers, and anything
 * but a successful reply of the expected length (an error reply, a
 * notice's reply, a request the loop aborted) is left for the loop, as is
 * the connection once nothing is in flight.  Each reply received whole
 * counts in rx_done; the loop, woken at an op's last reply here and every
 * quarter window (rx_told), settles them and sends more requests (the
 * window refills as in tcp_read.c).
 *
 * Only while two reader connections or more are busy (engage.h): with
 * one, the loop receives as without threads, and a worker that has one
 * gives it back at its next reply boundary.
 *
 * An abort, a failed connection or closing takes the receive side back
 * first (sx__xpool_reclaim: the worker is out of its system call and gone
 * before the loop goes on), so no destination is written after its batch
 * ended, and no descriptor is closed under a worker.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "internal.h"
#include "tcp_read_int.h"

/* The most payload bytes one system call receives: a take-back waits for
 * one such copy at most. */
#define RX_CHUNK (2u << 20)
#define RX_PIECES 64

static cconn *rx_conn(sx__xjob *j) { return (cconn *)((char *)j - offsetof(cconn, rx)); }

/* Worker: is the header in c->hdr the successful reply of entry r? */
static int rx_expected(const cconn *c, const treq *r) {
  sx__frame f;
  return sx__frame_decode(c->hdr, SX__FRAME_HDR, &f) == SX__FRAME_HDR &&
         f.type == SX__FRAME_READ_REPLY && f.status == 0 && f.id == r->id &&
         f.length == r->len && !r->aborted && r->idx != NOTICE_IDX;
}

/* Worker: the iovecs for the rest of r's payload (at most RX_CHUNK
 * bytes), and the next reply's header when another is due and the chunk
 * reaches the payload's end.  Returns their number. */
static int rx_iov(cconn *c, const treq *r, struct iovec *v) {
  uint64_t room = r->len - c->pgot;
  if (room > RX_CHUNK)
    room = RX_CHUNK;
  int n = 0;
  uint64_t off = c->voff;
  uint32_t pieces = sx__tcp_r_pieces(r);
  for (uint32_t i = c->vi; i < pieces && n < RX_PIECES && room > 0; i++) {
    struct iovec p = sx__tcp_r_piece(r, i);
    uint64_t len = p.iov_len - off;
    if (len > room)
      len = room;
    v[n++] = (struct iovec){(char *)p.iov_base + off, (size_t)len};
    room -= len;
    off = 0;
  }
  uint64_t asked = 0;
  for (int i = 0; i < n; i++)
    asked += v[i].iov_len;
  if (c->pgot + asked == r->len && atomic_load(&c->rx_left) > 1)
    v[n++] = (struct iovec){c->hdr, SX__FRAME_HDR};
  return n;
}

/* Worker: a reply of op, len bytes, was received whole and due more are: wake the
 * loop where it has something to do.  Every reply would cost the loop a
 * wakeup per reply (about a tenth more CPU per GB at 1 MiB on one
 * connection, on 2 cores); so the loop hears when an op's last reply on
 * this connection arrived (the next is another op's, or none is due), and
 * otherwise every quarter window, so that it refills the window in time
 * (it asks for more once half of it is free). */
static void rx_told(cconn *c, const sx_op *op, uint64_t len, unsigned due) {
  c->rx_quiet_n++;
  c->rx_quiet_bytes += len;
  if (due > 0 && c->ring[c->rx_pos].op == op && c->rx_quiet_n < WINDOW_REQS / 4 &&
      c->rx_quiet_bytes < WINDOW_BYTES / 4)
    return;
  c->rx_quiet_n = 0;
  c->rx_quiet_bytes = 0;
  sx__xpool_progress(&c->rx);
}

/* Worker: receive replies until nothing is due, the loop's part begins,
 * the socket fails, the pool wants the thread back, or the threads are no
 * longer engaged (one connection left busy: the loop receives on). */
static void rx_run(sx__xjob *j) {
  cconn *c = rx_conn(j);
  sx__engage *e = &c->p->t->srv.rx_eng;
  c->rx_errno = 0;
  for (;;) {
    ssize_t got;
    if (!c->in_payload) {
      if (c->hgot == 0 && (atomic_load(&c->rx_left) == 0 || sx__xpool_yield(j)))
        return;
      /* Between payloads the loop can take over anywhere: it finishes a
       * header begun here (c->hgot of it in c->hdr) or acts on a whole
       * one, as it does on one not taken below. */
      if (!sx__engage_on(e))
        return;
      if (c->hgot < SX__FRAME_HDR) {
        got = recv(c->rx_fd, c->hdr + c->hgot, SX__FRAME_HDR - c->hgot, MSG_DONTWAIT);
        if (got > 0) {
          c->hgot += (size_t)got;
          continue;
        }
      } else {
        if (!rx_expected(c, &c->ring[c->rx_pos]))
          return; /* the loop acts on it (c->hgot stays whole) */
        c->hgot = 0;
        c->in_payload = 1;
        c->pgot = 0;
        c->vi = 0;
        c->voff = 0;
        continue;
      }
    } else {
      const treq *r = &c->ring[c->rx_pos];
      struct iovec v[RX_PIECES + 1];
      int n = rx_iov(c, r, v);
      got = readv(c->rx_fd, v, n);
      if (got > 0) {
        uint64_t left = r->len - c->pgot;
        uint64_t more = (uint64_t)got > left ? (uint64_t)got - left : 0;
        sx__tcp_c_advance(c, r, (uint64_t)got - more);
        c->pgot += (uint64_t)got - more;
        c->hgot = (size_t)more;
        if (c->pgot == r->len) {
          c->in_payload = 0;
          c->rx_pos = (c->rx_pos + 1) % WINDOW_REQS;
          /* r is the loop's to settle (and reuse) once rx_done counts it. */
          const sx_op *op = r->op;
          uint64_t len = r->len;
          unsigned due = atomic_fetch_sub(&c->rx_left, 1) - 1;
          atomic_fetch_add_explicit(&c->rx_done, 1, memory_order_release);
          rx_told(c, op, len, due);
        }
        continue;
      }
    }
    if (got == 0) {
      c->rx_errno = -1;
      return;
    }
    int again = sx__xpool_again(j, c->rx_fd, POLLIN);
    if (again <= 0) {
      c->rx_errno = again < 0 ? errno : 0;
      return;
    }
  }
}

void sx__tcp_rx_settle(cconn *c) {
  c->rx_ready += atomic_exchange_explicit(&c->rx_done, 0, memory_order_acquire);
  while (c->rx_ready > 0 && c->state == C_READY) {
    c->rx_ready--;
    sx__tcp_c_complete_head(c, 0, NULL);
  }
  sx__tcp_c_refill(c);
}

/* Loop: the worker returned (or was taken back): the receive side is the
 * loop's again; settle what it finished, then fail the connection if its
 * socket failed, or read on. */
void sx__tcp_rx_back(cconn *c) {
  c->rx_away = 0;
  sx__tcp_rx_settle(c);
  if (c->state != C_READY)
    return;
  if (c->rx_errno != 0) {
    char msg[512];
    sx__conn_lost_msg(c->p->label, c->rx_errno < 0 ? NULL : strerror(c->rx_errno), msg,
                      sizeof(msg));
    sx__tcp_c_fail(c, SX_EDISCONN, msg);
    return;
  }
  sx__tcp_c_resume(c);
}

/* Loop: whether the threads receive payloads now (engage.h): while at
 * least rx_eng.conns of the agent's reader connections have a large
 * payload's worth of requests in flight. */
static int rx_engaged(tcp_t *t) {
  sx__conn_server *s = &t->srv;
  uint32_t busy = 0;
  for (const tpeer *p = t->peers; p != NULL && busy < s->rx_eng.conns; p = p->next)
    for (uint32_t i = 0; i < p->n_conns && !p->write && busy < s->rx_eng.conns; i++)
      busy += p->conns[i].state == C_READY && p->conns[i].inflight_bytes >= s->pool_min;
  return sx__engage_update(&s->rx_eng, t->loop, busy);
}

static void rx_notify(sx__xjob *j, int finished) {
  cconn *c = rx_conn(j);
  if (finished) {
    sx__tcp_rx_back(c);
    return;
  }
  sx__tcp_rx_settle(c);
  /* Other connections may have gone idle: the worker then gives c back
   * at its next reply boundary (rx_run). */
  if (c->state == C_READY)
    rx_engaged(c->p->t);
}

int sx__tcp_rx_lend(cconn *c) {
  tpeer *p = c->p;
  if (p->write || c->state != C_READY || !c->in_payload || c->rx_away || c->count == 0)
    return 0;
  const treq *r = &c->ring[c->head];
  sx__conn_server *s = &p->t->srv;
  if (r->aborted || r->idx == NOTICE_IDX || r->len - c->pgot < s->pool_min ||
      s->pool_threads == 0)
    return 0;
  if (!rx_engaged(p->t)) {
    sx__engage_keep(&s->rx_eng);
    return 0;
  }
  sx__xpool *pool = sx__conn_pool(s);
  uv_os_fd_t fd;
  if (pool == NULL || uv_fileno((const uv_handle_t *)&c->h, &fd) != 0)
    return 0;
  uv_read_stop((uv_stream_t *)&c->h);
  c->rx_fd = fd;
  c->rx_pos = c->head;
  c->rx_ready = 0;
  c->rx_errno = 0;
  c->rx_quiet_n = 0;
  c->rx_quiet_bytes = 0;
  atomic_store(&c->rx_left, c->count);
  atomic_store(&c->rx_done, 0);
  c->rx.run = rx_run;
  c->rx.notify = rx_notify;
  c->rx.kind = SX__XJOB_RECV;
  c->rx_away = 1;
  sx__xpool_submit(pool, &c->rx);
  return 1;
}

void sx__tcp_rx_added(cconn *c) {
  if (c->rx_away)
    atomic_fetch_add_explicit(&c->rx_left, 1, memory_order_release);
}

int sx__tcp_rx_take(cconn *c) {
  if (!c->rx_away)
    return 0;
  sx__xpool_reclaim(&c->rx);
  c->rx_away = 0;
  c->rx_ready += atomic_exchange_explicit(&c->rx_done, 0, memory_order_acquire);
  return 1;
}
