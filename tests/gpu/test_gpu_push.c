/*
 * GPU suite, push mode: a producer writes into a consumer's registered
 * memory, GPU memory on either side or both, over staged TCP (both agents
 * in this process) and over cuda_ipc (the producer is this binary run
 * again, driven over a pipe), with a real redis-server as the store.
 *
 * Every notice is checked from the consumer at the moment it is accepted:
 * the notice callback (on the consumer's agent thread, before the
 * producer's batch can complete) copies the destination blocks back and
 * compares them byte for byte, so a notice that came before its bytes
 * fails the test.  On the stand-in driver the device copies are slowed
 * down (FAKE_CUDA_DELAY_US) to widen any such window.  Refused writes (no
 * grant, read-only region, out of bounds, revoked) leave the destination
 * untouched; after sx_agent_revoke_write returns nothing lands any more
 * and the producer holds no mapping; a producer killed mid-batch gives no
 * notice and leaves nothing lent or mapped.
 */
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_fixture.h"
#include "internal.h"
#include "pattern.h"
#include "procs.h"
#include "push_fixture.h"
#include "redis_harness.h"
#include "transport/conn/frame.h"

#define SEED 0x9e57c0deu
#define LAYERS 2
#define BLOCKS 128
#define BB 65536
#define STAGING (1u << 20) /* chunks of 256 KiB: most ranges take several */

static sxt_redis redis;
static char url[256];
static char self[4096];

/* On the stand-in driver every asynchronous copy takes this long, so that
 * a notice sent before its copies ended would be seen (no effect on a GPU). */
#define FAKE_DELAY "200"

/* A batch's tag says what it writes, so the notice callback can check it:
 * seq << 48 | src << 32 | dst << 16 | count (blocks of every layer, K and V). */
static uint64_t tag_of(uint64_t seq, uint64_t src, uint64_t dst, uint64_t count) {
  return seq << 48 | src << 32 | dst << 16 | count;
}

static sx_block_write kv_write_tag(uint64_t tag) {
  return (sx_block_write){.layer_count = LAYERS, .slots = SXT_KV,
                          .local_block = (tag >> 32) & 0xffff,
                          .remote_block = (tag >> 16) & 0xffff, .count = tag & 0xffff};
}

/* ------------------------------------------------------------ consumer */

typedef struct consumer {
  sx_agent *a;
  gpu_pool pool;
  uint32_t pid[2]; /* the producer's K and V region ids */
  int checked, bad; /* notices checked in the callback, wrong ones (atomic) */
} consumer;

static int check_notice(void *arg, const sx_notice *n) {
  consumer *c = arg;
  if (n->tag >> 63)
    return 0; /* raw ranges: checked by the test itself */
  sx_block_write w = kv_write_tag(n->tag);
  /* Set by the test's thread (set_pid) before the producer writes: the
   * order reaches this thread through the sockets, which ThreadSanitizer
   * cannot see, so the ids are atomic. */
  uint32_t pid[2] = {__atomic_load_n(&c->pid[0], __ATOMIC_ACQUIRE),
                     __atomic_load_n(&c->pid[1], __ATOMIC_ACQUIRE)};
  int ok = n->n_blocks == 1 && n->n_ranges == 0 && n->blocks[0].block == w.remote_block &&
           n->blocks[0].count == w.count &&
           gpu_pool_check_written(&c->pool, pid, BLOCKS, SEED, w.local_block,
                                  w.remote_block, w.count) == 0;
  if (!ok)
    print_error("notice tag %lx came before its bytes (or is wrong)\n", (unsigned long)n->tag);
  __atomic_add_fetch(&c->checked, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&c->bad, !ok, __ATOMIC_SEQ_CST);
  return 0; /* queued as well */
}

static void consumer_start(consumer *c, const char *name, const char *location,
                           unsigned transports, uint32_t access) {
  memset(c, 0, sizeof(*c));
  c->a = gpu_agent(url, name, STAGING, transports);
  gpu_pool_make_access(&c->pool, c->a, location, LAYERS, BLOCKS, BB, 0, access);
  sxt_ok(sx_agent_notice_cb(c->a, check_notice, c));
  sxt_ok(sx_agent_publish(c->a, 0));
}

/* The producer's region ids, for the consumer's notice callback. */
static void set_pid(consumer *c, const uint32_t id[2]) {
  for (int s = 0; s < 2; s++)
    __atomic_store_n(&c->pid[s], id[s], __ATOMIC_RELEASE);
}

static void consumer_stop(consumer *c) {
  assert_int_equal(__atomic_load_n(&c->bad, __ATOMIC_SEQ_CST), 0); /* every notice checked */
  sx_agent_destroy(c->a);
  gpu_pool_free(&c->pool);
}

static void expect_notice(consumer *c, const char *producer, uint64_t tag,
                          sx_transport_kind via) {
  sx_notice *n = NULL;
  sxt_ok(sx_agent_notice_next(c->a, 5000, &n));
  assert_string_equal(n->producer, producer);
  assert_true(n->tag == tag);
  assert_int_equal(n->transport, via);
  sx_notice_free(n);
  assert_int_equal(__atomic_load_n(&c->bad, __ATOMIC_SEQ_CST), 0);
}

static void expect_no_notice(consumer *c, int ms) {
  sx_notice *n = NULL;
  int rc = sx_agent_notice_next(c->a, ms, &n);
  if (rc == 0)
    fail_msg("unexpected notice from %s, tag %lx", n->producer, (unsigned long)n->tag);
  assert_int_equal(rc, SX_ETIMEDOUT);
}

/* ------------------------------------------------------------ the producer process */

static void out(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void out(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  fflush(stdout);
}

static sx_batch_result p_write(sx_segment *seg, uint64_t tag) {
  sx_block_write w = kv_write_tag(tag);
  return sxt_run_write(seg, &w, 1, tag, 10000);
}

/* argv: producer URL NAME LOCATION TRANSPORTS.  Says "ready K V" (its
 * region ids) once published, then obeys lines on stdin; each answer is one
 * line: "write SEG TAG" and "read SEG" answer "done STATE ERROR VIA MAPS";
 * "maps" answers "maps N"; "loop SEG" writes batches of 8 blocks with
 * rotating sources and destinations until it is killed; "exit". */
static int producer_main(char **argv) {
  sx_agent_params p;
  sxt_params(&p, argv[2], argv[3]);
  p.listen = "127.0.0.1:0";
  p.staging_bytes = STAGING;
  if (atoi(argv[5]) != 0)
    p.transports = (unsigned)atoi(argv[5]);
  sx_agent *a;
  if (sx_agent_create(&p, &a) != 0) {
    fprintf(stderr, "producer: %s\n", sx_errmsg());
    return 1;
  }
  gpu_pool pool;
  gpu_pool_make(&pool, a, argv[4], LAYERS, BLOCKS, BB, SEED);
  if (sx_agent_publish(a, 0) != 0) {
    fprintf(stderr, "producer: %s\n", sx_errmsg());
    return 1;
  }
  out("ready %u %u\n", pool.id[0], pool.id[1]);
  char line[256], name[128];
  sx_segment *seg = NULL;
  unsigned long long tag;
  while (fgets(line, sizeof(line), stdin) != NULL) {
    sx_batch_result r = {0};
    if (sscanf(line, "write %127s %llx", name, &tag) == 2 ||
        sscanf(line, "read %127s", name) == 1 || sscanf(line, "loop %127s", name) == 1) {
      int rc = seg == NULL ? sx_segment_open(a, name, 5000, &seg) : 0;
      if (rc != 0) {
        fprintf(stderr, "producer: %s\n", sx_errmsg());
        out("done %d %d %d %ld\n", SX_BATCH_FAILED, rc, 0, sx__mem_ipc_open_count());
        continue;
      }
    }
    if (strncmp(line, "write", 5) == 0) {
      r = p_write(seg, tag);
    } else if (strncmp(line, "read", 4) == 0) {
      sx_block_read e = {.layer_count = LAYERS, .slots = SXT_KV, .count = 4};
      r = sxt_run_batch(seg, &e, 1, 10000);
    } else if (strncmp(line, "loop", 4) == 0) {
      for (uint64_t t = 1;; t++) {
        r = p_write(seg, tag_of(t, t % 7 * 8, t % 8 * 8, 8));
        out("done %d %d %d %ld\n", r.state, r.error, r.transport, sx__mem_ipc_open_count());
      }
    } else if (strncmp(line, "maps", 4) == 0) {
      out("maps %ld\n", sx__mem_ipc_open_count());
      continue;
    } else {
      break;
    }
    if (r.state != SX_BATCH_COMPLETED)
      fprintf(stderr, "producer: %s\n", r.message);
    out("done %d %d %d %ld\n", r.state, r.error, r.transport, sx__mem_ipc_open_count());
  }
  sx_segment_close(seg);
  sx_agent_destroy(a);
  gpu_pool_free(&pool);
  return 0;
}

typedef struct producer {
  pid_t pid;
  FILE *in, *out;
  uint32_t id[2];
} producer;

static void producer_start(producer *p, const char *name, const char *location,
                           unsigned transports) {
  char tr[16];
  snprintf(tr, sizeof(tr), "%u", transports);
  const char *argv[] = {"test_gpu_push", "producer", url, name, location, tr, NULL};
  p->pid = gpu_spawn(self, argv, &p->in, &p->out);
  char line[64];
  if (fgets(line, sizeof(line), p->out) == NULL ||
      sscanf(line, "ready %u %u", &p->id[0], &p->id[1]) != 2)
    fail_msg("the producer (%s on %s) did not start", name, location);
}

typedef struct answer {
  int state, error, via;
  long maps;
} answer;

static answer producer_do(producer *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static answer producer_do(producer *p, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(p->in, fmt, ap);
  va_end(ap);
  fputc('\n', p->in);
  fflush(p->in);
  char line[128];
  answer a = {-1, 0, 0, -1};
  if (fgets(line, sizeof(line), p->out) == NULL ||
      (sscanf(line, "done %d %d %d %ld", &a.state, &a.error, &a.via, &a.maps) != 4 &&
       sscanf(line, "maps %ld", &a.maps) != 1))
    fail_msg("the producer did not answer");
  return a;
}

static void producer_end(producer *p, int sig) {
  if (sig)
    kill(p->pid, sig);
  else
    fprintf(p->in, "exit\n");
  fclose(p->in);
  fclose(p->out);
  int st;
  waitpid(p->pid, &st, 0);
  if (!sig)
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* ------------------------------------------------------------ staged TCP */

typedef struct pair {
  consumer c;
  sx_agent *pa;
  gpu_pool p;
  sx_segment *seg;
} pair;

/* A consumer "push-c" at cloc and a producer "push-p" at ploc in this
 * process (so TCP), the consumer opened by the producer; granted or not. */
static void pair_start(pair *x, const char *ploc, const char *cloc, uint32_t access,
                       int grant) {
  consumer_start(&x->c, "push-c", cloc, SX_TRANSPORTS_TCP, access);
  x->pa = gpu_agent(url, "push-p", STAGING, SX_TRANSPORTS_TCP);
  gpu_pool_make(&x->p, x->pa, ploc, LAYERS, BLOCKS, BB, SEED);
  sxt_ok(sx_agent_publish(x->pa, 0));
  set_pid(&x->c, x->p.id);
  if (grant)
    sxt_ok(sx_agent_grant_write(x->c.a, "push-p", NULL));
  sxt_ok(sx_segment_open(x->pa, "push-c", 5000, &x->seg));
  assert_int_equal(sx_segment_transport(x->seg), SX_TRANSPORT_TCP);
}

static void pair_stop(pair *x) {
  sx_segment_close(x->seg);
  sx_agent_destroy(x->pa);
  gpu_pool_free(&x->p);
  consumer_stop(&x->c);
}

static void write_ok(pair *x, uint64_t tag) {
  sx_batch_result r = p_write(x->seg, tag);
  if (r.state != SX_BATCH_COMPLETED)
    fail_msg("write %lx: %s", (unsigned long)tag, r.message);
  assert_int_equal(r.transport, SX_TRANSPORT_TCP);
  expect_notice(&x->c, "push-p", tag, SX_TRANSPORT_TCP);
  sx_block_write w = kv_write_tag(tag);
  assert_int_equal(gpu_pool_check_written(&x->c.pool, x->p.id, BLOCKS, SEED, w.local_block,
                                          w.remote_block, w.count), 0);
}

static void tcp_directions(const char *ploc, const char *cloc) {
  pair x;
  pair_start(&x, ploc, cloc, SXT_RW, 1);
  /* One block, runs across several chunks, a whole layer. */
  write_ok(&x, tag_of(1, 3, 90, 1));
  write_ok(&x, tag_of(2, 17, 5, 9));
  assert_int_equal(gpu_pool_zero(&x.c.pool, 91, 5), 0); /* the rest is untouched */
  write_ok(&x, tag_of(3, 0, 0, BLOCKS));
  /* Raw ranges at odd offsets, crossing chunk boundaries. */
  uint64_t len = 3 * (STAGING / 4) + 99;
  sx_range_write rw = {.local = x.p.mem[0] + 12345, .remote_region = x.c.pool.id[1],
                       .offset = 777, .length = len};
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = SX_BATCH_WRITE;
  bp.tag = 1ull << 63;
  sx_batch *b;
  sxt_ok(sx_batch_create(x.seg, &bp, &b));
  sxt_ok(sx_batch_add_range_writes(b, &rw, 1));
  sxt_ok(sx_batch_submit(b));
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result r;
  sxt_ok(sx_batch_result_get(b, &r));
  assert_int_equal(r.state, SX_BATCH_COMPLETED);
  sx_batch_destroy(b);
  sx_notice *n;
  sxt_ok(sx_agent_notice_next(x.c.a, 5000, &n));
  assert_int_equal(n->n_ranges, 1);
  sx_notice_free(n);
  uint8_t *h = malloc(len);
  assert_non_null(h);
  sxt_ok(strcmp(cloc, "cpu") == 0 ? (memcpy(h, x.c.pool.mem[1] + 777, len), 0)
                                  : sx__mem_copy(h, x.c.pool.mem[1] + 777, len));
  assert_int_equal(sx__pattern_check(h, len, SEED, x.p.id[0], 12345, NULL), 0);
  free(h);
  assert_int_equal(__atomic_load_n(&x.c.checked, __ATOMIC_SEQ_CST), 3);
  pair_stop(&x);
}

static void test_gpu_push_tcp_host_to_gpu(void **state) {
  (void)state;
  tcp_directions("cpu", "cuda:0");
}

static void test_gpu_push_tcp_gpu_to_host(void **state) {
  (void)state;
  tcp_directions("cuda:0", "cpu");
}

static void test_gpu_push_tcp_gpu_to_gpu(void **state) {
  (void)state;
  tcp_directions("cuda:0", "cuda:0");
  if (gpu_devices() >= 2)
    tcp_directions("cuda:1", "cuda:0");
}

/* Refusals over TCP into GPU memory land nothing: no grant, revoked,
 * and (raw frames, past the producer's planner) a read-only region, out
 * of bounds; a read-only destination is refused at planning too. */
static void test_gpu_push_tcp_refused(void **state) {
  (void)state;
  pair x;
  pair_start(&x, "cuda:0", "cuda:0", SXT_RW, 0);
  uint64_t tag = tag_of(1, 4, 10, 6);
  sx_batch_result r = p_write(x.seg, tag);
  assert_int_equal(r.state, SX_BATCH_FAILED);
  assert_int_equal(r.error, SX_EACCESS);
  assert_int_equal(gpu_pool_zero(&x.c.pool, 10, 6), 0);
  expect_no_notice(&x.c, 100);
  sxt_ok(sx_agent_grant_write(x.c.a, "push-p", NULL));
  write_ok(&x, tag_of(2, 4, 10, 6));
  sxt_ok(sx_agent_revoke_write(x.c.a, "push-p", NULL));
  r = p_write(x.seg, tag_of(3, 4, 30, 6));
  assert_int_equal(r.error, SX_EACCESS);
  assert_int_equal(gpu_pool_zero(&x.c.pool, 30, 6), 0);
  expect_no_notice(&x.c, 100);
  sxt_ok(sx_agent_grant_write(x.c.a, "push-p", NULL));
  write_ok(&x, tag_of(4, 4, 30, 6));
  pair_stop(&x);

  /* A read-only GPU consumer: the planner refuses, and so does the
   * consumer itself for raw WRITEs, before any byte lands. */
  pair_start(&x, "cpu", "cuda:0", SX_ACCESS_REMOTE_READ, 1);
  sx_block_write w = kv_write_tag(tag_of(5, 0, 0, 2));
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.flags = SX_BATCH_WRITE;
  sx_batch *b;
  sxt_ok(sx_batch_create(x.seg, &bp, &b));
  sxt_rc(sx_batch_add_block_writes(b, &w, 1), SX_EDENIED);
  sx_batch_destroy(b);
  sx_desc cd, pd;
  sxt_ok(sx_agent_descriptor(x.c.a, &cd));
  sxt_ok(sx_agent_descriptor(x.pa, &pd));
  int fd = sxt_wire_connect(sxt_tcp_port(&cd));
  assert_int_equal(sxt_wire_hello(fd, cd.incarnation, cd.token, "push-p"), 0);
  assert_int_equal(sxt_wire_wauth(fd, pd.incarnation, pd.token), 0);
  uint8_t *junk = malloc(BB);
  assert_non_null(junk);
  memset(junk, 0xab, BB);
  assert_int_equal(sxt_wire_write(fd, 1, x.c.pool.id[0], 0, junk, BB), SX_EDENIED);
  close(fd);
  assert_int_equal(gpu_pool_zero(&x.c.pool, 0, 2), 0);
  pair_stop(&x);
  sx_desc_free(&cd);
  sx_desc_free(&pd);

  /* Writable, raw: out of bounds refused, a good WRITE lands (staged). */
  pair_start(&x, "cpu", "cuda:0", SXT_RW, 1);
  sxt_ok(sx_agent_descriptor(x.c.a, &cd));
  sxt_ok(sx_agent_descriptor(x.pa, &pd));
  fd = sxt_wire_connect(sxt_tcp_port(&cd));
  assert_int_equal(sxt_wire_hello(fd, cd.incarnation, cd.token, "push-p"), 0);
  assert_int_equal(sxt_wire_wauth(fd, pd.incarnation, pd.token), 0);
  uint64_t region_len = (uint64_t)LAYERS * BLOCKS * BB;
  assert_int_equal(sxt_wire_write(fd, 2, x.c.pool.id[0], region_len - BB / 2, junk, BB),
                   SX_EBOUNDS);
  assert_int_equal(gpu_pool_zero(&x.c.pool, BLOCKS - 1, 1), 0);
  assert_int_equal(sxt_wire_write(fd, 3, x.c.pool.id[0], BB, junk, BB), 0);
  uint8_t *h = malloc(BB);
  assert_non_null(h);
  sxt_ok(sx__mem_copy(h, x.c.pool.mem[0] + BB, BB));
  assert_memory_equal(h, junk, BB);
  free(h);
  close(fd);
  free(junk);
  sx_desc_free(&cd);
  sx_desc_free(&pd);
  pair_stop(&x);
}

/* Revoke while a staged batch into GPU memory runs: from the moment the
 * revoke returns, not one more byte changes, and no notice comes. */
static void test_gpu_push_tcp_revoke_in_flight(void **state) {
  (void)state;
  setenv("FAKE_CUDA_DELAY_US", "3000", 1);
  pair x;
  pair_start(&x, "cuda:0", "cuda:0", SXT_RW, 1);
  uint64_t tag = tag_of(1, 0, 0, BLOCKS);
  sx_block_write w = kv_write_tag(tag);
  sx_batch *b = sxt_write_submit(x.seg, &w, 1, tag, 20000);
  sxt_sleep_ms(2);
  sxt_ok(sx_agent_revoke_write(x.c.a, "push-p", NULL));
  uint8_t *before = gpu_pool_snapshot(&x.c.pool);
  sxt_ok(sx_batch_wait(b, -1));
  sx_batch_result r;
  sxt_ok(sx_batch_result_get(b, &r));
  sx_batch_destroy(b);
  sxt_sleep_ms(50);
  uint8_t *after = gpu_pool_snapshot(&x.c.pool);
  assert_memory_equal(before, after, 2ull * LAYERS * BLOCKS * BB);
  free(before);
  free(after);
  /* On a GPU it may have ended first; slowed down, it cannot have. */
  if (gpu_on_stand_in()) {
    assert_int_equal(r.state, SX_BATCH_FAILED);
    assert_int_equal(r.error, SX_EACCESS);
  }
  print_message("revoke during a staged batch: the batch ended %s (%s)\n",
                sx_batch_state_name(r.state), sx_err_name(r.error));
  if (r.state == SX_BATCH_COMPLETED)
    expect_notice(&x.c, "push-p", tag, SX_TRANSPORT_TCP);
  else
    expect_no_notice(&x.c, 100);
  assert_int_equal(__atomic_load_n(&x.c.bad, __ATOMIC_SEQ_CST), 0);
  pair_stop(&x);
  setenv("FAKE_CUDA_DELAY_US", FAKE_DELAY, 1);
}

/* A raw WRITE of 1 MiB whose payload is half sent when the producer's
 * grant is revoked: what arrived before the revoke may land (host memory:
 * all of it; GPU memory: the chunks already full, whose copies the revoke
 * waited for), nothing after it does, and the reply says SX_EACCESS. */
static void revoke_mid_write(const char *cloc) {
  pair x;
  pair_start(&x, "cpu", cloc, SXT_RW, 1);
  sx_desc cd, pd;
  sxt_ok(sx_agent_descriptor(x.c.a, &cd));
  sxt_ok(sx_agent_descriptor(x.pa, &pd));
  int fd = sxt_wire_connect(sxt_tcp_port(&cd));
  assert_int_equal(sxt_wire_hello(fd, cd.incarnation, cd.token, "push-p"), 0);
  assert_int_equal(sxt_wire_wauth(fd, pd.incarnation, pd.token), 0);
  const uint64_t len = 1u << 20, sent = 600u << 10, chunk = STAGING / 4;
  uint8_t *data = malloc(len), hdr[SX__FRAME_HDR];
  assert_non_null(data);
  sx__pattern_fill(data, len, SEED, 99, 0);
  sx__frame f = {.type = SX__FRAME_WRITE, .id = 1, .region = x.c.pool.id[0], .length = len};
  sx__frame_encode(&f, hdr);
  assert_int_equal(sxt_wire_send(fd, hdr, sizeof(hdr)), 0);
  assert_int_equal(sxt_wire_send(fd, data, sent), 0);
  sxt_sleep_ms(200); /* received by now */
  sxt_ok(sx_agent_revoke_write(x.c.a, "push-p", NULL));
  uint8_t *before = gpu_pool_snapshot(&x.c.pool);
  assert_int_equal(sxt_wire_send(fd, data + sent, len - sent), 0);
  assert_int_equal(sxt_wire_recv(fd, hdr, sizeof(hdr)), 0);
  assert_int_equal(sx__frame_decode(hdr, sizeof(hdr), &f), SX__FRAME_HDR);
  assert_int_equal(f.type, SX__FRAME_WRITE_REPLY);
  assert_int_equal(f.status, SX_EACCESS);
  uint8_t *after = gpu_pool_snapshot(&x.c.pool);
  assert_memory_equal(before, after, 2ull * LAYERS * BLOCKS * BB);
  uint64_t landed = strcmp(cloc, "cpu") == 0 ? sent : sent / chunk * chunk;
  assert_memory_equal(after, data, landed);
  for (uint64_t i = landed; i < len; i++)
    if (after[i] != 0)
      fail_msg("%s: byte %lu landed after the revoke", cloc, (unsigned long)i);
  free(before);
  free(after);
  free(data);
  close(fd);
  sx_desc_free(&cd);
  sx_desc_free(&pd);
  expect_no_notice(&x.c, 50);
  pair_stop(&x);
}

static void test_gpu_push_tcp_revoke_mid_write(void **state) {
  (void)state;
  revoke_mid_write("cpu");
  revoke_mid_write("cuda:0");
}

/* ------------------------------------------------------------ cuda_ipc */

static void ipc_write_ok(consumer *c, producer *p, const char *pname, uint64_t tag) {
  answer a = producer_do(p, "write ipc-c %lx", (unsigned long)tag);
  if (a.state != SX_BATCH_COMPLETED)
    fail_msg("write %lx: state %d error %s", (unsigned long)tag, a.state, sx_err_name(a.error));
  assert_int_equal(a.via, SX_TRANSPORT_CUDA_IPC);
  assert_true(a.maps >= 1);
  expect_notice(c, pname, tag, SX_TRANSPORT_CUDA_IPC);
  sx_block_write w = kv_write_tag(tag);
  assert_int_equal(gpu_pool_check_written(&c->pool, p->id, BLOCKS, SEED, w.local_block,
                                          w.remote_block, w.count), 0);
}

static void ipc_between(const char *ploc, const char *cloc) {
  consumer c;
  consumer_start(&c, "ipc-c", cloc, 0, SXT_RW);
  sxt_ok(sx_agent_grant_write(c.a, "ipc-p", NULL));
  producer p;
  producer_start(&p, "ipc-p", ploc, 0);
  set_pid(&c, p.id);
  ipc_write_ok(&c, &p, "ipc-p", tag_of(1, 3, 90, 1));
  ipc_write_ok(&c, &p, "ipc-p", tag_of(2, 17, 5, 9));
  assert_int_equal(gpu_pool_zero(&c.pool, 91, 5), 0);
  ipc_write_ok(&c, &p, "ipc-p", tag_of(3, 0, 0, BLOCKS));
  /* The consumer maps nothing: the producer does the copies. */
  assert_int_equal(sx__mem_ipc_open_count(), 0);
  producer_end(&p, 0);
  consumer_stop(&c);
}

static void test_gpu_push_ipc_one_gpu(void **state) {
  (void)state;
  ipc_between("cuda:0", "cuda:0");
  ipc_between("cpu", "cuda:0"); /* host sources, copied by device 0 */
}

static void test_gpu_push_ipc_two_gpus(void **state) {
  (void)state;
  if (gpu_devices() < 2)
    skip();
  ipc_between("cuda:1", "cuda:0");
  ipc_between("cuda:0", "cuda:1");
}

/* Handles of writable allocations go only to granted producers: without a
 * grant a write is refused and a named reader gets no handle either (so
 * holds no mapping); a revoke takes the mappings back before it returns,
 * and a grant given again makes writes work again. */
static void test_gpu_push_ipc_refused_and_revoked(void **state) {
  (void)state;
  consumer c;
  consumer_start(&c, "ipc-c", "cuda:0", 0, SXT_RW);
  producer p;
  producer_start(&p, "ipc-r", "cuda:0", 0);
  set_pid(&c, p.id);
  answer a = producer_do(&p, "write ipc-c %lx", (unsigned long)tag_of(1, 4, 10, 6));
  assert_int_equal(a.state, SX_BATCH_FAILED);
  assert_int_equal(a.error, SX_EACCESS);
  assert_int_equal(a.via, SX_TRANSPORT_CUDA_IPC);
  assert_int_equal(a.maps, 0);
  a = producer_do(&p, "read ipc-c");
  assert_int_equal(a.state, SX_BATCH_FAILED);
  assert_int_equal(a.error, SX_EDENIED);
  assert_int_equal(a.maps, 0);
  assert_int_equal(gpu_pool_zero(&c.pool, 10, 6), 0);
  expect_no_notice(&c, 100);
  /* Granted: writes land, and the producer may read back over cuda_ipc. */
  sxt_ok(sx_agent_grant_write(c.a, "ipc-r", NULL));
  ipc_write_ok(&c, &p, "ipc-r", tag_of(2, 4, 10, 6));
  a = producer_do(&p, "read ipc-c");
  assert_int_equal(a.state, SX_BATCH_COMPLETED);
  /* Revoked: when the revoke returns, the producer has given every
   * mapping back (it holds none) and its next write lands nothing. */
  sxt_ok(sx_agent_revoke_write(c.a, "ipc-r", NULL));
  a = producer_do(&p, "maps");
  assert_int_equal(a.maps, 0);
  a = producer_do(&p, "write ipc-c %lx", (unsigned long)tag_of(3, 4, 30, 6));
  assert_int_equal(a.state, SX_BATCH_FAILED);
  assert_int_equal(a.error, SX_EACCESS);
  assert_int_equal(a.maps, 0);
  assert_int_equal(gpu_pool_zero(&c.pool, 30, 6), 0);
  expect_no_notice(&c, 100);
  sxt_ok(sx_agent_grant_write(c.a, "ipc-r", NULL));
  ipc_write_ok(&c, &p, "ipc-r", tag_of(4, 4, 30, 6));
  producer_end(&p, 0);
  consumer_stop(&c);
}

/* Revoke while a cuda_ipc batch runs: nothing changes after the revoke
 * returned, and the producer holds no mapping then. */
static void test_gpu_push_ipc_revoke_in_flight(void **state) {
  (void)state;
  setenv("FAKE_CUDA_DELAY_US", "20000", 1);
  consumer c;
  consumer_start(&c, "ipc-c", "cuda:0", 0, SXT_RW);
  sxt_ok(sx_agent_grant_write(c.a, "ipc-f", NULL));
  producer p;
  producer_start(&p, "ipc-f", "cuda:0", 0);
  set_pid(&c, p.id);
  ipc_write_ok(&c, &p, "ipc-f", tag_of(1, 0, 0, 1)); /* mapped now */
  /* Every block: on the stand-in, the copies take 40 ms or more. */
  fprintf(p.in, "write ipc-c %lx\n", (unsigned long)tag_of(2, 0, 0, BLOCKS));
  fflush(p.in);
  sxt_sleep_ms(10);
  sxt_ok(sx_agent_revoke_write(c.a, "ipc-f", NULL));
  uint8_t *before = gpu_pool_snapshot(&c.pool);
  char line[128];
  int st = -1, err = 0, via = 0;
  long maps = -1;
  assert_non_null(fgets(line, sizeof(line), p.out));
  assert_int_equal(sscanf(line, "done %d %d %d %ld", &st, &err, &via, &maps), 4);
  /* (On a GPU the batch may have ended before the revoke, mapped.) */
  assert_int_equal(producer_do(&p, "maps").maps, 0);
  uint8_t *after = gpu_pool_snapshot(&c.pool);
  assert_memory_equal(before, after, 2ull * LAYERS * BLOCKS * BB);
  free(before);
  free(after);
  if (gpu_on_stand_in()) {
    assert_int_equal(st, SX_BATCH_FAILED);
    assert_int_equal(err, SX_EACCESS);
  }
  print_message("revoke during a cuda_ipc batch: the batch ended %s (%s)\n",
                sx_batch_state_name((sx_batch_state)st), sx_err_name(err));
  if (st == SX_BATCH_COMPLETED)
    expect_notice(&c, "ipc-f", tag_of(2, 0, 0, BLOCKS), SX_TRANSPORT_CUDA_IPC);
  else
    expect_no_notice(&c, 100);
  assert_int_equal(__atomic_load_n(&c.bad, __ATOMIC_SEQ_CST), 0);
  producer_end(&p, 0);
  consumer_stop(&c);
  setenv("FAKE_CUDA_DELAY_US", FAKE_DELAY, 1);
}

/* SIGKILL a producer that writes batch after batch: every notice that
 * came was checked against its bytes when it came, none comes after, and
 * nothing stays lent (an unregister does not wait) or mapped here. */
static void producer_killed(unsigned transports, sx_transport_kind via) {
  setenv("FAKE_CUDA_DELAY_US", "500", 1);
  /* Names of their own per variant: a SIGKILLed producer holds its name
   * until its lease runs out, which may outlast this case. */
  char cname[32], pname[32];
  snprintf(cname, sizeof(cname), "kill-c-%s", via == SX_TRANSPORT_CUDA_IPC ? "ipc" : "tcp");
  snprintf(pname, sizeof(pname), "kill-p-%s", via == SX_TRANSPORT_CUDA_IPC ? "ipc" : "tcp");
  consumer c;
  consumer_start(&c, cname, "cuda:0", transports, SXT_RW);
  sxt_ok(sx_agent_grant_write(c.a, pname, NULL));
  producer p;
  producer_start(&p, pname, "cuda:0", transports);
  set_pid(&c, p.id);
  fprintf(p.in, "loop %s\n", cname);
  fflush(p.in);
  int seen = 0;
  for (int i = 0; i < 400 && seen < 3; i++) {
    sx_notice *n;
    if (sx_agent_notice_next(c.a, 50, &n) == 0) {
      assert_int_equal(n->transport, via);
      sx_notice_free(n);
      seen++;
    }
  }
  assert_int_equal(seen, 3);
  kill(p.pid, SIGKILL);
  waitpid(p.pid, NULL, 0);
  fclose(p.in);
  fclose(p.out);
  /* What was accepted before the kill may still be queued. */
  sx_notice *n;
  while (sx_agent_notice_next(c.a, 300, &n) == 0) {
    sx_notice_free(n);
    seen++;
  }
  assert_int_equal(__atomic_load_n(&c.checked, __ATOMIC_SEQ_CST), seen);
  assert_int_equal(__atomic_load_n(&c.bad, __ATOMIC_SEQ_CST), 0);
  expect_no_notice(&c, 300);
  assert_int_equal(sx__mem_ipc_open_count(), 0);
  uint64_t t0 = sx__mono_ms();
  sxt_ok(sx_agent_unregister(c.a, c.pool.id[0]));
  assert_true(sx__mono_ms() - t0 < 1000);
  consumer_stop(&c);
  setenv("FAKE_CUDA_DELAY_US", FAKE_DELAY, 1);
}

static void test_gpu_push_ipc_producer_killed(void **state) {
  (void)state;
  producer_killed(0, SX_TRANSPORT_CUDA_IPC);
}

static void test_gpu_push_tcp_producer_killed(void **state) {
  (void)state;
  producer_killed(SX_TRANSPORTS_TCP, SX_TRANSPORT_TCP);
}

static int setup(void **state) {
  (void)state;
  setenv("FAKE_CUDA_DELAY_US", FAKE_DELAY, 1);
  return gpu_store_setup(&redis, url, sizeof(url), "test_gpu_push", "gpupush");
}

static int teardown(void **state) {
  (void)state;
  sxt_redis_stop(&redis);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 6 && strcmp(argv[1], "producer") == 0)
    return producer_main(argv);
  if (realpath(argv[0], self) == NULL)
    snprintf(self, sizeof(self), "/proc/self/exe");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gpu_push_tcp_host_to_gpu),
      cmocka_unit_test(test_gpu_push_tcp_gpu_to_host),
      cmocka_unit_test(test_gpu_push_tcp_gpu_to_gpu),
      cmocka_unit_test(test_gpu_push_tcp_refused),
      cmocka_unit_test(test_gpu_push_tcp_revoke_in_flight),
      cmocka_unit_test(test_gpu_push_tcp_revoke_mid_write),
      cmocka_unit_test(test_gpu_push_tcp_producer_killed),
      cmocka_unit_test(test_gpu_push_ipc_one_gpu),
      cmocka_unit_test(test_gpu_push_ipc_two_gpus),
      cmocka_unit_test(test_gpu_push_ipc_refused_and_revoked),
      cmocka_unit_test(test_gpu_push_ipc_revoke_in_flight),
      cmocka_unit_test(test_gpu_push_ipc_producer_killed),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
