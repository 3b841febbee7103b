/*
 * sx-bench codec: descriptor encode (validate + protobuf) and decode
 * (protobuf + validate), against JSON of the same content (jansson, as
 * `sxctl show --json` writes it and layout files are read) in the same run.
 *
 * Descriptors: 1, 16, 160 (80 layers x K,V, one region per layer and slot)
 * and 1024 per-layer regions, and the strided 80-layer layout (K and V each
 * one region over all layers).  Each carries a TCP and an RDMA endpoint (one
 * rkey per region), three labels and a full layout, like a real engine's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "segxfer/descriptor.h"
#include "segxfer/layout.h"

const char bx_codec_help[] =
    "usage: sx-bench codec [--regions LIST] [--no-strided] [common options]\n"
    "\n"
    "Encode (validate + protobuf) and decode+validate segment descriptors, and the\n"
    "same content as JSON (sx_desc_to_json / sx_layout_parse) as the baseline:\n"
    "nanoseconds per operation (median of 5 rounds, with their spread) and bytes.\n"
    "Each descriptor has a TCP and an RDMA endpoint, one rkey per region, labels\n"
    "and a layout.  --duration is the time spent on each descriptor.\n"
    "\n"
    "  --regions LIST   per-layer region counts (default 1,16,160,1024; 160 is\n"
    "                   80 layers x K,V)\n"
    "  --no-strided     leave out the strided 80-layer layout (2 regions)\n"
    "\n"
    "target: decode+validate of 160 regions under 20 us.\n"
    "\n"
    "examples:\n"
    "  sx-bench codec\n"
    "  sx-bench codec --regions 160 --duration 3 --csv codec.csv\n";

enum { ROUNDS = 5 };

/* A descriptor like a prefill engine's: n per-layer regions (layer i/2,
 * slot K or V), or the strided layout (2 regions over 80 layers). */
int bx_make_desc(sx_desc *d, const char *name, uint32_t n, int strided) {
  sx_desc_init(d);
  snprintf(d->name, sizeof(d->name), "%s", name);
  for (int i = 0; i < SX_INCARNATION_LEN; i++)
    d->incarnation[i] = (uint8_t)(0x3a + i);
  for (int i = 0; i < SX_TOKEN_LEN; i++)
    d->token[i] = (uint8_t)(0xc5 ^ i);
  d->generation = 7;
  d->published_at_ms = 1795000000000ull;
  d->lease_ms = 5000;
  snprintf(d->layout.fingerprint, sizeof(d->layout.fingerprint), "llama-3-70b/v1");
  snprintf(d->layout.tag, sizeof(d->layout.tag), "NHD");
  snprintf(d->layout.dtype, sizeof(d->layout.dtype), "bf16");
  d->layout.tp_rank = 3;
  d->layout.tp_size = 8;
  d->layout.pp_size = 1;
  int rc = sx_desc_set_label(d, "role", "prefill");
  if (rc == 0)
    rc = sx_desc_set_label(d, "host", "node-3");
  if (rc == 0)
    rc = sx_desc_set_label(d, "model", "llama-3-70b");
  sx_endpoint e;
  memset(&e, 0, sizeof(e));
  e.kind = SX_TRANSPORT_TCP;
  snprintf(e.addr, sizeof(e.addr), "10.0.0.7");
  e.port = 7400;
  if (rc == 0)
    rc = sx_desc_add_endpoint(d, &e);
  e.kind = SX_TRANSPORT_RDMA;
  e.port = 7471;
  snprintf(e.device, sizeof(e.device), "mlx5_0");
  e.gid[10] = e.gid[11] = 0xff;
  e.gid[12] = 10;
  e.gid[15] = 7;
  e.port_num = 1;
  e.mtu = 4096;
  if (rc == 0)
    rc = sx_desc_add_endpoint(d, &e);
  const uint64_t block = 32768, blocks = 1024, layer = block * blocks;
  uint32_t count = strided ? 2 : n;
  for (uint32_t i = 0; i < count && rc == 0; i++) {
    sx_region r;
    memset(&r, 0, sizeof(r));
    r.id = i;
    r.slot = i % 2;
    r.block_bytes = r.block_stride = block;
    r.num_blocks = blocks;
    r.access = SX_ACCESS_REMOTE_READ;
    snprintf(r.location, sizeof(r.location), "cuda:0");
    r.n_rkeys = 1;
    r.rkeys[0] = 0x1000u + i * 17u;
    if (strided) {
      r.layer_count = 80;
      r.layer_stride = layer;
      r.length = 80 * layer;
      r.addr = 0x7f0000000000ull + i * r.length;
    } else {
      r.layer_first = i / 2;
      r.layer_count = 1;
      r.length = layer;
      r.addr = 0x7f0000000000ull + i * layer;
    }
    rc = sx_desc_add_region(d, &r);
  }
  return rc ? rc : sx_desc_validate(d);
}

typedef enum op_kind { ENC, DEC, JENC, JDEC } op_kind;

typedef struct fixture {
  const sx_desc *d;
  const uint8_t *pb;
  size_t pb_len;
  const char *js;
  size_t js_len;
} fixture;

/* One operation; 0 or the library's error. */
static int run_op(const fixture *f, op_kind k) {
  int rc;
  switch (k) {
  case ENC: {
    uint8_t *buf;
    size_t len;
    if ((rc = sx_desc_encode(f->d, &buf, &len)) == 0)
      free(buf);
    return rc;
  }
  case DEC: {
    sx_desc d;
    if ((rc = sx_desc_decode(f->pb, f->pb_len, &d)) == 0)
      sx_desc_free(&d);
    return rc;
  }
  case JENC: {
    char *s;
    if ((rc = sx_desc_to_json(f->d, 1, &s)) == 0)
      free(s);
    return rc;
  }
  case JDEC: {
    sx_desc d;
    if ((rc = sx_layout_parse(f->js, f->js_len, &d)) == 0)
      sx_desc_free(&d);
    return rc;
  }
  }
  return -1;
}

/* ns per op: the median of ROUNDS rounds of `seconds` in all; *spread is
 * (slowest - fastest) / median of the rounds. */
static int time_op(const fixture *f, op_kind k, double seconds, double *ns, double *spread) {
  /* Calibrate: how many ops fill a round. */
  uint64_t iters = 1;
  double round = seconds / ROUNDS;
  for (;;) {
    double t0 = bx_now();
    for (uint64_t i = 0; i < iters; i++)
      if (run_op(f, k) != 0)
        return -1;
    double el = bx_now() - t0;
    if (el > round / 10 || iters > (1u << 30))
      break;
    iters *= 4;
  }
  double el = 0;
  {
    double t0 = bx_now();
    for (uint64_t i = 0; i < iters; i++)
      run_op(f, k);
    el = bx_now() - t0;
  }
  uint64_t per_round = (uint64_t)((double)iters * round / (el > 0 ? el : 1e-9));
  if (per_round < 1)
    per_round = 1;
  double r[ROUNDS];
  for (int j = 0; j < ROUNDS; j++) {
    double t0 = bx_now();
    for (uint64_t i = 0; i < per_round; i++)
      run_op(f, k);
    r[j] = (bx_now() - t0) * 1e9 / (double)per_round;
  }
  double lo = r[0], hi = r[0];
  for (int j = 1; j < ROUNDS; j++) {
    lo = r[j] < lo ? r[j] : lo;
    hi = r[j] > hi ? r[j] : hi;
  }
  *ns = bx_median(r, ROUNDS);
  *spread = *ns > 0 ? (hi - lo) / *ns : 0;
  return 0;
}

/* The decoded copy must say what was encoded, or the timing is of garbage. */
static int round_trip_ok(const fixture *f) {
  sx_desc d;
  if (sx_desc_decode(f->pb, f->pb_len, &d) != 0)
    return 0;
  int ok = d.n_regions == f->d->n_regions && d.n_endpoints == f->d->n_endpoints &&
           strcmp(d.name, f->d->name) == 0;
  for (uint32_t i = 0; ok && i < d.n_regions; i++)
    ok = memcmp(&d.regions[i], &f->d->regions[i], sizeof(sx_region)) == 0;
  sx_desc_free(&d);
  if (!ok)
    return 0;
  if (sx_layout_parse(f->js, f->js_len, &d) != 0)
    return 0;
  ok = d.n_regions == f->d->n_regions;
  sx_desc_free(&d);
  return ok;
}

int bx_codec_main(const bx_common *o, int argc, char **argv) {
  uint64_t counts[16] = {1, 16, 160, 1024};
  int n_counts = 4, strided = 1;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--regions") == 0 && i + 1 < argc) {
      n_counts = bx_parse_list(argv[++i], counts, 16, 0);
      for (int k = 0; k < n_counts; k++)
        if (counts[k] == 0 || counts[k] > SX_MAX_REGIONS)
          n_counts = -1;
      if (n_counts <= 0) {
        fprintf(stderr, "sx-bench codec: --regions needs counts 1..%d\n", SX_MAX_REGIONS);
        return BX_USAGE;
      }
    } else if (strcmp(argv[i], "--no-strided") == 0) {
      strided = 0;
    } else {
      fprintf(stderr, "sx-bench codec: unknown option '%s' (sx-bench codec --help)\n",
              argv[i]);
      return BX_USAGE;
    }
  }
  bx_report *rep = bx_report_new("codec", o);
  static const bx_col cols[] = {
      {"case", "DESCRIPTOR", NULL},     {"regions", "REGIONS", "%.0f"},
      {"op", "OPERATION", NULL},        {"bytes", "PROTOBUF B", "%.0f"},
      {"ns_op", "PROTOBUF NS/OP", "%.0f"}, {"spread", "SPREAD", "%.0f%%"},
      {"json_bytes", "JSON B", "%.0f"}, {"json_ns_op", "JSON NS/OP", "%.0f"},
      {"json_spread", "SPREAD", "%.0f%%"}, {"json_vs_pb", "JSON/PROTOBUF TIME", "%.1fx"},
  };
  bx_table *t = bx_table_add(rep, "codec", "Descriptor codec: protobuf (segxfer) against "
                             "JSON of the same content (baseline), same run",
                             cols, (int)(sizeof(cols) / sizeof(cols[0])));
  bx_table_note(t, "encode = sx_desc_encode (validate + pack); decode+validate = "
                "sx_desc_decode; JSON: sx_desc_to_json / sx_layout_parse");
  bx_table_note(t, "ns/op: median of %d rounds; spread = (slowest - fastest round) / median",
                ROUNDS);
  int cases = n_counts + strided, rc = BX_OK;
  bx_progress_start(o, "codec", cases, o->duration * cases);
  double dec160 = -1;
  for (int c = 0; c < cases && rc == BX_OK; c++) {
    int is_strided = c == n_counts;
    uint32_t n = is_strided ? 2 : (uint32_t)counts[c];
    char name[64];
    if (is_strided)
      snprintf(name, sizeof(name), "strided 80 layers x K,V");
    else if (n == 160)
      snprintf(name, sizeof(name), "per-layer 80 layers x K,V");
    else
      snprintf(name, sizeof(name), "per-layer %u", n);
    bx_progress("%s", name);
    sx_desc d;
    uint8_t *pb = NULL;
    char *js = NULL;
    size_t pb_len = 0;
    if (bx_make_desc(&d, "prefill-0/tp3", n, is_strided) != 0 || sx_desc_encode(&d, &pb, &pb_len) != 0 ||
        sx_desc_to_json(&d, 1, &js) != 0) {
      fprintf(stderr, "sx-bench codec: %s: %s: %s\n", name, sx_err_name(sx_desc_validate(&d)),
              sx_errmsg());
      rc = BX_FAIL;
      sx_desc_free(&d);
      free(pb);
      break;
    }
    fixture f = {&d, pb, pb_len, js, strlen(js)};
    if (!round_trip_ok(&f)) {
      fprintf(stderr, "sx-bench codec: %s: decoding what was encoded does not give it "
              "back: %s\n", name, sx_errmsg());
      rc = BX_FAIL;
    }
    static const struct {
      const char *name;
      op_kind pb, js;
    } ops[] = {{"encode", ENC, JENC}, {"decode+validate", DEC, JDEC}};
    for (int k = 0; k < 2 && rc == BX_OK; k++) {
      double ns, sp, jns, jsp;
      double share = o->duration / 4;
      if (time_op(&f, ops[k].pb, share, &ns, &sp) || time_op(&f, ops[k].js, share, &jns, &jsp)) {
        fprintf(stderr, "sx-bench codec: %s %s failed: %s\n", name, ops[k].name, sx_errmsg());
        rc = BX_FAIL;
        break;
      }
      bx_row *row = bx_row_add(t);
      bx_set_str(row, "case", "%s", name);
      bx_set_num(row, "regions", n);
      bx_set_str(row, "op", "%s", ops[k].name);
      bx_set_num(row, "bytes", (double)pb_len);
      bx_set_num(row, "ns_op", ns);
      bx_set_num(row, "spread", sp * 100);
      bx_set_num(row, "json_bytes", (double)f.js_len);
      bx_set_num(row, "json_ns_op", jns);
      bx_set_num(row, "json_spread", jsp * 100);
      bx_set_num(row, "json_vs_pb", jns / ns);
      if (!is_strided && n == 160 && ops[k].pb == DEC)
        dec160 = ns;
    }
    sx_desc_free(&d);
    free(pb);
    free(js);
  }
  bx_progress_end();
  if (dec160 >= 0)
    bx_target(rep, "descriptor decode+validate, 160 regions", dec160 / 1000, "us", "<", 20,
              "absolute (the JSON parse of the same content is in the table)");
  else
    bx_target_skip(rep, "descriptor decode+validate, 160 regions",
                   "160 not among --regions");
  if (bx_report_emit(rep, NULL) != 0 && rc == BX_OK)
    rc = BX_FAIL;
  bx_report_free(rep);
  return rc;
}
