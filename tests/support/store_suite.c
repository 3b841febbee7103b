/* The backend-independent store integration suite.  See store_suite.h. */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "internal.h"
#include "store_suite.h"

/* ---------------------------------------------------------------- helpers */

void sxt_random_inc(uint8_t inc[SX_INCARNATION_LEN]) {
  assert_int_equal(sx__random(inc, SX_INCARNATION_LEN), 0);
}

void sxt_encoded_desc(const char *name, const uint8_t *inc, uint64_t gen, uint8_t **out,
                      size_t *len) {
  sx_desc d;
  sxt_desc_kv(&d, name, 4, 0, 4096, 16, 0);
  memcpy(d.incarnation, inc, SX_INCARNATION_LEN);
  d.generation = gen;
  sxt_ok(sx_desc_encode(&d, out, len));
  sx_desc_free(&d);
}

sx_publish_req sxt_req(const char *name, const uint8_t *inc, uint64_t gen,
                       const uint8_t *value, size_t len, uint32_t lease_ms,
                       int takeover) {
  sx_publish_req r = {name, inc, gen, value, len, lease_ms, takeover};
  return r;
}

int sxt_is_outage(int status) {
  return status == SX_EUNREACH || status == SX_ETIMEDOUT || status == SX_EIO ||
         status == SX_EDISCONN || status == SX_ESTORE;
}

/* One segment owner in a test: an incarnation, its value, its generation. */
typedef struct owner {
  const char *name;
  uint8_t inc[SX_INCARNATION_LEN];
  uint64_t gen;
  uint8_t *val;
  size_t len;
} owner;

static void owner_init(owner *o, const char *name, uint64_t gen) {
  o->name = name;
  o->gen = gen;
  sxt_random_inc(o->inc);
  sxt_encoded_desc(name, o->inc, gen, &o->val, &o->len);
}

/* Move to a new generation with a new value. */
static void owner_bump(owner *o, uint64_t gen) {
  free(o->val);
  o->gen = gen;
  sxt_encoded_desc(o->name, o->inc, gen, &o->val, &o->len);
}

static void owner_free(owner *o) { free(o->val); }

static int publish(sxt_store *s, const owner *o, uint32_t lease_ms, int takeover,
                   sxt_reply *r) {
  sx_publish_req req =
      sxt_req(o->name, o->inc, o->gen, o->val, o->len, lease_ms, takeover);
  return sxt_publish(s, &req, r);
}

/* Assert an op's status, showing the backend's message on a mismatch. */
#define assert_status(call, r, code)                                                     \
  do {                                                                                   \
    int st_ = (call);                                                                    \
    if (st_ != (code))                                                                   \
      fail_msg("%s = %s, expected %s: %s", #call, sx_err_name(st_), sx_err_name(code),   \
               (r)->message);                                                            \
  } while (0)

static void assert_value_is(const sxt_reply *r, const owner *o) {
  assert_int_equal(r->len, o->len);
  assert_memory_equal(r->value, o->val, o->len);
}

static uint32_t round_up_s(uint32_t ms) { return (ms + 999) / 1000 * 1000; }

/* ---------------------------------------------------------------- setup */

int sxt_suite_group_setup(void **state, const sxt_store_fixture *fx) {
  sxt_suite *su = calloc(1, sizeof(*su));
  if (su == NULL)
    return -1;
  su->fx = fx;
  int rc = fx->start(&su->server);
  if (rc == 1) {
    su->skip = 1;
    su->server = NULL;
  } else if (rc != 0) {
    free(su);
    return -1;
  }
  *state = su;
  return 0;
}

int sxt_suite_group_teardown(void **state) {
  sxt_suite *su = *state;
  if (su != NULL) {
    if (su->server)
      su->fx->stop(su->server);
    free(su);
  }
  return 0;
}

int sxt_suite_setup(void **state) {
  sxt_suite *su = *state;
  snprintf(su->ns, sizeof(su->ns), "t%d-%ld", ++su->seq, (long)getpid());
  return 0;
}

int sxt_suite_teardown(void **state) {
  sxt_suite *su = *state;
  if (su->server == NULL)
    return 0;
  /* A test that failed half-way may have left the server dead or frozen. */
  su->fx->kill(su->server, SIGCONT);
  char url[512];
  sxt_suite_url(su, "timeout_ms=3000", url, sizeof(url));
  sxt_store s;
  int ok = sxt_store_open(&s, url, 0) == 0 && sxt_store_wait_conn(&s, 1, 1, 5000) == 0;
  if (s.b != NULL || ok)
    sxt_store_close(&s);
  if (!ok)
    return su->fx->restart(su->server, 0);
  return 0;
}

sxt_suite *sxt_suite_get(void **state) {
  sxt_suite *su = *state;
  if (su->skip) {
    print_message("skipped: the %s server is not installed (make deps)\n", su->fx->name);
    skip();
  }
  return su;
}

void sxt_suite_url(const sxt_suite *su, const char *extra, char *buf, size_t size) {
  su->fx->url(su->server, su->ns, extra, buf, size);
}

static void open_store(sxt_suite *su, sxt_store *s, int watch) {
  char url[512];
  sxt_suite_url(su, NULL, url, sizeof(url));
  sxt_ok(sxt_store_open(s, url, 1));
  if (watch)
    sxt_ok(sxt_store_watch(s));
}

/* ---------------------------------------------------------------- tests */

void test_store_publish_get_list_unpublish(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s;
  sxt_reply r;
  owner a, b;
  owner_init(&a, "prefill-0/tp3", 1);
  owner_init(&b, "decode-1", 1);
  open_store(su, &s, 0);

  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_get(&s, a.name, &r), &r, 0);
  assert_value_is(&r, &a);
  assert_true(r.ttl_ms > 0 && r.ttl_ms <= (int64_t)round_up_s(5000));
  sxt_reply_free(&r);
  assert_status(publish(&s, &b, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);

  assert_status(sxt_list(&s, &r), &r, 0);
  assert_int_equal(r.n_items, 2);
  const sxt_item *ia = sxt_reply_item(&r, a.name), *ib = sxt_reply_item(&r, b.name);
  assert_non_null(ia);
  assert_non_null(ib);
  assert_int_equal(ia->len, a.len);
  assert_memory_equal(ia->value, a.val, a.len);
  assert_int_equal(ib->len, b.len);
  assert_memory_equal(ib->value, b.val, b.len);
  assert_true(ia->ttl_ms > 0 && ia->ttl_ms <= (int64_t)round_up_s(5000));
  sxt_reply_free(&r);

  assert_status(sxt_renew(&s, a.name, a.inc, 5000, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_unpublish(&s, a.name, a.inc, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_get(&s, a.name, &r), &r, SX_ENOENT);
  sxt_reply_free(&r);
  assert_status(sxt_list(&s, &r), &r, 0);
  assert_int_equal(r.n_items, 1);
  assert_non_null(sxt_reply_item(&r, b.name));
  sxt_reply_free(&r);
  assert_status(sxt_unpublish(&s, a.name, a.inc, &r), &r, SX_EGONE);
  sxt_reply_free(&r);
  assert_status(sxt_renew(&s, a.name, a.inc, 5000, &r), &r, SX_EGONE);
  sxt_reply_free(&r);
  assert_status(sxt_unpublish(&s, b.name, b.inc, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_list(&s, &r), &r, 0);
  assert_int_equal(r.n_items, 0);
  sxt_reply_free(&r);

  /* Names are checked before anything is sent. */
  sx_publish_req bad = sxt_req("/starts-with-slash", a.inc, 1, a.val, a.len, 5000, 0);
  assert_int_equal(sxt_publish(&s, &bad, &r), SX_ENAME);
  assert_int_equal(r.calls, 0);

  sxt_store_close(&s);
  owner_free(&a);
  owner_free(&b);
}

void test_store_name_conflict_names_holder(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s;
  sxt_reply r;
  owner a, b;
  owner_init(&a, "prefill-1", 3);
  owner_init(&b, "prefill-1", 1);
  open_store(su, &s, 0);

  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(publish(&s, &b, 5000, 0, &r), &r, SX_EHELD);
  assert_memory_equal(r.holder, a.inc, SX_INCARNATION_LEN);
  assert_true(r.holder_ttl_ms > 0 && r.holder_ttl_ms <= (int64_t)round_up_s(5000));
  assert_true(r.holder_age_ms < 5000);
  char hex[2 * SX_INCARNATION_LEN + 1];
  sx_hex(a.inc, SX_INCARNATION_LEN, hex);
  if (strstr(r.message, hex) == NULL)
    fail_msg("the message does not name the holder %s: %s", hex, r.message);
  sxt_reply_free(&r);

  /* The holder is untouched. */
  assert_status(sxt_get(&s, a.name, &r), &r, 0);
  assert_value_is(&r, &a);
  sxt_reply_free(&r);
  assert_status(sxt_renew(&s, a.name, a.inc, 5000, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_renew(&s, b.name, b.inc, 5000, &r), &r, SX_EFENCED);
  sxt_reply_free(&r);

  sxt_store_close(&s);
  owner_free(&a);
  owner_free(&b);
}

void test_store_takeover_fences_old_holder(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s, w;
  sxt_reply r;
  owner a, b;
  owner_init(&a, "pool/0", 1);
  owner_init(&b, "pool/0", 1);
  open_store(su, &s, 0);
  open_store(su, &w, 1);

  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(publish(&s, &b, 5000, 1, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_get(&s, a.name, &r), &r, 0);
  assert_value_is(&r, &b);
  sxt_reply_free(&r);

  /* The watcher hears of the new holder. */
  sx_event ev;
  uint8_t seen[SX_INCARNATION_LEN] = {0};
  while (memcmp(seen, b.inc, SX_INCARNATION_LEN) != 0) {
    if (sxt_store_take_event(&w, SX_EVENT_PUT, a.name, 10000, &ev) != 0)
      fail_msg("no PUT event for the new holder");
    memcpy(seen, ev.incarnation, SX_INCARNATION_LEN);
  }

  /* Everything the old holder does now fails as fenced. */
  assert_status(sxt_renew(&s, a.name, a.inc, 5000, &r), &r, SX_EFENCED);
  sxt_reply_free(&r);
  owner_bump(&a, 2);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, SX_EFENCED);
  sxt_reply_free(&r);
  assert_status(publish(&s, &a, 5000, 1, &r), &r, SX_EFENCED);
  sxt_reply_free(&r);
  assert_status(sxt_unpublish(&s, a.name, a.inc, &r), &r, SX_EFENCED);
  sxt_reply_free(&r);

  /* The new holder carries on; the old one stays fenced after it leaves. */
  assert_status(sxt_renew(&s, b.name, b.inc, 5000, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_unpublish(&s, b.name, b.inc, &r), &r, 0);
  sxt_reply_free(&r);
  owner_bump(&a, 3);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, SX_EFENCED);
  sxt_reply_free(&r);

  sxt_store_close(&w);
  sxt_store_close(&s);
  owner_free(&a);
  owner_free(&b);
}

void test_store_generation_must_grow(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s;
  sxt_reply r;
  owner a;
  owner_init(&a, "gen", 5);
  open_store(su, &s, 0);

  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, SX_EGENERATION);
  sxt_reply_free(&r);
  owner_bump(&a, 4);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, SX_EGENERATION);
  sxt_reply_free(&r);
  owner_bump(&a, 6);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_get(&s, a.name, &r), &r, 0);
  assert_value_is(&r, &a);
  sxt_reply_free(&r);

  /* Generations are unsigned 64-bit: no sign or double rounding. */
  owner_bump(&a, (1ull << 63) + 5);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  owner_bump(&a, (1ull << 63) + 4);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, SX_EGENERATION);
  sxt_reply_free(&r);
  owner_bump(&a, UINT64_MAX);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);

  sxt_store_close(&s);
  owner_free(&a);
}

void test_store_remove_fences_holder(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s, w;
  sxt_reply r;
  owner a, c;
  owner_init(&a, "stale-7", 1);
  owner_init(&c, "stale-7", 1);
  open_store(su, &s, 0);
  open_store(su, &w, 1);

  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, a.name, 10000, NULL), 0);
  assert_status(sxt_remove(&s, a.name, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_get(&s, a.name, &r), &r, SX_ENOENT);
  sxt_reply_free(&r);

  sx_event ev;
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_DELETE, a.name, 10000, &ev), 0);
  assert_memory_equal(ev.incarnation, a.inc, SX_INCARNATION_LEN);

  /* The removed holder is fenced: a zombie cannot renew it back. */
  assert_status(sxt_renew(&s, a.name, a.inc, 5000, &r), &r, SX_EFENCED);
  sxt_reply_free(&r);
  owner_bump(&a, 2);
  assert_status(publish(&s, &a, 5000, 0, &r), &r, SX_EFENCED);
  sxt_reply_free(&r);
  assert_status(sxt_remove(&s, a.name, &r), &r, SX_ENOENT);
  sxt_reply_free(&r);
  /* Someone else may take the name. */
  assert_status(publish(&s, &c, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);

  sxt_store_close(&w);
  sxt_store_close(&s);
  owner_free(&a);
  owner_free(&c);
}

/* The publishing child: its own loop and backend; publishes, says so on the
 * pipe, renews every lease/4 until it is killed.  Never returns. */
typedef struct child_ctx {
  sx_backend *b;
  owner *o;
  uint32_t lease_ms;
  int fd;
  int published;
} child_ctx;

static void child_published(void *arg, const sx_backend_reply *rep) {
  child_ctx *c = arg;
  if (rep->status != 0)
    _exit(3);
  if (!c->published) {
    c->published = 1;
    if (write(c->fd, "P", 1) != 1)
      _exit(4);
  }
}

static void child_renew(uv_timer_t *t) {
  child_ctx *c = t->data;
  if (c->published && sx__backend_renew(c->b, c->o->name, c->o->inc, c->lease_ms,
                                        child_published, c) != 0)
    _exit(5);
}

static void child_main(const char *url, owner *o, uint32_t lease_ms, int fd) {
  uv_loop_t loop;
  uv_timer_t t;
  child_ctx c = {NULL, o, lease_ms, fd, 0};
  if (uv_loop_init(&loop) != 0 || sx__backend_open(&loop, url, NULL, &c.b) != 0)
    _exit(2);
  sx_publish_req req = sxt_req(o->name, o->inc, o->gen, o->val, o->len, lease_ms, 0);
  if (sx__backend_publish(c.b, &req, child_published, &c) != 0)
    _exit(2);
  uv_timer_init(&loop, &t);
  t.data = &c;
  uv_timer_start(&t, child_renew, lease_ms / 4, lease_ms / 4);
  uv_run(&loop, UV_RUN_DEFAULT);
  _exit(6);
}

void test_store_lease_expires_after_owner_sigkill(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store w;
  sxt_reply r;
  owner a;
  const uint32_t lease = su->fx->short_lease_ms;
  char url[512];
  owner_init(&a, "crashy", 1);
  sxt_suite_url(su, NULL, url, sizeof(url));
  open_store(su, &w, 1);

  int p[2];
  assert_int_equal(pipe(p), 0);
  pid_t parent = getpid();
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    /* Whatever happens to the test, the child must not renew on forever. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
      _exit(7);
    close(p[0]);
    child_main(url, &a, lease, p[1]);
  }
  close(p[1]);
  struct pollfd pf = {p[0], POLLIN, 0};
  char ch = 0;
  int ready = poll(&pf, 1, SXT_OP_DEADLINE_MS) == 1 && read(p[0], &ch, 1) == 1;
  close(p[0]);
  if (!ready) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    fail_msg("the child did not publish");
  }
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, a.name, 10000, NULL), 0);

  /* Renewals keep it alive well past one lease. */
  sxt_store_run_for(&w, lease + lease / 2);
  assert_status(sxt_get(&w, a.name, &r), &r, 0);
  assert_value_is(&r, &a);
  sxt_reply_free(&r);
  assert_int_equal(sxt_store_count_events(&w, SX_EVENT_EXPIRED, a.name), 0);

  /* A crash: no unpublish, no more renewals. */
  kill(pid, SIGKILL);
  uint64_t t0 = sx__mono_ms();
  int st;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);

  /* Gone within one lease of the last renewal; the bound leaves room for
   * the store's expiry sweep on a loaded machine. */
  const uint64_t bound = 3ull * round_up_s(lease);
  int status;
  do {
    status = sxt_get(&w, a.name, &r);
    sxt_reply_free(&r);
    if (status == 0)
      sxt_store_run_for(&w, 100);
  } while (status == 0 && sx__mono_ms() - t0 < bound);
  uint64_t gone = sx__mono_ms() - t0;
  print_message("segment gone %llu ms after SIGKILL (lease %u ms)\n",
                (unsigned long long)gone, lease);
  assert_int_equal(status, SX_ENOENT);
  assert_true(gone <= bound);
  if (sxt_store_take_event(&w, SX_EVENT_EXPIRED, a.name, 10000, NULL) != 0)
    fail_msg("no EXPIRED event for %s", a.name);
  assert_int_equal(sxt_store_count_events(&w, SX_EVENT_DELETE, a.name), 0);

  sxt_store_close(&w);
  owner_free(&a);
}

void test_store_watch_reports_put_delete_expiry(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s, w;
  sxt_reply r;
  owner x, y;
  const uint32_t lease = su->fx->short_lease_ms;
  owner_init(&x, "watched", 1);
  owner_init(&y, "forgotten", 1);
  open_store(su, &s, 0);
  open_store(su, &w, 1);
  /* watch() is idempotent; open_store() waited for it to be in place. */
  sxt_ok(sx__backend_watch(w.b));

  sx_event ev;
  assert_status(publish(&s, &x, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, x.name, 10000, &ev), 0);
  assert_memory_equal(ev.incarnation, x.inc, SX_INCARNATION_LEN);
  assert_int_equal(ev.generation, 1);

  owner_bump(&x, 2);
  assert_status(publish(&s, &x, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, x.name, 10000, &ev), 0);
  assert_int_equal(ev.generation, 2);

  assert_status(sxt_unpublish(&s, x.name, x.inc, &r), &r, 0);
  sxt_reply_free(&r);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_DELETE, x.name, 10000, &ev), 0);
  assert_memory_equal(ev.incarnation, x.inc, SX_INCARNATION_LEN);

  /* Published and never renewed: it expires, and the watcher hears so. */
  uint64_t t0 = sx__mono_ms();
  assert_status(publish(&s, &y, lease, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, y.name, 10000, NULL), 0);
  if (sxt_store_take_event(&w, SX_EVENT_EXPIRED, y.name, 3 * round_up_s(lease) + 5000,
                           NULL) != 0)
    fail_msg("no EXPIRED event for %s", y.name);
  uint64_t took = sx__mono_ms() - t0;
  print_message("EXPIRED %llu ms after publish (lease %u ms)\n", (unsigned long long)took,
                lease);
  assert_true(took + 100 >= lease);
  assert_int_equal(sxt_store_count_events(&w, SX_EVENT_DELETE, y.name), 0);
  assert_int_equal(sxt_store_count_events(&w, SX_EVENT_EXPIRED, x.name), 0);

  sxt_store_close(&w);
  sxt_store_close(&s);
  owner_free(&x);
  owner_free(&y);
}

void test_store_restart_empty_renew_gone_republish(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store p, w;
  sxt_reply r;
  owner a;
  owner_init(&a, "survivor", 1);
  open_store(su, &p, 0);
  open_store(su, &w, 1);

  assert_status(publish(&p, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_int_equal(sxt_store_take_event(&w, SX_EVENT_PUT, a.name, 10000, NULL), 0);

  /* The store dies: errors are reported, never fatal. */
  assert_int_equal(su->fx->kill(su->server, SIGKILL), 0);
  int st = sxt_renew(&p, a.name, a.inc, 5000, &r);
  if (!sxt_is_outage(st))
    fail_msg("renew during an outage = %s: %s", sx_err_name(st), r.message);
  sxt_reply_free(&r);
  assert_int_equal(sxt_store_wait_conn(&p, 0, 1, 10000), 0);
  assert_true(sxt_is_outage(p.last_err));
  assert_int_equal(sxt_store_wait_conn(&w, 0, 1, 10000), 0);

  /* It comes back empty: both report "up" again by themselves. */
  assert_int_equal(su->fx->restart(su->server, 1), 0);
  assert_int_equal(sxt_store_wait_conn(&p, 1, 2, SXT_OP_DEADLINE_MS), 0);
  assert_int_equal(sxt_store_wait_conn(&w, 1, 2, SXT_OP_DEADLINE_MS), 0);

  /* What an agent does on "up": renew, learn the lease is gone, republish. */
  assert_status(sxt_renew(&p, a.name, a.inc, 5000, &r), &r, SX_EGONE);
  sxt_reply_free(&r);
  assert_status(publish(&p, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_get(&p, a.name, &r), &r, 0);
  assert_value_is(&r, &a);
  sxt_reply_free(&r);
  assert_status(sxt_renew(&p, a.name, a.inc, 5000, &r), &r, 0);
  sxt_reply_free(&r);

  /* The watcher is back too. */
  if (sxt_store_take_event(&w, SX_EVENT_PUT, a.name, SXT_OP_DEADLINE_MS, NULL) != 0)
    fail_msg("the watcher saw no PUT after the store came back");

  sxt_store_close(&w);
  sxt_store_close(&p);
  owner_free(&a);
}

void test_store_corrupt_value_returned_raw(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s;
  sxt_reply r;
  owner good, a;
  static const uint8_t junk[] = {0x0a, 0xff, 0x01, 'g', 'a', 'r', 'b', 0x00, 0x07};
  owner_init(&good, "fine", 1);
  owner_init(&a, "planted", 1);
  open_store(su, &s, 0);

  assert_int_equal(su->fx->plant(su->server, su->ns, "planted", junk, sizeof(junk)), 0);
  assert_status(publish(&s, &good, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);

  /* The backend hands back the bytes; decoding is the caller's. */
  assert_status(sxt_get(&s, "planted", &r), &r, 0);
  assert_int_equal(r.len, sizeof(junk));
  assert_memory_equal(r.value, junk, sizeof(junk));
  sx_desc d;
  assert_int_not_equal(sx_desc_decode(r.value, r.len, &d), 0);
  sxt_reply_free(&r);

  /* A listing carries it along with the good one. */
  assert_status(sxt_list(&s, &r), &r, 0);
  assert_int_equal(r.n_items, 2);
  const sxt_item *bad = sxt_reply_item(&r, "planted");
  assert_non_null(bad);
  assert_int_equal(bad->len, sizeof(junk));
  assert_memory_equal(bad->value, junk, sizeof(junk));
  assert_non_null(sxt_reply_item(&r, "fine"));
  sxt_reply_free(&r);

  /* An agent can claim the name over the junk. */
  assert_status(publish(&s, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_get(&s, "planted", &r), &r, 0);
  assert_value_is(&r, &a);
  sxt_reply_free(&r);

  sxt_store_close(&s);
  owner_free(&good);
  owner_free(&a);
}

/* A callback that only counts (for ops that outlive their store). */
static void count_cb(void *arg, const sx_backend_reply *rep) {
  sxt_reply *r = arg;
  r->calls++;
  r->status = rep->status;
}

void test_store_close_cancels_pending_ops(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s;
  owner a;
  owner_init(&a, "cancelled", 1);
  open_store(su, &s, 1);

  sxt_reply r[4];
  memset(r, 0, sizeof(r));
  sx_publish_req req = sxt_req(a.name, a.inc, a.gen, a.val, a.len, 5000, 0);
  sxt_ok(sx__backend_publish(s.b, &req, count_cb, &r[0]));
  sxt_ok(sx__backend_get(s.b, a.name, count_cb, &r[1]));
  sxt_ok(sx__backend_list(s.b, count_cb, &r[2]));
  sxt_ok(sx__backend_renew(s.b, a.name, a.inc, 5000, count_cb, &r[3]));
  /* Closing answers every op in flight, once, with SX_ECANCELED. */
  sxt_store_close(&s);
  for (int i = 0; i < 4; i++) {
    assert_int_equal(r[i].calls, 1);
    assert_int_equal(r[i].status, SX_ECANCELED);
  }
  owner_free(&a);
}

void test_store_unreachable_reports_errors(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s;
  sxt_reply r;
  owner a;
  char url[512];
  owner_init(&a, "nowhere", 1);
  su->fx->dead_url(su->server, su->ns, url, sizeof(url));
  sxt_ok(sxt_store_open(&s, url, 0));

  assert_int_equal(sxt_store_wait_conn(&s, 0, 1, SXT_OP_DEADLINE_MS), 0);
  assert_true(sxt_is_outage(s.last_err));
  assert_non_null(strstr(s.last_msg, "127.0.0.1"));
  assert_int_equal(s.n_up, 0);

  int st = sxt_get(&s, a.name, &r);
  if (!sxt_is_outage(st))
    fail_msg("get from a dead store = %s: %s", sx_err_name(st), r.message);
  assert_non_null(strstr(r.message, "127.0.0.1"));
  sxt_reply_free(&r);
  st = publish(&s, &a, 5000, 0, &r);
  assert_true(sxt_is_outage(st));
  sxt_reply_free(&r);
  st = sxt_list(&s, &r);
  assert_true(sxt_is_outage(st));
  sxt_reply_free(&r);

  sxt_store_close(&s);
  owner_free(&a);
}

void test_store_namespaces_are_isolated(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s1, s2;
  sxt_reply r;
  owner a, b;
  char url[512], ns2[80];
  owner_init(&a, "shared-name", 1);
  owner_init(&b, "shared-name", 1);
  open_store(su, &s1, 0);
  snprintf(ns2, sizeof(ns2), "%s-other", su->ns);
  su->fx->url(su->server, ns2, NULL, url, sizeof(url));
  sxt_ok(sxt_store_open(&s2, url, 1));
  sxt_ok(sxt_store_watch(&s2));

  assert_status(publish(&s1, &a, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  assert_status(sxt_get(&s2, a.name, &r), &r, SX_ENOENT);
  sxt_reply_free(&r);
  assert_status(sxt_list(&s2, &r), &r, 0);
  assert_int_equal(r.n_items, 0);
  sxt_reply_free(&r);
  assert_status(publish(&s2, &b, 5000, 0, &r), &r, 0);
  sxt_reply_free(&r);
  /* s2 hears only of its own namespace. */
  sx_event ev;
  assert_int_equal(sxt_store_take_event(&s2, SX_EVENT_PUT, b.name, 10000, &ev), 0);
  assert_memory_equal(ev.incarnation, b.inc, SX_INCARNATION_LEN);
  sxt_store_run_for(&s2, 300);
  assert_int_equal(sxt_store_count_events(&s2, SX_EVENT_PUT, a.name), 1);

  sxt_store_close(&s2);
  sxt_store_close(&s1);
  owner_free(&a);
  owner_free(&b);
}

void test_store_racing_claims_one_wins(void **state) {
  sxt_suite *su = sxt_suite_get(state);
  sxt_store s1, s2;
  open_store(su, &s1, 0);
  open_store(su, &s2, 0);
  int wins[2] = {0, 0};
  for (int round = 0; round < 10; round++) {
    char name[32];
    snprintf(name, sizeof(name), "race-%d", round);
    owner a, b;
    owner_init(&a, name, 1);
    owner_init(&b, name, 1);
    /* Both claims are in flight at once, from two clients. */
    sxt_reply ra, rb, rg;
    memset(&ra, 0, sizeof(ra));
    memset(&rb, 0, sizeof(rb));
    sx_publish_req qa = sxt_req(name, a.inc, 1, a.val, a.len, 30000, 0);
    sx_publish_req qb = sxt_req(name, b.inc, 1, b.val, b.len, 30000, 0);
    sxt_ok(sx__backend_publish(s1.b, &qa, sxt_reply_cb, &ra));
    sxt_ok(sx__backend_publish(s2.b, &qb, sxt_reply_cb, &rb));
    sxt_store *stores[2] = {&s1, &s2};
    sxt_reply *replies[2] = {&ra, &rb};
    assert_int_equal(sxt_stores_await(stores, 2, replies, 2, SXT_OP_DEADLINE_MS), 0);
    assert_int_equal(ra.calls, 1);
    assert_int_equal(rb.calls, 1);
    /* Exactly one wins; the other is told who holds the name. */
    const owner *winner = ra.status == 0 ? &a : &b;
    const sxt_reply *loser = ra.status == 0 ? &rb : &ra;
    if (!((ra.status == 0) ^ (rb.status == 0)))
      fail_msg("round %d: statuses %s and %s", round, sx_err_name(ra.status),
               sx_err_name(rb.status));
    assert_status(loser->status, loser, SX_EHELD);
    assert_memory_equal(loser->holder, winner->inc, SX_INCARNATION_LEN);
    wins[winner == &b]++;
    assert_status(sxt_get(&s1, name, &rg), &rg, 0);
    assert_value_is(&rg, winner);
    sxt_reply_free(&rg);
    sxt_reply_free(&ra);
    sxt_reply_free(&rb);
    owner_free(&a);
    owner_free(&b);
  }
  print_message("first client won %d, second %d of 10 races\n", wins[0], wins[1]);
  sxt_store_close(&s2);
  sxt_store_close(&s1);
}
