#include "configs.hpp"

#include "moeblaze/error.hpp"
#include "table.hpp"

namespace moeblaze::tools {

const std::vector<NamedConfig>& named_configs() {
  // Kept identical to DESIGN.md's "Named benchmark configs" table; benchmark result files refer
  // to these names, so a shape never changes under an existing name.
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

std::vector<const NamedConfig*> select_configs(const std::string& spec) {
  std::vector<const NamedConfig*> configs;
  if (spec == "all") {
    for (const NamedConfig& c : named_configs()) configs.push_back(&c);
  } else {
    for (const std::string& name : split_commas(spec)) configs.push_back(&require_config(name));
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
