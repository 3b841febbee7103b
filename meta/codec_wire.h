/* The descriptor's wire reader (codec_wire.c).  Not installed. */
#ifndef SX_META_CODEC_WIRE_H
#define SX_META_CODEC_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "segxfer.pb-c.h"

/* Unpack buf into structs allocated from a (never freed one by one: an
 * arena), as sxpb__segment_descriptor__unpack() would; NULL when buf is not
 * a well-formed SegmentDescriptor or an allocation failed. */
Sxpb__SegmentDescriptor *sx__desc_wire_unpack(ProtobufCAllocator *a, const uint8_t *buf,
                                              size_t len);

#endif
