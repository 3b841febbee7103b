/*
 * The environment of a multi-process test program: where sx-agent and
 * sxctl are, a temporary directory for the children's logs, and a
 * redis-server with the URL that the children and the test share; plus
 * sx-agent processes holding a filled pool ("pools") in that store.
 *
 * Usage, in a cmocka group:
 *   static sxt_proc_env env;
 *   static int group_setup(void **state) {
 *     return sxt_proc_env_setup(&env, &(sxt_proc_env_opts){
 *         .test = "test_x", .tmp = "x", .need = "sx-agent", .ns = "x",
 *         .notify = "Kx"});
 *   }
 *   static int group_teardown(void **state) { return sxt_proc_env_teardown(&env); }
 *   ... SXT_NEED_REDIS(&env); ... env.url, env.tmpdir, env.bindir ...
 *
 * The teardown keeps the temporary directory when SXT_KEEP_LOGS is set.
 */
#ifndef SXT_PROC_ENV_H
#define SXT_PROC_ENV_H

#include <limits.h>
#include <stdint.h>
#include <sys/types.h>

#include "procs.h"
#include "redis_harness.h"
#include "sxtest.h"

typedef struct sxt_proc_env_opts {
  const char *test;   /* the test program, in messages ("test_e2e_agent") */
  const char *tmp;    /* the temporary directory is /tmp/sxt-TMP-XXXXXX */
  /* The programs are next to the test program (the RDMA VM's payload), not
   * in BUILD/bin (BUILD/tests/..). */
  int bin_here;
  const char *need;   /* a program the setup fails without ("sx-agent"), or NULL */
  /* Start a redis-server (with notify as its notify-keyspace-events) and
   * make url with namespace=ns; NULL: no server. */
  const char *ns;
  const char *notify;
  /* Without redis-server the setup fails; else have_redis is 0, the setup
   * says so and the tests skip (SXT_NEED_REDIS). */
  int redis_required;
} sxt_proc_env_opts;

typedef struct sxt_proc_env {
  const char *test;
  char bindir[PATH_MAX];
  char tmpdir[128]; /* "" until created */
  char url[256];
  sxt_redis redis;
  int have_redis;
} sxt_proc_env;

/* 0, or -1 with the reason on stderr. */
int sxt_proc_env_setup(sxt_proc_env *e, const sxt_proc_env_opts *o);

/* Stop every redis-server, remove the temporary directory (unless
 * SXT_KEEP_LOGS is set: then say where it is).  0 or -1. */
int sxt_proc_env_teardown(sxt_proc_env *e);

/* Skip the test when the setup could not start redis-server. */
#define SXT_NEED_REDIS(e)                                                      \
  do {                                                                         \
    if (!(e)->have_redis)                                                      \
      skip();                                                                  \
  } while (0)

/* sxt_spawn that fails the test when fork fails. */
pid_t sxt_spawn_ok(const char *log, const char *const argv[]);

/* Run env's sxctl with "--metadata URL" and args (NULL-terminated) to its
 * end (2 minutes at most), its output in log (and in out, up to size - 1
 * bytes, when out is not NULL; shown when it fails): its exit status. */
int sxt_sxctl(const sxt_proc_env *e, const char *log, const char *const *args, char *out,
              size_t size);

/* The incarnation env's store holds for name: 0, or the store's error
 * (SX_ENOENT).  Fails the test when the store cannot be opened. */
int sxt_stored_incarnation(const sxt_proc_env *e, const char *name,
                           uint8_t inc[SX_INCARNATION_LEN]);

/* ------------------------------------------------------------ pools */

/* An sx-agent process holding a pool filled with the pattern for seed. */
typedef struct sxt_pool {
  pid_t pid; /* 0 once stopped */
  char name[64];
  char log[256]; /* TMPDIR/NAME.log */
  uint64_t seed;
  uint8_t inc[SX_INCARNATION_LEN]; /* the incarnation it published */
} sxt_pool;

typedef struct sxt_pool_opts {
  const char *listen; /* NULL: 127.0.0.1:0 */
  uint32_t layers, block_bytes, num_blocks;
  const char *slots; /* "K,V" */
  const char *fingerprint;
  uint32_t lease_ms;
  const char *log_level;
  int takeover;
  const char *const *more; /* further options, NULL-terminated; or NULL */
  int publish_ms;          /* how long it may take to publish */
} sxt_pool_opts;

/* Start env's sx-agent as p, publishing name in env's store, and wait
 * (polling every 20 ms, o->publish_ms in all) until the store holds a new
 * incarnation of name (not the one it held before); that is p->inc.  Fails
 * the test, after showing the end of the log, when sx-agent exits first or
 * does not publish in time. */
void sxt_pool_start(const sxt_proc_env *e, sxt_pool *p, const char *name, uint64_t seed,
                    const sxt_pool_opts *o);

/* Send sig to the pool's sx-agent and reap it (20 s at most; if it does not
 * end, where it is stuck and the end of its log are shown): its exit status,
 * 128 + signal, or -1. */
int sxt_pool_stop(sxt_pool *p, int sig);

#endif
