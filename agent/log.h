/*
 * Logging and the agent's published state (log.c): the bottom of the agent
 * core, which every core file reaches through agent_int.h instead of
 * calling up into agent.c.  Not installed.
 */
#ifndef SX_AGENT_LOG_H
#define SX_AGENT_LOG_H

#include "internal.h"
#include "segxfer/agent.h"

/* The default log sink: one line on stderr with a UTC timestamp and the
 * level (the programs use it for their own lines too). */
void sx__log_stderr(void *arg, sx_log_level level, const char *msg);
/* Log one line (the params' sink) prefixed with the agent's name. */
void sx__log(sx_agent *a, sx_log_level level, const char *fmt, ...) SX__PRINTF(3, 4);
/* Loop thread: update the published state (and the status under lock). */
void sx__set_state(sx_agent *a, sx_agent_state s, int err);
/* The state's name as logs and metrics labels show it ("published", ...). */
const char *sx__agent_state_name(sx_agent_state s);
/* The transport context's log (sx_tctx.log): the same, for code that
 * sees the agent only as a void pointer. */
void sx__log_tctx(void *agent, sx_log_level level, const char *fmt, ...) SX__PRINTF(3, 4);

#endif
