// Just enough of Metal to run an mx.fast.metal_kernel body on a CPU, for tests.
//
// The threads of one threadgroup are fibers that switch at every threadgroup_barrier and every
// simd_* call, in thread order, and threadgroups run one after another. A thread runs as far as it
// can before the next one starts, so a read of threadgroup memory that a missing barrier leaves
// unordered sees the value from before the other threads' writes: poison (0x7F bytes, a float of
// 3.4e38), written over all threadgroup memory before each threadgroup and over outputs without
// an init_value. A barrier that not every thread of the group reaches is an error, as are
// simd_* calls that the lanes of one simdgroup reach on different source lines.
//
// Limits: `threadgroup` is for variable declarations only (not pointer types); no atomics,
// no textures, no simdgroup matrices.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <ucontext.h>
#include <vector>

namespace metal_cpu {

constexpr int SIMD_WIDTH = 32;
constexpr unsigned char POISON = 0x7F;

// ---- scalar types -----------------------------------------------------------------------
#ifdef __FLT16_MAX__
using half = _Float16;
#else
#error "metal_cpu.h needs a compiler with _Float16 (g++ 12 or newer on x86-64 or arm64)"
#endif

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) {
      bits = uint16_t((u >> 16) | 0x40);  // a quiet NaN
    } else {
      bits = uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);  // round to nearest even
    }
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// ---- vector types -----------------------------------------------------------------------
template <typename T, int N>
struct vec;

#define METAL_CPU_VEC_OPS(N)                                                             \
  T& operator[](int i) { return (&x)[i]; }                                              \
  const T& operator[](int i) const { return (&x)[i]; }                                  \
  vec& operator+=(const vec& o) { for (int i = 0; i < N; ++i) (*this)[i] += o[i]; return *this; } \
  vec& operator*=(const vec& o) { for (int i = 0; i < N; ++i) (*this)[i] *= o[i]; return *this; }

template <typename T>
struct vec<T, 2> {
  T x, y;
  vec() = default;
  vec(T s) : x(s), y(s) {}
  vec(T a, T b) : x(a), y(b) {}
  METAL_CPU_VEC_OPS(2)
};
template <typename T>
struct vec<T, 3> {
  T x, y, z;
  vec() = default;
  vec(T s) : x(s), y(s), z(s) {}
  vec(T a, T b, T c) : x(a), y(b), z(c) {}
  METAL_CPU_VEC_OPS(3)
};
template <typename T>
struct vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  METAL_CPU_VEC_OPS(4)
};

#define METAL_CPU_VEC_BINOP(op)                                                            \
  template <typename T, int N>                                                            \
  vec<T, N> operator op(vec<T, N> a, const vec<T, N>& b) {                               \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b[i];                                      \
    return a;                                                                             \
  }                                                                                       \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  vec<T, N> operator op(vec<T, N> a, S s) {                                               \
    for (int i = 0; i < N; ++i) a[i] = a[i] op T(s);                                      \
    return a;                                                                             \
  }                                                                                       \
  template <typename T, int N, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>> \
  vec<T, N> operator op(S s, vec<T, N> a) {                                               \
    for (int i = 0; i < N; ++i) a[i] = T(s) op a[i];                                      \
    return a;                                                                             \
  }
METAL_CPU_VEC_BINOP(+)
METAL_CPU_VEC_BINOP(-)
METAL_CPU_VEC_BINOP(*)
METAL_CPU_VEC_BINOP(/)

// ---- the fiber scheduler ------------------------------------------------------------------
struct Ids {
  vec<uint32_t, 3> grid_pos, tg_pos, tg_size, group_pos, groups, grid_size;
  uint32_t index_in_tg, lane, simd_id, simds;
};

enum State { READY, WAIT_TG, WAIT_SIMD, DONE };

struct Scheduler {
  int n = 0;
  std::vector<ucontext_t> ctx;
  std::vector<char*> stacks;
  ucontext_t main_ctx;
  std::vector<int> state;
  std::vector<long> simd_calls;  // how many simd_* calls each thread has made
  std::vector<int> simd_site;  // the source line of its last one
  std::vector<unsigned char> slots;  // one exchange slot a thread, SLOT bytes each
  std::vector<char> live;  // lanes that took part in the last simd exchange
  std::vector<Ids> ids;
  int cur = -1;
  const std::function<void(const Ids&)>* body = nullptr;
  char error[512] = {0};
  static constexpr int SLOT = 16;
  static constexpr size_t STACK = 256 * 1024;
  ~Scheduler() {
    for (char* s : stacks) std::free(s);
  }
};

inline Scheduler& sched() {
  static Scheduler s;
  return s;
}

inline void fail(const char* msg) {
  Scheduler& s = sched();
  if (!s.error[0]) std::snprintf(s.error, sizeof(s.error), "%s", msg);
}

inline void wait(State why) {
  Scheduler& s = sched();
  s.state[s.cur] = why;
  swapcontext(&s.ctx[s.cur], &s.main_ctx);
}

inline void trampoline() {
  Scheduler& s = sched();
  int me = s.cur;
  (*s.body)(s.ids[me]);
  s.state[me] = DONE;
  // uc_link returns to main_ctx.
}

// Release the threads whose barrier every live member has reached; false when none could go on.
inline bool release() {
  Scheduler& s = sched();
  bool any_ready = false;
  int live = 0, at_tg = 0;
  for (int i = 0; i < s.n; ++i) {
    live += s.state[i] != DONE;
    at_tg += s.state[i] == WAIT_TG;
  }
  if (at_tg > 0 && live < s.n) {
    fail("threadgroup_barrier not reached by every thread of the threadgroup (some returned)");
    return false;
  }
  if (at_tg > 0 && at_tg == live) {
    for (int i = 0; i < s.n; ++i)
      if (s.state[i] == WAIT_TG) s.state[i] = READY;
    return true;
  }
  for (int base = 0; base < s.n; base += SIMD_WIDTH) {
    int end = std::min(base + SIMD_WIDTH, s.n), waiting = 0, lane_live = 0;
    long call = -1;
    int site = -1;
    bool same = true;
    for (int i = base; i < end; ++i) {
      lane_live += s.state[i] != DONE;
      if (s.state[i] == WAIT_SIMD) {
        ++waiting;
        if (call >= 0 && (s.simd_calls[i] != call || s.simd_site[i] != site)) same = false;
        call = s.simd_calls[i];
        site = s.simd_site[i];
      }
    }
    if (waiting == 0 || waiting != lane_live) continue;
    if (!same) {
      fail("simd_* calls reached on different source lines by the lanes of one simdgroup");
      return false;
    }
    for (int i = base; i < end; ++i) {
      s.live[i] = s.state[i] == WAIT_SIMD;
      if (s.state[i] == WAIT_SIMD) s.state[i] = READY;
    }
    any_ready = true;
  }
  return any_ready;
}

// Runs one threadgroup to completion; false on an error (in sched().error).
inline bool run_group(const std::function<void(const Ids&)>& body, const std::vector<Ids>& ids) {
  Scheduler& s = sched();
  s.n = int(ids.size());
  s.ids = ids;
  s.body = &body;
  s.ctx.resize(s.n);
  while (int(s.stacks.size()) < s.n) s.stacks.push_back(static_cast<char*>(std::malloc(Scheduler::STACK)));
  s.state.assign(s.n, READY);
  s.simd_calls.assign(s.n, 0);
  s.simd_site.assign(s.n, -1);
  s.slots.assign(size_t(s.n) * Scheduler::SLOT, 0);
  s.live.assign(s.n, 0);
  for (int i = 0; i < s.n; ++i) {
    getcontext(&s.ctx[i]);
    s.ctx[i].uc_stack.ss_sp = s.stacks[i];
    s.ctx[i].uc_stack.ss_size = Scheduler::STACK;
    s.ctx[i].uc_link = &s.main_ctx;
    makecontext(&s.ctx[i], trampoline, 0);
  }
  while (true) {
    bool ran = false;
    for (int i = 0; i < s.n; ++i) {
      if (s.state[i] != READY) continue;
      s.cur = i;
      swapcontext(&s.main_ctx, &s.ctx[i]);
      ran = true;
    }
    if (s.error[0]) return false;
    bool all_done = true;
    for (int i = 0; i < s.n; ++i) all_done = all_done && s.state[i] == DONE;
    if (all_done) return true;
    if (!release() && !ran) {
      bool tg = false;
      for (int i = 0; i < s.n; ++i) tg = tg || s.state[i] == WAIT_TG;
      fail(tg ? "threadgroup_barrier not reached by every live thread of the threadgroup"
              : "simd_* calls that the lanes of a simdgroup never all reach");
      return false;
    }
  }
}

// Every simd_* call: each lane publishes a value, waits for its simdgroup, reads all lanes'
// values, and waits again so that no lane overwrites its slot before the others have read it.
template <typename T>
inline void exchange(T v, T (&all)[SIMD_WIDTH], bool (&on)[SIMD_WIDTH], int site) {
  static_assert(sizeof(T) <= Scheduler::SLOT, "simd value too large");
  Scheduler& s = sched();
  int me = s.cur, base = me - me % SIMD_WIDTH;
  std::memcpy(&s.slots[size_t(me) * Scheduler::SLOT], &v, sizeof(T));
  ++s.simd_calls[me];
  s.simd_site[me] = site;
  wait(WAIT_SIMD);
  for (int l = 0; l < SIMD_WIDTH; ++l) {
    on[l] = base + l < s.n && s.live[base + l];
    if (on[l]) std::memcpy(&all[l], &s.slots[size_t(base + l) * Scheduler::SLOT], sizeof(T));
  }
  ++s.simd_calls[me];
  wait(WAIT_SIMD);
}

inline int lane_of_current() { return sched().cur % SIMD_WIDTH; }

}  // namespace metal_cpu

// ---- what a kernel body sees ---------------------------------------------------------------
using metal_cpu::bfloat;
using metal_cpu::half;
using bfloat16_t = metal_cpu::bfloat;
using float16_t = metal_cpu::half;
using uint = uint32_t;
using uint2 = metal_cpu::vec<uint32_t, 2>;
using uint3 = metal_cpu::vec<uint32_t, 3>;
using uint4 = metal_cpu::vec<uint32_t, 4>;
using int2 = metal_cpu::vec<int32_t, 2>;
using int3 = metal_cpu::vec<int32_t, 3>;
using int4 = metal_cpu::vec<int32_t, 4>;
using float2 = metal_cpu::vec<float, 2>;
using float3 = metal_cpu::vec<float, 3>;
using float4 = metal_cpu::vec<float, 4>;
using half2 = metal_cpu::vec<metal_cpu::half, 2>;
using half4 = metal_cpu::vec<metal_cpu::half, 4>;

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };

inline void threadgroup_barrier(mem_flags) { metal_cpu::wait(metal_cpu::WAIT_TG); }
inline void simdgroup_barrier(mem_flags, int site = __builtin_LINE()) {
  // The lanes of a simdgroup meet as at any simd_* call.
  int all[metal_cpu::SIMD_WIDTH];
  bool on[metal_cpu::SIMD_WIDTH];
  metal_cpu::exchange(0, all, on, site);
}

template <typename T>
T simd_sum(T v, int site = __builtin_LINE()) {
  T all[metal_cpu::SIMD_WIDTH];
  bool on[metal_cpu::SIMD_WIDTH];
  metal_cpu::exchange(v, all, on, site);
  T acc = T(0);
  for (int l = 0; l < metal_cpu::SIMD_WIDTH; ++l)
    if (on[l]) acc = acc + all[l];
  return acc;
}

#define METAL_CPU_SIMD_REDUCE(name, pick)                                   \
  template <typename T>                                                    \
  T name(T v, int site = __builtin_LINE()) {                                \
    T all[metal_cpu::SIMD_WIDTH];                                          \
    bool on[metal_cpu::SIMD_WIDTH];                                        \
    metal_cpu::exchange(v, all, on, site);                                 \
    T acc = v;                                                             \
    for (int l = 0; l < metal_cpu::SIMD_WIDTH; ++l)                        \
      if (on[l]) acc = pick;                                               \
    return acc;                                                            \
  }
METAL_CPU_SIMD_REDUCE(simd_max, (all[l] > acc ? all[l] : acc))
METAL_CPU_SIMD_REDUCE(simd_min, (all[l] < acc ? all[l] : acc))

// Reads lane `src`'s value; a lane outside the simdgroup (or inactive) gives the caller's own.
template <typename T>
T metal_cpu_read_lane(T v, int src, int site) {
  T all[metal_cpu::SIMD_WIDTH];
  bool on[metal_cpu::SIMD_WIDTH];
  metal_cpu::exchange(v, all, on, site);
  return (src >= 0 && src < metal_cpu::SIMD_WIDTH && on[src]) ? all[src] : v;
}
template <typename T>
T simd_shuffle(T v, uint16_t lane, int site = __builtin_LINE()) { return metal_cpu_read_lane(v, int(lane), site); }
template <typename T>
T simd_broadcast(T v, uint16_t lane, int site = __builtin_LINE()) { return metal_cpu_read_lane(v, int(lane), site); }
template <typename T>
T simd_shuffle_down(T v, uint16_t delta, int site = __builtin_LINE()) {
  return metal_cpu_read_lane(v, metal_cpu::lane_of_current() + int(delta), site);
}
template <typename T>
T simd_shuffle_up(T v, uint16_t delta, int site = __builtin_LINE()) {
  return metal_cpu_read_lane(v, metal_cpu::lane_of_current() - int(delta), site);
}
template <typename T>
T simd_shuffle_xor(T v, uint16_t mask, int site = __builtin_LINE()) {
  return metal_cpu_read_lane(v, metal_cpu::lane_of_current() ^ int(mask), site);
}

namespace metal {
using std::abs;
using std::ceil;
using std::exp;
using std::exp2;
using std::floor;
using std::fma;
using std::isinf;
using std::isnan;
using std::log;
using std::numeric_limits;
using std::pow;
using std::sqrt;
using std::tanh;
template <typename T>
T max(T a, T b) { return a > b ? a : b; }
template <typename T>
T min(T a, T b) { return a < b ? a : b; }
template <typename T>
T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T>
T select(T a, T b, bool c) { return c ? b : a; }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
namespace fast {
using std::exp;
using std::log;
using std::sqrt;
using std::tanh;
}  // namespace fast
namespace precise {
using std::exp;
using std::log;
}  // namespace precise
}  // namespace metal
using namespace metal;

// Metal's address spaces: a pointer is a pointer here. Threadgroup variables are statics in one
// section, shared by the fibers of a group and poisoned before each group.
#define device
#define constant
#define thread
#define threadgroup static __attribute__((section("metal_cpu_tg")))
