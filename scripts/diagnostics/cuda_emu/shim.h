// CPU emulation shim for TVM-generated CUDA kernels: every CUDA thread of a block is a ucontext
// fiber; __syncthreads and shuffles are block-wide lockstep points (checked).
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>
#include <ucontext.h>
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
struct dim3_ { int x, y, z; };
static dim3_ threadIdx, blockIdx, blockDim, gridDim;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) int4 { int x, y, z, w; };
static inline int2 make_int2(int a, int b) { int2 r; r.x = a; r.y = b; return r; }
static inline uint2 make_uint2(unsigned a, unsigned b) { uint2 r; r.x = a; r.y = b; return r; }
static inline int4 make_int4(int a, int b, int c, int d) { int4 r; r.x = a; r.y = b; r.z = c; r.w = d; return r; }
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct nv_bfloat16 {
  uint16_t b;
  nv_bfloat16() : b(0) {}
  nv_bfloat16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if (std::isnan(f)) { b = 0x7fc0; return; }
    u += 0x7fffu + ((u >> 16) & 1u); b = (uint16_t)(u >> 16);
  }
  operator float() const { uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct alignas(8) nv_bfloat164 { nv_bfloat16 x, y, z, w; };
struct alignas(4) nv_bfloat162 { nv_bfloat16 x, y; };
static inline nv_bfloat164 make_nv_bfloat164(nv_bfloat16 a, nv_bfloat16 b, nv_bfloat16 c, nv_bfloat16 d) { nv_bfloat164 r; r.x = a; r.y = b; r.z = c; r.w = d; return r; }
static inline nv_bfloat162 make_nv_bfloat162(nv_bfloat16 a, nv_bfloat16 b) { nv_bfloat162 r; r.x = a; r.y = b; return r; }
static inline nv_bfloat16 __float2bfloat16_rn(float f) { return nv_bfloat16(f); }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
#define CUDART_INF_F INFINITY

// ---- fiber runtime ----
struct Fiber { ucontext_t ctx; bool done; int sync_count; bool at_bar; std::vector<char> stack; };
static ucontext_t g_sched;
static std::vector<Fiber> g_fibers;
static int g_cur;
static std::function<void()> g_body;
static uint64_t g_xchg[1024];
static long g_errors = 0;
static void fiber_entry() {
  g_body();
  g_fibers[g_cur].done = true;
  swapcontext(&g_fibers[g_cur].ctx, &g_sched);
}
static inline void yield_() { g_fibers[g_cur].sync_count++; swapcontext(&g_fibers[g_cur].ctx, &g_sched); }
static inline void __syncthreads() { g_fibers[g_cur].at_bar = true; swapcontext(&g_fibers[g_cur].ctx, &g_sched); }
static inline int lin_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
template <class T> static inline T __shfl_xor_sync(long long, T v, int lm, int width = 32) {
  int t = lin_tid(); uint64_t w = 0; std::memcpy(&w, &v, sizeof(T)); g_xchg[t] = w; yield_();
  int lane = t & 31; int src = (t & ~31) | ((lane ^ lm) & 31);
  T r; std::memcpy(&r, &g_xchg[src], sizeof(T)); yield_(); return r;
}
template <class T> static inline T __shfl_up_sync(long long, T v, int d, int width = 32) {
  int t = lin_tid(); uint64_t w = 0; std::memcpy(&w, &v, sizeof(T)); g_xchg[t] = w; yield_();
  int lane = t & 31; int seg = lane & ~(width - 1); int src = lane - d;
  T r; if (src < seg) src = lane; std::memcpy(&r, &g_xchg[(t & ~31) | src], sizeof(T)); yield_(); return r;
}
template <class T> static inline T __shfl_sync(long long, T v, int src_lane, int width = 32) {
  int t = lin_tid(); uint64_t w = 0; std::memcpy(&w, &v, sizeof(T)); g_xchg[t] = w; yield_();
  int lane = t & 31; int src = (t & ~31) | ((lane & ~(width - 1)) + (src_lane % width));
  T r; std::memcpy(&r, &g_xchg[src], sizeof(T)); yield_(); return r;
}
static void run_grid(int gx, int gy, int gz, int nt, std::function<void()> body) {
  // Warp collectives deposit / yield / read / yield: lanes of a warp must stay in lockstep (checked per
  // warp each round). __syncthreads parks a fiber until every unfinished fiber of the block is parked.
  g_body = body; gridDim = {gx, gy, gz}; blockDim = {nt, 1, 1};
  g_fibers.resize(nt);
  for (auto& f : g_fibers) f.stack.resize(256 * 1024);
  for (int z = 0; z < gz; ++z) for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
    blockIdx = {x, y, z};
    for (int i = 0; i < nt; ++i) {
      Fiber& f = g_fibers[i]; f.done = false; f.sync_count = 0; f.at_bar = false;
      getcontext(&f.ctx); f.ctx.uc_stack.ss_sp = f.stack.data(); f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = nullptr; makecontext(&f.ctx, fiber_entry, 0);
    }
    bool bad = false;
    while (true) {
      int ndone = 0, nbar = 0;
      for (int i = 0; i < nt; ++i) {
        if (g_fibers[i].done) { ndone++; continue; }
        if (g_fibers[i].at_bar) { nbar++; continue; }
        g_cur = i; threadIdx = {i, 0, 0};
        swapcontext(&g_sched, &g_fibers[i].ctx);
        if (g_fibers[i].done) ndone++; else if (g_fibers[i].at_bar) nbar++;
      }
      for (int w = 0; w < nt; w += 32) {
        int e = w + 32 < nt ? w + 32 : nt;
        for (int i = w; i < e; ++i)
          if (g_fibers[i].sync_count != g_fibers[w].sync_count || g_fibers[i].done != g_fibers[w].done ||
              g_fibers[i].at_bar != g_fibers[w].at_bar) bad = true;
      }
      if (bad) { if (g_errors++ < 5) fprintf(stderr, "warp lockstep violation in block (%d,%d,%d)\n", x, y, z); break; }
      if (ndone == nt) break;
      if (nbar > 0 && nbar + ndone == nt) {
        if (ndone > 0) { if (g_errors++ < 5) fprintf(stderr, "barrier with exited threads in block (%d,%d,%d)\n", x, y, z); }
        for (int i = 0; i < nt; ++i) g_fibers[i].at_bar = false;
      }
    }
    if (bad) {  // drain
      for (int i = 0; i < nt; ++i) g_fibers[i].at_bar = false;
      bool any = true; int guard = 0;
      while (any && guard++ < 1000000) { any = false; for (int i = 0; i < nt; ++i) if (!g_fibers[i].done) { any = true; g_fibers[i].at_bar = false; g_cur = i; threadIdx = {i,0,0}; swapcontext(&g_sched, &g_fibers[i].ctx);} }
    }
  }
}
extern "C" long emu_errors() { return g_errors; }
