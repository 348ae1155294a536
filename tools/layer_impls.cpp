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

}  // namespace moeblaze::tools
