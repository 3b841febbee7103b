/* Backend selection by URL scheme. */
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "internal.h"

/* Backends register here; a scheme whose ops are not built gives SX_ENOTSUP. */
static const sx_backend_ops *const backends[] = {
    &sx__backend_mem_ops,
    &sx__backend_redis_ops,
    &sx__backend_etcd_ops,
};

int sx__backend_open(uv_loop_t *loop, const char *text, const sx_backend_hooks *hooks,
                     sx_backend **out) {
  sx_url url;
  int rc = sx__url_parse(text, &url);
  if (rc)
    return rc;
  const char *scheme = url.scheme;
  if (strcmp(scheme, "redis+sentinel") == 0 || strcmp(scheme, "redis+cluster") == 0)
    scheme = "redis";
  else if (strcmp(scheme, "etcd+https") == 0)
    scheme = "etcd";
  for (size_t i = 0; i < SX__ARRAY_SIZE(backends); i++)
    if (strcmp(backends[i]->scheme, scheme) == 0)
      return backends[i]->open(loop, &url, hooks, out);
  return sx__err(SX_ENOTSUP, "metadata URL: the %s backend is not built into this "
                 "library", url.scheme);
}

void sx__reply_fail(sx_backend_reply *rep, int status, const char *fmt, ...) {
  va_list ap;
  rep->status = status;
  va_start(ap, fmt);
  vsnprintf(rep->message, sizeof(rep->message), fmt, ap);
  va_end(ap);
}
