/*
 * The write-notice codec (push mode): sx_notice to and from the WriteNotice
 * protobuf of proto/segxfer.proto.  Not installed.
 *
 * A notice comes from the network, so decoding is strict: the size, the
 * version, the producer's name and incarnation, equal column lengths, the
 * entry limit, non-empty entries and overflow-free arithmetic are checked,
 * and unknown fields are refused.  What only the consumer can check (that
 * each entry lies in one of its writable regions and the byte count adds
 * up) is the agent's (agent/notice.c).  Pure functions: the fuzz target
 * drives them directly.
 */
#ifndef SX_META_NOTICE_H
#define SX_META_NOTICE_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer/push.h"

#define SX__NOTICE_VERSION 1

/* A zeroed notice with room for nb block runs and nr ranges, in one
 * allocation that sx_notice_free() releases; NULL when out of memory or
 * above SX_NOTICE_MAX_ENTRIES. */
sx_notice *sx__notice_alloc(uint32_t nb, uint32_t nr);
/* The writable views of a notice from sx__notice_alloc(). */
sx_notice_blocks *sx__notice_blocks(sx_notice *n);
sx_notice_range *sx__notice_ranges(sx_notice *n);

/* The structural rules above: 0 or SX_ENAME, SX_EMISSING, SX_ELIMIT,
 * SX_EINVAL, SX_EOVERFLOW with a message naming the entry. */
int sx__notice_check(const sx_notice *n);

/* Check, then encode into a malloc()ed buffer (*out, *len). */
int sx__notice_encode(const sx_notice *n, uint8_t **out, size_t *len);

/* Decode and check len bytes.  On success *out is a new notice (its
 * transport field SX_TRANSPORT_NONE); SX_EDECODE, SX_ELIMIT, SX_EVERSION or
 * a check code otherwise. */
int sx__notice_decode(const uint8_t *buf, size_t len, sx_notice **out);

#endif
