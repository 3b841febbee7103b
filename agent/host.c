/*
 * This host's identity as descriptors carry it (sx_desc.host_id, hostname,
 * process): what tells a reader that a target runs on the same kernel
 * (CUDA IPC can work) but in another process (where it must).
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "agent_int.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t drawn_by;  /* mu: the process that drew `process` */
static uint64_t process; /* mu */

/* Keep a boot id only when it has the exact UUID form validation wants. */
static void read_boot_id(char out[SX_HOST_ID_LEN + 1]) {
  char buf[64] = "";
  out[0] = '\0';
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f == NULL)
    return;
  if (fgets(buf, sizeof(buf), f) != NULL) {
    buf[strcspn(buf, "\n")] = '\0';
    if (strlen(buf) == SX_HOST_ID_LEN &&
        strspn(buf, "0123456789abcdef-") == SX_HOST_ID_LEN)
      memcpy(out, buf, SX_HOST_ID_LEN + 1);
  }
  fclose(f);
}

/* The short hostname, characters outside [A-Za-z0-9._-] left out. */
static void read_hostname(char out[SX_HOSTNAME_MAX + 1]) {
  char buf[256] = "";
  size_t n = 0;
  if (gethostname(buf, sizeof(buf) - 1) == 0)
    for (const char *p = buf; *p && n < SX_HOSTNAME_MAX; p++)
      if (strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-", *p))
        out[n++] = *p;
  out[n] = '\0';
}

void sx__host_identity(sx_desc *d) {
  read_boot_id(d->host_id);
  read_hostname(d->hostname);
  pthread_mutex_lock(&mu);
  /* Drawn again in a forked child: it is another process. */
  if (drawn_by != getpid()) {
    uint64_t v = 0;
    while (v == 0 && sx__random(&v, sizeof(v)) == 0) {
    }
    process = v;
    drawn_by = getpid();
  }
  d->process = process;
  pthread_mutex_unlock(&mu);
}
