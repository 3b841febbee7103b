/*
 * Read notices (SX_BATCH_NOTIFY, include/segxfer/push.h) over TCP inside one
 * process (mem:// store, loopback): a notifying read batch ends COMPLETED
 * only once the target holds its notice, naming the reader, its
 * incarnation, the tag and the target's blocks; a read batch without the
 * flag, a failed, a timed-out and a cancelled batch give none; forged and
 * oversized read notices on the wire are refused.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent_int.h"
#include "internal.h"
#include "notice.h"
#include "push_fixture.h"
#include "push_int.h"
#include "transport/conn/frame.h"

typedef struct pair {
  char url[64];
  sxt_agent t, r;
  sx_segment *seg;
} pair;

static void pair_start(pair *p, const char *reader) {
  sxt_mem_url(p->url, sizeof(p->url), "rnotice");
  sxt_target_start(&p->t, p->url, "prefill-0", NULL, 42);
  sxt_reader_start(&p->r, p->url, reader);
  sxt_ok(sx_segment_open(p->r.a, "prefill-0", 2000, &p->seg));
}

static void pair_stop(pair *p) {
  sx_segment_close(p->seg);
  sxt_agent_stop(&p->r);
  sxt_agent_stop(&p->t);
}

static sx_block_read kv_read(uint64_t remote, uint64_t local, uint64_t count) {
  return (sx_block_read){.layer_count = SXT_LAYERS, .slots = SXT_KV, .remote_block = remote,
                         .local_block = local, .count = count};
}

/* A read batch of e[0..n): notifying with tag when notify, submitted. */
static sx_batch *submit(sx_segment *s, const sx_block_read *e, size_t n, int notify,
                        uint64_t tag, uint32_t timeout_ms) {
  return notify ? sxt_notify_submit(s, e, n, tag, timeout_ms)
                : sxt_batch_submit(s, e, n, timeout_ms);
}

static sx_batch_result finish(sx_batch *b) { return sxt_batch_finish(b); }

static uint64_t notices_of(sx_agent *a) {
  sx_agent_stats st;
  sxt_ok(sx_agent_stats_get(a, &st, sizeof(st)));
  return st.notices;
}

static void test_read_notice_tcp_arrives_after_every_byte(void **state) {
  (void)state;
  pair p;
  pair_start(&p, "decode-0");
  int fd = sx_agent_notice_fd(p.t.a);
  assert_true(fd >= 0);
  /* Without the flag: no notice at all. */
  sx_block_read plain = kv_read(3, 0, 2);
  sx_batch_result r = finish(submit(p.seg, &plain, 1, 0, 0, 5000));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sxt_expect_no_notice(p.t.a);
  assert_false(sxt_fd_readable(fd));
  /* With it: COMPLETED means the target holds the notice already. */
  sx_block_read e[2] = {kv_read(10, 0, 4), kv_read(40, 4, 3)};
  r = finish(submit(p.seg, e, 2, 1, 0xfeedface12345678ull, 5000));
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("read batch %s: %s", sx_batch_state_name(r.state), r.message);
  assert_int_equal(r.bytes, 7 * SXT_LAYERS * 2 * SXT_BLOCK);
  assert_int_equal(r.transport, SX_TRANSPORT_TCP);
  assert_true(sxt_fd_readable(fd));
  assert_int_equal(notices_of(p.t.a), 1);
  for (int i = 0; i < 2; i++)
    assert_int_equal(sxt_verify_blocks(&p.r, p.seg, 42, &e[i]), 0);
  sx_notice *peek = NULL;
  sxt_ok(sx_agent_notice_next(p.t.a, 0, &peek));
  assert_int_equal(peek->kind, SX_NOTICE_READ);
  assert_int_equal(peek->transport, SX_TRANSPORT_TCP);
  sxt_check_notice(peek, &p.r, "decode-0", 0xfeedface12345678ull,
                   (sx_block_write[]){{.layer_count = SXT_LAYERS, .slots = SXT_KV,
                                       .remote_block = 10, .count = 4},
                                      {.layer_count = SXT_LAYERS, .slots = SXT_KV,
                                       .remote_block = 40, .count = 3}},
                   2);
  sx_notice_free(peek);
  assert_false(sxt_fd_readable(fd));
  /* Consecutive entries merge into one run; the helper checks it. */
  sx_block_read run[2] = {kv_read(20, 0, 2), kv_read(22, 2, 2)};
  r = finish(submit(p.seg, run, 2, 1, 5, 5000));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sxt_expect_read_notice(p.t.a, &p.r, "decode-0", 5, run, 2, 0);
  /* An empty notifying batch still tells the target (request done, nothing
   * to read), as an empty write batch does. */
  sx_batch *b;
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = SX_BATCH_NOTIFY;
  bp.tag = 6;
  sxt_ok(sx_batch_create(p.seg, &bp, &b));
  sxt_ok(sx_batch_submit(b));
  r = finish(b);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sxt_expect_read_notice(p.t.a, &p.r, "decode-0", 6, NULL, 0, 0);
  sxt_expect_no_notice(p.t.a);
  pair_stop(&p);
}

static void test_read_notice_unnamed_reader(void **state) {
  (void)state;
  pair p;
  pair_start(&p, NULL); /* a reader-only agent: no name */
  sx_block_read e = kv_read(0, 0, 8);
  sx_batch_result r = finish(submit(p.seg, &e, 1, 1, 11, 5000));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sxt_expect_read_notice(p.t.a, &p.r, "", 11, &e, 1, 0);
  pair_stop(&p);
}

static void test_read_notice_flags_and_limits(void **state) {
  (void)state;
  pair p;
  pair_start(&p, "decode-0");
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = SX_BATCH_NOTIFY | SX_BATCH_WRITE;
  sx_batch *b = NULL;
  sxt_rc(sx_batch_create(p.seg, &bp, &b), SX_EINVAL);
  /* More entries than a notice lists: refused at add time, nothing added. */
  bp.flags = SX_BATCH_NOTIFY;
  sxt_ok(sx_batch_create(p.seg, &bp, &b));
  sx_block_read *many = calloc(SX_NOTICE_MAX_ENTRIES + 1, sizeof(*many));
  for (uint32_t i = 0; i <= SX_NOTICE_MAX_ENTRIES; i++)
    many[i] = (sx_block_read){.layer_count = 1, .layer_first = i % SXT_LAYERS,
                              .slots = 1u << (i / SXT_LAYERS % 2), .remote_block = i % 64,
                              .local_block = 0, .count = 1};
  sxt_rc(sx_batch_add_blocks(b, many, SX_NOTICE_MAX_ENTRIES + 1), SX_ELIMIT);
  /* The planner's refusal undoes the notice's entries too: a good entry
   * afterwards is the notice's only one. */
  sx_block_read bad = kv_read(60, 0, 10); /* past the target's 64 blocks */
  sxt_rc(sx_batch_add_blocks(b, &bad, 1), SX_EBOUNDS);
  sx_block_read good = kv_read(1, 1, 1);
  sxt_ok(sx_batch_add_blocks(b, &good, 1));
  sxt_ok(sx_batch_submit(b));
  sx_batch_result r = finish(b);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sxt_expect_read_notice(p.t.a, &p.r, "decode-0", 0, &good, 1, 0);
  free(many);
  pair_stop(&p);
}

static void test_read_notice_none_for_a_failed_batch(void **state) {
  (void)state;
  pair p;
  pair_start(&p, "decode-0");
  /* The reader still holds the descriptor with region V; the target
   * refuses its reads from now on. */
  sxt_ok(sx_agent_unregister(p.t.a, p.t.id[1]));
  sx_block_read e = kv_read(0, 0, 4);
  sx_batch_result r = finish(submit(p.seg, &e, 1, 1, 13, 5000));
  assert_int_equal(r.state, SX_BATCH_FAILED);
  sxt_expect_no_notice(p.t.a);
  assert_int_equal(notices_of(p.t.a), 0);
  pair_stop(&p);
}

/* A notice callback that holds the target's loop until released: reads
 * queued meanwhile are not served. */
typedef struct held_cb {
  atomic_int in_cb, release, calls;
  atomic_ullong last_tag;
} held_cb;

static int hold_notice(void *arg, const sx_notice *n) {
  held_cb *h = arg;
  atomic_fetch_add(&h->calls, 1);
  atomic_store(&h->last_tag, n->tag);
  atomic_store(&h->in_cb, 1);
  while (!atomic_load(&h->release))
    usleep(1000);
  return 1;
}

static void test_read_notice_none_when_timed_out_or_cancelled(void **state) {
  (void)state;
  pair p;
  pair_start(&p, "decode-0");
  held_cb h;
  memset(&h, 0, sizeof(h));
  sxt_ok(sx_agent_notice_cb(p.t.a, hold_notice, &h));
  sx_block_read e = kv_read(0, 0, 4);
  sx_batch *first = submit(p.seg, &e, 1, 1, 1, 20000);
  for (int i = 0; i < 5000 && !atomic_load(&h.in_cb); i++)
    usleep(1000);
  assert_true(atomic_load(&h.in_cb));
  /* The target's loop is held: these get nothing served. */
  sx_block_read e2 = kv_read(8, 8, 4);
  sx_batch_result r = finish(submit(p.seg, &e2, 1, 1, 2, 200));
  assert_int_equal(r.state, SX_BATCH_TIMEOUT);
  sx_batch *third = submit(p.seg, &e2, 1, 1, 3, 20000);
  usleep(20000);
  sxt_ok(sx_batch_cancel(third));
  r = finish(third);
  assert_int_equal(r.state, SX_BATCH_CANCELLED);
  atomic_store(&h.release, 1);
  r = finish(first);
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  /* The held loop now serves what was queued; still no second notice. */
  usleep(300000);
  assert_int_equal(atomic_load(&h.calls), 1);
  assert_int_equal(atomic_load(&h.last_tag), 1);
  sxt_ok(sx_agent_notice_cb(p.t.a, NULL, NULL));
  sxt_expect_no_notice(p.t.a);
  /* The connection still works for the next notifying batch. */
  r = finish(submit(p.seg, &e2, 1, 1, 4, 5000));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sxt_expect_read_notice(p.t.a, &p.r, "decode-0", 4, &e2, 1, 0);
  pair_stop(&p);
}

/* ------------------------------------------------------------ the reader's side */

/* A target of our own on the wire: it says yes to HELLO, answers READs
 * with payload (or, while fail_reads is set, with SX_EIO) and counts the
 * read notices it gets, answering them 0. */
typedef struct fake {
  int lfd, fd;
  atomic_int fail_reads, rnotices, reads;
} fake;

static void *fake_main(void *arg) {
  fake *fk = arg;
  fk->fd = accept(fk->lfd, NULL, NULL);
  static uint8_t buf[SX__FRAME_HDR + SX_NOTICE_MAX_BYTES];
  static uint8_t payload[256 * 1024];
  for (;;) {
    sx__frame f, r;
    if (sxt_wire_recv(fk->fd, buf, SX__FRAME_HDR) ||
        sx__frame_decode(buf, SX__FRAME_HDR, &f) != SX__FRAME_HDR)
      return NULL;
    if (f.type != SX__FRAME_READ && sxt_wire_recv(fk->fd, buf, (size_t)f.length))
      return NULL;
    r = (sx__frame){.id = f.id};
    if (f.type == SX__FRAME_HELLO) {
      r.type = SX__FRAME_HELLO_REPLY;
    } else if (f.type == SX__FRAME_RNOTICE) {
      atomic_fetch_add(&fk->rnotices, 1);
      r.type = SX__FRAME_NOTICE_REPLY;
    } else if (f.type == SX__FRAME_READ && f.length <= sizeof(payload)) {
      atomic_fetch_add(&fk->reads, 1);
      r.type = SX__FRAME_READ_REPLY;
      if (atomic_load(&fk->fail_reads))
        r.status = SX_EIO;
      else
        r.length = f.length;
    } else {
      return NULL;
    }
    sx__frame_encode(&r, buf);
    if (sxt_wire_send(fk->fd, buf, SX__FRAME_HDR) ||
        (r.length && sxt_wire_send(fk->fd, payload, (size_t)r.length)))
      return NULL;
  }
}

static void test_read_notice_reader_sends_none_after_a_failure(void **state) {
  (void)state;
  char url[64];
  sxt_mem_url(url, sizeof(url), "rnotice");
  fake fk = {.fd = -1};
  fk.lfd = sxt_fake_target(url, "fake-0", SXT_TARGET_BLOCKS, SX_ACCESS_REMOTE_READ);
  /* One connection, so that the fake serves it alone. */
  sxt_agent r;
  memset(&r, 0, sizeof(r));
  sx_agent_params ap;
  sxt_params(&ap, url, "decode-0");
  ap.conns_per_peer = 1;
  sxt_ok(sx_agent_create(&ap, &r.a));
  sxt_register_kv(&r, SXT_READER_BLOCKS, SX_ACCESS_REMOTE_READ);
  sx_segment *seg;
  sxt_ok(sx_segment_open(r.a, "fake-0", 2000, &seg));
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, fake_main, &fk), 0);
  /* Every READ refused: FAILED, and no RNOTICE on the wire. */
  atomic_store(&fk.fail_reads, 1);
  sx_block_read e = kv_read(0, 0, 4);
  sx_batch_result res = finish(submit(seg, &e, 1, 1, 21, 5000));
  assert_int_equal(res.state, SX_BATCH_FAILED);
  assert_true(atomic_load(&fk.reads) > 0);
  usleep(200000);
  assert_int_equal(atomic_load(&fk.rnotices), 0);
  /* The same fake, reads served: the notice comes (so the count above
   * would have seen one). */
  atomic_store(&fk.fail_reads, 0);
  res = finish(submit(seg, &e, 1, 1, 22, 5000));
  assert_int_equal(res.state, SX_BATCH_COMPLETED);
  assert_int_equal(atomic_load(&fk.rnotices), 1);
  sx_segment_close(seg);
  sxt_agent_stop(&r);
  pthread_join(th, NULL);
  if (fk.fd >= 0)
    close(fk.fd);
  close(fk.lfd);
}

/* ------------------------------------------------------------ the wire */

/* An encoded notice of kind from name (incarnation inc) over blocks
 * [block, +count) of every layer, K and V, claiming bytes. */
static uint8_t *encode(uint32_t kind, const char *name, const uint8_t *inc, uint64_t block,
                       uint64_t count, uint64_t bytes, size_t *len) {
  sx_notice *n = sx__notice_alloc(1, 0);
  snprintf(n->producer, sizeof(n->producer), "%s", name);
  memcpy(n->incarnation, inc, SX_INCARNATION_LEN);
  n->kind = kind;
  n->tag = 77;
  n->bytes = bytes;
  sx__notice_blocks(n)[0] = (sx_notice_blocks){.layer_count = SXT_LAYERS, .slots = SXT_KV,
                                               .block = block, .count = count};
  uint8_t *buf = NULL;
  sxt_ok(sx__notice_encode(n, &buf, len));
  sx_notice_free(n);
  return buf;
}

/* The bytes of one block in every layer, K and V. */
static const uint64_t per_block = SXT_LAYERS * 2 * SXT_BLOCK;

/* A pair for raw frames: the target's descriptor as the reader opened it,
 * and an incarnation of fill bytes for forged notices. */
static const sx_desc *wire_start(pair *p, const char *reader, uint8_t *inc, uint8_t fill) {
  pair_start(p, reader);
  memset(inc, fill, SX_INCARNATION_LEN);
  return sx_segment_desc(p->seg);
}

/* After the raw frames: no notice came of them, the target goes on serving
 * and taking real notices (a read of remote block `block` with tag). */
static void wire_stop(pair *p, const char *reader, uint64_t block, uint64_t tag) {
  sxt_expect_no_notice(p->t.a);
  sx_block_read e = kv_read(block, 0, 1);
  assert_int_equal(finish(submit(p->seg, &e, 1, 1, tag, 5000)).state, SX_BATCH_COMPLETED);
  sxt_expect_read_notice(p->t.a, &p->r, reader, tag, &e, 1, 0);
  pair_stop(p);
}

static void test_read_notice_forged_ones_are_refused(void **state) {
  (void)state;
  pair p;
  uint8_t inc[SX_INCARNATION_LEN];
  const sx_desc *d = wire_start(&p, "decode-0", inc, 0x5c);
  uint16_t port = sxt_tcp_port(d);
  /* Before HELLO: the connection closes. */
  int fd = sxt_wire_connect(port);
  size_t len;
  uint8_t *ok = encode(SX_NOTICE_READ, "decode-x", inc, 2, 3, 3 * per_block, &len);
  assert_int_equal(sxt_wire_rnotice(fd, 1, ok, len), 1);
  close(fd);
  fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, d->incarnation, d->token, "decode-x"), 0);
  /* A well-formed one is taken (this is the path the others try). */
  assert_int_equal(sxt_wire_rnotice(fd, 2, ok, len), 0);
  sx_notice *n = NULL;
  sxt_ok(sx_agent_notice_next(p.t.a, 0, &n));
  assert_int_equal(n->kind, SX_NOTICE_READ);
  assert_string_equal(n->producer, "decode-x");
  assert_int_equal(n->tag, 77);
  sx_notice_free(n);
  free(ok);
  struct {
    uint32_t kind;
    const char *name;
    uint64_t block, count, bytes;
    int want;
  } bad[] = {
      {SX_NOTICE_READ, "someone-else", 2, 3, 3 * per_block, SX_EPROTO}, /* not its HELLO */
      {SX_NOTICE_READ, "decode-x", 62, 3, 3 * per_block, SX_EBOUNDS},   /* past the end */
      {SX_NOTICE_READ, "decode-x", 2, 3, 4 * per_block, SX_EPROTO},     /* bytes lie */
      {SX_NOTICE_WRITE, "decode-x", 2, 3, 3 * per_block, SX_EPROTO},    /* not a read one */
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    uint8_t *buf = encode(bad[i].kind, bad[i].name, inc, bad[i].block, bad[i].count,
                          bad[i].bytes, &len);
    int st = sxt_wire_rnotice(fd, 10 + i, buf, len);
    free(buf);
    if (st != bad[i].want)
      fail_msg("forged notice %zu: status %s, expected %s", i, sx_err_name(st),
               sx_err_name(bad[i].want));
  }
  /* Not a notice at all. */
  uint8_t junk[64];
  memset(junk, 0xff, sizeof(junk));
  assert_int_equal(sxt_wire_rnotice(fd, 20, junk, sizeof(junk)), SX_EDECODE);
  sxt_expect_no_notice(p.t.a);
  /* A write notice frame on a reader's connection (no WAUTH): refused. */
  uint8_t *w = encode(SX_NOTICE_WRITE, "decode-x", inc, 2, 3, 3 * per_block, &len);
  assert_int_equal(sxt_wire_notice(fd, 21, w, len), SX_EACCESS);
  free(w);
  /* Longer than any notice may be: the header alone closes the connection. */
  uint8_t hdr[SX__FRAME_HDR];
  sx__frame f = {.type = SX__FRAME_RNOTICE, .id = 30, .length = SX_NOTICE_MAX_BYTES + 1};
  sx__frame_encode(&f, hdr);
  assert_int_equal(sxt_wire_send(fd, hdr, sizeof(hdr)), 0);
  assert_int_equal(sxt_wire_closed(fd), 1);
  close(fd);
  wire_stop(&p, "decode-0", 5, 8);
}

/* Send many copies of the read notice body[0..len) on fd (which said
 * HELLO), 128 a send, ids from id0, reading the replies after each send;
 * count those accepted and those refused with SX_ELIMIT (any other answer
 * fails the test). */
static void pipeline(int fd, const uint8_t *body, size_t len, uint64_t id0, size_t many,
                     size_t *taken, size_t *limited) {
  const size_t per = 128, one = SX__FRAME_HDR + len;
  uint8_t *burst = malloc(per * one);
  assert_non_null(burst);
  sx__frame f = {.type = SX__FRAME_RNOTICE, .length = len}, g;
  uint8_t rep[SX__FRAME_HDR];
  for (size_t at = 0; at < many; at += per) {
    size_t k = many - at < per ? many - at : per;
    for (size_t i = 0; i < k; i++) {
      f.id = id0 + at + i;
      sx__frame_encode(&f, burst + i * one);
      memcpy(burst + i * one + SX__FRAME_HDR, body, len);
    }
    assert_int_equal(sxt_wire_send(fd, burst, k * one), 0);
    for (size_t i = 0; i < k; i++) {
      assert_int_equal(sxt_wire_recv(fd, rep, sizeof(rep)), 0);
      assert_int_equal(sx__frame_decode(rep, sizeof(rep), &g), SX__FRAME_HDR);
      assert_int_equal(g.type, SX__FRAME_NOTICE_REPLY);
      assert_int_equal(g.id, id0 + at + i);
      if (g.status == 0)
        (*taken)++;
      else if (g.status == SX_ELIMIT)
        (*limited)++;
      else
        fail_msg("notice %zu: %s", at + i, sx_err_name(g.status));
    }
  }
  free(burst);
}

/* Read notices a hostile reader sends past HELLO that the forged ones above
 * do not: an empty body, a body split across sends, more pipelined than
 * the reply queue holds (past the notice queue's bound in all), and one
 * cut off by the connection's end.  Each is answered or dropped
 * without touching anything else; the target goes on serving. */
static void test_read_notice_hostile_framing(void **state) {
  (void)state;
  pair p;
  uint8_t inc[SX_INCARNATION_LEN];
  const sx_desc *d = wire_start(&p, "hostile-0", inc, 0x3a);
  uint16_t port = sxt_tcp_port(d);
  size_t len;
  uint8_t *ok = encode(SX_NOTICE_READ, "hostile-x", inc, 1, 2, 2 * per_block, &len);
  int fd = sxt_wire_connect(port);
  assert_int_equal(sxt_wire_hello(fd, d->incarnation, d->token, "hostile-x"), 0);
  /* An empty body is no notice. */
  assert_true(sxt_wire_rnotice(fd, 1, NULL, 0) < 0);
  sxt_expect_no_notice(p.t.a);
  /* A body split across sends (the header and its first byte, then the rest). */
  uint8_t hdr[SX__FRAME_HDR];
  sx__frame f = {.type = SX__FRAME_RNOTICE, .id = 2, .length = len};
  sx__frame_encode(&f, hdr);
  assert_int_equal(sxt_wire_send(fd, hdr, sizeof(hdr)), 0);
  assert_int_equal(sxt_wire_send(fd, ok, 1), 0);
  usleep(20000);
  assert_int_equal(sxt_wire_send(fd, ok + 1, len - 1), 0);
  uint8_t rep[SX__FRAME_HDR];
  sx__frame g;
  assert_int_equal(sxt_wire_recv(fd, rep, sizeof(rep)), 0);
  assert_int_equal(sx__frame_decode(rep, sizeof(rep), &g), SX__FRAME_HDR);
  assert_int_equal(g.type, SX__FRAME_NOTICE_REPLY);
  assert_int_equal(g.id, 2);
  assert_int_equal(g.status, 0);
  sx_notice *n = NULL;
  sxt_ok(sx_agent_notice_next(p.t.a, 0, &n));
  assert_string_equal(n->producer, "hostile-x");
  sx_notice_free(n);
  /* Pipelined: more notices than the notice queue holds, 128 a send
   * (more than the reply queue holds; the replies are read after each
   * send, as a reader must); each is answered in order, those past the
   * read notices' share of the queue with SX_ELIMIT.  (Before that share
   * existed, read notices could fill all SX_NOTICE_QUEUE_MAX places.) */
  const size_t many = SX_NOTICE_QUEUE_MAX + 40;
  size_t taken = 0, limited = 0;
  pipeline(fd, ok, len, 100, many, &taken, &limited);
  assert_int_equal(taken, SX_NOTICE_READ_QUEUE_MAX);
  assert_int_equal(limited, many - SX_NOTICE_READ_QUEUE_MAX);
  while (sx_agent_notice_next(p.t.a, 0, &n) == 0)
    sx_notice_free(n), taken--;
  assert_int_equal(taken, 0);
  /* Cut off: the header and half the body, then the connection ends. */
  f.id = 3;
  sx__frame_encode(&f, hdr);
  assert_int_equal(sxt_wire_send(fd, hdr, sizeof(hdr)), 0);
  assert_int_equal(sxt_wire_send(fd, ok, len / 2), 0);
  close(fd);
  free(ok);
  wire_stop(&p, "hostile-0", 4, 9);
}

/* A reader that never lets the target read its notices cannot starve the
 * producers that push into it: read notices fill only their share of the
 * queue (SX_NOTICE_READ_QUEUE_MAX), a producer's write batch still
 * completes and its notice is queued, and once the target takes its
 * notices, read notices are accepted again. */
static void test_read_notice_share_leaves_room_for_writes(void **state) {
  (void)state;
  sxt_pair x;
  sxt_pair_start(&x, SXT_RW);
  sxt_pair_grant(&x);
  const sx_desc *d = sx_segment_desc(x.seg);
  uint8_t inc[SX_INCARNATION_LEN];
  memset(inc, 0x4d, sizeof(inc));
  size_t len;
  uint8_t *body = encode(SX_NOTICE_READ, "greedy-0", inc, 1, 2, 2 * per_block, &len);
  int fd = sxt_wire_connect(sxt_tcp_port(d));
  assert_int_equal(sxt_wire_hello(fd, d->incarnation, d->token, "greedy-0"), 0);
  /* As many as the whole queue holds, and more: only the share is taken. */
  const size_t many = SX_NOTICE_QUEUE_MAX + 8;
  size_t taken = 0, limited = 0;
  pipeline(fd, body, len, 1, many, &taken, &limited);
  assert_int_equal(taken, SX_NOTICE_READ_QUEUE_MAX);
  assert_int_equal(limited, many - SX_NOTICE_READ_QUEUE_MAX);
  /* A real reader's notifying batch fails; the target's refusal says
   * which bound it hit (the reader gets only the code). */
  sx_block_read e = kv_read(5, 0, 1);
  sx_batch_result r = finish(sxt_notify_submit(x.seg, &e, 1, 9, 5000));
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_ELIMIT);
  char msg[256] = "";
  assert_int_equal(sx__read_notice_in(x.c.a, "greedy-0", SX_TRANSPORT_TCP, body, len, msg,
                                      sizeof(msg)),
                   SX_ELIMIT);
  if (strstr(msg, "read notices") == NULL)
    fail_msg("the refusal does not name the read share: %s", msg);
  /* The producer's write batch completes, its notice queued behind them. */
  sx_block_write w = sxt_kv_write(3, 7, 2);
  r = sxt_run_write(x.seg, &w, 1, 0xabc, 5000);
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("write batch %s: %s", sx_batch_state_name(r.state), r.message);
  assert_int_equal(sxt_verify_write(&x.c, &x.p, &w), 0);
  sx_notice *n = NULL;
  for (size_t i = 0; i < SX_NOTICE_READ_QUEUE_MAX; i++) {
    sxt_ok(sx_agent_notice_next(x.c.a, 0, &n));
    assert_int_equal(n->kind, SX_NOTICE_READ);
    assert_string_equal(n->producer, "greedy-0");
    sx_notice_free(n);
  }
  sxt_expect_notice(x.c.a, &x.p, "prefill-0", 0xabc, &w, 1, 0);
  sxt_expect_no_notice(x.c.a);
  /* Taken: read notices are accepted again, up to the share once more. */
  taken = limited = 0;
  pipeline(fd, body, len, many + 1, SX_NOTICE_READ_QUEUE_MAX + 1, &taken, &limited);
  assert_int_equal(taken, SX_NOTICE_READ_QUEUE_MAX);
  assert_int_equal(limited, 1);
  close(fd);
  free(body);
  sxt_pair_stop(&x); /* frees what is queued */
}

/* ------------------------------------------------------------ races */

typedef struct ends {
  atomic_int calls, shutdown;
} ends;

/* A batch's callback that destroys it, counting how it ended. */
static void count_end(sx_batch *b, void *arg) {
  ends *en = arg;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  atomic_fetch_add(&en->calls, 1);
  if (res.state == SX_BATCH_FAILED && res.error == SX_ESHUTDOWN)
    atomic_fetch_add(&en->shutdown, 1);
  sx_batch_destroy(b);
}

static void *destroy_agent(void *arg) {
  sxt_agent_stop(arg);
  return NULL;
}

static void wait_in_cb(held_cb *h) {
  for (int i = 0; i < 5000 && !atomic_load(&h->in_cb); i++)
    usleep(1000);
  assert_true(atomic_load(&h->in_cb));
}

/* Many notifying batches at once on one segment, each with its own tag:
 * each completes, and the target holds exactly one notice per tag. */
static void test_read_notice_many_concurrent_batches(void **state) {
  (void)state;
  pair p;
  pair_start(&p, "many-0");
  enum { N = 48 };
  sx_batch *b[N];
  sx_block_read e[N];
  for (int i = 0; i < N; i++) {
    e[i] = kv_read((uint64_t)i, (uint64_t)i % SXT_READER_BLOCKS, 1);
    b[i] = submit(p.seg, &e[i], 1, 1, 1000 + (uint64_t)i, 10000);
  }
  for (int i = 0; i < N; i++)
    assert_int_equal(finish(b[i]).state, SX_BATCH_COMPLETED);
  uint64_t seen = 0;
  sx_notice *n = NULL;
  for (int i = 0; i < N; i++) {
    sxt_ok(sx_agent_notice_next(p.t.a, 2000, &n));
    assert_true(n->tag >= 1000 && n->tag < 1000 + N);
    assert_false(seen & (1ull << (n->tag - 1000)));
    seen |= 1ull << (n->tag - 1000);
    sx_notice_free(n);
  }
  sxt_expect_no_notice(p.t.a);
  pair_stop(&p);
}

/* Cancel racing the notice: submit, cancel at once or a little later, over
 * and over.  A batch that ends COMPLETED left its notice at the target; a
 * cancelled one may have (its notice was in flight, docs/push.md), never
 * twice; nothing leaks or is touched after it is freed. */
static void test_read_notice_cancel_races_the_notice(void **state) {
  (void)state;
  pair p;
  pair_start(&p, "race-0");
  enum { N = 120 };
  int completed[N] = {0};
  for (int i = 0; i < N; i++) {
    sx_block_read e = kv_read((uint64_t)i % SXT_TARGET_BLOCKS, (uint64_t)i % SXT_READER_BLOCKS,
                              1);
    sx_batch *b = submit(p.seg, &e, 1, 1, 5000 + (uint64_t)i, 10000);
    if (i % 4)
      usleep((useconds_t)(i % 4) * 150);
    sxt_ok(sx_batch_cancel(b));
    sx_batch_result r = finish(b);
    assert_true(r.state == SX_BATCH_COMPLETED || r.state == SX_BATCH_CANCELLED);
    completed[i] = r.state == SX_BATCH_COMPLETED;
  }
  /* Every notice the target got, once each. */
  int seen[N] = {0};
  sx_notice *n = NULL;
  while (sx_agent_notice_next(p.t.a, 300, &n) == 0) {
    assert_true(n->tag >= 5000 && n->tag < 5000 + N);
    assert_int_equal(seen[n->tag - 5000]++, 0);
    sx_notice_free(n);
  }
  for (int i = 0; i < N; i++)
    if (completed[i] && !seen[i])
      fail_msg("batch %d ended COMPLETED, the target has no notice of it", i);
  /* The connection still carries reads and notices. */
  sx_block_read e = kv_read(1, 1, 1);
  assert_int_equal(finish(submit(p.seg, &e, 1, 1, 9999, 5000)).state, SX_BATCH_COMPLETED);
  sxt_expect_read_notice(p.t.a, &p.r, "race-0", 9999, &e, 1, 0);
  pair_stop(&p);
}

/* Three notifying batches that destroy themselves, submitted on p's
 * segment once the target's loop is held in its notice callback by the
 * first one's notice (so the first waits for the answer to its notice,
 * the others for their reads). */
static void submit_held(pair *p, held_cb *h, ends *en) {
  memset(h, 0, sizeof(*h));
  sxt_ok(sx_agent_notice_cb(p->t.a, hold_notice, h));
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.cb = count_end;
  bp.cb_arg = en;
  bp.flags = SX_BATCH_NOTIFY;
  bp.timeout_ms = 20000;
  sx_block_read e = kv_read(0, 0, 2);
  for (int i = 0; i < 3; i++) {
    sx_batch *b;
    bp.tag = 50 + (uint64_t)i;
    sxt_ok(sx_batch_create(p->seg, &bp, &b));
    sxt_ok(sx_batch_add_blocks(b, &e, 1));
    sxt_ok(sx_batch_submit(b));
    if (i == 0)
      wait_in_cb(h);
  }
}

/* While notifying batches wait for the target's answer to their notice:
 * the segment closed under them (a misuse the API logs), and the reader
 * agent destroyed with them in flight.  Each batch ends exactly once
 * (SX_ESHUTDOWN at destroy, as sx_agent_destroy() promises), nothing is
 * touched after it is freed, and the target lives on. */
static void test_read_notice_reader_gone_while_notice_waits(void **state) {
  (void)state;
  pair p;
  held_cb h;
  ends en = {0};
  pair_start(&p, "gone-0");
  submit_held(&p, &h, &en);
  sx_segment_close(p.seg);
  p.seg = NULL;
  usleep(50000);
  atomic_store(&h.release, 1);
  for (int i = 0; i < 5000 && atomic_load(&en.calls) < 3; i++)
    usleep(1000);
  assert_int_equal(atomic_load(&en.calls), 3);
  sxt_ok(sx_agent_notice_cb(p.t.a, NULL, NULL));
  pair_stop(&p);

  ends en2 = {0};
  pair_start(&p, "gone-1");
  submit_held(&p, &h, &en2);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, destroy_agent, &p.r), 0);
  usleep(100000);
  atomic_store(&h.release, 1);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_int_equal(atomic_load(&en2.calls), 3);
  assert_int_equal(atomic_load(&en2.shutdown), 3);
  sxt_ok(sx_agent_notice_cb(p.t.a, NULL, NULL));
  sxt_agent_stop(&p.t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_read_notice_tcp_arrives_after_every_byte),
      cmocka_unit_test(test_read_notice_unnamed_reader),
      cmocka_unit_test(test_read_notice_flags_and_limits),
      cmocka_unit_test(test_read_notice_none_for_a_failed_batch),
      cmocka_unit_test(test_read_notice_reader_sends_none_after_a_failure),
      cmocka_unit_test(test_read_notice_none_when_timed_out_or_cancelled),
      cmocka_unit_test(test_read_notice_forged_ones_are_refused),
      cmocka_unit_test(test_read_notice_hostile_framing),
      cmocka_unit_test(test_read_notice_share_leaves_room_for_writes),
      cmocka_unit_test(test_read_notice_many_concurrent_batches),
      cmocka_unit_test(test_read_notice_cancel_races_the_notice),
      cmocka_unit_test(test_read_notice_reader_gone_while_notice_waits),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
