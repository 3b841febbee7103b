/*
 * Store test support, the same for every backend.
 *
 * sxt_store_fixture: how a test starts, breaks and stops one kind of store
 * server (etcd_harness.c for etcd; a Redis harness adds its own).  The shared
 * store suite (store_suite.h) runs its tests against any fixture.
 *
 * sxt_store: one backend instance on its own libuv loop, driven
 * synchronously: each call starts an op and runs the loop until its callback
 * has run (failing the test if it never does), and every event and
 * connection change the backend reports is recorded.
 */
#ifndef SXT_STORE_FIXTURE_H
#define SXT_STORE_FIXTURE_H

#include "ports.h"

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "segxfer/descriptor.h"

typedef struct sxt_store_fixture {
  const char *name; /* "etcd", "redis" */
  /* Start a fresh server on free loopback ports in a new temp dir: 0, 1 when
   * the server program is not installed (the suite skips, saying so), -1 on
   * failure (printed). */
  int (*start)(void **server);
  /* Stop it (whatever its state) and remove its files.  NULL is a no-op. */
  void (*stop)(void *server);
  /* SIGKILL (the server is dead until restart), SIGSTOP, SIGCONT. */
  int (*kill)(void *server, int sig);
  /* Start again on the same ports, with its data (wipe=0) or empty (1). */
  int (*restart)(void *server, int wipe);
  /* The server's URL for namespace ns; extra ("timeout_ms=500") is added
   * to the query when not NULL. */
  void (*url)(void *server, const char *ns, const char *extra, char *buf, size_t size);
  /* A URL of the same scheme where nothing listens. */
  void (*dead_url)(void *server, const char *ns, char *buf, size_t size);
  /* Store raw bytes as segment name's value by hand (no owner, no lease),
   * as an admin or a bug might: 0 or -1. */
  int (*plant)(void *server, const char *ns, const char *name, const void *value,
               size_t len);
  /* Lease lengths the server can keep (etcd: whole seconds, 2 s minimum). */
  uint32_t short_lease_ms;
} sxt_store_fixture;

/* What the last op answered, copied out of the callback. */
typedef struct sxt_item {
  char name[SX_NAME_MAX + 1];
  uint8_t *value;
  size_t len;
  int64_t ttl_ms;
} sxt_item;

typedef struct sxt_reply {
  int calls; /* how often the callback ran: must end at exactly 1 */
  int status;
  char message[256];
  uint8_t *value;
  size_t len;
  int64_t ttl_ms;
  uint8_t holder[SX_INCARNATION_LEN];
  uint64_t holder_age_ms;
  int64_t holder_ttl_ms;
  sxt_item *items;
  size_t n_items;
} sxt_reply;

#define SXT_MAX_EVENTS 1024

typedef struct sxt_store {
  uv_loop_t loop;
  sx_backend *b;
  sx_event events[SXT_MAX_EVENTS];
  unsigned char taken[SXT_MAX_EVENTS];
  size_t n_events;
  int n_up, n_down;
  int n_watch; /* hooks.on_watch calls */
  int last_err;
  char last_msg[256];
} sxt_store;

/* How long a single op may take before the test fails, in ms.  Generous:
 * the machine is shared and may be slow. */
#define SXT_OP_DEADLINE_MS 30000

/* Open a backend on url; with wait_up, run until on_conn reported "up".
 * Returns the open status (the test asserts on it). */
int sxt_store_open(sxt_store *s, const char *url, int wait_up);
/* Close the backend and run the loop until every handle is gone. */
void sxt_store_close(sxt_store *s);

/* Each returns the op's status (the async one), or the synchronous error
 * when the op did not start (r->calls stays 0).  Free r with
 * sxt_reply_free(). */
int sxt_publish(sxt_store *s, const sx_publish_req *req, sxt_reply *r);
int sxt_renew(sxt_store *s, const char *name, const uint8_t *inc, uint32_t lease_ms,
              sxt_reply *r);
int sxt_unpublish(sxt_store *s, const char *name, const uint8_t *inc, sxt_reply *r);
int sxt_get(sxt_store *s, const char *name, sxt_reply *r);
int sxt_list(sxt_store *s, sxt_reply *r);
int sxt_remove(sxt_store *s, const char *name, sxt_reply *r);
void sxt_reply_free(sxt_reply *r);
/* The callback behind the calls above, for ops a test starts itself (pass
 * a zeroed sxt_reply as arg). */
void sxt_reply_cb(void *arg, const sx_backend_reply *rep);
/* The listed item of that name, or NULL. */
const sxt_item *sxt_reply_item(const sxt_reply *r, const char *name);

/* Run the loop for ms milliseconds. */
void sxt_store_run_for(sxt_store *s, uint32_t ms);
/* Run until pred(arg) holds or timeout: 0, or -1 on timeout. */
int sxt_store_run_until(sxt_store *s, int (*pred)(sxt_store *, void *), void *arg,
                        uint32_t timeout_ms);
/* Wait for the first event of that kind and name not taken before, take
 * it: 0 (copied to *out when not NULL) or -1 on timeout. */
int sxt_store_take_event(sxt_store *s, sx_event_kind kind, const char *name,
                         uint32_t timeout_ms, sx_event *out);
/* How many events of that kind and name were seen (taken or not). */
int sxt_store_count_events(const sxt_store *s, sx_event_kind kind, const char *name);
/* Run several stores' loops in turn (none blocks) until every reply has
 * been called: 0, or -1 on timeout. */
int sxt_stores_await(sxt_store *const *stores, size_t n, sxt_reply *const *replies,
                     size_t n_replies, uint32_t timeout_ms);
/* Start watching and wait (failing the test after SXT_OP_DEADLINE_MS) until
 * the backend says the watch is in place: changes made after this returns
 * are delivered.  Returns watch()'s status. */
int sxt_store_watch(sxt_store *s);
/* Wait until on_watch has been reported at least count times. */
int sxt_store_wait_watch(sxt_store *s, int count, uint32_t timeout_ms);
/* With the server stopped (SIGSTOP) and a short timeout_ms: start two
 * reads of name, the first of which closes the backend from its callback
 * (its own command and the second read still outstanding); check that both
 * end once (the first with SX_ETIMEDOUT, the second cancelled or timed
 * out) and close s.  A regression test for ops released by a close they
 * ran themselves. */
void sxt_store_close_from_timed_out_op(sxt_store *s, const char *name);
/* The same with the server answering: the first read's reply closes the
 * backend from inside the connection's own callback (the second read still
 * outstanding on it); the first ends with its answer (SX_ENOENT: name is
 * not published), the second once, cancelled or answered, and s is
 * closed. */
void sxt_store_close_from_reply(sxt_store *s, const char *name);
/* Wait until on_conn has reported up (or down) at least count times. */
int sxt_store_wait_conn(sxt_store *s, int up, int count, uint32_t timeout_ms);


#endif
