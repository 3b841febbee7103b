/*
 * RDMA devices and memory: which device ports this agent serves on (active
 * ports, their GID and the IP address rdma_cm resolves to them), protection
 * domains and completion channels, memory registration, and the endpoints
 * and rkeys published in the descriptor.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <stdarg.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "rdma_int.h"

static uint32_t mtu_bytes(enum ibv_mtu m) {
  return (m >= IBV_MTU_256 && m <= IBV_MTU_4096) ? 128u << m : 0;
}

static int gid_v4mapped(const uint8_t *g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g, prefix, sizeof(prefix)) == 0;
}

static int gid_zero(const uint8_t *g) {
  uint8_t acc = 0;
  for (int i = 0; i < SX_GID_LEN; i++)
    acc |= g[i];
  return acc == 0;
}

static int gid_linklocal(const uint8_t *g) { return g[0] == 0xfe && (g[1] & 0xc0) == 0x80; }

/* Is name in a list like "mlx5_0,mlx5_1" (commas or spaces)? */
static int name_in_list(const char *list, const char *name) {
  size_t n = strlen(name);
  const char *s = list;
  while (*s != '\0') {
    while (*s == ',' || *s == ' ')
      s++;
    const char *e = s;
    while (*e != '\0' && *e != ',' && *e != ' ')
      e++;
    if ((size_t)(e - s) == n && n > 0 && strncmp(s, name, n) == 0)
      return 1;
    s = e;
  }
  return 0;
}

/* Append to a bounded summary of what was looked at, for the ENODEV message. */
static void note(char *buf, size_t size, const char *fmt, ...) SX__PRINTF(3, 4);
static void note(char *buf, size_t size, const char *fmt, ...) {
  size_t used = strlen(buf);
  if (used + 3 >= size)
    return;
  if (used > 0) {
    buf[used++] = ';';
    buf[used++] = ' ';
    buf[used] = '\0';
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + used, size - used, fmt, ap);
  va_end(ap);
}

/* IPv4 netmask of an interface address, for same-subnet preference. */
static void find_mask(rdma_ep *ep) {
  struct ifaddrs *ifs, *i;
  if (getifaddrs(&ifs) != 0)
    return;
  for (i = ifs; i != NULL; i = i->ifa_next) {
    if (i->ifa_addr == NULL || i->ifa_addr->sa_family != AF_INET || i->ifa_netmask == NULL)
      continue;
    if (((struct sockaddr_in *)i->ifa_addr)->sin_addr.s_addr == ep->ipv4.s_addr) {
      ep->mask = ((struct sockaddr_in *)i->ifa_netmask)->sin_addr;
      break;
    }
  }
  freeifaddrs(ifs);
}

/* The address of the netdev behind a GID: its first IPv4 address, else its
 * first global IPv6 address. */
static int ifindex_addr(unsigned ifindex, rdma_ep *ep) {
  struct ifaddrs *ifs, *i;
  char ifname[IF_NAMESIZE];
  int found = 0;
  if (ifindex == 0 || if_indextoname(ifindex, ifname) == NULL || getifaddrs(&ifs) != 0)
    return 0;
  for (int pass = 0; pass < 2 && !found; pass++) {
    for (i = ifs; i != NULL && !found; i = i->ifa_next) {
      if (i->ifa_addr == NULL || strcmp(i->ifa_name, ifname) != 0)
        continue;
      if (pass == 0 && i->ifa_addr->sa_family == AF_INET) {
        ep->ipv4 = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
        if (i->ifa_netmask != NULL)
          ep->mask = ((struct sockaddr_in *)i->ifa_netmask)->sin_addr;
        ep->has_ipv4 = 1;
        inet_ntop(AF_INET, &ep->ipv4, ep->addr, sizeof(ep->addr));
        found = 1;
      } else if (pass == 1 && i->ifa_addr->sa_family == AF_INET6) {
        const struct in6_addr *a = &((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr;
        if (gid_linklocal(a->s6_addr))
          continue; /* needs a scope id rdma_cm peers cannot use */
        inet_ntop(AF_INET6, a, ep->addr, sizeof(ep->addr));
        found = 1;
      }
    }
  }
  freeifaddrs(ifs);
  return found;
}

/* Where peers reach this port through rdma_cm. */
static int ep_address(sx_rdma *t, rdma_ep *ep, unsigned ndev_ifindex) {
  if (gid_v4mapped(ep->gid)) {
    memcpy(&ep->ipv4, ep->gid + 12, 4);
    ep->has_ipv4 = 1;
    inet_ntop(AF_INET, &ep->ipv4, ep->addr, sizeof(ep->addr));
    find_mask(ep);
    return 1;
  }
  if (ifindex_addr(ndev_ifindex, ep))
    return 1;
  /* InfiniBand: the GID has no IP in it; IPoIB's address is what rdma_cm
   * resolves, and only the operator knows which one belongs to this port. */
  const sx_agent_params *params = t->base.ctx->params;
  if (params != NULL && params->advertise != NULL && params->advertise[0] != '\0') {
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, params->advertise, &a4) == 1) {
      ep->ipv4 = a4;
      ep->has_ipv4 = 1;
      snprintf(ep->addr, sizeof(ep->addr), "%s", params->advertise);
      find_mask(ep);
      return 1;
    }
    if (inet_pton(AF_INET6, params->advertise, &a6) == 1) {
      snprintf(ep->addr, sizeof(ep->addr), "%s", params->advertise);
      return 1;
    }
  }
  return 0;
}

/* Rank a GID for rdma_cm over this port: RoCE v2 with an IPv4 address first
 * (routable, and rdma_cm resolves IPv4 on every stack), then RoCE v2 IPv6,
 * then RoCE v1; InfiniBand uses its port GID (index 0). */
static int gid_rank(uint8_t link_layer, const struct ibv_gid_entry *e) {
  const uint8_t *g = e->gid.raw;
  if (gid_zero(g))
    return 0;
  if (link_layer == IBV_LINK_LAYER_INFINIBAND)
    return e->gid_type == IBV_GID_TYPE_IB ? (e->gid_index == 0 ? 3 : 1) : 0;
  if (e->gid_type == IBV_GID_TYPE_ROCE_V2)
    return gid_v4mapped(g) ? 5 : (gid_linklocal(g) ? 2 : 4);
  if (e->gid_type == IBV_GID_TYPE_ROCE_V1)
    return gid_v4mapped(g) ? 3 : 1;
  return 0;
}

/* Choose the GID for one port from the device's table. */
static int pick_gid(const struct ibv_gid_entry *ents, ssize_t n, uint8_t port,
                    uint8_t link_layer, int want_index, struct ibv_gid_entry *out) {
  int best = 0;
  for (ssize_t i = 0; i < n; i++) {
    if (ents[i].port_num != port)
      continue;
    if (want_index >= 0) {
      if ((int)ents[i].gid_index == want_index && !gid_zero(ents[i].gid.raw)) {
        *out = ents[i];
        return 1;
      }
      continue;
    }
    int r = gid_rank(link_layer, &ents[i]);
    if (r > best) {
      best = r;
      *out = ents[i];
    }
  }
  return best > 0;
}

/* Every valid GID of a device: the table query, or one entry at a time on
 * stacks without it. */
static ssize_t gid_table(struct ibv_context *verbs, const struct ibv_device_attr *attr,
                         struct ibv_gid_entry **out) {
  size_t max = 0;
  for (uint8_t port = 1; port <= attr->phys_port_cnt; port++) {
    struct ibv_port_attr pa;
    if (ibv_query_port(verbs, port, &pa) == 0)
      max += (size_t)pa.gid_tbl_len;
  }
  if (max == 0)
    max = 1;
  struct ibv_gid_entry *ents = calloc(max, sizeof(*ents));
  if (ents == NULL)
    return -1;
  ssize_t n = ibv_query_gid_table(verbs, ents, max, 0);
  if (n < 0) {
    n = 0;
    for (uint8_t port = 1; port <= attr->phys_port_cnt; port++) {
      struct ibv_port_attr pa;
      if (ibv_query_port(verbs, port, &pa) != 0)
        continue;
      for (int i = 0; i < pa.gid_tbl_len && i < 256 && (size_t)n < max; i++)
        if (ibv_query_gid_ex(verbs, port, (uint32_t)i, &ents[n], 0) == 0)
          n++;
    }
  }
  *out = ents;
  return n;
}

static void free_handle(uv_handle_t *h) { free(h); }

static void dev_free(rdma_dev *d) {
  sx__rdma_wdev_free(d);
  if (d->chan_poll != NULL) {
    /* uv_close stops polling at once; the handle's memory goes in its
     * close callback, so the channel (and its fd) can go right away. */
    uv_close((uv_handle_t *)d->chan_poll, free_handle);
    d->chan_poll = NULL;
  }
  if (d->idle_cq != NULL) {
    ibv_destroy_cq(d->idle_cq);
    d->idle_cq = NULL;
  }
  if (d->chan != NULL) {
    ibv_destroy_comp_channel(d->chan);
    d->chan = NULL;
  }
  if (d->pd != NULL) {
    if (ibv_dealloc_pd(d->pd) != 0)
      sx__rdma_log(d->t, SX_LOG_WARN, "ibv_dealloc_pd(%s): %s", d->name, strerror(errno));
    d->pd = NULL;
  }
}

int sx__rdma_chan_open(sx_rdma *t, rdma_dev *d, struct ibv_comp_channel **chan,
                       uv_poll_t **poll, uv_poll_cb cb) {
  int rc, flags;
  *chan = ibv_create_comp_channel(d->verbs);
  if (*chan == NULL)
    return sx__err(SX_ENODEV, "ibv_create_comp_channel(%s): %s", d->name, strerror(errno));
  flags = fcntl((*chan)->fd, F_GETFL);
  if (flags < 0 || fcntl((*chan)->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    rc = sx__err(SX_EIO, "completion channel of %s: fcntl: %s", d->name, strerror(errno));
    goto out_destroy_chan;
  }
  *poll = malloc(sizeof(**poll));
  if (*poll == NULL) {
    rc = sx__err(SX_ENOMEM, "rdma: out of memory");
    goto out_destroy_chan;
  }
  if (uv_poll_init(t->base.ctx->loop, *poll, (*chan)->fd) != 0) {
    free(*poll);
    *poll = NULL;
    rc = sx__err(SX_EIO, "uv_poll_init on a completion channel of %s failed", d->name);
    goto out_destroy_chan;
  }
  (*poll)->data = d;
  uv_poll_start(*poll, UV_READABLE, cb);
  return 0;

out_destroy_chan:
  ibv_destroy_comp_channel(*chan);
  *chan = NULL;
  return rc;
}

/* PD and completion channel of a device, the channel hooked into the loop. */
static int dev_setup(sx_rdma *t, rdma_dev *d) {
  int rc;
  d->pd = ibv_alloc_pd(d->verbs);
  if (d->pd == NULL)
    return sx__err(SX_ENODEV, "ibv_alloc_pd(%s): %s", d->name, strerror(errno));
  if ((rc = sx__rdma_chan_open(t, d, &d->chan, &d->chan_poll, sx__rdma_on_cq_event)) != 0) {
    ibv_dealloc_pd(d->pd);
    d->pd = NULL;
  }
  return rc;
}

/* Add the usable active ports of one device as endpoints.  Returns how many. */
static int dev_ports(sx_rdma *t, rdma_dev *d, char *seen, size_t seen_size) {
  const sx_agent_params *params = t->base.ctx->params;
  int want_index = params != NULL ? params->rdma_gid_index : -1;
  struct ibv_gid_entry *ents = NULL;
  int added = 0;
  ssize_t n = gid_table(d->verbs, &d->attr, &ents);
  if (n < 0) {
    note(seen, seen_size, "%s: out of memory", d->name);
    return 0;
  }
  for (uint8_t port = 1; port <= d->attr.phys_port_cnt; port++) {
    struct ibv_port_attr pa;
    struct ibv_gid_entry g;
    if (t->n_eps >= SX__RDMA_MAX_EPS) {
      note(seen, seen_size, "%s port %u: more than %d endpoints", d->name, port, SX__RDMA_MAX_EPS);
      break;
    }
    if (ibv_query_port(d->verbs, port, &pa) != 0) {
      note(seen, seen_size, "%s port %u: ibv_query_port: %s", d->name, port, strerror(errno));
      continue;
    }
    if (pa.state != IBV_PORT_ACTIVE) {
      note(seen, seen_size, "%s port %u is %s", d->name, port, ibv_port_state_str(pa.state));
      continue;
    }
    if (!pick_gid(ents, n, port, pa.link_layer, want_index, &g)) {
      if (want_index >= 0)
        note(seen, seen_size, "%s port %u has no GID at index %d", d->name, port, want_index);
      else
        note(seen, seen_size, "%s port %u has no usable GID", d->name, port);
      continue;
    }
    rdma_ep *ep = &t->eps[t->n_eps];
    memset(ep, 0, sizeof(*ep));
    ep->dev = d;
    ep->port_num = port;
    ep->link_layer = pa.link_layer;
    ep->gid_index = (int)g.gid_index;
    ep->gid_type = (int)g.gid_type;
    memcpy(ep->gid, g.gid.raw, SX_GID_LEN);
    ep->mtu = mtu_bytes(pa.active_mtu);
    ep->max_msg_sz = pa.max_msg_sz;
    if (!ep_address(t, ep, g.ndev_ifindex)) {
      note(seen, seen_size,
           "%s port %u: no IP address for rdma_cm (InfiniBand needs IPoIB and the agent's "
           "advertise address)",
           d->name, port);
      continue;
    }
    t->n_eps++;
    added++;
  }
  free(ents);
  return added;
}

int sx__rdma_devs_open(sx_rdma *t) {
  const sx_agent_params *params = t->base.ctx->params;
  const char *filter = params != NULL ? params->rdma_devices : NULL;
  char seen[400] = "";
  int n = 0, rc;
  if (filter != NULL && filter[0] == '\0')
    filter = NULL;

  errno = 0;
  t->dev_list = rdma_get_devices(&n);
  if (t->dev_list == NULL || n <= 0) {
    int e = errno;
    if (t->dev_list != NULL)
      rdma_free_devices(t->dev_list);
    t->dev_list = NULL;
    return sx__err(SX_ENODEV, "no RDMA device on this host (rdma_get_devices: %s); "
                   "reads go over TCP", e ? strerror(e) : "none found");
  }
  for (int i = 0; i < n && t->dev_list[i] != NULL; i++) {
    struct ibv_context *verbs = t->dev_list[i];
    const char *name = ibv_get_device_name(verbs->device);
    if (filter != NULL && !name_in_list(filter, name))
      continue;
    if (t->n_devs >= SX__RDMA_MAX_DEVS) {
      note(seen, sizeof(seen), "%s: more than %d devices", name, SX__RDMA_MAX_DEVS);
      break;
    }
    rdma_dev *d = &t->devs[t->n_devs];
    memset(d, 0, sizeof(*d));
    d->t = t;
    d->index = t->n_devs;
    d->verbs = verbs;
    snprintf(d->name, sizeof(d->name), "%s", name);
    if (ibv_query_device(verbs, &d->attr) != 0) {
      note(seen, sizeof(seen), "%s: ibv_query_device: %s", name, strerror(errno));
      continue;
    }
    int first = t->n_eps;
    if (dev_ports(t, d, seen, sizeof(seen)) == 0)
      continue;
    rc = dev_setup(t, d);
    if (rc) {
      note(seen, sizeof(seen), "%s", sx_errmsg());
      t->n_eps = first;
      continue;
    }
    t->n_devs++;
  }
  /* A device the operator named but that is not there is a configuration
   * error worth saying so, not a silent fallback. */
  if (filter != NULL) {
    const char *s = filter;
    while (*s != '\0') {
      while (*s == ',' || *s == ' ')
        s++;
      const char *e = s;
      while (*e != '\0' && *e != ',' && *e != ' ')
        e++;
      if (e > s) {
        int found = 0;
        for (int i = 0; i < n && t->dev_list[i] != NULL && !found; i++) {
          const char *name = ibv_get_device_name(t->dev_list[i]->device);
          found = strlen(name) == (size_t)(e - s) && strncmp(name, s, (size_t)(e - s)) == 0;
        }
        if (!found)
          note(seen, sizeof(seen), "device '%.*s' (rdma_devices) does not exist", (int)(e - s), s);
      }
      s = e;
    }
  }
  if (t->n_eps == 0) {
    sx__rdma_devs_close(t);
    return sx__err(SX_ENODEV, "no usable RDMA port (%s); reads go over TCP",
                   seen[0] ? seen : "no device matched rdma_devices");
  }
  if (seen[0] != '\0')
    sx__rdma_log(t, SX_LOG_INFO, "not used: %s", seen);
  return 0;
}

void sx__rdma_devs_close(sx_rdma *t) {
  for (int i = 0; i < t->n_devs; i++)
    dev_free(&t->devs[i]);
  t->n_devs = 0;
  t->n_eps = 0;
  if (t->dev_list != NULL) {
    rdma_free_devices(t->dev_list);
    t->dev_list = NULL;
  }
}

rdma_dev *sx__rdma_dev_by_verbs(sx_rdma *t, struct ibv_context *verbs) {
  for (int i = 0; i < t->n_devs; i++)
    if (t->devs[i].verbs == verbs)
      return &t->devs[i];
  return NULL;
}

/* ------------------------------------------------------------------ memory */

static int mr_error(rdma_dev *d, const sx_lregion *lr, int e) {
  if (e == ENOMEM || e == EAGAIN) {
    struct rlimit rl;
    char lim[64] = "unknown";
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0) {
      if (rl.rlim_cur == RLIM_INFINITY)
        snprintf(lim, sizeof(lim), "unlimited");
      else
        snprintf(lim, sizeof(lim), "%llu KiB", (unsigned long long)rl.rlim_cur / 1024);
    }
    return sx__err(SX_ENOMEM,
                   "ibv_reg_mr(%s) of region %u (%llu bytes): %s; the locked-memory limit "
                   "(RLIMIT_MEMLOCK) is %s: raise it (ulimit -l unlimited, or "
                   "LimitMEMLOCK=infinity for a systemd service)",
                   d->name, lr->r.id, (unsigned long long)lr->r.length, strerror(e), lim);
  }
  return sx__err(SX_EIO, "ibv_reg_mr(%s) of region %u (%llu bytes at 0x%llx): %s", d->name,
                 lr->r.id, (unsigned long long)lr->r.length, (unsigned long long)lr->r.addr,
                 strerror(e));
}

static void mr_link(sx_rdma *t, sx_lregion *lr, rdma_mr *rm) {
  rm->next = t->mrs;
  if (t->mrs != NULL)
    t->mrs->prev = rm;
  t->mrs = rm;
  /* The rkeys go into the descriptor in pack(), next to their endpoints;
   * lr->r is also copied into descriptors that carry no endpoints. */
  lr->tpriv[SX_TRANSPORT_RDMA] = rm;
}

int sx__rdma_reg_mem(sx_transport *tt, sx_lregion *lr) {
  sx_rdma *t = (sx_rdma *)tt;
  int rc, i;
  if (lr->tpriv[SX_TRANSPORT_RDMA] != NULL)
    return sx__err(SX_EBUSY, "region %u is already registered with RDMA", lr->r.id);
  /* GPU memory: registered through dma-buf or peermem where the pair
   * (device, GPU) allows, else published with rkey 0 and staged
   * (rdma_gpu.c, docs/gpu.md). */
  if (lr->mem.kind == SX__MEM_CUDA) {
    rdma_mr *g = NULL;
    if ((rc = sx__rdma_gpu_reg(t, lr, &g)) != 0)
      return rc;
    /* Staged regions have no MR, but still a chosen NIC to publish. */
    if (g == NULL && (g = calloc(1, sizeof(*g))) == NULL)
      return sx__err(SX_ENOMEM, "rdma: out of memory");
    g->lreg = lr;
    g->nic = sx__rdma_nic_pick(t, lr);
    mr_link(t, lr, g);
    return 0;
  }
  rdma_mr *rm = calloc(1, sizeof(*rm));
  if (rm == NULL)
    return sx__err(SX_ENOMEM, "rdma: out of memory");
  rm->lreg = lr;
  rm->nic = -1;
  int remote = (lr->r.access & SX_ACCESS_REMOTE_READ) != 0;
  for (i = 0; i < t->n_devs; i++) {
    rdma_dev *d = &t->devs[i];
    void *addr = (void *)(uintptr_t)lr->r.addr;
    int access = IBV_ACCESS_LOCAL_WRITE | (remote ? IBV_ACCESS_REMOTE_READ : 0);
    rm->mr[i] = ibv_reg_mr(d->pd, addr, (size_t)lr->r.length, access);
    if (rm->mr[i] == NULL && remote && (errno == EFAULT || errno == EACCES || errno == EPERM)) {
      /* Read-only memory cannot take local writes; peers may still read it,
       * it just cannot be the destination of this agent's own reads. */
      rm->mr[i] = ibv_reg_mr(d->pd, addr, (size_t)lr->r.length, IBV_ACCESS_REMOTE_READ);
    }
    if (rm->mr[i] == NULL) {
      rc = mr_error(d, lr, errno);
      goto out_dereg;
    }
    if ((lr->r.access & SX_ACCESS_REMOTE_WRITE) && (rc = sx__rdma_wreg(t, d, lr, &rm->wmr[i]))) {
      ibv_dereg_mr(rm->mr[i]);
      goto out_dereg;
    }
  }
  rm->nic = sx__rdma_nic_pick(t, lr);
  mr_link(t, lr, rm);
  return 0;

out_dereg:
  while (i-- > 0) {
    ibv_dereg_mr(rm->mr[i]);
    if (rm->wmr[i] != NULL)
      ibv_dereg_mr(rm->wmr[i]);
  }
  free(rm);
  return rc;
}

void sx__rdma_dereg_mem(sx_transport *tt, sx_lregion *lr) {
  sx_rdma *t = (sx_rdma *)tt;
  rdma_mr *rm = lr->tpriv[SX_TRANSPORT_RDMA];
  if (rm == NULL)
    return;
  for (int i = 0; i < t->n_devs; i++) {
    if (rm->mr[i] != NULL && ibv_dereg_mr(rm->mr[i]) != 0)
      sx__rdma_log(t, SX_LOG_ERROR, "ibv_dereg_mr(%s) of region %u: %s", t->devs[i].name,
                   lr->r.id, strerror(errno));
    /* From here no producer's WRITE reaches the region. */
    if (rm->wmr[i] != NULL && ibv_dereg_mr(rm->wmr[i]) != 0)
      sx__rdma_log(t, SX_LOG_ERROR, "ibv_dereg_mr(%s) of writable region %u: %s",
                   t->devs[i].name, lr->r.id, strerror(errno));
  }
  sx__rdma_nic_put(t, rm->nic, lr->r.length);
  if (rm->prev != NULL)
    rm->prev->next = rm->next;
  else
    t->mrs = rm->next;
  if (rm->next != NULL)
    rm->next->prev = rm->prev;
  free(rm);
  lr->tpriv[SX_TRANSPORT_RDMA] = NULL;
}

/* ------------------------------------------------------------------ descriptor */

int sx__rdma_pack(sx_transport *tt, sx_desc *d) {
  sx_rdma *t = (sx_rdma *)tt;
  const sx_tctx *ctx = t->base.ctx;
  uint32_t base = sx_desc_rdma_devices(d);
  int rc;
  if (base + (uint32_t)t->n_eps > SX_MAX_DEVICES)
    return sx__err(SX_ELIMIT, "more than %d RDMA endpoints", SX_MAX_DEVICES);
  for (int k = 0; k < t->n_eps; k++) {
    const rdma_ep *ep = &t->eps[k];
    sx_endpoint e;
    memset(&e, 0, sizeof(e));
    e.kind = SX_TRANSPORT_RDMA;
    snprintf(e.addr, sizeof(e.addr), "%s", ep->addr);
    e.port = t->port;
    snprintf(e.device, sizeof(e.device), "%s", ep->dev->name);
    memcpy(e.gid, ep->gid, SX_GID_LEN);
    e.port_num = ep->port_num;
    e.mtu = ep->mtu;
    rc = sx_desc_add_endpoint(d, &e);
    if (rc)
      return rc;
  }
  for (uint32_t i = 0; i < d->n_regions; i++) {
    sx_region *r = &d->regions[i];
    sx_lregion *lr = ctx->find_region != NULL ? ctx->find_region(ctx->agent, r->id) : NULL;
    rdma_mr *rm = lr != NULL ? lr->tpriv[SX_TRANSPORT_RDMA] : NULL;
    if (rm == NULL && (lr == NULL || lr->mem.kind != SX__MEM_CUDA))
      return sx__err(SX_EINVAL, "region %u is not registered with RDMA", r->id);
    for (int k = 0; k < t->n_eps; k++)
      r->rkeys[base + (uint32_t)k] =
          rm && rm->mr[t->eps[k].dev->index] ? rm->mr[t->eps[k].dev->index]->rkey : 0;
    r->n_rkeys = base + (uint32_t)t->n_eps;
    /* The chosen NIC: the first endpoint (port) of its device. */
    r->nic = 0;
    for (int k = 0; rm != NULL && k < t->n_eps && r->nic == 0; k++)
      if (t->eps[k].dev->index == rm->nic)
        r->nic = base + (uint32_t)k + 1;
    /* Push: the write keys, usable only from producers' QPs (none for GPU
     * memory, which RDMA does not register). */
    int writable = rm != NULL && rm->wmr[0] != NULL;
    for (int k = 0; k < t->n_eps && writable; k++)
      r->wkeys[base + (uint32_t)k] = rm->wmr[t->eps[k].dev->index]->rkey;
    r->n_wkeys = writable ? r->n_rkeys : 0;
  }
  return 0;
}

/* How well a local port suits a remote endpoint: same kind of GID, same
 * IPv4 subnet (RoCE) or GID prefix (InfiniBand) scores higher.  Readers
 * pick a segment's default pair with it, and each further NIC pair's local
 * port (rdma_route.c). */
int sx__rdma_ep_score(const rdma_ep *l, const sx_endpoint *r) {
  int r_v4 = gid_v4mapped(r->gid);
  int l_v4 = gid_v4mapped(l->gid) || (l->has_ipv4 && l->link_layer != IBV_LINK_LAYER_INFINIBAND);
  if (l->link_layer == IBV_LINK_LAYER_INFINIBAND)
    return (!r_v4 && memcmp(r->gid, l->gid, 8) == 0) ? 4 : 1;
  if (r_v4 && l_v4) {
    struct in_addr ra;
    if (l->mask.s_addr != 0 && inet_pton(AF_INET, r->addr, &ra) == 1 &&
        (ra.s_addr & l->mask.s_addr) == (l->ipv4.s_addr & l->mask.s_addr))
      return 4;
    return 2;
  }
  return r_v4 == l_v4 ? 1 : 0;
}

/* Bytes of remote's regions whose owner chose each RDMA endpoint (by
 * ordinal).  Saturating: lengths come from the store. */
static void remote_nic_bytes(const sx_desc *remote, uint64_t want[SX_MAX_DEVICES]) {
  memset(want, 0, SX_MAX_DEVICES * sizeof(uint64_t));
  for (uint32_t i = 0; i < remote->n_regions; i++) {
    const sx_region *r = &remote->regions[i];
    if (r->nic == 0 || r->nic > SX_MAX_DEVICES)
      continue;
    uint64_t *w = &want[r->nic - 1];
    *w = r->length > UINT64_MAX - *w ? UINT64_MAX : *w + r->length;
  }
}

/* The endpoint pair for a peer: the best-suited pair of ports (ep_score);
 * among equals, the remote endpoint that most of the segment's bytes were
 * placed on by their owner (its NIC choice), then the local port whose
 * device holds most of this agent's own regions, so that a reader on one
 * GPU's NIC reads a target's GPU through that GPU's NIC. */
int sx__rdma_pick(sx_rdma *t, const sx_desc *remote, uint32_t *rkey_index, rdma_ep **lep) {
  int best = -1, best_score = -1;
  uint64_t want[SX_MAX_DEVICES], best_want = 0, best_mine = 0;
  uint32_t ordinal = 0;
  remote_nic_bytes(remote, want);
  for (uint32_t i = 0; i < remote->n_endpoints; i++) {
    const sx_endpoint *e = &remote->endpoints[i];
    if (e->kind != SX_TRANSPORT_RDMA)
      continue;
    uint64_t w = ordinal < SX_MAX_DEVICES ? want[ordinal] : 0;
    for (int k = 0; k < t->n_eps; k++) {
      int s = sx__rdma_ep_score(&t->eps[k], e);
      uint64_t mine = t->nic_bytes[t->eps[k].dev->index];
      if (s > best_score || (s == best_score && (w > best_want ||
                                                 (w == best_want && mine > best_mine)))) {
        best_score = s;
        best_want = w;
        best_mine = mine;
        best = (int)i;
        *rkey_index = ordinal;
        *lep = &t->eps[k];
      }
    }
    ordinal++;
  }
  return best;
}

int sx__rdma_usable(sx_transport *tt, const sx_desc *remote) {
  sx_rdma *t = (sx_rdma *)tt;
  return t->n_eps > 0 && sx_desc_rdma_devices(remote) > 0 && sx__rdma_gpu_usable(t, remote);
}
