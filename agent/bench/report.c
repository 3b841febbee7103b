/*
 * sx-bench output: the aligned table (default), JSON on stdout (--json), a
 * CSV file (--csv; every table's rows in one file, a `table` column first
 * and the union of the tables' columns), the targets judged on this run's
 * figures, and a PNG plot drawn by gnuplot (--plot).
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"

#define MAX_COLS 24

typedef struct cell {
  int set, is_num;
  double num;
  char text[200];
} cell;

struct bx_row {
  bx_table *t;
  cell c[MAX_COLS];
};

struct bx_table {
  char id[32];
  char title[200];
  bx_col cols[MAX_COLS];
  int ncols;
  bx_row **rows;
  int nrows, cap;
  char notes[8][300];
  int nnotes;
  bx_table *next;
};

typedef struct target {
  char what[160];
  double measured, limit;
  char unit[16], op[4], basis[200];
  int skipped, met;
  char why[200];
} target;

struct bx_report {
  char mode[16];
  bx_common o;
  bx_machine m_start;
  double t0;
  time_t started;
  bx_table *tables, **tail;
  target targets[32];
  int ntargets;
};

bx_report *bx_report_new(const char *mode, const bx_common *o) {
  bx_report *r = calloc(1, sizeof(*r));
  if (r == NULL)
    return NULL;
  snprintf(r->mode, sizeof(r->mode), "%s", mode);
  r->o = *o;
  r->tail = &r->tables;
  bx_machine_get(&r->m_start);
  r->t0 = bx_now();
  r->started = time(NULL);
  return r;
}

void bx_report_free(bx_report *r) {
  if (r == NULL)
    return;
  bx_table *t = r->tables;
  while (t) {
    bx_table *next = t->next;
    for (int i = 0; i < t->nrows; i++)
      free(t->rows[i]);
    free(t->rows);
    free(t);
    t = next;
  }
  free(r);
}

bx_table *bx_table_add(bx_report *r, const char *id, const char *title, const bx_col *cols,
                       int n) {
  bx_table *t = calloc(1, sizeof(*t));
  if (t == NULL || n > MAX_COLS) {
    free(t);
    return NULL;
  }
  snprintf(t->id, sizeof(t->id), "%s", id);
  snprintf(t->title, sizeof(t->title), "%s", title);
  memcpy(t->cols, cols, (size_t)n * sizeof(*cols));
  t->ncols = n;
  *r->tail = t;
  r->tail = &t->next;
  return t;
}

void bx_table_note(bx_table *t, const char *fmt, ...) {
  if (t == NULL || t->nnotes == 8)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->notes[t->nnotes++], sizeof(t->notes[0]), fmt, ap);
  va_end(ap);
}

bx_row *bx_row_add(bx_table *t) {
  if (t == NULL)
    return NULL;
  if (t->nrows == t->cap) {
    int cap = t->cap ? t->cap * 2 : 16;
    bx_row **rows = realloc(t->rows, (size_t)cap * sizeof(*rows));
    if (rows == NULL)
      return NULL;
    t->rows = rows;
    t->cap = cap;
  }
  bx_row *row = calloc(1, sizeof(*row));
  if (row == NULL)
    return NULL;
  row->t = t;
  t->rows[t->nrows++] = row;
  return row;
}

static cell *cell_of(bx_row *row, const char *key) {
  if (row == NULL)
    return NULL;
  for (int i = 0; i < row->t->ncols; i++)
    if (strcmp(row->t->cols[i].key, key) == 0)
      return &row->c[i];
  fprintf(stderr, "sx-bench: internal: table %s has no column %s\n", row->t->id, key);
  return NULL;
}

void bx_set_num(bx_row *row, const char *key, double v) {
  cell *c = cell_of(row, key);
  if (c == NULL || !isfinite(v))
    return;
  c->set = c->is_num = 1;
  c->num = v;
}

void bx_set_str(bx_row *row, const char *key, const char *fmt, ...) {
  cell *c = cell_of(row, key);
  if (c == NULL)
    return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->text, sizeof(c->text), fmt, ap);
  va_end(ap);
  c->set = 1;
  c->is_num = 0;
}

void bx_target(bx_report *r, const char *what, double measured, const char *unit,
               const char *op, double limit, const char *basis) {
  if (r->ntargets == (int)(sizeof(r->targets) / sizeof(r->targets[0])))
    return;
  target *t = &r->targets[r->ntargets++];
  memset(t, 0, sizeof(*t));
  snprintf(t->what, sizeof(t->what), "%s", what);
  snprintf(t->unit, sizeof(t->unit), "%s", unit);
  snprintf(t->op, sizeof(t->op), "%s", op);
  snprintf(t->basis, sizeof(t->basis), "%s", basis ? basis : "");
  t->measured = measured;
  t->limit = limit;
  if (strcmp(op, "<") == 0)
    t->met = measured < limit;
  else if (strcmp(op, "<=") == 0)
    t->met = measured <= limit;
  else if (strcmp(op, ">") == 0)
    t->met = measured > limit;
  else
    t->met = measured >= limit;
}

void bx_target_skip(bx_report *r, const char *what, const char *why) {
  if (r->ntargets == (int)(sizeof(r->targets) / sizeof(r->targets[0])))
    return;
  target *t = &r->targets[r->ntargets++];
  memset(t, 0, sizeof(*t));
  snprintf(t->what, sizeof(t->what), "%s", what);
  snprintf(t->why, sizeof(t->why), "%s", why);
  t->skipped = 1;
}

/* ------------------------------------------------------------ plots */

bx_series *bx_plot_series(bx_plot *p, const char *name, int baseline) {
  for (int i = 0; i < p->n; i++)
    if (strcmp(p->s[i].name, name) == 0)
      return &p->s[i];
  if (p->n == (int)(sizeof(p->s) / sizeof(p->s[0])))
    return NULL;
  bx_series *s = &p->s[p->n++];
  memset(s, 0, sizeof(*s));
  snprintf(s->name, sizeof(s->name), "%s", name);
  s->baseline = baseline;
  return s;
}

void bx_series_add(bx_series *s, double x, double y) {
  if (s == NULL || s->n == (int)(sizeof(s->x) / sizeof(s->x[0])) || !isfinite(y))
    return;
  s->x[s->n] = x;
  s->y[s->n] = y;
  s->n++;
}

/* A gnuplot string in double quotes, where "\n" is a line break: quotes
 * and backslashes inside are escaped, line breaks written as \n. */
static void gp_quote(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '"' || *s == '\\')
      fputc('\\', f);
    if (*s == '\n')
      fputs("\\n", f);
    else
      fputc(*s, f);
  }
  fputc('"', f);
}

static int write_plot(const bx_report *r, const bx_plot *p, const char *path) {
  int any = 0;
  for (int i = 0; i < p->n; i++)
    any |= p->s[i].n > 0;
  if (!any) {
    fprintf(stderr, "sx-bench: --plot %s: nothing to plot in this run\n", path);
    return 0;
  }
  char script[4096];
  snprintf(script, sizeof(script), "%s.gp", path);
  FILE *f = fopen(script, "w");
  if (f == NULL) {
    fprintf(stderr, "sx-bench: cannot write %s: %s\n", script, strerror(errno));
    return -1;
  }
  fprintf(f, "# sx-bench %s: `gnuplot %s` draws %s\n", r->mode, script, path);
  fprintf(f, "set terminal pngcairo size 1000,620 font 'sans,10' noenhanced\nset output ");
  gp_quote(f, path);
  fprintf(f, "\nset title ");
  char title[640];
  snprintf(title, sizeof(title), "%s\n%d CPUs (%s), %s, load %.2f at start", p->title,
           r->m_start.nproc, r->m_start.cpu, r->m_start.kernel, r->m_start.load1);
  gp_quote(f, title);
  fprintf(f, " noenhanced\nset xlabel ");
  gp_quote(f, p->xlabel);
  fprintf(f, "\nset ylabel ");
  gp_quote(f, p->ylabel);
  fprintf(f, "\nset grid\nset key outside right top\nset yrange [0:*]\n");
  if (p->logx)
    fprintf(f, "set logscale x 2\n");
  if (p->logy)
    fprintf(f, "set logscale y 10\nset yrange [*:*]\n");
  if (p->xbytes) {
    /* Tick every x value that appears, labelled 4K, 64K, 1M... */
    double seen[128];
    int ns = 0;
    fprintf(f, "set xtics (");
    for (int i = 0; i < p->n; i++) {
      for (int k = 0; k < p->s[i].n; k++) {
        int dup = 0;
        for (int j = 0; j < ns; j++)
          dup |= seen[j] == p->s[i].x[k];
        if (dup || ns == 128)
          continue;
        char b[16];
        fprintf(f, "%s\"%s\" %.0f", ns ? ", " : "", bx_size_name((uint64_t)p->s[i].x[k], b,
                                                                  sizeof(b)),
                p->s[i].x[k]);
        seen[ns++] = p->s[i].x[k];
      }
    }
    fprintf(f, ")\n");
  }
  for (int i = 0; i < p->n; i++) {
    fprintf(f, "$d%d << EOD\n", i);
    for (int k = 0; k < p->s[i].n; k++)
      fprintf(f, "%.6g %.6g\n", p->s[i].x[k], p->s[i].y[k]);
    fprintf(f, "EOD\n");
  }
  /* A palette that stays apart on white; baselines are thick, black,
   * dashed. */
  static const char *const palette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                        "#9467bd", "#8c564b", "#e377c2", "#17becf",
                                        "#bcbd22", "#7f7f7f"};
  const int np = (int)(sizeof(palette) / sizeof(palette[0]));
  fprintf(f, "plot ");
  int first = 1, color = 0;
  for (int i = 0; i < p->n; i++) {
    const bx_series *s = &p->s[i];
    if (s->n == 0)
      continue;
    int c = s->color ? s->color - 1 : color++;
    if (s->baseline)
      fprintf(f, "%s$d%d using 1:2 with linespoints lw 3 pt 6 dt %d lc rgb \"black\" "
              "title ", first ? "" : ", \\\n     ", i, s->dash ? s->dash : 2);
    else
      fprintf(f, "%s$d%d using 1:2 with linespoints lw 2 pt 7 dt %d lc rgb \"%s\" title ",
              first ? "" : ", \\\n     ", i, s->dash ? s->dash : 1, palette[c % np]);
    gp_quote(f, s->name);
    first = 0;
  }
  fprintf(f, "\n");
  if (fclose(f) != 0) {
    fprintf(stderr, "sx-bench: cannot write %s: %s\n", script, strerror(errno));
    return -1;
  }
  pid_t pid = fork();
  if (pid == 0) {
    execlp("gnuplot", "gnuplot", script, (char *)NULL);
    _exit(127);
  }
  int st = 0;
  if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) {
    fprintf(stderr, "sx-bench: gnuplot failed on %s\n", script);
    return -1;
  }
  if (WEXITSTATUS(st) == 127) {
    /* No gnuplot here (a test VM, a minimal host): the script is all a
     * machine with gnuplot needs, so this is not a failure. */
    fprintf(stderr, "sx-bench: gnuplot is not installed; run `gnuplot %s` where it is "
            "(gnuplot-nox) to draw %s\n", script, path);
    return 0;
  }
  if (WEXITSTATUS(st) != 0) {
    fprintf(stderr, "sx-bench: gnuplot failed on %s\n", script);
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------ text */

static void cell_text(const bx_col *col, const cell *c, char *buf, size_t size) {
  if (!c->set)
    snprintf(buf, size, "-");
  else if (!c->is_num)
    snprintf(buf, size, "%s", c->text);
  else
    snprintf(buf, size, col->fmt ? col->fmt : "%g", c->num);
}

static void print_table(FILE *out, const bx_table *t) {
  int w[MAX_COLS];
  char buf[224];
  for (int i = 0; i < t->ncols; i++) {
    w[i] = (int)strlen(t->cols[i].head);
    for (int k = 0; k < t->nrows; k++) {
      cell_text(&t->cols[i], &t->rows[k]->c[i], buf, sizeof(buf));
      if ((int)strlen(buf) > w[i])
        w[i] = (int)strlen(buf);
    }
  }
  fprintf(out, "\n%s\n", t->title);
  for (int i = 0; i < t->ncols; i++)
    fprintf(out, "%s%-*s", i ? "  " : "", i == t->ncols - 1 ? 0 : w[i], t->cols[i].head);
  fprintf(out, "\n");
  for (int k = 0; k < t->nrows; k++) {
    for (int i = 0; i < t->ncols; i++) {
      cell_text(&t->cols[i], &t->rows[k]->c[i], buf, sizeof(buf));
      /* Numbers right-aligned, text left-aligned. */
      if (t->rows[k]->c[i].is_num)
        fprintf(out, "%s%*s", i ? "  " : "", w[i], buf);
      else
        fprintf(out, "%s%-*s", i ? "  " : "", i == t->ncols - 1 ? 0 : w[i], buf);
    }
    fprintf(out, "\n");
  }
  for (int i = 0; i < t->nnotes; i++)
    fprintf(out, "  * %s\n", t->notes[i]);
}

static const char *verdict(const target *t) {
  return t->skipped ? "NOT RUN" : t->met ? "met" : "MISSED";
}

static void print_targets(FILE *out, const bx_report *r) {
  if (r->ntargets == 0)
    return;
  fprintf(out, "\nTargets, judged on this run's figures:\n");
  int w = 0;
  for (int i = 0; i < r->ntargets; i++)
    if ((int)strlen(r->targets[i].what) > w)
      w = (int)strlen(r->targets[i].what);
  for (int i = 0; i < r->ntargets; i++) {
    const target *t = &r->targets[i];
    if (t->skipped) {
      fprintf(out, "  %-7s  %-*s  (%s)\n", verdict(t), w, t->what, t->why);
      continue;
    }
    fprintf(out, "  %-7s  %-*s  %.3g %s (target %s %.3g)%s%s\n", verdict(t), w, t->what,
            t->measured, t->unit, t->op, t->limit, t->basis[0] ? "; " : "", t->basis);
  }
}

static void print_header(FILE *out, const bx_report *r) {
  bx_machine end;
  bx_machine_get(&end);
  char when[64];
  struct tm tm;
  gmtime_r(&r->started, &tm);
  strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", &tm);
  fprintf(out, "sx-bench %s, %s, %.1f s per case\n", r->mode, when, r->o.duration);
  fprintf(out, "machine: %d CPUs (%s), %s, load %.2f at start, %.2f at end\n",
          r->m_start.nproc, r->m_start.cpu, r->m_start.kernel, r->m_start.load1, end.load1);
}

/* ------------------------------------------------------------ JSON */

static json_t *table_json(const bx_table *t) {
  json_t *jt = json_object(), *rows = json_array(), *notes = json_array();
  json_object_set_new(jt, "id", json_string(t->id));
  json_object_set_new(jt, "title", json_string(t->title));
  for (int k = 0; k < t->nrows; k++) {
    json_t *o = json_object();
    for (int i = 0; i < t->ncols; i++) {
      const cell *c = &t->rows[k]->c[i];
      json_object_set_new(o, t->cols[i].key, !c->set       ? json_null()
                                             : c->is_num ? json_real(c->num)
                                                         : json_string(c->text));
    }
    json_array_append_new(rows, o);
  }
  for (int i = 0; i < t->nnotes; i++)
    json_array_append_new(notes, json_string(t->notes[i]));
  json_object_set_new(jt, "rows", rows);
  json_object_set_new(jt, "notes", notes);
  return jt;
}

static int print_json(const bx_report *r) {
  bx_machine end;
  bx_machine_get(&end);
  json_t *root = json_object(), *m = json_object(), *tables = json_array();
  json_t *targets = json_array();
  json_object_set_new(root, "mode", json_string(r->mode));
  json_object_set_new(root, "started", json_integer((json_int_t)r->started));
  json_object_set_new(root, "duration_per_case_s", json_real(r->o.duration));
  json_object_set_new(m, "nproc", json_integer(r->m_start.nproc));
  json_object_set_new(m, "cpu", json_string(r->m_start.cpu));
  json_object_set_new(m, "kernel", json_string(r->m_start.kernel));
  json_object_set_new(m, "load_start", json_real(r->m_start.load1));
  json_object_set_new(m, "load_end", json_real(end.load1));
  json_object_set_new(root, "machine", m);
  for (const bx_table *t = r->tables; t; t = t->next)
    json_array_append_new(tables, table_json(t));
  json_object_set_new(root, "tables", tables);
  for (int i = 0; i < r->ntargets; i++) {
    const target *t = &r->targets[i];
    json_t *o = json_object();
    json_object_set_new(o, "target", json_string(t->what));
    json_object_set_new(o, "verdict", json_string(t->skipped ? "not run"
                                                  : t->met   ? "met"
                                                             : "missed"));
    if (t->skipped) {
      json_object_set_new(o, "why", json_string(t->why));
    } else {
      json_object_set_new(o, "measured", json_real(t->measured));
      json_object_set_new(o, "unit", json_string(t->unit));
      json_object_set_new(o, "op", json_string(t->op));
      json_object_set_new(o, "limit", json_real(t->limit));
      json_object_set_new(o, "basis", json_string(t->basis));
    }
    json_array_append_new(targets, o);
  }
  json_object_set_new(root, "targets", targets);
  int rc = json_dumpf(root, stdout, JSON_INDENT(1)) == 0 ? 0 : -1;
  printf("\n");
  json_decref(root);
  return rc;
}

/* ------------------------------------------------------------ CSV */

static void csv_field(FILE *f, const char *s) {
  if (strpbrk(s, ",\"\n") == NULL) {
    fputs(s, f);
    return;
  }
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '"')
      fputc('"', f);
    fputc(*s, f);
  }
  fputc('"', f);
}

static int write_csv(const bx_report *r, const char *path) {
  const char *keys[MAX_COLS * 8];
  int nk = 0;
  for (const bx_table *t = r->tables; t; t = t->next) {
    for (int i = 0; i < t->ncols; i++) {
      int seen = 0;
      for (int k = 0; k < nk && !seen; k++)
        seen = strcmp(keys[k], t->cols[i].key) == 0;
      if (!seen && nk < (int)(sizeof(keys) / sizeof(keys[0])))
        keys[nk++] = t->cols[i].key;
    }
  }
  FILE *f = fopen(path, "w");
  if (f == NULL) {
    fprintf(stderr, "sx-bench: cannot write %s: %s\n", path, strerror(errno));
    return -1;
  }
  /* Targets go in rows of their own, in columns of their own. */
  static const char *const tkeys[] = {"target",       "target_measured", "target_unit",
                                      "target_op",    "target_limit",    "target_verdict",
                                      "target_basis"};
  const int ntk = (int)(sizeof(tkeys) / sizeof(tkeys[0]));
  fprintf(f, "mode,table");
  for (int k = 0; k < nk; k++) {
    fputc(',', f);
    csv_field(f, keys[k]);
  }
  for (int k = 0; k < ntk; k++)
    fprintf(f, ",%s", tkeys[k]);
  fputc('\n', f);
  char buf[224];
  for (const bx_table *t = r->tables; t; t = t->next) {
    for (int row = 0; row < t->nrows; row++) {
      fprintf(f, "%s,%s", r->mode, t->id);
      for (int k = 0; k < nk; k++) {
        fputc(',', f);
        for (int i = 0; i < t->ncols; i++) {
          if (strcmp(t->cols[i].key, keys[k]) != 0)
            continue;
          const cell *c = &t->rows[row]->c[i];
          if (c->set && c->is_num)
            fprintf(f, "%.6g", c->num);
          else if (c->set) {
            cell_text(&t->cols[i], c, buf, sizeof(buf));
            csv_field(f, buf);
          }
        }
      }
      for (int k = 0; k < ntk; k++)
        fputc(',', f);
      fputc('\n', f);
    }
  }
  for (int i = 0; i < r->ntargets; i++) {
    const target *t = &r->targets[i];
    fprintf(f, "%s,targets", r->mode);
    for (int k = 0; k < nk; k++)
      fputc(',', f);
    fputc(',', f);
    csv_field(f, t->what);
    if (t->skipped) {
      fprintf(f, ",,,,,%s,", verdict(t));
      csv_field(f, t->why);
    } else {
      fprintf(f, ",%.6g,%s,%s,%.6g,%s,", t->measured, t->unit, t->op, t->limit, verdict(t));
      csv_field(f, t->basis);
    }
    fputc('\n', f);
  }
  if (fclose(f) != 0) {
    fprintf(stderr, "sx-bench: cannot write %s: %s\n", path, strerror(errno));
    return -1;
  }
  return 0;
}

int bx_report_emit(bx_report *r, const bx_plot *plot) {
  int rc = 0;
  if (r->o.json) {
    rc = print_json(r);
  } else {
    print_header(stdout, r);
    for (const bx_table *t = r->tables; t; t = t->next)
      print_table(stdout, t);
    print_targets(stdout, r);
  }
  fflush(stdout);
  if (r->o.csv != NULL && write_csv(r, r->o.csv) != 0)
    rc = -1;
  if (r->o.plot != NULL) {
    if (plot == NULL)
      fprintf(stderr, "sx-bench %s: --plot: this mode draws no plot\n", r->mode);
    else if (write_plot(r, plot, r->o.plot) != 0)
      rc = -1;
  }
  return rc;
}
