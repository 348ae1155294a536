#include "layer_impls.hpp"

namespace moeblaze::tools {

std::string impl_names() {
  std::string s;
  for (const Impl& i : kImpls) s += std::string(s.empty() ? "" : ", ") + i.name;
  return s;
}

const Impl& parse_impl(const std::string& s) {
  for (const Impl& i : kImpls)
    if (s == i.name) return i;
  throw InvalidArgument("impl '" + s + "' is not one of: " + impl_names());
}

double check_tolerance(const Impl& impl, DType dtype) {
  if (is_fp8(impl.compute)) return 0.1;
  return dtype == DType::bf16 ? 2e-2 : 1e-4;
}

}  // namespace moeblaze::tools
