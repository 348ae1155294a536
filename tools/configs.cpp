#include "configs.hpp"

#include <cstdio>
#include <deque>
#include <mutex>

#include "moeblaze/error.hpp"
#include "table.hpp"

namespace moeblaze::tools {

const std::vector<NamedConfig>& named_configs() {
  // Kept identical to docs/DESIGN.md's "Named benchmark configs" table; benchmark result files
  // refer to these names, so a shape never changes under an existing name.
  static const std::vector<NamedConfig> configs = {
      {"mb-conf1", 65536, 512, 2048, 4, 1, "MoEBlaze Table 1 (n = 4d)"},
      {"mb-conf3", 65536, 1024, 4096, 16, 4, "MoEBlaze"},
      {"mb-conf4", 32768, 2048, 8192, 16, 4, "MoEBlaze"},
      {"mb-conf7", 8192, 2048, 8192, 8, 4, "MoEBlaze"},
      {"sm-1.4B-n256", 40960, 768, 256, 128, 8, "SonicMoE fig."},
      {"sm-7B-n256", 24576, 1536, 256, 128, 8, "SonicMoE"},
      {"sm-7B-n1024", 24576, 1536, 1024, 32, 2, "SonicMoE"},
      {"sm-30B-n512", 32768, 4096, 512, 128, 8, "SonicMoE"},
      {"sm-default", 32768, 4096, 1024, 128, 8, "SonicMoE benchmark default"},
      {"olmoe", 16384, 2048, 1024, 64, 8, "OLMoE-like"},
      {"cpu-default", 2048, 256, 512, 16, 4, "the CLI's embedded default"},
  };
  return configs;
}

const NamedConfig& default_config() { return named_configs().back(); }

const NamedConfig* find_config(const std::string& name) {
  for (const NamedConfig& c : named_configs())
    if (name == c.name) return &c;
  return nullptr;
}

const NamedConfig* shape_config(const std::string& name) {
  long long v[5];
  int used = 0;
  if (std::sscanf(name.c_str(), "T%lld-d%lld-n%lld-E%lld-K%lld%n", &v[0], &v[1], &v[2], &v[3],
                  &v[4], &used) != 5 ||
      used != static_cast<int>(name.size()))
    return nullptr;
  for (long long x : v)
    MOEBLAZE_REQUIRE(x > 0, "config '", name, "': every dimension must be positive");
  MOEBLAZE_REQUIRE(v[4] <= v[3], "config '", name, "': K must be in [1, E]");
  static std::mutex mu;
  static std::deque<std::string> names;  // interned: NamedConfig::name points into them
  static std::deque<NamedConfig> shapes;
  const std::lock_guard<std::mutex> lock(mu);
  for (const NamedConfig& c : shapes)
    if (name == c.name) return &c;
  names.push_back(name);
  shapes.push_back({names.back().c_str(), v[0], v[1], v[2], v[3], v[4], "a shape by name"});
  return &shapes.back();
}

std::vector<const NamedConfig*> select_configs(const std::string& spec) {
  std::vector<const NamedConfig*> configs;
  if (spec == "all") {
    for (const NamedConfig& c : named_configs()) configs.push_back(&c);
  } else {
    for (const std::string& name : split_commas(spec)) {
      const NamedConfig* shape = shape_config(name);
      configs.push_back(shape ? shape : &require_config(name));
    }
  }
  return configs;
}

const NamedConfig& require_config(const std::string& name) {
  const NamedConfig* c = find_config(name);
  MOEBLAZE_REQUIRE(c != nullptr, "config '", name, "' is not one of: ", config_names(),
                   " (or 'list')");
  return *c;
}

std::string config_names() {
  std::string s;
  for (const NamedConfig& c : named_configs()) {
    if (!s.empty()) s += ", ";
    s += c.name;
  }
  return s;
}

void print_config_list(std::ostream& os) {
  Table t({{"name", Align::left},
           {"T", Align::right},
           {"d", Align::right},
           {"n", Align::right},
           {"E", Align::right},
           {"K", Align::right},
           {"S = T*K", Align::right},
           {"from", Align::left}});
  for (const NamedConfig& c : named_configs())
    t.add_row({c.name, std::to_string(c.T), std::to_string(c.d), std::to_string(c.n),
               std::to_string(c.E), std::to_string(c.K), std::to_string(c.T * c.K), c.source});
  t.print(os);
}

LayerConfig layer_config(const NamedConfig& c, Activation activation, DType dtype) {
  LayerConfig cfg;
  cfg.T = c.T;
  cfg.d = c.d;
  cfg.n = c.n;
  cfg.E = c.E;
  cfg.K = c.K;
  cfg.activation = activation;
  cfg.dtype = dtype;
  return cfg;
}

}  // namespace moeblaze::tools
