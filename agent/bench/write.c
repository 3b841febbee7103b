/*
 * sx-bench read --op write: the writer's side of the comparison.  read.c
 * runs the cases as it does for reads, with this process as a named
 * producer writing into the target's pool (docs/push.md); the baselines
 * are perftest's ib_write_bw on the same device (read_base.c) and, for
 * TCP, the raw stream the other way round: this process sends chunks of
 * its own (filled) memory and the target receives them into its pool, with
 * as many connections and a thread per connection on each side.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "pattern.h"
#include "rawproto.h"
#include "read.h"
#include "segxfer/push.h"

int bx_write_batch(sx_segment *seg, const sx_block_read *ent, size_t n, sx_batch **out) {
  sx_block_write *w = malloc((n ? n : 1) * sizeof(*w));
  if (w == NULL)
    return SX_ENOMEM;
  for (size_t i = 0; i < n; i++)
    w[i] = (sx_block_write){.group = ent[i].group, .layer_first = ent[i].layer_first,
                            .layer_count = ent[i].layer_count, .slots = ent[i].slots,
                            .local_block = ent[i].local_block,
                            .remote_block = ent[i].remote_block, .count = ent[i].count};
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = 30000;
  bp.flags = SX_BATCH_WRITE;
  int rc = sx_batch_create(seg, &bp, out);
  if (rc == 0 && (rc = sx_batch_add_block_writes(*out, w, n)) == 0)
    rc = sx_batch_submit(*out);
  free(w);
  return rc;
}

/* ------------------------------------------------------------ raw stream, reversed */

typedef struct swriter {
  pthread_t th;
  int fd;
  const uint8_t *buf;
  uint64_t chunk, slots;
  atomic_uint_fast64_t bytes;
  atomic_int stop;
  int failed;
} swriter;

static void *swriter_main(void *arg) {
  swriter *s = arg;
  uint64_t slot = 0;
  while (!atomic_load_explicit(&s->stop, memory_order_relaxed)) {
    if (bx_send_all(s->fd, s->buf + slot * s->chunk, (size_t)s->chunk) != 0) {
      s->failed = 1;
      break;
    }
    atomic_fetch_add_explicit(&s->bytes, s->chunk, memory_order_relaxed);
    slot = (slot + 1) % s->slots;
  }
  return NULL;
}

static uint64_t sent(swriter *s, int n) {
  uint64_t b = 0;
  for (int i = 0; i < n; i++)
    b += atomic_load_explicit(&s[i].bytes, memory_order_relaxed);
  return b;
}

int bx_raw_sink(bx_tproc *t, const bx_stream_req *q, bx_caseres *out, char *err,
                size_t esize) {
  swriter *s = calloc((size_t)q->conns, sizeof(*s));
  uint8_t **bufs = calloc((size_t)q->conns, sizeof(*bufs));
  int rc = -1, started = 0;
  memset(out, 0, sizeof(*out));
  if (s == NULL || bufs == NULL) {
    free(s);
    free(bufs);
    return -1;
  }
  for (uint32_t i = 0; i < q->conns; i++) {
    s[i].fd = -1;
    s[i].chunk = q->size;
    s[i].slots = q->dst_bytes / q->size ? q->dst_bytes / q->size : 1;
    /* Filled, as the writer's sources are: untouched pages would all be
     * the one zero page, cache-hot and unfairly cheap to send. */
    bufs[i] = malloc((size_t)(s[i].slots * q->size));
    if (bufs[i] != NULL)
      sx__pattern_fill(bufs[i], s[i].slots * q->size, q->seed, i, 0);
    s[i].buf = bufs[i];
    s[i].fd = bx_raw_connect(t->raw_port);
    if (bufs[i] == NULL || s[i].fd < 0 || bx_raw_req(s[i].fd, BX_RAW_SINK, q->size, q->group)) {
      snprintf(err, esize, "raw stream to the target: cannot connect");
      goto out;
    }
    if (pthread_create(&s[i].th, NULL, swriter_main, &s[i]) != 0) {
      snprintf(err, esize, "raw stream to the target: cannot start a thread");
      goto out;
    }
    started = (int)i + 1;
  }
  struct timespec w = {0, 150000000};
  nanosleep(&w, NULL);
  double t0 = bx_now(), c0 = bx_cpu_self(), tc0 = bx_target_cpu(t);
  uint64_t b0 = sent(s, started);
  struct timespec d = {(time_t)q->secs, (long)((q->secs - (double)(time_t)q->secs) * 1e9)};
  nanosleep(&d, NULL);
  uint64_t b1 = sent(s, started);
  double t1 = bx_now(), c1 = bx_cpu_self(), tc1 = bx_target_cpu(t);
  out->secs = t1 - t0;
  out->bytes = b1 - b0;
  out->blocks = out->bytes / q->size;
  out->cpu_reader = c1 - c0;
  out->cpu_target = tc0 >= 0 && tc1 >= tc0 ? tc1 - tc0 : -1;
  rc = 0;
out:
  for (int i = 0; i < started; i++)
    atomic_store(&s[i].stop, 1);
  for (uint32_t i = 0; i < q->conns; i++)
    if (s[i].fd >= 0)
      shutdown(s[i].fd, SHUT_RDWR); /* wakes a sender blocked in send() */
  for (int i = 0; i < started; i++) {
    pthread_join(s[i].th, NULL);
    if (s[i].failed && rc == 0 && !atomic_load(&s[i].stop)) {
      snprintf(err, esize, "raw stream to the target: the connection broke");
      rc = -1;
    }
  }
  for (uint32_t i = 0; i < q->conns; i++) {
    if (s[i].fd >= 0)
      close(s[i].fd);
    free(bufs[i]);
  }
  free(bufs);
  free(s);
  return rc;
}
