/* sx-agent processes and readers for the fault tests.  See fault_fixture.h. */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "fault_fixture.h"
#include "internal.h"
#include "segxfer/store.h"

const char *sxt_fault_log_level = "info";
/* Makes log files and reader names unique within the process. */
static int spawn_seq;

/* What sxt_fault_main's group setup and teardown work on. */
static struct {
  sxt_proc_env *env;
  const char *test;
  void (*cleanup)(void);
} group;

static int group_setup(void **state) {
  (void)state;
  const char *tmp = strncmp(group.test, "test_", 5) == 0 ? group.test + 5 : group.test;
  return sxt_proc_env_setup(group.env, &(sxt_proc_env_opts){.test = group.test, .tmp = tmp,
                                                             .need = "sx-agent",
                                                             .ns = "faults",
                                                             .notify = "Kx"});
}

static int group_teardown(void **state) {
  (void)state;
  if (group.cleanup != NULL)
    group.cleanup();
  return sxt_proc_env_teardown(group.env);
}

int sxt_fault_main(sxt_proc_env *env, const char *test, const char *title,
                   const struct CMUnitTest *tests, size_t n, void (*cleanup)(void)) {
  signal(SIGPIPE, SIG_IGN);
  group.env = env;
  group.test = test;
  group.cleanup = cleanup;
  const char *filter = getenv("SXT_FILTER");
  if (filter != NULL)
    cmocka_set_test_filter(filter);
  return _cmocka_run_group_tests(title, tests, n, group_setup, group_teardown);
}

int sxt_fault_stored(const char *url, const char *name, uint8_t inc[SX_INCARNATION_LEN],
                     uint64_t *gen) {
  sx_store *s;
  int rc = sx_store_open(url, &s);
  if (rc != 0)
    return rc;
  sx_desc d;
  rc = sx_store_get(s, name, &d, NULL);
  if (rc == 0) {
    if (inc)
      memcpy(inc, d.incarnation, SX_INCARNATION_LEN);
    if (gen)
      *gen = d.generation;
    sx_desc_free(&d);
  }
  sx_store_close(s);
  return rc;
}

const char *sxt_ip_cmd(void) {
  static const char *const paths[] = {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"};
  for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++)
    if (access(paths[i], X_OK) == 0)
      return paths[i];
  return NULL;
}

void sxt_fault_spawn(const sxt_proc_env *env, sxt_fault_agent *p, const char *name,
                     const char *url, const char *listen, uint32_t lease_ms, uint64_t seed,
                     const char *netns) {
  char exe[PATH_MAX + 16], lease[16], fill[32], blocks[16], bb[16], layers[16];
  snprintf(exe, sizeof(exe), "%s/sx-agent", env->bindir);
  snprintf(lease, sizeof(lease), "%u", lease_ms);
  snprintf(fill, sizeof(fill), "%lu", (unsigned long)seed);
  snprintf(blocks, sizeof(blocks), "%u", SXT_FAULT_BLOCKS);
  snprintf(bb, sizeof(bb), "%u", SXT_FAULT_BLOCK);
  snprintf(layers, sizeof(layers), "%u", SXT_FAULT_LAYERS);
  memset(p, 0, sizeof(*p));
  snprintf(p->name, sizeof(p->name), "%s", name);
  snprintf(p->log, sizeof(p->log), "%s/%s-%d.log", env->tmpdir, name, spawn_seq++);
  snprintf(p->url, sizeof(p->url), "%s", url);
  p->seed = seed;
  const char *argv[40];
  int n = 0;
  if (netns) {
    argv[n++] = sxt_ip_cmd();
    argv[n++] = "netns";
    argv[n++] = "exec";
    argv[n++] = netns;
  }
  const char *rest[] = {exe, "--name", p->name, "--metadata", url, "--listen",
                        listen ? listen : "127.0.0.1:0", "--layers", layers,
                        "--block-bytes", bb, "--num-blocks", blocks, "--slots", "K,V",
                        "--fingerprint", "faults/v1", "--fill", fill, "--lease-ms", lease,
                        "--log-level", sxt_fault_log_level, NULL};
  for (size_t i = 0; i < sizeof(rest) / sizeof(rest[0]); i++)
    argv[n++] = rest[i];
  p->pid = sxt_spawn(p->log, argv);
  assert_true(p->pid > 0);
}

void sxt_fault_wait_published(sxt_fault_agent *p, const uint8_t *not, int ms) {
  uint64_t t0 = sx__mono_ms();
  while ((int)(sx__mono_ms() - t0) < ms) {
    uint8_t inc[SX_INCARNATION_LEN];
    if (sxt_fault_stored(p->url, p->name, inc, NULL) == 0 &&
        (not == NULL || memcmp(inc, not, SX_INCARNATION_LEN) != 0)) {
      memcpy(p->inc, inc, SX_INCARNATION_LEN);
      return;
    }
    if (waitpid(p->pid, NULL, WNOHANG) == p->pid)
      fail_msg("sx-agent %s exited early; see %s", p->name, p->log);
    sxt_sleep_ms(20);
  }
  fail_msg("sx-agent %s did not publish within %d ms; see %s", p->name, ms, p->log);
}

int sxt_fault_stop(sxt_fault_agent *p, int sig) {
  if (p->pid <= 0)
    return -1;
  kill(p->pid, SIGCONT);
  kill(p->pid, sig);
  int rc = sxt_reap(p->pid, 20000);
  p->pid = 0;
  return rc;
}

void sxt_fault_reader_start(sxt_fault_reader *r, const char *url) {
  memset(r, 0, sizeof(*r));
  sx_agent_params p;
  char name[32];
  snprintf(name, sizeof(name), "fault-reader-%d", spawn_seq++);
  sxt_params(&p, url, name);
  p.name = NULL; /* reader only */
  snprintf(p.layout.fingerprint, sizeof(p.layout.fingerprint), "faults/v1");
  sxt_ok(sx_agent_create(&p, &r->a));
  for (uint32_t s = 0; s < 2; s++) {
    uint64_t layer = (uint64_t)SXT_FAULT_LOCAL_BLOCKS * SXT_FAULT_BLOCK;
    r->mem[s] = calloc(SXT_FAULT_LAYERS, layer);
    assert_non_null(r->mem[s]);
    sx_region_params rp = {.addr = r->mem[s], .length = SXT_FAULT_LAYERS * layer,
                           .layer_count = SXT_FAULT_LAYERS, .layer_stride = layer, .slot = s,
                           .block_bytes = SXT_FAULT_BLOCK,
                           .num_blocks = SXT_FAULT_LOCAL_BLOCKS};
    uint32_t id;
    sxt_ok(sx_agent_register(r->a, &rp, &id));
  }
}

void sxt_fault_reader_stop(sxt_fault_reader *r) {
  sx_agent_destroy(r->a);
  for (int s = 0; s < 2; s++)
    free(r->mem[s]);
}

sx_block_read sxt_fault_blocks(uint64_t first, uint64_t count) {
  return (sx_block_read){.layer_count = SXT_FAULT_LAYERS, .slots = SXT_FAULT_KV,
                         .remote_block = first, .local_block = first, .count = count};
}

sx_batch_result sxt_fault_batch(sx_segment *s, const sx_block_read *e, uint32_t timeout_ms,
                                uint64_t *took_ms) {
  sx_batch_params bp;
  sx_batch_params_init(&bp);
  bp.timeout_ms = timeout_ms;
  sx_batch *b;
  sxt_ok(sx_batch_create(s, &bp, &b));
  sxt_ok(sx_batch_add_blocks(b, e, 1));
  uint64_t t0 = sx__mono_ms();
  sxt_ok(sx_batch_submit(b));
  /* A batch must end by its deadline: wait a bounded time, never forever. */
  if (sx_batch_wait(b, (int)timeout_ms + 5000) != 0)
    fail_msg("a batch with a %u ms deadline was still running %u ms after submit",
             timeout_ms, timeout_ms + 5000);
  if (took_ms)
    *took_ms = sx__mono_ms() - t0;
  sx_batch_result res;
  sxt_ok(sx_batch_result_get(b, &res));
  res.failed = NULL;
  sx_batch_destroy(b);
  return res;
}

int sxt_fault_verify(const sxt_fault_reader *r, const sx_segment *seg, uint64_t seed,
                     const sx_block_read *e) {
  return sxt_verify(r->mem, SXT_FAULT_LOCAL_BLOCKS, seg, seed, e);
}

int sxt_fault_untouched(const sxt_fault_reader *r, const sx_block_read *e, uint8_t fill) {
  uint64_t layer = (uint64_t)SXT_FAULT_LOCAL_BLOCKS * SXT_FAULT_BLOCK;
  for (int s = 0; s < 2; s++)
    for (uint32_t l = 0; l < SXT_FAULT_LAYERS; l++)
      for (uint64_t i = e->local_block * SXT_FAULT_BLOCK;
           i < (e->local_block + e->count) * SXT_FAULT_BLOCK; i++)
        if (r->mem[s][l * layer + i] != fill)
          return 0;
  return 1;
}

void sxt_fault_fill(sxt_fault_reader *r, uint8_t v) {
  for (int s = 0; s < 2; s++)
    memset(r->mem[s], v,
           (uint64_t)SXT_FAULT_LAYERS * SXT_FAULT_LOCAL_BLOCKS * SXT_FAULT_BLOCK);
}
