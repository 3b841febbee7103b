/* Modes still being written: they say so. */
#include <stdio.h>

#include "bench.h"

const char bx_read_help[] = "sx-bench read: not written yet\n";
const char bx_target_help[] = "sx-bench target: not written yet\n";

static int not_yet(const char *mode) {
  fprintf(stderr, "sx-bench %s: not written yet\n", mode);
  return BX_USAGE;
}

int bx_read_main(const bx_common *o, int argc, char **argv) {
  (void)o, (void)argc, (void)argv;
  return not_yet("read");
}
int bx_target_main(const bx_common *o, int argc, char **argv) {
  (void)o, (void)argc, (void)argv;
  return not_yet("target");
}
