/* A fake sysfs tree for the NIC choice (fake_sysfs.h). */
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "fake_sysfs.h"

static void mkdirs(const char *root, const char *rel) {
  char p[PATH_MAX + 64];
  snprintf(p, sizeof(p), "%s/%s", root, rel);
  for (char *s = p + strlen(root) + 1; *s; s++)
    if (*s == '/') {
      *s = '\0';
      mkdir(p, 0755);
      *s = '/';
    }
  mkdir(p, 0755);
}

void sxt_sysfs_make(char *root, size_t cap) {
  snprintf(root, cap, "/tmp/sx-sysfs.XXXXXX");
  assert_non_null(mkdtemp(root));
  mkdirs(root, "bus/pci/devices");
  mkdirs(root, "class/infiniband");
}

void sxt_sysfs_put(const char *root, const char *rel, const char *text) {
  char p[PATH_MAX + 64];
  snprintf(p, sizeof(p), "%s/%s", root, rel);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

void sxt_sysfs_link(const char *root, const char *target, const char *rel) {
  char p[PATH_MAX + 64];
  snprintf(p, sizeof(p), "%s/%s", root, rel);
  unlink(p);
  assert_int_equal(symlink(target, p), 0);
}

void sxt_sysfs_pci(const char *root, const char *path, const char *node) {
  char rel[256], tgt[300];
  snprintf(rel, sizeof(rel), "devices/%s", path);
  mkdirs(root, rel);
  if (node != NULL) {
    snprintf(rel, sizeof(rel), "devices/%s/numa_node", path);
    sxt_sysfs_put(root, rel, node);
  }
  const char *slash = strrchr(path, '/');
  snprintf(rel, sizeof(rel), "bus/pci/devices/%s", slash != NULL ? slash + 1 : path);
  snprintf(tgt, sizeof(tgt), "../../../devices/%s", path);
  sxt_sysfs_link(root, tgt, rel);
}

void sxt_sysfs_ib(const char *root, const char *name, const char *path) {
  char rel[256], tgt[300];
  snprintf(rel, sizeof(rel), "class/infiniband/%s", name);
  mkdirs(root, rel);
  snprintf(rel, sizeof(rel), "class/infiniband/%s/device", name);
  snprintf(tgt, sizeof(tgt), "../../../devices/%s", path);
  sxt_sysfs_link(root, tgt, rel);
}

void sxt_sysfs_remove(const char *root) {
  char cmd[PATH_MAX + 16];
  if (root[0] == '\0' || strncmp(root, "/tmp/sx-sysfs.", 14) != 0)
    return;
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", root);
  assert_int_equal(system(cmd), 0);
}
