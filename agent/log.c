/*
 * Logging and the agent's published state (set and read): the bottom of
 * the agent core.  Every core file (region.c, lease.c, segment.c,
 * batch.c, ...) and, through the transport context, every transport logs
 * and reads or sets the state through here, so none of them calls up into
 * agent.c (the lifecycle), which only wires sx__log_tctx into the context
 * it hands the transports.
 */
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "agent_int.h"
#include "log.h"

/* ------------------------------------------------------------ logging */

static const char *level_name(sx_log_level l) {
  switch (l) {
  case SX_LOG_ERROR:
    return "ERROR";
  case SX_LOG_WARN:
    return "WARN";
  case SX_LOG_INFO:
    return "INFO";
  case SX_LOG_DEBUG:
    return "DEBUG";
  }
  return "?";
}

void sx__log_stderr(void *arg, sx_log_level level, const char *msg) {
  (void)arg;
  struct timespec ts;
  struct tm tm;
  char when[32];
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
  fprintf(stderr, "%s.%03ldZ %-5s %s\n", when, ts.tv_nsec / 1000000L, level_name(level),
          msg);
}

void sx__log(sx_agent *a, sx_log_level level, const char *fmt, ...) {
  if (level > a->p.log_level)
    return;
  char msg[1024];
  int n = snprintf(msg, sizeof(msg), "%s: ", a->name[0] ? a->name : "reader");
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + n, sizeof(msg) - (size_t)n, fmt, ap);
  va_end(ap);
  a->p.log(a->p.log_arg, level, msg);
}

void sx__log_tctx(void *agent, sx_log_level level, const char *fmt, ...) {
  sx_agent *a = agent;
  if (level > a->p.log_level)
    return;
  char msg[900];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  sx__log(a, level, "%s", msg);
}

/* ------------------------------------------------------------ state */

const char *sx__agent_state_name(sx_agent_state s) {
  switch (s) {
  case SX_AGENT_UNPUBLISHED:
    return "unpublished";
  case SX_AGENT_PUBLISHED:
    return "published";
  case SX_AGENT_RECLAIMING:
    return "reclaiming";
  case SX_AGENT_FENCED:
    return "fenced";
  }
  return "unknown";
}

void sx__set_state(sx_agent *a, sx_agent_state s, int err) {
  pthread_mutex_lock(&a->lock);
  sx_agent_state old = a->status.state;
  a->status.state = s;
  a->status.last_error = err;
  pthread_mutex_unlock(&a->lock);
  if (old != s)
    sx__log(a, SX_LOG_DEBUG, "state %s -> %s", sx__agent_state_name(old), sx__agent_state_name(s));
}

int sx_agent_status_get(sx_agent *a, sx_agent_status *out) {
  if (a == NULL || out == NULL)
    return sx__err(SX_EINVAL, "sx_agent_status_get: NULL argument");
  pthread_mutex_lock(&a->lock);
  sx_agent_status st = a->status;
  pthread_mutex_unlock(&a->lock);
  /* The serving counters are atomics (see stats.c); sum them up. */
  sx_agent_stats s;
  sx_agent_stats_get(a, &s, sizeof(s));
  st.served_reads = st.served_bytes = st.served_errors = 0;
  for (unsigned k = 0; k < SX_STATS_TRANSPORTS; k++) {
    st.served_reads += s.served_reads[k];
    st.served_bytes += s.served_bytes[k];
    for (unsigned e = 0; e < SX_STATS_ERRORS; e++)
      st.served_errors += s.served_errors[k][e];
  }
  *out = st;
  return 0;
}
