/* The environment of a multi-process test program (see proc_env.h). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proc_env.h"
#include "segxfer/store.h"

int sxt_proc_env_setup(sxt_proc_env *e, const sxt_proc_env_opts *o) {
  memset(e, 0, sizeof(*e));
  e->test = o->test;
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0)
    return -1;
  self[n] = '\0';
  *strrchr(self, '/') = '\0'; /* BUILD/tests, or the payload directory */
  if (o->bin_here)
    snprintf(e->bindir, sizeof(e->bindir), "%s", self);
  else
    snprintf(e->bindir, sizeof(e->bindir), "%.*s/../bin", (int)(sizeof(e->bindir) - 8),
             self);
  if (o->need != NULL) {
    char exe[PATH_MAX + 64];
    snprintf(exe, sizeof(exe), "%s/%s", e->bindir, o->need);
    if (access(exe, X_OK) != 0) {
      fprintf(stderr, "%s: %s is %s\n", e->test, exe, o->bin_here ? "missing" : "not built");
      return -1;
    }
  }
  snprintf(e->tmpdir, sizeof(e->tmpdir), "/tmp/sxt-%s-XXXXXX", o->tmp);
  if (mkdtemp(e->tmpdir) == NULL) {
    e->tmpdir[0] = '\0';
    return -1;
  }
  if (o->ns == NULL)
    return 0;
  e->have_redis = sxt_redis_start(&e->redis, &(sxt_redis_opts){.notify = o->notify}) == 0;
  if (!e->have_redis) {
    if (o->redis_required) {
      fprintf(stderr, "%s: cannot start redis-server\n", e->test);
      return -1;
    }
    fprintf(stderr, "%s: cannot start redis-server (is the redis-server package "
            "installed?): every test here is skipped\n", e->test);
    return 0;
  }
  char query[128];
  snprintf(query, sizeof(query), "namespace=%s", o->ns);
  sxt_redis_url(&e->redis, e->url, sizeof(e->url), query);
  return 0;
}

int sxt_proc_env_teardown(sxt_proc_env *e) {
  sxt_redis_stop_all();
  if (e->tmpdir[0] == '\0')
    return 0;
  if (getenv("SXT_KEEP_LOGS") != NULL) {
    fprintf(stderr, "%s: logs kept in %s (SXT_KEEP_LOGS)\n", e->test, e->tmpdir);
    return 0;
  }
  char cmd[200];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", e->tmpdir);
  return system(cmd) == 0 ? 0 : -1;
}

pid_t sxt_spawn_ok(const char *log, const char *const argv[]) {
  pid_t pid = sxt_spawn(log, argv);
  assert_true(pid >= 0);
  return pid;
}

int sxt_sxctl(const sxt_proc_env *e, const char *log, const char *const *args, char *out,
              size_t size) {
  char exe[PATH_MAX + 16];
  snprintf(exe, sizeof(exe), "%s/sxctl", e->bindir);
  const char *argv[32] = {exe, "--metadata", e->url};
  int n = 3;
  for (int i = 0; args[i] != NULL && n < 31; i++)
    argv[n++] = args[i];
  argv[n] = NULL;
  int rc = sxt_reap_log(sxt_spawn_ok(log, argv), 120000, log);
  if (out != NULL) {
    FILE *f = fopen(log, "r");
    size_t got = f != NULL ? fread(out, 1, size - 1, f) : 0;
    out[got] = '\0';
    if (f != NULL)
      fclose(f);
  }
  if (rc != 0)
    sxt_show_log(log);
  return rc;
}

int sxt_stored_incarnation(const sxt_proc_env *e, const char *name,
                           uint8_t inc[SX_INCARNATION_LEN]) {
  sx_store *s;
  sxt_ok(sx_store_open(e->url, &s));
  sx_desc d;
  int rc = sx_store_get(s, name, &d, NULL);
  if (rc == 0) {
    memcpy(inc, d.incarnation, SX_INCARNATION_LEN);
    sx_desc_free(&d);
  }
  sx_store_close(s);
  return rc;
}

/* ------------------------------------------------------------ pools */

void sxt_pool_start(const sxt_proc_env *e, sxt_pool *p, const char *name, uint64_t seed,
                    const sxt_pool_opts *o) {
  uint8_t old[SX_INCARNATION_LEN];
  int had = sxt_stored_incarnation(e, name, old) == 0;
  char exe[PATH_MAX + 16], lease[16], fill[32], blocks[16], bb[16], layers[16];
  snprintf(exe, sizeof(exe), "%s/sx-agent", e->bindir);
  snprintf(lease, sizeof(lease), "%u", o->lease_ms);
  snprintf(fill, sizeof(fill), "%lu", (unsigned long)seed);
  snprintf(blocks, sizeof(blocks), "%u", o->num_blocks);
  snprintf(bb, sizeof(bb), "%u", o->block_bytes);
  snprintf(layers, sizeof(layers), "%u", o->layers);
  snprintf(p->name, sizeof(p->name), "%s", name);
  snprintf(p->log, sizeof(p->log), "%s/%s.log", e->tmpdir, name);
  p->seed = seed;
  const char *argv[48] = {exe, "--name", p->name, "--metadata", e->url, "--listen",
                          o->listen ? o->listen : "127.0.0.1:0", "--layers", layers,
                          "--block-bytes", bb, "--num-blocks", blocks, "--slots", o->slots,
                          "--fingerprint", o->fingerprint, "--fill", fill, "--lease-ms",
                          lease, "--log-level", o->log_level};
  size_t n = 23;
  if (o->takeover)
    argv[n++] = "--takeover";
  for (size_t i = 0; o->more != NULL && o->more[i] != NULL; i++) {
    assert_true(n < sizeof(argv) / sizeof(argv[0]) - 1);
    argv[n++] = o->more[i];
  }
  argv[n] = NULL;
  p->pid = sxt_spawn_ok(p->log, argv);
  for (int waited = 0; waited < o->publish_ms; waited += 20) {
    uint8_t inc[SX_INCARNATION_LEN];
    if (sxt_stored_incarnation(e, name, inc) == 0 &&
        (!had || memcmp(inc, old, sizeof(inc)) != 0)) {
      memcpy(p->inc, inc, sizeof(inc));
      return;
    }
    if (waitpid(p->pid, NULL, WNOHANG) == p->pid) {
      sxt_show_log(p->log);
      fail_msg("sx-agent %s exited early; see %s", name, p->log);
    }
    sxt_sleep_ms(20);
  }
  sxt_show_log(p->log);
  fail_msg("sx-agent %s did not publish within %d s; see %s", name, o->publish_ms / 1000,
           p->log);
}

int sxt_pool_stop(sxt_pool *p, int sig) {
  if (p->pid <= 0)
    return -1;
  kill(p->pid, sig);
  int rc = sxt_reap_log(p->pid, 20000, p->log);
  p->pid = 0;
  return rc;
}
