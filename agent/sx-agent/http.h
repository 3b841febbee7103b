/*
 * sx-agent's HTTP endpoint (libmicrohttpd, its own thread): /metrics in
 * Prometheus text, /ready and /healthz for probes.
 */
#ifndef SXA_HTTP_H
#define SXA_HTTP_H

#include <stdint.h>

#include "segxfer/agent.h"

typedef struct sxa_http sxa_http;

/*
 * Serve on listen ("HOST:PORT", "[V6]:PORT" or ":PORT" for every IPv4
 * address; port 0 picks a free one).  The agent must outlive the server.
 * Returns 0 with *out and the port bound in *port, or -1 with a message in
 * err.
 */
int sxa_http_start(const char *listen, sx_agent *a, sxa_http **out, uint16_t *port,
                   char *err, size_t err_size);

/* Stop serving: waits for requests in progress.  NULL is a no-op. */
void sxa_http_stop(sxa_http *h);

#endif
