/* sxctl ls, show, check: reading what is published. */
#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sxctl.h"
#include "transport/transport.h"

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Milliseconds since the descriptor was published (by its owner's clock). */
static int64_t age_ms(const sx_desc *d) {
  int64_t age = now_ms() - (int64_t)d->published_at_ms;
  return d->published_at_ms == 0 ? -1 : age < 0 ? 0 : age;
}

static void labels_text(const sx_desc *d, char *buf, size_t size) {
  size_t o = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < d->n_labels && o < size; i++) {
    int n = snprintf(buf + o, size - o, "%s%s=%s", i ? "," : "", d->labels[i].key,
                     d->labels[i].value);
    if (n > 0)
      o += (size_t)n;
  }
}

static void endpoints_text(const sx_desc *d, char *buf, size_t size) {
  size_t o = 0;
  buf[0] = '\0';
  for (uint32_t i = 0; i < d->n_endpoints && o < size; i++) {
    char e[128];
    int n = snprintf(buf + o, size - o, "%s%s", i ? "," : "",
                     sxctl_endpoint(&d->endpoints[i], e, sizeof(e)));
    if (n > 0)
      o += (size_t)n;
  }
}

static int json_print(json_t *j) {
  char *s = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
  json_decref(j);
  if (s == NULL) {
    fprintf(stderr, "sxctl: cannot format JSON\n");
    return SXCTL_ERROR;
  }
  puts(s);
  free(s);
  return SXCTL_OK;
}

/* ------------------------------------------------------------------ ls */

static int label_matches(const sx_desc *d, char **filters, int n) {
  for (int i = 0; i < n; i++) {
    const char *eq = strchr(filters[i], '=');
    char key[SX_LABEL_KEY_MAX + 1];
    size_t kl = (size_t)(eq - filters[i]);
    if (kl >= sizeof(key))
      return 0;
    memcpy(key, filters[i], kl);
    key[kl] = '\0';
    const char *v = sx_desc_label(d, key);
    if (v == NULL || strcmp(v, eq + 1) != 0)
      return 0;
  }
  return 1;
}

static json_t *entry_json(const sx_store_entry *e) {
  json_t *o = json_object();
  json_object_set_new(o, "name", json_string(e->name));
  json_object_set_new(o, "lease_left_ms", json_integer(e->lease.ttl_ms));
  if (e->status != 0) {
    json_object_set_new(o, "status", json_string("error"));
    json_object_set_new(o, "error", json_string(sx_err_name(e->status)));
    json_object_set_new(o, "message", json_string(e->message));
    return o;
  }
  const sx_desc *d = &e->desc;
  char hex[2 * SX_INCARNATION_LEN + 1], ep[128];
  sx_hex(d->incarnation, SX_INCARNATION_LEN, hex);
  json_object_set_new(o, "status", json_string("ok"));
  json_object_set_new(o, "incarnation", json_string(hex));
  json_object_set_new(o, "generation", json_integer((json_int_t)d->generation));
  json_object_set_new(o, "published_at_ms", json_integer((json_int_t)d->published_at_ms));
  json_object_set_new(o, "age_ms", json_integer(age_ms(d)));
  json_object_set_new(o, "lease_ms", json_integer(d->lease_ms));
  json_object_set_new(o, "regions", json_integer(d->n_regions));
  json_object_set_new(o, "total_bytes", json_integer((json_int_t)sx_desc_total_bytes(d)));
  json_t *eps = json_array(), *labels = json_object();
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    json_array_append_new(eps, json_string(sxctl_endpoint(&d->endpoints[i], ep, sizeof(ep))));
  for (uint32_t i = 0; i < d->n_labels; i++)
    json_object_set_new(labels, d->labels[i].key, json_string(d->labels[i].value));
  json_object_set_new(o, "endpoints", eps);
  json_object_set_new(o, "labels", labels);
  return o;
}

static int ls_run(sxctl_ctx *ctx, int argc, char **argv) {
  const sxctl_cmd *cmd = &sxctl_cmd_ls;
  int json = 0, nf = 0;
  char **filters = calloc((size_t)argc, sizeof(char *));
  int rc = SXCTL_OK;
  if (filters == NULL)
    return SXCTL_ERROR;
  for (int i = 1; i < argc; i++) {
    if (sxctl_is_help(cmd, argv[i])) {
      free(filters);
      return SXCTL_OK;
    } else if (strcmp(argv[i], "--json") == 0) {
      json = 1;
    } else if (strcmp(argv[i], "--label") == 0) {
      if (i + 1 == argc) { /* not "unexpected argument '--label'" */
        free(filters);
        return sxctl_usage(cmd, "--label needs KEY=VALUE");
      }
      if (strchr(argv[i + 1], '=') == NULL) {
        free(filters);
        return sxctl_usage(cmd, "--label wants KEY=VALUE, not '%s'", argv[i + 1]);
      }
      filters[nf++] = argv[++i];
    } else {
      free(filters);
      return sxctl_usage(cmd, "unexpected argument '%s'", argv[i]);
    }
  }
  sx_store *s;
  if ((rc = sxctl_open(ctx, &s)) != SXCTL_OK) {
    free(filters);
    return rc;
  }
  sx_store_entry *e;
  size_t n;
  int err = sx_store_list(s, &e, &n);
  if (err != 0) {
    sxctl_err(cmd, "%s: %s", sx_err_name(err), sx_errmsg());
    sx_store_close(s);
    free(filters);
    return SXCTL_ERROR;
  }
  size_t bad = 0;
  json_t *arr = json_array();
  sxctl_table t;
  sxctl_table_init(&t, 9, "NAME", "INCARNATION", "GEN", "AGE", "LEASE LEFT", "REGIONS",
                   "BYTES", "ENDPOINTS", "LABELS");
  for (size_t i = 0; i < n; i++) {
    /* A corrupt entry has no labels to match; show it only unfiltered. */
    if (nf > 0 && (e[i].status != 0 || !label_matches(&e[i].desc, filters, nf)))
      continue;
    if (e[i].status != 0) {
      bad++;
      if (json) {
        json_array_append_new(arr, entry_json(&e[i]));
      } else {
        char why[300];
        snprintf(why, sizeof(why), "!! %s", e[i].message);
        char left[32];
        sxctl_table_add(&t, e[i].name, "?", "?", "?",
                        sxctl_duration(e[i].lease.ttl_ms, left, sizeof(left)), "?", "?", "?",
                        why);
      }
      continue;
    }
    const sx_desc *d = &e[i].desc;
    if (json) {
      json_array_append_new(arr, entry_json(&e[i]));
      continue;
    }
    char inc[9], gen[24], age[32], left[32], regions[16], bytes[32], eps[512], labels[1024];
    snprintf(gen, sizeof(gen), "%" PRIu64, d->generation);
    snprintf(regions, sizeof(regions), "%u", d->n_regions);
    endpoints_text(d, eps, sizeof(eps));
    labels_text(d, labels, sizeof(labels));
    sxctl_table_add(&t, e[i].name, sxctl_short_inc(d->incarnation, inc), gen,
                    sxctl_duration(age_ms(d), age, sizeof(age)),
                    sxctl_duration(e[i].lease.ttl_ms, left, sizeof(left)), regions,
                    sxctl_bytes(sx_desc_total_bytes(d), bytes, sizeof(bytes)), eps, labels);
  }
  if (json) {
    rc = json_print(arr);
  } else {
    json_decref(arr);
    if (t.nrows > 1)
      sxctl_table_print(&t, stdout, "");
    else
      printf("no segments in %s\n", sx_store_url(s));
  }
  sxctl_table_free(&t);
  if (bad > 0)
    fprintf(stderr, "sxctl ls: %zu segment%s could not be read (marked !!): the stored "
            "value is corrupt or not a segment; `sxctl rm NAME` removes it\n",
            bad, bad == 1 ? "" : "s");
  sx_store_entries_free(e, n);
  sx_store_close(s);
  free(filters);
  return rc;
}

const sxctl_cmd sxctl_cmd_ls = {
    .name = "ls",
    .summary = "list the live segments of the namespace",
    .help = "usage: sxctl ls [--label KEY=VALUE]... [--json]\n"
            "\n"
            "List every live segment of the namespace: name, incarnation (first 8 hex\n"
            "digits), generation, age since publication, lease left, regions, bytes,\n"
            "endpoints and labels.  A segment whose stored value cannot be decoded is\n"
            "listed with '!!' and the reason, and the listing goes on.\n"
            "\n"
            "  --label K=V   only segments with this label (repeat to require several)\n"
            "  --json        a JSON array, one object per segment; unreadable ones have\n"
            "                \"status\": \"error\" with \"error\" and \"message\"\n"
            "\n"
            "examples:\n"
            "  sxctl --metadata redis://127.0.0.1:6379?namespace=prod ls\n"
            "  sxctl ls --label role=prefill --json | jq -r '.[].name'\n",
    .run = ls_run,
};

/* ---------------------------------------------------------------- show */

/* Read NAME; on failure print why and return the exit code. */
static int fetch(const sxctl_cmd *cmd, sx_store *s, const char *name, sx_desc *d,
                 sx_store_lease *lease) {
  int err = sx_store_get(s, name, d, lease);
  if (err == 0)
    return SXCTL_OK;
  if (err == SX_ENOENT) {
    sxctl_err(cmd, "%s: no such segment in %s", name, sx_store_url(s));
    return SXCTL_NO;
  }
  sxctl_err(cmd, "%s: %s", sx_err_name(err), sx_errmsg());
  return SXCTL_ERROR;
}

/* The RDMA device the owner chose for a region ("-" for none), with the
 * port where the device publishes several. */
static void region_nic(const sx_desc *d, const sx_region *r, char *buf, size_t len) {
  const sx_endpoint *e = sx_desc_region_nic(d, r);
  int ports = 0;
  if (e == NULL) {
    snprintf(buf, len, "-");
    return;
  }
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    ports += d->endpoints[i].kind == SX_TRANSPORT_RDMA &&
             strcmp(d->endpoints[i].device, e->device) == 0;
  if (ports > 1)
    snprintf(buf, len, "%s:%u", e->device, e->port_num);
  else
    snprintf(buf, len, "%s", e->device);
}

static void show_human(const sx_desc *d, const sx_store_lease *lease, int secrets) {
  char hex[2 * SX_INCARNATION_LEN + 1], buf[64], buf2[64], buf3[64], labels[1024];
  sx_hex(d->incarnation, SX_INCARNATION_LEN, hex);
  printf("name          %s\n", d->name);
  printf("incarnation   %s\n", hex);
  printf("generation    %" PRIu64 "\n", d->generation);
  time_t pub = (time_t)(d->published_at_ms / 1000);
  struct tm tm;
  gmtime_r(&pub, &tm);
  strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S UTC", &tm);
  printf("published     %s (%s ago)\n", buf, sxctl_duration(age_ms(d), buf2, sizeof(buf2)));
  printf("lease         %u ms, %s left, renewed %s ago\n", d->lease_ms,
         sxctl_duration(lease->ttl_ms, buf2, sizeof(buf2)),
         sxctl_duration(lease->renewed_ago_ms, buf3, sizeof(buf3)));
  if (secrets) {
    sx_hex(d->token, SX_TOKEN_LEN, hex);
    printf("token         %s\n", hex);
  } else {
    printf("token         <redacted> (--show-secrets shows it)\n");
  }
  printf("layout        fingerprint=%s tag=%s dtype=%s tp=%u/%u pp=%u/%u\n",
         d->layout.fingerprint[0] ? d->layout.fingerprint : "-",
         d->layout.tag[0] ? d->layout.tag : "-", d->layout.dtype[0] ? d->layout.dtype : "-",
         d->layout.tp_rank, d->layout.tp_size, d->layout.pp_rank, d->layout.pp_size);
  if (d->layout.layer_count)
    printf("stage         layers %u-%u\n", d->layout.layer_first,
           d->layout.layer_first + d->layout.layer_count - 1);
  for (uint32_t i = 0; i < d->layout.n_blocks && i < SX_MAX_BLOCK_DESCS; i++) {
    const sx_block_desc *b = &d->layout.blocks[i];
    printf("%s", i ? "              " : "blocks        ");
    if (b->order == SX_KV_MLA)
      printf("group %u: %u tokens x %u x %s, MLA (no head split)\n", b->group, b->tokens,
             b->head_dim, b->dtype);
    else
      printf("group %u: %u tokens x heads %u-%u of %u x %u x %s, %s\n", b->group, b->tokens,
             b->head_first, b->head_first + b->head_count - 1, b->heads_total, b->head_dim,
             b->dtype, sx_kv_order_name(b->order));
  }
  labels_text(d, labels, sizeof(labels));
  printf("labels        %s\n", labels[0] ? labels : "-");
  sx_desc here;
  memset(&here, 0, sizeof(here));
  sx__host_identity(&here);
  int ipc = 0;
  for (uint32_t i = 0; i < d->n_endpoints; i++)
    ipc |= d->endpoints[i].kind == SX_TRANSPORT_CUDA_IPC;
  printf("host          %s, boot id %s%s\n", d->hostname[0] ? d->hostname : "-",
         d->host_id[0] ? d->host_id : "-",
         !d->host_id[0] || strcmp(d->host_id, here.host_id) != 0 ? ""
         : ipc ? " (this host: other processes here read it over cuda_ipc)"
               : " (this host)");
  for (uint32_t i = 0; i < d->n_endpoints; i++) {
    const sx_endpoint *e = &d->endpoints[i];
    printf("%s%s", i ? "              " : "endpoints     ", sxctl_endpoint(e, buf, sizeof(buf)));
    if (e->kind == SX_TRANSPORT_RDMA) {
      char gid[2 * SX_GID_LEN + 1];
      sx_hex(e->gid, SX_GID_LEN, gid);
      printf(" device %s port %u mtu %u gid %s", e->device, e->port_num, e->mtu, gid);
    }
    putchar('\n');
  }
  if (d->n_endpoints == 0)
    printf("endpoints     -\n");
  printf("regions       %u, %s\n", d->n_regions,
         sxctl_bytes(sx_desc_total_bytes(d), buf, sizeof(buf)));
  if (d->n_regions == 0)
    return;
  sxctl_table t;
  sxctl_table_init(&t, 14, "ID", "GROUP", "LAYERS", "SLOT", "ADDR", "LENGTH", "BLOCK",
                   "STRIDE", "BLOCKS", "LAYER STRIDE", "LOCATION", "NIC", "ACCESS", "RKEYS");
  for (uint32_t i = 0; i < d->n_regions; i++) {
    const sx_region *r = &d->regions[i];
    char id[16], group[16], layers[32], slot[16], addr[24], len[32], blk[24], stride[24],
        nb[24], ls[24], rkeys[128], nic[SX_TAG_MAX + 16];
    snprintf(id, sizeof(id), "%u", r->id);
    region_nic(d, r, nic, sizeof(nic));
    snprintf(group, sizeof(group), "%u", r->group);
    if (r->layer_count > 1)
      snprintf(layers, sizeof(layers), "%u-%u", r->layer_first,
               r->layer_first + r->layer_count - 1);
    else
      snprintf(layers, sizeof(layers), "%u", r->layer_first);
    snprintf(addr, sizeof(addr), "0x%" PRIx64, r->addr);
    snprintf(blk, sizeof(blk), "%" PRIu64, r->block_bytes);
    snprintf(stride, sizeof(stride), "%" PRIu64, r->block_stride);
    snprintf(nb, sizeof(nb), "%" PRIu64, r->num_blocks);
    snprintf(ls, sizeof(ls), "%" PRIu64, r->layer_stride);
    /* rkeys with the address are enough to read the memory over RDMA:
     * secrets like the token. */
    if (r->n_rkeys == 0) {
      snprintf(rkeys, sizeof(rkeys), "-");
    } else if (!secrets) {
      snprintf(rkeys, sizeof(rkeys), "%u redacted", r->n_rkeys);
    } else {
      size_t o = 0;
      for (uint32_t k = 0; k < r->n_rkeys && o < sizeof(rkeys); k++) {
        int w = snprintf(rkeys + o, sizeof(rkeys) - o, "%s0x%x", k ? "," : "", r->rkeys[k]);
        if (w > 0)
          o += (size_t)w;
      }
    }
    sxctl_table_add(&t, id, group, layers, sx_slot_name(r->slot, slot), addr,
                    sxctl_bytes(r->length, len, sizeof(len)), blk, stride, nb, ls, r->location,
                    nic, (r->access & SX_ACCESS_REMOTE_READ) ? "read" : "none", rkeys);
  }
  sxctl_table_print(&t, stdout, "  ");
  sxctl_table_free(&t);
}

static int show_run(sxctl_ctx *ctx, int argc, char **argv) {
  const sxctl_cmd *cmd = &sxctl_cmd_show;
  int json = 0, secrets = 0;
  const char *name = NULL;
  for (int i = 1; i < argc; i++) {
    if (sxctl_is_help(cmd, argv[i]))
      return SXCTL_OK;
    else if (strcmp(argv[i], "--json") == 0)
      json = 1;
    else if (strcmp(argv[i], "--show-secrets") == 0)
      secrets = 1;
    else if (argv[i][0] == '-' || name != NULL)
      return sxctl_usage(cmd, "unexpected argument '%s'", argv[i]);
    else
      name = argv[i];
  }
  if (name == NULL)
    return sxctl_usage(cmd, "which segment? (sxctl show NAME)");
  sx_store *s;
  int rc = sxctl_open(ctx, &s);
  if (rc != SXCTL_OK)
    return rc;
  sx_desc d;
  sx_store_lease lease;
  rc = fetch(cmd, s, name, &d, &lease);
  if (rc == SXCTL_OK) {
    if (json) {
      char *text;
      int err = sx_desc_to_json(&d, secrets, &text);
      if (err != 0) {
        sxctl_err(cmd, "%s: %s", sx_err_name(err), sx_errmsg());
        rc = SXCTL_ERROR;
      } else {
        puts(text);
        free(text);
      }
    } else {
      show_human(&d, &lease, secrets);
    }
    sx_desc_free(&d);
  }
  sx_store_close(s);
  return rc;
}

const sxctl_cmd sxctl_cmd_show = {
    .name = "show",
    .summary = "print one segment's whole descriptor",
    .help = "usage: sxctl show NAME [--json] [--show-secrets]\n"
            "\n"
            "Print a segment's descriptor: identity, lease, layout, labels, endpoints and\n"
            "its regions as a table.  The access token and RDMA rkeys are redacted\n"
            "unless --show-secrets is given.  Exit 1 if NAME does not exist, 2 if its\n"
            "stored value is corrupt (the message says which rule it breaks).\n"
            "\n"
            "  --json           the descriptor as JSON; it is also a valid layout file\n"
            "                   for `sxctl check --layout`\n"
            "  --show-secrets   include the access token and rkeys\n"
            "\n"
            "examples:\n"
            "  sxctl show prefill-0/tp3\n"
            "  sxctl show prefill-0/tp3 --json > layout.json\n",
    .run = show_run,
};

/* --------------------------------------------------------------- check */

/* The check's verdict, in words or JSON.  err/m are the plan's when it
 * ran (then plan_text is set on success), else the equal check's. */
static void check_print(int json, char **names, int n, const char *with, int err,
                        const sx_mismatch *m, const char *plan_text, int equal) {
  char who[1024] = "";
  for (int i = 0; i < n; i++)
    snprintf(who + strlen(who), sizeof(who) - strlen(who), "%s%s", i ? ", " : "", names[i]);
  if (json) {
    json_t *o = json_object(), *segs = json_array();
    for (int i = 0; i < n; i++)
      json_array_append_new(segs, json_string(names[i]));
    json_object_set_new(o, "segment", json_string(names[0]));
    json_object_set_new(o, "segments", segs);
    json_object_set_new(o, "against", json_string(with));
    json_object_set_new(o, "compatible", json_boolean(err == 0));
    json_object_set_new(o, "equal", json_boolean(equal));
    if (err != 0) {
      json_object_set_new(o, "mismatch", json_string(sx_mismatch_kind_name(m->kind)));
      json_object_set_new(o, "field", json_string(m->field ? m->field : ""));
      json_object_set_new(o, "local", json_string(m->local));
      json_object_set_new(o, "remote", json_string(m->remote));
      json_object_set_new(o, "message", json_string(m->message));
    }
    if (plan_text != NULL)
      json_object_set_new(o, "plan", json_string(plan_text));
    json_print(o);
  } else if (err == 0) {
    printf("compatible%s: %s and %s\n", equal ? "" : " with a plan", who, with);
    if (plan_text != NULL)
      fputs(plan_text, stdout);
  } else {
    printf("incompatible: %s vs %s: %s\n", who, with, m->message);
  }
}

static int check_run(sxctl_ctx *ctx, int argc, char **argv) {
  const sxctl_cmd *cmd = &sxctl_cmd_check;
  const char *against = NULL, *layout = NULL;
  char *names[SX_PLAN_MAX_MEMBERS];
  int json = 0, n = 0;
  unsigned flags = 0;
  for (int i = 1; i < argc; i++) {
    if (sxctl_is_help(cmd, argv[i]))
      return SXCTL_OK;
    else if (strcmp(argv[i], "--json") == 0)
      json = 1;
    else if (strcmp(argv[i], "--ignore-fingerprint") == 0)
      flags |= SX_CHECK_IGNORE_FINGERPRINT;
    else if (strcmp(argv[i], "--against") == 0 && i + 1 < argc)
      against = argv[++i];
    else if (strcmp(argv[i], "--layout") == 0 && i + 1 < argc)
      layout = argv[++i];
    else if (argv[i][0] == '-')
      return sxctl_usage(cmd, "unexpected argument '%s'", argv[i]);
    else if (n == SX_PLAN_MAX_MEMBERS)
      return sxctl_usage(cmd, "at most %d segments", SX_PLAN_MAX_MEMBERS);
    else
      names[n++] = argv[i];
  }
  if (n == 0)
    return sxctl_usage(cmd, "which segment? (sxctl check NAME --against NAME2)");
  if ((against == NULL) == (layout == NULL))
    return sxctl_usage(cmd, "give exactly one of --against NAME2 and --layout FILE");
  sx_desc local;
  if (layout != NULL) {
    int err = sx_layout_load(layout, &local);
    if (err != 0) {
      sxctl_err(cmd, "%s: %s: %s", layout, sx_err_name(err), sx_errmsg());
      return SXCTL_ERROR;
    }
  }
  sx_store *s;
  int rc = sxctl_open(ctx, &s);
  if (rc != SXCTL_OK) {
    if (layout != NULL)
      sx_desc_free(&local);
    return rc;
  }
  if (against != NULL) {
    rc = fetch(cmd, s, against, &local, NULL);
    /* A missing reference is trouble with the question, not a "no". */
    if (rc != SXCTL_OK) {
      sx_store_close(s);
      return SXCTL_ERROR;
    }
  }
  sx_desc remote[SX_PLAN_MAX_MEMBERS];
  const sx_desc *rp[SX_PLAN_MAX_MEMBERS];
  int got = 0;
  for (rc = SXCTL_OK; got < n && rc == SXCTL_OK; got++) {
    rc = fetch(cmd, s, names[got], &remote[got], NULL);
    rp[got] = &remote[got];
  }
  if (rc != SXCTL_OK)
    got--; /* the last fetch failed: nothing to free there */
  if (rc == SXCTL_NO)
    rc = SXCTL_ERROR;
  if (rc == SXCTL_OK) {
    /* One segment with an equal layout: the check as it always was.
     * Otherwise (or besides) the plan says whether and how it fits. */
    sx_mismatch m, pm;
    int equal = n == 1 && sx_layout_check(&local, &remote[0], flags, &m) == 0;
    sx_plan *plan = NULL;
    char *text = NULL;
    int err = sx_layout_plan(&local, rp, (uint32_t)n, flags, &plan, &pm);
    if (err == 0)
      err = sx_plan_text(plan, &text);
    else if (err == SX_EINCOMPAT && n == 1 && local.layout.n_blocks == 0 &&
             remote[0].layout.n_blocks == 0)
      pm = m; /* no descriptions: the check's words, as before plans */
    const char *with = against ? against : layout;
    if (err != 0 && err != SX_EINCOMPAT)
      sxctl_err(cmd, "%s: %s", sx_err_name(err), sx_errmsg());
    else
      check_print(json, names, n, with, err, &pm, text, equal);
    rc = err == 0 ? SXCTL_OK : err == SX_EINCOMPAT ? SXCTL_NO : SXCTL_ERROR;
    free(text);
    sx_plan_free(plan);
  }
  for (int i = 0; i < got; i++)
    sx_desc_free(&remote[i]);
  sx_desc_free(&local);
  sx_store_close(s);
  return rc;
}

const sxctl_cmd sxctl_cmd_check = {
    .name = "check",
    .summary = "check a segment's layout against another segment or a layout file",
    .help = "usage: sxctl check NAME... (--against NAME2 | --layout FILE) [--ignore-fingerprint] [--json]\n"
            "\n"
            "Check whether a reader with the layout of NAME2 (or of FILE) may read NAME:\n"
            "equal layouts (same fingerprint, layout tag and dtype, the same (group,\n"
            "layer, slot) keys and equal block sizes; block counts may differ), or\n"
            "layouts whose block descriptions fit through a read plan (another tensor-\n"
            "parallel split, GQA replicas, block sizes in an integer ratio, NHD/HND),\n"
            "which is printed in words.  Several NAMEs are one set (the ranks of a\n"
            "prefill engine) read together.  Prints the first mismatch otherwise.\n"
            "Exit 0 compatible, 1 incompatible, 2 error (including a NAME or NAME2\n"
            "that does not exist).\n"
            "\n"
            "  --against NAME2        compare with another published segment\n"
            "  --layout FILE          compare with a layout file (JSON; `sxctl show --json`\n"
            "                         writes one)\n"
            "  --ignore-fingerprint   do not require the same model fingerprint\n"
            "  --json                 {\"compatible\": bool, \"mismatch\", \"message\", ...}\n"
            "\n"
            "examples:\n"
            "  sxctl check prefill-0/tp3 --against decode-0/tp3\n"
            "  sxctl check prefill-0/tp0 prefill-0/tp1 --against decode-0/tp0\n"
            "  sxctl check prefill-0/tp3 --layout my-layout.json && echo ok\n",
    .run = check_run,
};
