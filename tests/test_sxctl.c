/*
 * sxctl run as a binary (BUILD/bin/sxctl) against each store backend (a
 * real redis-server, a real 3+3 Redis Cluster, then a real etcd, from the
 * store fixtures): human
 * output checked, --json parsed with jansson, exit codes.  The same tests
 * run for both; what differs is only the URL.
 */
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "etcd_harness.h"
#include "procs.h"
#include "redis_cluster_harness.h"
#include "redis_harness.h"
#include "sxtest.h"

/* The backend of the group running now. */
static const sxt_store_fixture *fx;
static void *server;
static int have_server;
static char sxctl[PATH_MAX + 32];
static char url[512];
static char tmpdir[128];

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Run sxctl with args (a shell fragment); capture stdout and stderr. */
static int run(char **out, char **err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int run(char **out, char **err, const char *fmt, ...) {
  char args[16384], cmd[PATH_MAX + 16896], opath[200], epath[200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof(args), fmt, ap);
  va_end(ap);
  snprintf(opath, sizeof(opath), "%s/out", tmpdir);
  snprintf(epath, sizeof(epath), "%s/err", tmpdir);
  snprintf(cmd, sizeof(cmd), "%s %s >%s 2>%s", sxctl, args, opath, epath);
  int st = system(cmd);
  assert_true(WIFEXITED(st));
  const char *paths[2] = {opath, epath};
  char **dst[2] = {out, err};
  for (int i = 0; i < 2; i++) {
    FILE *f = fopen(paths[i], "r");
    assert_non_null(f);
    char *buf = calloc(1, 1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    if (dst[i])
      *dst[i] = buf;
    else
      free(buf);
  }
  return WEXITSTATUS(st);
}

static void desc_make(sx_desc *d, const char *name, uint8_t inc, const char *role,
                      uint64_t block_bytes, uint32_t lease_ms) {
  sxt_desc_kv(d, name, 8, 0, block_bytes, 32, 1);
  memset(d->incarnation, inc, SX_INCARNATION_LEN);
  d->lease_ms = lease_ms;
  d->published_at_ms = (uint64_t)time(NULL) * 1000;
  assert_int_equal(sx_desc_set_label(d, "role", role), 0);
}

static int group_setup_fx(const sxt_store_fixture *f) {
  fx = f;
  have_server = 0;
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0)
    return -1;
  self[n] = '\0';
  *strrchr(self, '/') = '\0'; /* BUILD/tests */
  snprintf(sxctl, sizeof(sxctl), "%s/../bin/sxctl", self);
  if (access(sxctl, X_OK) != 0) {
    fprintf(stderr, "test_sxctl: %s is not built\n", sxctl);
    return -1;
  }
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/sxt-sxctl-XXXXXX");
  if (mkdtemp(tmpdir) == NULL)
    return -1;
  int rc = fx->start(&server);
  if (rc == 1) {
    fprintf(stderr, "test_sxctl: the %s server is not installed (make deps): tests "
            "skipped\n", fx->name);
    return 0;
  }
  if (rc != 0)
    return -1;
  have_server = 1;
  fx->url(server, "cli", NULL, url, sizeof(url));
  /* Seed: two compatible segments, one with other block sizes, one corrupt. */
  sx_store *s;
  if (sx_store_open(url, &s) != 0)
    return -1;
  sx_desc d;
  desc_make(&d, "prefill-0/tp0", 0x11, "prefill", 4096, 60000);
  d.generation = 3;
  rc = sx_store_publish(s, &d, 0);
  sx_desc_free(&d);
  desc_make(&d, "decode-0/tp0", 0x22, "decode", 4096, 60000);
  rc |= sx_store_publish(s, &d, 0);
  sx_desc_free(&d);
  desc_make(&d, "decode-9/odd", 0x33, "decode", 8192, 60000);
  rc |= sx_store_publish(s, &d, 0);
  sx_desc_free(&d);
  sx_store_close(s);
  rc |= fx->plant(server, "cli", "broken/0", "garbage!", 8);
  return rc;
}

static int group_setup_redis(void **state) {
  (void)state;
  return group_setup_fx(&sxt_redis_fixture);
}

static int group_setup_cluster(void **state) {
  (void)state;
  return group_setup_fx(&sxt_rcluster_fixture);
}

static int group_setup_etcd(void **state) {
  (void)state;
  return group_setup_fx(&sxt_etcd_fixture);
}

static int group_teardown(void **state) {
  (void)state;
  if (have_server)
    fx->stop(server);
  server = NULL;
  have_server = 0;
  char cmd[200];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

#define NEED_SERVER()                                                          \
  do {                                                                         \
    if (!have_server)                                                          \
      skip();                                                                  \
  } while (0)

static void test_sxctl_ls_human(void **state) {
  (void)state;
  NEED_SERVER();
  char *out, *err;
  assert_int_equal(run(&out, &err, "--metadata '%s' ls", url), 0);
  /* Header, every segment, the corrupt one marked; sorted by name. */
  assert_non_null(strstr(out, "NAME"));
  assert_non_null(strstr(out, "INCARNATION"));
  assert_non_null(strstr(out, "LEASE LEFT"));
  assert_non_null(strstr(out, "ENDPOINTS"));
  char *a = strstr(out, "broken/0"), *b = strstr(out, "decode-0/tp0"),
       *c = strstr(out, "decode-9/odd"), *p = strstr(out, "prefill-0/tp0");
  assert_true(a && b && c && p && a < b && b < c && c < p);
  assert_non_null(strstr(out, "!! broken/0: the stored descriptor is corrupt"));
  assert_non_null(strstr(p, "11111111"));
  assert_non_null(strstr(p, "tcp://10.1.2.3:7400"));
  assert_non_null(strstr(p, "role=prefill"));
  assert_non_null(strstr(err, "could not be read"));
  free(out);
  free(err);
  /* The URL from the environment works the same. */
  setenv("SX_METADATA_URL", url, 1);
  assert_int_equal(run(&out, NULL, "ls --label role=decode"), 0);
  unsetenv("SX_METADATA_URL");
  assert_non_null(strstr(out, "decode-0/tp0"));
  assert_non_null(strstr(out, "decode-9/odd"));
  assert_null(strstr(out, "prefill-0/tp0"));
  assert_null(strstr(out, "broken/0"));
  free(out);
}

static void test_sxctl_ls_json(void **state) {
  (void)state;
  NEED_SERVER();
  char *out;
  assert_int_equal(run(&out, NULL, "--metadata '%s' ls --json", url), 0);
  json_error_t je;
  json_t *arr = json_loads(out, 0, &je);
  if (arr == NULL)
    fail_msg("ls --json is not JSON: %s\n%s", je.text, out);
  assert_true(json_is_array(arr));
  assert_int_equal(json_array_size(arr), 4);
  json_t *bad = json_array_get(arr, 0), *p = json_array_get(arr, 3);
  assert_string_equal(json_string_value(json_object_get(bad, "name")), "broken/0");
  assert_string_equal(json_string_value(json_object_get(bad, "status")), "error");
  assert_non_null(strstr(json_string_value(json_object_get(bad, "message")), "corrupt"));
  assert_string_equal(json_string_value(json_object_get(p, "name")), "prefill-0/tp0");
  assert_string_equal(json_string_value(json_object_get(p, "status")), "ok");
  assert_int_equal(json_integer_value(json_object_get(p, "generation")), 3);
  assert_int_equal(json_integer_value(json_object_get(p, "regions")), 2);
  assert_int_equal(json_integer_value(json_object_get(p, "total_bytes")), 2 * 8 * 32 * 4096);
  assert_string_equal(json_string_value(json_object_get(p, "incarnation")),
                      "11111111111111111111111111111111");
  assert_string_equal(
      json_string_value(json_object_get(json_object_get(p, "labels"), "role")), "prefill");
  json_int_t left = json_integer_value(json_object_get(p, "lease_left_ms"));
  assert_true(left > 30000 && left <= 60000);
  json_decref(arr);
  free(out);
}

static void test_sxctl_show(void **state) {
  (void)state;
  NEED_SERVER();
  char *out, *err;
  assert_int_equal(run(&out, NULL, "--metadata '%s' show prefill-0/tp0", url), 0);
  assert_non_null(strstr(out, "incarnation   11111111111111111111111111111111"));
  assert_non_null(strstr(out, "generation    3"));
  assert_non_null(strstr(out, "<redacted>"));
  assert_null(strstr(out, "101112131415161718191a1b1c1d1e1f")); /* the fixture token */
  assert_non_null(strstr(out, "LAYERS"));
  assert_non_null(strstr(out, "0-7")); /* one region spans 8 layers */
  assert_non_null(strstr(out, "1 redacted"));
  assert_non_null(strstr(out, "fingerprint=llama-3-70b/bf16/v1"));
  free(out);
  assert_int_equal(run(&out, NULL, "--metadata '%s' show prefill-0/tp0 --show-secrets", url),
                   0);
  assert_non_null(strstr(out, "101112131415161718191a1b1c1d1e1f"));
  free(out);
  assert_int_equal(run(&out, NULL, "--metadata '%s' show prefill-0/tp0 --json", url), 0);
  json_t *j = json_loads(out, 0, NULL);
  assert_non_null(j);
  assert_string_equal(json_string_value(json_object_get(j, "name")), "prefill-0/tp0");
  assert_string_equal(json_string_value(json_object_get(j, "token")), "<redacted>");
  assert_int_equal(json_array_size(json_object_get(j, "regions")), 2);
  json_decref(j);
  free(out);
  /* Not found: exit 1.  Corrupt: exit 2 with the decode error. */
  assert_int_equal(run(NULL, &err, "--metadata '%s' show nobody/0", url), 1);
  assert_non_null(strstr(err, "no such segment"));
  free(err);
  assert_int_equal(run(NULL, &err, "--metadata '%s' show broken/0", url), 2);
  assert_non_null(strstr(err, "corrupt"));
  free(err);
}

static void test_sxctl_check(void **state) {
  (void)state;
  NEED_SERVER();
  char *out, *err;
  assert_int_equal(
      run(&out, NULL, "--metadata '%s' check prefill-0/tp0 --against decode-0/tp0", url), 0);
  assert_non_null(strstr(out, "compatible"));
  free(out);
  assert_int_equal(
      run(&out, NULL, "--metadata '%s' check prefill-0/tp0 --against decode-9/odd", url), 1);
  assert_non_null(strstr(out, "incompatible"));
  assert_non_null(strstr(out, "block_bytes"));
  free(out);
  assert_int_equal(run(&out, NULL,
                       "--metadata '%s' check prefill-0/tp0 --against decode-9/odd --json",
                       url),
                   1);
  json_t *j = json_loads(out, 0, NULL);
  assert_non_null(j);
  assert_true(json_is_false(json_object_get(j, "compatible")));
  assert_string_equal(json_string_value(json_object_get(j, "field")), "block_bytes");
  json_decref(j);
  free(out);
  /* A layout file written by show --json. */
  assert_int_equal(run(NULL, NULL, "--metadata '%s' show decode-0/tp0 --json >%s/layout.json; "
                       "cat %s/layout.json >&2", url, tmpdir, tmpdir), 0);
  assert_int_equal(run(&out, NULL, "--metadata '%s' check prefill-0/tp0 --layout %s/layout.json",
                       url, tmpdir),
                   0);
  free(out);
  assert_int_equal(run(NULL, &err, "--metadata '%s' check prefill-0/tp0 --against nobody/0",
                       url),
                   2);
  assert_non_null(strstr(err, "no such segment"));
  free(err);
  assert_int_equal(run(NULL, &err, "--metadata '%s' check prefill-0/tp0", url), 2);
  assert_non_null(strstr(err, "--against"));
  free(err);
}

/* A described segment: 8 layers of K/V blocks of 16 tokens x heads
 * [first, first+count) of 8 x 128 x bf16. */
static void desc_described(sx_desc *d, const char *name, uint8_t inc, sx_kv_order order,
                           uint32_t first, uint32_t count, uint32_t rank, uint32_t size) {
  desc_make(d, name, inc, "tp", 16ull * count * 128 * 2, 60000);
  d->layout.tp_rank = rank;
  d->layout.tp_size = size;
  d->layout.n_blocks = 1;
  d->layout.blocks[0] = (sx_block_desc){.order = order, .tokens = 16, .head_first = first,
                                        .head_count = count, .heads_total = 8,
                                        .head_dim = 128};
  strcpy(d->layout.blocks[0].dtype, "bf16");
}

static void test_sxctl_check_prints_plans(void **state) {
  (void)state;
  NEED_SERVER();
  sx_store *s;
  sx_desc d;
  assert_int_equal(sx_store_open(url, &s), 0);
  desc_described(&d, "plan-p/tp0", 0x41, SX_KV_HND, 0, 4, 0, 2);
  sxt_ok(sx_store_publish(s, &d, 0));
  sx_desc_free(&d);
  desc_described(&d, "plan-p/tp1", 0x42, SX_KV_HND, 4, 4, 1, 2);
  sxt_ok(sx_store_publish(s, &d, 0));
  sx_desc_free(&d);
  desc_described(&d, "plan-d/tp0", 0x43, SX_KV_HND, 0, 8, 0, 1);
  sxt_ok(sx_store_publish(s, &d, 0));
  sx_desc_free(&d);
  char *out, *err;
  assert_int_equal(run(&out, NULL, "--metadata '%s' show plan-p/tp1", url), 0);
  assert_non_null(strstr(out, "group 0: 16 tokens x heads 4-7 of 8 x 128 x bf16, HND"));
  free(out);
  assert_int_equal(run(&out, NULL, "--metadata '%s' show plan-p/tp1 --json", url), 0);
  json_t *j = json_loads(out, 0, NULL);
  json_t *b0 = json_array_get(json_object_get(json_object_get(j, "layout"), "blocks"), 0);
  assert_int_equal(json_integer_value(json_object_get(b0, "head_first")), 4);
  assert_string_equal(json_string_value(json_object_get(b0, "order")), "HND");
  json_decref(j);
  free(out);
  /* Both ranks into one: a plan in words. */
  assert_int_equal(run(&out, NULL, "--metadata '%s' check plan-p/tp0 plan-p/tp1 --against "
                       "plan-d/tp0", url), 0);
  assert_non_null(strstr(out, "compatible with a plan"));
  assert_non_null(strstr(out, "reads heads 4-7 (all it holds) of each block of plan-p/tp1"));
  assert_non_null(strstr(out, "reads heads 0-3 (all it holds) of each block of plan-p/tp0"));
  free(out);
  /* One rank alone: heads 4-7 have no holder; a structured refusal. */
  assert_int_equal(run(&out, NULL, "--metadata '%s' check plan-p/tp0 --against plan-d/tp0 "
                       "--json", url), 1);
  j = json_loads(out, 0, NULL);
  assert_non_null(j);
  assert_true(json_is_false(json_object_get(j, "compatible")));
  assert_string_equal(json_string_value(json_object_get(j, "mismatch")), "heads_missing");
  assert_string_equal(json_string_value(json_object_get(j, "local")), "4");
  json_decref(j);
  free(out);
  /* The other way (decode TP=2 reading a TP=1 prefill): each rank's part;
   * the equal check alone would not pass it (the block sizes differ). */
  assert_int_equal(run(&out, NULL, "--metadata '%s' check plan-d/tp0 --against plan-p/tp1",
                       url), 0);
  assert_non_null(strstr(out, "reads heads 4-7 of each block of plan-d/tp0"));
  free(out);
  /* Against an undescribed reader: refused with the check's words. */
  assert_int_equal(run(&out, &err, "--metadata '%s' check plan-p/tp0 plan-p/tp1 --against "
                       "decode-0/tp0", url), 1);
  assert_non_null(strstr(out, "a set of 2"));
  free(out);
  free(err);
  const char *names[] = {"plan-p/tp0", "plan-p/tp1", "plan-d/tp0"};
  for (int i = 0; i < 3; i++) {
    uint8_t inc[SX_INCARNATION_LEN];
    memset(inc, 0x41 + i, sizeof(inc));
    sxt_ok(sx_store_unpublish(s, names[i], inc));
  }
  sx_store_close(s);
}

static void test_sxctl_unreachable_and_usage(void **state) {
  (void)state;
  char *out, *err, dead[512];
  int port = sxt_free_port();
  if (strcmp(fx->name, "redis") == 0)
    snprintf(dead, sizeof(dead), "redis://op:Very-Secret-1@127.0.0.1:%d", port);
  else
    snprintf(dead, sizeof(dead), "etcd://127.0.0.1:%d?connect_timeout_ms=1000", port);
  assert_int_equal(run(NULL, &err, "--metadata '%s' ls", dead), 2);
  char hostport[64];
  snprintf(hostport, sizeof(hostport), "127.0.0.1:%d", port);
  assert_non_null(strstr(err, hostport));
  if (strcmp(fx->name, "redis") == 0)
    assert_non_null(strstr(err, "op:***@"));
  assert_null(strstr(err, "Very-Secret-1"));
  assert_non_null(strstr(err, "SX_EUNREACH"));
  assert_non_null(strstr(err, "running")); /* the hint */
  free(err);
  unsetenv("SX_METADATA_URL");
  assert_int_equal(run(NULL, &err, "ls"), 2);
  assert_non_null(strstr(err, "SX_METADATA_URL"));
  free(err);
  assert_int_equal(run(NULL, &err, "--metadata 'redis://h:1?namespace=a b' ls"), 2);
  assert_non_null(strstr(err, "SX_EURL"));
  free(err);
  assert_int_equal(run(NULL, &err, "frobnicate"), 2);
  assert_non_null(strstr(err, "unknown command"));
  free(err);
  assert_int_equal(run(&out, NULL, "ls --help"), 0);
  assert_non_null(strstr(out, "usage: sxctl ls"));
  assert_non_null(strstr(out, "examples"));
  free(out);
  assert_int_equal(run(&out, NULL, "--help"), 0);
  assert_non_null(strstr(out, "watch"));
  free(out);
}

static void test_sxctl_rm(void **state) {
  (void)state;
  NEED_SERVER();
  sx_store *s;
  sxt_ok(sx_store_open(url, &s));
  sx_desc live, stale;
  desc_make(&live, "rm/live", 0x44, "x", 4096, 60000);
  desc_make(&stale, "rm/stale", 0x45, "x", 4096, 3000);
  sxt_ok(sx_store_publish(s, &live, 0));
  sxt_ok(sx_store_publish(s, &stale, 0));
  char *out, *err;
  /* A live segment is refused without --force. */
  assert_int_equal(run(NULL, &err, "--metadata '%s' rm rm/live", url), 1);
  assert_non_null(strstr(err, "alive"));
  assert_non_null(strstr(err, "--force"));
  free(err);
  assert_int_equal(run(&out, NULL, "--metadata '%s' rm rm/live --force", url), 0);
  assert_non_null(strstr(out, "fenced"));
  free(out);
  sxt_rc(sx_store_renew(s, "rm/live", live.incarnation, 60000), SX_EFENCED);
  /* One that missed renewals (more than half its lease ago) goes without.
   * (etcd tells the time since the last renewal to a second.) */
  sleep_ms(1700);
  assert_int_equal(run(&out, NULL, "--metadata '%s' rm rm/stale", url), 0);
  assert_non_null(strstr(out, "removed rm/stale"));
  free(out);
  assert_int_equal(run(NULL, &err, "--metadata '%s' rm rm/stale", url), 1);
  assert_non_null(strstr(err, "no such segment"));
  free(err);
  sx_desc_free(&live);
  sx_desc_free(&stale);
  sx_store_close(s);
}

static void test_sxctl_watch_json(void **state) {
  (void)state;
  NEED_SERVER();
  char opath[200], epath[200];
  snprintf(opath, sizeof(opath), "%s/watch.out", tmpdir);
  snprintf(epath, sizeof(epath), "%s/watch.err", tmpdir);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    if (freopen(opath, "w", stdout) == NULL || freopen(epath, "w", stderr) == NULL)
      _exit(127);
    execl(sxctl, "sxctl", "--metadata", url, "watch", "--json", (char *)NULL);
    _exit(127);
  }
  /* sxctl says "watching" once its watch is in place. */
  for (int i = 0; i < 3000 && sxt_count_in_file(epath, "watching") == 0; i++)
    sleep_ms(10);
  assert_int_equal(sxt_count_in_file(epath, "watching"), 1);
  sx_store *s;
  sxt_ok(sx_store_open(url, &s));
  sx_desc d;
  desc_make(&d, "w/0", 0x66, "x", 4096, 60000);
  d.generation = 42;
  sxt_ok(sx_store_publish(s, &d, 0));
  sxt_ok(sx_store_unpublish(s, "w/0", d.incarnation));
  sx_desc_free(&d);
  sx_store_close(s);
  /* Both events printed, then a clean stop. */
  for (int i = 0; i < 3000 && sxt_count_in_file(opath, "\"w/0\"") < 2; i++)
    sleep_ms(10);
  kill(pid, SIGINT);
  int st;
  waitpid(pid, &st, 0);
  assert_true(WIFEXITED(st));
  assert_int_equal(WEXITSTATUS(st), 0); /* SIGINT ends it cleanly */
  FILE *f = fopen(opath, "r");
  assert_non_null(f);
  char line[1024];
  int puts_seen = 0, dels_seen = 0;
  while (fgets(line, sizeof(line), f)) {
    json_t *j = json_loads(line, 0, NULL);
    if (j == NULL)
      fail_msg("watch --json line is not JSON: %s", line);
    const char *kind = json_string_value(json_object_get(j, "kind"));
    const char *name = json_string_value(json_object_get(j, "name"));
    assert_non_null(json_object_get(j, "time"));
    if (name && strcmp(name, "w/0") == 0 && kind && strcmp(kind, "put") == 0) {
      assert_int_equal(json_integer_value(json_object_get(j, "generation")), 42);
      puts_seen++;
    }
    if (name && strcmp(name, "w/0") == 0 && kind && strcmp(kind, "delete") == 0)
      dels_seen++;
    json_decref(j);
  }
  fclose(f);
  assert_int_equal(puts_seen, 1);
  assert_int_equal(dels_seen, 1);
}

/* sxctl ARGS (a shell fragment, after --metadata) exits 2 with want on
 * stderr: a usage error, found before the store or any agent is asked. */
static void usage_fails(const char *want, const char *args) {
  char *err;
  int rc = run(NULL, &err, "--metadata '%s' %s", url, args);
  if (rc != 2 || strstr(err, want) == NULL)
    fail_msg("sxctl %s: exit %d, stderr '%s' (wanted 2 and '%s')", args, rc, err, want);
  free(err);
}

static void test_sxctl_numbers_out_of_range_or_signed_are_usage_errors(void **state) {
  (void)state;
  NEED_SERVER();
  /* More than 64 bits: strtoull gave 2^64-1 and the write went out with
   * that tag (the seed likewise). */
  usage_fails("--tag '99999999999999999999'",
              "write prefill-0/tp0 --as p-1 --fill 1 --tag 99999999999999999999");
  usage_fails("--seed '99999999999999999999'",
              "read prefill-0/tp0 --seed 99999999999999999999");
  /* A sign or blank first is not a number either. */
  usage_fails("--tag '+7'", "write prefill-0/tp0 --as p-1 --fill 1 --tag +7");
  usage_fails("--tag ' 7'", "write prefill-0/tp0 --as p-1 --fill 1 --tag ' 7'");
  usage_fails("--batch ' 8'", "read prefill-0/tp0 --batch ' 8'");
  usage_fails("--timeout-ms '+5'", "read prefill-0/tp0 --timeout-ms +5");
  /* A leading zero: strtoull read 010 as octal 8; seeds already refuse it. */
  usage_fails("--tag '010'", "write prefill-0/tp0 --as p-1 --fill 1 --tag 010");
  usage_fails("--batch '08'", "read prefill-0/tp0 --batch 08");
}

static void test_sxctl_usage_errors_say_what_is_wrong(void **state) {
  (void)state;
  NEED_SERVER();
  /* It said "unexpected argument '--label'" for a documented option. */
  usage_fails("--label needs KEY=VALUE", "ls --label");
  /* Exit 2 with the help on stdout and no word of the unknown command. */
  usage_fails("unknown command 'frobnicate'", "help frobnicate");
  char *out;
  assert_int_equal(run(&out, NULL, "help read"), 0);
  assert_non_null(strstr(out, "usage: sxctl read"));
  free(out);
}

static void test_sxctl_blocks_spec_is_checked_whole_and_bounded(void **state) {
  (void)state;
  NEED_SERVER();
  /* Judged before the store is asked (nope/0 is not published): random:N
   * allocated N ids, and ran out of memory, before reading any. */
  usage_fails("more than 16777216 blocks", "read nope/0 --blocks random:100000000000");
  usage_fails("more than 16777216 blocks", "read nope/0 --blocks 0-16777216");
  usage_fails("more than 16777216 blocks", "write nope/0 --as p-1 --fill 1 "
              "--blocks 0-9999999,0-9999999");
  /* Empty items were skipped: ',' read no block and exited 0. */
  usage_fails("--blocks ','", "read nope/0 --blocks ,");
  usage_fails("--blocks '1,,2'", "read nope/0 --blocks 1,,2");
  usage_fails("--blocks '3,'", "read nope/0 --blocks 3,");
  usage_fails("--blocks ''", "read nope/0 --blocks ''");
  usage_fails("--blocks '0-99999999999999999999'", "read nope/0 --blocks 0-99999999999999999999");
  /* A list longer than 4096 bytes was cut there: the block past the cut
   * (99, beyond the 32 of prefill-0/tp0) was dropped, not refused. */
  char *list = malloc(8192), *err;
  size_t k = 0;
  while (k < 5000)
    k += (size_t)sprintf(list + k, "0,");
  sprintf(list + k, "99");
  assert_int_equal(run(NULL, &err, "--metadata '%s' read prefill-0/tp0 --blocks %s", url, list), 2);
  assert_non_null(strstr(err, "the segment has 32 blocks per region"));
  free(err);
  free(list);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sxctl_ls_human),
      cmocka_unit_test(test_sxctl_ls_json),
      cmocka_unit_test(test_sxctl_show),
      cmocka_unit_test(test_sxctl_check),
      cmocka_unit_test(test_sxctl_check_prints_plans),
      cmocka_unit_test(test_sxctl_unreachable_and_usage),
      cmocka_unit_test(test_sxctl_rm),
      cmocka_unit_test(test_sxctl_watch_json),
      cmocka_unit_test(test_sxctl_numbers_out_of_range_or_signed_are_usage_errors),
      cmocka_unit_test(test_sxctl_blocks_spec_is_checked_whole_and_bounded),
      cmocka_unit_test(test_sxctl_usage_errors_say_what_is_wrong),
  };
  int failed = cmocka_run_group_tests_name("sxctl on redis", tests, group_setup_redis,
                                           group_teardown);
  failed += cmocka_run_group_tests_name("sxctl on redis-cluster", tests, group_setup_cluster,
                                        group_teardown);
  failed += cmocka_run_group_tests_name("sxctl on etcd", tests, group_setup_etcd,
                                        group_teardown);
  return failed;
}
