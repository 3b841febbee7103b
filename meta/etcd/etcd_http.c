/*
 * HTTP to etcd's JSON gateway: libcurl's multi interface on a libuv loop
 * (curl_multi_socket_action with a uv_poll_t per socket and a uv_timer_t for
 * curl's timeouts), endpoint failover and bounded answers.  See etcd.h.
 *
 * Reentrancy: libcurl forbids calling it from its own callbacks, and our
 * callers' callbacks may start, cancel or close anything.  So the curl
 * callbacks here only record (bytes into a buffer, sockets into polls), and
 * every delivery happens in settle(), after curl_multi_socket_action() has
 * returned.  A call being delivered is unlinked (done) or marked busy
 * (stream message) first, so a callback that cancels it or closes the whole
 * connection never frees memory that is still in use.
 */
#include <curl/curl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "etcd.h"
#include "internal.h"

size_t sx__etcd_answer_max = SX_ETCD_ANSWER_MAX;

struct sx__etcd_call {
  sx__etcd_call *prev, *next; /* h->calls */
  sx__etcd_http *h;
  CURL *easy;
  char path[48];
  char *body; /* the request, JSON */
  size_t body_len;
  sx__etcd_done_fn done;
  sx__etcd_msg_fn on_msg; /* streams only */
  void *arg;
  int ep;    /* endpoint in use */
  int tried; /* endpoints that refused a connection so far */
  char *buf; /* the answer (unary) or what is left of it (stream) */
  size_t len, cap, scanned;
  int over;    /* the answer outgrew sx__etcd_answer_max */
  int pending; /* stream: a complete line may be waiting in buf */
  int busy;    /* stream: on_msg is running; cancel defers the free */
  int canceled;
  int in_multi;
  char unreach[200]; /* why each endpoint tried so far failed */
  char errbuf[CURL_ERROR_SIZE];
};

struct sx__etcd_http {
  uv_loop_t *loop;
  CURLM *multi;
  uv_timer_t timer;
  struct curl_slist *hdrs;
  sx_url url;
  int https;
  int cur; /* preferred endpoint */
  sx__etcd_call *calls;
  int handles; /* open uv handles: the timer and one poll per socket */
  int closing;
  char where[300]; /* "host:port" of cur, for messages */
  /* TLS files from the environment (paths, never secrets themselves). */
  char cacert[512], cert[512], key[512];
};

typedef struct sock_ctx {
  uv_poll_t poll;
  curl_socket_t fd;
  sx__etcd_http *h;
} sock_ctx;

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;

static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

static void settle(sx__etcd_http *h);

/* ---------------------------------------------------------------- libuv glue */

static void maybe_free(sx__etcd_http *h) {
  if (h->closing && h->handles == 0) {
    curl_slist_free_all(h->hdrs);
    free(h);
  }
}

static void poll_closed(uv_handle_t *hd) {
  sock_ctx *s = hd->data;
  sx__etcd_http *h = s->h;
  free(s);
  h->handles--;
  maybe_free(h);
}

static void timer_closed(uv_handle_t *hd) {
  sx__etcd_http *h = hd->data;
  h->handles--;
  maybe_free(h);
}

static void drive(sx__etcd_http *h, curl_socket_t fd, int flags) {
  int running;
  if (h->closing)
    return;
  curl_multi_socket_action(h->multi, fd, flags, &running);
  settle(h);
}

static void on_poll(uv_poll_t *p, int status, int events) {
  sock_ctx *s = p->data;
  int flags = 0;
  if (status < 0)
    flags |= CURL_CSELECT_ERR;
  if (events & UV_READABLE)
    flags |= CURL_CSELECT_IN;
  if (events & UV_WRITABLE)
    flags |= CURL_CSELECT_OUT;
  drive(s->h, s->fd, flags);
}

static void on_timer_fired(uv_timer_t *t) { drive(t->data, CURL_SOCKET_TIMEOUT, 0); }

/* CURLMOPT_SOCKETFUNCTION: watch what curl asks for, nothing more. */
static int on_socket(CURL *easy, curl_socket_t fd, int what, void *userp, void *sockp) {
  sx__etcd_http *h = userp;
  sock_ctx *s = sockp;
  (void)easy;
  if (what == CURL_POLL_REMOVE) {
    if (s != NULL) {
      uv_poll_stop(&s->poll);
      uv_close((uv_handle_t *)&s->poll, poll_closed);
      if (!h->closing)
        curl_multi_assign(h->multi, fd, NULL);
    }
    return 0;
  }
  if (s == NULL) {
    if (h->closing)
      return -1;
    s = calloc(1, sizeof(*s));
    if (s == NULL)
      return -1;
    if (uv_poll_init_socket(h->loop, &s->poll, fd) != 0) {
      free(s);
      return -1;
    }
    s->poll.data = s;
    s->fd = fd;
    s->h = h;
    h->handles++;
    curl_multi_assign(h->multi, fd, s);
  }
  int ev = 0;
  if (what & CURL_POLL_IN)
    ev |= UV_READABLE;
  if (what & CURL_POLL_OUT)
    ev |= UV_WRITABLE;
  return uv_poll_start(&s->poll, ev, on_poll) == 0 ? 0 : -1;
}

/* CURLMOPT_TIMERFUNCTION: one uv timer stands for curl's single timeout.  A
 * zero timeout also goes through the loop, never straight back into curl. */
static int on_curl_timer(CURLM *multi, long ms, void *userp) {
  sx__etcd_http *h = userp;
  (void)multi;
  if (h->closing)
    return 0;
  if (ms < 0)
    uv_timer_stop(&h->timer);
  else
    uv_timer_start(&h->timer, on_timer_fired, (uint64_t)ms, 0);
  return 0;
}

/* ---------------------------------------------------------------- calls */

static void set_where(sx__etcd_http *h) {
  const sx_url_host *e = &h->url.hosts[h->cur];
  sx__etcd_say(h->where, sizeof(h->where), strchr(e->host, ':') ? "[%s]:%u" : "%s:%u",
               e->host, e->port);
}

const char *sx__etcd_endpoint(const sx__etcd_http *h) { return h->where; }

static size_t on_data(char *p, size_t size, size_t n, void *userp) {
  sx__etcd_call *c = userp;
  size_t len = size * n;
  if (len > sx__etcd_answer_max || c->len > sx__etcd_answer_max - len) {
    c->over = 1;
    return 0; /* curl ends the transfer with CURLE_WRITE_ERROR */
  }
  if (c->len + len + 1 > c->cap) {
    size_t cap = c->cap ? c->cap : 4096;
    while (cap < c->len + len + 1)
      cap *= 2;
    char *b = realloc(c->buf, cap);
    if (b == NULL)
      return 0;
    c->buf = b;
    c->cap = cap;
  }
  memcpy(c->buf + c->len, p, len);
  c->len += len;
  if (c->on_msg != NULL && memchr(p, '\n', len) != NULL)
    c->pending = 1;
  return len;
}

static void call_unlink(sx__etcd_call *c) {
  sx__etcd_http *h = c->h;
  if (c->prev)
    c->prev->next = c->next;
  else if (h->calls == c)
    h->calls = c->next;
  if (c->next)
    c->next->prev = c->prev;
  c->prev = c->next = NULL;
}

static void call_free(sx__etcd_call *c) {
  if (c->in_multi && c->h->multi != NULL)
    curl_multi_remove_handle(c->h->multi, c->easy);
  curl_easy_cleanup(c->easy);
  free(c->body);
  free(c->buf);
  free(c);
}

/* Point the call at its current endpoint and hand it to curl. */
static int call_start(sx__etcd_call *c) {
  sx__etcd_http *h = c->h;
  const sx_url_host *e = &h->url.hosts[c->ep];
  char url[400];
  snprintf(url, sizeof(url), strchr(e->host, ':') ? "%s://[%s]:%u%s" : "%s://%s:%u%s",
           h->https ? "https" : "http", e->host, e->port, c->path);
  c->len = c->scanned = 0;
  c->over = c->pending = 0;
  c->errbuf[0] = '\0';
  if (curl_easy_setopt(c->easy, CURLOPT_URL, url) != CURLE_OK)
    return SX_ENOMEM;
  if (curl_multi_add_handle(h->multi, c->easy) != CURLM_OK)
    return SX_EIO;
  c->in_multi = 1;
  return 0;
}

static int call_new(sx__etcd_http *h, const char *path, const json_t *req,
                    sx__etcd_msg_fn on_msg, sx__etcd_done_fn done, void *arg,
                    sx__etcd_call **out) {
  int rc = SX_ENOMEM;
  if (h->closing)
    return sx__err(SX_ECANCELED, "etcd: the connection is closing");
  sx__etcd_call *c = calloc(1, sizeof(*c));
  if (c == NULL)
    return sx__err(SX_ENOMEM, "etcd: out of memory");
  c->h = h;
  c->done = done;
  c->on_msg = on_msg;
  c->arg = arg;
  c->ep = h->cur;
  snprintf(c->path, sizeof(c->path), "%s", path);
  c->body = json_dumps(req, JSON_COMPACT);
  c->easy = curl_easy_init();
  if (c->body == NULL || c->easy == NULL)
    goto out_free;
  c->body_len = strlen(c->body);
  CURL *e = c->easy;
  int bad = 0;
  bad |= curl_easy_setopt(e, CURLOPT_PRIVATE, c) != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L) != CURLE_OK;
  bad |=
      curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1) != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https") != CURLE_OK;
  /* etcd is reached directly: proxies from the environment would only be in
   * the way of a loopback or cluster-internal address. */
  bad |= curl_easy_setopt(e, CURLOPT_PROXY, "") != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_HTTPHEADER, h->hdrs) != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_POSTFIELDS, c->body) != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE, (long)c->body_len) != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_data) != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_WRITEDATA, c) != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_ERRORBUFFER, c->errbuf) != CURLE_OK;
  bad |= curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS,
                          (long)h->url.connect_timeout_ms) != CURLE_OK;
  /* A stream lives as long as the watch; its liveness is the backend's
   * health probe, not a transfer timeout. */
  bad |= curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, on_msg ? 0L : (long)h->url.timeout_ms) !=
         CURLE_OK;
  if (on_msg != NULL)
    bad |= curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L) != CURLE_OK;
  if (h->cacert[0])
    bad |= curl_easy_setopt(e, CURLOPT_CAINFO, h->cacert) != CURLE_OK;
  if (h->cert[0])
    bad |= curl_easy_setopt(e, CURLOPT_SSLCERT, h->cert) != CURLE_OK;
  if (h->key[0])
    bad |= curl_easy_setopt(e, CURLOPT_SSLKEY, h->key) != CURLE_OK;
  if (bad)
    goto out_free;
  rc = call_start(c);
  if (rc)
    goto out_free;
  c->next = h->calls;
  if (h->calls)
    h->calls->prev = c;
  h->calls = c;
  if (out)
    *out = c;
  return 0;

out_free:
  call_free(c);
  return sx__err(rc, "etcd: cannot start a request to %s", path);
}

int sx__etcd_post(sx__etcd_http *h, const char *path, const json_t *req,
                  sx__etcd_done_fn done, void *arg, sx__etcd_call **out) {
  return call_new(h, path, req, NULL, done, arg, out);
}

int sx__etcd_stream(sx__etcd_http *h, const char *path, const json_t *req,
                    sx__etcd_msg_fn on_msg, sx__etcd_done_fn done, void *arg,
                    sx__etcd_call **out) {
  return call_new(h, path, req, on_msg, done, arg, out);
}

void sx__etcd_cancel(sx__etcd_call *c) {
  if (c == NULL || c->canceled)
    return;
  c->canceled = 1;
  if (c->in_multi) {
    curl_multi_remove_handle(c->h->multi, c->easy);
    c->in_multi = 0;
  }
  call_unlink(c);
  if (!c->busy)
    call_free(c);
}

/* ---------------------------------------------------------------- answers */

/* Copy text from the server into a message: printable ASCII only, bounded. */
static void clean_text(const char *in, size_t len, char *out, size_t size) {
  size_t o = 0;
  for (size_t i = 0; i < len && o + 1 < size; i++)
    out[o++] = (in[i] >= 0x20 && in[i] < 0x7f) ? in[i] : '?';
  out[o] = '\0';
}

/* gRPC status codes etcd reports, as segxfer codes. */
static int grpc_status(json_int_t code) {
  switch (code) {
  case 4: /* DEADLINE_EXCEEDED */
    return SX_ETIMEDOUT;
  case 5: /* NOT_FOUND: "requested lease not found" */
    return SX_ENOENT;
  case 7:  /* PERMISSION_DENIED */
  case 16: /* UNAUTHENTICATED */
    return SX_EAUTH;
  case 8: /* RESOURCE_EXHAUSTED: too many requests, request too large */
    return SX_ELIMIT;
  case 14: /* UNAVAILABLE: no leader, server stopping */
    return SX_EUNREACH;
  default:
    return SX_ESTORE;
  }
}

/* An error object from the gateway: {"error":"...","message":"...","code":5}
 * for unary calls, {"error":{"grpc_code":5,"message":"..."}} for streams. */
static int error_status(const json_t *o, char *msg, size_t size) {
  const json_t *inner = json_object_get(o, "error");
  if (json_is_object(inner))
    o = inner;
  const json_t *m = json_object_get(o, "message");
  if (!json_is_string(m))
    m = json_object_get(o, "error");
  const json_t *code = json_object_get(o, "code");
  if (!json_is_integer(code))
    code = json_object_get(o, "grpc_code");
  json_int_t c = json_is_integer(code) ? json_integer_value(code) : 2;
  char text[160] = "no message";
  if (json_is_string(m))
    clean_text(json_string_value(m), json_string_length(m), text, sizeof(text));
  sx__etcd_say(msg, size, "%s (gRPC code %lld)", text, (long long)c);
  return grpc_status(c);
}

typedef struct answer {
  int status;
  json_t *body; /* owned */
  char msg[256];
} answer;

/* Judge a complete answer to a unary call. */
static void judge(sx__etcd_call *c, long http, answer *a) {
  sx__etcd_http *h = c->h;
  const sx_url_host *e = &h->url.hosts[c->ep];
  char where[320];
  sx__etcd_say(where, sizeof(where), "etcd %s:%u %s", e->host, e->port, c->path);
  json_error_t jerr;
  json_t *j = json_loadb(c->buf ? c->buf : "", c->len, 0, &jerr);
  if (http != 200) {
    char detail[200];
    if (json_is_object(j)) {
      a->status = error_status(j, detail, sizeof(detail));
    } else {
      clean_text(c->buf ? c->buf : "", c->len > 80 ? 80 : c->len, detail, sizeof(detail));
      a->status = SX_ESTORE;
    }
    sx__etcd_say(a->msg, sizeof(a->msg), "%s: HTTP %ld: %s", where, http, detail);
    json_decref(j);
    return;
  }
  if (j == NULL) {
    a->status = SX_EPROTO;
    sx__etcd_say(a->msg, sizeof(a->msg), "%s: the answer is not JSON: %s (byte %d)",
                 where, jerr.text, jerr.position);
    return;
  }
  if (!json_is_object(j)) {
    a->status = SX_EPROTO;
    sx__etcd_say(a->msg, sizeof(a->msg), "%s: the answer is not a JSON object", where);
    json_decref(j);
    return;
  }
  if (json_object_get(j, "error") != NULL) {
    char detail[200];
    a->status = error_status(j, detail, sizeof(detail));
    sx__etcd_say(a->msg, sizeof(a->msg), "%s: %s", where, detail);
    json_decref(j);
    return;
  }
  /* Streaming endpoints called once (lease keepalive) wrap the answer. */
  json_t *res = json_object_get(j, "result");
  if (json_is_object(res)) {
    json_incref(res);
    json_decref(j);
    j = res;
  }
  a->status = 0;
  a->body = j;
}

/* Deliver the end of a call and free it. */
static void finish(sx__etcd_call *c, int status, json_t *body, const char *msg) {
  call_unlink(c);
  if (!c->canceled)
    c->done(c->arg, status, body, msg);
  call_free(c);
}

/* Errors that happen before the request left: it never reached etcd, so it
 * is safe to send it to another endpoint.  (Not the connect time: a reused
 * keep-alive connection reports 0 for it.) */
static int never_sent(CURLcode rc, long request_bytes) {
  switch (rc) {
  case CURLE_COULDNT_CONNECT:
  case CURLE_COULDNT_RESOLVE_HOST:
  case CURLE_SSL_CONNECT_ERROR:
  case CURLE_PEER_FAILED_VERIFICATION:
    return 1;
  case CURLE_OPERATION_TIMEDOUT:
    return request_bytes == 0;
  default:
    return 0;
  }
}

static void transfer_done(sx__etcd_call *c, CURLcode rc) {
  sx__etcd_http *h = c->h;
  long http = 0, sent = 0;
  curl_easy_getinfo(c->easy, CURLINFO_RESPONSE_CODE, &http);
  curl_easy_getinfo(c->easy, CURLINFO_REQUEST_SIZE, &sent);
  curl_multi_remove_handle(h->multi, c->easy);
  c->in_multi = 0;
  const sx_url_host *e = &h->url.hosts[c->ep];
  char msg[320];

  if (rc != CURLE_OK && !c->over && never_sent(rc, sent)) {
    size_t o = strlen(c->unreach);
    sx__etcd_say(c->unreach + o, sizeof(c->unreach) - o, "%s%s:%u (%s)", o ? ", " : "",
                 e->host, e->port, c->errbuf[0] ? c->errbuf : curl_easy_strerror(rc));
    if (++c->tried < h->url.n_hosts) {
      /* Later requests start at the next endpoint too. */
      if (c->ep == h->cur) {
        h->cur = (h->cur + 1) % h->url.n_hosts;
        set_where(h);
      }
      c->ep = (c->ep + 1) % h->url.n_hosts;
      if (call_start(c) == 0)
        return;
    }
    sx__etcd_say(msg, sizeof(msg), "etcd unreachable: %s", c->unreach);
    finish(c, SX_EUNREACH, NULL, msg);
    return;
  }
  if (c->over) {
    sx__etcd_say(msg, sizeof(msg), "etcd %s:%u %s: the answer exceeds %zu bytes", e->host,
                 e->port, c->path, sx__etcd_answer_max);
    finish(c, SX_ELIMIT, NULL, msg);
    return;
  }
  if (rc == CURLE_OPERATION_TIMEDOUT) {
    /* The endpoint accepted but did not answer (stopped, overloaded, or cut
     * off from its cluster): try another one next time. */
    if (c->ep == h->cur && h->url.n_hosts > 1) {
      h->cur = (h->cur + 1) % h->url.n_hosts;
      set_where(h);
    }
    sx__etcd_say(msg, sizeof(msg), "etcd %s:%u %s: no answer within %u ms", e->host,
                 e->port, c->path, h->url.timeout_ms);
    finish(c, SX_ETIMEDOUT, NULL, msg);
    return;
  }
  if (rc != CURLE_OK) {
    sx__etcd_say(msg, sizeof(msg), "etcd %s:%u %s: connection broke: %s", e->host,
                 e->port, c->path, c->errbuf[0] ? c->errbuf : curl_easy_strerror(rc));
    finish(c, SX_EIO, NULL, msg);
    return;
  }
  if (c->on_msg != NULL && http == 200) {
    sx__etcd_say(msg, sizeof(msg), "etcd %s:%u %s: the stream ended", e->host, e->port,
                 c->path);
    finish(c, SX_EIO, NULL, msg);
    return;
  }
  answer a = {0};
  judge(c, http, &a);
  finish(c, a.status, a.body, a.msg);
  json_decref(a.body);
}

/* Deliver one complete line of one stream.  1 if something happened (the
 * list of calls may have changed), 0 if no stream has a complete line. */
static int deliver_line(sx__etcd_http *h) {
  sx__etcd_call *c;
  for (c = h->calls; c; c = c->next)
    if (c->pending && !c->busy)
      break;
  if (c == NULL)
    return 0;
  long http = 0;
  curl_easy_getinfo(c->easy, CURLINFO_RESPONSE_CODE, &http);
  char *nl = http == 200 ? memchr(c->buf + c->scanned, '\n', c->len - c->scanned) : NULL;
  if (nl == NULL) {
    /* An error answer is judged whole when the transfer ends. */
    c->scanned = http == 200 ? c->len : 0;
    c->pending = 0;
    return 1;
  }
  size_t line = (size_t)(nl - c->buf);
  json_error_t jerr;
  json_t *j = NULL;
  int blank = 1;
  for (size_t i = 0; i < line && blank; i++)
    blank = c->buf[i] == ' ' || c->buf[i] == '\r' || c->buf[i] == '\t';
  if (!blank)
    j = json_loadb(c->buf, line, 0, &jerr);
  memmove(c->buf, nl + 1, c->len - line - 1);
  c->len -= line + 1;
  c->scanned = 0;
  if (blank)
    return 1;
  int rc = 0;
  char err[256] = "";
  if (j == NULL) {
    rc = SX_EPROTO;
    sx__etcd_say(err, sizeof(err), "etcd %s %s: a stream message is not JSON: %s",
                 h->where, c->path, jerr.text);
  } else if (!json_is_object(j)) {
    rc = SX_EPROTO;
    sx__etcd_say(err, sizeof(err), "etcd %s %s: a stream message is not a JSON object",
                 h->where, c->path);
  } else if (json_object_get(j, "error") != NULL) {
    char detail[200];
    rc = error_status(j, detail, sizeof(detail));
    sx__etcd_say(err, sizeof(err), "etcd %s %s: %s", h->where, c->path, detail);
  } else {
    json_t *res = json_object_get(j, "result");
    c->busy = 1;
    rc = c->on_msg(c->arg, json_is_object(res) ? res : j, err, sizeof(err));
    c->busy = 0;
  }
  json_decref(j);
  if (c->canceled) {
    call_free(c);
  } else if (rc != 0) {
    if (c->in_multi) {
      curl_multi_remove_handle(h->multi, c->easy);
      c->in_multi = 0;
    }
    finish(c, rc, NULL, err[0] ? err : "the stream was ended");
  }
  return 1;
}

/* Everything curl has finished since the last call, delivered in order:
 * stream messages first, so that a stream's last messages precede its end. */
static void settle(sx__etcd_http *h) {
  while (!h->closing) {
    if (deliver_line(h))
      continue;
    int left;
    CURLMsg *m = curl_multi_info_read(h->multi, &left);
    if (m == NULL)
      return;
    if (m->msg != CURLMSG_DONE)
      continue;
    CURLcode rc = m->data.result;
    char *priv = NULL;
    curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, &priv);
    if (priv != NULL)
      transfer_done((sx__etcd_call *)priv, rc);
  }
}

/* ---------------------------------------------------------------- open/close */

int sx__etcd_http_open(uv_loop_t *loop, const sx_url *url, sx__etcd_http **out) {
  pthread_once(&curl_once, curl_init);
  if (curl_init_rc != CURLE_OK)
    return sx__err(SX_EIO, "etcd: libcurl failed to initialise: %s",
                   curl_easy_strerror(curl_init_rc));
  if (url->n_hosts < 1)
    return sx__err(SX_EURL, "etcd: the URL names no endpoint");
  sx__etcd_http *h = calloc(1, sizeof(*h));
  if (h == NULL)
    return sx__err(SX_ENOMEM, "etcd: out of memory");
  h->loop = loop;
  h->url = *url;
  h->https = strcmp(url->scheme, "etcd+https") == 0;
  static const char *const env[3] = {"SX_ETCD_CACERT", "SX_ETCD_CERT", "SX_ETCD_KEY"};
  char *dst[3] = {h->cacert, h->cert, h->key};
  for (int i = 0; i < 3; i++) {
    const char *v = getenv(env[i]);
    if (v != NULL && sx__strlcpy(dst[i], v, sizeof(h->cacert)) != 0) {
      free(h);
      return sx__err(SX_EINVAL, "etcd: %s is longer than %zu bytes", env[i],
                     sizeof(h->cacert) - 1);
    }
  }
  set_where(h);
  struct curl_slist *l = curl_slist_append(NULL, "Content-Type: application/json");
  /* No "Expect: 100-continue" round trip before large bodies. */
  struct curl_slist *l2 = l ? curl_slist_append(l, "Expect:") : NULL;
  if (l2 == NULL) {
    curl_slist_free_all(l);
    goto out_free;
  }
  h->hdrs = l2;
  h->multi = curl_multi_init();
  if (h->multi == NULL)
    goto out_free_hdrs;
  int bad = 0;
  bad |= curl_multi_setopt(h->multi, CURLMOPT_SOCKETFUNCTION, on_socket) != CURLM_OK;
  bad |= curl_multi_setopt(h->multi, CURLMOPT_SOCKETDATA, h) != CURLM_OK;
  bad |= curl_multi_setopt(h->multi, CURLMOPT_TIMERFUNCTION, on_curl_timer) != CURLM_OK;
  bad |= curl_multi_setopt(h->multi, CURLMOPT_TIMERDATA, h) != CURLM_OK;
  /* HTTP/1.1 has one request per connection at a time: a few connections
   * per endpoint, more requests wait inside curl. */
  bad |= curl_multi_setopt(h->multi, CURLMOPT_MAX_HOST_CONNECTIONS, 8L) != CURLM_OK;
  bad |= curl_multi_setopt(h->multi, CURLMOPT_MAXCONNECTS, 16L) != CURLM_OK;
  if (bad)
    goto out_cleanup_multi;
  if (uv_timer_init(loop, &h->timer) != 0)
    goto out_cleanup_multi;
  h->timer.data = h;
  h->handles = 1;
  *out = h;
  return 0;

out_cleanup_multi:
  curl_multi_cleanup(h->multi);
out_free_hdrs:
  curl_slist_free_all(h->hdrs);
out_free:
  free(h);
  return sx__err(SX_ENOMEM, "etcd: cannot set up libcurl");
}

void sx__etcd_http_close(sx__etcd_http *h) {
  if (h == NULL || h->closing)
    return;
  while (h->calls)
    sx__etcd_cancel(h->calls);
  h->closing = 1;
  /* Cached connections close now: their sockets leave through on_socket. */
  curl_multi_cleanup(h->multi);
  h->multi = NULL;
  uv_timer_stop(&h->timer);
  uv_close((uv_handle_t *)&h->timer, timer_closed);
}

/* ---------------------------------------------------------------- messages */

void sx__etcd_say(char *buf, size_t size, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, size, fmt, ap);
  va_end(ap);
}
