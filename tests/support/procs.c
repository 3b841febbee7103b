/* Child processes for multi-process tests (see procs.h). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "procs.h"

void sxt_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

pid_t sxt_spawn(const char *log, const char *const argv[]) {
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (freopen(log, "a", stderr) == NULL)
      _exit(126);
    dup2(2, 1);
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  return pid;
}

int sxt_log_has(const char *path, const char *what) {
  static char buf[65536];
  FILE *f = fopen(path, "r");
  size_t n = f != NULL ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
  buf[n] = '\0';
  if (f != NULL)
    fclose(f);
  return strstr(buf, what) != NULL;
}

void sxt_show_log(const char *log) {
  char cmd[600];
  snprintf(cmd, sizeof(cmd), "echo '== end of %s'; tail -n 30 '%s'", log, log);
  if (system(cmd) != 0)
    fprintf(stderr, "(no log at %s)\n", log);
}

/* Where each thread of a process that will not exit is stuck. */
static void show_stuck(pid_t pid) {
  char cmd[300];
  snprintf(cmd, sizeof(cmd),
           "for t in /proc/%d/task/*; do echo \"== $t $(cat $t/comm) wchan=$(cat $t/wchan)\"; "
           "cat $t/stack $t/syscall 2>/dev/null; done",
           (int)pid);
  if (system(cmd) != 0)
    fprintf(stderr, "(could not inspect pid %d)\n", (int)pid);
}

static int reap(pid_t pid, int ms, int show, const char *log) {
  int st;
  if (pid <= 0)
    return -1; /* waitpid would take any child */
  for (int waited = 0; waited <= ms; waited += 10) {
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (r < 0 && errno != EINTR)
      return -1;
    sxt_sleep_ms(10);
  }
  if (show) {
    fprintf(stderr, "pid %d still runs after %d ms:\n", (int)pid, ms);
    show_stuck(pid);
    if (log != NULL)
      sxt_show_log(log);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  return -1;
}

int sxt_reap(pid_t pid, int ms) { return reap(pid, ms, 0, NULL); }

int sxt_reap_log(pid_t pid, int ms, const char *log) { return reap(pid, ms, 1, log); }

int sxt_freeze(pid_t pid) {
  if (kill(pid, SIGSTOP) != 0)
    return -1;
  /* The parent hears of the stop once the group stop is complete, that is
   * once every thread has stopped. */
  int st;
  pid_t r;
  while ((r = waitpid(pid, &st, WUNTRACED)) < 0 && errno == EINTR) {
  }
  return r == pid && WIFSTOPPED(st) ? 0 : -1;
}

int sxt_thaw(pid_t pid) {
  if (kill(pid, SIGCONT) != 0)
    return -1;
  int st;
  while (waitpid(pid, &st, WCONTINUED | WNOHANG) < 0 && errno == EINTR) {
  }
  return 0;
}

int sxt_count_in_file(const char *path, const char *needle) {
  FILE *f = fopen(path, "r");
  char line[4096];
  int n = 0;
  if (f == NULL)
    return 0;
  while (fgets(line, sizeof(line), f))
    n += strstr(line, needle) != NULL;
  fclose(f);
  return n;
}

long sxt_rss_kib(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  long kib = -1;
  if (f == NULL)
    return -1;
  while (fgets(line, sizeof(line), f))
    if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
      break;
  fclose(f);
  return kib;
}
