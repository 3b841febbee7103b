/*
 * The cuda_ipc transport (see cuda_ipc.h): a reader on the same host as the
 * target maps the target's CUDA allocations once per target incarnation
 * (cuIpcOpenMemHandle, through the memory layer) and runs each batch as
 * device-to-device copies, spread over a few streams per device, each
 * stream's copies followed by one completion notice (no polling).  The
 * handles come from the control connection (ipc_conn.c).
 *
 * Push mode is the same in the other direction: a write peer copies from
 * local memory into the mapping of a consumer's writable allocation (whose
 * handle the consumer lends only to a producer it granted writes), and
 * once every copy of the batch has completed (the completion notices run
 * only after the copies ended on the device) sends the batch's notice on
 * the control connection.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "ipc_int.h"

/* ------------------------------------------------------------ mappings */

static void map_close(ipc_map *m) {
  sx__mem_ipc_close(m->device, m->ptr);
  free(m);
}

static int map_busy(const ipc_peer *p, const ipc_map *m);

/* Close the mappings no READY region and no running copy uses (all when
 * all is set: nothing runs then). */
static void unmap(ipc_peer *p, int all) {
  for (ipc_map **pp = &p->maps; *pp;) {
    ipc_map *m = *pp;
    int used = !all && map_busy(p, m);
    for (uint32_t i = 0; i < p->n_regs && !all && !used; i++)
      used = p->regs[i].state == R_READY && p->regs[i].rec.base == m->base;
    if (used) {
      pp = &m->next;
      continue;
    }
    for (uint32_t i = 0; i < p->n_regs; i++)
      if (p->regs[i].map == m)
        p->regs[i].map = NULL;
    *pp = m->next;
    map_close(m);
  }
}

/* The mapping of region r's allocation into device.  The region must lie
 * inside what the handle really maps: the record's alloc is the target's
 * word, and a copy past the mapping would reach our own device memory. */
static int map_get(ipc_peer *p, ipc_reg *r, int device, ipc_map **out) {
  if (r->map != NULL && r->map->device == device) {
    *out = r->map;
    return 0;
  }
  ipc_map *m;
  for (m = p->maps; m != NULL; m = m->next)
    if (m->base == r->rec.base && m->device == device)
      break;
  if (m == NULL) {
    if ((m = calloc(1, sizeof(*m))) == NULL)
      return sx__err(SX_ENOMEM, "cuda_ipc: mapping");
    int rc = sx__mem_ipc_open(device, r->rec.handle, (void **)&m->ptr, &m->size);
    if (rc) {
      free(m);
      return sx__errwrap(rc, "%s: mapping region %u into cuda:%d", p->label,
                         r->rec.region, device);
    }
    m->base = r->rec.base;
    m->device = device;
    m->next = p->maps;
    p->maps = m;
  }
  uint64_t end;
  if (!sx__add_ok(r->rec.offset, r->length, &end) || end > m->size)
    return sx__err(SX_EBOUNDS, "%s: region %u (%lu bytes at offset %lu) lies outside the "
                   "%lu bytes its CUDA IPC handle maps", p->label, r->id,
                   (unsigned long)r->length, (unsigned long)r->rec.offset,
                   (unsigned long)m->size);
  r->map = m;
  *out = m;
  return 0;
}

/* ------------------------------------------------------------ regions */

static void reg_init(ipc_reg *r, const sx_region *R) {
  *r = (ipc_reg){.id = R->id, .addr = R->addr, .length = R->length};
}

uint32_t sx__ipc_reg_find(const ipc_peer *p, uint32_t id) {
  uint32_t i = 0;
  while (i < p->n_regs && p->regs[i].id != id)
    i++;
  return i;
}

/* The index in p->regs of region R of a batch's descriptor.  That is
 * p->remote itself, the usual case: R's place in it.  A segment opened
 * later may hold a newer descriptor of the same incarnation (a region
 * registered or withdrawn since), which shares this peer: its regions are
 * found by id, and one the peer never knew is added. */
static int reg_index(ipc_peer *p, const sx_region *R, uint32_t *out) {
  uintptr_t a = (uintptr_t)R, lo = (uintptr_t)p->remote->regions;
  if (a >= lo && a < lo + (uintptr_t)p->remote->n_regions * sizeof(sx_region)) {
    *out = (uint32_t)((a - lo) / sizeof(sx_region));
    return 0;
  }
  uint32_t i = sx__ipc_reg_find(p, R->id);
  if (i < p->n_regs) {
    /* An id names one region for the whole incarnation. */
    if (p->regs[i].addr != R->addr || p->regs[i].length != R->length)
      return sx__err(SX_EPROTO, "%s: region %u changed place within one incarnation "
                     "(descriptors disagree); reopen the segment", p->label, R->id);
    *out = i;
    return 0;
  }
  if (p->n_regs == p->cap_regs) {
    if (p->cap_regs >= SX__IPC_MAX_REGS)
      return sx__err(SX_ELIMIT, "%s: more than %u regions seen over this incarnation's "
                     "descriptors; reopen the segment", p->label, SX__IPC_MAX_REGS);
    uint32_t cap = p->cap_regs * 2 < SX__IPC_MAX_REGS ? p->cap_regs * 2 : SX__IPC_MAX_REGS;
    ipc_reg *g = realloc(p->regs, cap * sizeof(ipc_reg));
    if (g == NULL)
      return sx__err(SX_ENOMEM, "cuda_ipc: regions");
    p->regs = g;
    p->cap_regs = cap;
  }
  reg_init(&p->regs[p->n_regs], R);
  *out = p->n_regs++;
  return 0;
}

/* ------------------------------------------------------------ ops */

static void list_del(iop **head, iop *o) {
  if (o->prev)
    o->prev->next = o->next;
  else
    *head = o->next;
  if (o->next)
    o->next->prev = o->prev;
  o->next = o->prev = NULL;
}

static void list_add(iop **head, iop *o) {
  o->prev = NULL;
  o->next = *head;
  if (o->next)
    o->next->prev = o;
  *head = o;
}

/* An op of n ranges: one kept from an earlier op when there is one (the
 * loop posts tens of thousands a second, each with two arrays), else new. */
static iop *iop_new(cipc_t *t, size_t n) {
  iop *o = t->spare;
  if (o != NULL) {
    t->spare = o->next;
    t->n_spare--;
  } else if ((o = calloc(1, sizeof(*o))) == NULL) {
    return NULL;
  }
  if (o->cap < n) {
    free(o->slot);
    free(o->ri);
    free(o->rg);
    o->slot = malloc(n);
    o->ri = malloc(n * sizeof(uint32_t));
    o->rg = malloc(2 * n * sizeof(sx__mem_range));
    o->cap = n;
    if (o->slot == NULL || o->ri == NULL || o->rg == NULL) {
      free(o->slot);
      free(o->ri);
      free(o->rg);
      free(o);
      return NULL;
    }
  }
  /* Everything else starts from zero, as calloc gave it the first time. */
  *o = (iop){.t = t, .slot = o->slot, .ri = o->ri, .rg = o->rg, .cap = o->cap,
             .srg = o->srg, .scap = o->scap};
  return o;
}

/* Room in o->srg for ns strided ranges (and their per-stream copies). */
static int iop_strided(iop *o, size_t ns) {
  if (o->scap >= ns)
    return 0;
  free(o->srg);
  o->scap = 0;
  if ((o->srg = malloc(2 * ns * sizeof(sx__mem_strided))) == NULL)
    return SX_ENOMEM;
  o->scap = ns;
  return 0;
}

static void iop_destroy(iop *o) {
  free(o->srg);
  free(o->slot);
  free(o->ri);
  free(o->rg);
  free(o);
}

static void iop_free(iop *o) {
  cipc_t *t = o->t;
  if (t->n_spare >= IPC_SPARE_OPS || o->cap > IPC_SPARE_RANGES || o->scap > IPC_SPARE_RANGES) {
    iop_destroy(o);
    return;
  }
  o->next = t->spare;
  t->spare = o;
  t->n_spare++;
}

/* Does a copy still running read or write through mapping m? */
static int map_busy(const ipc_peer *p, const ipc_map *m) {
  for (const iop *o = p->running; o != NULL; o = o->next) {
    /* A table op reads every region it names until it ends. */
    for (uint32_t j = 0; o->op->tab != NULL && j < o->op->n_rregs; j++)
      if (p->regs[o->rix[j]].rec.base == m->base)
        return 1;
    for (size_t i = 0; i < o->op->n; i++)
      if (o->slot[i] != 0xff && o->op->xfers[i].status == 1 &&
          p->regs[o->ri[i]].rec.base == m->base)
        return 1;
  }
  return 0;
}

/* Does a copy still running use region id? */
static int region_busy(const ipc_peer *p, uint32_t id) {
  for (const iop *o = p->running; o != NULL; o = o->next) {
    for (uint32_t j = 0; o->op->tab != NULL && j < o->op->n_rregs; j++)
      if (o->op->rregs[j]->id == id)
        return 1;
    for (size_t i = 0; i < o->op->n; i++)
      if (o->slot[i] != 0xff && o->op->xfers[i].status == 1 && o->op->xfers[i].rreg->id == id)
        return 1;
  }
  return 0;
}

/* Give back what the target asked for once no copy uses it (its mapping
 * closed first, unless a region still held needs it), and drop the
 * mappings a lost connection left once nothing runs. */
static void settle_peer(ipc_peer *p) {
  if (p->unmap_all && p->running == NULL) {
    unmap(p, 1);
    p->unmap_all = 0;
  }
  uint32_t n = 0;
  for (uint32_t k = 0; k < p->n_give; k++)
    if (!region_busy(p, p->give[k]))
      n++;
  if (n > 0) {
    uint32_t *ids = malloc(n * sizeof(uint32_t)), m = 0;
    if (ids != NULL) {
      for (uint32_t k = 0; k < p->n_give;) {
        if (region_busy(p, p->give[k])) {
          k++;
          continue;
        }
        ids[m++] = p->give[k];
        p->give[k] = p->give[--p->n_give];
      }
      unmap(p, 0);
      if (p->state == C_READY)
        sx__ipc_conn_send(p, 0, ids, m);
      free(ids);
    }
  }
  sx__ipc_peer_maybe_free(p);
}

/* The copies of one stream finished. */
static void slot_done(sx__mem_notice *n) {
  iop_slot *s = (iop_slot *)((char *)n - offsetof(iop_slot, note));
  iop *o = s->o;
  ipc_peer *p = o->p;
  unsigned k = (unsigned)(s - o->slots);
  if (o->status == 0 && n->status != 0) {
    /* A launch before it failed on the launcher's thread. */
    o->status = n->status;
    if (p != NULL) {
      char msg[256];
      snprintf(msg, sizeof(msg), "%s: launching the gather kernel (launcher thread): %s",
               p->label, sx_strerror(n->status));
      sx__op_error(o->op, n->status, msg);
    }
  }
  int st = o->status;
  o->slots_left--;
  if (p != NULL) /* the peer's streams live while it does */
    sx__mem_stream_passed(s->s, n);
  if (p != NULL && o->one) {
    /* Every range of the op was on this stream: one pass, one done. */
    s->left = 0;
    sx__op_xfers_done(o->op, st, NULL); /* done may run: o->op last used here */
  } else if (p != NULL) {
    for (size_t i = 0; i < o->op->n && s->left > 0; i++) {
      if (o->slot[i] != k)
        continue;
      s->left--;
      sx__op_xfer_done(o->op, i, st, NULL); /* done may run: o->op last used here */
    }
  }
  if (o->slots_left > 0)
    return;
  if (p != NULL)
    list_del(&p->running, o);
  iop_free(o);
  if (p != NULL)
    settle_peer(p);
}

/* The device of the local side (a read's destination, a write's source);
 * host memory is copied by device 0's context. */
static int local_device(const sx_xfer *x) {
  sx__mem_info m;
  if (x->lreg != NULL)
    m = x->lreg->mem;
  else
    sx__mem_query(x->local, &m);
  return m.kind == SX__MEM_CUDA ? m.device : -1;
}

/* The stream for a range of an op on device: all of the op's ranges on
 * one stream (one gather launch), ops taking the streams in turn; when
 * copies are forced onto the copy engines, ranges take them in turn. */
static int stream_for(cipc_t *t, int device, unsigned pick, sx__mem_stream **out) {
  if (device < 0 || device >= IPC_MAX_DEVICES)
    return sx__err(SX_ENODEV, "cuda_ipc: device %d", device);
  if (t->spread)
    pick = t->rr[device]++;
  sx__mem_stream **s = &t->streams[device][pick % IPC_STREAMS];
  if (*s == NULL) {
    int rc = sx__mem_stream_create_on(device, t->launcher, s);
    if (rc)
      return rc;
  }
  *out = *s;
  return 0;
}

/* Why region R cannot be copied (r refused with rc). */
static void refused_msg(const ipc_peer *p, const ipc_reg *r, const sx_region *R, int rc,
                        char *msg, size_t cap) {
  if (r->gated && p->write)
    snprintf(msg, cap, "%.96s refused our writes of region %u: no write grant covers this "
             "producer, or it is not published as this incarnation", p->label, R->id);
  else if (r->gated)
    snprintf(msg, cap, "%.96s: region %u shares a CUDA allocation with writable memory, "
             "whose IPC handle goes only to granted producers (docs/security.md): read it "
             "over tcp", p->label, R->id);
  else
    snprintf(msg, cap, "%s: region %u: %s", p->label, R->id,
             rc == SX_ENOTSUP && strncmp(R->location, "cuda:", 5) != 0
                 ? "host memory goes over tcp, not cuda_ipc"
                 : sx_strerror(rc));
}

static uint64_t table_ops; /* atomic: table ops run (sx__ipc_table_ops) */

/* Does the launcher's thread make an op's driver calls?  While other reads
 * are in flight (the loop is busy: it plans this one meanwhile); alone,
 * the loop makes them itself, sparing a read the hand-over
 * (SX_GPU_LAUNCHER). */
static int launch_deferred(const cipc_t *t) {
  return t->launch_mode == 1 ||
         (t->launch_mode == 2 && sx__mem_notifier_pending(t->nf) > 0);
}

/* Log the first gather by each copy method: n of what, into mem (and why
 * not the kernel, where it was not). */
static void say_method(cipc_t *t, sx__mem_copy_method used, int device, size_t n,
                       const char *what, const char *mem) {
  if (t->said & 1u << used)
    return;
  t->said |= 1u << used;
  const char *why = used == SX__COPY_KERNEL ? NULL : sx__mem_kernel_error(device);
  t->base.ctx->log(t->base.ctx->agent, SX_LOG_INFO, "cuda_ipc: copies by %s (first used "
                   "for %zu %s, %s%s%s)", sx__mem_copy_name(used), n, what, mem,
                   why ? "; " : "", why ? why : "");
}

uint64_t sx__ipc_table_ops(void) {
  return __atomic_load_n(&table_ops, __ATOMIC_RELAXED) + sx__ipc_direct_reads();
}

/* The copies of a table op: one based gather over the table the batch's
 * thread wrote (sx_op.tab), each of its regions' mapping into the
 * destinations' device as a base: nothing here is per range.  Where the
 * kernel does not run (SX_GPU_COPY=batch|range, or it does not load), the
 * table is read into ranges for sx__mem_gather.  A region that cannot be
 * read fails the whole op. */
static void run_table(ipc_peer *p, iop *o) {
  __atomic_add_fetch(&table_ops, 1, __ATOMIC_RELAXED);
  cipc_t *t = p->t;
  sx_op *op = o->op;
  char msg[256] = "";
  int rc = 0, dev = op->tab_device;
  list_add(&p->running, o);
  o->one = 1;
  o->slots_left = 1; /* held while queueing */
  uint64_t bases[SX__GATHER_BASES];
  for (uint32_t j = 0; j < op->n_rregs && rc == 0; j++) {
    ipc_reg *r = &p->regs[o->rix[j]];
    ipc_map *m = NULL;
    if (r->state != R_READY) {
      rc = r->err ? r->err : SX_EIO;
      refused_msg(p, r, op->rregs[j], rc, msg, sizeof(msg));
    } else if ((rc = map_get(p, r, dev, &m)) != 0) {
      snprintf(msg, sizeof(msg), "%s", sx_errmsg());
    } else {
      bases[j] = (uint64_t)(uintptr_t)(m->ptr + r->rec.offset);
    }
  }
  sx__mem_stream *s = NULL;
  if (rc == 0 && (rc = stream_for(t, dev, t->rr_op++, &s)) != 0)
    snprintf(msg, sizeof(msg), "%s", sx_errmsg());
  if (rc == 0) {
    o->n_slots = 1;
    o->slots[0] = (iop_slot){.o = o, .s = s, .left = 1};
    sx__mem_stream_defer(s, launch_deferred(t));
    sx__mem_copy_method used = SX__COPY_KERNEL;
    if (t->method == SX__COPY_AUTO || t->method == SX__COPY_KERNEL)
      rc = sx__mem_gather_based(s, op->tab, op->n_tab, bases, op->n_rregs);
    if (rc == SX_ENOTSUP || (t->method != SX__COPY_AUTO && t->method != SX__COPY_KERNEL)) {
      /* The kernel is not for it: the table's pieces as ranges. */
      sx__mem_range *rg = malloc(op->n_tab * sizeof(*rg));
      rc = rg == NULL ? sx__err(SX_ENOMEM, "cuda_ipc: ranges of a table") : 0;
      for (size_t i = 0; rc == 0 && i < op->n_tab; i++)
        rg[i] = (sx__mem_range){op->tab[i].dst, bases[op->tab[i].region] + op->tab[i].src,
                                op->tab[i].len};
      if (rc == 0)
        rc = sx__mem_gather(s, rg, op->n_tab, SX__GATHER_ENV_READ | SX__GATHER_SM_OK,
                            t->method, &used);
      free(rg);
    }
    if (rc == 0)
      say_method(t, used, dev, op->n_tab, "table pieces", "device memory");
    if (rc == 0 && used == SX__COPY_KERNEL)
      sx__ipc_lane_publish(p, o, bases); /* the caller's thread may run the next */
    /* Copies of it may have been queued: the notice still comes behind
     * them and settles the op with the error. */
    if (rc != 0) {
      snprintf(msg, sizeof(msg), "%s", sx_errmsg());
      o->status = rc;
    }
    o->slots[0].note.fn = slot_done;
    o->slots_left++;
    if (sx__mem_notify(s, t->nf, &o->slots[0].note) != 0) {
      sx__mem_stream_sync(s);
      slot_done(&o->slots[0].note);
    }
  }
  if (rc != 0) {
    char what[sizeof(msg) + 160];
    snprintf(what, sizeof(what), "%s: %s", p->label, msg);
    if (o->status == 0)
      o->status = rc;
    sx__op_error(op, rc, what);
  }
  if (--o->slots_left == 0) {
    /* Nothing was queued (or the notice already ran): settle now. */
    if (op->pending > 0)
      sx__op_xfers_done(op, o->status, NULL);
    list_del(&p->running, o);
    iop_free(o);
    settle_peer(p);
  }
}

/* How many ranges ahead run() asks for (a range is one cache line). */
#define RUN_AHEAD 16

/* Every region o needs is known: queue its copies.  Ranges that cannot
 * be copied settle with their error after the others were queued.  One
 * pass over the ranges finds each one's mapping and stream and writes its
 * copy; an op on one stream (the usual case: all of an op's ranges share
 * one unless copies are spread) hands that table to the gather as it is. */
static void run(ipc_peer *p, iop *o) {
  if (o->op->tab != NULL) {
    run_table(p, o);
    return;
  }
  cipc_t *t = p->t;
  sx_op *op = o->op;
  char msg[256] = "";
  int err = 0;
  size_t n_failed = 0;
  unsigned pick = t->rr_op++;
  list_add(&p->running, o);
  o->slots_left = 1; /* held while queueing */
  /* Consecutive ranges of one region into one local region share the
   * mapping and the stream: looked up once for the run of them. */
  const ipc_reg *last = NULL;
  const sx_lregion *last_l = NULL;
  unsigned last_k = 0;
  uint64_t last_base = 0;
  size_t js = 0; /* strided ranges written */
  const sx_region *late_R = NULL; /* ri_late: the region of the range before */
  uint32_t late_ri = 0;
  for (size_t i = 0; i < op->n; i++) {
    sx_xfer *x = &op->xfers[i];
    /* The caller's thread wrote the ranges on its core: ask for lines
     * ahead, so that several come at once rather than one per range. */
    if (i + RUN_AHEAD < op->n)
      __builtin_prefetch(&op->xfers[i + RUN_AHEAD]);
    if (o->ri_late) {
      if (x->rreg != late_R) {
        uint32_t j = 0;
        while (j < op->n_rregs && op->rregs[j] != x->rreg)
          j++;
        late_R = x->rreg;
        late_ri = j < op->n_rregs ? o->rix[j] : UINT32_MAX;
      }
      o->ri[i] = late_ri;
    }
    ipc_reg *r = o->ri[i] < p->n_regs ? &p->regs[o->ri[i]] : NULL;
    unsigned k = 0;
    int rc = 0;
    if (r != NULL && r == last && x->lreg == last_l) {
      k = last_k;
    } else if (r == NULL) {
      rc = sx__err(SX_EPROTO, "cuda_ipc: a range reads region %u, which its batch's plan "
                   "did not list (a bug)", x->rreg->id);
    } else {
      rc = r->state == R_READY ? 0 : r->err;
      int dev = local_device(x);
      ipc_map *m = NULL;
      sx__mem_stream *s = NULL;
      last = NULL;
      /* Host destinations are copied by the stream of device 0's context. */
      if (rc == 0 && (rc = map_get(p, r, dev < 0 ? 0 : dev, &m)) == 0)
        rc = stream_for(t, m->device, pick, &s);
      if (rc == 0) {
        for (k = 0; k < o->n_slots && o->slots[k].s != s; k++) {
        }
        if (k == o->n_slots && o->n_slots == IPC_SLOTS)
          rc = sx__err(SX_ELIMIT, "cuda_ipc: one batch uses more than %d streams",
                       IPC_SLOTS);
        else if (k == o->n_slots)
          o->slots[o->n_slots++] = (iop_slot){.o = o, .s = s};
      }
      if (rc == 0) {
        o->slots[k].host |= dev < 0;
        last_base = (uint64_t)(uintptr_t)(m->ptr + r->rec.offset);
        /* Spread copies take a stream per range: nothing to share. */
        if (!t->spread && x->lreg != NULL) {
          last = r;
          last_l = x->lreg;
          last_k = k;
        }
      }
    }
    if (rc != 0) {
      o->slot[i] = 0xff;
      n_failed++;
      if (x->shape == SX__XFER_STRIDED)
        o->srg[js++] = (sx__mem_strided){0}; /* keeps srg in op order */
      if (err == 0) {
        err = rc;
        if (r != NULL && r->state != R_READY)
          refused_msg(p, r, x->rreg, rc, msg, sizeof(msg));
        else
          snprintf(msg, sizeof(msg), "%s", sx_errmsg());
      }
      continue;
    }
    o->slot[i] = (uint8_t)k;
    o->slots[k].left++;
    uint64_t remote = last_base + x->roff, local = (uint64_t)(uintptr_t)x->local;
    if (x->shape == SX__XFER_STRIDED) {
      /* Its pieces are one copy of the strided kind: one table entry per
       * 64 KiB of them for the kernel. */
      uint64_t rs = x->st.rstride, ls = x->st.lstride, len = x->length / x->n_iov;
      o->srg[js++] = p->write ? (sx__mem_strided){remote, local, len, x->n_iov, rs, ls}
                              : (sx__mem_strided){local, remote, len, x->n_iov, ls, rs};
      continue;
    }
    o->rg[i] = p->write ? (sx__mem_range){.dst = remote, .src = local, .len = x->length}
                        : (sx__mem_range){.dst = local, .src = remote, .len = x->length};
  }
  o->one = o->n_slots == 1 && n_failed == 0 && o->n_strided == 0;
  int defer = launch_deferred(t);
  /* Each stream's copies in one call (the gather kernel, or the copy
   * engines: sx__mem_gather chooses), then one notice behind them. */
  for (unsigned k = 0; k < o->n_slots; k++) {
    sx__mem_stream_defer(o->slots[k].s, defer);
    const sx__mem_range *rg = o->rg;
    size_t c = op->n, cs = 0;
    sx__mem_strided *spart = o->n_strided ? o->srg + o->n_strided : NULL;
    if (!o->one) {
      sx__mem_range *part = o->rg + op->n;
      c = 0;
      for (size_t i = 0, j = 0; i < op->n; i++) {
        int strided = op->xfers[i].shape == SX__XFER_STRIDED;
        if (o->slot[i] == k && strided)
          spart[cs++] = o->srg[j];
        else if (o->slot[i] == k)
          part[c++] = o->rg[i];
        j += strided;
      }
      rg = part;
    }
    /* Pageable host memory is for the copy engines only. */
    sx__mem_copy_method used = SX__COPY_AUTO;
    unsigned flags = SX__GATHER_ENV_READ | (o->slots[k].host ? 0 : SX__GATHER_SM_OK);
    /* Plain ranges and strided ones are two gathers on the stream, both
     * before its notice. */
    int rc = c > 0 ? sx__mem_gather(o->slots[k].s, rg, c, flags, t->method, &used) : 0;
    if (rc == 0 && cs > 0)
      rc = sx__mem_gather_strided(o->slots[k].s, spart, cs, flags, t->method, &used);
    if (rc == 0)
      say_method(t, used, sx__mem_stream_device(o->slots[k].s), c, "ranges",
                 o->slots[k].host ? "host memory on our side" : "device memory");
    if (rc != 0) {
      /* Copies of it may have been queued: they end before the notice,
       * which settles the stream's ranges with this error and message. */
      if (err == 0) {
        err = rc;
        snprintf(msg, sizeof(msg), "%s", sx_errmsg());
      }
      if (o->status == 0)
        o->status = rc;
      char what[sizeof(msg) + 128];
      snprintf(what, sizeof(what), "%s: %s", p->label, msg);
      sx__op_error(op, rc, what);
    }
  }
  /* One notice per stream used, behind its copies. */
  for (unsigned k = 0; k < o->n_slots; k++) {
    if (o->slots[k].left == 0)
      continue;
    o->slots[k].note.fn = slot_done;
    o->slots_left++;
    if (sx__mem_notify(o->slots[k].s, t->nf, &o->slots[k].note) != 0) {
      /* Cannot be told: wait here (copies must end before they settle). */
      sx__mem_stream_sync(o->slots[k].s);
      slot_done(&o->slots[k].note);
    }
  }
  /* Ranges not copied settle now (the op ends with its last range). */
  for (size_t i = 0; i < op->n && n_failed > 0 && op->pending > 0; i++)
    if (o->slot[i] == 0xff && op->xfers[i].status == 1)
      sx__op_xfer_done(op, i, o->status ? o->status : err ? err : SX_EIO, msg);
  o->slots_left--;
  if (o->slots_left == 0) {
    list_del(&p->running, o);
    iop_free(o);
    settle_peer(p);
  }
}

/* Run the waiting ops whose regions are all known now. */
static void run_ready(ipc_peer *p) {
  for (iop *o = p->waiting, *next; o != NULL; o = next) {
    next = o->next;
    int ready = 1;
    for (size_t i = 0; i < iop_n_regs(o) && ready; i++) {
      int st = p->regs[iop_reg(o, i)].state;
      ready = st == R_READY || st == R_FAILED;
    }
    if (ready) {
      list_del(&p->waiting, o);
      run(p, o);
    }
  }
  if (p->waiting != NULL)
    sx__ipc_conn_kick(p);
}

static void fail_waiting(ipc_peer *p, int err, const char *msg) {
  while (p->waiting != NULL) {
    iop *o = p->waiting;
    list_del(&p->waiting, o);
    sx_op *op = o->op;
    int st = o->status ? o->status : err;
    iop_free(o);
    sx__op_xfers_done(op, st, msg);
  }
}

/* ------------------------------------------------------------ from ipc_conn.c */

void sx__ipc_records(ipc_peer *p, const uint8_t *body, size_t len) {
  for (size_t off = 0; off + SX__IPC_RECORD <= len; off += SX__IPC_RECORD) {
    sx__ipc_record rec;
    sx__ipc_record_decode(body + off, &rec);
    uint32_t i = sx__ipc_reg_find(p, rec.region);
    if (i == p->n_regs)
      continue; /* not asked: ignore */
    ipc_reg *r = &p->regs[i];
    if (r->state != R_ASKED)
      continue;
    uint64_t end;
    int st = rec.status < 0 && rec.status >= SX_ERRNO_MIN ? rec.status
           : rec.status != 0 ? SX_EPROTO : 0;
    /* Nothing from the wire is trusted: the region must lie inside the
     * allocation, where the descriptor says it is. */
    if (st == 0 && (!sx__add_ok(rec.offset, r->length, &end) || end > rec.alloc ||
                    rec.base + rec.offset != r->addr))
      st = SX_EBOUNDS;
    /* No write grant covers us: a write is refused (SX_EACCESS); for a
     * read, the region is simply not lent this way (SX_EDENIED). */
    r->gated = st == SX_EACCESS;
    if (r->gated && !p->write)
      st = SX_EDENIED;
    r->rec = rec;
    r->err = st;
    r->state = st ? R_FAILED : R_READY;
  }
  run_ready(p);
}

static void notes_fail(ipc_peer *p, int err, const char *msg) {
  while (p->notes != NULL) {
    ipc_note *nt = p->notes;
    p->notes = nt->next;
    sx_op *op = nt->op;
    free(nt);
    op->noticed(op, err, msg);
  }
}

void sx__ipc_noticed(ipc_peer *p, uint64_t id, int status) {
  ipc_note **pp = &p->notes;
  while (*pp != NULL && (*pp)->id != id)
    pp = &(*pp)->next;
  ipc_note *nt = *pp;
  if (nt == NULL)
    return; /* its batch was aborted meanwhile */
  *pp = nt->next;
  sx_op *op = nt->op;
  free(nt);
  char msg[256];
  int err = status >= SX_ERRNO_MIN ? status : SX_EPROTO;
  if (status != 0)
    snprintf(msg, sizeof(msg), "%s refused the batch's notice: %s", p->label,
             err == SX_EACCESS ? "no write grant covers this producer (any more)"
                               : sx_strerror(err));
  op->noticed(op, status ? err : 0, status ? msg : NULL);
}

int sx__ipc_revoked(ipc_peer *p, const uint8_t *ids, size_t len) {
  /* The target names what it asks back; only regions we know can be
   * lent, and each is given back once: unknown and repeated ids are
   * dropped, so the list stays within n_regs however many frames come
   * while a copy keeps a region busy. */
  if (p->cap_give < p->n_regs) {
    uint32_t *g = realloc(p->give, p->n_regs * sizeof(uint32_t));
    if (g == NULL)
      return SX_ENOMEM;
    p->give = g;
    p->cap_give = p->n_regs;
  }
  size_t n = len / 4;
  /* Direct reads stop using every mapping (and those in flight end) first;
   * the next table op the loop runs publishes the ones still lent. */
  sx__ipc_lane_withdraw(p, 0, NULL);
  for (size_t k = 0; k < n; k++) {
    const uint8_t *b = ids + 4 * k;
    uint32_t id = (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
    uint32_t i = sx__ipc_reg_find(p, id), g = 0;
    if (i == p->n_regs)
      continue;
    p->regs[i].state = R_NONE; /* asked again if needed: then refused */
    p->regs[i].map = NULL;
    while (g < p->n_give && p->give[g] != id)
      g++;
    if (g == p->n_give)
      p->give[p->n_give++] = id;
  }
  settle_peer(p);
  return 0;
}

void sx__ipc_lost(ipc_peer *p, int err, const char *msg) {
  /* Copies in flight finish (the mapping keeps the memory), but the target
   * may have been writing it as it went: those ranges fail too, direct
   * reads included. */
  sx__ipc_lane_withdraw(p, err, msg);
  for (iop *o = p->running; o != NULL; o = o->next)
    if (o->status == 0)
      o->status = err;
  for (uint32_t i = 0; i < p->n_regs; i++) {
    p->regs[i].state = R_NONE;
    p->regs[i].map = NULL;
  }
  p->n_give = 0;
  p->unmap_all = 1;
  fail_waiting(p, err, msg);
  notes_fail(p, err, msg);
  settle_peer(p);
}

/* ------------------------------------------------------------ ops table */

/* Region R of an op being posted: its index in p->regs into *idx; *ready
 * cleared unless R is known (mapped, or failed).  A region refused for
 * want of a write grant is asked again (*again set); one in the target's
 * host memory fails now.  0, or the error of reg_index(). */
static int post_region(ipc_peer *p, const sx_region *R, uint32_t *idx, int *ready,
                       int *again) {
  int rc = reg_index(p, R, idx);
  if (rc != 0)
    return rc;
  ipc_reg *r = &p->regs[*idx];
  if (r->state == R_FAILED && r->gated) {
    r->state = R_NONE; /* a grant may have come since: ask again */
    *again = 1;
  }
  if (r->state == R_NONE && strncmp(R->location, "cuda:", 5) != 0) {
    r->state = R_FAILED; /* host memory of the target: not for cuda_ipc */
    r->err = SX_ENOTSUP;
  }
  *ready &= r->state == R_READY || r->state == R_FAILED;
  return 0;
}

static int ipc_post(sx_tpeer *tp, sx_op *op) {
  ipc_peer *p = (ipc_peer *)tp;
  if (p->closing)
    return sx__err(SX_ECANCELED, "%s: segment closed", p->label);
  if (op->tab != NULL && (p->write || op->n_rregs == 0))
    return sx__err(SX_EINVAL, "cuda_ipc: a table op must be a read that lists its regions "
                   "(a bug)");
  iop *o = iop_new(p->t, op->n);
  if (o == NULL)
    return sx__err(SX_ENOMEM, "cuda_ipc: post");
  o->p = p;
  o->op = op;
  int again = 0, ready = 1, rc = 0;
  if (op->n_rregs > 0) {
    /* The planner listed the op's regions: one look at each, not one per
     * range; run() then finds each range's index in the same pass that
     * writes its copy (a pass less over ranges another thread wrote). */
    for (uint32_t j = 0; j < op->n_rregs && rc == 0; j++)
      rc = post_region(p, op->rregs[j], &o->rix[j], &ready, &again);
    o->n_strided = op->n_strided;
    o->ri_late = rc == 0 && ready && p->waiting == NULL;
  }
  if (!o->ri_late && rc == 0 && op->tab == NULL) {
    /* Else each range's region, also for an op that waits (ask() and
     * run_ready() read ri). */
    const sx_region *last = NULL;
    ready = 1;
    o->n_strided = 0;
    for (size_t i = 0; i < op->n && rc == 0; i++) {
      const sx_region *R = op->xfers[i].rreg;
      o->n_strided += op->xfers[i].shape == SX__XFER_STRIDED;
      if (R == last) {
        o->ri[i] = o->ri[i - 1];
        continue; /* the same region as the range before: seen */
      }
      last = R;
      rc = post_region(p, R, &o->ri[i], &ready, &again);
    }
  }
  if (rc != 0) {
    iop_free(o);
    return rc;
  }
  if (o->n_strided > 0 && iop_strided(o, o->n_strided) != 0) {
    iop_free(o);
    return sx__err(SX_ENOMEM, "cuda_ipc: post");
  }
  /* Authorize again first (the target answers in order). */
  if (again && p->wauth_want && p->wauth < 0 && p->state == C_READY &&
      sx__ipc_conn_wauth(p) != 0)
    p->wauth = SX_EDISCONN;
  /* Every region known (the usual case, once mapped): run now, without
   * the waiting list and its second pass over the ranges. */
  if (ready && p->waiting == NULL) {
    run(p, o);
    return 0;
  }
  list_add(&p->waiting, o);
  run_ready(p);
  return 0;
}

static int ipc_notify(sx_tpeer *tp, sx_op *op, const uint8_t *buf, size_t len) {
  ipc_peer *p = (ipc_peer *)tp;
  if (p->closing)
    return sx__err(SX_ECANCELED, "%s: segment closed", p->label);
  if (p->state != C_READY)
    return sx__err(SX_EDISCONN, "%s: the connection was lost before the notice", p->label);
  ipc_note *nt = calloc(1, sizeof(*nt));
  if (nt == NULL)
    return sx__err(SX_ENOMEM, "cuda_ipc: notice");
  nt->op = op;
  nt->id = ++p->next_id;
  int rc = sx__ipc_conn_notice(p, nt->id, buf, len);
  if (rc != 0) {
    free(nt);
    return rc;
  }
  ipc_note **pp = &p->notes;
  while (*pp != NULL)
    pp = &(*pp)->next;
  *pp = nt;
  return 0;
}

static void ipc_abort(sx_tpeer *tp, sx_op *op, int status) {
  ipc_peer *p = (ipc_peer *)tp;
  for (ipc_note **pp = &p->notes; *pp != NULL; pp = &(*pp)->next) {
    if ((*pp)->op == op) {
      /* The notice is out: the consumer may still take it (every byte is
       * there), but this batch ends now. */
      ipc_note *nt = *pp;
      *pp = nt->next;
      free(nt);
      op->noticed(op, status, NULL);
      return;
    }
  }
  for (iop *o = p->running; o != NULL; o = o->next)
    if (o->op == op && o->status == 0)
      o->status = status; /* settles when its copies finished */
  for (iop *o = p->waiting; o != NULL; o = o->next) {
    if (o->op == op) {
      list_del(&p->waiting, o);
      iop_free(o);
      sx__op_xfers_done(op, status, NULL);
      return;
    }
  }
}

static int ipc_peer_open(sx_transport *base, const sx_desc *remote, sx_tpeer **out) {
  cipc_t *t = (cipc_t *)base;
  ipc_peer *p = calloc(1, sizeof(*p));
  if (p == NULL || (p->regs = calloc(remote->n_regions + 1, sizeof(ipc_reg))) == NULL) {
    free(p);
    return sx__err(SX_ENOMEM, "cuda_ipc: peer");
  }
  p->base.t = base;
  p->t = t;
  p->remote = remote;
  p->n_regs = remote->n_regions;
  p->cap_regs = remote->n_regions + 1;
  for (uint32_t i = 0; i < remote->n_regions; i++)
    reg_init(&p->regs[i], &remote->regions[i]);
  const char *name = base->ctx->name;
  for (uint32_t i = 0; i < remote->n_regions && name != NULL && name[0]; i++)
    p->wauth_want |= (remote->regions[i].access & SX_ACCESS_REMOTE_WRITE) != 0;
  int rc = sx__ipc_conn_init(p);
  if (rc) {
    free(p->regs);
    free(p);
    return rc;
  }
  p->next = t->peers;
  if (p->next)
    p->next->prev = p;
  t->peers = p;
  *out = &p->base;
  return 0;
}

void sx__ipc_peer_maybe_free(ipc_peer *p) {
  if (!p->closing || p->handles > 0 || p->running != NULL)
    return;
  free(p->regs);
  free(p->give);
  free(p->rb);
  free(p);
}

static void ipc_peer_close(sx_tpeer *tp) {
  ipc_peer *p = (ipc_peer *)tp;
  if (p->closing)
    return;
  p->closing = 1;
  cipc_t *t = p->t;
  if (p->prev)
    p->prev->next = p->next;
  else
    t->peers = p->next;
  if (p->next)
    p->next->prev = p->prev;
  char msg[256];
  snprintf(msg, sizeof(msg), "%s: segment closed", p->label);
  fail_waiting(p, SX_ECANCELED, msg);
  notes_fail(p, SX_ECANCELED, msg);
  sx__ipc_lane_close(p, msg);
  /* Copies in flight end first (briefly blocking the loop): then their
   * ranges settle, the mappings close, and the peer goes. */
  for (int d = 0; d < IPC_MAX_DEVICES; d++)
    for (int k = 0; k < IPC_STREAMS; k++)
      if (t->streams[d][k] != NULL)
        sx__mem_stream_sync(t->streams[d][k]);
  for (iop *o = p->running; o != NULL; o = o->next) {
    if (o->status == 0)
      o->status = SX_ECANCELED;
    o->p = NULL; /* its notices only free it now */
    sx__op_xfers_done(o->op, o->status, msg);
  }
  p->running = NULL;
  unmap(p, 1);
  p->remote = NULL; /* the agent frees it after this returns */
  sx__ipc_conn_close(p);
  sx__ipc_peer_maybe_free(p);
}

static int ipc_wpeer_open(sx_transport *base, const sx_desc *remote, sx_tpeer **out) {
  int rc = ipc_peer_open(base, remote, out);
  if (rc == 0)
    ((ipc_peer *)*out)->write = 1;
  return rc;
}

/* ------------------------------------------------------------ transport */

static int ipc_open(const sx_tctx *ctx, sx_transport **out) {
  int n;
  int rc = sx__mem_cuda_devices(&n);
  if (rc)
    return sx__err(SX_ENODEV, "%s", sx_errmsg()); /* no GPU: the agent goes on */
  cipc_t *t = calloc(1, sizeof(*t));
  if (t == NULL)
    return sx__err(SX_ENOMEM, "cuda_ipc: open");
  if ((rc = sx__mem_notifier_create(ctx->loop, &t->nf)) != 0) {
    free(t);
    return rc;
  }
  t->base.ops = &sx__cuda_ipc_ops;
  t->base.ctx = ctx;
  t->loop = ctx->loop;
  /* The driver calls of reads on a thread beside the loop (launch.c):
   * SX_GPU_LAUNCHER=auto (the default) for reads that start while others
   * are in flight, on hosts of 8 CPUs and more (the thread spins a while
   * after each call: on fewer it would take the loop's core); 1 always; 0
   * never. */
  const char *e = getenv("SX_GPU_LAUNCHER");
  t->launch_mode = e == NULL || *e == '\0' || strcmp(e, "auto") == 0 ? 2
                   : strcmp(e, "1") == 0                              ? 1
                   : strcmp(e, "0") == 0                              ? 0
                                                                      : -1;
  if (t->launch_mode < 0) {
    fprintf(stderr, "segxfer: SX_GPU_LAUNCHER=%s is not auto, 1 or 0: auto\n", e);
    t->launch_mode = 2;
  }
  if (t->launch_mode == 2 && !sx__spin_host())
    t->launch_mode = 0;
  if (t->launch_mode != 0 && (rc = sx__mem_launcher_create(&t->launcher)) != 0) {
    sx__mem_notifier_close(t->nf);
    free(t);
    return rc;
  }
  sx__mem_copy_method m = sx__mem_copy_env();
  t->method = m;
  t->spread = m == SX__COPY_BATCH || m == SX__COPY_RANGE;
  sx__host_identity(&t->self);
  *out = &t->base;
  return 0;
}

static void ipc_close(sx_transport *base) {
  cipc_t *t = (cipc_t *)base;
  while (t->peers != NULL)
    ipc_peer_close(&t->peers->base);
  for (int d = 0; d < IPC_MAX_DEVICES; d++)
    for (int k = 0; k < IPC_STREAMS; k++)
      sx__mem_stream_destroy(t->streams[d][k]);
  sx__mem_launcher_destroy(t->launcher); /* its streams are gone */
  sx__mem_notifier_close(t->nf); /* the last notices free their ops */
  while (t->spare != NULL) {
    iop *o = t->spare;
    t->spare = o->next;
    iop_destroy(o);
  }
  free(t);
}

/* The cuda_ipc endpoint is the TCP one: handles come over that listener. */
static int ipc_pack(sx_transport *base, sx_desc *d) {
  (void)base;
  for (uint32_t i = 0; i < d->n_endpoints; i++) {
    if (d->endpoints[i].kind != SX_TRANSPORT_TCP || d->host_id[0] == '\0')
      continue;
    sx_endpoint e = d->endpoints[i];
    e.kind = SX_TRANSPORT_CUDA_IPC;
    return sx_desc_add_endpoint(d, &e);
  }
  return 0;
}

static int ipc_usable(sx_transport *base, const sx_desc *remote) {
  cipc_t *t = (cipc_t *)base;
  const char *name = base->ctx->name;
  int ep = 0, gpu = 0;
  for (uint32_t i = 0; i < remote->n_endpoints; i++)
    ep |= remote->endpoints[i].kind == SX_TRANSPORT_CUDA_IPC;
  /* Same kernel, another process, and GPU memory on every region peers may
   * read or write. */
  if (!ep || remote->host_id[0] == '\0' || strcmp(remote->host_id, t->self.host_id) != 0 ||
      remote->process == t->self.process)
    return 0;
  for (uint32_t i = 0; i < remote->n_regions; i++) {
    uint32_t access = remote->regions[i].access;
    if (!(access & (SX_ACCESS_REMOTE_READ | SX_ACCESS_REMOTE_WRITE)))
      continue;
    if (strncmp(remote->regions[i].location, "cuda:", 5) != 0)
      return 0;
    /* Handles of writable allocations go only to granted producers, which
     * are named: an unnamed reader reads such a target over tcp. */
    if ((access & SX_ACCESS_REMOTE_WRITE) && (name == NULL || name[0] == '\0'))
      return 0;
    gpu = 1;
  }
  return gpu;
}

const sx_transport_ops sx__cuda_ipc_ops = {
    .name = "cuda_ipc",
    .kind = SX_TRANSPORT_CUDA_IPC,
    .caps = SX__TR_STRIDED | SX__TR_TABLES, /* run() hands them to the gather whole */
    .open = ipc_open,
    .close = ipc_close,
    .pack = ipc_pack,
    .usable = ipc_usable,
    .peer_open = ipc_peer_open,
    .peer_close = ipc_peer_close,
    .post = ipc_post,
    .abort = ipc_abort,
    .wpeer_open = ipc_wpeer_open,
    .notify = ipc_notify,
    .lane = sx__ipc_lane,
    .lane_ref = sx__ipc_lane_ref,
    .lane_read = sx__ipc_lane_read,
    .lane_done = sx__ipc_lane_done,
    .lane_watch = sx__ipc_lane_watch,
};
