/* sxctl watch, rm: following changes and removing stale segments. */
#include <inttypes.h>
#include <jansson.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sxctl.h"

/* --------------------------------------------------------------- watch */

static sx_store *watched; /* for the signal handler */

static void on_signal(int sig) {
  (void)sig;
  if (watched != NULL)
    sx_store_interrupt(watched); /* async-signal-safe */
}

typedef struct watch_ctx {
  int json;
  sx_store *s;
} watch_ctx;

static int print_event(void *arg, const sx_event *ev) {
  const watch_ctx *w = arg;
  int json = w->json;
  if (ev == NULL) {
    /* The watch is in place: every change from now on is printed. */
    fprintf(stderr, "watching %s (Ctrl-C to stop)\n", sx_store_url(w->s));
    return 0;
  }
  struct timespec ts;
  struct tm tm;
  char when[64], inc[2 * SX_INCARNATION_LEN + 1];
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  size_t n = strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(when + n, sizeof(when) - n, ".%03ldZ", ts.tv_nsec / 1000000);
  sx_hex(ev->incarnation, SX_INCARNATION_LEN, inc);
  int known = 0;
  for (int i = 0; i < SX_INCARNATION_LEN; i++)
    known |= ev->incarnation[i];
  if (json) {
    json_t *o = json_object();
    json_object_set_new(o, "time", json_string(when));
    json_object_set_new(o, "kind", json_string(sx_event_kind_name(ev->kind)));
    json_object_set_new(o, "name", json_string(ev->name));
    if (known) {
      json_object_set_new(o, "incarnation", json_string(inc));
      json_object_set_new(o, "generation", json_integer((json_int_t)ev->generation));
    }
    char *s = json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(o);
    if (s) {
      puts(s);
      free(s);
    }
  } else if (known) {
    printf("%s  %-7s %s  incarnation %.8s  generation %" PRIu64 "\n", when,
           sx_event_kind_name(ev->kind), ev->name, inc, ev->generation);
  } else {
    printf("%s  %-7s %s\n", when, sx_event_kind_name(ev->kind), ev->name);
  }
  fflush(stdout);
  return 0;
}

static int watch_run(sxctl_ctx *ctx, int argc, char **argv) {
  const sxctl_cmd *cmd = &sxctl_cmd_watch;
  int json = 0;
  for (int i = 1; i < argc; i++) {
    if (sxctl_is_help(cmd, argv[i]))
      return SXCTL_OK;
    else if (strcmp(argv[i], "--json") == 0)
      json = 1;
    else
      return sxctl_usage(cmd, "unexpected argument '%s'", argv[i]);
  }
  sx_store *s;
  int rc = sxctl_open(ctx, &s);
  if (rc != SXCTL_OK)
    return rc;
  watched = s;
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  watch_ctx w = {.json = json, .s = s};
  int err = sx_store_watch(s, print_event, &w);
  watched = NULL;
  if (err == SX_ECANCELED) {
    rc = SXCTL_OK;
  } else {
    sxctl_err(cmd, "%s: %s", sx_err_name(err), sx_errmsg());
    rc = SXCTL_ERROR;
  }
  sx_store_close(s);
  return rc;
}

const sxctl_cmd sxctl_cmd_watch = {
    .name = "watch",
    .summary = "print segment events as they happen",
    .help = "usage: sxctl watch [--json]\n"
            "\n"
            "Print every put (publish, republish), delete (unpublish, rm) and expired\n"
            "(lease lapsed) event of the namespace until interrupted (SIGINT, SIGTERM:\n"
            "exit 0).  Expired events need keyspace notifications on the Redis server\n"
            "(notify-keyspace-events Kx, see docs/store.md); puts and deletes do not.\n"
            "Exit 2 if the store connection is lost.\n"
            "\n"
            "  --json   one JSON object per line: time, kind, name, incarnation,\n"
            "           generation\n"
            "\n"
            "example:\n"
            "  sxctl watch --json | jq -c 'select(.kind == \"expired\")'\n",
    .run = watch_run,
};

/* ------------------------------------------------------------------ rm */

static int rm_run(sxctl_ctx *ctx, int argc, char **argv) {
  const sxctl_cmd *cmd = &sxctl_cmd_rm;
  const char *name = NULL;
  int force = 0;
  for (int i = 1; i < argc; i++) {
    if (sxctl_is_help(cmd, argv[i]))
      return SXCTL_OK;
    else if (strcmp(argv[i], "--force") == 0 || strcmp(argv[i], "-f") == 0)
      force = 1;
    else if (argv[i][0] == '-' || name != NULL)
      return sxctl_usage(cmd, "unexpected argument '%s'", argv[i]);
    else
      name = argv[i];
  }
  if (name == NULL)
    return sxctl_usage(cmd, "which segment? (sxctl rm NAME)");
  if (sx_name_validate(name) != 0)
    return sxctl_usage(cmd, "%s", sx_errmsg());
  sx_store *s;
  int rc = sxctl_open(ctx, &s);
  if (rc != SXCTL_OK)
    return rc;
  sx_desc d;
  sx_store_lease lease;
  char inc[2 * SX_INCARNATION_LEN + 1] = "";
  int err = sx_store_get(s, name, &d, &lease);
  if (err == SX_ENOENT) {
    sxctl_err(cmd, "%s: no such segment in %s", name, sx_store_url(s));
    sx_store_close(s);
    return SXCTL_NO;
  }
  if (err == 0) {
    sx_hex(d.incarnation, SX_INCARNATION_LEN, inc);
    /* A healthy owner renews every lease/3: within half a lease of the last
     * renewal it is alive, and removing it would fence a working agent. */
    int alive = lease.renewed_ago_ms >= 0 && lease.renewed_ago_ms < (int64_t)d.lease_ms / 2;
    if (alive && !force) {
      char ago[32];
      sxctl_err(cmd, "%s is alive: incarnation %.8s renewed its lease %s ago (lease %u ms). "
                "Removing it fences that incarnation: the agent loses the name and must "
                "restart to publish again.  Use --force to remove it anyway.", name, inc,
                sxctl_duration(lease.renewed_ago_ms, ago, sizeof(ago)), d.lease_ms);
      sx_desc_free(&d);
      sx_store_close(s);
      return SXCTL_NO;
    }
    sx_desc_free(&d);
  } else if (err != SX_EUNREACH && err != SX_ETIMEDOUT && err != SX_EAUTH &&
             err != SX_ESTORE && err != SX_ENAME && err != SX_EINVAL) {
    /* The stored value is corrupt: nothing to protect, remove it. */
    fprintf(stderr, "sxctl rm: %s: removing a corrupt value (%s)\n", name, sx_err_name(err));
  } else {
    sxctl_err(cmd, "%s: %s", sx_err_name(err), sx_errmsg());
    sx_store_close(s);
    return SXCTL_ERROR;
  }
  err = sx_store_remove(s, name);
  if (err == SX_ENOENT) {
    sxctl_err(cmd, "%s: no such segment (it went away meanwhile)", name);
    rc = SXCTL_NO;
  } else if (err != 0) {
    sxctl_err(cmd, "%s: %s", sx_err_name(err), sx_errmsg());
    rc = SXCTL_ERROR;
  } else if (inc[0]) {
    printf("removed %s; incarnation %s is fenced\n", name, inc);
  } else {
    printf("removed %s\n", name);
  }
  sx_store_close(s);
  return rc;
}

const sxctl_cmd sxctl_cmd_rm = {
    .name = "rm",
    .summary = "remove a (stale) segment and fence its owner",
    .help = "usage: sxctl rm NAME [--force]\n"
            "\n"
            "Remove a segment from the store.  Its incarnation is fenced: that agent can\n"
            "neither renew nor republish the name again (a restarted agent, being a new\n"
            "incarnation, can).  Readers get a delete event.\n"
            "\n"
            "Without --force, rm refuses a segment whose owner renewed its lease within\n"
            "the last half lease, i.e. an agent that is alive and renewing on schedule\n"
            "(exit 1).  Segments whose owner missed renewals, and corrupt values, are\n"
            "removed.  Exit 1 if NAME does not exist.\n"
            "\n"
            "  -f, --force   remove and fence even a live segment\n"
            "\n"
            "examples:\n"
            "  sxctl rm prefill-0/tp3\n"
            "  sxctl rm prefill-0/tp3 --force\n",
    .run = rm_run,
};
