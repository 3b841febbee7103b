/* Fuzz target: metadata URL parsing.  Parsed URLs redact their passwords. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "url.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char text[4096], red[8192];
  sx_url u;
  if (size >= sizeof(text))
    return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  if (sx__url_parse(text, &u) != 0)
    return 0;
  if (u.n_hosts < 0 || u.n_hosts > SX_URL_MAX_HOSTS)
    abort();
  sx__url_redact(&u, red, sizeof(red));
  /* The redacted form is scheme://user:***@...: the password's place holds
   * "***", never the secret.  (A substring search for "user:password@" is
   * not the test: "redis://:***@" holds "://:***@", the password "//:***".) */
  if (u.has_password) {
    char want[512];
    snprintf(want, sizeof(want), "%s://%s:***@", u.scheme, u.user);
    if (strncmp(red, want, strlen(want)) != 0)
      abort();
  }
  /* Sentinel credentials: only on redis+sentinel://, a user only with a
   * password, and the redacted form shows no query item but the namespace,
   * so nothing of them. */
  if ((u.has_sentinel_password || u.sentinel_user[0]) &&
      strcmp(u.scheme, "redis+sentinel") != 0)
    abort();
  if (u.sentinel_user[0] && !u.has_sentinel_password)
    abort();
  if (u.has_sentinel_password && u.sentinel_password[0] == '\0')
    abort();
  /* The redacted form's query is the namespace alone. */
  char tail[128];
  snprintf(tail, sizeof(tail), "?namespace=%s", u.ns);
  size_t rlen = strlen(red), tlen = strlen(tail);
  if (rlen < tlen || strcmp(red + rlen - tlen, tail) != 0 || strchr(u.ns, '?') != NULL)
    abort();
  return 0;
}
