/* etcd processes for integration tests.  See etcd_harness.h. */
#include <curl/curl.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "etcd/etcd.h"
#include "etcd_harness.h"
#include "internal.h"
#include "sxtest.h"

/* Startup on a busy shared machine can be slow; this only bounds a hang. */
#define START_TIMEOUT_MS 60000

static int on_path(const char *prog) {
  const char *path = getenv("PATH");
  char buf[1024];
  if (path == NULL)
    path = "/usr/bin:/bin";
  while (*path) {
    size_t n = strcspn(path, ":");
    snprintf(buf, sizeof(buf), "%.*s/%s", (int)n, path, prog);
    if (access(buf, X_OK) == 0)
      return 1;
    path += n + (path[n] == ':');
  }
  return 0;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f) {
  (void)st, (void)flag, (void)f;
  remove(p);
  return 0;
}

static void rm_rf(const char *dir) {
  if (dir[0] != '\0')
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static void tail_log(const sxt_etcd *e) {
  FILE *f = fopen(e->log, "r");
  if (f == NULL)
    return;
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  fseek(f, size > 3000 ? size - 3000 : 0, SEEK_SET);
  char buf[3001];
  size_t n = fread(buf, 1, 3000, f);
  buf[n] = '\0';
  fclose(f);
  fprintf(stderr, "--- tail of %s ---\n%s\n---\n", e->log, buf);
}

static size_t collect(char *p, size_t size, size_t n, void *userp) {
  char **buf = userp;
  size_t old = *buf ? strlen(*buf) : 0, len = size * n;
  char *b = realloc(*buf, old + len + 1);
  if (b == NULL)
    return 0;
  memcpy(b + old, p, len);
  b[old + len] = '\0';
  *buf = b;
  return len;
}

/* One blocking request (test code only); 0 with the answer, or -1. */
static int http(const sxt_etcd *e, const char *path, const char *body, long timeout_ms,
                char **answer) {
  char url[256];
  char *buf = NULL;
  snprintf(url, sizeof(url), "%s://127.0.0.1:%u%s", e->tls ? "https" : "http", e->port,
           path);
  CURL *c = curl_easy_init();
  if (c == NULL)
    return -1;
  struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_PROXY, "");
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &buf);
  if (e->tls)
    curl_easy_setopt(c, CURLOPT_CAINFO, e->ca);
  if (body) {
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
  }
  CURLcode rc = curl_easy_perform(c);
  long code = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
  curl_slist_free_all(h);
  curl_easy_cleanup(c);
  if (rc != CURLE_OK || code != 200) {
    free(buf);
    return -1;
  }
  if (answer)
    *answer = buf ? buf : strdup("");
  else
    free(buf);
  return 0;
}

int sxt_etcd_post(const sxt_etcd *e, const char *path, const char *body, char **answer) {
  return http(e, path, body, 10000, answer);
}

int sxt_etcd_put(const sxt_etcd *e, const char *key, const void *value, size_t len) {
  json_t *req = json_object();
  json_object_set_new(req, "key", sx__etcd_b64(key, strlen(key)));
  json_object_set_new(req, "value", sx__etcd_b64(value, len));
  char *body = json_dumps(req, JSON_COMPACT);
  json_decref(req);
  int rc = body ? sxt_etcd_post(e, "/v3/kv/put", body, NULL) : -1;
  free(body);
  return rc;
}

static int healthy(const sxt_etcd *e) {
  char *ans = NULL;
  int ok = http(e, "/health", NULL, 2000, &ans) == 0 && strstr(ans, "\"true\"") != NULL;
  free(ans);
  return ok;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

static int spawn(sxt_etcd *e) {
  char client[64], peer[64], cluster[96];
  const char *scheme = e->tls ? "https" : "http";
  snprintf(client, sizeof(client), "%s://127.0.0.1:%u", scheme, e->port);
  snprintf(peer, sizeof(peer), "http://127.0.0.1:%u", e->peer_port);
  snprintf(cluster, sizeof(cluster), "sxt=%s", peer);
  const char *argv[32] = {"etcd",  "--name",
                          "sxt",   "--data-dir",
                          e->data, "--listen-client-urls",
                          client,  "--advertise-client-urls",
                          client,  "--listen-peer-urls",
                          peer,    "--initial-advertise-peer-urls",
                          peer,    "--initial-cluster",
                          cluster, "--initial-cluster-state",
                          "new",   "--logger",
                          "zap",   "--log-level",
                          "warn"};
  int n = 21;
  if (e->tls) {
    argv[n++] = "--cert-file";
    argv[n++] = e->cert;
    argv[n++] = "--key-file";
    argv[n++] = e->key;
  }
  argv[n] = NULL;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0)
    return -1;
  if (pid == 0) {
    /* The server must not outlive the test, whatever happens to it. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent)
      _exit(127);
    int fd = open(e->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execvp("etcd", (char *const *)argv);
    _exit(127);
  }
  e->pid = pid;
  return 0;
}

/* Start the process and wait until it answers /health: 0, or -1 if it
 * exited (e.g. a port was taken meanwhile) or never became healthy. */
static int launch(sxt_etcd *e) {
  if (spawn(e) != 0)
    return -1;
  uint64_t start = sx__mono_ms();
  while (sx__mono_ms() - start < START_TIMEOUT_MS) {
    int st;
    if (waitpid(e->pid, &st, WNOHANG) == e->pid) {
      e->pid = 0;
      return -1;
    }
    if (healthy(e))
      return 0;
    sleep_ms(50);
  }
  sxt_etcd_kill(e, SIGKILL);
  return -1;
}

static int make_certs(sxt_etcd *e) {
  char cmd[2048];
  snprintf(e->ca, sizeof(e->ca), "%s/ca.pem", e->root);
  snprintf(e->cert, sizeof(e->cert), "%s/server.pem", e->root);
  snprintf(e->key, sizeof(e->key), "%s/server-key.pem", e->root);
  snprintf(
      cmd, sizeof(cmd),
      "cd '%s' && "
      "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 "
      "-subj /CN=sxt-test-ca -keyout ca-key.pem -out ca.pem && "
      "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes "
      "-subj /CN=127.0.0.1 -keyout server-key.pem -out server.csr && "
      "printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext && "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial "
      "-days 2 -extfile san.ext -out server.pem",
      e->root);
  char full[2600];
  snprintf(full, sizeof(full), "( %s ) >'%s/openssl.log' 2>&1", cmd, e->root);
  return system(full) == 0 ? 0 : -1;
}

/* Whether a process is alive: a zombie (killed, not yet reaped) is not. */
static int alive(long pid) {
  char path[64], buf[512];
  if (kill((pid_t)pid, 0) != 0 && errno == ESRCH)
    return 0;
  snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 1; /* no /proc: trust kill() */
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *paren = strrchr(buf, ')');
  return !(paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X'));
}

/* Remove the temp dirs of test processes that died without cleaning up
 * (killed by a timeout): each dir names its owner in owner.pid. */
static void sweep_stale(const char *tmp) {
  DIR *d = opendir(tmp);
  struct dirent *de;
  if (d == NULL)
    return;
  while ((de = readdir(d)) != NULL) {
    char path[512], pidfile[600];
    if (strncmp(de->d_name, "sxt-etcd-", 9) != 0)
      continue;
    snprintf(path, sizeof(path), "%s/%s", tmp, de->d_name);
    snprintf(pidfile, sizeof(pidfile), "%s/owner.pid", path);
    FILE *f = fopen(pidfile, "r");
    long pid = 0;
    if (f == NULL)
      continue; /* kept on purpose (SXT_KEEP_ETCD), or not ours */
    if (fscanf(f, "%ld", &pid) != 1)
      pid = 0;
    fclose(f);
    if (pid > 0 && !alive(pid))
      rm_rf(path);
  }
  closedir(d);
}

int sxt_etcd_start(sxt_etcd *e, int tls) {
  memset(e, 0, sizeof(*e));
  if (!on_path("etcd")) {
    fprintf(stderr, "etcd is not installed (Debian package etcd-server)\n");
    return 1;
  }
  if (tls && !on_path("openssl")) {
    fprintf(stderr, "openssl is not installed: no test certificates\n");
    return 1;
  }
  curl_global_init(CURL_GLOBAL_DEFAULT);
  const char *tmp = getenv("TMPDIR");
  snprintf(e->root, sizeof(e->root), "%s/sxt-etcd-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  sweep_stale(tmp && *tmp ? tmp : "/tmp");
  if (mkdtemp(e->root) == NULL) {
    fprintf(stderr, "mkdtemp %s: %s\n", e->root, strerror(errno));
    e->root[0] = '\0';
    return -1;
  }
  char pidfile[300];
  snprintf(pidfile, sizeof(pidfile), "%s/owner.pid", e->root);
  FILE *pf = fopen(pidfile, "w");
  if (pf != NULL) {
    fprintf(pf, "%ld\n", (long)getpid());
    fclose(pf);
  }
  snprintf(e->data, sizeof(e->data), "%s/data", e->root);
  snprintf(e->log, sizeof(e->log), "%s/etcd.log", e->root);
  e->tls = tls;
  if (tls && make_certs(e) != 0) {
    fprintf(stderr, "openssl could not make test certificates (see %s/openssl.log)\n",
            e->root);
    return -1;
  }
  /* Free ports can be taken between our probe and etcd's bind: retry. */
  for (int attempt = 0; attempt < 4; attempt++) {
    e->port = sxt_free_port();
    do
      e->peer_port = sxt_free_port();
    while (e->peer_port == e->port);
    if (launch(e) == 0)
      return 0;
    rm_rf(e->data);
  }
  fprintf(stderr, "etcd did not start\n");
  tail_log(e);
  return -1;
}

int sxt_etcd_kill(sxt_etcd *e, int sig) {
  if (e->pid <= 0)
    return -1;
  if (sig == SIGKILL) {
    kill(e->pid, SIGCONT); /* a stopped process dies too, but be plain */
    kill(e->pid, SIGKILL);
    while (waitpid(e->pid, NULL, 0) < 0 && errno == EINTR) {
    }
    e->pid = 0;
    return 0;
  }
  if (kill(e->pid, sig) != 0)
    return -1;
  /* kill() only queues the signal: wait until the server is really frozen
   * (or thawed), so that a test's next request meets that state. */
  int st;
  pid_t r;
  if (sig == SIGSTOP) {
    while ((r = waitpid(e->pid, &st, WUNTRACED)) < 0 && errno == EINTR) {
    }
    return r == e->pid && WIFSTOPPED(st) ? 0 : -1;
  }
  if (sig == SIGCONT) {
    /* WCONTINUED reports only a stopped process that was continued; one
     * that ran already gives nothing to wait for. */
    while ((r = waitpid(e->pid, &st, WCONTINUED | WNOHANG)) < 0 && errno == EINTR) {
    }
  }
  return 0;
}

int sxt_etcd_restart(sxt_etcd *e, int wipe) {
  if (e->pid > 0)
    sxt_etcd_kill(e, SIGKILL);
  if (wipe)
    rm_rf(e->data);
  /* The ports were ours a moment ago; etcd binds with SO_REUSEADDR.  A
   * few tries cover a slow release. */
  for (int attempt = 0; attempt < 4; attempt++) {
    if (launch(e) == 0)
      return 0;
    sleep_ms(200);
  }
  fprintf(stderr, "etcd did not restart\n");
  tail_log(e);
  return -1;
}

void sxt_etcd_stop(sxt_etcd *e) {
  if (e == NULL)
    return;
  if (e->pid > 0)
    sxt_etcd_kill(e, SIGKILL);
  /* SXT_KEEP_ETCD=1 keeps the data dir and log for a post-mortem. */
  if (getenv("SXT_KEEP_ETCD") == NULL) {
    rm_rf(e->root);
  } else if (e->root[0] != '\0') {
    char pidfile[300];
    snprintf(pidfile, sizeof(pidfile), "%s/owner.pid", e->root);
    unlink(pidfile); /* not stale: the sweep leaves it alone */
    fprintf(stderr, "etcd files kept in %s\n", e->root);
  }
  e->root[0] = '\0';
}

void sxt_etcd_url(const sxt_etcd *e, const char *ns, const char *extra, char *buf,
                  size_t size) {
  snprintf(buf, size, "%s://127.0.0.1:%u?namespace=%s%s%s",
           e->tls ? "etcd+https" : "etcd", e->port, ns, extra ? "&" : "",
           extra ? extra : "");
}

/* ---------------------------------------------------------------- fixture */

static int fx_start(void **server) {
  sxt_etcd *e = calloc(1, sizeof(*e));
  if (e == NULL)
    return -1;
  int rc = sxt_etcd_start(e, 0);
  if (rc != 0) {
    sxt_etcd_stop(e);
    free(e);
    return rc;
  }
  *server = e;
  return 0;
}

static void fx_stop(void *server) {
  sxt_etcd_stop(server);
  free(server);
}

static int fx_kill(void *server, int sig) { return sxt_etcd_kill(server, sig); }
static int fx_restart(void *server, int wipe) { return sxt_etcd_restart(server, wipe); }

static void fx_url(void *server, const char *ns, const char *extra, char *buf,
                   size_t size) {
  sxt_etcd_url(server, ns, extra, buf, size);
}

static void fx_dead_url(void *server, const char *ns, char *buf, size_t size) {
  (void)server;
  snprintf(buf, size, "etcd://127.0.0.1:%u?namespace=%s&connect_timeout_ms=1000",
           sxt_free_port(), ns);
}

static int fx_plant(void *server, const char *ns, const char *name, const void *value,
                    size_t len) {
  char key[512];
  snprintf(key, sizeof(key), "%s%s/seg/%s", SX_ETCD_ROOT, ns, name);
  return sxt_etcd_put(server, key, value, len);
}

const sxt_store_fixture sxt_etcd_fixture = {
    .name = "etcd",
    .start = fx_start,
    .stop = fx_stop,
    .kill = fx_kill,
    .restart = fx_restart,
    .url = fx_url,
    .dead_url = fx_dead_url,
    .plant = fx_plant,
    .short_lease_ms = 2000,
};
