/*
 * What one cache line costs to pass between two CPUs of this host, for
 * each pair: two threads, pinned one to each CPU, bounce a counter in one
 * 64-byte line (each waits for the other's number, then writes its own),
 * and the round trip is timed.  cuda_ipc hands every read from the
 * caller's thread to the agent's loop and back (docs/gpu.md), so this is
 * the floor under each hand-over, and it says which CPUs lie close.  A
 * measuring tool, not a test.  Usage: cpu_lines [round trips per pair]
 * Prints the matrix in ns per round trip, then the closest and the
 * farthest pairs.
 */
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef struct {
  _Alignas(64) volatile uint64_t n;
  int cpu;
  uint64_t rounds;
} line;

static int pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  return pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
}

/* The answering side: odd numbers. */
static void *answer(void *arg) {
  line *l = arg;
  if (pin(l->cpu) != 0)
    return NULL;
  for (uint64_t i = 0; i < l->rounds; i++) {
    while (l->n != 2 * i + 1) {
    }
    l->n = 2 * i + 2;
  }
  return NULL;
}

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* ns per round trip between CPUs a and b, or -1. */
static double pair(int a, int b, uint64_t rounds) {
  line l = {.n = 0, .cpu = b, .rounds = rounds};
  pthread_t t;
  if (pin(a) != 0 || pthread_create(&t, NULL, answer, &l) != 0)
    return -1;
  double t0 = now_ns();
  for (uint64_t i = 0; i < rounds; i++) {
    l.n = 2 * i + 1;
    while (l.n != 2 * i + 2) {
    }
  }
  double ns = (now_ns() - t0) / (double)rounds;
  pthread_join(t, NULL);
  return ns;
}

int main(int argc, char **argv) {
  uint64_t rounds = 20000;
  if (argc > 2 || (argc == 2 && (sscanf(argv[1], "%" SCNu64 "%c", &rounds, &(char){0}) != 1 ||
                                 argv[1][0] == '-' || rounds == 0 || rounds > 100000000))) {
    fprintf(stderr, "usage: cpu_lines [round trips per pair: 1 to 100000000]\n");
    return 2;
  }
  cpu_set_t all;
  if (sched_getaffinity(0, sizeof(all), &all) != 0) {
    perror("cpu_lines: sched_getaffinity");
    return 1;
  }
  int cpus[CPU_SETSIZE], n = 0;
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &all))
      cpus[n++] = c;
  double lo = 1e18, hi = 0;
  int lo_a = 0, lo_b = 0, hi_a = 0, hi_b = 0;
  printf("ns per round trip of one cache line (row: timing CPU, column: answering CPU)\n    ");
  for (int j = 0; j < n; j++)
    printf(" %5d", cpus[j]);
  printf("\n");
  for (int i = 0; i < n; i++) {
    printf("%4d", cpus[i]);
    for (int j = 0; j < n; j++) {
      if (i == j) {
        printf("     -");
        continue;
      }
      double ns = pair(cpus[i], cpus[j], rounds);
      printf(" %5.0f", ns);
      if (ns > 0 && ns < lo)
        lo = ns, lo_a = cpus[i], lo_b = cpus[j];
      if (ns > hi)
        hi = ns, hi_a = cpus[i], hi_b = cpus[j];
    }
    printf("\n");
    fflush(stdout);
  }
  if (n > 1)
    printf("closest: %d-%d %.0f ns; farthest: %d-%d %.0f ns\n", lo_a, lo_b, lo, hi_a, hi_b,
           hi);
  return 0;
}
