/*
 * Child processes for multi-process tests: spawn with a log file, reap with
 * a bound, and freeze/thaw (SIGSTOP/SIGCONT) that return only once the
 * child is really stopped or running again.
 *
 * Why the wait: kill(SIGSTOP) only queues the signal.  The kernel wakes one
 * thread of the target to start the group stop; until that thread gets a
 * CPU, the target's other threads (an agent's event loop) keep running and
 * serving.  On a loaded machine that takes hundreds of milliseconds, so a
 * test that assumes "stopped" right after kill() is wrong.
 */
#ifndef SXT_PROCS_H
#define SXT_PROCS_H

#include <sys/types.h>

/* fork + exec argv (argv[0] is the path); stdout and stderr go to log
 * (appended; the child exits 126 if log cannot be opened).  The child dies
 * with the test process (PR_SET_PDEATHSIG).  -1 if fork fails. */
pid_t sxt_spawn(const char *log, const char *const argv[]);

/* Wait for a child up to ms: its exit status, 128 + signal if killed, or -1
 * when it did not end in time (it is then killed with SIGKILL and reaped),
 * or when pid is not a child (pid <= 0 included). */
int sxt_reap(pid_t pid, int ms);

/* sxt_reap, but a child that did not end in time is described before it is
 * killed: where each of its threads waits (wchan, kernel stack, syscall),
 * then the end of log (NULL: no log). */
int sxt_reap_log(pid_t pid, int ms, const char *log);

/* Print the last 30 lines of log (where a test's logs do not outlive it, as
 * in the RDMA VM, this is all that is left of them). */
void sxt_show_log(const char *log);

/* 1 when the first 64 KiB of the file at path hold what (0 when it cannot
 * be read): a line a child logged. */
int sxt_log_has(const char *path, const char *what);

/* SIGSTOP a child and wait until the whole process has stopped (every
 * thread): 0, or -1 if it is gone. */
int sxt_freeze(pid_t pid);

/* SIGCONT a frozen child: 0 or -1. */
int sxt_thaw(pid_t pid);

/* Lines of a file that contain needle (0 if the file cannot be read). */
int sxt_count_in_file(const char *path, const char *needle);

/* Resident set size of a process in KiB (VmRSS), or -1. */
long sxt_rss_kib(pid_t pid);

void sxt_sleep_ms(int ms);

#endif
