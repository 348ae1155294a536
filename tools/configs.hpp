// docs/DESIGN.md's named benchmark configurations (T, d, n, E, K), shared by `moeblaze run` and the
// `moeblaze bench` commands so that every result row names its shape the same way.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "moeblaze/config.hpp"

namespace moeblaze::tools {

struct NamedConfig {
  const char* name;
  int64_t T, d, n, E, K;
  const char* source;  // where the shape comes from (paper table, model family)
};

// Every named config, in docs/DESIGN.md's order; the last one is the CLI's embedded default.
const std::vector<NamedConfig>& named_configs();

// The embedded default of `moeblaze run`: cpu-default (T=2048, d=256, n=512, E=16, K=4).
const NamedConfig& default_config();

// nullptr when `name` is not a named config.
const NamedConfig* find_config(const std::string& name);

// Throws InvalidArgument listing the valid names when `name` is unknown.
const NamedConfig& require_config(const std::string& name);

// A shape by name, "T<T>-d<d>-n<n>-E<E>-K<K>" (the name bench rows give a shape off the named
// configs), interned for the process's life; nullptr for a name of another form; InvalidArgument
// naming it for a dimension below 1 or K > E.
const NamedConfig* shape_config(const std::string& name);

// The configs a --config flag names: "all" (every named config, in DESIGN's order) or a comma list
// of names and shapes by name (InvalidArgument listing the valid names for an unknown one).
std::vector<const NamedConfig*> select_configs(const std::string& spec);

// "mb-conf1, mb-conf3, ..., cpu-default"
std::string config_names();

// The table printed by `--config list`.
void print_config_list(std::ostream& os);

// The layer shape of a named config with the given activation and storage dtype.
LayerConfig layer_config(const NamedConfig& c, Activation activation, DType dtype);

}  // namespace moeblaze::tools
