/*
 * Agent lifecycle: parameters, the loop thread, the store connection and
 * its hooks, the transports, logging, status, and an orderly shutdown
 * (unpublish at once, end batches, close peers, transports, cache, store).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "addr.h"
#include "agent_int.h"
#include "push_int.h"

extern const sx_transport_ops *const sx__transports[];
extern const unsigned sx__n_transports;
extern const struct sx__conn_handler *const sx__conn_handlers[];
extern const unsigned sx__n_conn_handlers;

/* How long create waits for the store's first answer beyond its connect
 * timeout, and how long shutdown gives the store to delete the segment. */
#define CREATE_SLACK_MS 1000u

void sx_agent_params_init(sx_agent_params *p) {
  memset(p, 0, sizeof(*p));
  p->transports = SX_TRANSPORTS_ALL;
  p->lease_ms = 5000;
  p->conns_per_peer = 4;
  p->rdma_gid_index = -1;
  p->rdma_slice_bytes = 1u << 20;
  p->slice_bytes = SX__PLAN_SLICE;
  p->cache_ttl_ms = 5000;
  p->log_level = SX_LOG_INFO;
  p->tcp_threads = -1;
}

static void tctx_served(void *agent, sx_transport_kind kind, uint64_t bytes, int err) {
  sx__stats_served(agent, kind, bytes, err);
}

static void tctx_gpu_unreachable(void *agent) { sx__stats_gpu_unreachable(agent); }
static void tctx_nic_posted(void *agent, int dev, const char *name, uint64_t wrs,
                            uint64_t bytes) {
  sx__stats_nic(agent, dev, name, wrs, bytes);
}

void sx_agent_incarnation(const sx_agent *a, uint8_t out[SX_INCARNATION_LEN]) {
  memcpy(out, a->incarnation, SX_INCARNATION_LEN);
}

/* ------------------------------------------------------------ store hooks */

static void on_event(void *arg, const sx_event *ev) {
  sx_agent *a = arg;
  if (a->cache != NULL)
    sx__cache_event(a->cache, ev);
}

static void on_conn(void *arg, int up, int err, const char *msg) {
  sx_agent *a = arg;
  pthread_mutex_lock(&a->lock);
  int first = !a->conn_seen;
  if (first) {
    a->conn_seen = 1;
    a->conn_err = up ? 0 : (err ? err : SX_EUNREACH);
    snprintf(a->conn_msg, sizeof(a->conn_msg), "%s", msg ? msg : "");
    pthread_cond_broadcast(&a->cond);
  }
  a->status.store_up = up;
  if (up && a->store_down)
    a->status.store_reconnects++;
  pthread_mutex_unlock(&a->lock);
  if (up) {
    if (a->store_down) {
      sx__log(a, SX_LOG_INFO, "metadata store is back");
      /* Events may have been lost during the outage. */
      if (a->cache != NULL)
        sx__cache_flush(a->cache);
    }
    a->store_down = 0;
  } else if (!a->store_down) {
    a->store_down = 1;
    /* A failure of the very first connect is sx_agent_create()'s error. */
    if (!first)
      sx__log(a, SX_LOG_WARN, "metadata store connection lost: %s",
              msg && *msg ? msg : sx_strerror(err));
  }
  if (!a->shutting_down)
    sx__lease_on_conn(a, up, err, msg);
}

/* The store's watch is (again) in place.  Again means that events may have
 * been missed: a Redis Cluster node dropped a shard channel's subscription
 * when its slot moved, or a master failed over.  The cache forgets what it
 * holds, as after an outage. */
static void on_watch(void *arg) {
  sx_agent *a = arg;
  if (a->watch_seen++ > 0 && a->cache != NULL)
    sx__cache_flush(a->cache);
}

/* ------------------------------------------------------------ descriptor */

typedef struct desc_call {
  sx__call c;
  sx_desc d;
} desc_call;

static void desc_discard(sx__call *c) { sx_desc_free(&((desc_call *)c)->d); }

static void desc_run(sx__call *c) {
  desc_call *dc = (desc_call *)c;
  sx_agent *a = c->a;
  if (a->shutting_down) {
    sx__call_finish(c, SX_ESHUTDOWN, "the agent is shutting down");
    return;
  }
  int rc = sx__local_desc(a, &dc->d);
  sx__call_finish(c, rc, rc ? sx_errmsg() : NULL);
}

int sx_agent_descriptor(sx_agent *a, sx_desc *out) {
  if (a == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_agent_descriptor: NULL argument");
  desc_call *dc = calloc(1, sizeof(*dc));
  if (dc == NULL)
    return sx__err(SX_ENOMEM, "sx_agent_descriptor");
  dc->c.run = desc_run;
  dc->c.discard = desc_discard;
  int rc, err = sx__call_wait(a, &dc->c, SX__CALL_SLACK_MS, &rc);
  if (err)
    return err; /* the call is the agent's now */
  rc = sx__call_result(&dc->c, rc);
  if (rc == 0)
    *out = dc->d;
  else
    sx_desc_free(&dc->d);
  sx__call_free(&dc->c);
  return rc;
}

/* ------------------------------------------------------------ addresses */

/* The local address the kernel would use to reach host (a UDP connect
 * sends nothing); "" if it cannot tell. */
static void route_addr(const char *host, uint16_t port, char *out, size_t size) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  struct sockaddr_in *in4 = (struct sockaddr_in *)&ss;
  struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&ss;
  out[0] = '\0';
  memset(&ss, 0, sizeof(ss));
  if (uv_ip4_addr(host, port ? port : 9, in4) != 0 &&
      uv_ip6_addr(host, port ? port : 9, in6) != 0)
    return;
  int fd = socket(ss.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return;
  if (connect(fd, (struct sockaddr *)&ss,
              ss.ss_family == AF_INET ? sizeof(*in4) : sizeof(*in6)) == 0 &&
      getsockname(fd, (struct sockaddr *)&ss, &len) == 0)
    uv_ip_name((struct sockaddr *)&ss, out, size);
  close(fd);
}

static int wildcard(const char *host) {
  return host[0] == '\0' || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "::") == 0;
}

/* Fill a->listen and a->advertise from the params and the store URL. */
static int pick_addresses(sx_agent *a, const sx_agent_params *p, const sx_url *url) {
  const char *listen = p->listen;
  char host[256], adv[SX_ADDR_MAX + 1] = "";
  uint16_t port;
  if (listen == NULL && p->name != NULL)
    listen = "0.0.0.0:0";
  if (listen != NULL) {
    if (sx__hostport_split(listen, host, sizeof(host), &port))
      return sx__err(SX_EINVAL, "listen address '%.64s' is not host:port", listen);
    if ((a->listen = strdup(listen)) == NULL)
      return sx__err(SX_ENOMEM, "sx_agent_create");
  }
  if (p->advertise != NULL) {
    if (sx__strlcpy(adv, p->advertise, sizeof(adv)))
      return sx__err(SX_EINVAL, "advertise address is longer than %d bytes", SX_ADDR_MAX);
    /* Peers connect to it as given (rdma takes IP literals only): refuse
     * what no peer could use rather than publish it. */
    const char *why = sx__host_unusable(adv);
    if (why != NULL)
      return sx__err(SX_EINVAL, "advertise address '%.64s' is not one peers can connect to: %s",
                     adv, why);
  } else if (listen != NULL && !wildcard(host)) {
    if (sx__strlcpy(adv, host, sizeof(adv)))
      return sx__err(SX_EINVAL, "listen host is longer than %d bytes", SX_ADDR_MAX);
  } else {
    if (url->n_hosts > 0)
      route_addr(url->hosts[0].host, url->hosts[0].port, adv, sizeof(adv));
    if (adv[0] == '\0' || wildcard(adv))
      snprintf(adv, sizeof(adv), "127.0.0.1");
  }
  if ((a->advertise = strdup(adv)) == NULL)
    return sx__err(SX_ENOMEM, "sx_agent_create");
  return 0;
}

/* ------------------------------------------------------------ create */

static int check_params(const sx_agent_params *p) {
  int rc;
  if (p->name != NULL && (rc = sx_name_validate(p->name)) != 0)
    return rc;
  if (p->ns != NULL && (rc = sx_ns_validate(p->ns)) != 0)
    return rc;
  if (p->metadata_url == NULL)
    return sx__err(SX_EURL, "metadata URL is empty (set metadata_url)");
  if (p->lease_ms < 100 || p->lease_ms > 3600000)
    return sx__err(SX_EINVAL, "lease_ms %u is not 100..3600000", p->lease_ms);
  if (p->renew_ms >= p->lease_ms)
    return sx__err(SX_EINVAL, "renew_ms %u must be below lease_ms %u", p->renew_ms,
                   p->lease_ms);
  if ((p->transports & SX_TRANSPORTS_ALL) == 0)
    return sx__err(SX_EINVAL, "transports allows none of tcp, rdma, cuda_ipc");

  if (p->slice_bytes > (64u << 20))
    return sx__err(SX_EINVAL, "slice_bytes %u is above 64 MiB (the largest read a "
                   "target serves)", p->slice_bytes);
  if (p->staging_bytes != 0 && p->staging_bytes < (1u << 20))
    return sx__err(SX_EINVAL, "staging_bytes %lu is below 1 MiB",
                   (unsigned long)p->staging_bytes);
  if (p->tcp_threads < -1 || p->tcp_threads > 64)
    return sx__err(SX_EINVAL, "tcp_threads %d is not -1..64", p->tcp_threads);
  if (p->tcp_thread_bytes > (64u << 20))
    return sx__err(SX_EINVAL, "tcp_thread_bytes %u is above 64 MiB (the largest read a "
                   "target serves)", p->tcp_thread_bytes);
  if (p->conns_per_peer > 64)
    return sx__err(SX_EINVAL, "conns_per_peer %u is above 64", p->conns_per_peer);
  if (p->n_labels > SX_MAX_LABELS || (p->n_labels && p->labels == NULL))
    return sx__err(SX_EINVAL, "labels: %u given (at most %u)", p->n_labels,
                   SX_MAX_LABELS);
  /* The layout and labels must make a valid descriptor. */
  sx_desc d;
  sx_desc_init(&d);
  d.layout = p->layout;
  for (uint32_t i = 0; i < p->n_labels && rc == 0; i++)
    rc = sx_desc_set_label(&d, p->labels[i].key, p->labels[i].value);
  if (rc == 0)
    rc = sx__layout_validate(&d);
  sx_desc_free(&d);
  return rc;
}

static int copy_params(sx_agent *a, const sx_agent_params *p) {
  a->p = *p;
  if (p->name)
    snprintf(a->name, sizeof(a->name), "%s", p->name);
  a->p.name = p->name ? a->name : NULL;
  /* Append the namespace override as the last query item: it wins. */
  size_t ulen = strlen(p->metadata_url) + (p->ns ? strlen(p->ns) + 16 : 0) + 1;
  if ((a->url = malloc(ulen)) == NULL)
    return sx__err(SX_ENOMEM, "sx_agent_create");
  if (p->ns)
    snprintf(a->url, ulen, "%s%snamespace=%s", p->metadata_url,
             strchr(p->metadata_url, '?') ? "&" : "?", p->ns);
  else
    snprintf(a->url, ulen, "%s", p->metadata_url);
  a->p.metadata_url = a->url;
  if ((p->ns && (a->ns = strdup(p->ns)) == NULL) ||
      (p->rdma_devices && (a->rdma_devices = strdup(p->rdma_devices)) == NULL))
    return sx__err(SX_ENOMEM, "sx_agent_create");
  a->p.ns = a->ns;
  a->p.rdma_devices = a->rdma_devices;
  if (p->n_labels) {
    if ((a->labels = malloc(p->n_labels * sizeof(sx_label))) == NULL)
      return sx__err(SX_ENOMEM, "sx_agent_create");
    memcpy(a->labels, p->labels, p->n_labels * sizeof(sx_label));
  }
  a->p.labels = a->labels;
  if (a->p.renew_ms == 0)
    a->p.renew_ms = a->p.lease_ms / 3;
  if (a->p.conns_per_peer == 0)
    a->p.conns_per_peer = 4;
  if (a->p.slice_bytes == 0)
    a->p.slice_bytes = SX__PLAN_SLICE;
  if (a->p.cache_ttl_ms == 0)
    a->p.cache_ttl_ms = 5000;
  if (a->p.staging_bytes == 0)
    a->p.staging_bytes = 64u << 20;
  if (a->p.log == NULL)
    a->p.log = sx__log_stderr;
  return 0;
}

static void loop_main(void *arg) {
  sx_agent *a = arg;
  a->loop_tid = uv_thread_self();
  /* libuv writes to sockets with write(2), which raises SIGPIPE when the
   * peer has reset the connection, and SIGPIPE kills a process that did
   * not set it to SIG_IGN (a library cannot ask that of every engine).
   * Blocked here, the signal stays pending on this thread, which never
   * takes it, and the write fails with EPIPE, which the transports handle
   * like any broken connection. */
  sigset_t pipe;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, NULL);
  uv_run(&a->loop, UV_RUN_DEFAULT);
}

static int open_transports(sx_agent *a) {
  a->tctx = (sx_tctx){
      .loop = &a->loop,
      .name = a->name,
      .incarnation = a->incarnation,
      .token = a->token,
      .params = &a->p,
      .find_region = sx__find_region,
      .log = sx__log_tctx,
      .served = tctx_served,
      .agent = a,
      .write_auth = sx__push_write_auth,
      .write_auth_cancel = sx__push_write_auth_cancel,
      .write_granted = sx__push_write_granted,
      .grant_epoch = &a->push->epoch,
      .notice = sx__push_notice_in,
      .read_notice = sx__read_notice_in,
      .written = sx__push_written,
      .gpu_unreachable = tctx_gpu_unreachable,
      .nic_posted = tctx_nic_posted,
      .region_at = sx__region_at,
      .grants_settled = sx__push_grants_settled,
      .conn_handlers = sx__conn_handlers,
      .n_conn_handlers = sx__n_conn_handlers,
      .lane_failed = sx__batches_lane_failed,
  };
  int opened = 0, last = SX_ENODEV;
  for (unsigned i = 0; i < sx__n_transports; i++) {
    const sx_transport_ops *ops = sx__transports[i];
    if (!(a->p.transports & (1u << ops->kind)))
      continue;
    sx_transport *t = NULL;
    int rc = ops->open(&a->tctx, &t);
    if (rc == SX_ENODEV) {
      sx__log(a, SX_LOG_INFO, "%s transport not available here: %s", ops->name,
              sx_errmsg());
      continue;
    }
    if (rc)
      return sx__errwrap(rc, "%s transport", ops->name);
    a->tr[ops->kind] = t;
    opened++;
    last = 0;
  }
  if (opened == 0)
    return sx__err(last, "no transport could be opened (allowed: %s%s%s)",
                   a->p.transports & SX_TRANSPORTS_TCP ? "tcp " : "",
                   a->p.transports & SX_TRANSPORTS_RDMA ? "rdma " : "",
                   a->p.transports & SX_TRANSPORTS_CUDA_IPC ? "cuda_ipc" : "");
  return 0;
}

/* Register the ping scratch bytes with every transport that registers
 * memory; a failure only costs pings over that transport. */
static void register_scratch(sx_agent *a) {
  sx_region *r = &a->scratch.l.r;
  r->id = UINT32_MAX; /* never published, never looked up by id */
  r->layer_count = 1;
  r->addr = (uint64_t)(uintptr_t)a->scratch_buf;
  r->length = r->block_bytes = r->block_stride = sizeof(a->scratch_buf);
  r->num_blocks = 1;
  snprintf(r->location, sizeof(r->location), "cpu");
  a->scratch.l.mem = (sx__mem_info){.kind = SX__MEM_HOST, .device = -1};
  for (int k = 0; k < SX__TRANSPORT_SLOTS; k++) {
    sx_transport *t = a->tr[k];
    if (t == NULL || t->ops->reg_mem == NULL)
      continue;
    if (t->ops->reg_mem(t, &a->scratch.l) == 0)
      a->scratch_reg[k] = 1;
    else
      sx__log(a, SX_LOG_WARN, "%s: cannot register the ping buffer: %s", t->ops->name,
              sx_errmsg());
  }
}

static void close_transports(sx_agent *a) {
  for (int k = 0; k < SX__TRANSPORT_SLOTS; k++) {
    sx_transport *t = a->tr[k];
    if (t == NULL)
      continue;
    /* Deregister what is still registered; the transport then closes. */
    sx__ltable *lt = a->lt;
    for (uint32_t i = 0; lt && i < lt->n; i++)
      if (t->ops->dereg_mem)
        t->ops->dereg_mem(t, lt->v[i]);
    if (a->scratch_reg[k] && t->ops->dereg_mem)
      t->ops->dereg_mem(t, &a->scratch.l);
    a->scratch_reg[k] = 0;
    t->ops->close(t);
    a->tr[k] = NULL;
    /* close() closed and freed the transport's peers: peers still held
     * (by a cache refresh that completes during shutdown) must not close
     * them again. */
    for (sx__rpeer *p = a->peers; p != NULL; p = p->next) {
      if (p->kind == (sx_transport_kind)k)
        p->tp = p->wtp = NULL;
      if (k == SX_TRANSPORT_TCP)
        p->ntp = NULL;
    }
  }
}

static void free_agent(sx_agent *a) {
  sx__push_free(a);
  sx__ltable_put(a->lt);
  free(a->url);
  free(a->ns);
  free(a->listen);
  free(a->advertise);
  free(a->rdma_devices);
  free(a->labels);
  sx__wake_release(&a->wake); /* no thread can queue a call any more */
  pthread_mutex_destroy(&a->lock);
  pthread_mutex_destroy(&a->direct_mu);
  pthread_cond_destroy(&a->cond);
  free(a);
}

/* Close what create opened, run the loop until the handles are gone. */
static void close_loop(sx_agent *a);

int sx_agent_create(const sx_agent_params *p, sx_agent **out) {
  if (p == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_agent_create: NULL argument");
  int rc = check_params(p);
  if (rc)
    return rc;
  sx_url url;
  if ((rc = sx__url_parse(p->metadata_url, &url)) != 0)
    return rc;
  sx_agent *a = calloc(1, sizeof(*a));
  if (a == NULL)
    return sx__err(SX_ENOMEM, "sx_agent_create");
  a->wake.fd = -1;
  pthread_mutex_init(&a->lock, NULL);
  pthread_mutex_init(&a->direct_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&a->cond, &ca);
  pthread_condattr_destroy(&ca);
  a->calls_tail = &a->calls;
  a->lease.q_tail = &a->lease.q;
  if ((rc = sx__push_init(a)) || (rc = copy_params(a, p)) || (rc = pick_addresses(a, p, &url)))
    goto out_free;
  a->p.listen = a->listen;
  a->p.advertise = a->advertise;
  if ((rc = sx__random(a->incarnation, sizeof(a->incarnation))) ||
      (rc = sx__random(a->token, sizeof(a->token))))
    goto out_free;
  sx__ltable *lt = calloc(1, sizeof(*lt));
  if (lt == NULL || sx__rindex_build(&lt->ix, NULL, 0)) {
    free(lt);
    rc = sx__err(SX_ENOMEM, "sx_agent_create");
    goto out_free;
  }
  lt->refs = 1;
  a->lt = lt;
  if (uv_loop_init(&a->loop)) {
    rc = sx__err(SX_EIO, "sx_agent_create: uv_loop_init failed");
    goto out_free;
  }
  if ((rc = sx__wake_init(&a->loop, &a->wake, sx__calls_run)) != 0) {
    if (a->wake.fd >= 0) {
      sx__wake_close(&a->wake, NULL); /* the loop has no other handle yet */
      uv_run(&a->loop, UV_RUN_DEFAULT);
    }
    uv_loop_close(&a->loop);
    goto out_free;
  }
  sx__calls_open(a);
  uv_timer_init(&a->loop, &a->drain_timer);
  a->drain_timer.data = a;
  uv_timer_init(&a->loop, &a->stop_timer);
  a->stop_timer.data = a;
  sx__batches_init(a);
  uv_timer_init(&a->loop, &a->lease.timer);
  a->lease.timer.data = a;
  a->lease.timer_init = 1;

  sx_backend_hooks hooks = {
      .on_event = on_event, .on_conn = on_conn, .on_watch = on_watch, .arg = a};
  if ((rc = sx__backend_open(&a->loop, a->url, &hooks, &a->backend)) != 0)
    goto out_loop;
  sx_cache_params cp;
  sx__cache_params_init(&cp);
  cp.ttl_ms = a->p.cache_ttl_ms;
  if ((rc = sx__cache_create(&a->loop, a->backend, &cp, &a->cache)) != 0 ||
      (rc = open_transports(a)) != 0)
    goto out_loop;
  register_scratch(a);
  if (uv_thread_create(&a->thread, loop_main, a)) {
    rc = sx__err(SX_EIO, "sx_agent_create: cannot start the agent thread");
    goto out_loop;
  }

  /* Wait for the store's first word: connected, or why not. */
  uint32_t wait_ms = url.connect_timeout_ms + CREATE_SLACK_MS;
  struct timespec ts;
  sx__deadline(&ts, wait_ms);
  pthread_mutex_lock(&a->lock);
  while (!a->conn_seen)
    if (pthread_cond_timedwait(&a->cond, &a->lock, &ts) != 0)
      break;
  int seen = a->conn_seen, err = a->conn_err;
  char msg[sizeof(a->conn_msg)];
  snprintf(msg, sizeof(msg), "%s", a->conn_msg);
  pthread_mutex_unlock(&a->lock);
  if (!seen || err) {
    char red[512];
    sx__url_redact(&url, red, sizeof(red));
    if (!seen)
      rc = sx__err(SX_ETIMEDOUT, "metadata store %s did not answer within %u ms", red,
                   wait_ms);
    else if (msg[0]) /* the backend's message names the store already */
      rc = sx__err(err, "%s", msg);
    else
      rc = sx__err(err, "metadata store %s: %s", red, sx_strerror(err));
    char keep[1024];
    snprintf(keep, sizeof(keep), "%s", sx_errmsg());
    sx_agent_destroy(a);
    return sx__err(rc, "%s", keep);
  }
  char red[512], inc[2 * SX_INCARNATION_LEN + 1];
  sx__url_redact(&url, red, sizeof(red));
  sx_hex(a->incarnation, SX_INCARNATION_LEN, inc);
  sx__log(a, SX_LOG_INFO, "agent started: incarnation %s, store %s, advertise %s", inc,
          red, a->advertise);
  *out = a;
  return 0;

out_loop:
  close_loop(a);
out_free:
  free_agent(a);
  return rc;
}

/* ------------------------------------------------------------ shutdown */

static void close_store_and_handles(sx_agent *a) {
  sx__push_close(a);
  sx__lease_close(a);
  sx__regions_close(a);
  close_transports(a);
  sx__batches_direct_close(a); /* their lanes' copies ended with the transports */
  sx_cache *cache = a->cache;
  sx__stats_cache_closing(a); /* keeps its counters, a->cache = NULL */
  sx__cache_close(cache);
  sx__backend_close(a->backend);
  a->backend = NULL;
  sx__calls_drain(a);
  sx__batches_close(a);
  if (!uv_is_closing((uv_handle_t *)&a->drain_timer))
    uv_close((uv_handle_t *)&a->drain_timer, NULL);
  sx__wake_close(&a->wake, NULL);
  sx__calls_close(a);
  if (!uv_is_closing((uv_handle_t *)&a->stop_timer))
    uv_close((uv_handle_t *)&a->stop_timer, NULL);
}

static void close_loop(sx_agent *a) {
  a->shutting_down = 1;
  close_store_and_handles(a);
  uv_run(&a->loop, UV_RUN_DEFAULT);
  uv_loop_close(&a->loop);
}

/* The last step, on a fresh stack (not inside a store callback, since it
 * closes the store): end batches, close peers, transports, cache, store. */
static void shutdown_close(uv_timer_t *t) {
  sx_agent *a = t->data;
  sx__batches_abort(a, SX_ESHUTDOWN);
  sx__segments_close(a);
  close_store_and_handles(a);
}

static void shutdown_finish(sx_agent *a, void *arg, int rc) {
  (void)arg;
  if (rc && rc != SX_ESHUTDOWN)
    sx__log(a, SX_LOG_WARN, "unpublishing at shutdown failed: %s (the lease will "
            "expire)", sx_strerror(rc));
  uv_timer_start(&a->stop_timer, shutdown_close, 0, 0);
}

static void shutdown_run(sx__call *c) {
  sx_agent *a = c->a;
  if (a->shutting_down)
    return;
  /* Unpublish first so peers see the segment gone at once; new calls
   * fail from here on, the store op is bounded by the backend's timeout. */
  a->shutting_down = 1;
  sx__lease_unpublish(a, shutdown_finish, NULL);
}

void sx_agent_destroy(sx_agent *a) {
  if (a == NULL)
    return;
  if (sx__on_loop(a)) {
    sx__log(a, SX_LOG_ERROR, "sx_agent_destroy called on the agent's own thread: "
            "ignored (call it from another thread)");
    return;
  }
  a->shutdown.run = shutdown_run;
  a->shutdown.embedded = 1;
  sx__call_post(a, &a->shutdown);
  pthread_mutex_lock(&a->lock);
  a->joining = 1; /* sx_agent_stats_get stops asking for the thread's CPU clock */
  pthread_mutex_unlock(&a->lock);
  uv_thread_join(&a->thread);
  if (uv_loop_close(&a->loop) != 0)
    sx__log(a, SX_LOG_ERROR, "agent stopped with libuv handles still open (a bug)");
  sx__log(a, SX_LOG_INFO, "agent stopped");
  free_agent(a);
}
