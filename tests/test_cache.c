/* The resolver cache over the in-process mem:// store. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "cache.h"
#include "internal.h"
#include "sxtest.h"

typedef struct env {
  uv_loop_t loop;
  sx_backend *b; /* the cache's backend (watching) */
  sx_backend *w; /* a writer, like another agent */
  sx_cache *c;
  int drop_events; /* pretend the event channel lost them */
  int events_seen;
} env;

static int store_seq;

static void on_event(void *arg, const sx_event *ev) {
  env *e = arg;
  e->events_seen++;
  if (!e->drop_events && e->c != NULL)
    sx__cache_event(e->c, ev);
}

static void env_init(env *e, const sx_cache_params *cp) {
  memset(e, 0, sizeof(*e));
  assert_int_equal(uv_loop_init(&e->loop), 0);
  char url[64];
  snprintf(url, sizeof(url), "mem://cache-%d", store_seq++);
  sx_backend_hooks h = {.on_event = on_event, .arg = e};
  sxt_ok(sx__backend_open(&e->loop, url, &h, &e->b));
  sxt_ok(sx__backend_open(&e->loop, url, NULL, &e->w));
  sxt_ok(sx__cache_create(&e->loop, e->b, cp, &e->c));
}

static void env_free(env *e) {
  sx__cache_close(e->c);
  sx__backend_close(e->b);
  sx__backend_close(e->w);
  uv_run(&e->loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&e->loop), 0);
}

/* Run the loop until *flag or ms pass. */
static void run_until(env *e, const int *flag, uint64_t ms) {
  uint64_t end = sx__mono_ms() + ms;
  while ((flag == NULL || !*flag) && sx__mono_ms() < end)
    uv_run(&e->loop, UV_RUN_ONCE);
}

static void run_for(env *e, uint64_t ms) { run_until(e, NULL, ms); }

typedef struct op_result {
  int done, status;
} op_result;

static void op_cb(void *arg, const sx_backend_reply *rep) {
  op_result *r = arg;
  r->status = rep->status;
  r->done = 1;
}

static int publish_raw(env *e, const char *name, uint8_t inc, uint64_t gen,
                       const uint8_t *val, size_t len, uint32_t lease_ms) {
  uint8_t incarnation[SX_INCARNATION_LEN];
  memset(incarnation, inc, sizeof(incarnation));
  sx_publish_req req = {.name = name, .incarnation = incarnation, .generation = gen,
                        .value = val, .len = len, .lease_ms = lease_ms, .takeover = 1};
  op_result r = {0};
  sxt_ok(sx__backend_publish(e->w, &req, op_cb, &r));
  run_until(e, &r.done, 5000);
  assert_true(r.done);
  return r.status;
}

/* Publish a valid descriptor named `as` under `name`. */
static void publish_as(env *e, const char *name, const char *as, uint8_t inc,
                       uint64_t gen, uint32_t lease_ms) {
  sx_desc d;
  sxt_desc_kv(&d, as, 4, 0, 4096, 16, 0);
  memset(d.incarnation, inc, sizeof(d.incarnation));
  d.generation = gen;
  d.lease_ms = lease_ms;
  uint8_t *buf;
  size_t len;
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  sxt_ok(publish_raw(e, name, inc, gen, buf, len, lease_ms));
  free(buf);
  sx_desc_free(&d);
}

static void publish(env *e, const char *name, uint8_t inc, uint64_t gen) {
  publish_as(e, name, name, inc, gen, 60000);
}

static void unpublish(env *e, const char *name, uint8_t inc) {
  uint8_t incarnation[SX_INCARNATION_LEN];
  memset(incarnation, inc, sizeof(incarnation));
  op_result r = {0};
  sxt_ok(sx__backend_unpublish(e->w, name, incarnation, op_cb, &r));
  run_until(e, &r.done, 5000);
  sxt_ok(r.status);
}

typedef struct res {
  int done, status;
  sx_cdesc *d;
  char msg[512];
  uint64_t at_ms;
} res;

static void res_cb(void *arg, int status, sx_cdesc *d, const char *msg) {
  res *r = arg;
  r->done++;
  r->status = status;
  r->d = d;
  r->at_ms = sx__mono_ms();
  snprintf(r->msg, sizeof(r->msg), "%s", msg ? msg : "");
}

static void resolve_wait(env *e, const char *name, unsigned flags, uint32_t wait_ms,
                         res *r) {
  memset(r, 0, sizeof(*r));
  sxt_ok(sx__cache_resolve(e->c, name, flags, wait_ms, res_cb, r));
  assert_int_equal(r->done, 0); /* never inside the call */
  run_until(e, &r->done, wait_ms + 5000);
  assert_int_equal(r->done, 1);
}

static uint64_t fetches(env *e) {
  sx_cache_stats st;
  sx__cache_stats(e->c, &st);
  return st.fetches;
}

static void test_cache_resolve_hits_after_one_fetch(void **state) {
  (void)state;
  env e;
  env_init(&e, NULL);
  publish(&e, "prefill-0", 1, 1);
  res r;
  resolve_wait(&e, "prefill-0", 0, 0, &r);
  sxt_ok(r.status);
  assert_string_equal(r.d->desc.name, "prefill-0");
  assert_int_equal(r.d->desc.generation, 1);
  assert_int_equal(fetches(&e), 1);
  res r2;
  resolve_wait(&e, "prefill-0", 0, 0, &r2);
  sxt_ok(r2.status);
  assert_ptr_equal(r2.d, r.d); /* the same decoded descriptor, shared */
  sx_cdesc *p = sx__cache_peek(e.c, "prefill-0");
  assert_ptr_equal(p, r.d);
  assert_int_equal(fetches(&e), 1);
  sx__cdesc_unref(p);
  sx__cdesc_unref(r.d);
  sx__cdesc_unref(r2.d);
  env_free(&e);
}

static void test_cache_concurrent_resolves_make_one_request(void **state) {
  (void)state;
  env e;
  env_init(&e, NULL);
  publish(&e, "prefill-1", 1, 1);
  res r[10];
  memset(r, 0, sizeof(r));
  for (int i = 0; i < 10; i++)
    sxt_ok(sx__cache_resolve(e.c, "prefill-1", 0, 0, res_cb, &r[i]));
  int all = 0;
  uint64_t end = sx__mono_ms() + 5000;
  while (!all && sx__mono_ms() < end) {
    uv_run(&e.loop, UV_RUN_ONCE);
    all = 1;
    for (int i = 0; i < 10; i++)
      all &= r[i].done == 1;
  }
  assert_true(all);
  assert_int_equal(fetches(&e), 1);
  for (int i = 0; i < 10; i++) {
    sxt_ok(r[i].status);
    assert_ptr_equal(r[i].d, r[0].d);
    sx__cdesc_unref(r[i].d);
  }
  /* Forced refreshes (after transport failures) are single-flight too. */
  memset(r, 0, sizeof(r));
  for (int i = 0; i < 5; i++)
    sxt_ok(sx__cache_resolve(e.c, "prefill-1", SX_CACHE_REFRESH, 0, res_cb, &r[i]));
  run_until(&e, &r[4].done, 5000);
  assert_int_equal(fetches(&e), 2);
  for (int i = 0; i < 5; i++) {
    assert_int_equal(r[i].done, 1);
    sxt_ok(r[i].status);
    sx__cdesc_unref(r[i].d);
  }
  env_free(&e);
}

static void test_cache_put_event_replaces_entry(void **state) {
  (void)state;
  env e;
  env_init(&e, NULL);
  publish(&e, "prefill-2", 1, 1);
  res r;
  resolve_wait(&e, "prefill-2", 0, 0, &r);
  sxt_ok(r.status);
  sx_cdesc *old = r.d;
  int seen = e.events_seen;
  publish(&e, "prefill-2", 1, 2);
  while (e.events_seen == seen)
    run_for(&e, 10);
  /* Dropped at once: no one is served generation 1 any more. */
  assert_null(sx__cache_peek(e.c, "prefill-2"));
  resolve_wait(&e, "prefill-2", 0, 0, &r);
  sxt_ok(r.status);
  assert_int_equal(r.d->desc.generation, 2);
  /* Whoever opened the old one keeps a valid copy. */
  assert_int_equal(old->desc.generation, 1);
  assert_string_equal(old->desc.name, "prefill-2");
  sx__cdesc_unref(old);
  sx__cdesc_unref(r.d);
  /* A put of an older generation than the one held changes nothing. */
  sx_event ev = {.kind = SX_EVENT_PUT, .generation = 1};
  strcpy(ev.name, "prefill-2");
  memset(ev.incarnation, 1, sizeof(ev.incarnation));
  sx__cache_event(e.c, &ev);
  sx_cdesc *p = sx__cache_peek(e.c, "prefill-2");
  assert_non_null(p);
  sx__cdesc_unref(p);
  env_free(&e);
}

static void test_cache_delete_event_and_negative_caching(void **state) {
  (void)state;
  sx_cache_params cp;
  sx__cache_params_init(&cp);
  cp.negative_ms = 300;
  env e;
  env_init(&e, &cp);
  publish(&e, "prefill-3", 1, 1);
  res r;
  resolve_wait(&e, "prefill-3", 0, 0, &r);
  sxt_ok(r.status);
  sx__cdesc_unref(r.d);
  int seen = e.events_seen;
  unpublish(&e, "prefill-3", 1);
  while (e.events_seen == seen)
    run_for(&e, 10);
  assert_null(sx__cache_peek(e.c, "prefill-3"));
  uint64_t f = fetches(&e);
  resolve_wait(&e, "prefill-3", 0, 0, &r);
  assert_int_equal(r.status, SX_ENOENT);
  assert_null(r.d);
  assert_non_null(strstr(r.msg, "prefill-3"));
  /* Not found is remembered briefly: no request for a while... */
  resolve_wait(&e, "prefill-3", 0, 0, &r);
  assert_int_equal(r.status, SX_ENOENT);
  assert_int_equal(fetches(&e), f);
  /* ...and only briefly. */
  run_for(&e, 400);
  resolve_wait(&e, "prefill-3", 0, 0, &r);
  assert_int_equal(r.status, SX_ENOENT);
  assert_int_equal(fetches(&e), f + 1);
  env_free(&e);
}

static void test_cache_entries_expire_after_ttl_and_lease(void **state) {
  (void)state;
  sx_cache_params cp;
  sx__cache_params_init(&cp);
  cp.ttl_ms = 100;
  env e;
  env_init(&e, &cp);
  publish(&e, "prefill-4", 1, 1);
  res r;
  resolve_wait(&e, "prefill-4", 0, 0, &r);
  sxt_ok(r.status);
  sx__cdesc_unref(r.d);
  run_for(&e, 200);
  assert_null(sx__cache_peek(e.c, "prefill-4"));
  resolve_wait(&e, "prefill-4", 0, 0, &r);
  sxt_ok(r.status);
  sx__cdesc_unref(r.d);
  assert_int_equal(fetches(&e), 2);
  env_free(&e);

  /* A long TTL is cut to the descriptor's lease, even with no events. */
  env_init(&e, NULL);
  e.drop_events = 1;
  publish_as(&e, "prefill-5", "prefill-5", 1, 1, 150);
  resolve_wait(&e, "prefill-5", 0, 0, &r);
  sxt_ok(r.status);
  sx__cdesc_unref(r.d);
  sx_cdesc *p = sx__cache_peek(e.c, "prefill-5");
  assert_non_null(p);
  sx__cdesc_unref(p);
  run_for(&e, 300);
  assert_null(sx__cache_peek(e.c, "prefill-5"));
  env_free(&e);
}

typedef struct later {
  env *e;
  const char *name;
  uv_timer_t t;
} later;

static void publish_later_cb(uv_timer_t *t) {
  later *l = t->data;
  sx_desc d;
  sxt_desc_kv(&d, l->name, 4, 0, 4096, 16, 0);
  uint8_t *buf;
  size_t len;
  sxt_ok(sx_desc_encode(&d, &buf, &len));
  sx_publish_req req = {.name = l->name, .incarnation = d.incarnation, .generation = 1,
                        .value = buf, .len = len, .lease_ms = 60000};
  static op_result ignore;
  sxt_ok(sx__backend_publish(l->e->w, &req, op_cb, &ignore));
  free(buf);
  sx_desc_free(&d);
  uv_close((uv_handle_t *)t, NULL);
}

static void publish_after(env *e, later *l, const char *name, uint64_t ms) {
  l->e = e;
  l->name = name;
  uv_timer_init(&e->loop, &l->t);
  l->t.data = l;
  uv_timer_start(&l->t, publish_later_cb, ms, 0);
}

static void test_cache_wait_is_woken_by_the_put_event(void **state) {
  (void)state;
  sx_cache_params cp;
  sx__cache_params_init(&cp);
  cp.recheck_ms = 60000; /* only the event can wake it in this test */
  env e;
  env_init(&e, &cp);
  later l;
  publish_after(&e, &l, "late-0", 100);
  uint64_t t0 = sx__mono_ms();
  res r;
  resolve_wait(&e, "late-0", 0, 30000, &r);
  sxt_ok(r.status);
  assert_string_equal(r.d->desc.name, "late-0");
  assert_true(r.at_ms - t0 < 20000);
  assert_int_equal(fetches(&e), 2); /* the first miss, then the event's fetch */
  sx__cdesc_unref(r.d);
  env_free(&e);
}

static void test_cache_wait_rechecks_slowly_when_the_event_is_lost(void **state) {
  (void)state;
  sx_cache_params cp;
  sx__cache_params_init(&cp);
  cp.recheck_ms = 200;
  env e;
  env_init(&e, &cp);
  e.drop_events = 1;
  later l;
  publish_after(&e, &l, "late-1", 50);
  res r;
  resolve_wait(&e, "late-1", 0, 30000, &r);
  sxt_ok(r.status);
  sx__cdesc_unref(r.d);
  uint64_t f = fetches(&e);
  assert_true(f >= 2);
  /* Rechecks are slow: in ~200 ms steps, not a tight loop. */
  assert_true(f <= 10);
  env_free(&e);
}

static void test_cache_wait_times_out_with_enoent(void **state) {
  (void)state;
  sx_cache_params cp;
  sx__cache_params_init(&cp);
  cp.recheck_ms = 100;
  env e;
  env_init(&e, &cp);
  uint64_t t0 = sx__mono_ms();
  res r;
  resolve_wait(&e, "never", 0, 300, &r);
  assert_int_equal(r.status, SX_ENOENT);
  assert_true(r.at_ms - t0 >= 250);
  assert_true(fetches(&e) <= 10);
  env_free(&e);
}

static void test_cache_rejects_corrupt_values(void **state) {
  (void)state;
  env e;
  env_init(&e, NULL);
  static const uint8_t junk[] = "this is not a descriptor";
  sxt_ok(publish_raw(&e, "corrupt", 1, 1, junk, sizeof(junk), 60000));
  res r;
  resolve_wait(&e, "corrupt", 0, 0, &r);
  assert_true(r.status == SX_EDECODE || r.status == SX_EVERSION);
  assert_null(r.d);
  assert_non_null(strstr(r.msg, "corrupt"));
  /* A valid descriptor stored under another segment's name. */
  publish_as(&e, "victim", "impostor", 2, 1, 60000);
  resolve_wait(&e, "victim", 0, 0, &r);
  assert_int_equal(r.status, SX_EDECODE);
  assert_non_null(strstr(r.msg, "impostor"));
  sxt_rc(sx__cache_resolve(e.c, "/bad name", 0, 0, res_cb, &r), SX_ENAME);
  env_free(&e);
}

/* A refresh that reads the very bytes the cached descriptor came from
 * hands out that descriptor again (no decode); any other bytes, even of the
 * same length, are decoded and checked anew. */
static void test_cache_refresh_of_the_same_bytes_reuses_the_descriptor(void **state) {
  (void)state;
  env e;
  env_init(&e, NULL);
  e.drop_events = 1; /* only the bytes read may tell a change */
  publish(&e, "prefill-9", 1, 2);
  res r1, r2, r3, r4;
  resolve_wait(&e, "prefill-9", 0, 0, &r1);
  sxt_ok(r1.status);
  resolve_wait(&e, "prefill-9", SX_CACHE_REFRESH, 0, &r2);
  sxt_ok(r2.status);
  assert_int_equal(fetches(&e), 2);
  assert_ptr_equal(r2.d, r1.d);
  /* Generation 3 encodes to as many bytes as 2. */
  publish(&e, "prefill-9", 1, 3);
  resolve_wait(&e, "prefill-9", SX_CACHE_REFRESH, 0, &r3);
  sxt_ok(r3.status);
  assert_ptr_not_equal(r3.d, r1.d);
  assert_int_equal(r3.d->raw_len, r1.d->raw_len);
  assert_int_equal(r3.d->desc.generation, 3);
  assert_int_equal(r1.d->desc.generation, 2); /* its holders keep theirs */
  /* Bad bytes after good ones: an error, never the old descriptor. */
  static const uint8_t junk[] = "this is not a descriptor";
  sxt_ok(publish_raw(&e, "prefill-9", 1, 4, junk, sizeof(junk), 60000));
  resolve_wait(&e, "prefill-9", SX_CACHE_REFRESH, 0, &r4);
  assert_true(r4.status == SX_EDECODE || r4.status == SX_EVERSION);
  assert_null(r4.d);
  sx__cdesc_unref(r1.d);
  sx__cdesc_unref(r2.d);
  sx__cdesc_unref(r3.d);
  env_free(&e);
}

static void test_cache_invalidate_by_incarnation(void **state) {
  (void)state;
  env e;
  env_init(&e, NULL);
  publish(&e, "prefill-6", 7, 1);
  res r;
  resolve_wait(&e, "prefill-6", 0, 0, &r);
  sxt_ok(r.status);
  uint8_t other[SX_INCARNATION_LEN];
  memset(other, 8, sizeof(other));
  sx__cache_invalidate(e.c, "prefill-6", other);
  sx_cdesc *p = sx__cache_peek(e.c, "prefill-6");
  assert_non_null(p);
  sx__cdesc_unref(p);
  sx__cache_invalidate(e.c, "prefill-6", r.d->desc.incarnation);
  assert_null(sx__cache_peek(e.c, "prefill-6"));
  sx__cdesc_unref(r.d);
  /* After a flush (store reconnected) everything is re-read. */
  resolve_wait(&e, "prefill-6", 0, 0, &r);
  sx__cdesc_unref(r.d);
  sx__cache_flush(e.c);
  assert_null(sx__cache_peek(e.c, "prefill-6"));
  env_free(&e);
}

/* Closing while a store read is in flight: the waiter hears SX_ECANCELED
 * at once, and the read's late answer frees what it names (valgrind and
 * the sanitizers check it is neither leaked nor used after free). */
static void test_cache_close_with_a_store_read_in_flight(void **state) {
  (void)state;
  env e;
  env_init(&e, NULL);
  publish(&e, "inflight-1", 1, 1);
  res r;
  memset(&r, 0, sizeof(r));
  sxt_ok(sx__cache_resolve(e.c, "inflight-1", SX_CACHE_REFRESH, 0, res_cb, &r));
  assert_int_equal(fetches(&e), 1);
  sx__cache_close(e.c); /* before the loop ran: the read is still out */
  e.c = NULL;
  assert_int_equal(r.done, 1);
  assert_int_equal(r.status, SX_ECANCELED);
  assert_null(r.d);
  uv_run(&e.loop, UV_RUN_NOWAIT); /* the store answers a cache that is gone */
  sx__backend_close(e.b);
  sx__backend_close(e.w);
  uv_run(&e.loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&e.loop), 0);
}

static void test_cache_close_cancels_waiters(void **state) {
  (void)state;
  env e;
  env_init(&e, NULL);
  res r;
  memset(&r, 0, sizeof(r));
  sxt_ok(sx__cache_resolve(e.c, "never-1", 0, 60000, res_cb, &r));
  run_for(&e, 50);
  assert_int_equal(r.done, 0);
  sx__cache_close(e.c);
  e.c = NULL;
  assert_int_equal(r.done, 1);
  assert_int_equal(r.status, SX_ECANCELED);
  sx__backend_close(e.b);
  sx__backend_close(e.w);
  uv_run(&e.loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&e.loop), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cache_resolve_hits_after_one_fetch),
      cmocka_unit_test(test_cache_concurrent_resolves_make_one_request),
      cmocka_unit_test(test_cache_put_event_replaces_entry),
      cmocka_unit_test(test_cache_delete_event_and_negative_caching),
      cmocka_unit_test(test_cache_entries_expire_after_ttl_and_lease),
      cmocka_unit_test(test_cache_wait_is_woken_by_the_put_event),
      cmocka_unit_test(test_cache_wait_rechecks_slowly_when_the_event_is_lost),
      cmocka_unit_test(test_cache_wait_times_out_with_enoent),
      cmocka_unit_test(test_cache_rejects_corrupt_values),
      cmocka_unit_test(test_cache_refresh_of_the_same_bytes_reuses_the_descriptor),
      cmocka_unit_test(test_cache_invalidate_by_incarnation),
      cmocka_unit_test(test_cache_close_with_a_store_read_in_flight),
      cmocka_unit_test(test_cache_close_cancels_waiters),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
