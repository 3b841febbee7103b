/*
 * Layout compatibility and layout files.
 *
 * Before any read, a reader checks the remote descriptor against its own
 * layout: the same fingerprint, layout tag and dtype; the same set of
 * (group, layer, slot) keys; equal block_bytes for each key.  num_blocks may
 * differ (a decode engine usually holds fewer blocks than a prefill engine).
 */
#ifndef SEGXFER_LAYOUT_H
#define SEGXFER_LAYOUT_H

#include <stdint.h>

#include "segxfer/descriptor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* sx_layout_check() flags. */
enum {
  SX_CHECK_IGNORE_FINGERPRINT = 1u << 0,
};

typedef enum sx_mismatch_kind {
  SX_MISMATCH_NONE = 0,
  SX_MISMATCH_FINGERPRINT,
  SX_MISMATCH_LAYOUT_TAG,
  SX_MISMATCH_DTYPE,
  SX_MISMATCH_MISSING_KEY, /* local has (group, layer, slot), remote lacks it */
  SX_MISMATCH_EXTRA_KEY,   /* remote has a key the local layout lacks */
  SX_MISMATCH_BLOCK_BYTES,
  /* Plans (segxfer/plan.h): */
  SX_MISMATCH_BLOCK_DESC,    /* a group is described on one side only */
  SX_MISMATCH_HEADS_TOTAL,   /* the model's KV head counts differ */
  SX_MISMATCH_HEAD_DIM,
  SX_MISMATCH_BLOCK_TOKENS,  /* tokens per block not in an integer ratio */
  SX_MISMATCH_ORDER,         /* MLA against a head-split cache */
  SX_MISMATCH_HEADS_MISSING, /* a local head no remote segment holds */
  SX_MISMATCH_HEADS_OVERLAP, /* two remote segments hold overlapping, unequal heads */
  SX_MISMATCH_TP,            /* the set's tp sizes differ or a rank repeats */
} sx_mismatch_kind;

typedef struct sx_mismatch {
  sx_mismatch_kind kind;
  const char *field;        /* "fingerprint", "block_bytes", "key", ... */
  uint32_t group, layer, slot; /* valid for key and block_bytes mismatches */
  char local[SX_FINGERPRINT_MAX + 1];  /* the values, as text */
  char remote[SX_FINGERPRINT_MAX + 1];
  /* e.g. "block_bytes differs at group 0 layer 17 slot V: local 32768,
   * remote 16384" */
  char message[512];
} sx_mismatch;

/*
 * Compare two descriptors' layouts.  Returns 0 when compatible (and sets
 * mismatch->kind to SX_MISMATCH_NONE if mismatch is not NULL), SX_EINCOMPAT
 * with the first difference in *mismatch otherwise, SX_EINVAL on NULL input.
 * The check is deterministic: the first difference is the lowest
 * (group, slot, layer) key that differs, after the segment-wide fields.
 */
SX_EXTERN int sx_layout_check(const sx_desc *local, const sx_desc *remote,
                              unsigned flags, sx_mismatch *mismatch);

SX_EXTERN const char *sx_mismatch_kind_name(sx_mismatch_kind k);

/*
 * JSON form of a descriptor (what `sxctl show --json` prints).  Secrets
 * (the access token) are written only when with_secrets is non-zero.
 * On success *out is a malloc()ed NUL-terminated string the caller frees.
 */
SX_EXTERN int sx_desc_to_json(const sx_desc *d, int with_secrets, char **out);

/*
 * Parse a layout file: JSON with "layout" ({fingerprint, tag, dtype, tp_rank,
 * tp_size, pp_rank, pp_size}), "labels" ({key: value}) and "regions" (each
 * {group, layer_first, layer_count, layer_stride, slot, block_bytes,
 * block_stride, num_blocks, ...}).  The output of sx_desc_to_json() is a
 * valid layout file.  Fields not about layout (addresses, keys) are optional.
 * The result is checked with the layout rules (strides, overlap, limits) but
 * not for identity fields.  On failure *d is untouched; sx_errmsg() gives the
 * line/column or the field that is wrong.
 */
SX_EXTERN int sx_layout_parse(const char *text, size_t len, sx_desc *d);
SX_EXTERN int sx_layout_load(const char *path, sx_desc *d);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_LAYOUT_H */
