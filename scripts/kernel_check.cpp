// Device check of the committed PTX (crates/rlsync-core/kernels/rlsync.ptx) on a GPU machine: loads it
// through the driver API, runs diff_compact / apply_compact / scatter / checksum_compact for widths 1, 2, 4, 8 on tensors with
// tails, 16-byte-misaligned bases, empty and multi-segment tensors, NaN-like bit changes and an overflowing
// pool, checks every output against a host model of notes/gpu-spec.md, then (without --small) times
// diff_compact against a device-to-device copy of the same bytes; and cast_gather (bucket casts) against a host
// model of its conversions (check_cast); and xxh3_chunks (the state checksum's chunk digests) against an
// independent host XXH3 (check_xxh3).
//
// Build: g++ -O2 -std=c++17 -I$CUDA_HOME/include scripts/kernel_check.cpp -o kernel_check -lcuda
// Run:   ./kernel_check crates/rlsync-core/kernels/rlsync.ptx [--small]
//        (compute-sanitizer --tool memcheck|racecheck ./kernel_check ... --small)
// Prints one JSON object per line; exit status 1 when a check failed.

#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#define CK(x)                                                                                   \
    do {                                                                                        \
        CUresult r_ = (x);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                               \
            const char* s_ = "?";                                                               \
            cuGetErrorString(r_, &s_);                                                          \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, s_);                \
            std::exit(2);                                                                       \
        }                                                                                       \
    } while (0)

struct DiffJob { uint64_t state, snap, numel, first_tile; };
struct TileDir { uint64_t offset; uint32_t count, flags; };
struct ScatterJob { uint64_t dst, first; uint32_t count, mode; };
struct ApplyJob { uint64_t dst, dense_src, numel, first_tile; };

static const uint64_t TILE = 4096, SEGMENT_TILES = 1024;
static int g_failures = 0;
static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd() {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}

static void fail(const char* what, int w, long long a, long long b) {
    if (g_failures++ < 20) std::printf("{\"fail\": \"%s\", \"width\": %d, \"a\": %lld, \"b\": %lld}\n", what, w, a, b);
}

static uint64_t get(const std::vector<uint8_t>& v, uint64_t i, int w) {
    uint64_t x = 0;
    std::memcpy(&x, v.data() + i * w, w);
    return x;
}

struct Mod {
    CUmodule m;
    int sms;
    CUfunction f(const char* name, int w) {
        CUfunction fn;
        std::string n = std::string(name) + "_w" + std::to_string(w);
        CK(cuModuleGetFunction(&fn, m, n.c_str()));
        return fn;
    }
    unsigned grid(CUfunction fn, uint64_t work) {
        int per = 0;
        CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&per, fn, 256, 0));
        uint64_t g = (uint64_t)sms * (per > 0 ? per : 1);
        return (unsigned)std::max<uint64_t>(1, std::min<uint64_t>(g, work));
    }
};

static CUdeviceptr upload(const void* p, size_t n) {
    CUdeviceptr d;
    CK(cuMemAlloc(&d, n ? n : 16));
    if (n) CK(cuMemcpyHtoD(d, p, n));
    return d;
}

// Milliseconds per call of `f` (queued work, waited for): one warm-up, then the mean of 5.
template <typename F>
static double time_ms(F&& f) {
    f();
    CK(cuCtxSynchronize());
    auto a = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; i++) f();
    CK(cuCtxSynchronize());
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count() / 5;
}

struct Tensor {
    uint64_t numel;
    unsigned misalign;  // bytes added to the state's base (breaks 16-byte alignment)
    std::vector<uint8_t> old_, new_;
    CUdeviceptr sbuf, nbuf;
    uint64_t first_tile;
};

// -- checksum_compact (s14/ipcsum): host model of gpu/reference.rs `checksum_compact` --
static uint64_t mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ull;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

struct PoolSum { uint64_t sum, count; };

// `dense`: per job, the updated snapshot's bytes (host copies).
static PoolSum host_checksum(int w, const std::vector<ApplyJob>& jobs, const std::vector<const std::vector<uint8_t>*>& dense,
                             uint64_t tiles, const std::vector<TileDir>& dir, const std::vector<uint32_t>& idx,
                             const std::vector<uint64_t>& vals, uint64_t cap, uint64_t seed, bool full) {
    PoolSum out = {0, 0};
    const uint64_t key = mix64(seed ^ ((uint64_t)w << 48));
    for (uint64_t tile = 0; tile < tiles; ++tile) {
        size_t j = 0;
        for (size_t k = 0; k < jobs.size(); ++k) if (jobs[k].first_tile <= tile) j = k;
        const ApplyJob& job = jobs[j];
        if (tile < job.first_tile) continue;
        uint64_t t = tile - job.first_tile, start = t * TILE;
        if (start >= job.numel) continue;
        uint64_t end = std::min(job.numel, start + TILE), base = job.first_tile * TILE;
        bool dense_tile = full;
        if (full) {
            out.count += end - start;
        } else {
            const TileDir& d = dir[tile];
            out.count += d.count;
            dense_tile = d.flags & 1;
            if (!dense_tile) {
                uint64_t tkey = mix64(key ^ tile), seg_base = (t / SEGMENT_TILES) * (SEGMENT_TILES * TILE);
                for (uint64_t k = 0; k < std::min<uint64_t>(d.count, TILE); ++k) {
                    uint64_t e = d.offset + k;
                    if (e >= cap) continue;
                    uint64_t v0 = w == 8 ? vals[2 * e] : vals[e], v1 = w == 8 ? vals[2 * e + 1] : 0;
                    out.sum += mix64(mix64(mix64(tkey ^ (base + seg_base + idx[e])) ^ v0) ^ v1);
                }
            }
        }
        if (!dense_tile) continue;
        uint64_t tkey = mix64(key ^ tile ^ (1ull << 63));
        for (uint64_t i = start; i < end; ++i) out.sum += mix64(mix64(tkey ^ (base + i)) ^ get(*dense[j], i, w));
    }
    return out;
}

// Run checksum_compact_w{w} over (dir, idx, vals) with the jobs' dense sources; (sum, count).
static PoolSum device_checksum(Mod& md, int w, CUdeviceptr jobs, uint32_t nj, uint64_t tiles, CUdeviceptr dir,
                               CUdeviceptr idx, CUdeviceptr vals, uint64_t cap, uint64_t seed, bool full,
                               CUdeviceptr out) {
    CUfunction fn = md.f("checksum_compact", w);
    uint32_t f = full ? 1 : 0;
    CK(cuMemsetD8(out, 0, 16));
    void* args[] = {&jobs, &nj, &tiles, &dir, &idx, &vals, &cap, &seed, &f, &out};
    CK(cuLaunchKernel(fn, md.grid(fn, tiles), 1, 1, 256, 1, 1, 0, 0, args, nullptr));
    CK(cuCtxSynchronize());
    PoolSum r;
    CK(cuMemcpyDtoH(&r, out, 16));
    return r;
}
// -- checksum_compact (end) --

// One width: diff (pool ample or a third of the changes), apply_compact, scatter (set and add).
static void check_width(Mod& md, int w, bool small, bool short_pool) {
    std::vector<uint64_t> numels = {0, 1, 15, 4096, 4097, 70001, 4097, 33};
    if (!small) numels.push_back((1ull << 22) * 2 + 5000);
    std::vector<Tensor> ts(numels.size());
    uint64_t tiles = 0;
    for (size_t k = 0; k < ts.size(); ++k) {
        Tensor& t = ts[k];
        t.numel = numels[k];
        t.misalign = (k == 5 && w < 16) ? (unsigned)w : 0;
        t.old_.resize(t.numel * w);
        for (auto& b : t.old_) b = (uint8_t)rnd();
        t.new_ = t.old_;
        uint64_t per_mille = k == 6 ? 1000 : (k == 7 ? 0 : 20);
        for (uint64_t i = 0; i < t.numel; ++i) {
            if (rnd() % 1000 < per_mille) {
                uint64_t bit = rnd() % (8 * w);
                t.new_[i * w + bit / 8] ^= (uint8_t)(1u << (bit % 8));
            }
        }
        t.first_tile = tiles;
        tiles += (t.numel + TILE - 1) / TILE;
        CK(cuMemAlloc(&t.sbuf, t.numel * w + 64));
        CK(cuMemAlloc(&t.nbuf, t.numel * w + 64));
        if (t.numel) {
            CK(cuMemcpyHtoD(t.sbuf + t.misalign, t.new_.data(), t.numel * w));
            CK(cuMemcpyHtoD(t.nbuf, t.old_.data(), t.numel * w));
        }
    }
    // Expected entries per tile: (segment-relative index, old, new).
    struct E { uint32_t idx; uint64_t o, n; };
    std::vector<std::vector<E>> want(tiles);
    uint64_t total = 0;
    for (auto& t : ts) {
        for (uint64_t i = 0; i < t.numel; ++i) {
            uint64_t o = get(t.old_, i, w), n = get(t.new_, i, w);
            if (o != n) {
                uint64_t tt = i / TILE;
                want[t.first_tile + tt].push_back({(uint32_t)((tt % SEGMENT_TILES) * TILE + i % TILE), o, n});
                ++total;
            }
        }
    }
    uint64_t cap = short_pool ? total / 3 : total + 7;
    int per = w == 8 ? 2 : 1;
    std::vector<DiffJob> jobs;
    for (auto& t : ts) jobs.push_back({t.sbuf + t.misalign, t.nbuf, t.numel, t.first_tile});
    CUdeviceptr djobs = upload(jobs.data(), jobs.size() * sizeof(DiffJob));
    CUdeviceptr didx, dvals, dcur, ddir;
    CK(cuMemAlloc(&didx, cap * 4 + 16));
    CK(cuMemAlloc(&dvals, cap * 8 * per + 16));
    CK(cuMemAlloc(&dcur, 8));
    CK(cuMemAlloc(&ddir, tiles * sizeof(TileDir) + 16));
    CK(cuMemsetD8(dcur, 0, 8));
    CK(cuMemsetD8(ddir, 0xAB, tiles * sizeof(TileDir)));
    CUfunction diff = md.f("diff_compact", w);
    uint32_t nj = (uint32_t)jobs.size();
    void* args[] = {&djobs, &nj, &tiles, &didx, &dvals, &cap, &dcur, &ddir};
    CK(cuLaunchKernel(diff, md.grid(diff, tiles), 1, 1, 256, 1, 1, 0, 0, args, nullptr));
    CK(cuCtxSynchronize());
    std::vector<TileDir> dir(tiles);
    std::vector<uint32_t> idx(cap + 1);
    std::vector<uint64_t> vals((cap + 1) * per);
    uint64_t cursor = 0;
    CK(cuMemcpyDtoH(&cursor, dcur, 8));
    if (tiles) CK(cuMemcpyDtoH(dir.data(), ddir, tiles * sizeof(TileDir)));
    if (cap) CK(cuMemcpyDtoH(idx.data(), didx, cap * 4));
    if (cap) CK(cuMemcpyDtoH(vals.data(), dvals, cap * 8 * per));
    if (cursor != total) fail("cursor", w, (long long)cursor, (long long)total);
    uint64_t overflowed = 0, listed = 0;
    std::vector<uint8_t> used(cap, 0);
    for (uint64_t tile = 0; tile < tiles; ++tile) {
        const TileDir& d = dir[tile];
        const auto& e = want[tile];
        if (d.count != e.size()) { fail("count", w, (long long)tile, d.count); continue; }
        if (d.flags == 1) {
            ++overflowed;
            if (!short_pool || d.offset != 0) fail("overflow", w, (long long)tile, (long long)d.offset);
            continue;
        }
        if (d.flags != 0) { fail("flags", w, (long long)tile, d.flags); continue; }
        if (e.empty()) { if (d.offset != 0) fail("empty offset", w, (long long)tile, (long long)d.offset); continue; }
        if (d.offset + d.count > cap) { fail("offset", w, (long long)tile, (long long)d.offset); continue; }
        for (uint32_t k = 0; k < d.count; ++k) {
            uint64_t s = d.offset + k;
            if (used[s]++) fail("pool slot twice", w, (long long)tile, (long long)s);
            uint64_t o = w == 8 ? vals[2 * s] : (vals[s] & 0xffffffffull);
            uint64_t n = w == 8 ? vals[2 * s + 1] : (vals[s] >> 32);
            if (idx[s] != e[k].idx || o != e[k].o || n != e[k].n) {
                fail("entry", w, (long long)tile, (long long)k);
                break;
            }
        }
        listed += d.count;
    }
    if (short_pool && total > 3 && overflowed == 0) fail("no overflow with a short pool", w, 0, 0);
    for (auto& t : ts) {
        std::vector<uint8_t> snap(t.numel * w);
        if (t.numel) CK(cuMemcpyDtoH(snap.data(), t.nbuf, t.numel * w));
        if (snap != t.new_) fail("snapshot", w, (long long)t.numel, 0);
    }
    // apply_compact into a copy of the old state; overflowing tiles from the updated snapshot.
    std::vector<ApplyJob> aj;
    std::vector<CUdeviceptr> recv;
    for (auto& t : ts) {
        CUdeviceptr r = upload(t.old_.data(), t.numel * w);
        recv.push_back(r);
        aj.push_back({r, t.nbuf, t.numel, t.first_tile});
    }
    CUdeviceptr dajobs = upload(aj.data(), aj.size() * sizeof(ApplyJob));
    CUfunction apply = md.f("apply_compact", w);
    void* aargs[] = {&dajobs, &nj, &tiles, &ddir, &didx, &dvals};
    CK(cuLaunchKernel(apply, md.grid(apply, tiles), 1, 1, 256, 1, 1, 0, 0, aargs, nullptr));
    CK(cuCtxSynchronize());
    for (size_t k = 0; k < ts.size(); ++k) {
        std::vector<uint8_t> got(ts[k].numel * w);
        if (ts[k].numel) CK(cuMemcpyDtoH(got.data(), recv[k], got.size()));
        if (got != ts[k].new_) fail("apply_compact", w, (long long)k, 0);
    }
    // checksum_compact (s14/ipcsum): patch and full mode against the host model; a flipped index bit of a
    // used entry and another seed change the sum.
    {
        std::vector<const std::vector<uint8_t>*> dense;
        for (auto& t : ts) dense.push_back(&t.new_);
        CUdeviceptr dout;
        CK(cuMemAlloc(&dout, 16));
        for (bool full : {false, true}) {
            PoolSum want_s = host_checksum(w, aj, dense, tiles, dir, idx, vals, cap, 42, full);
            PoolSum got_s = device_checksum(md, w, dajobs, nj, tiles, ddir, didx, dvals, cap, 42, full, dout);
            if (got_s.sum != want_s.sum) fail(full ? "checksum full sum" : "checksum sum", w, (long long)got_s.sum, (long long)want_s.sum);
            if (got_s.count != want_s.count) fail(full ? "checksum full count" : "checksum count", w, (long long)got_s.count, (long long)want_s.count);
            if (!full && got_s.count != total) fail("checksum count vs cursor", w, (long long)got_s.count, (long long)total);
            PoolSum stale = device_checksum(md, w, dajobs, nj, tiles, ddir, didx, dvals, cap, 41, full, dout);
            if (want_s.count && stale.sum == got_s.sum) fail("checksum stale seed", w, 0, 0);
        }
        uint64_t e = ~0ull;
        for (uint64_t tile = 0; tile < tiles && e == ~0ull; ++tile)
            if (dir[tile].flags == 0 && dir[tile].count) e = dir[tile].offset;
        if (e != ~0ull) {
            PoolSum good = device_checksum(md, w, dajobs, nj, tiles, ddir, didx, dvals, cap, 42, false, dout);
            uint32_t flipped = idx[e] ^ 8u;
            CK(cuMemcpyHtoD(didx + e * 4, &flipped, 4));
            PoolSum bad = device_checksum(md, w, dajobs, nj, tiles, ddir, didx, dvals, cap, 42, false, dout);
            if (bad.sum == good.sum) fail("checksum flipped idx", w, (long long)e, 0);
            CK(cuMemcpyHtoD(didx + e * 4, &idx[e], 4));
        }
        CK(cuMemFree(dout));
    }
    // scatter, set and add, every change of every tensor (jobs of empty tensors have count 0).
    for (uint32_t mode = 0; mode < 2; ++mode) {
        std::vector<ScatterJob> sj;
        std::vector<uint32_t> sidx;
        std::vector<uint64_t> svals;
        std::vector<CUdeviceptr> dst;
        for (auto& t : ts) {
            CUdeviceptr r = upload(t.old_.data(), t.numel * w);
            dst.push_back(r);
            uint64_t first = sidx.size();
            // The first half of the tensor as one job, the rest as another (base offset in dst).
            uint64_t half = t.numel / 2;
            for (int part = 0; part < 2; ++part) {
                uint64_t lo = part ? half : 0, hi = part ? t.numel : half;
                first = sidx.size();
                for (uint64_t i = lo; i < hi; ++i) {
                    uint64_t o = get(t.old_, i, w), n = get(t.new_, i, w);
                    if (o == n) continue;
                    sidx.push_back((uint32_t)(i - lo));
                    svals.push_back(mode ? n - o : n);
                }
                sj.push_back({r + lo * w, first, (uint32_t)(sidx.size() - first), mode});
            }
        }
        uint64_t stotal = sidx.size();
        CUdeviceptr dsj = upload(sj.data(), sj.size() * sizeof(ScatterJob));
        CUdeviceptr dsi = upload(sidx.data(), sidx.size() * 4);
        CUdeviceptr dsv = upload(svals.data(), svals.size() * 8);
        CUfunction sc = md.f("scatter", w);
        uint32_t nsj = (uint32_t)sj.size();
        void* sargs[] = {&dsj, &nsj, &stotal, &dsi, &dsv};
        CK(cuLaunchKernel(sc, md.grid(sc, (stotal + 255) / 256), 1, 1, 256, 1, 1, 0, 0, sargs, nullptr));
        CK(cuCtxSynchronize());
        for (size_t k = 0; k < ts.size(); ++k) {
            std::vector<uint8_t> got(ts[k].numel * w);
            if (ts[k].numel) CK(cuMemcpyDtoH(got.data(), dst[k], got.size()));
            if (got != ts[k].new_) fail(mode ? "scatter add" : "scatter set", w, (long long)k, 0);
            CK(cuMemFree(dst[k]));
        }
        CK(cuMemFree(dsj));
        CK(cuMemFree(dsi));
        CK(cuMemFree(dsv));
    }
    std::printf("{\"check\": \"width\", \"width\": %d, \"short_pool\": %s, \"tiles\": %llu, \"changes\": %llu, "
                "\"listed\": %llu, \"overflowed_tiles\": %llu, \"failures_so_far\": %d}\n",
                w, short_pool ? "true" : "false", (unsigned long long)tiles, (unsigned long long)total,
                (unsigned long long)listed, (unsigned long long)overflowed, g_failures);
    for (size_t k = 0; k < ts.size(); ++k) {
        CK(cuMemFree(ts[k].sbuf));
        CK(cuMemFree(ts[k].nbuf));
        CK(cuMemFree(recv[k]));
    }
    CK(cuMemFree(djobs));
    CK(cuMemFree(dajobs));
    CK(cuMemFree(didx));
    CK(cuMemFree(dvals));
    CK(cuMemFree(dcur));
    CK(cuMemFree(ddir));
}

// diff_compact on `bytes` of width-w elements at `per_mille` density vs a D2D copy of the same bytes; and
// apply_compact of its output.
static void bench(Mod& md, int w, uint64_t bytes, uint64_t per_mille) {
    uint64_t n = bytes / w, tiles = (n + TILE - 1) / TILE;
    CUdeviceptr state, base, snap, recv;
    CK(cuMemAlloc(&state, bytes));
    CK(cuMemAlloc(&base, bytes));
    CK(cuMemAlloc(&snap, bytes));
    CK(cuMemAlloc(&recv, bytes));
    // One host buffer for every bench (filled once: drawing 2 GiB of random bytes per bench took most of the
    // stage's time on the H100 machine); each bench flips its own changes into it.
    static std::vector<uint8_t> h;
    if (h.size() < bytes) {
        h.resize(bytes);
        for (size_t i = 0; i < bytes; i += 8) {
            uint64_t r = rnd();
            std::memcpy(&h[i], &r, std::min<size_t>(8, bytes - i));
        }
    }
    CK(cuMemcpyHtoD(base, h.data(), bytes));
    // Changed elements at random gaps of 1 .. 2m - 1 (mean m = 1000 / per_mille): the density without one
    // random draw per element.
    uint64_t changes = 0;
    if (per_mille) {
        uint64_t m = 1000 / per_mille;
        for (uint64_t i = rnd() % (2 * m); i < n; i += 1 + rnd() % (2 * m - 1)) {
            h[i * w] ^= 1;
            ++changes;
        }
    }
    CK(cuMemcpyHtoD(state, h.data(), bytes));
    uint64_t cap = changes + 1024;
    int per = w == 8 ? 2 : 1;
    CUdeviceptr didx, dvals, dcur, ddir;
    CK(cuMemAlloc(&didx, cap * 4));
    CK(cuMemAlloc(&dvals, cap * 8 * per));
    CK(cuMemAlloc(&dcur, 8));
    CK(cuMemAlloc(&ddir, tiles * sizeof(TileDir)));
    DiffJob job = {state, snap, n, 0};
    CUdeviceptr djob = upload(&job, sizeof job);
    CUfunction diff = md.f("diff_compact", w);
    ApplyJob aj = {recv, snap, n, 0};
    CUdeviceptr dajob = upload(&aj, sizeof aj);
    CUfunction apply = md.f("apply_compact", w);
    unsigned grid = md.grid(diff, tiles), agrid = md.grid(apply, tiles);
    CUfunction csum = md.f("checksum_compact", w);
    unsigned cgrid = md.grid(csum, tiles);
    CUdeviceptr dsum;
    CK(cuMemAlloc(&dsum, 16));
    uint32_t one = 1;
    CUevent a, b;
    CK(cuEventCreate(&a, 0));
    CK(cuEventCreate(&b, 0));
    std::vector<float> tk, tc, ta, ts_, tf;
    auto timed = [&](auto&& launch, std::vector<float>& into, bool keep) {
        float ms = 0;
        CK(cuEventRecord(a, 0));
        launch();
        CK(cuEventRecord(b, 0));
        CK(cuEventSynchronize(b));
        CK(cuEventElapsedTime(&ms, a, b));
        if (keep) into.push_back(ms);
    };
    for (int it = 0; it < 6; ++it) {
        CK(cuMemcpyDtoD(snap, base, bytes));
        CK(cuMemsetD8(dcur, 0, 8));
        CK(cuCtxSynchronize());
        void* args[] = {&djob, &one, &tiles, &didx, &dvals, &cap, &dcur, &ddir};
        timed([&] { CK(cuLaunchKernel(diff, grid, 1, 1, 256, 1, 1, 0, 0, args, nullptr)); }, tk, it > 0);
        timed([&] { CK(cuMemcpyDtoDAsync(recv, state, bytes, 0)); }, tc, it > 0);
        CK(cuMemcpyDtoD(recv, base, bytes));
        CK(cuCtxSynchronize());
        void* aargs[] = {&dajob, &one, &tiles, &ddir, &didx, &dvals};
        timed([&] { CK(cuLaunchKernel(apply, agrid, 1, 1, 256, 1, 1, 0, 0, aargs, nullptr)); }, ta, it > 0);
        // The GPU channel's pool checksum (per sync, both ends) and its full mode (full copies).
        for (uint32_t full : {0u, 1u}) {
            uint64_t seed = 7;
            void* cargs[] = {&dajob, &one, &tiles, &ddir, &didx, &dvals, &cap, &seed, &full, &dsum};
            CK(cuMemsetD8(dsum, 0, 16));
            timed([&] { CK(cuLaunchKernel(csum, cgrid, 1, 1, 256, 1, 1, 0, 0, cargs, nullptr)); }, full ? tf : ts_, it > 0);
        }
    }
    uint64_t sums[2] = {0, 0};
    CK(cuMemcpyDtoH(sums, dsum, 16));
    if (sums[1] != n) fail("bench checksum full count", w, (long long)sums[1], (long long)n);
    uint64_t cursor = 0;
    CK(cuMemcpyDtoH(&cursor, dcur, 8));
    if (cursor != changes) fail("bench cursor", w, (long long)cursor, (long long)changes);
    std::vector<uint8_t> got(bytes);
    CK(cuMemcpyDtoH(got.data(), recv, bytes));
    if (std::memcmp(got.data(), h.data(), bytes) != 0) fail("bench apply", w, 0, 0);
    std::sort(tk.begin(), tk.end());
    std::sort(tc.begin(), tc.end());
    std::sort(ta.begin(), ta.end());
    std::sort(ts_.begin(), ts_.end());
    std::sort(tf.begin(), tf.end());
    int regs = 0;
    CK(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, diff));
    float k = tk[tk.size() / 2], c = tc[tc.size() / 2];
    std::printf("{\"bench\": \"diff_compact\", \"width\": %d, \"bytes\": %llu, \"density\": %.4f, "
                "\"changes\": %llu, \"grid\": %u, \"regs\": %d, \"diff_ms\": %.3f, \"d2d_copy_ms\": %.3f, "
                "\"ratio\": %.3f, \"apply_ms\": %.3f, \"diff_read_gbps\": %.1f, \"checksum_ms\": %.3f, "
                "\"checksum_full_ms\": %.3f}\n",
                w, (unsigned long long)bytes, n ? (double)changes / n : 0.0, (unsigned long long)changes, grid, regs, k,
                c, k / c, ta[ta.size() / 2], 2.0 * bytes / (k * 1e6), ts_[ts_.size() / 2], tf[tf.size() / 2]);
    for (CUdeviceptr p : {state, base, snap, recv, didx, dvals, dcur, ddir, djob, dajob, dsum}) CK(cuMemFree(p));
    CK(cuEventDestroy(a));
    CK(cuEventDestroy(b));
}

// ---- cast_gather (bucket casts): a host model of the conversions (the same bit operations as
// gpu/reference/cast.rs, which is tested bit for bit against the host's cast_bytes), checked on every
// f16 / bf16 pattern and on random f32 / f64 bits, in one launch of many jobs with raw copies among them;
// then (without --small) a 1 GiB f32 -> bf16 pack timed against a D2D copy of the same source bytes.
struct CastJob { uint64_t src, dst, first, numel; uint32_t codes, pad; };
enum { DT_F64 = 0, DT_F32 = 1, DT_F16 = 2, DT_BF16 = 3, DT_RAW1 = 4, DT_RAW2 = 5, DT_RAW4 = 6, DT_RAW8 = 7 };
static int cwidth(uint32_t c) { return (c == DT_F64 || c == DT_RAW8) ? 8 : (c == DT_F32 || c == DT_RAW4) ? 4 : (c == DT_RAW1) ? 1 : 2; }
static uint32_t h_f32_bf16(uint32_t b) {
    uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    return (b & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFFu : (r & 0xFFFFu);
}
static uint32_t h_f16_f32(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16, exp = h & 0x7C00u, man = h & 0x03FFu;
    if ((h & 0x7FFFu) == 0) return sign;
    if (exp == 0x7C00u) return man == 0 ? (sign | 0x7F800000u) : (sign | 0x7FC00000u | (man << 13));
    if (exp == 0) { uint32_t p = 31u - (uint32_t)__builtin_clz(man); return sign | ((p + 103u) << 23) | ((man << (23u - p)) & 0x7FFFFFu); }
    return sign | (((exp >> 10) + 112u) << 23) | (man << 13);
}
static uint32_t h_f32_f16(uint32_t x) {
    uint32_t sign = (x & 0x80000000u) >> 16, exp = x & 0x7F800000u, man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) return sign | 0x7C00u | (man != 0 ? 0x0200u : 0u) | (man >> 13);
    int he = (int)(exp >> 23) - 127 + 15;
    if (he >= 0x1F) return sign | 0x7C00u;
    if (he <= 0) {
        if (14 - he > 24) return sign;
        uint32_t m = man | 0x00800000u, hm = m >> (14 - he), rb = 1u << (13 - he);
        if ((m & rb) != 0 && (m & (3u * rb - 1u)) != 0) hm += 1;
        return sign | hm;
    }
    uint32_t v = sign | ((uint32_t)he << 10) | (man >> 13), rb = 0x1000u;
    return ((man & rb) != 0 && (man & (3u * rb - 1u)) != 0) ? v + 1 : v;
}
static uint64_t h_rne(uint64_t m, uint32_t s) {
    uint64_t r = m >> s, rem = m & ((1ull << s) - 1), half = 1ull << (s - 1);
    return (rem > half || (rem == half && (r & 1))) ? r + 1 : r;
}
static uint32_t h_f64_f32(uint64_t x) {
    uint32_t sign = (uint32_t)(x >> 32) & 0x80000000u, exp = (uint32_t)(x >> 52) & 0x7FFu;
    uint64_t man = x & 0x000FFFFFFFFFFFFFull;
    if (exp == 0x7FFu) return man == 0 ? (sign | 0x7F800000u) : (sign | 0x7FC00000u | (uint32_t)(man >> 29));
    if (exp == 0) return sign;
    int e = (int)exp - 1023 + 127;
    uint64_t m = man | (1ull << 52);
    if (e >= 0xFF) return sign | 0x7F800000u;
    if (e >= 1) return sign + (((uint32_t)(e - 1)) << 23) + (uint32_t)h_rne(m, 29);
    uint32_t s = 29u + (uint32_t)(1 - e);
    return s >= 54 ? sign : (sign | (uint32_t)h_rne(m, s));
}
static uint64_t h_f32_f64(uint32_t x) {
    uint64_t sign = (uint64_t)(x & 0x80000000u) << 32;
    uint32_t exp = (x >> 23) & 0xFFu, man = x & 0x7FFFFFu;
    if (exp == 0xFFu) return man == 0 ? (sign | 0x7FF0000000000000ull) : (sign | 0x7FF8000000000000ull | ((uint64_t)man << 29));
    if (exp == 0) {
        if (man == 0) return sign;
        uint32_t p = 31u - (uint32_t)__builtin_clz(man);
        return sign | ((uint64_t)(p + 874u) << 52) | (((uint64_t)man << (52u - p)) & 0x000FFFFFFFFFFFFFull);
    }
    return sign | ((uint64_t)(exp + 896u) << 52) | ((uint64_t)man << 29);
}
static uint64_t h_convert(uint32_t from, uint32_t to, uint64_t bits) {
    if (from == to || from > DT_BF16 || to > DT_BF16) return bits;
    if (from == DT_F16 && to == DT_BF16 && (bits & 0x7C00u) == 0x7C00u && (bits & 0x03FFu) != 0) return 0x7FC0u;
    uint32_t f = from == DT_F64 ? h_f64_f32(bits) : from == DT_F16 ? h_f16_f32((uint32_t)bits)
               : from == DT_BF16 ? (uint32_t)bits << 16 : (uint32_t)bits;
    return to == DT_F64 ? h_f32_f64(f) : to == DT_F16 ? h_f32_f16(f) : to == DT_BF16 ? h_f32_bf16(f) : f;
}

static void check_cast(Mod& md, bool small) {
    CUfunction fn;
    CK(cuModuleGetFunction(&fn, md.m, "cast_gather"));
    struct Spec { uint32_t from, to; uint64_t n; bool all16; };
    std::vector<Spec> specs;
    for (uint32_t from : {DT_F16, DT_BF16})
        for (uint32_t to : {DT_F64, DT_F32, DT_F16, DT_BF16}) specs.push_back({from, to, 65536, true});
    uint64_t rn = small ? 4096 : 1 << 20;
    for (uint32_t from : {DT_F32, DT_F64})
        for (uint32_t to : {DT_F64, DT_F32, DT_F16, DT_BF16}) specs.push_back({from, to, rn, false});
    specs.push_back({DT_RAW1, DT_RAW1, 1001, false});
    specs.push_back({DT_RAW8, DT_RAW8, 77, false});
    specs.push_back({DT_F32, DT_BF16, 0, false});
    std::vector<CastJob> jobs;
    std::vector<std::vector<uint8_t>> srcs;
    std::vector<CUdeviceptr> dsts;
    uint64_t first = 0;
    for (const Spec& sp : specs) {
        int sw = cwidth(sp.from), dw = cwidth(sp.to);
        std::vector<uint8_t> src(sp.n * sw);
        for (uint64_t i = 0; i < sp.n; i++) {
            uint64_t v = sp.all16 ? i : rnd();
            if (!sp.all16 && i % 7 == 0) v &= 0xFFF0000000000000ull | 0x7FF0000000000000ull;  // specials: zeros, infs, NaN exps
            std::memcpy(src.data() + i * sw, &v, sw);
        }
        CUdeviceptr s = upload(src.data(), src.size()), d;
        CK(cuMemAlloc(&d, sp.n * dw ? sp.n * dw : 16));
        if (sp.n) jobs.push_back({s, d, first, sp.n, sp.from | sp.to << 8, 0});
        first += sp.n;
        srcs.push_back(src);
        dsts.push_back(d);
    }
    CUdeviceptr jd = upload(jobs.data(), jobs.size() * sizeof(CastJob));
    uint32_t nj = (uint32_t)jobs.size();
    uint64_t total = first;
    void* args[] = {&jd, &nj, &total};
    CK(cuLaunchKernel(fn, md.grid(fn, (total + 255) / 256), 1, 1, 256, 1, 1, 0, 0, args, nullptr));
    CK(cuCtxSynchronize());
    int bad = 0;
    for (size_t k = 0; k < specs.size(); k++) {
        const Spec& sp = specs[k];
        int sw = cwidth(sp.from), dw = cwidth(sp.to);
        std::vector<uint8_t> got(sp.n * dw);
        if (sp.n) CK(cuMemcpyDtoH(got.data(), dsts[k], got.size()));
        for (uint64_t i = 0; i < sp.n; i++) {
            uint64_t v = get(srcs[k], i, sw), want = h_convert(sp.from, sp.to, v), g = get(got, i, dw);
            uint64_t mask = dw == 8 ? ~0ull : ((1ull << (8 * dw)) - 1);
            if ((want & mask) != g) {
                if (bad++ < 5) fail("cast_gather", (int)(sp.from * 10 + sp.to), (long long)v, (long long)g);
            }
        }
        CK(cuMemFree(dsts[k]));
    }
    std::printf("{\"check\": \"cast_gather\", \"jobs\": %u, \"elements\": %llu, \"mismatches\": %d}\n", nj,
                (unsigned long long)total, bad);
    CK(cuMemFree(jd));
    if (small) return;
    // 1 GiB of f32 packed to bf16 vs a D2D copy of the same source bytes.
    uint64_t n = (1ull << 30) / 4;
    CUdeviceptr s, d, c;
    CK(cuMemAlloc(&s, n * 4));
    CK(cuMemAlloc(&d, n * 2));
    CK(cuMemAlloc(&c, n * 4));
    CK(cuMemsetD8(s, 0x3F, n * 4));
    CastJob j = {s, d, 0, n, DT_F32 | DT_BF16 << 8, 0};
    jd = upload(&j, sizeof j);
    nj = 1;
    total = n;
    double cast_ms = time_ms([&] { CK(cuLaunchKernel(fn, md.grid(fn, (total + 255) / 256), 1, 1, 256, 1, 1, 0, 0, args, nullptr)); });
    double copy_ms = time_ms([&] { CK(cuMemcpyDtoD(c, s, n * 4)); });
    std::printf("{\"bench\": \"cast_gather_f32_bf16\", \"src_bytes\": %llu, \"cast_ms\": %.3f, \"d2d_copy_ms\": %.3f, \"ratio\": %.2f}\n",
                (unsigned long long)(n * 4), cast_ms, copy_ms, cast_ms / copy_ms);
    CK(cuMemFree(s));
    CK(cuMemFree(d));
    CK(cuMemFree(c));
    CK(cuMemFree(jd));
}

// ---- xxh3_chunks (s17/devsum): an independent host model, xxhash's scalar XXH3_hashLong_64b with the default
// secret (not the kernel's lane structure, which cargo test checks on the host), against the kernel's digests of
// 1 MiB chunks at many addresses and of other lengths; then (without --small) 4 GiB of chunks timed against a
// D2D copy of the same bytes.
static const uint8_t XXH_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
    0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67,
    0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72,
    0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26,
    0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e,
    0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac,
    0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f,
    0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73,
    0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63,
    0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68,
    0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31,
    0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40,
    0x7e,
};
static uint64_t rd64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}
static void h_acc512(uint64_t acc[8], const uint8_t* in, const uint8_t* sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = rd64(in + 8 * i), k = v ^ rd64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFull) * (k >> 32);
    }
}
static uint64_t h_xxh3(const uint8_t* in, uint64_t len) {
    uint64_t acc[8] = {0xC2B2AE3Dull, 0x9E3779B185EBCA87ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                       0x85EBCA77C2B2AE63ull, 0x85EBCA77ull, 0x27D4EB2F165667C5ull, 0x9E3779B1ull};
    const uint64_t per_block = (192 - 64) / 8, block = 64 * per_block, blocks = (len - 1) / block;
    for (uint64_t b = 0; b < blocks; b++) {
        for (uint64_t s = 0; s < per_block; s++) h_acc512(acc, in + b * block + s * 64, XXH_SECRET + s * 8);
        for (int i = 0; i < 8; i++) {
            acc[i] ^= acc[i] >> 47;
            acc[i] ^= rd64(XXH_SECRET + 128 + 8 * i);
            acc[i] *= 0x9E3779B1ull;
        }
    }
    const uint64_t stripes = ((len - 1) - block * blocks) / 64;
    for (uint64_t s = 0; s < stripes; s++) h_acc512(acc, in + blocks * block + s * 64, XXH_SECRET + s * 8);
    h_acc512(acc, in + len - 64, XXH_SECRET + 192 - 64 - 7);
    uint64_t h = len * 0x9E3779B185EBCA87ull;
    for (int i = 0; i < 4; i++) {
        unsigned __int128 p = (unsigned __int128)(acc[2 * i] ^ rd64(XXH_SECRET + 11 + 16 * i)) *
                              (acc[2 * i + 1] ^ rd64(XXH_SECRET + 11 + 16 * i + 8));
        h += (uint64_t)p ^ (uint64_t)(p >> 64);
    }
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    return h ^ (h >> 32);
}

// xxh3_chunks over `addrs` (device addresses) of `len` bytes each, on `grid` blocks (0: as rlsync sizes it);
// the digests.
static std::vector<uint64_t> run_xxh3(Mod& md, CUfunction fn, const std::vector<uint64_t>& addrs, uint64_t len,
                                      unsigned grid) {
    uint64_t n = addrs.size();
    CUdeviceptr table = upload(addrs.data(), n * 8), out;
    CK(cuMemAlloc(&out, n ? n * 8 : 16));
    void* args[] = {&table, &n, &len, &out};
    if (grid == 0) grid = md.grid(fn, (n * 8 + 255) / 256);
    CK(cuLaunchKernel(fn, grid, 1, 1, 256, 1, 1, 0, 0, args, nullptr));
    CK(cuCtxSynchronize());
    std::vector<uint64_t> got(n);
    if (n) CK(cuMemcpyDtoH(got.data(), out, n * 8));
    CK(cuMemFree(table));
    CK(cuMemFree(out));
    return got;
}

static void check_xxh3(Mod& md, bool small) {
    CUfunction fn;
    CK(cuModuleGetFunction(&fn, md.m, "xxh3_chunks"));
    const uint64_t MiB = 1ull << 20;
    // One buffer of 37 MiB + 8 bytes (300 without --small): 1 MiB chunks at every MiB (on one block: 32 chunks
    // at a time, so the grid-stride loop is taken) and at 8 bytes past each, and other lengths.
    uint64_t chunks = small ? 37 : 300;
    std::vector<uint8_t> host(chunks * MiB + 8);
    for (size_t i = 0; i < host.size(); i += 8) {
        uint64_t v = rnd();
        std::memcpy(host.data() + i, &v, std::min<size_t>(8, host.size() - i));
    }
    CUdeviceptr buf = upload(host.data(), host.size());
    int bad = 0, checked = 0;
    auto check = [&](const std::vector<uint64_t>& offs, uint64_t len, unsigned grid) {
        std::vector<uint64_t> addrs;
        for (uint64_t o : offs) addrs.push_back(buf + o);
        std::vector<uint64_t> got = run_xxh3(md, fn, addrs, len, grid);
        for (size_t k = 0; k < offs.size(); k++) {
            uint64_t want = h_xxh3(host.data() + offs[k], len);
            checked++;
            if (got[k] != want && bad++ < 5) fail("xxh3_chunks", (int)len, (long long)want, (long long)got[k]);
        }
    };
    std::vector<uint64_t> whole, shifted;
    for (uint64_t c = 0; c < chunks; c++) whole.push_back(c * MiB);
    for (uint64_t c = 0; c < chunks; c++) shifted.push_back(c * MiB + 8);
    check(whole, MiB, 1);
    check(shifted, MiB, 0);
    for (uint64_t len : std::vector<uint64_t>{248, 1024, 1032, 4096 + 8 * 37, 3 * MiB + 64}) check({0, 8, 4096, 8 * MiB}, len, 0);
    std::printf("{\"check\": \"xxh3_chunks\", \"digests\": %d, \"mismatches\": %d}\n", checked, bad);
    CK(cuMemFree(buf));
    if (small) return;
    // 4 GiB as 4096 chunks of 1 MiB vs a D2D copy of the same bytes (a copy reads and writes them).
    const uint64_t n = 4096, bytes = n * MiB;
    CUdeviceptr src, dst;
    CK(cuMemAlloc(&src, bytes));
    CK(cuMemAlloc(&dst, bytes));
    CK(cuMemsetD8(src, 0x5A, bytes));
    std::vector<uint64_t> addrs;
    for (uint64_t c = 0; c < n; c++) addrs.push_back(src + c * MiB);
    CUdeviceptr table = upload(addrs.data(), n * 8), out;
    CK(cuMemAlloc(&out, n * 8));
    uint64_t nn = n, len = MiB;
    void* args[] = {&table, &nn, &len, &out};
    unsigned grid = md.grid(fn, (n * 8 + 255) / 256);
    double hash_ms = time_ms([&] { CK(cuLaunchKernel(fn, grid, 1, 1, 256, 1, 1, 0, 0, args, nullptr)); });
    double copy_ms = time_ms([&] { CK(cuMemcpyDtoD(dst, src, bytes)); });
    std::printf("{\"bench\": \"xxh3_chunks\", \"bytes\": %llu, \"grid\": %u, \"hash_ms\": %.3f, \"hash_gb_s\": %.1f, "
                "\"d2d_copy_ms\": %.3f, \"ratio\": %.2f}\n",
                (unsigned long long)bytes, grid, hash_ms, bytes / hash_ms / 1e6, copy_ms, hash_ms / copy_ms);
    CK(cuMemFree(table));
    CK(cuMemFree(out));
    CK(cuMemFree(src));
    CK(cuMemFree(dst));
}

int main(int argc, char** argv) {
    if (argc < 2) { std::fprintf(stderr, "usage: kernel_check PTX [--small]\n"); return 2; }
    bool small = argc > 2 && std::string(argv[2]) == "--small";
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    std::ifstream f(argv[1]);
    std::stringstream ss;
    ss << f.rdbuf();
    std::string ptx = ss.str();
    CK(cuInit(0));
    CUdevice dev;
    CK(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    int driver = 0;
    CK(cuDriverGetVersion(&driver));
    char name[128];
    CK(cuDeviceGetName(name, sizeof name, dev));
    Mod md;
    CK(cuDeviceGetAttribute(&md.sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    auto t0 = std::chrono::steady_clock::now();
    CK(cuModuleLoadData(&md.m, ptx.c_str()));
    double load_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("{\"device\": \"%s\", \"driver\": %d, \"sms\": %d, \"ptx_load_ms\": %.1f}\n", name, driver, md.sms, load_ms);
    // Registers and occupancy of every kernel.
    auto attrs = [&](const char* label, CUfunction f_) {
        int regs = 0, spill = 0, per = 0;
        CK(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, f_));
        CK(cuFuncGetAttribute(&spill, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f_));
        CK(cuOccupancyMaxActiveBlocksPerMultiprocessor(&per, f_, 256, 0));
        std::printf("{\"kernel\": \"%s\", \"regs\": %d, \"local_bytes\": %d, \"blocks_per_sm\": %d}\n", label, regs, spill, per);
    };
    for (int w : {1, 2, 4, 8})
        for (const char* fn : {"diff_compact", "scatter", "apply_compact", "checksum_compact"})
            attrs((std::string(fn) + "_w" + std::to_string(w)).c_str(), md.f(fn, w));
    for (const char* fn : {"cast_gather", "xxh3_chunks"}) {
        CUfunction f_;
        CK(cuModuleGetFunction(&f_, md.m, fn));
        attrs(fn, f_);
    }
    // Without --small the timings come first (the small run has checked every kernel just before, under the
    // sanitizers too), then the same checks at full sizes (a 2-segment tensor): a run stopped by its caller's
    // time limit has printed the timings already (stdout is line-buffered).
    const uint64_t GiB = 1ull << 30;
    if (!small) {
        bench(md, 2, 2 * GiB, 0);
        bench(md, 2, 2 * GiB, 10);
        bench(md, 2, 2 * GiB, 30);
        bench(md, 4, 2 * GiB, 10);
        bench(md, 1, 1 * GiB, 10);
        bench(md, 8, 2 * GiB, 10);
    }
    check_xxh3(md, small);
    check_cast(md, small);
    for (int w : {1, 2, 4, 8}) {
        check_width(md, w, small, false);
        check_width(md, w, small, true);
    }
    std::printf("{\"result\": \"%s\", \"failures\": %d}\n", g_failures ? "FAIL" : "ok", g_failures);
    return g_failures ? 1 : 0;
}
