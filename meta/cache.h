/*
 * The resolver cache: segment descriptors by name, decoded and validated
 * once, shared by reference with everyone who opened them.  Not installed.
 *
 * Freshness: a store event (put, delete, expired) drops or replaces an entry
 * at once; every entry also expires after a bounded TTL (never longer than
 * the descriptor's own lease), so a lost event costs at most one TTL.  A
 * caller that saw a transport failure or a stale error forces a refresh;
 * concurrent refreshes and misses of one name share one store request
 * (single flight).  A "not found" answer is remembered briefly so a storm
 * of opens of a missing name does not become a storm of store requests.
 *
 * Waiting for a name: a resolve with wait_ms > 0 that finds nothing parks
 * until the name's put event arrives (then one fetch) or its deadline
 * passes.  In case an event is lost, parked names are re-read every
 * recheck_ms (default 1 s), never in a tight loop.
 *
 * Threading: a cache lives on one libuv loop together with its backend;
 * every function here runs on that loop's thread, except
 * sx__cdesc_ref()/sx__cdesc_unref(), which any thread may call.
 */
#ifndef SX_META_CACHE_H
#define SX_META_CACHE_H

#include <stdint.h>
#include <uv.h>

#include "backend.h"
#include "segxfer/descriptor.h"

typedef struct sx_cache sx_cache;

/* A decoded, validated descriptor.  Immutable once published by the cache;
 * it lives while anyone holds a reference.  It keeps the exact bytes it was
 * decoded from: a later store read that returns the same bytes decodes to
 * the same descriptor, so the cache hands out this one again instead of
 * decoding (the bytes decide, never the name). */
typedef struct sx_cdesc {
  sx_desc desc;
  uint64_t fetched_ms;  /* monotonic time of the store read that first gave raw */
  int refs;             /* atomic */
  size_t raw_len;
  const uint8_t *raw;   /* the stored value, raw_len bytes (same allocation) */
} sx_cdesc;

sx_cdesc *sx__cdesc_ref(sx_cdesc *d);
/* Drop a reference; frees at zero.  NULL is a no-op. */
void sx__cdesc_unref(sx_cdesc *d);

typedef struct sx_cache_params {
  uint32_t ttl_ms;      /* longest an entry is served (default 5000) */
  uint32_t negative_ms; /* how long "not found" is remembered (default 250) */
  uint32_t recheck_ms;  /* parked resolves re-read the store this often (1000) */
} sx_cache_params;

void sx__cache_params_init(sx_cache_params *p);

/* Create a cache over backend b (which must outlive it) and start the
 * backend's event watch.  p may be NULL for the defaults. */
int sx__cache_create(uv_loop_t *loop, sx_backend *b, const sx_cache_params *p,
                     sx_cache **out);

/*
 * Complete every pending resolve with SX_ECANCELED (their callbacks run
 * before this returns), drop every entry and release the cache.  Store
 * requests still in flight keep a little memory until the backend answers
 * or is closed, so close the cache before its backend.  NULL is a no-op.
 */
void sx__cache_close(sx_cache *c);

/* Feed one store event (the backend hook's owner calls this). */
void sx__cache_event(sx_cache *c, const sx_event *ev);

/* The store connection came back after an outage: events may have been
 * lost, so every entry is re-read from the store on its next use. */
void sx__cache_flush(sx_cache *c);

/* A fresh entry for name with a new reference, or NULL.  Never touches the
 * store: the fast path for warm opens. */
sx_cdesc *sx__cache_peek(sx_cache *c, const char *name);

/* sx__cache_resolve() flags. */
enum {
  SX_CACHE_REFRESH = 1u << 0, /* skip the cached entry; read the store */
};

/*
 * status is 0 with d a new reference the callback owns, or SX_ENOENT (not
 * published, or not within wait_ms), SX_EDECODE and the other validation
 * codes (corrupt value), store errors, SX_ECANCELED (cache closed); then d is
 * NULL and msg says what failed.
 */
typedef void (*sx_cache_cb)(void *arg, int status, sx_cdesc *d, const char *msg);

/*
 * Resolve name.  The callback runs exactly once if this returns 0, never
 * before this returns (a hit is delivered on the next loop iteration).
 * Errors: SX_ENAME, SX_ENOMEM, SX_ESHUTDOWN (closing).
 */
int sx__cache_resolve(sx_cache *c, const char *name, unsigned flags, uint32_t wait_ms,
                      sx_cache_cb cb, void *arg);

/* A peer told us name's incarnation inc is gone: drop the entry if it is
 * that incarnation, so the next resolve reads the store. */
void sx__cache_invalidate(sx_cache *c, const char *name, const uint8_t *inc);

typedef struct sx_cache_stats {
  uint64_t hits;      /* resolves and peeks served from the cache */
  uint64_t misses;    /* resolves that had to ask the store (not forced) */
  uint64_t refreshes; /* resolves with SX_CACHE_REFRESH */
  uint64_t fetches;   /* store get requests sent */
  uint64_t events;    /* events that changed an entry */
  uint32_t entries;   /* names tracked now */
} sx_cache_stats;

/* A snapshot of the counters.  Unlike the rest of this file, any thread may
 * call it while the cache is open (the counters are atomic); the caller
 * makes sure the cache is not being closed meanwhile. */
void sx__cache_stats(const sx_cache *c, sx_cache_stats *out);

#endif
