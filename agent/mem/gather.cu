/*
 * The gather/scatter copy kernel of the memory layer (agent/mem/gather.c
 * loads it).  This is its source; the library ships the PTX that
 * agent/mem/gen_gather_ptx.sh makes from it (agent/mem/gather_ptx.h), so
 * building segxfer needs no nvcc and no CUDA runtime: the driver
 * JIT-compiles the PTX once per process and device.
 *
 * One launch copies a whole table of pieces.  A piece is at most
 * SX__GATHER_PIECE bytes (the host cuts longer ranges), and one thread
 * block copies one piece at a time, blocks striding over the table, so a
 * batch of many small ranges keeps every SM busy while one copy-engine
 * operation per range would pay its fixed cost each time.  Pointers may be
 * this GPU's memory, a peer GPU's (an IPC mapping or peer access: loads and
 * stores go over NVLink) or pinned host memory (the table itself is pinned
 * host memory, read in place).
 *
 * sx_gather_strided takes a table of strided pieces instead: count pieces
 * of len bytes, piece k from src + k * sstride to dst + k * dstride, which
 * one thread block copies whole (the host keeps count * len within
 * SX__GATHER_PIECE), so a token-major read plan's per-token pieces cost
 * one table entry per 64 KiB rather than one thread block per piece.
 *
 * sx_gather_based takes a table of based pieces (sx__mem_bpiece): the
 * source is relative to one of up to 16 bases passed by value with the
 * launch, so a table can be written before the addresses it reads from
 * are known (the batch's thread writes it in pinned memory; the agent's
 * thread only adds the bases when it launches).
 */
struct sx_piece {
  unsigned long long dst, src, len;
};

#define THREADS 256
#define UNROLL 4

/* One piece: len bytes from src to dst, by the calling thread block. */
__device__ __forceinline__ void copy_piece(unsigned long long dst, unsigned long long src,
                                           unsigned long long len) {
  unsigned long long done = 0;
  if (((dst | src) & 15) == 0) {
    /* 16-byte loads and stores, UNROLL of them in flight per thread so
     * that reads over NVLink overlap. */
    const uint4 *s = (const uint4 *)src;
    uint4 *d = (uint4 *)dst;
    const unsigned long long nv = len / 16;
    unsigned long long k = threadIdx.x;
    for (; k + (UNROLL - 1) * THREADS < nv; k += UNROLL * THREADS) {
      uint4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; u++)
        v[u] = s[k + u * THREADS];
#pragma unroll
      for (int u = 0; u < UNROLL; u++)
        d[k + u * THREADS] = v[u];
    }
    for (; k < nv; k += THREADS)
      d[k] = s[k];
    done = nv * 16;
  } else if (((dst | src) & 3) == 0) {
    const unsigned *s = (const unsigned *)src;
    unsigned *d = (unsigned *)dst;
    const unsigned long long nw = len / 4;
    for (unsigned long long k = threadIdx.x; k < nw; k += THREADS)
      d[k] = s[k];
    done = nw * 4;
  }
  const unsigned char *s = (const unsigned char *)src;
  unsigned char *d = (unsigned char *)dst;
  for (unsigned long long k = done + threadIdx.x; k < len; k += THREADS)
    d[k] = s[k];
}

extern "C" __global__ void __launch_bounds__(THREADS)
sx_gather(const sx_piece *__restrict__ table, unsigned long long n) {
  for (unsigned long long i = blockIdx.x; i < n; i += gridDim.x)
    copy_piece(table[i].dst, table[i].src, table[i].len);
}

struct sx_bpiece {
  unsigned long long dst, src;
  unsigned len, region, e0, e1; /* e0, e1: the host's */
};

struct sx_bases {
  unsigned long long base[16];
};

extern "C" __global__ void __launch_bounds__(THREADS)
sx_gather_based(const sx_bpiece *__restrict__ table, unsigned long long n, sx_bases b) {
  for (unsigned long long i = blockIdx.x; i < n; i += gridDim.x) {
    const unsigned long long dst = table[i].dst, src = table[i].src;
    const unsigned len = table[i].len, region = table[i].region;
    /* Picked with constant indexes: b.base[region] would copy the 128
     * bytes of parameters to local memory in every thread. */
    unsigned long long base = 0;
#pragma unroll
    for (unsigned r = 0; r < 16; r++)
      base = region == r ? b.base[r] : base;
    copy_piece(dst, base + src, len);
  }
}

struct sx_spiece {
  unsigned long long dst, src, len, count, dstride, sstride;
};

/* The pieces of one strided entry as T-sized elements (len, both
 * addresses and both strides are multiples of sizeof(T)): element i of the
 * whole is element i % per of piece i / per, UNROLL loads in flight per
 * thread.  Indexes are 32 bits: an entry holds at most 64 KiB. */
template <typename T>
__device__ void copy_strided(unsigned char *dst, const unsigned char *src, unsigned per,
                             unsigned total, unsigned long long dstride,
                             unsigned long long sstride) {
  unsigned k = threadIdx.x;
  for (; k + (UNROLL - 1) * THREADS < total; k += UNROLL * THREADS) {
    T v[UNROLL];
    unsigned q[UNROLL], w[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      q[u] = (k + u * THREADS) / per;
      w[u] = k + u * THREADS - q[u] * per;
      v[u] = ((const T *)(src + q[u] * sstride))[w[u]];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
      ((T *)(dst + q[u] * dstride))[w[u]] = v[u];
  }
  for (; k < total; k += THREADS) {
    const unsigned q = k / per, w = k - q * per;
    ((T *)(dst + q * dstride))[w] = ((const T *)(src + q * sstride))[w];
  }
}

extern "C" __global__ void __launch_bounds__(THREADS)
sx_gather_strided(const sx_spiece *__restrict__ table, unsigned long long n) {
  for (unsigned long long i = blockIdx.x; i < n; i += gridDim.x) {
    const sx_spiece p = table[i];
    unsigned char *d = (unsigned char *)p.dst;
    const unsigned char *s = (const unsigned char *)p.src;
    const unsigned long long all = p.dst | p.src | p.len | p.dstride | p.sstride;
    const unsigned c = (unsigned)p.count;
    if ((all & 15) == 0) {
      const unsigned per = (unsigned)(p.len / 16);
      copy_strided<uint4>(d, s, per, per * c, p.dstride, p.sstride);
    } else if ((all & 3) == 0) {
      const unsigned per = (unsigned)(p.len / 4);
      copy_strided<unsigned>(d, s, per, per * c, p.dstride, p.sstride);
    } else {
      const unsigned per = (unsigned)p.len;
      copy_strided<unsigned char>(d, s, per, per * c, p.dstride, p.sstride);
    }
  }
}
