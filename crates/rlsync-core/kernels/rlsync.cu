// rlsync's CUDA kernels: the fused patch build (diff_compact), the install of host-decoded patch entries
// (scatter) and the device-to-device install of diff_compact's output (apply_compact), one per element width.
//
// The binding spec is notes/gpu-spec.md (layouts, semantics); the CPU reference with the same semantics is
// crates/rlsync-core/src/gpu/reference.rs and the host side of the compacted format gpu/compact.rs.
//
// Design:
// - Compiled standalone by NVRTC (scripts/gen_ptx.py, compute_80): no includes, own integer typedefs. The
//   generated PTX (rlsync.ptx) is committed and embedded; the driver JITs it for the device's arch.
// - diff_compact: a block of 256 threads owns a tile of 4096 elements (16 per thread, consecutive), tiles
//   never straddle tensors, a grid-stride loop walks the tiles (tile = blockIdx.x + k * gridDim.x, so the
//   blocks in flight read neighbouring memory). Each thread loads its 16 state and snapshot elements with
//   16-byte vector loads when the tensor's two base addresses are 16-byte aligned and the run is whole
//   (scalar loads otherwise: unaligned tensors, the tail tile), compares bit patterns (NaN payloads and -0.0
//   are changes like any other bits), builds a 16-bit mask, and writes the changed elements back to the
//   snapshot (unchanged elements are never written). A warp-shuffle scan of the popcounts plus an 8-entry
//   shared-memory scan of the warp totals give each thread its rank and the tile its count; thread 0 takes
//   the tile's place in the output pool with one 64-bit atomicAdd (none when nothing changed) and writes the
//   tile's directory entry; a tile that does not fit the pool is flagged OVERFLOW and writes no entries (the
//   host sends its segment dense). The pool is in reservation order, the directory restores tile order.
// - diff_compact's speed (issue 24, s10/gpu-tune; the first version measured 1.61x / 1.80x a D2D copy for
//   bf16 at 1 % / 3 % on an H100, 2.68x for 1-byte elements, docs/measurements.md). The first version did
//   one tile at a time per block: loads, then compare, scan, barrier, the tile's atomic, barrier, writes,
//   and only then the next tile's loads, so the memory pipe idled while a block waited on its barriers and
//   atomic, with few blocks per SM (80 registers: 3 blocks) and only 32 (W = 1) or 64 (W = 2) bytes per
//   thread to hide it. What changed, output unchanged (same directory, same entries per tile in the same
//   order, one reservation per tile, same snapshot writes):
//   * W = 1 and 2 are software-pipelined: the next tile's (tile + gridDim.x) job lookup and loads are issued
//     before the current tile's compare, scan, reservation and writes (`fetch` into a second set of
//     registers), so each thread always has a tile's loads in flight. The loads are `volatile` asm so the
//     compiler keeps that order (checked in the sm_90 SASS: the next tile's LDG.128s precede the current
//     tile's compare, BAR.SYNC and ATOMG). W = 4 and 8 load 64 and 128 bytes per side per thread per tile,
//     enough in flight without it, and would lose occupancy to a second register set (W = 8 spills at 3
//     blocks per SM already): they load after the writes, as before.
//   * Fewer registers: a thread's elements stay packed in 32-bit words (`Run`, 4 * W words per side)
//     instead of one register per element, and the scalar path (unaligned tensors, tensor ends) loads
//     element by element into a shift register of words (a rolled loop, 4 loads in flight: slower per
//     element, but the fully unrolled one kept 32 loads in flight and set the register high-water mark of
//     the whole kernel). `__launch_bounds__` asks for 5 / 4 / 4 / 2 blocks of 256 threads per SM for
//     W = 1 / 2 / 4 / 8 (<= 48 / 64 / 64 / 128 registers); ptxas for sm_90 fits 48 / 64 / 62 / 96 with no
//     spills (NVRTC 12.4 and 13.0 from the source; nvJitLink 13.5 from the committed PTX: 48 / 64 / 61 /
//     94). Bytes in flight per SM with pipelining: W = 1: 5 * 256 * 32 = 40 KiB, W = 2: 4 * 256 * 64 =
//     64 KiB, nearly all the time.
//   * The state is read with `ld.global.cs.nc` (evict-first in L1 and L2: read once), so it does not push
//     the snapshot's lines out of L2 before their changed elements are written back into them.
//   * find_job checks the previous job first (one load, not a binary search of dependent loads per tile).
// - scatter: one thread per change (grid-stride), its job found by binary search over the jobs' prefix sums.
// - apply_compact: diff_compact's tiles again: a block walks one tile's directory entry and writes its
//   entries (or copies an OVERFLOW tile densely from the sender's snapshot).
// - No dynamic allocation, no device-side printf, no recursion. Pointers must be aligned to the element
//   width (16-byte alignment is only a fast path). Launch with 256 threads per block, no dynamic shared memory.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define RLSYNC_TILE 4096u
#define RLSYNC_BLOCK 256u
#define RLSYNC_PER_THREAD 16u
#define RLSYNC_SEGMENT_TILES 1024u
#define RLSYNC_SEGMENT (1ull << 22)
#define RLSYNC_OVERFLOW 1u

struct DiffJob {
    u64 state;
    u64 snap;
    u64 numel;
    u64 first_tile;
};

struct TileDir {
    u64 offset;
    u32 count;
    u32 flags;
};

struct ScatterJob {
    u64 dst;
    u64 first;
    u32 count;
    u32 mode;
};

struct ApplyJob {
    u64 dst;
    u64 dense_src;
    u64 numel;
    u64 first_tile;
};

struct alignas(16) Vec16 {
    u32 a, b, c, d;
};

template <int W> struct WordOf;
template <> struct WordOf<1> { typedef u8 T; };
template <> struct WordOf<2> { typedef u16 T; };
template <> struct WordOf<4> { typedef u32 T; };
template <> struct WordOf<8> { typedef u64 T; };

// The last job whose `first_tile` is <= tile, searching jobs[lo..n) (lo is a job known to start at or
// before the tile). Jobs of empty tensors share their first tile with the next job; the last one wins.
// Fast path first: a grid-stride walk mostly stays in the job it was in (jobs[lo + 1] starts past the
// tile), one load instead of a binary search of dependent loads; the answer is the same (the table is
// sorted, so no later job can start at or before the tile either).
__device__ __forceinline__ u32 find_job(const u64* first_of, u32 stride_words, u32 lo, u32 n, u64 tile) {
    if (lo + 1 >= n || first_of[(u64)(lo + 1) * stride_words] > tile) return lo;
    u32 hi = n;  // invariant: first(lo) <= tile (or lo == 0), first(hi) > tile (or hi == n)
    while (hi - lo > 1) {
        u32 mid = lo + (hi - lo) / 2;
        if (first_of[(u64)mid * stride_words] <= tile) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// -- global-memory access helpers (begin) --
// Global-memory accesses through pointers that arrive as integers (the job tables): the compiler cannot
// infer their address space, so these name it (`ld.global`, not a generic `ld`). All are `volatile`, so
// the compiler keeps them in program order: diff_compact issues the next tile's loads before the current
// tile's scan, reservation and writes, and that order must survive compilation.
// - State: read-only during diff_compact and read once: the non-coherent path with the streaming cache
//   operator (`ld.global.cs.nc`: evict-first in L1 and L2, so the state does not push the snapshot's lines
//   out of L2 before their changed elements are written back into them).
// - Snapshot: read, then its changed elements written, by the same thread: a plain `ld.global`.
__device__ __forceinline__ Vec16 ld_v4(const void* p, bool readonly) {
    Vec16 v;
    if (readonly) {
        asm volatile("ld.global.cs.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
    } else {
        asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p) : "memory");
    }
    return v;
}

template <typename T> __device__ __forceinline__ T ld_scalar(const T* p);
template <> __device__ __forceinline__ u8 ld_scalar<u8>(const u8* p) {
    u16 v;
    asm volatile("ld.global.u8 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return (u8)v;
}
template <> __device__ __forceinline__ u16 ld_scalar<u16>(const u16* p) {
    u16 v;
    asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
    return v;
}
template <> __device__ __forceinline__ u32 ld_scalar<u32>(const u32* p) {
    u32 v;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
template <> __device__ __forceinline__ u64 ld_scalar<u64>(const u64* p) {
    u64 v;
    asm volatile("ld.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

template <typename T> __device__ __forceinline__ void st_scalar(T* p, T v);
template <> __device__ __forceinline__ void st_scalar<u8>(u8* p, u8 v) {
    asm volatile("st.global.u8 [%0], %1;" : : "l"(p), "h"((u16)v) : "memory");
}
template <> __device__ __forceinline__ void st_scalar<u16>(u16* p, u16 v) {
    asm volatile("st.global.u16 [%0], %1;" : : "l"(p), "h"(v) : "memory");
}
template <> __device__ __forceinline__ void st_scalar<u32>(u32* p, u32 v) {
    asm volatile("st.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
template <> __device__ __forceinline__ void st_scalar<u64>(u64* p, u64 v) {
    asm volatile("st.global.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}

// -- global-memory access helpers (end) --

// One thread's 16 consecutive elements of a tile as raw little-endian 32-bit words (16 * W bytes = 4 * W
// words): element k of width W < 8 is bits [8 * W * k % 32, ...) of word W * k / 4, of width 8 words 2k and
// 2k + 1. Kept packed, so a tile in flight costs 4 * W registers per side.
template <int W> struct Run {
    u32 w[4 * W];
};

// Element k of a run, zero-extended.
template <int W> __device__ __forceinline__ u64 element(const Run<W>& r, int k) {
    if constexpr (W == 8) {
        return (u64)r.w[2 * k] | ((u64)r.w[2 * k + 1] << 32);
    } else if constexpr (W == 4) {
        return (u64)r.w[k];
    } else {
        return (u64)((r.w[(k * W) / 4] >> ((k * W * 8) % 32)) & ((1u << (8 * W)) - 1u));
    }
}

// Load 16 consecutive elements at `p` (element index `i0` of a tensor of `numel`): vectors when `vec`
// (aligned and whole), scalars otherwise; elements past `numel` read as 0 on both sides, so never differ.
template <int W>
__device__ __forceinline__ void load16(const u8* p, bool vec, bool readonly, u64 i0, u64 numel, Run<W>& out) {
    typedef typename WordOf<W>::T T;
    if (vec) {
#pragma unroll
        for (int v = 0; v < W; ++v) {
            const Vec16 x = ld_v4(p + 16 * v, readonly);
            out.w[4 * v + 0] = x.a;
            out.w[4 * v + 1] = x.b;
            out.w[4 * v + 2] = x.c;
            out.w[4 * v + 3] = x.d;
        }
    } else {
        // Rare (an unaligned tensor, the thread at a tensor's end): element by element into a shift
        // register of words (each element enters at the top, the earlier ones move down by W bytes), a
        // loop of constant register indices that needs no register per element in flight.
        const T* e = reinterpret_cast<const T*>(p);
#pragma unroll
        for (int k = 0; k < 4 * W; ++k) out.w[k] = 0;
#pragma unroll 4
        for (int k = 0; k < (int)RLSYNC_PER_THREAD; ++k) {
            const u64 x = (i0 + k < numel) ? (u64)ld_scalar<T>(e + k) : 0ull;
            if constexpr (W == 8) {
#pragma unroll
                for (int i = 0; i + 2 < 4 * W; ++i) out.w[i] = out.w[i + 2];
                out.w[4 * W - 2] = (u32)x;
                out.w[4 * W - 1] = (u32)(x >> 32);
            } else if constexpr (W == 4) {
#pragma unroll
                for (int i = 0; i + 1 < 4 * W; ++i) out.w[i] = out.w[i + 1];
                out.w[4 * W - 1] = (u32)x;
            } else {
#pragma unroll
                for (int i = 0; i + 1 < 4 * W; ++i) {
                    out.w[i] = (out.w[i] >> (8 * W)) | (out.w[i + 1] << (32 - 8 * W));
                }
                out.w[4 * W - 1] = (out.w[4 * W - 1] >> (8 * W)) | ((u32)x << (32 - 8 * W));
            }
        }
    }
}

// The 16-bit change mask of a thread's run: bit k = element k's bit patterns differ.
template <int W> __device__ __forceinline__ u32 change_mask(const Run<W>& cur, const Run<W>& old) {
    u32 mask = 0;
#pragma unroll
    for (int k = 0; k < (int)RLSYNC_PER_THREAD; ++k) {
        mask |= (u32)(element<W>(cur, k) != element<W>(old, k)) << k;
    }
    return mask;
}

// Inclusive scan of `x` over the warp.
__device__ __forceinline__ u32 warp_inclusive(u32 x, u32 lane) {
#pragma unroll
    for (u32 d = 1; d < 32; d <<= 1) {
        u32 y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
    }
    return x;
}

// One thread's share of a tile, loaded and waiting to be compared: its state and snapshot words, where
// its snapshot run lives (0: the thread owns no element of the tile, the words are 0 on both sides) and
// the segment-relative index of its first element.
template <int W> struct Fetched {
    Run<W> cur, old;
    u64 snap;
    u32 rel;
};

// Find `tile`'s job (updating `j`) and load this thread's 16 elements of it. A tile at or past `ntiles`
// or past its tensor's end (a malformed table) loads nothing: it changes nothing and lists nothing.
template <int W>
__device__ __forceinline__ void fetch(const DiffJob* __restrict__ jobs, u32 njobs, u64 ntiles, u64 tile,
                                      u32& j, Fetched<W>& f) {
    j = find_job(&jobs[0].first_tile, sizeof(DiffJob) / 8, j, njobs, tile);
    const DiffJob job = jobs[j];
    const u64 t = tile - job.first_tile;                                 // tile within its tensor
    const u64 start = t * RLSYNC_TILE;                                   // its first element
    const u64 i0 = start + (u64)threadIdx.x * RLSYNC_PER_THREAD;         // this thread's first element
    const bool in_table = tile < ntiles && tile >= job.first_tile && start < job.numel;
    f.rel = (u32)((t % RLSYNC_SEGMENT_TILES) * RLSYNC_TILE + threadIdx.x * RLSYNC_PER_THREAD);
    if (in_table && i0 < job.numel) {
        const bool whole = i0 + RLSYNC_PER_THREAD <= job.numel;
        const bool aligned = ((job.state | job.snap) & 15u) == 0;
        const u8* sp = reinterpret_cast<const u8*>(job.state) + i0 * W;
        const u8* np = reinterpret_cast<const u8*>(job.snap) + i0 * W;
        load16<W>(sp, whole && aligned, true, i0, job.numel, f.cur);
        load16<W>(np, whole && aligned, false, i0, job.numel, f.old);
        f.snap = reinterpret_cast<u64>(np);
    } else {
#pragma unroll
        for (int k = 0; k < 4 * W; ++k) {
            f.cur.w[k] = 0;
            f.old.w[k] = 0;
        }
        f.snap = 0;
    }
}

// `PIPELINE`: the next tile's loads are issued before this tile's compare, scan, reservation and writes,
// so every thread keeps a tile of loads in flight while its block waits on barriers and the tile's
// atomic (twice the registers for the loaded words: used for W <= 2, whose 16 elements are 32 bytes or
// less per side; W = 4 and 8 keep their occupancy instead and load after the writes).
template <int W, bool PIPELINE>
__device__ __forceinline__ void diff_compact(const DiffJob* __restrict__ jobs, u32 njobs, u64 ntiles,
                                             u32* __restrict__ idx, u64* __restrict__ vals, u64 capacity,
                                             unsigned long long* cursor, TileDir* __restrict__ dir) {
    typedef typename WordOf<W>::T T;
    if (njobs == 0 || blockIdx.x >= ntiles) return;  // (uniform per block)
    __shared__ u32 warp_total[RLSYNC_BLOCK / 32];
    __shared__ u64 tile_offset;  // the tile's place in the pool, or ~0 when it overflowed
    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31u;
    const u32 warp = tid >> 5;
    u32 j = 0;
    Fetched<W> f;
    if constexpr (PIPELINE) fetch<W>(jobs, njobs, ntiles, blockIdx.x, j, f);
    for (u64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        Fetched<W> nf;
        if constexpr (PIPELINE) {
            fetch<W>(jobs, njobs, ntiles, tile + gridDim.x, j, nf);  // in flight during this tile's work
        } else {
            fetch<W>(jobs, njobs, ntiles, tile, j, f);
        }
        const u32 mask = change_mask<W>(f.cur, f.old);
        if (mask != 0) {
            // Changed elements into the snapshot (also in tiles that overflow the pool).
            T* snap = reinterpret_cast<T*>(f.snap);
#pragma unroll
            for (int k = 0; k < (int)RLSYNC_PER_THREAD; ++k) {
                if (mask & (1u << k)) st_scalar<T>(snap + k, (T)element<W>(f.cur, k));
            }
        }
        const u32 n = __popc(mask);
        const u32 incl = warp_inclusive(n, lane);
        if (lane == 31) warp_total[warp] = incl;
        __syncthreads();
        u32 before = 0, total = 0;
#pragma unroll
        for (u32 w = 0; w < RLSYNC_BLOCK / 32; ++w) {
            const u32 v = warp_total[w];
            before += (w < warp) ? v : 0u;
            total += v;
        }
        const u32 rank = before + incl - n;  // this thread's first entry within the tile
        if (tid == 0) {
            TileDir d;
            d.offset = 0;
            d.count = total;
            d.flags = 0;
            u64 off = ~0ull;
            if (total != 0) {
                off = atomicAdd(cursor, (unsigned long long)total);
                if (off + total > capacity) {
                    d.flags = RLSYNC_OVERFLOW;
                    off = ~0ull;
                } else {
                    d.offset = off;
                }
            }
            dir[tile] = d;
            tile_offset = off;
        }
        __syncthreads();
        const u64 off = tile_offset;
        if (mask != 0 && off != ~0ull) {
            u64 e = off + rank;
#pragma unroll
            for (int k = 0; k < (int)RLSYNC_PER_THREAD; ++k) {
                if (mask & (1u << k)) {
                    st_scalar<u32>(idx + e, f.rel + (u32)k);
                    if (W == 8) {
                        st_scalar<u64>(vals + 2 * e, element<W>(f.old, k));
                        st_scalar<u64>(vals + 2 * e + 1, element<W>(f.cur, k));
                    } else {
                        st_scalar<u64>(vals + e, element<W>(f.old, k) | (element<W>(f.cur, k) << 32));
                    }
                    ++e;
                }
            }
        }
        // The next tile's writes to warp_total and tile_offset come after its first barrier, which every
        // thread reaches only after reading this tile's values.
        if constexpr (PIPELINE) f = nf;
    }
}

template <int W>
__device__ __forceinline__ void scatter(const ScatterJob* __restrict__ jobs, u32 njobs, u64 total,
                                        const u32* __restrict__ idx, const u64* __restrict__ vals) {
    typedef typename WordOf<W>::T T;
    if (njobs == 0) return;
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
        const u32 j = find_job(&jobs[0].first, sizeof(ScatterJob) / 8, 0, njobs, i);
        const ScatterJob job = jobs[j];
        if (i < job.first || i - job.first >= job.count) continue;  // a malformed table writes nothing
        T* p = reinterpret_cast<T*>(job.dst) + idx[i];
        const T v = (T)vals[i];
        // mode 1 adds, wrapping, truncated to W bytes; anything else sets.
        st_scalar<T>(p, job.mode == 1 ? (T)(ld_scalar<T>(p) + v) : v);
    }
}

template <int W>
__device__ __forceinline__ void apply_compact(const ApplyJob* __restrict__ jobs, u32 njobs, u64 ntiles,
                                              const TileDir* __restrict__ dir, const u32* __restrict__ idx,
                                              const u64* __restrict__ vals) {
    typedef typename WordOf<W>::T T;
    if (njobs == 0) return;
    u32 j = 0;
    for (u64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        j = find_job(&jobs[0].first_tile, sizeof(ApplyJob) / 8, j, njobs, tile);
        const ApplyJob job = jobs[j];
        if (tile < job.first_tile) continue;
        const u64 t = tile - job.first_tile;
        const u64 start = t * RLSYNC_TILE;
        if (start >= job.numel) continue;
        const u64 end = (job.numel - start < RLSYNC_TILE) ? job.numel : start + RLSYNC_TILE;
        const TileDir d = dir[tile];
        T* dst = reinterpret_cast<T*>(job.dst);
        if (d.flags & RLSYNC_OVERFLOW) {
            if (job.dense_src == 0) continue;  // left to the host
            const T* src = reinterpret_cast<const T*>(job.dense_src);
            for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
                st_scalar<T>(dst + i, ld_scalar<T>(src + i));
            }
            continue;
        }
        const u64 seg_base = (t / RLSYNC_SEGMENT_TILES) * RLSYNC_SEGMENT;
        const u32 count = d.count < RLSYNC_TILE ? d.count : RLSYNC_TILE;
        for (u32 k = threadIdx.x; k < count; k += blockDim.x) {
            const u64 e = d.offset + k;
            const u64 i = seg_base + idx[e];
            if (i < start || i >= end) continue;  // never outside the tile, whatever the pool holds
            st_scalar<T>(dst + i, (T)(W == 8 ? vals[2 * e + 1] : (vals[e] >> 32)));
        }
    }
}

#define RLSYNC_WIDTH(W, DIFF_BLOCKS_PER_SM)                                                                \
    extern "C" __global__ void __launch_bounds__(256, DIFF_BLOCKS_PER_SM) diff_compact_w##W(              \
        const DiffJob* jobs, u32 njobs, u64 ntiles, u32* idx, u64* vals, u64 capacity,                     \
        unsigned long long* cursor, TileDir* dir) {                                                        \
        diff_compact<W, (W <= 2)>(jobs, njobs, ntiles, idx, vals, capacity, cursor, dir);                  \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) scatter_w##W(const ScatterJob* jobs, u32 njobs,      \
                                                                   u64 total, const u32* idx,              \
                                                                   const u64* vals) {                      \
        scatter<W>(jobs, njobs, total, idx, vals);                                                         \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) apply_compact_w##W(                                  \
        const ApplyJob* jobs, u32 njobs, u64 ntiles, const TileDir* dir, const u32* idx, const u64* vals) { \
        apply_compact<W>(jobs, njobs, ntiles, dir, idx, vals);                                             \
    }

RLSYNC_WIDTH(1, 5)
RLSYNC_WIDTH(2, 4)
RLSYNC_WIDTH(4, 4)
RLSYNC_WIDTH(8, 2)

// -- checksum_compact (the GPU channel's pool checksum, s14/ipcsum; CPU reference: gpu/reference.rs
// `checksum_compact`) --
// Both ends of the same-host GPU channel hash diff_compact's output: the sender right after diff_compact on
// its stream, each receiver on the opened buffers before apply_compact. Grid-stride over the tiles (jobs as
// apply_compact's, `dst` unused); per tile:
// - `full` != 0: every element of the tile hashed from `dense_src` (the snapshot copy) and counted;
// - else its directory entry's count is counted (also for an OVERFLOW tile); an OVERFLOW tile's elements are
//   hashed from `dense_src` (the sender's updated snapshot: what a receiver copies); a listed tile's entries
//   offset .. offset + min(count, TILE) below `capacity` are hashed (never read past the pool).
// A listed entry's hash mixes (splitmix64's finalizer, a bijection, chained) the tile's key, the element's
// position in the width's tile space (first_tile * TILE + element) and its value word(s) (old | new << 32,
// or both words of an 8-byte element); a dense element's hash the dense tile key, the position and its bits.
// The key is mix64(seed ^ W << 48) ^ tile (| 1 << 63 when dense), mixed: an entry listed under another tile,
// or hashed with another sequence number (a stale pool), hashes differently. The hashes are summed
// (wrapping; the pool's order, set by atomics, does not matter), reduced per block and added with one 64-bit
// atomicAdd per block into out[0]; the counts into out[1]. The host zeroes `out` before the launch.
__device__ __forceinline__ u64 rlsync_mix64(u64 z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ull;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <int W>
__device__ __forceinline__ void checksum_compact(const ApplyJob* __restrict__ jobs, u32 njobs, u64 ntiles,
                                                 const TileDir* __restrict__ dir, const u32* __restrict__ idx,
                                                 const u64* __restrict__ vals, u64 capacity, u64 seed, u32 full,
                                                 unsigned long long* out) {
    typedef typename WordOf<W>::T T;
    if (njobs == 0) return;  // (uniform)
    __shared__ u64 warp_sum[RLSYNC_BLOCK / 32];
    const u64 key = rlsync_mix64(seed ^ ((u64)W << 48));
    u64 sum = 0;
    u64 count = 0;  // thread 0's tally
    u32 j = 0;
    for (u64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        j = find_job(&jobs[0].first_tile, sizeof(ApplyJob) / 8, j, njobs, tile);
        const ApplyJob job = jobs[j];
        if (tile < job.first_tile) continue;
        const u64 t = tile - job.first_tile;
        const u64 start = t * RLSYNC_TILE;
        if (start >= job.numel) continue;
        const u64 end = (job.numel - start < RLSYNC_TILE) ? job.numel : start + RLSYNC_TILE;
        const u64 base = job.first_tile * RLSYNC_TILE;
        if (full == 0) {
            const TileDir d = dir[tile];
            if (threadIdx.x == 0) count += d.count;
            if (!(d.flags & RLSYNC_OVERFLOW)) {
                const u64 tkey = rlsync_mix64(key ^ tile);
                const u64 seg_base = (t / RLSYNC_SEGMENT_TILES) * RLSYNC_SEGMENT;
                const u32 n = d.count < RLSYNC_TILE ? d.count : RLSYNC_TILE;
                for (u32 k = threadIdx.x; k < n; k += blockDim.x) {
                    const u64 e = d.offset + k;
                    if (e >= capacity) continue;
                    const u64 v0 = W == 8 ? vals[2 * e] : vals[e];
                    const u64 v1 = W == 8 ? vals[2 * e + 1] : 0ull;
                    const u64 pos = base + seg_base + idx[e];
                    sum += rlsync_mix64(rlsync_mix64(rlsync_mix64(tkey ^ pos) ^ v0) ^ v1);
                }
                continue;
            }
        } else if (threadIdx.x == 0) {
            count += end - start;
        }
        if (job.dense_src == 0) continue;
        const u64 tkey = rlsync_mix64(key ^ tile ^ (1ull << 63));
        const T* src = reinterpret_cast<const T*>(job.dense_src);
        for (u64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            const u64 v = (u64)ld_scalar<T>(src + i);
            sum += rlsync_mix64(rlsync_mix64(tkey ^ (base + i)) ^ v);
        }
    }
    // Block reduction: warps by shuffles, then the 8 warp sums; one atomic per block and word.
#pragma unroll
    for (u32 d = 16; d > 0; d >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, d);
    if ((threadIdx.x & 31u) == 0) warp_sum[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 total = 0;
#pragma unroll
        for (u32 w = 0; w < RLSYNC_BLOCK / 32; ++w) total += warp_sum[w];
        atomicAdd(out, (unsigned long long)total);
        atomicAdd(out + 1, (unsigned long long)count);
    }
}

#define RLSYNC_CHECKSUM_WIDTH(W)                                                                           \
    extern "C" __global__ void __launch_bounds__(256) checksum_compact_w##W(                               \
        const ApplyJob* jobs, u32 njobs, u64 ntiles, const TileDir* dir, const u32* idx, const u64* vals,  \
        u64 capacity, u64 seed, u32 full, unsigned long long* out) {                                       \
        checksum_compact<W>(jobs, njobs, ntiles, dir, idx, vals, capacity, seed, full, out);               \
    }

RLSYNC_CHECKSUM_WIDTH(1)
RLSYNC_CHECKSUM_WIDTH(2)
RLSYNC_CHECKSUM_WIDTH(4)
RLSYNC_CHECKSUM_WIDTH(8)

// -- checksum_compact (end) --

// ---- Bucket casts (s14/bucketgpu): cast_gather packs many tensors into a bucket buffer, casting floating
// elements to the wire dtype (sender), or unpacks a bucket buffer into many tensors (receiver); the same
// kernel, the job table says which. CPU reference: gpu/reference/cast.rs (follows this block line by line);
// host side: gpu/bucket.rs.
//
// - A job copies `numel` elements from `src` (dtype code `codes & 0xff`) to `dst` (code `codes >> 8`);
//   `first` is the job's first element in the launch's element space (the prefix sum of the jobs' numel).
//   One thread per element, grid-stride; a thread finds its job with find_job (the previous job first).
// - The conversions are bit operations written to match the host's `tensor/cast.rs::cast_bytes` bit for bit
//   (torch's CPU semantics, x86 conversion instructions), not CUDA's cvt intrinsics, whose NaN results are
//   canonical (0x7fffffff) where the host keeps payloads: every floating pair goes through an f32 value
//   (f64 narrows to f32 first, as the host does: double rounding for f64 -> bf16 / f16), round to nearest
//   even, subnormals kept, overflow to inf; NaN: -> bf16 from f32/f64 is 0xFFFF, from f16 0x7FC0; -> f16 is
//   sign | 0x7E00 | top payload; widening keeps the payload and sets the quiet bit (bf16 -> f32 keeps bits).
// - Same-dtype jobs (integers, bool, floating tensors already in the wire dtype) are copies by this kernel
//   too (raw codes): one launch per bucket instead of one cuMemcpyAsync per tensor. Reasoning, not yet
//   measured: a 7B bucket of 1 GB holds ~60-300 tensors (biases and norms are small), and each memcpy call
//   costs a few microseconds of host submission while the whole bucket's D2D copy takes ~0.5 ms on an H100;
//   the GPU check (gpu_check.py, bucket_device=cuda) times the pack against the host-staged path.
// - Element-wise 1/2/4/8-byte loads: simple and correct first; vectorising the copies is the next step if
//   the timing shows the pack is not bandwidth-bound.

#define RLSYNC_DT_F64 0u
#define RLSYNC_DT_F32 1u
#define RLSYNC_DT_F16 2u
#define RLSYNC_DT_BF16 3u
#define RLSYNC_DT_RAW1 4u
#define RLSYNC_DT_RAW2 5u
#define RLSYNC_DT_RAW4 6u
#define RLSYNC_DT_RAW8 7u

struct CastJob {
    u64 src;
    u64 dst;
    u64 first;
    u64 numel;
    u32 codes;  // source code | destination code << 8
    u32 pad;
};

__device__ __forceinline__ u32 cast_width(u32 code) {
    switch (code) {
        case RLSYNC_DT_F64: case RLSYNC_DT_RAW8: return 8;
        case RLSYNC_DT_F32: case RLSYNC_DT_RAW4: return 4;
        case RLSYNC_DT_F16: case RLSYNC_DT_BF16: case RLSYNC_DT_RAW2: return 2;
        default: return 1;
    }
}

__device__ __forceinline__ u64 cast_load(u64 addr, u32 width) {
    switch (width) {
        case 8: return *reinterpret_cast<const u64*>(addr);
        case 4: return *reinterpret_cast<const u32*>(addr);
        case 2: return *reinterpret_cast<const u16*>(addr);
        default: return *reinterpret_cast<const u8*>(addr);
    }
}

__device__ __forceinline__ void cast_store(u64 addr, u32 width, u64 v) {
    switch (width) {
        case 8: *reinterpret_cast<u64*>(addr) = v; break;
        case 4: *reinterpret_cast<u32*>(addr) = (u32)v; break;
        case 2: *reinterpret_cast<u16*>(addr) = (u16)v; break;
        default: *reinterpret_cast<u8*>(addr) = (u8)v; break;
    }
}

// f32 -> bf16: round to nearest even, every NaN 0xFFFF (cast.rs cast_f32_to_bf16).
__device__ __forceinline__ u32 cast_f32_bf16(u32 b) {
    const u32 rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return (b & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : (rounded & 0xFFFFu);
}

// f16 -> f32: exact; NaN keeps its payload with the quiet bit set.
__device__ __forceinline__ u32 cast_f16_f32(u32 h) {
    const u32 sign = (h & 0x8000u) << 16;
    const u32 exp = h & 0x7C00u;
    const u32 man = h & 0x03FFu;
    if ((h & 0x7FFFu) == 0) return sign;
    if (exp == 0x7C00u) return man == 0 ? (sign | 0x7F800000u) : (sign | 0x7FC00000u | (man << 13));
    if (exp == 0) {
        const u32 p = 31u - (u32)__clz(man);  // the top set bit, 0..9
        return sign | ((p + 103u) << 23) | ((man << (23u - p)) & 0x7FFFFFu);
    }
    return sign | (((exp >> 10) + 112u) << 23) | (man << 13);
}

// f32 -> f16: round to nearest even, overflow to inf, subnormals; NaN: sign | 0x7E00 | top payload.
__device__ __forceinline__ u32 cast_f32_f16(u32 x) {
    const u32 sign = (x & 0x80000000u) >> 16;
    const u32 exp = x & 0x7F800000u;
    const u32 man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) return sign | 0x7C00u | (man != 0 ? 0x0200u : 0u) | (man >> 13);
    const int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1F) return sign | 0x7C00u;
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return sign;
        const u32 m = man | 0x00800000u;
        u32 half_man = m >> (14 - half_exp);
        const u32 round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) half_man += 1;
        return sign | half_man;
    }
    const u32 v = sign | ((u32)half_exp << 10) | (man >> 13);
    const u32 round_bit = 0x00001000u;
    return ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) ? v + 1 : v;
}

// Round-to-nearest-even right shift of `m` by `s` (1..63).
__device__ __forceinline__ u64 cast_rne_shift(u64 m, u32 s) {
    const u64 r = m >> s;
    const u64 rem = m & ((1ull << s) - 1);
    const u64 half = 1ull << (s - 1);
    return (rem > half || (rem == half && (r & 1))) ? r + 1 : r;
}

// f64 -> f32: round to nearest even, overflow to inf, subnormals; NaN: sign | quiet | top payload (x86).
__device__ __forceinline__ u32 cast_f64_f32(u64 x) {
    const u32 sign = (u32)(x >> 32) & 0x80000000u;
    const u32 exp = (u32)(x >> 52) & 0x7FFu;
    const u64 man = x & 0x000FFFFFFFFFFFFFull;
    if (exp == 0x7FFu) return man == 0 ? (sign | 0x7F800000u) : (sign | 0x7FC00000u | (u32)(man >> 29));
    if (exp == 0) return sign;  // f64 subnormals are far below f32's smallest subnormal
    const int e = (int)exp - 1023 + 127;
    const u64 m = man | (1ull << 52);
    if (e >= 0xFF) return sign | 0x7F800000u;
    if (e >= 1) return sign + (((u32)(e - 1)) << 23) + (u32)cast_rne_shift(m, 29);  // a carry moves the exponent
    const u32 s = 29u + (u32)(1 - e);
    if (s >= 54) return sign;
    return sign | (u32)cast_rne_shift(m, s);
}

// f32 -> f64: exact; NaN keeps its payload with the quiet bit set.
__device__ __forceinline__ u64 cast_f32_f64(u32 x) {
    const u64 sign = (u64)(x & 0x80000000u) << 32;
    const u32 exp = (x >> 23) & 0xFFu;
    const u32 man = x & 0x7FFFFFu;
    if (exp == 0xFFu) {
        return man == 0 ? (sign | 0x7FF0000000000000ull)
                        : (sign | 0x7FF8000000000000ull | ((u64)man << 29));
    }
    if (exp == 0) {
        if (man == 0) return sign;
        const u32 p = 31u - (u32)__clz(man);  // 0..22
        return sign | ((u64)(p + 874u) << 52) | (((u64)man << (52u - p)) & 0x000FFFFFFFFFFFFFull);
    }
    return sign | ((u64)(exp + 896u) << 52) | ((u64)man << 29);
}

// One element's bits from dtype code `from` to code `to` (both floating, different), as cast_bytes does.
__device__ __forceinline__ u64 cast_convert(u32 from, u32 to, u64 bits) {
    if (from == RLSYNC_DT_F16 && to == RLSYNC_DT_BF16 && (bits & 0x7C00u) == 0x7C00u && (bits & 0x03FFu) != 0) {
        return 0x7FC0u;
    }
    u32 f;
    switch (from) {
        case RLSYNC_DT_F64: f = cast_f64_f32(bits); break;
        case RLSYNC_DT_F16: f = cast_f16_f32((u32)bits); break;
        case RLSYNC_DT_BF16: f = (u32)bits << 16; break;
        default: f = (u32)bits; break;
    }
    switch (to) {
        case RLSYNC_DT_F64: return cast_f32_f64(f);
        case RLSYNC_DT_F16: return cast_f32_f16(f);
        case RLSYNC_DT_BF16: return cast_f32_bf16(f);
        default: return f;
    }
}

extern "C" __global__ void __launch_bounds__(256) cast_gather(const CastJob* jobs, u32 njobs, u64 total) {
    if (njobs == 0) return;
    u32 j = 0;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += (u64)gridDim.x * blockDim.x) {
        j = find_job(&jobs[0].first, sizeof(CastJob) / 8, j, njobs, g);
        const CastJob job = jobs[j];
        if (g < job.first || g - job.first >= job.numel) continue;  // a gap in the element space
        const u64 i = g - job.first;
        const u32 from = job.codes & 0xFFu, to = (job.codes >> 8) & 0xFFu;
        const u32 sw = cast_width(from), dw = cast_width(to);
        const u64 v = cast_load(job.src + i * sw, sw);
        const u64 out = (from == to || from > RLSYNC_DT_BF16 || to > RLSYNC_DT_BF16) ? v : cast_convert(from, to, v);
        cast_store(job.dst + i * dw, dw, out);
    }
}

// ---- State checksum chunks (s17/devsum): xxh3-64 of whole chunks of device tensors, so a rollout whose
// weights live on the GPU verifies a sync without copying its state to the host. CPU reference:
// gpu/reference/xxh3.rs (follows this block line by line); host side: gpu/checksum.rs, which hashes each
// tensor's last partial chunk on the host and feeds the digests to tensor::StateHasher in order.
//
// - XXH3-64 (seed 0, default secret) of inputs longer than 240 bytes whose length is a multiple of 8, read
//   from 8-byte aligned memory: the algorithm of xxhash's XXH3_hashLong_64b (8 accumulators over 64-byte
//   stripes; a scramble after every 16 stripes; the input's last 64 bytes as a final stripe; the
//   accumulators merged and avalanched). The host uses it for CHECKSUM_CHUNK (1 MiB) chunks only.
// - Eight threads per chunk, one per accumulator. Accumulator i adds stripe word i's 32x32->64 product with
//   its key and stripe word i^1 itself, so each thread loads its own and its neighbour's word (the same
//   16 bytes in one warp instruction: no extra memory traffic) and never waits on another thread until the
//   merge: one shuffle round gathers the eight accumulators in the group's first thread.
// - A warp reads four chunks, 64 contiguous bytes of each per stripe (whole 32-byte sectors); 16 stripes
//   (a scramble block) of loads are independent and issued together.
// - The keys are the secret's words precomputed (XXH3_WORDS: its 24 aligned words; XXH3_LAST and XXH3_MERGE:
//   the unaligned words at byte 121 and 11); gpu/reference/xxh3.rs checks them against the secret.
// -- xxh3 chunks (begin) --
// (host-compiled by a test as well, with __device__ / __forceinline__ / __constant__ / __ldg / __umul64hi
// defined for the host: nothing else CUDA-specific between these markers.)

#define RLSYNC_XXH_PRIME32_1 0x9E3779B1ull
#define RLSYNC_XXH_PRIME64_1 0x9E3779B185EBCA87ull
#define RLSYNC_XXH_PRIME_MX1 0x165667919E3779F9ull

__constant__ u64 XXH3_INIT[8] = {
    0x00000000C2B2AE3Dull, 0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
    0x85EBCA77C2B2AE63ull, 0x0000000085EBCA77ull, 0x27D4EB2F165667C5ull, 0x000000009E3779B1ull,
};
__constant__ u64 XXH3_WORDS[24] = {
    0xBE4BA423396CFEB8ull, 0x1CAD21F72C81017Cull, 0xDB979083E96DD4DEull, 0x1F67B3B7A4A44072ull,
    0x78E5C0CC4EE679CBull, 0x2172FFCC7DD05A82ull, 0x8E2443F7744608B8ull, 0x4C263A81E69035E0ull,
    0xCB00C391BB52283Cull, 0xA32E531B8B65D088ull, 0x4EF90DA297486471ull, 0xD8ACDEA946EF1938ull,
    0x3F349CE33F76FAA8ull, 0x1D4F0BC7C7BBDCF9ull, 0x3159B4CD4BE0518Aull, 0x647378D9C97E9FC8ull,
    0xC3EBD33483ACC5EAull, 0xEB6313FAFFA081C5ull, 0x49DAF0B751DD0D17ull, 0x9E68D429265516D3ull,
    0xFCA1477D58BE162Bull, 0xCE31D07AD1B8F88Full, 0x280416958F3ACB45ull, 0x7E404BBBCAFBD7AFull,
};
__constant__ u64 XXH3_LAST[8] = {
    0xEA647378D9C97E9Full, 0xC5C3EBD33483ACC5ull, 0x17EB6313FAFFA081ull, 0xD349DAF0B751DD0Dull,
    0x2B9E68D429265516ull, 0x8FFCA1477D58BE16ull, 0x45CE31D07AD1B8F8ull, 0xAF280416958F3ACBull,
};
__constant__ u64 XXH3_MERGE[8] = {
    0x6DD4DE1CAD21F72Cull, 0xA44072DB979083E9ull, 0xE679CB1F67B3B7A4ull, 0xD05A8278E5C0CC4Eull,
    0x4608B82172FFCC7Dull, 0x9035E08E2443F774ull, 0x52283C4C263A81E6ull, 0x65D088CB00C391BBull,
};

// One stripe word into accumulator `acc`: its own word `v`, its neighbour's `w`, its key `k`.
__device__ __forceinline__ u64 xxh3_step(u64 acc, u64 v, u64 w, u64 k) {
    const u64 dk = v ^ k;
    return acc + w + (dk & 0xFFFFFFFFull) * (dk >> 32);
}

__device__ __forceinline__ u64 xxh3_scramble(u64 acc, u64 k) {
    acc ^= acc >> 47;
    acc ^= k;
    return acc * RLSYNC_XXH_PRIME32_1;
}

// Accumulator `lane` (0..7) of the input `p[0 .. len / 8)` after its last stripe.
__device__ __forceinline__ u64 xxh3_lane(const u64* p, u64 len, u32 lane) {
    const u32 other = lane ^ 1u;
    u64 acc = XXH3_INIT[lane];
    // This lane's keys in registers: indexed by lane, constant-memory loads would serialise across a warp.
    u64 key[17];
#pragma unroll
    for (u32 i = 0; i < 17; ++i) key[i] = XXH3_WORDS[i + lane];
    const u64 blocks = (len - 1) / 1024;
    for (u64 b = 0; b < blocks; ++b) {
        const u64* s = p + b * 128;
        u64 v[16], w[16];
#pragma unroll
        for (u32 i = 0; i < 16; ++i) {
            v[i] = __ldg(s + i * 8 + lane);
            w[i] = __ldg(s + i * 8 + other);
        }
#pragma unroll
        for (u32 i = 0; i < 16; ++i) acc = xxh3_step(acc, v[i], w[i], key[i]);
        acc = xxh3_scramble(acc, key[16]);
    }
    // The last block's whole stripes (at most 15: the input's last byte is never in one of them)...
    const u64* s = p + blocks * 128;
    const u64 stripes = ((len - 1) - blocks * 1024) / 64;
    for (u64 i = 0; i < stripes; ++i) {
        acc = xxh3_step(acc, __ldg(s + i * 8 + lane), __ldg(s + i * 8 + other), XXH3_WORDS[i + lane]);
    }
    // ... then the input's last 64 bytes with the secret's words at byte 121.
    const u64* last = p + (len / 8 - 8);
    return xxh3_step(acc, __ldg(last + lane), __ldg(last + other), XXH3_LAST[lane]);
}

// The low and high halves of a 64x64-bit product, xored.
__device__ __forceinline__ u64 xxh3_fold(u64 a, u64 b) {
    return (a * b) ^ __umul64hi(a, b);
}

// The digest from the eight accumulators.
__device__ __forceinline__ u64 xxh3_merge(const u64* acc, u64 len) {
    u64 h = len * RLSYNC_XXH_PRIME64_1;
#pragma unroll
    for (u32 i = 0; i < 4; ++i) h += xxh3_fold(acc[2 * i] ^ XXH3_MERGE[2 * i], acc[2 * i + 1] ^ XXH3_MERGE[2 * i + 1]);
    h ^= h >> 37;
    h *= RLSYNC_XXH_PRIME_MX1;
    return h ^ (h >> 32);
}

// -- xxh3 chunks (end) --

// chunks[c] is the device address of chunk c (8-byte aligned), each `len` bytes; out[c] := its xxh3-64.
// Eight consecutive threads per chunk, grid-stride over chunks; launch with 256 threads per block.
extern "C" __global__ void __launch_bounds__(256) xxh3_chunks(const u64* chunks, u64 nchunks, u64 len, u64* out) {
    const u32 lane = threadIdx.x & 7u;
    // The eight threads of a chunk are in one warp and loop alike; other groups of the warp may stop earlier.
    const u32 group = 0xFFu << (threadIdx.x & 24u);
    const u64 step = ((u64)gridDim.x * blockDim.x) >> 3;
    for (u64 c = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 3; c < nchunks; c += step) {
        const u64 acc = xxh3_lane(reinterpret_cast<const u64*>(chunks[c]), len, lane);
        u64 all[8];
#pragma unroll
        for (u32 i = 0; i < 8; ++i) all[i] = __shfl_sync(group, acc, i, 8);
        if (lane == 0) out[c] = xxh3_merge(all, len);
    }
}
