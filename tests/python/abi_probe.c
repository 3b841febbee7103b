/*
 * The C side of tests/python/test_abi.py: the size of every struct the
 * Python package mirrors with ctypes, the offset and size of each field it
 * uses, and the enum values it spells out, as the C compiler sees them.
 * The test compares them with python/segxfer/_lib.py, so a header change
 * that the Python side does not follow fails there instead of corrupting
 * memory.  Output lines: "S struct size", "F struct.field offset size",
 * "C NAME value".
 */
#include <stddef.h>
#include <stdio.h>

#include "segxfer.h"

#define S(t) printf("S %s %zu\n", #t, sizeof(t))
#define F(t, f) printf("F %s.%s %zu %zu\n", #t, #f, offsetof(t, f), sizeof(((t *)0)->f))
#define C(n) printf("C %s %lld\n", #n, (long long)(n))

int main(void) {
  S(sx_layout);
  F(sx_layout, fingerprint); F(sx_layout, tag); F(sx_layout, dtype);
  F(sx_layout, tp_rank); F(sx_layout, tp_size); F(sx_layout, pp_rank);
  F(sx_layout, pp_size); F(sx_layout, layer_first); F(sx_layout, layer_count);
  F(sx_layout, n_blocks); F(sx_layout, blocks);
  S(sx_group_params);
  F(sx_group_params, names); F(sx_group_params, n_names); F(sx_group_params, engine);
  F(sx_group_params, tp_size); F(sx_group_params, timeout_ms); F(sx_group_params, flags);
  F(sx_group_params, pattern);
  S(sx_group_result);
  F(sx_group_result, state); F(sx_group_result, error); F(sx_group_result, message);
  F(sx_group_result, bytes); F(sx_group_result, n_ranges); F(sx_group_result, members);
  F(sx_group_result, n_failed); F(sx_group_result, failed);
  F(sx_group_result, transfer_ns);
  S(sx_plan_info);
  F(sx_plan_info, members); F(sx_plan_info, used); F(sx_plan_info, groups);
  F(sx_plan_info, pieces); F(sx_plan_info, whole);
  S(sx_block_desc);
  F(sx_block_desc, group); F(sx_block_desc, order); F(sx_block_desc, tokens);
  F(sx_block_desc, head_first); F(sx_block_desc, head_count);
  F(sx_block_desc, heads_total); F(sx_block_desc, head_dim); F(sx_block_desc, dtype);
  F(sx_block_desc, slots);
  S(sx_label);
  F(sx_label, key); F(sx_label, value);
  S(sx_agent_params);
  F(sx_agent_params, name); F(sx_agent_params, metadata_url); F(sx_agent_params, ns);
  F(sx_agent_params, listen); F(sx_agent_params, advertise);
  F(sx_agent_params, transports); F(sx_agent_params, lease_ms);
  F(sx_agent_params, renew_ms); F(sx_agent_params, conns_per_peer);
  F(sx_agent_params, rdma_devices); F(sx_agent_params, rdma_gid_index);
  F(sx_agent_params, rdma_slice_bytes); F(sx_agent_params, slice_bytes);
  F(sx_agent_params, cache_ttl_ms); F(sx_agent_params, layout);
  F(sx_agent_params, labels); F(sx_agent_params, n_labels); F(sx_agent_params, log);
  F(sx_agent_params, log_arg); F(sx_agent_params, log_level);
  F(sx_agent_params, staging_bytes); F(sx_agent_params, rdma_gpu);
  F(sx_agent_params, tcp_threads); F(sx_agent_params, tcp_thread_bytes);
  S(sx_region_params);
  F(sx_region_params, addr); F(sx_region_params, length); F(sx_region_params, group);
  F(sx_region_params, layer_first); F(sx_region_params, layer_count);
  F(sx_region_params, layer_stride); F(sx_region_params, slot);
  F(sx_region_params, block_bytes); F(sx_region_params, block_stride);
  F(sx_region_params, num_blocks); F(sx_region_params, location);
  F(sx_region_params, access);
  S(sx_endpoint);
  F(sx_endpoint, kind); F(sx_endpoint, addr); F(sx_endpoint, port);
  F(sx_endpoint, device); F(sx_endpoint, gid); F(sx_endpoint, port_num);
  F(sx_endpoint, mtu);
  S(sx_region);
  F(sx_region, id); F(sx_region, group); F(sx_region, layer_first);
  F(sx_region, layer_count); F(sx_region, layer_stride); F(sx_region, slot);
  F(sx_region, access); F(sx_region, addr); F(sx_region, length);
  F(sx_region, block_bytes); F(sx_region, block_stride); F(sx_region, num_blocks);
  F(sx_region, location); F(sx_region, n_rkeys); F(sx_region, rkeys);
  F(sx_region, n_wkeys); F(sx_region, wkeys); F(sx_region, nic);
  S(sx_desc);
  F(sx_desc, schema_version); F(sx_desc, name); F(sx_desc, incarnation);
  F(sx_desc, generation); F(sx_desc, published_at_ms); F(sx_desc, lease_ms);
  F(sx_desc, token); F(sx_desc, layout); F(sx_desc, endpoints);
  F(sx_desc, n_endpoints); F(sx_desc, regions); F(sx_desc, n_regions);
  F(sx_desc, labels); F(sx_desc, n_labels); F(sx_desc, host_id);
  F(sx_desc, hostname); F(sx_desc, process);
  S(sx_mismatch);
  F(sx_mismatch, kind); F(sx_mismatch, field); F(sx_mismatch, group);
  F(sx_mismatch, layer); F(sx_mismatch, slot); F(sx_mismatch, local);
  F(sx_mismatch, remote); F(sx_mismatch, message);
  S(sx_block_read);
  F(sx_block_read, group); F(sx_block_read, layer_first);
  F(sx_block_read, layer_count); F(sx_block_read, slots);
  F(sx_block_read, remote_block); F(sx_block_read, local_block);
  F(sx_block_read, count);
  S(sx_block_ids);
  F(sx_block_ids, group); F(sx_block_ids, layer_first); F(sx_block_ids, layer_count);
  F(sx_block_ids, slots); F(sx_block_ids, local); F(sx_block_ids, n_local);
  F(sx_block_ids, remote); F(sx_block_ids, n_remote);
  S(sx_range_read);
  F(sx_range_read, local); F(sx_range_read, remote_region); F(sx_range_read, offset);
  F(sx_range_read, length);
  S(sx_batch_params);
  F(sx_batch_params, timeout_ms); F(sx_batch_params, cb); F(sx_batch_params, cb_arg);
  F(sx_batch_params, flags); F(sx_batch_params, tag);
  S(sx_batch_result);
  F(sx_batch_result, state); F(sx_batch_result, error); F(sx_batch_result, message);
  F(sx_batch_result, bytes); F(sx_batch_result, n_entries);
  F(sx_batch_result, n_ranges); F(sx_batch_result, n_failed);
  F(sx_batch_result, failed); F(sx_batch_result, transport);
  F(sx_batch_result, post_ns); F(sx_batch_result, transfer_ns);
  S(sx_agent_status);
  F(sx_agent_status, state); F(sx_agent_status, generation);
  F(sx_agent_status, renewals); F(sx_agent_status, renew_failures);
  F(sx_agent_status, republishes); F(sx_agent_status, store_reconnects);
  F(sx_agent_status, last_error); F(sx_agent_status, store_up);
  F(sx_agent_status, served_reads); F(sx_agent_status, served_bytes);
  F(sx_agent_status, served_errors);
  S(sx_block_write);
  F(sx_block_write, group); F(sx_block_write, layer_first);
  F(sx_block_write, layer_count); F(sx_block_write, slots);
  F(sx_block_write, local_block); F(sx_block_write, remote_block);
  F(sx_block_write, count);
  S(sx_range_write);
  F(sx_range_write, local); F(sx_range_write, remote_region); F(sx_range_write, offset);
  F(sx_range_write, length);
  S(sx_notice_blocks);
  F(sx_notice_blocks, group); F(sx_notice_blocks, layer_first);
  F(sx_notice_blocks, layer_count); F(sx_notice_blocks, slots);
  F(sx_notice_blocks, block); F(sx_notice_blocks, count);
  S(sx_notice_range);
  F(sx_notice_range, region); F(sx_notice_range, offset); F(sx_notice_range, length);
  S(sx_notice);
  F(sx_notice, producer); F(sx_notice, incarnation); F(sx_notice, tag);
  F(sx_notice, bytes); F(sx_notice, transport); F(sx_notice, n_blocks);
  F(sx_notice, n_ranges); F(sx_notice, kind); F(sx_notice, blocks);
  F(sx_notice, ranges);
  C(SX_BATCH_NEW); C(SX_BATCH_RUNNING); C(SX_BATCH_COMPLETED); C(SX_BATCH_FAILED);
  C(SX_BATCH_TIMEOUT); C(SX_BATCH_CANCELLED);
  C(SX_AGENT_UNPUBLISHED); C(SX_AGENT_PUBLISHED); C(SX_AGENT_RECLAIMING); C(SX_AGENT_FENCED);
  C(SX_TRANSPORT_NONE); C(SX_TRANSPORT_TCP); C(SX_TRANSPORT_RDMA);
  C(SX_TRANSPORT_CUDA_IPC); C(SX_HOST_ID_LEN); C(SX_HOSTNAME_MAX);
  C(SX_LOG_ERROR); C(SX_LOG_WARN); C(SX_LOG_INFO); C(SX_LOG_DEBUG);
  C(SX_MISMATCH_NONE); C(SX_MISMATCH_FINGERPRINT); C(SX_MISMATCH_LAYOUT_TAG);
  C(SX_MISMATCH_DTYPE); C(SX_MISMATCH_MISSING_KEY); C(SX_MISMATCH_EXTRA_KEY);
  C(SX_MISMATCH_BLOCK_BYTES); C(SX_MISMATCH_BLOCK_DESC); C(SX_MISMATCH_HEADS_TOTAL);
  C(SX_MISMATCH_HEAD_DIM); C(SX_MISMATCH_BLOCK_TOKENS); C(SX_MISMATCH_ORDER);
  C(SX_MISMATCH_HEADS_MISSING); C(SX_MISMATCH_HEADS_OVERLAP); C(SX_MISMATCH_TP);
  C(SX_SLOT_K); C(SX_SLOT_V); C(SX_SLOT_INDEX); C(SX_SLOT_STATE);
  C(SX_ACCESS_REMOTE_READ); C(SX_PUBLISH_TAKEOVER); C(SX_CHECK_IGNORE_FINGERPRINT);
  C(SX_ACCESS_REMOTE_WRITE); C(SX_BATCH_WRITE); C(SX_NOTICE_MAX_ENTRIES);
  C(SX_BATCH_NOTIFY); C(SX_NOTICE_WRITE); C(SX_NOTICE_READ);
  C(SX_EINCOMPAT); C(SX_EBUSY); C(SX_ETIMEDOUT); C(SX_ECANCELED); C(SX_EINVAL);
  return 0;
}
