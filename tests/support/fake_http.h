/*
 * A scripted HTTP/1.1 server on a free 127.0.0.1 port, for tests that need
 * answers a real server would never give (malformed JSON, wrong shapes,
 * errors, huge bodies, broken streams).  One thread per connection, so a
 * streaming answer does not hold up the others.
 */
#ifndef SXT_FAKE_HTTP_H
#define SXT_FAKE_HTTP_H

#include <stddef.h>
#include <stdint.h>

typedef struct sxt_fake_route {
  const char *path; /* exact request path; NULL matches any path */
  int status;       /* HTTP status of the answer */
  const char *body; /* the answer */
  int stream;       /* 1: chunked, and the connection stays open after the
                       body until the client leaves (a watch stream) */
} sxt_fake_route;

typedef struct sxt_fake_http sxt_fake_http;

/* Start serving; 0 or -1.  Unmatched paths get 404 with a JSON error. */
int sxt_fake_http_start(sxt_fake_http **out, uint16_t *port);
/* Replace the routes (copied; first match wins).  At most 16. */
void sxt_fake_http_routes(sxt_fake_http *f, const sxt_fake_route *routes, size_t n);
/* How many requests came for path (NULL: all). */
int sxt_fake_http_hits(sxt_fake_http *f, const char *path);
/* The body of the last request for path, copied into buf (empty if none). */
void sxt_fake_http_last_body(sxt_fake_http *f, const char *path, char *buf, size_t size);
/* Close every connection, join the threads, free. */
void sxt_fake_http_stop(sxt_fake_http *f);

#endif
