/*
 * sx-agent's HTTP endpoint: libmicrohttpd with its own polling thread, so a
 * slow scraper never touches the agent's event loop.  Every answer is built
 * from one sx_agent_stats snapshot, which never waits for the agent.
 *
 *   /metrics   Prometheus text (sx_agent_metrics_text)
 *   /ready     200 when the segment is published and the lease held (the
 *              snapshot's `ready`), else 503 with the reason: for a
 *              Kubernetes readinessProbe
 *   /healthz   200 unless the agent was fenced (it is about to exit): for a
 *              livenessProbe
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <microhttpd.h>

#include "addr.h"
#include "http.h"
#include "segxfer.h"

struct sxa_http {
  struct MHD_Daemon *d;
  sx_agent *a;
};

/* Requests are tiny GETs; these bound what a misbehaving client can hold. */
#define HTTP_CONNECTIONS 64
#define HTTP_TIMEOUT_S 10

static const char metrics_type[] = "text/plain; version=0.0.4; charset=utf-8";
static const char text_type[] = "text/plain; charset=utf-8";

static enum MHD_Result answer(struct MHD_Connection *conn, unsigned status,
                              const char *type, char *body, size_t len, int owned) {
  struct MHD_Response *r = MHD_create_response_from_buffer(
      len, body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_MUST_COPY);
  if (r == NULL) {
    if (owned)
      free(body);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  enum MHD_Result ret = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return ret;
}

static enum MHD_Result text(struct MHD_Connection *conn, unsigned status,
                            const char *msg) {
  return answer(conn, status, text_type, (char *)msg, strlen(msg), 0);
}

static const char *state_word(sx_agent_state s) {
  switch (s) {
  case SX_AGENT_UNPUBLISHED:
    return "unpublished";
  case SX_AGENT_PUBLISHED:
    return "published";
  case SX_AGENT_RECLAIMING:
    return "reclaiming (lease lost, republishing)";
  case SX_AGENT_FENCED:
    return "fenced (another agent took the name)";
  }
  return "unknown";
}

static enum MHD_Result ready(struct MHD_Connection *conn, sx_agent *a) {
  sx_agent_stats s;
  if (sx_agent_stats_get(a, &s, sizeof(s)) != 0)
    return text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "no stats\n");
  char msg[256];
  if (s.ready) {
    snprintf(msg, sizeof(msg), "ready: published generation %lu, lease confirmed %lu ms "
             "ago\n", (unsigned long)s.generation, (unsigned long)s.lease_age_ms);
    return text(conn, MHD_HTTP_OK, msg);
  }
  char age[48] = "never";
  if (s.lease_age_ms != UINT64_MAX)
    snprintf(age, sizeof(age), "%lu ms ago", (unsigned long)s.lease_age_ms);
  snprintf(msg, sizeof(msg), "not ready: %s, metadata store %s, lease confirmed %s "
           "(lease %lu ms)%s%s\n", state_word(s.state), s.store_up ? "up" : "down", age,
           (unsigned long)s.lease_ms, s.last_error ? ", last error " : "",
           s.last_error ? sx_err_name(s.last_error) : "");
  return text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, msg);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version,
                              const char *upload_data, size_t *upload_size,
                              void **req_cls) {
  sxa_http *h = cls;
  (void)version;
  (void)upload_data;
  (void)req_cls;
  if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
    return text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET and HEAD\n");
  if (*upload_size != 0)
    return text(conn, MHD_HTTP_BAD_REQUEST, "no request body expected\n");
  if (strcmp(url, "/metrics") == 0) {
    char *body;
    size_t len;
    if (sx_agent_metrics_text(h->a, &body, &len) != 0)
      return text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "cannot render metrics\n");
    return answer(conn, MHD_HTTP_OK, metrics_type, body, len, 1);
  }
  if (strcmp(url, "/ready") == 0 || strcmp(url, "/readyz") == 0)
    return ready(conn, h->a);
  if (strcmp(url, "/healthz") == 0 || strcmp(url, "/livez") == 0) {
    sx_agent_stats s;
    if (sx_agent_stats_get(h->a, &s, sizeof(s)) == 0 && s.state == SX_AGENT_FENCED)
      return text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "fenced: exiting\n");
    return text(conn, MHD_HTTP_OK, "ok\n");
  }
  if (strcmp(url, "/") == 0)
    return text(conn, MHD_HTTP_OK, "sx-agent: /metrics /ready /healthz\n");
  return text(conn, MHD_HTTP_NOT_FOUND, "not found: try /metrics, /ready, /healthz\n");
}

/* libmicrohttpd's own complaints (bind failures, resource limits). */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  fputs("sx-agent: metrics http: ", stderr);
  vfprintf(stderr, fmt, ap);
}

int sxa_http_start(const char *listen, sx_agent *a, sxa_http **out, uint16_t *port,
                   char *err, size_t err_size) {
  char spec[300], host[256];
  struct sockaddr_storage ss;
  /* ":PORT" means every IPv4 address. */
  snprintf(spec, sizeof(spec), "%s%s", listen[0] == ':' ? "0.0.0.0" : "", listen);
  if (sx__hostport_sockaddr(spec, &ss, host, sizeof(host)) != 0) {
    snprintf(err, err_size, "--metrics-listen '%s' is not IP:PORT, [IPv6]:PORT or :PORT",
             listen);
    return -1;
  }
  sxa_http *h = calloc(1, sizeof(*h));
  if (h == NULL) {
    snprintf(err, err_size, "out of memory");
    return -1;
  }
  h->a = a;
  unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
  if (ss.ss_family == AF_INET6)
    flags |= MHD_USE_IPv6;
  uint16_t want = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
  /* The port argument is ignored when MHD_OPTION_SOCK_ADDR is given. */
  /* The logger goes first: libmicrohttpd logs option errors as it parses. */
  h->d = MHD_start_daemon(flags, want, NULL, NULL, handle, h,
                          MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                          MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                          MHD_OPTION_CONNECTION_LIMIT, (unsigned)HTTP_CONNECTIONS,
                          MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)HTTP_TIMEOUT_S,
                          MHD_OPTION_END);
  if (h->d == NULL) {
    snprintf(err, err_size, "cannot serve metrics on %s (address in use, or not an "
             "address of this host?)", listen);
    free(h);
    return -1;
  }
  const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
  *port = info != NULL && info->port ? info->port : want;
  *out = h;
  return 0;
}

void sxa_http_stop(sxa_http *h) {
  if (h == NULL)
    return;
  MHD_stop_daemon(h->d);
  free(h);
}
