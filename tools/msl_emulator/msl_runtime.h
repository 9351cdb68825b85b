// The emulator's runtime: every GPU thread of a threadgroup runs as a fiber on one OS thread, so
// barriers and simdgroup operations really meet; threadgroups are spread over a few OS threads.
// Written for metalserve; included by msl.h before the MSL-to-C++ macros are defined.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <source_location>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) && !defined(MSL_USE_UCONTEXT) && !defined(__SANITIZE_ADDRESS__)
#define MSL_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace msl_rt {

struct uint3v {
  uint32_t x, y, z;
};

// The values of MLX's thread-position attributes for one GPU thread.
struct ThreadCtx {
  uint3v thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3v threads_per_threadgroup, threadgroups_per_grid, threads_per_grid, grid_size, grid_origin;
  uint3v dispatch_threads_per_threadgroup;
  uint32_t thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup;
  uint32_t simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width;
  uint32_t quadgroup_index_in_threadgroup, quadgroups_per_threadgroup, thread_index_in_quadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

constexpr int kSimdWidth = 32;
constexpr size_t kMaxThreadgroupBytes = 32 * 1024;
constexpr int kSlotBytes = 64;
constexpr int kMaxBuffers = 64;
// What a launch counts: device bytes read per buffer slot, then barriers, simdgroup operations
// (every collective, matrix ones included) and simdgroup multiply-accumulates.
enum Count { kBarriers = kMaxBuffers, kSimdOps, kSimdMma, kNumCounts };

enum class State { Ready, Barrier, Simd, Done };

struct Fiber {
  State state = State::Ready;
  uint32_t site = 0;       // source line of the barrier / simd op it waits at
  uint64_t simd_gen = 0;   // how many simd ops this lane has entered
  int tg_decl = 0;         // how many threadgroup declarations it has passed
  ThreadCtx ctx{};
#ifdef MSL_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc{};
#endif
  char* stack = nullptr;
};

struct SimdGroup {
  int lanes = 0;
  uint64_t product_gen = ~uint64_t(0);  // which multiply-accumulate `product` holds
  float product[64];
  int arrived[2] = {0, 0};
  uint32_t site[2] = {0, 0};
  uint64_t completed = 0;
  alignas(16) unsigned char slots[2][kSimdWidth][kSlotBytes];
  int args[2][kSimdWidth];
};

struct TgVar {
  size_t offset, bytes;
};

class Error : public std::exception {};

struct Worker;
inline thread_local Worker* tls_worker = nullptr;

// Fiber stacks outlive a launch: a new launch reuses stacks whose pages are already mapped.
struct StackPool {
  std::mutex mu;
  size_t bytes = 0;
  std::vector<char*> free;
  char* take(size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    if (n != bytes) {  // another size: drop the pool
      for (char* s : free) std::free(s);
      free.clear();
      bytes = n;
    }
    if (free.empty()) return static_cast<char*>(std::malloc(n));
    char* s = free.back();
    free.pop_back();
    return s;
  }
  void give(char* s, size_t n) {
    std::lock_guard<std::mutex> lock(mu);
    if (n == bytes) free.push_back(s); else std::free(s);
  }
};
inline StackPool stack_pool;

extern "C" inline void msl_fiber_entry();

// One OS thread's state: the fibers of the threadgroup it runs now and that group's memory arena.
struct Worker {
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simds;
  std::vector<TgVar> tg_vars;
  std::vector<unsigned char> arena;
  size_t arena_used = 0;
  int current = -1;
  int barrier_arrived = 0;
  uint32_t barrier_site = 0;
  size_t stack_bytes;
  const std::function<void(const ThreadCtx&)>* body = nullptr;
#ifdef MSL_ASM_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched_uc{};
#endif
  std::string error;
  uint64_t counts[kNumCounts] = {};

  explicit Worker(size_t stack) : stack_bytes(stack), arena(kMaxThreadgroupBytes + 64) {}
  ~Worker() {
    for (auto& f : fibers)
      if (f.stack) stack_pool.give(f.stack, stack_bytes);
  }
  [[noreturn]] void fail(const std::string& msg) {
    if (error.empty()) error = msg;
    yield_to_scheduler();
    std::abort();  // never resumed after an error
  }
  Fiber& me() { return fibers[current]; }
  void yield_to_scheduler();
  void run_group(const ThreadCtx& base, uint32_t n, bool reverse);
  void start_fiber(int i);
  bool step_all(bool reverse);
  void diagnose_stall();
};

#ifdef MSL_ASM_SWITCH
extern "C" void msl_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl msl_switch
.hidden msl_switch
.type msl_switch,@function
msl_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size msl_switch, .-msl_switch
)");
#endif

extern "C" inline void msl_fiber_entry() {
  Worker* w = tls_worker;
  Fiber& f = w->me();
  (*w->body)(f.ctx);
  w->me().state = State::Done;
  w->yield_to_scheduler();
  std::abort();
}

#ifndef MSL_ASM_SWITCH
inline void msl_fiber_entry_uc() { msl_fiber_entry(); }
#endif

inline void Worker::yield_to_scheduler() {
#ifdef MSL_ASM_SWITCH
  msl_switch(&fibers[current].sp, sched_sp);
#else
  swapcontext(&fibers[current].uc, &sched_uc);
#endif
}

inline void Worker::start_fiber(int i) {
  Fiber& f = fibers[i];
  if (!f.stack) f.stack = stack_pool.take(stack_bytes);
#ifdef MSL_ASM_SWITCH
  // A fresh stack laid out as msl_switch leaves it: control word slot, six registers, return address.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + stack_bytes) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;  // fake return address of the entry function, keeps the ABI's alignment
  *--sp = reinterpret_cast<uint64_t>(&msl_fiber_entry);
  for (int r = 0; r < 6; ++r) *--sp = 0;
  sp -= 1;
  uint32_t csr;
  uint16_t cw;
  asm volatile("stmxcsr %0" : "=m"(csr));
  asm volatile("fnstcw %0" : "=m"(cw));
  std::memcpy(reinterpret_cast<char*>(sp), &csr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &cw, 2);
  f.sp = sp;
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = stack_bytes;
  f.uc.uc_link = nullptr;
  makecontext(&f.uc, msl_fiber_entry_uc, 0);
#endif
}

inline std::string where(uint32_t line) { return "line " + std::to_string(line); }

// Runs every ready fiber once until it blocks or ends; returns whether any ran.
inline bool Worker::step_all(bool reverse) {
  bool ran = false;
  int n = static_cast<int>(fibers.size());
  for (int k = 0; k < n; ++k) {
    int i = reverse ? n - 1 - k : k;
    if (fibers[i].state != State::Ready) continue;
    current = i;
    ran = true;
#ifdef MSL_ASM_SWITCH
    msl_switch(&sched_sp, fibers[i].sp);
#else
    swapcontext(&sched_uc, &fibers[i].uc);
#endif
    current = -1;
    if (!error.empty()) return false;
  }
  return ran;
}

inline void Worker::diagnose_stall() {
  int done = 0, at_barrier = 0, at_simd = 0;
  for (auto& f : fibers) {
    done += f.state == State::Done;
    at_barrier += f.state == State::Barrier;
    at_simd += f.state == State::Simd;
  }
  if (at_barrier && done) {
    error = "threadgroup_barrier at " + where(barrier_site) + " reached by only " +
            std::to_string(at_barrier) + " of " + std::to_string(fibers.size()) +
            " threads; the others returned";
  } else if (at_simd && done) {
    error = "simdgroup operation reached by only part of a simdgroup; other lanes returned";
  } else {
    error = "deadlock: " + std::to_string(at_barrier) + " threads wait at a barrier and " +
            std::to_string(at_simd) + " at simdgroup operations that can never complete";
  }
}

inline void Worker::run_group(const ThreadCtx& base, uint32_t n, bool reverse) {
  fibers.resize(n);
  int nsimd = static_cast<int>((n + kSimdWidth - 1) / kSimdWidth);
  simds.assign(nsimd, SimdGroup{});
  for (int s = 0; s < nsimd; ++s) simds[s].lanes = std::min<int>(kSimdWidth, n - s * kSimdWidth);
  // Threadgroup memory starts as NaN (all bits set) so a read before any write shows in the output.
  std::memset(arena.data(), 0xFF, arena.size());
  arena_used = 0;
  tg_vars.clear();
  barrier_arrived = 0;
  uint32_t tx = base.threads_per_threadgroup.x, ty = base.threads_per_threadgroup.y;
  for (uint32_t i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f.state = State::Ready;
    f.simd_gen = 0;
    f.tg_decl = 0;
    f.ctx = base;
    uint3v p{i % tx, (i / tx) % ty, i / (tx * ty)};
    f.ctx.thread_position_in_threadgroup = p;
    f.ctx.thread_position_in_grid = {base.threadgroup_position_in_grid.x * tx + p.x,
                                     base.threadgroup_position_in_grid.y * ty + p.y,
                                     base.threadgroup_position_in_grid.z *
                                             base.threads_per_threadgroup.z + p.z};
    f.ctx.thread_index_in_threadgroup = i;
    f.ctx.simdgroup_index_in_threadgroup = i / kSimdWidth;
    f.ctx.thread_index_in_simdgroup = i % kSimdWidth;
    f.ctx.quadgroup_index_in_threadgroup = i / 4;
    f.ctx.thread_index_in_quadgroup = i % 4;
    start_fiber(static_cast<int>(i));
  }
  while (true) {
    bool ran = step_all(reverse);
    if (!error.empty()) return;
    bool all_done = std::all_of(fibers.begin(), fibers.end(),
                                [](const Fiber& f) { return f.state == State::Done; });
    if (all_done) return;
    if (!ran) {
      diagnose_stall();
      return;
    }
  }
}

inline Worker& worker() {
  if (!tls_worker) std::abort();
  return *tls_worker;
}

// threadgroup_barrier: waits until every thread of the group arrives at the same barrier.
inline void barrier(uint32_t line) {
  Worker& w = worker();
  if (w.barrier_arrived > 0 && w.barrier_site != line) {
    w.fail("divergent threadgroup_barrier: threads wait at " + where(w.barrier_site) + " and " +
           where(line));
  }
  w.barrier_site = line;
  Fiber& f = w.me();
  if (++w.barrier_arrived == static_cast<int>(w.fibers.size())) {
    w.barrier_arrived = 0;
    ++w.counts[kBarriers];
    for (auto& g : w.fibers)
      if (g.state == State::Barrier) g.state = State::Ready;
    return;
  }
  f.state = State::Barrier;
  f.site = line;
  w.yield_to_scheduler();
}

// One simdgroup collective: each lane deposits `value` (and an int argument), waits for all lanes,
// then `pick` computes its own result from every lane's deposit.
template <typename T, typename Pick>
inline T simd_collective(const T& value, int arg, uint32_t line, Pick pick) {
  static_assert(sizeof(T) <= kSlotBytes, "simd operand too large");
  Worker& w = worker();
  Fiber& f = w.me();
  SimdGroup& sg = w.simds[f.ctx.simdgroup_index_in_threadgroup];
  int b = static_cast<int>(f.simd_gen & 1);
  uint32_t lane = f.ctx.thread_index_in_simdgroup;
  if (sg.arrived[b] > 0 && sg.site[b] != line) {
    w.fail("divergent simdgroup operation: lanes of simdgroup " +
           std::to_string(f.ctx.simdgroup_index_in_threadgroup) + " wait at " + where(sg.site[b]) +
           " and " + where(line));
  }
  sg.site[b] = line;
  std::memcpy(sg.slots[b][lane], &value, sizeof(T));
  sg.args[b][lane] = arg;
  uint64_t my_gen = f.simd_gen++;
  if (++sg.arrived[b] == sg.lanes) {
    sg.arrived[b] = 0;
    ++w.counts[kSimdOps];
    sg.completed = my_gen + 1;
    size_t first = size_t(f.ctx.simdgroup_index_in_threadgroup) * kSimdWidth;  // only its lanes
    for (size_t i = first; i < first + size_t(sg.lanes); ++i) {
      if (w.fibers[i].state == State::Simd) w.fibers[i].state = State::Ready;
    }
  } else {
    f.state = State::Simd;
    f.site = line;
    w.yield_to_scheduler();
  }
  auto lane_value = [&](int l) {
    T v;
    std::memcpy(&v, sg.slots[b][l], sizeof(T));
    return v;
  };
  return pick(lane_value, sg.lanes, static_cast<int>(lane), sg.args[b]);
}

// A kernel-scope `threadgroup` declaration: the k-th declaration a thread passes maps to the
// group's k-th arena slot, allocated (NaN-filled) by the first thread that reaches it.
template <typename A>
inline A& tg_var(uint32_t line) {
  Worker& w = worker();
  Fiber& f = w.me();
  int k = f.tg_decl++;
  if (k == static_cast<int>(w.tg_vars.size())) {
    size_t off = (w.arena_used + 15) & ~size_t(15);
    if (off + sizeof(A) > kMaxThreadgroupBytes) {
      w.fail("threadgroup memory over 32 KiB: " + std::to_string(off + sizeof(A)) + " bytes at " +
             where(line));
    }
    w.tg_vars.push_back({off, sizeof(A)});
    w.arena_used = off + sizeof(A);
  } else if (k > static_cast<int>(w.tg_vars.size()) || w.tg_vars[k].bytes != sizeof(A)) {
    w.fail("threads of one group declared different threadgroup variables at " + where(line));
  }
  return *reinterpret_cast<A*>(w.arena.data() + w.tg_vars[k].offset);
}

struct Dims {
  uint32_t grid[3], tg[3];
};

// Runs every threadgroup of the grid; returns an error message, empty on success.
inline std::string launch(const Dims& d, bool reverse, int num_workers, size_t stack_bytes,
                          const std::function<void(const ThreadCtx&)>& body, uint64_t* counts) {
  for (int a = 0; a < 3; ++a) {
    if (d.tg[a] == 0 || d.grid[a] % d.tg[a] != 0)
      return "grid must be a positive multiple of the threadgroup size in every dimension";
  }
  uint32_t n = d.tg[0] * d.tg[1] * d.tg[2];
  if (n > 1024) return "threadgroup larger than 1024 threads";
  uint32_t groups[3] = {d.grid[0] / d.tg[0], d.grid[1] / d.tg[1], d.grid[2] / d.tg[2]};
  uint64_t total = uint64_t(groups[0]) * groups[1] * groups[2];
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  std::string first_error;
  auto run = [&]() {
    Worker w(stack_bytes);
    w.body = &body;
    tls_worker = &w;
    for (uint64_t g = next++; g < total; g = next++) {
      ThreadCtx base{};
      base.threadgroup_position_in_grid = {uint32_t(g % groups[0]), uint32_t((g / groups[0]) % groups[1]),
                                           uint32_t(g / (uint64_t(groups[0]) * groups[1]))};
      base.threads_per_threadgroup = {d.tg[0], d.tg[1], d.tg[2]};
      base.dispatch_threads_per_threadgroup = base.threads_per_threadgroup;
      base.threadgroups_per_grid = {groups[0], groups[1], groups[2]};
      base.threads_per_grid = {d.grid[0], d.grid[1], d.grid[2]};
      base.grid_size = base.threads_per_grid;
      base.grid_origin = {0, 0, 0};
      base.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
      base.dispatch_simdgroups_per_threadgroup = base.simdgroups_per_threadgroup;
      base.quadgroups_per_threadgroup = (n + 3) / 4;
      base.dispatch_quadgroups_per_threadgroup = base.quadgroups_per_threadgroup;
      base.threads_per_simdgroup = kSimdWidth;
      base.thread_execution_width = kSimdWidth;
      w.run_group(base, n, reverse);
      if (!w.error.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.empty())
          first_error = "threadgroup (" + std::to_string(base.threadgroup_position_in_grid.x) + ", " +
                        std::to_string(base.threadgroup_position_in_grid.y) + ", " +
                        std::to_string(base.threadgroup_position_in_grid.z) + "): " + w.error;
        next = total;
        break;
      }
    }
    tls_worker = nullptr;
    std::lock_guard<std::mutex> lock(mu);
    for (int i = 0; i < kNumCounts; ++i) counts[i] += w.counts[i];
  };
  int workers = static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(num_workers, total)));
  std::vector<std::thread> pool;
  for (int i = 1; i < workers; ++i) pool.emplace_back(run);
  run();
  for (auto& t : pool) t.join();
  return first_error;
}

}  // namespace msl_rt
