/*
 * Soak: readers doing continuous verified batches against sx-agent targets
 * that are restarted at random, for a given duration.
 *
 *   soak SECONDS
 *
 * A redis-server (tests/support/redis_harness.c), TARGETS sx-agent
 * processes and READERS reader agents (threads of this process, each an
 * agent of its own).  Every target is started with a new fill seed, which
 * it publishes as the label seed=N: a reader checks every byte it gets
 * against the seed of the incarnation it opened, so bytes from another
 * incarnation (or from nowhere) cannot pass.  Readers re-open after stale,
 * not-found and transport errors.  A chaos loop restarts a random target
 * every 0.5-2 s with SIGTERM (clean unpublish) or SIGKILL (crash; the new
 * incarnation takes the name over).  Every 2 s the RSS of each long-lived
 * process is sampled.
 *
 * Fails (exit 1) if any byte is wrong, a batch outlives its deadline by more
 * than 5 s, no batch completed, or RSS grows beyond a bound after warm-up.
 * Prints totals: bytes, batches, failures by kind, restarts, and RSS over
 * time.
 */
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent_fixture.h"
#include "internal.h"
#include "procs.h"
#include "redis_harness.h"
#include "segxfer/store.h"

#define TARGETS 3
#define READERS 3
#define LAYERS 4
#define BLOCK 16384u
#define BLOCKS 128u       /* per layer and slot on a target */
#define LOCAL_BLOCKS 32u  /* per layer and slot on a reader */
#define DEADLINE_MS 3000u /* per batch */
#define HANG_SLACK_MS 5000
/* RSS may grow this much after warm-up (first third of the run).  Under
 * AddressSanitizer freed memory sits in its quarantine (up to 256 MiB) before
 * reuse, so RSS says little there; LeakSanitizer checks leaks at exit. */
#if defined(__SANITIZE_ADDRESS__)
#define RSS_SLACK_KIB ((16 + 256) * 1024)
#else
#define RSS_SLACK_KIB (16 * 1024)
#endif
#define MAX_SAMPLES 4096

static char bindir[PATH_MAX];
static char tmpdir[128];
static char url[256];
static atomic_int stop;
static uint64_t seed_next = 1000;

/* ------------------------------------------------------------ targets */

typedef struct target {
  char name[32];
  pid_t pid;
  uint64_t seed;
  char log[256];
} target;

static target targets[TARGETS];
static pthread_mutex_t targets_lock = PTHREAD_MUTEX_INITIALIZER;

static void target_start(target *t, int takeover) {
  char exe[PATH_MAX + 16], seed[32], label[48], blocks[16], bb[16], layers[16];
  t->seed = seed_next++;
  snprintf(exe, sizeof(exe), "%s/sx-agent", bindir);
  snprintf(seed, sizeof(seed), "%lu", (unsigned long)t->seed);
  snprintf(label, sizeof(label), "seed=%lu", (unsigned long)t->seed);
  snprintf(blocks, sizeof(blocks), "%u", BLOCKS);
  snprintf(bb, sizeof(bb), "%u", BLOCK);
  snprintf(layers, sizeof(layers), "%u", LAYERS);
  snprintf(t->log, sizeof(t->log), "%s/%s.log", tmpdir, t->name + 5);
  const char *argv[] = {exe, "--name", t->name, "--metadata", url, "--listen",
                        "127.0.0.1:0", "--layers", layers, "--block-bytes", bb,
                        "--num-blocks", blocks, "--slots", "K,V", "--fingerprint", "soak/v1",
                        "--fill", seed, "--label", label, "--lease-ms", "2000",
                        "--log-level", "warn", takeover ? "--takeover" : NULL, NULL};
  t->pid = sxt_spawn(t->log, argv);
}

/* ------------------------------------------------------------ readers */

enum { K_STALE, K_NOENT, K_DISCONN, K_TIMEDOUT, K_UNREACH, K_OTHER, K_KINDS };
static const char *const kind_names[K_KINDS] = {"stale", "not found", "disconnected",
                                                "timed out", "unreachable", "other"};

typedef struct reader {
  pthread_t th;
  int id;
  sx_agent *a;
  uint8_t *mem[2];
  uint64_t bytes, batches, completed, opens, failures[K_KINDS], wrong, hangs;
  char last_other[400];
} reader;

static reader readers[READERS];

static int kind_of(int err) {
  switch (err) {
  case SX_ESTALE:
    return K_STALE;
  case SX_ENOENT:
    return K_NOENT;
  case SX_EDISCONN:
    return K_DISCONN;
  case SX_ETIMEDOUT:
    return K_TIMEDOUT;
  case SX_EUNREACH:
    return K_UNREACH;
  default:
    return K_OTHER;
  }
}

static uint64_t label_seed(const sx_desc *d) {
  for (uint32_t i = 0; i < d->n_labels; i++)
    if (strcmp(d->labels[i].key, "seed") == 0)
      return strtoull(d->labels[i].value, NULL, 10);
  return 0;
}

static void *reader_main(void *arg) {
  reader *r = arg;
  uint32_t rng = 7919u * (uint32_t)(r->id + 1);
  sx_segment *seg = NULL;
  uint64_t seed = 0;
  while (!atomic_load(&stop)) {
    rng = rng * 1103515245u + 12345u;
    if (seg == NULL) {
      const char *name = targets[(rng >> 8) % TARGETS].name;
      int rc = sx_segment_open(r->a, name, 2000, &seg);
      r->opens++;
      if (rc != 0) {
        r->failures[kind_of(rc)]++;
        if (kind_of(rc) == K_OTHER)
          snprintf(r->last_other, sizeof(r->last_other), "open: %s: %s", sx_err_name(rc),
                   sx_errmsg());
        seg = NULL;
        sxt_sleep_ms(20);
        continue;
      }
      seed = label_seed(sx_segment_desc(seg));
    }
    /* A few entries of random blocks, every layer, K and V. */
    sx_block_read e[4];
    uint64_t local = 0;
    for (int i = 0; i < 4; i++) {
      rng = rng * 1103515245u + 12345u;
      uint64_t count = 1 + (rng >> 4) % 8;
      e[i] = (sx_block_read){.layer_count = LAYERS, .slots = SXT_KV,
                             .remote_block = (rng >> 10) % (BLOCKS - count),
                             .local_block = local, .count = count};
      local += count;
    }
    sx_batch_params bp;
    sx_batch_params_init(&bp);
    bp.timeout_ms = DEADLINE_MS;
    sx_batch *b;
    if (sx_batch_create(seg, &bp, &b) != 0 || sx_batch_add_blocks(b, e, 4) != 0 ||
        sx_batch_submit(b) != 0) {
      snprintf(r->last_other, sizeof(r->last_other), "batch: %s", sx_errmsg());
      r->failures[K_OTHER]++;
      sx_batch_destroy(b);
      sx_segment_close(seg);
      seg = NULL;
      continue;
    }
    if (sx_batch_wait(b, (int)(DEADLINE_MS + HANG_SLACK_MS)) != 0) {
      r->hangs++;
      fprintf(stderr, "soak: reader %d: a batch outlived its %u ms deadline by %d ms\n",
              r->id, DEADLINE_MS, HANG_SLACK_MS);
      atomic_store(&stop, 1);
      sx_batch_destroy(b);
      break;
    }
    sx_batch_result res;
    sx_batch_result_get(b, &res);
    r->batches++;
    if (res.state == SX_BATCH_COMPLETED) {
      for (int i = 0; i < 4; i++)
        if (sxt_verify(r->mem, LOCAL_BLOCKS, seg, seed, &e[i]) != 0) {
          r->wrong++;
          fprintf(stderr, "soak: reader %d: WRONG BYTES from %s (seed %lu)\n", r->id,
                  sx_segment_desc(seg)->name, (unsigned long)seed);
        }
      r->bytes += res.bytes;
      r->completed++;
      sx_batch_destroy(b);
      continue;
    }
    int k = kind_of(res.error);
    r->failures[k]++;
    if (k == K_OTHER)
      snprintf(r->last_other, sizeof(r->last_other), "%s %s: %s",
               sx_batch_state_name(res.state), sx_err_name(res.error), res.message);
    sx_batch_destroy(b);
    /* Whatever went wrong, open again: the target may have restarted. */
    sx_segment_close(seg);
    seg = NULL;
  }
  sx_segment_close(seg);
  return NULL;
}

static void reader_start(reader *r, int id) {
  memset(r, 0, sizeof(*r));
  r->id = id;
  sx_agent_params p;
  sxt_params(&p, url, NULL);
  snprintf(p.layout.fingerprint, sizeof(p.layout.fingerprint), "soak/v1");
  if (sx_agent_create(&p, &r->a) != 0) {
    fprintf(stderr, "soak: reader agent: %s\n", sx_errmsg());
    exit(2);
  }
  for (uint32_t s = 0; s < 2; s++) {
    uint64_t layer = (uint64_t)LOCAL_BLOCKS * BLOCK;
    r->mem[s] = calloc(LAYERS, layer);
    sx_region_params rp = {.addr = r->mem[s], .length = LAYERS * layer,
                           .layer_count = LAYERS, .layer_stride = layer, .slot = s,
                           .block_bytes = BLOCK, .num_blocks = LOCAL_BLOCKS};
    uint32_t rid;
    if (r->mem[s] == NULL || sx_agent_register(r->a, &rp, &rid) != 0) {
      fprintf(stderr, "soak: reader regions: %s\n", sx_errmsg());
      exit(2);
    }
  }
  pthread_create(&r->th, NULL, reader_main, r);
}

/* ------------------------------------------------------------ main */

typedef struct sample {
  uint32_t t_s;
  long self_kib, redis_kib, target_kib[TARGETS];
} sample;

static sample samples[MAX_SAMPLES];
static int n_samples;

static void take_sample(uint32_t t_s, pid_t redis_pid) {
  if (n_samples >= MAX_SAMPLES)
    return;
  sample *s = &samples[n_samples++];
  s->t_s = t_s;
  s->self_kib = sxt_rss_kib(getpid());
  s->redis_kib = sxt_rss_kib(redis_pid);
  pthread_mutex_lock(&targets_lock);
  for (int i = 0; i < TARGETS; i++)
    s->target_kib[i] = sxt_rss_kib(targets[i].pid);
  pthread_mutex_unlock(&targets_lock);
}

int main(int argc, char **argv) {
  int seconds = argc > 1 ? atoi(argv[1]) : 60;
  if (seconds <= 0) {
    fprintf(stderr, "usage: soak SECONDS\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0)
    return 2;
  self[n] = '\0';
  *strrchr(self, '/') = '\0'; /* BUILD/tests/soak */
  snprintf(bindir, sizeof(bindir), "%.*s/../../bin", (int)(sizeof(bindir) - 16), self);
  snprintf(tmpdir, sizeof(tmpdir), "/tmp/sxt-soak-XXXXXX");
  if (mkdtemp(tmpdir) == NULL)
    return 2;
  sxt_redis redis;
  if (sxt_redis_start(&redis, &(sxt_redis_opts){.notify = "Kx"}) != 0) {
    fprintf(stderr, "soak: cannot start redis-server (make deps)\n");
    return 2;
  }
  sxt_redis_url(&redis, url, sizeof(url), "namespace=soak");

  for (int i = 0; i < TARGETS; i++) {
    snprintf(targets[i].name, sizeof(targets[i].name), "soak/t%d", i);
    target_start(&targets[i], 0);
  }
  /* Wait until all are published. */
  for (int i = 0; i < TARGETS; i++) {
    sx_store *s;
    sx_desc d;
    int ok = 0;
    for (int k = 0; k < 1000 && !ok; k++) {
      if (sx_store_open(url, &s) == 0) {
        ok = sx_store_get(s, targets[i].name, &d, NULL) == 0;
        if (ok)
          sx_desc_free(&d);
        sx_store_close(s);
      }
      if (!ok)
        sxt_sleep_ms(20);
    }
    if (!ok) {
      fprintf(stderr, "soak: %s did not publish; see %s\n", targets[i].name,
              targets[i].log);
      return 1;
    }
  }
  for (int i = 0; i < READERS; i++)
    reader_start(&readers[i], i);

  uint64_t t0 = sx__mono_ms(), next_chaos = t0 + 1000, next_sample = t0;
  uint32_t rng = 4242;
  int restarts_term = 0, restarts_kill = 0, unclean = 0;
  while (!atomic_load(&stop) && sx__mono_ms() - t0 < (uint64_t)seconds * 1000) {
    uint64_t now = sx__mono_ms();
    if (now >= next_sample) {
      take_sample((uint32_t)((now - t0) / 1000), redis.pid);
      next_sample += 2000;
    }
    if (now >= next_chaos) {
      rng = rng * 1103515245u + 12345u;
      target *t = &targets[(rng >> 8) % TARGETS];
      int hard = (rng >> 16) & 1;
      pthread_mutex_lock(&targets_lock);
      kill(t->pid, hard ? SIGKILL : SIGTERM);
      int st = sxt_reap(t->pid, 10000);
      if (!hard && st != 0) {
        unclean++;
        fprintf(stderr, "soak: %s exited %d after SIGTERM; the end of its log:\n", t->name,
                st);
        char cmd[400];
        snprintf(cmd, sizeof(cmd), "tail -n 15 %s >&2", t->log);
        if (system(cmd) != 0)
          fprintf(stderr, "soak: (cannot show %s)\n", t->log);
      }
      /* After a crash the old incarnation still holds the lease: take over. */
      target_start(t, hard);
      pthread_mutex_unlock(&targets_lock);
      hard ? restarts_kill++ : restarts_term++;
      next_chaos = now + 500 + (rng >> 4) % 1500;
    }
    sxt_sleep_ms(50);
  }
  atomic_store(&stop, 1);
  uint64_t ran_ms = sx__mono_ms() - t0;
  take_sample((uint32_t)(ran_ms / 1000), redis.pid);
  for (int i = 0; i < READERS; i++)
    pthread_join(readers[i].th, NULL);

  /* Totals. */
  uint64_t bytes = 0, batches = 0, completed = 0, opens = 0, fails[K_KINDS] = {0};
  uint64_t wrong = 0, hangs = 0;
  for (int i = 0; i < READERS; i++) {
    reader *r = &readers[i];
    bytes += r->bytes;
    batches += r->batches;
    completed += r->completed;
    opens += r->opens;
    wrong += r->wrong;
    hangs += r->hangs;
    for (int k = 0; k < K_KINDS; k++)
      fails[k] += r->failures[k];
  }
  printf("soak: %.1f s, %d targets (restarted %d times: %d SIGTERM, %d SIGKILL), %d "
         "readers\n", (double)ran_ms / 1000, TARGETS, restarts_term + restarts_kill,
         restarts_term, restarts_kill, READERS);
  printf("soak: %lu batches, %lu completed and verified byte by byte (%.1f MiB), %lu "
         "opens; wrong bytes: %lu; hung batches: %lu\n", (unsigned long)batches,
         (unsigned long)completed, (double)bytes / (1 << 20), (unsigned long)opens,
         (unsigned long)wrong, (unsigned long)hangs);
  printf("soak: failures by kind (opens and batches):");
  for (int k = 0; k < K_KINDS; k++)
    printf(" %s %lu%s", kind_names[k], (unsigned long)fails[k], k + 1 < K_KINDS ? "," : "\n");
  for (int i = 0; i < READERS; i++)
    if (readers[i].last_other[0])
      printf("soak: reader %d, last 'other' failure: %s\n", i, readers[i].last_other);
  printf("soak: RSS (KiB) over time\n   t/s   readers    redis");
  for (int i = 0; i < TARGETS; i++)
    printf("   target%d", i);
  printf("\n");
  for (int i = 0; i < n_samples; i++) {
    printf("  %4u  %8ld %8ld", samples[i].t_s, samples[i].self_kib, samples[i].redis_kib);
    for (int k = 0; k < TARGETS; k++)
      printf("  %8ld", samples[i].target_kib[k]);
    printf("\n");
  }

  int rc = 0;
  if (wrong > 0) {
    printf("soak: FAIL: %lu batches brought wrong bytes\n", (unsigned long)wrong);
    rc = 1;
  }
  if (hangs > 0) {
    printf("soak: FAIL: a batch outlived its deadline\n");
    rc = 1;
  }
  if (bytes == 0) {
    printf("soak: FAIL: no batch completed\n");
    rc = 1;
  }
  if (unclean > 0) {
    printf("soak: FAIL: %d targets did not exit 0 after SIGTERM\n", unclean);
    rc = 1;
  }
  /* Growth of the long-lived processes after warm-up. */
  int warm = n_samples / 3;
  if (n_samples >= 3) {
    long grow_self = samples[n_samples - 1].self_kib - samples[warm].self_kib;
    long grow_redis = samples[n_samples - 1].redis_kib - samples[warm].redis_kib;
    printf("soak: RSS growth after warm-up (t=%us): readers %+ld KiB, redis %+ld KiB "
           "(bound %d KiB)\n", samples[warm].t_s, grow_self, grow_redis, RSS_SLACK_KIB);
    if (grow_self > RSS_SLACK_KIB || grow_redis > RSS_SLACK_KIB) {
      printf("soak: FAIL: RSS grew beyond the bound\n");
      rc = 1;
    }
  }
  for (int i = 0; i < READERS; i++) {
    sx_agent_destroy(readers[i].a);
    free(readers[i].mem[0]);
    free(readers[i].mem[1]);
  }
  for (int i = 0; i < TARGETS; i++) {
    kill(targets[i].pid, SIGTERM);
    sxt_reap(targets[i].pid, 10000);
  }
  sxt_redis_stop_all();
  if (rc == 0 || getenv("SXT_KEEP_LOGS") == NULL) {
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir);
    if (system(cmd) != 0)
      rc = rc ? rc : 1;
  } else {
    printf("soak: logs kept in %s\n", tmpdir);
  }
  printf("soak: %s\n", rc ? "FAILED" : "passed");
  return rc;
}
