/*
 * A synchronous metadata-store client, for programs such as sxctl and
 * sx-bench and for tests.  Agents do not need it: they talk to the store
 * asynchronously on their own event loop.
 *
 * URLs (see docs/store.md, "URLs"):
 *   redis://[user:password@]host[:port][/db][?namespace=NS&connect_timeout_ms=N&timeout_ms=N]
 *   redis+sentinel://[user:password@]host[:port][,host[:port]...]/master[/db][?...]
 *
 * Every call waits for the store's answer, bounded by the URL's timeout_ms
 * (default 2000), and returns 0 or a negative SX_E* code; sx_errmsg() then
 * says what went wrong, naming the store by its URL without the password.
 *
 * Threading: an sx_store may be used by one thread at a time (it runs a
 * private event loop inside each call).  Different stores are independent.
 */
#ifndef SEGXFER_STORE_H
#define SEGXFER_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/descriptor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct sx_store sx_store;

/*
 * Connect now.  Errors: SX_EURL (malformed URL; the message names the part),
 * SX_EUNREACH (nothing answers, or no sentinel knows the master), SX_EAUTH
 * (wrong user/password, or the server wants one), SX_ETIMEDOUT (no answer
 * within connect_timeout_ms), SX_ENOTSUP (a scheme this library lacks).
 * The message carries the URL with the password replaced by "***" and a
 * hint.  On success *out is a store to release with sx_store_close().
 */
SX_EXTERN int sx_store_open(const char *url, sx_store **out);

/* Disconnect and free.  NULL is a no-op. */
SX_EXTERN void sx_store_close(sx_store *s);

/* The store's URL with the password replaced by "***" (owned by s). */
SX_EXTERN const char *sx_store_url(const sx_store *s);

/* What the store knows about a segment's lease. */
typedef struct sx_store_lease {
  int64_t ttl_ms;         /* lease left, -1 if unknown */
  int64_t renewed_ago_ms; /* since the owner last published or renewed, -1 if unknown */
} sx_store_lease;

/*
 * Read and decode one segment.  On success *desc owns a validated
 * descriptor (sx_desc_free() it) and *lease (if not NULL) is filled.
 * Errors: SX_ENOENT (no such segment), a decode/validation code such as
 * SX_EDECODE or SX_EBOUNDS when the stored value is corrupt (the message
 * says so), SX_ENAME (bad name), store errors (SX_EUNREACH, SX_ETIMEDOUT,
 * SX_EAUTH, SX_ESTORE).  *desc is untouched on failure.
 */
SX_EXTERN int sx_store_get(sx_store *s, const char *name, sx_desc *desc,
                           sx_store_lease *lease);

/* One segment of a listing.  A value that cannot be used does not stop the
 * listing: its entry says why instead. */
typedef struct sx_store_entry {
  char name[SX_NAME_MAX + 1];
  int status;        /* 0: desc is valid; else why not (SX_EDECODE, ...) */
  char message[256]; /* the reason, when status != 0 */
  sx_desc desc;      /* valid when status == 0 */
  sx_store_lease lease;
} sx_store_entry;

/*
 * Every live segment of the namespace, sorted by name.  The cost is in
 * proportion to the namespace's segments (an index, never a keyspace scan).
 * On success *entries (free with sx_store_entries_free()) holds *n entries;
 * *entries is NULL when *n is 0.
 */
SX_EXTERN int sx_store_list(sx_store *s, sx_store_entry **entries, size_t *n);
SX_EXTERN void sx_store_entries_free(sx_store_entry *entries, size_t n);

/*
 * Admin removal: delete the segment whoever holds it, and fence the holder's
 * incarnation so that it can neither renew nor republish the name (it must
 * restart as a new incarnation).  Peers get a delete event.  0 or
 * SX_ENOENT, or a store error.
 */
SX_EXTERN int sx_store_remove(sx_store *s, const char *name);

/* sx_store_publish() flags. */
enum {
  SX_STORE_TAKEOVER = 1u << 0, /* replace a live holder of another incarnation */
};

/*
 * Publish a descriptor as its own incarnation (d->incarnation), generation
 * (d->generation) and lease (d->lease_ms; 0 means 5000).  The descriptor is
 * validated and encoded first.  The segment expires unless renewed.
 * Errors: the validation codes, SX_EHELD (another live incarnation holds the
 * name; the message names it, its lease age and lease left), SX_EFENCED
 * (this incarnation was taken over or removed), SX_EGENERATION (generation
 * did not grow), store errors.
 */
SX_EXTERN int sx_store_publish(sx_store *s, const sx_desc *d, unsigned flags);

/* The same with an already encoded value, which is stored as given (not
 * validated): for benchmarks, and for tests that need a bad value. */
SX_EXTERN int sx_store_publish_raw(sx_store *s, const char *name,
                                   const uint8_t incarnation[SX_INCARNATION_LEN],
                                   uint64_t generation, const uint8_t *value, size_t len,
                                   uint32_t lease_ms, unsigned flags);

/* Extend one's own lease: 0, SX_EGONE (expired or lost: publish again),
 * SX_EFENCED (someone else holds it, or this incarnation was fenced). */
SX_EXTERN int sx_store_renew(sx_store *s, const char *name,
                             const uint8_t incarnation[SX_INCARNATION_LEN],
                             uint32_t lease_ms);

/* Delete one's own segment: 0, SX_EGONE, SX_EFENCED. */
SX_EXTERN int sx_store_unpublish(sx_store *s, const char *name,
                                 const uint8_t incarnation[SX_INCARNATION_LEN]);

/* Called for each event; return non-zero to end sx_store_watch().  Also
 * called once with ev == NULL when the watch is in place: every change made
 * from then on is delivered (a tool can say "watching" then, and a test
 * can make its changes). */
typedef int (*sx_store_watch_cb)(void *arg, const sx_event *ev);

/*
 * Deliver the namespace's events (put, delete, expired) to cb until it
 * returns non-zero (then 0 is returned), the connection is lost (its error
 * is returned), or sx_store_interrupt() is called (SX_ECANCELED).  Expiry
 * events need keyspace notifications on the server (docs/store.md); puts and
 * deletes do not.  Events that happen while not watching are not replayed;
 * Redis subscribes asynchronously, so a change made before cb(arg, NULL)
 * may be missed.
 */
SX_EXTERN int sx_store_watch(sx_store *s, sx_store_watch_cb cb, void *arg);

/* Make a running (or the next) sx_store_watch() return SX_ECANCELED.  Safe
 * to call from a signal handler or another thread. */
SX_EXTERN void sx_store_interrupt(sx_store *s);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_STORE_H */
