/*
 * Reachability of GPU memory from an RDMA device (docs/gpu.md).  A
 * registration of GPU memory can succeed where the NIC cannot actually reach
 * the GPU (no peer-to-peer path on that PCI topology, an IOMMU in the way);
 * the first READ then fails with IBV_WC_LOC_PROT_ERR or
 * IBV_WC_REM_ACCESS_ERR at a reader, far from the cause.  So the first
 * registration of each (device, GPU) pair reads a few bytes of the new MR
 * back through a loopback RC QP pair on the device; if that fails the pair
 * is marked staged (its MRs dropped) and the log says why.
 *
 * The two QPs are connected by hand (INIT, RTR, RTS with the port's own GID
 * as destination): no rdma_cm, nothing on the wire, and it runs
 * synchronously (bounded by LOOP_MS) at registration, not on the loop.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rdma_int.h"

#define LOOP_MS 2000u
#define PROBE_BYTES 64u

static int qp_up(struct ibv_qp *qp, const rdma_ep *ep, uint32_t dqpn) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_INIT;
  a.port_num = ep->port_num;
  a.qp_access_flags = IBV_ACCESS_REMOTE_READ;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                IBV_QP_ACCESS_FLAGS) != 0)
    return -1;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dqpn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = ep->port_num;
  a.ah_attr.is_global = 1;
  memcpy(a.ah_attr.grh.dgid.raw, ep->gid, SX_GID_LEN);
  a.ah_attr.grh.sgid_index = (uint8_t)ep->gid_index;
  a.ah_attr.grh.hop_limit = 1;
  if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                IBV_QP_MIN_RNR_TIMER) != 0)
    return -1;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 2;
  a.rnr_retry = 2;
  a.max_rd_atomic = 1;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                   IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

int sx__rdma_reach(sx_rdma *t, rdma_dev *d, const struct ibv_mr *mr, uint64_t addr, char *why,
                   size_t cap) {
  const rdma_ep *ep = NULL;
  for (int i = 0; i < t->n_eps && ep == NULL; i++)
    if (t->eps[i].dev == d)
      ep = &t->eps[i];
  if (ep == NULL) {
    snprintf(why, cap, "%s has no active port to test on", d->name);
    return 0; /* nothing to read over: no reader will come through it either */
  }
  int rc = -1;
  struct ibv_cq *cq = ibv_create_cq(d->verbs, 4, NULL, NULL, 0);
  struct ibv_qp *qa = NULL, *qb = NULL;
  struct ibv_mr *lmr = NULL;
  uint8_t *buf = calloc(1, PROBE_BYTES);
  if (cq == NULL || buf == NULL) {
    snprintf(why, cap, "loopback test on %s: %s", d->name, strerror(errno));
    goto out;
  }
  struct ibv_qp_init_attr ia;
  memset(&ia, 0, sizeof(ia));
  ia.send_cq = ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = ia.cap.max_recv_wr = 1;
  ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
  qa = ibv_create_qp(d->pd, &ia);
  qb = ibv_create_qp(d->pd, &ia);
  lmr = ibv_reg_mr(d->pd, buf, PROBE_BYTES, IBV_ACCESS_LOCAL_WRITE);
  if (qa == NULL || qb == NULL || lmr == NULL || qp_up(qa, ep, qb->qp_num) != 0 ||
      qp_up(qb, ep, qa->qp_num) != 0) {
    snprintf(why, cap, "loopback QPs on %s: %s", d->name, strerror(errno));
    goto out;
  }
  struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = PROBE_BYTES, .lkey = lmr->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  sx__rdma_wr_read(&wr, &sge, 0, addr, mr->rkey);
  if (ibv_post_send(qa, &wr, &bad) != 0) {
    snprintf(why, cap, "loopback READ on %s: ibv_post_send: %s", d->name, strerror(errno));
    goto out;
  }
  struct ibv_wc wc;
  uint64_t end = sx__mono_ms() + LOOP_MS;
  int n = 0;
  while ((n = ibv_poll_cq(cq, 1, &wc)) == 0 && sx__mono_ms() < end)
    usleep(100);
  if (n <= 0)
    snprintf(why, cap, "loopback READ of GPU memory on %s: no completion within %u ms",
             d->name, LOOP_MS);
  else if (wc.status != IBV_WC_SUCCESS)
    snprintf(why, cap, "loopback READ of GPU memory on %s failed: %s", d->name,
             ibv_wc_status_str(wc.status));
  else
    rc = 0;
out:
  /* Destroying the QPs flushes a READ still pending before buf goes. */
  if (qa != NULL)
    ibv_destroy_qp(qa);
  if (qb != NULL)
    ibv_destroy_qp(qb);
  if (lmr != NULL)
    ibv_dereg_mr(lmr);
  if (cq != NULL)
    ibv_destroy_cq(cq);
  free(buf);
  return rc == 0;
}

void sx__rdma_reach_failed(sx_rdma *t, rdma_dev *d, int gpu, const char *why) {
  const sx_tctx *ctx = t->base.ctx;
  t->stats.gpu_unreachable++;
  if (ctx->gpu_unreachable != NULL)
    ctx->gpu_unreachable(ctx->agent);
  sx__rdma_log(t, SX_LOG_WARN, "%s cannot reach cuda:%d (%s): the pair is staged", d->name, gpu,
               why);
}
