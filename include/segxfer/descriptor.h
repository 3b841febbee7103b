/*
 * Segment descriptors: the plain C form of what an agent publishes.
 *
 * A descriptor names a segment, identifies its owner (incarnation, generation),
 * says how to reach it (endpoints, access token), what it holds (layout) and
 * where (regions).  The wire form is protobuf (proto/segxfer.proto); its types
 * stay inside the library.  Every descriptor read from a store or a peer goes
 * through sx_desc_decode(), which validates it: nothing downstream trusts a
 * descriptor that did not pass sx_desc_validate().
 *
 * Ownership: an sx_desc owns its three arrays (endpoints, regions, labels),
 * which only the library allocates (grow them with the helpers below);
 * sx_desc_free() releases them.  Build one by hand with sx_desc_init() and the
 * sx_desc_add_*() helpers, or take one from sx_desc_decode().
 *
 * Thread safety: descriptors are plain data; a descriptor may be read from
 * many threads at once and must not be modified while others read it.
 */
#ifndef SEGXFER_DESCRIPTOR_H
#define SEGXFER_DESCRIPTOR_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/errors.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The schema version this library writes and the only one it accepts. */
#define SX_SCHEMA_VERSION 1

/* Documented limits, enforced on encode and decode. */
#define SX_NAME_MAX 200          /* bytes in a segment name */
#define SX_NS_MAX 64             /* bytes in a namespace */
#define SX_MAX_REGIONS 4096      /* regions per descriptor */
#define SX_MAX_ENDPOINTS 16      /* endpoints per descriptor */
#define SX_MAX_DEVICES 8         /* RDMA endpoints (devices) per descriptor */
#define SX_MAX_LABELS 32         /* labels per descriptor */
#define SX_MAX_DESC_BYTES (1u << 20) /* encoded descriptor size */
#define SX_MAX_SLOTS 64          /* slot ids are 0..63 */
#define SX_FINGERPRINT_MAX 127
#define SX_TAG_MAX 31            /* layout tag, dtype, location, label key */
#define SX_LABEL_KEY_MAX 63
#define SX_LABEL_VALUE_MAX 255
#define SX_ADDR_MAX 63           /* endpoint host: IPv4/IPv6 literal or name */
#define SX_HOST_ID_LEN 36        /* boot id: "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
#define SX_HOSTNAME_MAX 64       /* [A-Za-z0-9._-] */
#define SX_MAX_BLOCK_DESCS 8     /* block descriptions (groups) per layout */
#define SX_MAX_BLOCK_TOKENS 65536 /* tokens per block */
#define SX_MAX_HEADS 4096        /* KV heads of a model */
#define SX_MAX_HEAD_DIM 65536    /* elements per head and token */

#define SX_INCARNATION_LEN 16
#define SX_TOKEN_LEN 16
#define SX_GID_LEN 16

/* Well-known slots.  Any id below SX_MAX_SLOTS may be used. */
enum {
  SX_SLOT_K = 0,
  SX_SLOT_V = 1,
  SX_SLOT_INDEX = 2,
  SX_SLOT_STATE = 3,
};

typedef enum sx_transport_kind {
  SX_TRANSPORT_NONE = 0,
  SX_TRANSPORT_TCP = 1,
  SX_TRANSPORT_RDMA = 2,
  SX_TRANSPORT_CUDA_IPC = 3, /* GPU to GPU on one host (docs/gpu.md) */
} sx_transport_kind;

/* Region access flags. */
enum {
  SX_ACCESS_REMOTE_READ = 1u << 0,
  SX_ACCESS_REMOTE_WRITE = 1u << 1, /* granted producers may write it (push.h) */
};

typedef struct sx_endpoint {
  sx_transport_kind kind;
  char addr[SX_ADDR_MAX + 1]; /* host the peer connects to */
  uint16_t port;
  /* RDMA only: */
  char device[SX_TAG_MAX + 1]; /* e.g. "mlx5_0", "rxe0" */
  uint8_t gid[SX_GID_LEN];
  uint8_t port_num;            /* HCA port, 1-based */
  uint32_t mtu;                /* active path MTU in bytes (256..4096) */
} sx_endpoint;

/*
 * A registered memory range and its block structure.  Block b of layer l
 * (layer_first <= l < layer_first + layer_count) starts at
 *   addr + (l - layer_first) * layer_stride + b * block_stride
 * and is block_bytes long.  One region with layer_count > 1 describes a
 * whole layer-strided allocation, so a regular KV cache takes O(1) regions.
 */
typedef struct sx_region {
  uint32_t id;          /* unique within the segment */
  uint32_t group;       /* KV-cache group (e.g. attention type) */
  uint32_t layer_first;
  uint32_t layer_count; /* >= 1 */
  uint64_t layer_stride;
  uint32_t slot;        /* SX_SLOT_K, SX_SLOT_V, ... (< SX_MAX_SLOTS) */
  uint32_t access;      /* SX_ACCESS_* */
  uint64_t addr;        /* address in the owner's address space */
  uint64_t length;
  uint64_t block_bytes;
  uint64_t block_stride; /* >= block_bytes */
  uint64_t num_blocks;
  char location[SX_TAG_MAX + 1]; /* "cpu", "cuda:0", ... */
  uint32_t n_rkeys;      /* == number of RDMA endpoints */
  uint32_t rkeys[SX_MAX_DEVICES]; /* in the order of the RDMA endpoints */
  /* Push mode: RDMA write keys, 0 or n_rkeys of them, only on regions with
   * SX_ACCESS_REMOTE_WRITE.  They belong to a protection domain of their
   * own that only producers the owner authorized reach (docs/push.md), so
   * knowing them grants nothing; the rkeys above never allow writes. */
  uint32_t n_wkeys;
  uint32_t wkeys[SX_MAX_DEVICES];
  /* The RDMA device its owner chose for it (the NIC nearest its memory,
   * docs/gpu.md "NIC choice"): 1 + the ordinal of that device's endpoint
   * among the RDMA endpoints (as for rkeys), 0 when none was chosen.
   * sx_desc_region_nic() gives the endpoint. */
  uint32_t nic;
} sx_region;

typedef struct sx_label {
  char key[SX_LABEL_KEY_MAX + 1];
  char value[SX_LABEL_VALUE_MAX + 1];
} sx_label;

/* The order of the elements inside one block of one layer and slot. */
typedef enum sx_kv_order {
  SX_KV_NONE = 0, /* not described */
  SX_KV_NHD = 1,  /* token-major: [tokens][heads][head_dim] */
  SX_KV_HND = 2,  /* head-major: [heads][tokens][head_dim] */
  SX_KV_MLA = 3,  /* no head split (MLA latent): [tokens][head_dim]; every
                   * rank holds the whole of it */
} sx_kv_order;

/*
 * What a block of one group is (optional: a layout without descriptions
 * checks and plans as whole, equal blocks).  Every region of the group whose
 * slot is in `slots` then has block_bytes == tokens * head_count * head_dim *
 * (bytes of dtype), which validation enforces, so a plan can cut blocks into
 * head and token pieces without leaving them.  With SX_KV_MLA head_first is 0
 * and head_count == heads_total (no split).
 */
typedef struct sx_block_desc {
  uint32_t group;
  sx_kv_order order;
  uint32_t tokens;       /* tokens per block, 1..SX_MAX_BLOCK_TOKENS */
  uint32_t head_first;   /* the KV heads this segment holds: */
  uint32_t head_count;   /*   [head_first, head_first + head_count) */
  uint32_t heads_total;  /*   of the model's heads_total (<= SX_MAX_HEADS) */
  uint32_t head_dim;     /* elements per head and token */
  char dtype[SX_TAG_MAX + 1]; /* "fp32", "bf16", "fp16", "fp8_e4m3", "int8"... */
  uint64_t slots;        /* slots described (bit mask); 0 is K and V */
} sx_block_desc;

/* Bytes of one element of a dtype name, 0 for a name not known. */
SX_EXTERN uint32_t sx_dtype_bytes(const char *dtype);
SX_EXTERN const char *sx_kv_order_name(sx_kv_order o);

/* Segment-wide facts a reader must agree with. */
typedef struct sx_layout {
  char fingerprint[SX_FINGERPRINT_MAX + 1]; /* model/layout fingerprint */
  char tag[SX_TAG_MAX + 1];                 /* e.g. "NHD", "HND" */
  char dtype[SX_TAG_MAX + 1];               /* e.g. "bf16", "fp8_e4m3" */
  uint32_t tp_rank, tp_size;
  uint32_t pp_rank, pp_size;
  /* Pipeline stage: the layers this segment holds, [layer_first,
   * layer_first + layer_count); count 0: not said.  Regions must lie in it. */
  uint32_t layer_first, layer_count;
  /* Block descriptions, one per group at most (see sx_block_desc). */
  uint32_t n_blocks;
  sx_block_desc blocks[SX_MAX_BLOCK_DESCS];
} sx_layout;

typedef struct sx_desc {
  uint32_t schema_version;
  char name[SX_NAME_MAX + 1];
  uint8_t incarnation[SX_INCARNATION_LEN];
  uint64_t generation;
  uint64_t published_at_ms; /* Unix time, milliseconds */
  uint32_t lease_ms;
  uint8_t token[SX_TOKEN_LEN];
  sx_layout layout;
  sx_endpoint *endpoints;
  uint32_t n_endpoints;
  sx_region *regions;
  uint32_t n_regions;
  sx_label *labels;
  uint32_t n_labels;
  /* Where the owner runs: the kernel's boot id (lower-case hex UUID from
   * /proc/sys/kernel/random/boot_id; "" when unknown), its hostname, and a
   * number drawn at random once per process (0: unknown).  Equal host_id
   * means the same running kernel, so CUDA IPC can work; equal process
   * means the same process, where it cannot. */
  char host_id[SX_HOST_ID_LEN + 1];
  char hostname[SX_HOSTNAME_MAX + 1];
  uint64_t process;
} sx_desc;

/* Zero a descriptor and set its schema version.  Never fails. */
SX_EXTERN void sx_desc_init(sx_desc *d);

/* Release the arrays a descriptor owns and zero it.  NULL is a no-op. */
SX_EXTERN void sx_desc_free(sx_desc *d);

/* Deep copy.  On success *dst owns new arrays; on failure *dst is untouched. */
SX_EXTERN int sx_desc_copy(sx_desc *dst, const sx_desc *src);

/* Append a copy of *r / *e / a label; SX_ENOMEM or SX_ELIMIT on failure. */
SX_EXTERN int sx_desc_add_region(sx_desc *d, const sx_region *r);
SX_EXTERN int sx_desc_add_endpoint(sx_desc *d, const sx_endpoint *e);
SX_EXTERN int sx_desc_set_label(sx_desc *d, const char *key, const char *value);
SX_EXTERN const char *sx_desc_label(const sx_desc *d, const char *key);

/* Remove the region with this id; SX_ENOREGION if there is none. */
SX_EXTERN int sx_desc_remove_region(sx_desc *d, uint32_t id);

/* The region holding (group, layer, slot), or NULL. */
SX_EXTERN const sx_region *sx_desc_find(const sx_desc *d, uint32_t group,
                                        uint32_t layer, uint32_t slot);

/* Number of RDMA endpoints (the rkey count every region must carry). */
SX_EXTERN uint32_t sx_desc_rdma_devices(const sx_desc *d);

/* The RDMA endpoint (device) the owner chose for region r of d (r->nic), or
 * NULL when it chose none or r->nic names no RDMA endpoint of d.  The
 * pointer is into d and lives as long as d. */
SX_EXTERN const sx_endpoint *sx_desc_region_nic(const sx_desc *d, const sx_region *r);

/* Sum of region lengths. */
SX_EXTERN uint64_t sx_desc_total_bytes(const sx_desc *d);

/*
 * Check every rule a published descriptor must satisfy: schema version,
 * name, limits, stride/overflow/bounds of every region, non-overlapping keys,
 * rkey counts, incarnation and token present.  Returns 0 or the SX_E* code of
 * the first rule broken; sx_errmsg() names the field and region.
 */
SX_EXTERN int sx_desc_validate(const sx_desc *d);

/* Name rules: 1..SX_NAME_MAX bytes of [A-Za-z0-9._:/@+=-], not starting with
 * '/' or '.'.  Returns 0 or SX_ENAME with a message saying what is wrong. */
SX_EXTERN int sx_name_validate(const char *name);

/* Namespace rules: 1..SX_NS_MAX bytes of [A-Za-z0-9._-]. */
SX_EXTERN int sx_ns_validate(const char *ns);

/*
 * Encode a valid descriptor.  Validates first.  On success *out is a
 * malloc()ed buffer the caller frees, *out_len its size.
 */
SX_EXTERN int sx_desc_encode(const sx_desc *d, uint8_t **out, size_t *out_len);

/*
 * Decode and validate.  On success *d (which need not be initialised) owns
 * new arrays; on failure *d is untouched and the code says which rule broke:
 * SX_EDECODE (not protobuf), SX_ELIMIT (too large), SX_EVERSION, SX_ENAME,
 * SX_ESTRIDE, SX_EOVERFLOW, SX_EBOUNDS, SX_ELAYERS, SX_EOVERLAP, SX_ERKEYS,
 * SX_EMISSING, SX_EDUPLICATE, SX_EINVAL.
 */
SX_EXTERN int sx_desc_decode(const uint8_t *buf, size_t len, sx_desc *d);

/* Segment events, as announced by stores on every change. */
typedef enum sx_event_kind {
  SX_EVENT_PUT = 1,
  SX_EVENT_DELETE = 2,
  SX_EVENT_EXPIRED = 3,
} sx_event_kind;

typedef struct sx_event {
  sx_event_kind kind;
  char name[SX_NAME_MAX + 1];
  uint8_t incarnation[SX_INCARNATION_LEN]; /* zero when unknown (expiry) */
  uint64_t generation;
} sx_event;

SX_EXTERN int sx_event_encode(const sx_event *ev, uint8_t **out, size_t *out_len);
SX_EXTERN int sx_event_decode(const uint8_t *buf, size_t len, sx_event *ev);
SX_EXTERN const char *sx_event_kind_name(sx_event_kind k);

/* "K", "V", "index", "state", or "slot<N>" for other ids.  Returns buf. */
SX_EXTERN const char *sx_slot_name(uint32_t slot, char buf[16]);
/* Inverse of sx_slot_name() (names in any case); also accepts a plain
 * number, digits only.  0 or SX_EINVAL. */
SX_EXTERN int sx_slot_parse(const char *s, uint32_t *slot);

/* Lower-case hex of an incarnation or token; out needs 2*len+1 bytes. */
SX_EXTERN void sx_hex(const uint8_t *bytes, size_t len, char *out);
SX_EXTERN int sx_unhex(const char *hex, uint8_t *bytes, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* SEGXFER_DESCRIPTOR_H */
