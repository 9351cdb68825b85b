// Device-buffer reads that count: the emulator rewrites every `const device T*` (and `const constant
// T*`) in a kernel's source to msl_rt::dev_ptr<const T>, so the bytes each buffer gives are known per
// launch. Written for metalserve; included by msl.h after msl_runtime.h.
#pragma once

#include <cstddef>

#include "msl_runtime.h"

namespace msl_rt {

// Reads through it are counted against its buffer slot; casts to other element types keep the slot.
template <typename T>
struct dev_ptr {
  T* p = nullptr;
  int slot = 0;
  dev_ptr() = default;
  dev_ptr(T* ptr, int s) : p(ptr), slot(s) {}
  T& read(ptrdiff_t i) const {
    worker().counts[slot] += sizeof(T);
    return p[i];
  }
  template <typename I>
  T& operator[](I i) const { return read(static_cast<ptrdiff_t>(i)); }
  T& operator*() const { return read(0); }
  template <typename I>
  dev_ptr operator+(I i) const { return {p + i, slot}; }
  template <typename I>
  dev_ptr operator-(I i) const { return {p - i, slot}; }
  template <typename I>
  dev_ptr& operator+=(I i) { p += i; return *this; }
  dev_ptr& operator++() { ++p; return *this; }
};
template <typename U, typename T>
dev_ptr<U> dev_cast(const dev_ptr<T>& d) {
  return {reinterpret_cast<U*>(d.p), d.slot};
}

}  // namespace msl_rt
