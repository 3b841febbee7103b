/* sxctl: global options and dispatch to the subcommands of SXCTL_COMMANDS. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sxctl.h"

#define SXCTL_ENTRY(name) &sxctl_cmd_##name,
static const sxctl_cmd *const commands[] = {SXCTL_COMMANDS(SXCTL_ENTRY)};
#undef SXCTL_ENTRY

static void help(FILE *f) {
  fprintf(f,
          "usage: sxctl [--metadata URL] COMMAND [options]\n"
          "\n"
          "Inspect and administer the segments that segxfer agents publish in a metadata\n"
          "store.\n"
          "\n"
          "commands:\n");
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    fprintf(f, "  %-8s %s\n", commands[i]->name, commands[i]->summary);
  fprintf(f,
          "\n"
          "options:\n"
          "  --metadata URL   the store (default: $SX_METADATA_URL), e.g.\n"
          "                   redis://127.0.0.1:6379?namespace=prod\n"
          "                   redis://agent:PASSWORD@10.0.0.5:6379/2?namespace=prod\n"
          "                   redis+sentinel://s1:26379,s2:26379/mymaster?namespace=prod\n"
          "                   redis+cluster://n1:7001,n2:7001,n3:7001?namespace=prod\n"
          "  -h, --help       this text; `sxctl COMMAND --help` for a command\n"
          "  --version        print the library version\n"
          "\n"
          "exit status: 0 success, 1 a negative answer (not found, incompatible,\n"
          "refused), 2 an error (usage, store unreachable, corrupt value).\n");
}

static const sxctl_cmd *find(const char *name) {
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    if (strcmp(commands[i]->name, name) == 0)
      return commands[i];
  return NULL;
}

int main(int argc, char **argv) {
  sxctl_ctx ctx = {.metadata = getenv("SX_METADATA_URL"), .prog = "sxctl"};
  if (ctx.metadata != NULL && ctx.metadata[0] == '\0')
    ctx.metadata = NULL;
  /* --metadata may stand anywhere; take it out so commands see only theirs. */
  int n = 0;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--metadata") == 0) {
      if (i + 1 >= argc) {
        fprintf(stderr, "sxctl: --metadata needs a URL\n");
        return SXCTL_ERROR;
      }
      ctx.metadata = argv[++i];
    } else if (strncmp(argv[i], "--metadata=", 11) == 0) {
      ctx.metadata = argv[i] + 11;
    } else {
      argv[n++] = argv[i];
    }
  }
  argc = n;
  if (argc < 2) {
    help(stderr);
    return SXCTL_ERROR;
  }
  if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
    help(stdout);
    return SXCTL_OK;
  }
  if (strcmp(argv[1], "--version") == 0) {
    printf("sxctl (segxfer %s)\n", sx_version());
    return SXCTL_OK;
  }
  if (strcmp(argv[1], "help") == 0) {
    const sxctl_cmd *c = argc > 2 ? find(argv[2]) : NULL;
    if (c == NULL && argc > 2) { /* exit 2, and say why, as `sxctl bogus` does */
      fprintf(stderr, "sxctl: unknown command '%s'\n\n", argv[2]);
      help(stderr);
      return SXCTL_ERROR;
    }
    if (c == NULL) {
      help(stdout);
      return SXCTL_OK;
    }
    fputs(c->help, stdout);
    return SXCTL_OK;
  }
  const sxctl_cmd *c = find(argv[1]);
  if (c == NULL) {
    fprintf(stderr, "sxctl: unknown command '%s'\n\n", argv[1]);
    help(stderr);
    return SXCTL_ERROR;
  }
  return c->run(&ctx, argc - 1, argv + 1);
}
