/* A scripted HTTP server for tests.  See fake_http.h. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fake_http.h"

#define MAX_ROUTES 16
#define MAX_CONNS 64
#define MAX_PATHS 32

struct sxt_fake_http {
  int lfd;
  pthread_t acceptor;
  pthread_mutex_t lock;
  int stopping;
  sxt_fake_route routes[MAX_ROUTES];
  char *bodies[MAX_ROUTES]; /* copies */
  char *paths[MAX_ROUTES];
  size_t n_routes;
  struct conn {
    int fd;
    pthread_t th;
    sxt_fake_http *f;
  } conns[MAX_CONNS];
  int n_conns;
  struct hit {
    char path[256];
    int n;
    char last[4096];
  } hits[MAX_PATHS];
  int n_hits;
};

static int write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) {
      if (w < 0 && errno == EINTR)
        continue;
      return -1;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

static void record(sxt_fake_http *f, const char *path, const char *body) {
  pthread_mutex_lock(&f->lock);
  struct hit *h = NULL;
  for (int i = 0; i < f->n_hits; i++)
    if (strcmp(f->hits[i].path, path) == 0)
      h = &f->hits[i];
  if (h == NULL && f->n_hits < MAX_PATHS) {
    h = &f->hits[f->n_hits++];
    snprintf(h->path, sizeof(h->path), "%s", path);
  }
  if (h != NULL) {
    h->n++;
    snprintf(h->last, sizeof(h->last), "%s", body);
  }
  pthread_mutex_unlock(&f->lock);
}

/* Serve one request; 0 to go on with the connection, -1 to end it. */
static int serve_one(struct conn *c, char *buf, size_t *len, size_t cap) {
  sxt_fake_http *f = c->f;
  char *end;
  buf[*len] = '\0';
  while ((end = strstr(buf, "\r\n\r\n")) == NULL) {
    if (*len + 1 >= cap)
      return -1;
    ssize_t r = recv(c->fd, buf + *len, cap - *len - 1, 0);
    if (r <= 0)
      return -1;
    *len += (size_t)r;
    buf[*len] = '\0';
  }
  size_t head = (size_t)(end - buf) + 4;
  char method[16], path[256];
  if (sscanf(buf, "%15s %255s", method, path) != 2)
    return -1;
  size_t clen = 0;
  for (char *l = strstr(buf, "\r\n"); l && l < end; l = strstr(l + 2, "\r\n"))
    if (strncasecmp(l + 2, "Content-Length:", 15) == 0)
      clen = strtoul(l + 17, NULL, 10);
  while (*len < head + clen) {
    if (*len + 1 >= cap)
      return -1;
    ssize_t r = recv(c->fd, buf + *len, cap - *len - 1, 0);
    if (r <= 0)
      return -1;
    *len += (size_t)r;
  }
  char body[4096];
  snprintf(body, sizeof(body), "%.*s", (int)clen, buf + head);
  memmove(buf, buf + head + clen, *len - head - clen);
  *len -= head + clen;
  record(f, path, body);

  pthread_mutex_lock(&f->lock);
  sxt_fake_route r = {NULL, 404, "{\"error\":\"no such path\",\"code\":5}", 0};
  char *copy = NULL;
  for (size_t i = 0; i < f->n_routes; i++) {
    if (f->routes[i].path == NULL || strcmp(f->routes[i].path, path) == 0) {
      r = f->routes[i];
      break;
    }
  }
  copy = strdup(r.body ? r.body : "");
  pthread_mutex_unlock(&f->lock);
  if (copy == NULL)
    return -1;

  char hdr[256];
  int rc;
  if (r.stream) {
    snprintf(hdr, sizeof(hdr),
             "HTTP/1.1 %d X\r\nContent-Type: application/json\r\n"
             "Transfer-Encoding: chunked\r\n\r\n%zx\r\n",
             r.status, strlen(copy));
    rc = write_all(c->fd, hdr, strlen(hdr)) || write_all(c->fd, copy, strlen(copy)) ||
         write_all(c->fd, "\r\n", 2);
    free(copy);
    /* Hold the stream open until the client goes away or we stop. */
    while (rc == 0) {
      struct pollfd p = {c->fd, POLLIN, 0};
      int n = poll(&p, 1, 100);
      pthread_mutex_lock(&f->lock);
      int stop = f->stopping;
      pthread_mutex_unlock(&f->lock);
      if (stop)
        return -1;
      if (n > 0) {
        char junk[256];
        if (recv(c->fd, junk, sizeof(junk), 0) <= 0)
          return -1;
      }
    }
    return -1;
  }
  snprintf(hdr, sizeof(hdr),
           "HTTP/1.1 %d X\r\nContent-Type: application/json\r\n"
           "Content-Length: %zu\r\n\r\n",
           r.status, strlen(copy));
  rc = write_all(c->fd, hdr, strlen(hdr)) || write_all(c->fd, copy, strlen(copy));
  free(copy);
  return rc ? -1 : 0;
}

static void *conn_main(void *arg) {
  struct conn *c = arg;
  size_t cap = 1 << 16, len = 0;
  char *buf = malloc(cap);
  while (buf != NULL && serve_one(c, buf, &len, cap) == 0) {
  }
  free(buf);
  shutdown(c->fd, SHUT_RDWR);
  return NULL;
}

static void *accept_main(void *arg) {
  sxt_fake_http *f = arg;
  for (;;) {
    int fd = accept(f->lfd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR)
        continue;
      return NULL;
    }
    pthread_mutex_lock(&f->lock);
    if (f->stopping || f->n_conns == MAX_CONNS) {
      pthread_mutex_unlock(&f->lock);
      close(fd);
      if (f->stopping)
        return NULL;
      continue;
    }
    struct conn *c = &f->conns[f->n_conns];
    c->fd = fd;
    c->f = f;
    if (pthread_create(&c->th, NULL, conn_main, c) == 0)
      f->n_conns++;
    else
      close(fd);
    pthread_mutex_unlock(&f->lock);
  }
}

int sxt_fake_http_start(sxt_fake_http **out, uint16_t *port) {
  sxt_fake_http *f = calloc(1, sizeof(*f));
  if (f == NULL)
    return -1;
  pthread_mutex_init(&f->lock, NULL);
  f->lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t alen = sizeof(a);
  if (f->lfd < 0 || bind(f->lfd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
      listen(f->lfd, 64) != 0 || getsockname(f->lfd, (struct sockaddr *)&a, &alen) != 0 ||
      pthread_create(&f->acceptor, NULL, accept_main, f) != 0) {
    if (f->lfd >= 0)
      close(f->lfd);
    pthread_mutex_destroy(&f->lock);
    free(f);
    return -1;
  }
  *port = ntohs(a.sin_port);
  *out = f;
  return 0;
}

void sxt_fake_http_routes(sxt_fake_http *f, const sxt_fake_route *routes, size_t n) {
  pthread_mutex_lock(&f->lock);
  for (size_t i = 0; i < f->n_routes; i++) {
    free(f->bodies[i]);
    free(f->paths[i]);
  }
  f->n_routes = n < MAX_ROUTES ? n : MAX_ROUTES;
  for (size_t i = 0; i < f->n_routes; i++) {
    f->routes[i] = routes[i];
    f->bodies[i] = strdup(routes[i].body ? routes[i].body : "");
    f->paths[i] = routes[i].path ? strdup(routes[i].path) : NULL;
    f->routes[i].body = f->bodies[i];
    f->routes[i].path = f->paths[i];
  }
  pthread_mutex_unlock(&f->lock);
}

int sxt_fake_http_hits(sxt_fake_http *f, const char *path) {
  int n = 0;
  pthread_mutex_lock(&f->lock);
  for (int i = 0; i < f->n_hits; i++)
    if (path == NULL || strcmp(f->hits[i].path, path) == 0)
      n += f->hits[i].n;
  pthread_mutex_unlock(&f->lock);
  return n;
}

void sxt_fake_http_last_body(sxt_fake_http *f, const char *path, char *buf, size_t size) {
  pthread_mutex_lock(&f->lock);
  buf[0] = '\0';
  for (int i = 0; i < f->n_hits; i++)
    if (strcmp(f->hits[i].path, path) == 0)
      snprintf(buf, size, "%s", f->hits[i].last);
  pthread_mutex_unlock(&f->lock);
}

void sxt_fake_http_stop(sxt_fake_http *f) {
  if (f == NULL)
    return;
  pthread_mutex_lock(&f->lock);
  f->stopping = 1;
  pthread_mutex_unlock(&f->lock);
  shutdown(f->lfd, SHUT_RDWR);
  close(f->lfd);
  pthread_join(f->acceptor, NULL);
  for (int i = 0; i < f->n_conns; i++) {
    shutdown(f->conns[i].fd, SHUT_RDWR);
    pthread_join(f->conns[i].th, NULL);
    close(f->conns[i].fd);
  }
  for (size_t i = 0; i < f->n_routes; i++) {
    free(f->bodies[i]);
    free(f->paths[i]);
  }
  pthread_mutex_destroy(&f->lock);
  free(f);
}
