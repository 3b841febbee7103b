/* Is there a GPU for the GPU suite?  Prints the device count, or why not
 * (through the same memory layer the library uses), and exits 0 or 1. */
#include <stdio.h>

#include "mem/mem.h"
#include "segxfer.h"

int main(void) {
  int n;
  if (sx__mem_cuda_devices(&n) != 0) {
    printf("%s\n", sx_errmsg());
    return 1;
  }
  printf("%d CUDA device%s\n", n, n == 1 ? "" : "s");
  return 0;
}
