// Numbers, shapes, devices and dtypes in the bindings' error messages, as strings made without
// std::ostream's number formatting. On the H200 machine of 2026-11-30 (torch 2.11.0+cu130,
// Python 3.12, GCC 13.3) any extension that wrote an integer into a std::ostringstream
// segfaulted (likely a second libstdc++'s locale facets in the process, as in
// pytorch/pytorch#109923), so a TORCH_CHECK whose message streamed a number, a shape or a
// device killed Python instead of raising; strings stream safely, and std::to_string does not
// use the locale. Every message argument of a TORCH_CHECK in csrc/*/binding.cpp is a string
// literal, a const char* or one of these (tests/test_binding_messages.py checks).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

namespace ks_messages {

inline std::string number(int64_t x) { return std::to_string(x); }

// "[2, 3, 4]", as torch prints sizes.
inline std::string shape(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(sizes[i]);
  }
  return out + "]";
}

// "cuda:0", "cpu", as torch prints devices.
inline std::string device_name(const c10::Device& d) {
  std::string out = c10::DeviceTypeName(d.type(), /*lower_case=*/true);
  return d.has_index() ? out + ":" + std::to_string(d.index()) : out;
}

inline const char* dtype_name(c10::ScalarType t) { return c10::toString(t); }

}  // namespace ks_messages
